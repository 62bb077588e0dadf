"""``hlat eval``: run lm-evaluation-harness over checkpoints and put the scores where the training run is.

Scores go to MLflow as ``eval/<task>/<metric>`` at the checkpoint's step, in the training run when the store holds
it, with a table per checkpoint and a plot against tokens seen (the paper's Fig. 3) from the run's whole history.
Training starts this as a child process (:mod:`hlat.train.evals`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hlat import checkpoint
from hlat.checkpoint.weights import EXTRA
from hlat.config import ConfigError, EvalConfig, EvalTask, RunConfig
from hlat.eval.tasks import check_tasks

log = logging.getLogger(__name__)

LOCAL_PREFIX = "hlat_local"
"""hlat's own offline tasks (``src/hlat/eval/tasks/``): with only these, lm-eval's built-in task index is skipped."""


@dataclass(frozen=True)
class Score:
    """One metric of one task at one checkpoint."""

    task: str
    metric: str
    value: float
    stderr: float | None
    num_fewshot: int


def checkpoints_of(path: str, every: bool) -> list[Path]:
    """The checkpoints ``hlat eval`` evaluates: ``path`` itself, the newest valid one under it, or all valid ones.

    Raises:
        ConfigError: when there is no valid checkpoint there.
    """
    p = Path(path).expanduser()
    if checkpoint.manifest(p) is not None or not every:
        return [checkpoint.resolve(str(p), key="eval.checkpoint")]
    found = [d for d in sorted(p.glob("step_*")) if not checkpoint.problems(d)]
    if not found:
        raise ConfigError(f"eval.checkpoint={path}: no complete checkpoint there (step_* directories with manifests)")
    return found


def scores(results: dict[str, Any], task: EvalTask) -> list[Score]:
    """The numbers lm-eval reported for ``task``: its own metrics, or for a group without an aggregate its subtasks'."""
    table = {**results.get("results", {}), **results.get("groups", {})}
    row = table.get(task.task)
    if row is None:
        raise ConfigError(f"lm-eval returned no results for task {task.task!r} (got {sorted(table)[:10]}...)")
    out = []
    for key, value in row.items():
        metric, comma, filt = key.partition(",")
        if not comma or metric.endswith("_stderr") or not isinstance(value, int | float):
            continue  # alias, name, sample_len, stderr entries (read with their metric)
        name = metric if filt == "none" else f"{metric}_{filt}"
        err = row.get(f"{metric}_stderr,{filt}")
        out.append(
            Score(task.task, name, float(value), float(err) if isinstance(err, int | float) else None, task.num_fewshot)
        )
    if not out:  # a group that aggregates nothing: report its members
        for sub in results.get("group_subtasks", {}).get(task.task, []):
            out.extend(scores(results, EvalTask(task=sub, num_fewshot=task.num_fewshot)))
    return out


def run_scores(ckpt: Path, cfg: EvalConfig, device: str) -> list[Score]:
    """Evaluate one checkpoint on every task of ``cfg`` (one lm-eval call per distinct shot count)."""
    from hlat.eval.harness import evaluate

    by_shots: dict[int, list[EvalTask]] = {}
    for t in cfg.tasks:
        by_shots.setdefault(t.num_fewshot, []).append(t)
    out: list[Score] = []
    for shots, tasks in by_shots.items():
        names = [t.task for t in tasks]
        results = evaluate(
            ckpt,
            names,
            num_fewshot=shots,
            limit=cfg.limit,
            device=device,
            batch_size=cfg.batch_size,
            include_defaults=not all(n.startswith(LOCAL_PREFIX) for n in names),
        )
        for t in tasks:
            out.extend(scores(results, t))
    return out


def markdown(ckpt: Path, step: int, tokens: int, rows: list[Score]) -> str:
    """The scores of one checkpoint as a markdown table."""
    lines = [
        f"# {ckpt} (step {step:,}, {tokens:,} tokens)",
        "",
        "| task | shots | metric | value | stderr |",
        "|---|---|---|---|---|",
    ]
    for s in rows:
        err = f"{s.stderr:.4f}" if s.stderr is not None and math.isfinite(s.stderr) else ""
        lines.append(f"| {s.task} | {s.num_fewshot} | {s.metric} | {s.value:.4f} | {err} |")
    return "\n".join(lines) + "\n"


def metric_dict(rows: list[Score]) -> dict[str, float]:
    """``eval/<task>/<metric>`` (and ``_stderr``) -> value, for MLflow."""
    out = {}
    for s in rows:
        out[f"eval/{s.task}/{s.metric}"] = s.value
        if s.stderr is not None and math.isfinite(s.stderr):
            out[f"eval/{s.task}/{s.metric}_stderr"] = s.stderr
    return out


def tokens_at(meta: dict[str, Any]) -> int:
    """Training tokens seen at a checkpoint: its step x global batch x sequence length (from its manifest)."""
    t = meta.get("config", {}).get("train", {})
    return int(meta["step"]) * int(t.get("global_batch_size", 0)) * int(t.get("seq_len", 0))


@dataclass
class MlflowSink:
    """Where the scores go in MLflow: the training run when the store has it, else a run of their own."""

    uri: str
    experiment: str
    train_run_id: str | None
    _client: Any = field(default=None, init=False, repr=False)
    _run_id: str | None = field(default=None, init=False)

    def run_id(self, ckpt: Path) -> str:
        """The run to log into (created on first use when the training run is not in this store)."""
        from mlflow.exceptions import MlflowException

        from hlat.track.mlflow_store import open_client

        if self._run_id is not None:
            return self._run_id
        self._client = open_client(self.uri)
        if self.train_run_id:
            try:
                self._client.get_run(self.train_run_id)
                self._run_id = self.train_run_id
                return self._run_id
            except MlflowException:
                log.warning(
                    "training run %s is not in %s: logging the evaluation to a run of its own",
                    self.train_run_id,
                    self.uri,
                )
        from hlat.track.trackers import experiment_id

        exp_id = experiment_id(self._client, self.experiment)
        run = self._client.create_run(
            exp_id,
            run_name=f"eval-{ckpt.parent.parent.name}-{ckpt.name}",
            tags={"hlat.kind": "eval", "hlat.checkpoint": str(ckpt)},
        )
        self._run_id = run.info.run_id
        return self._run_id

    def close(self) -> None:
        """End the run this sink created (FINISHED); a training run it logged into is left as training left it."""
        if self._client is not None and self._run_id is not None and self._run_id != self.train_run_id:
            self._client.set_terminated(self._run_id)

    def log(self, ckpt: Path, step: int, tokens: int, rows: list[Score], table: Path) -> str:
        """Log one checkpoint's scores at its training step, and its table as an artifact; returns the run id."""
        import time

        from mlflow.entities import Metric

        run_id = self.run_id(ckpt)
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in metric_dict(rows).items()]
        metrics.append(Metric("eval/tokens_seen", float(tokens), now, step))
        self._client.log_batch(run_id, metrics=metrics)
        self._client.log_artifact(run_id, str(table), artifact_path="eval")
        return run_id

    def plot(self, out: Path, tokens_per_step: int) -> Path | None:
        """Every ``eval/`` metric of the run against tokens seen (Fig. 3 of the paper), logged as an artifact."""
        from hlat.track.plots import plot_eval_curves

        client, run_id = self._client, self._run_id
        if client is None or run_id is None:
            return None
        keys = sorted(
            k
            for k in client.get_run(run_id).data.metrics
            if k.startswith("eval/") and not k.endswith("_stderr") and k != "eval/tokens_seen"
        )
        series = {
            k[len("eval/") :]: [
                (m.step * tokens_per_step, m.value)
                for m in sorted(client.get_metric_history(run_id, k), key=lambda m: m.step)
            ]
            for k in keys
        }
        if not series:
            return None
        path = plot_eval_curves(series, out)
        client.log_artifact(run_id, str(path), artifact_path="plots")
        return path


def main(cfg: RunConfig) -> list[tuple[Path, list[Score]]]:
    """``hlat eval``: evaluate ``cfg.eval.checkpoint`` (or all of a run's checkpoints) on ``cfg.eval.tasks``.

    Raises:
        ConfigError: no checkpoint or tasks, a checkpoint of the neuron backend, no lm-eval, or an unknown task.
    """
    e = cfg.eval
    if not e.checkpoint:
        raise ConfigError("hlat eval needs a checkpoint: hlat eval checkpoint=<run>/checkpoints[/step_N] tasks=local")
    if not e.tasks:
        raise ConfigError(f"eval={e.name} has no tasks: choose tasks=local, hlat_suite or truthfulness")
    check_tasks([t.task for t in e.tasks], e.name, cfg.data.cache_dir)  # lm-eval and the task names, before any model
    ckpts = checkpoints_of(e.checkpoint, e.all_checkpoints)
    meta = checkpoint.manifest(ckpts[-1]) or {}
    trained = meta.get("config", {})
    device = e.device or ("cuda" if trained.get("cluster", {}).get("device") == "cuda" and _cuda() else "cpu")
    root = ckpts[-1].parent
    sink = None
    if cfg.tracker.kind == "mlflow":
        from hlat.track.mlflow_store import run_store_uri

        sink = MlflowSink(run_store_uri(cfg.tracker.uri), cfg.tracker.experiment, training_run_id(ckpts[-1]))
    out_dir = root / "eval"
    out_dir.mkdir(exist_ok=True)
    done = []
    for ckpt in ckpts:
        m = checkpoint.manifest(ckpt) or {}
        step, tokens = int(m.get("step", 0)), tokens_at(m)
        rows = run_scores(ckpt, e, device)
        table = out_dir / f"{e.name}_{ckpt.name}.md"
        table.write_text(markdown(ckpt, step, tokens, rows))
        print(table.read_text())
        if sink is not None:
            run_id = sink.log(ckpt, step, tokens, rows, table)
            log.info("logged %d metrics of %s to MLflow run %s", len(rows), ckpt.name, run_id)
        done.append((ckpt, rows))
    if sink is not None:
        per_step = tokens_at({**meta, "step": 1})
        plot = sink.plot(out_dir / f"{e.name}_curves.png", per_step)
        if plot is not None:
            print(f"curves: {plot}")
        sink.close()
    return done


def training_run_id(ckpt: Path) -> str | None:
    """The MLflow run that trained ``ckpt``: its job record, else the record the checkpoint carries itself.

    A converted or copied checkpoint has no ``job.json`` beside it; rank 0's extra holds the same run id.
    """
    job = checkpoint.read_job(ckpt.parent)
    if job.get("mlflow_run_id"):
        return job["mlflow_run_id"]
    extra = ckpt / EXTRA  # rank 0's
    if not extra.is_file():
        return None
    import torch

    saved = torch.load(extra, map_location="cpu", weights_only=True).get("job") or {}
    return saved.get("mlflow_run_id")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
