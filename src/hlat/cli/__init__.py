"""The ``hlat`` command: ``hlat train|summary [overrides]``, ``hlat data ...``, ``hlat launch|compile ...``.

``train`` and ``summary`` take Hydra overrides exactly like ``python train.py``; ``doctor`` is ``hlat doctor``.
The top layer: may import anything; nothing in hlat imports it.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hlat.config.compose import compose_run_config, config_dir, hydra_error_message

if TYPE_CHECKING:
    from omegaconf import DictConfig

COMMANDS = (
    "train",
    "summary",
    "plan",
    "data",
    "compare",
    "track",
    "doctor",
    "bench",
    "eval",
    "export",
    "import",
    "convert",
    "launch",
    "compile",
    "graphs",
)
"""Every ``hlat`` command, in the order USAGE lists them."""

USAGE = f"""usage: hlat {{{",".join(COMMANDS)}}} [args...]

train, summary, plan, doctor, eval, launch and compile take Hydra overrides (key=value, group=option), as
`python train.py` does.

commands:
  train     train as configured (same as `python train.py ...`)
  summary   validate, count parameters, estimate memory per rank, and exit: config only, no torch (train.dry_run)
  plan      memory per device, step time, MFU and cost per 4M tokens on the cluster, predicted without hardware:
            `hlat plan [overrides] [--nodes 4,8,16,32,64] [--json] [--paper]` (docs/planner.md)
  data      prepare data: `hlat data prepare INPUT... --output DIR`, `hlat data tokenizer --data PATH ...`
            (see `hlat data --help`)
  compare   compare MLflow runs: `hlat compare --experiment NAME | --runs ID... | --sweep DIR [--out DIR]`
  track     `hlat track sync PATH...`: send the metrics a run kept in its spool while the tracking server was away
            (PATH: a run's checkpoint directory or a spool file; docs/telemetry.md)
  doctor    pre-flight health check of the configured cluster: per rank, device, matmul TFLOP/s, all-reduce /
            all-gather bandwidth and latency; names the failing nodes; writes the report to outputs/doctor/
            (MLflow with --mlflow): `hlat doctor [--out FILE.md] [--mlflow] [overrides]` (docs/health.md)
  bench     `hlat bench peak`: measure this host's matmul peak FLOP/s (the CPU MFU denominator) and cache it
  eval      lm-evaluation-harness on checkpoints: `hlat eval checkpoint=PATH tasks=local|hlat_suite|truthfulness`
  export    `hlat export CHECKPOINT --out DIR`: the Hugging Face LLaMA layout (config.json, safetensors, tokenizer)
  import    `hlat import HF_DIR --out DIR`: a weights-only hlat checkpoint to start a run from (train.init_from)
  convert   `hlat convert SRC DST --to torch|neuron|hf`: between the backends' checkpoints and the Hugging Face
            layout, tensor by tensor, carrying the optimizer state where the target holds it (docs/evaluation.md)
  launch    render a cluster launch: `hlat launch --target torchrun|slurm|eks [--out DIR] [--image IMG] overrides...`
  compile   ahead-of-time Neuron compile of the run: `hlat compile [--steps N] [--target torchrun|slurm] [--run]
            overrides...`; of a sweep, one job per graph group: `hlat compile -m ...` (`hlat compile --help`)
  graphs    which sweep arms compile the same graphs on Trainium, traced on this CPU: `hlat graphs plan [-m]
            [--config-dir DIR --config-name NAME] overrides...`; `hlat graphs keys` (docs/trn1.md)
"""
# ConfigError messages of the shared data code name config keys; `hlat data tokenizer` names its flags.
_FLAG_NAMES = {
    "data.path": "--data",
    "data.text_column": "--text-column",
    "model.vocab_size": "--vocab-size",
    "data.tokenizer_type": "--type",
}


class _HydraRun:
    """State of :func:`run_hydra`: whether it set ``HYDRA_FULL_ERROR`` and whether the job has started."""

    owned = False
    started = False


def job_started() -> None:
    """First thing of a Hydra task function: errors from here on are the job's, reported by Hydra as before."""
    _HydraRun.started = True
    if _HydraRun.owned:
        os.environ.pop("HYDRA_FULL_ERROR", None)  # the job's processes (elastic workers, evaluations) inherit none
        _HydraRun.owned = False


def take_credentials(argv: list[str] | None = None) -> list[str]:
    """A tracking store's login off the command line and ``MLFLOW_TRACKING_URI``, into the variables MLflow reads.

    ``argv``: default ``sys.argv``, rewritten in place. Nothing hlat or Hydra writes from here on holds the login
    (:mod:`hlat.track.credentials`); one it cannot hand over exits 2 with the fix.
    """
    from hlat.config import ConfigError
    from hlat.track.credentials import adopt_arguments, adopt_environment

    try:
        adopt_environment()
        if argv is not None:
            return adopt_arguments(argv)
        sys.argv[1:] = adopt_arguments(sys.argv[1:])
        return sys.argv[1:]
    except ConfigError as e:
        print(f"hlat: configuration error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _refuse_credentials_in_launch_files(argv: list[str]) -> None:
    """``hlat launch|compile`` writes its overrides into the launch files: a tracking password there exits 2."""
    from hlat.track.credentials import KEYS, PASSWORD, USERNAME, has_credentials

    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key.lstrip("+~") in KEYS and has_credentials(value):
            print(
                f"hlat: configuration error: {key.lstrip('+~')} holds a user name and password, which the launch "
                f"files would record; give the URI without them and set {USERNAME} and {PASSWORD} in the job's "
                "environment (for eks: from a Kubernetes Secret)",
                file=sys.stderr,
            )
            raise SystemExit(2)


def run_hydra(app: Callable[[], Any], argv: Sequence[str] | None = None) -> Any:
    """Call the ``@hydra.main`` function ``app``: what Hydra rejects before the job starts exits 2 with one message.

    Hydra would print a stack trace and exit 1; until the task calls :func:`job_started`, ``HYDRA_FULL_ERROR=1``
    makes it raise instead, for :func:`hydra_error_message` to word. ``argv``: default ``sys.argv[1:]``.
    """
    take_credentials()  # before Hydra records the overrides (.hydra/overrides.yaml, hydra.yaml, config.yaml)
    argv = take_credentials(list(sys.argv[1:] if argv is None else argv))
    _HydraRun.started, _HydraRun.owned = False, "HYDRA_FULL_ERROR" not in os.environ
    if _HydraRun.owned:
        os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        return app()
    except Exception as e:
        message = None if _HydraRun.started else hydra_error_message(e, argv)
        if message is None:
            raise
        print(f"hlat: configuration error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        job_started()


def _hydra_train(argv: list[str]) -> None:
    """``hlat train``: ``python train.py`` under another name (its log file is still ``train.log``)."""
    import hydra

    from hlat.config import register_configs

    register_configs()

    @hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
    def task(cfg: DictConfig) -> None:
        job_started()
        from hlat.train.entry import entry  # torch and the trainer: only once the config composed

        entry(cfg)

    if not any(a.startswith("hydra.job.name=") for a in argv):
        argv = [*argv, "hydra.job.name=train"]  # else the task function's file (__init__.py) would name the log
    sys.argv = ["hlat", *argv]  # Hydra reads its overrides from sys.argv
    run_hydra(task, argv)


def _hydra_summary(argv: list[str]) -> None:
    """``hlat summary``: compose and validate as ``hlat train`` would, print ``plan.summary_text``; no run dir."""
    import hydra

    from hlat.config import ConfigError, register_configs, to_run_config
    from hlat.plan.memory import summary_text

    register_configs()

    @hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
    def task(cfg: DictConfig) -> None:
        job_started()
        try:
            print(summary_text(to_run_config(cfg)))
        except ConfigError as e:
            print(f"hlat: configuration error: {e}", file=sys.stderr)
            raise SystemExit(2) from None

    sys.argv = [
        "hlat",
        *argv,
        "train.dry_run=true",
        "hydra.output_subdir=null",
        "hydra/job_logging=none",
        "hydra.run.dir=.",
        "hydra.job.name=summary",
    ]
    run_hydra(task, argv)


def data_parser() -> argparse.ArgumentParser:
    """The ``hlat data`` parser with its ``prepare`` and ``tokenizer`` subcommands."""
    parser = argparse.ArgumentParser(prog="hlat data", description="Prepare training data for data.path.")
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="{prepare,tokenizer}")
    prep = sub.add_parser(
        "prepare",
        help="convert JSONL/Parquet/Arrow/.txt files into Arrow IPC shards for data.path",
        description="Convert JSONL, Parquet, Arrow and .txt files (or directories of them) into memory-mappable "
        "Arrow IPC shards DIR/shard-00000.arrow, ... with one 'text' column; then train with data.path=DIR. "
        "Null, blank, non-string and invalid UTF-8 rows are counted and skipped.",
    )
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help="input files or directories")
    prep.add_argument("--output", required=True, metavar="DIR", help="output directory (must not hold shards yet)")
    prep.add_argument("--text-column", default="text", help="column / JSON key of the documents (default: text)")
    prep.add_argument("--shard-rows", type=int, default=100_000, help="documents per shard (default: 100000)")
    prep.add_argument("--lines", action="store_true", help=".txt inputs hold one document per non-blank line")
    tok = sub.add_parser(
        "tokenizer",
        help="train a sentencepiece tokenizer (the project's LLaMA-style recipe) for data.tokenizer",
        description="Train a sentencepiece model on the documents of --data (the recipe a run with data.tokenizer=null "
        "uses) and copy it to --output; then train with data.tokenizer=FILE.model.",
    )
    tok.add_argument("--data", required=True, metavar="PATH", help="Arrow/Parquet/JSONL file or directory")
    tok.add_argument("--text-column", default="text", help="column / JSON key of the documents (default: text)")
    tok.add_argument("--vocab-size", type=int, required=True, metavar="N", help="number of pieces (model.vocab_size)")
    tok.add_argument("--type", choices=["bpe", "unigram"], default="bpe", help="model type (default: bpe)")
    tok.add_argument("--output", required=True, metavar="FILE.model", help="where to write the model")
    tok.add_argument("--cache-dir", default="~/.cache/hlat", help="tokenizer cache (data.cache_dir)")
    return parser


def _data(argv: list[str]) -> None:
    from hlat.config import ConfigError
    from hlat.logs import console_logging

    args = data_parser().parse_args(argv)
    console_logging("%(message)s")
    try:
        if args.data_command == "prepare":
            from hlat.data.prepare import prepare

            report = prepare(
                args.inputs, args.output, text_column=args.text_column, shard_rows=args.shard_rows, lines=args.lines
            )
            print(f"{report.summary()} -> {Path(args.output).expanduser()}")
            return
        from hlat.data.prepare import train_tokenizer

        start = time.perf_counter()
        tok = train_tokenizer(
            args.data,
            args.output,
            vocab_size=args.vocab_size,
            model_type=args.type,
            text_column=args.text_column,
            cache_dir=args.cache_dir,
        )
        print(f"{tok.vocab_size}-piece {args.type} tokenizer in {time.perf_counter() - start:.1f}s -> {tok.path}")
    except ConfigError as err:
        msg = str(err)
        if args.data_command == "tokenizer":
            for key, flag in _FLAG_NAMES.items():
                msg = msg.replace(key, flag)
        print(f"hlat: error: {msg}", file=sys.stderr)
        raise SystemExit(2) from None


EVAL_USAGE = """hlat eval checkpoint=PATH [tasks=local|hlat_suite|truthfulness] [all_checkpoints=true] [overrides...]

Evaluate an hlat checkpoint (a step_N directory, or a run's checkpoints/ directory: its newest valid checkpoint,
or every one with all_checkpoints=true) with lm-evaluation-harness. Scores go to a markdown table next to the
checkpoints and to MLflow (the training run when the store holds it), with a curve per metric against tokens seen.
The MLflow store: tracker.uri=... given here, else MLFLOW_TRACKING_URI, else tracker.uri of conf/, else ./mlflow.db.
Other overrides: eval.limit=N (smoke tests), eval.batch_size, eval.device=cpu|cuda, tracker=console (no MLflow,
no curves).
"""
_EVAL_ALIASES = {"checkpoint": "eval.checkpoint", "all_checkpoints": "eval.all_checkpoints", "tasks": "eval"}


def _eval(argv: list[str]) -> int:
    """``hlat eval``: compose conf/ with the eval overrides (``checkpoint=``, ``tasks=`` as shorthands) and run."""
    if not argv or argv[0] in ("-h", "--help"):
        print(EVAL_USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    from hlat.config import ConfigError

    overrides = []
    for a in argv:
        key, eq, value = a.partition("=")
        overrides.append(f"{_EVAL_ALIASES[key]}={value}" if eq and key in _EVAL_ALIASES else a)
    if not any(o.startswith("eval=") for o in overrides):
        overrides.insert(0, "eval=local")
    from hlat.logs import console_logging

    console_logging("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    try:
        from hlat.eval.run import main as eval_main

        cfg = compose_run_config(overrides)
        if cfg.tracker.kind == "mlflow":
            import dataclasses

            from hlat.track.mlflow_store import command_tracker

            tracker, store = command_tracker(cfg.tracker, overrides)
            print(store.line("hlat eval"), file=sys.stderr)
            cfg = dataclasses.replace(cfg, tracker=tracker)
        eval_main(cfg)
    except ConfigError as e:
        print(f"hlat: configuration error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``hlat`` console script."""
    from hlat.logs import route_library_logs

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("launch", "compile"):
        _refuse_credentials_in_launch_files(argv)
    argv = take_credentials(argv)
    route_library_logs()  # mlflow's INFO chatter: to the run's log file (or nowhere), never the console
    if argv and argv[0] == "data":  # before the top-level parser, which would answer `hlat data --help` itself
        _data(argv[1:])
        return
    if argv and argv[0] == "compare":
        from hlat.track.compare import main as compare_main

        raise SystemExit(compare_main(argv[1:]))
    if argv and argv[0] == "track":
        from hlat.track.spool import main as track_main

        raise SystemExit(track_main(argv[1:]))
    if argv and argv[0] in ("launch", "compile"):
        from hlat.deploy.commands import main as deploy_main

        raise SystemExit(deploy_main(argv))
    if argv and argv[0] in ("export", "import", "convert"):
        from hlat.eval.hf import main as hf_main

        raise SystemExit(hf_main(argv))
    if argv and argv[0] == "eval":
        raise SystemExit(_eval(argv[1:]))
    if argv and argv[0] == "doctor":
        from hlat.cli.doctor import main as doctor_main

        raise SystemExit(doctor_main(argv[1:]))
    if argv and argv[0] == "graphs":
        from hlat.plan.graphs_command import main as graphs_main

        raise SystemExit(graphs_main(argv[1:]))
    if argv and argv[0] == "plan":
        from hlat.plan.command import main as plan_main

        raise SystemExit(plan_main(argv[1:]))
    if argv and argv[0] == "bench":
        if argv[1:2] != ["peak"]:
            print("hlat: usage: hlat bench peak [--cache-dir DIR] [--size N] [--seconds S]", file=sys.stderr)
            raise SystemExit(2)
        from hlat.plan.peak import main as peak_main

        raise SystemExit(peak_main(argv[2:]))
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    if argv[0] not in COMMANDS:
        near = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f" (did you mean `hlat {near[0]}`?)" if near else ""
        print(
            f"hlat: unknown command {argv[0]!r}{hint}. The commands are: {', '.join(COMMANDS)} "
            "(`hlat --help` says what each does)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if argv[0] == "summary":
        _hydra_summary(argv[1:])
        return
    _hydra_train(argv[1:])
