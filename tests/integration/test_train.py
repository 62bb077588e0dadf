"""End to end through run.main and the real command line."""

from __future__ import annotations

import contextlib
import io
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hlat.config import ConfigError
from hlat.train.run import main
from tests.conftest import backend_config, compose_cfg, lock_held_elsewhere, run_config
from tests.timeouts import hang_guard

ROOT = Path(__file__).resolve().parents[2]
SMALL_RUN = [
    "model.n_layers=2",
    "model.dim=128",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=352",
    "train.seq_len=64",
    "train.global_batch_size=16",
    "train.micro_batch_size=8",
    "train.steps=80",
    "train.log_every=10",
    "optimizer.lr=3e-3",
    "optimizer.min_lr=3e-4",
    "optimizer.warmup_steps=5",
    "health=off",  # no pre-flight check, watchdog or straggler report: load must not fail a test about training
]


def cli(*args: str, cwd: Path, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` in ``cwd``; ``timeout`` is a hang guard (default ``hang_guard(600)``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_guard(600) if timeout is None else timeout,
    )


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[Path, Any]:
    """One 80-step run with MLflow and every telemetry option on, shared by the two tests below (the options only
    measure: they change no number of the training)."""
    tmp = tmp_path_factory.mktemp("short-run")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        cfg = run_config(
            *SMALL_RUN,
            f"data.cache_dir={cache_dir}",
            "tracker.flush_every_s=0",
            "tracker.spike_window=4",
            "tracker.spike_threshold=0.02",
            "tracker.spike_summary_every=20",
            "cluster.peak_tflops=0.5",
            "cluster.price_per_hour=2.0",
            "tracker.layer_grad_norms_every=20",
        )
        return tmp, main(cfg, run_dir=tmp / "run")


def series(tmp_path: Path, key: str) -> dict[int, float]:
    """One metric of the short run's Parquet series (beside its checkpoints): step -> value."""
    from hlat.track.series import read_series, to_points

    steps, values = to_points(read_series(tmp_path / "run" / "checkpoints" / "series"), key)
    return dict(zip(steps.tolist(), values.tolist(), strict=True))


@pytest.mark.slow
def test_short_run_loss_falls_and_lands_in_mlflow(short_run: tuple[Path, Any]) -> None:
    from mlflow import MlflowClient

    tmp_path, result = short_run
    assert result.state is not None and result.state.step == 80
    assert result.state.tokens_seen == 80 * 16 * 64

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    loss_points = client.get_metric_history(run.info.run_id, "train/loss")
    loss = sorted((m.step, m.value) for m in loss_points)
    assert [s for s, _ in loss] == list(range(1, 81))  # every step, logged in batches
    assert loss[0][1] == pytest.approx(math.log(4096), abs=0.3)  # ~ln(vocab) at init
    # Single-batch losses are noisy (the last one ranges 6.3-6.7 over seeds): compare averages.
    first, last = [v for _, v in loss[:5]], [v for _, v in loss[-10:]]
    assert sum(last) / len(last) < sum(first) / len(first) - 1.5
    for key in (
        "train/grad_norm",
        "train/param_norm",
        "train/lr",
        "perf/tokens_per_s",
        "perf/step_time_s",
        "perf/data_wait_s",
        "data/documents_consumed",
        "data/padding_fraction",
        "data/producer_tokens_per_s",
    ):
        assert client.get_metric_history(run.info.run_id, key), key
    lr = series(tmp_path, "train/lr")  # every step in the Parquet series; MLflow keeps loss and grad norm per step
    assert lr[5] == pytest.approx(3e-3) and lr[80] < lr[40] < lr[5]
    assert set(series(tmp_path, "train/loss").items()) == {(m.step, m.value) for m in loss_points}
    assert run.data.params["model.dim"] == "128" and run.data.params["optimizer.beta2"] == "0.95"
    assert run.data.tags["backend"] == "torch"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "provenance.json", "training.png", "spikes.json"} <= artifacts
    assert (tmp_path / "run" / "config.yaml").read_text().count("dim: 128") == 1


@pytest.mark.slow
def test_telemetry_spikes_mfu_and_memory_land_in_mlflow(short_run: tuple[Path, Any]) -> None:
    """Spike metrics agree with a brute-force recomputation from the logged grad norms; MFU and cost are logged."""
    import json

    from mlflow import MlflowClient

    from tests.unit.test_telemetry import brute_force_spikes

    tmp_path, result = short_run
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    rid = result.mlflow_run_id

    def hist(key: str) -> dict[int, float]:
        return series(tmp_path, key)

    norms = [v for _, v in sorted(hist("train/grad_norm").items())]
    active, durations = brute_force_spikes(norms, 4, 0.02)
    logged = hist("spike/active")
    assert [bool(logged[s]) for s in range(5, 81)] == active[4:]  # detection starts after the window
    assert hist("spike/count")[80] == len(durations) > 0
    latest = client.get_run(rid).data.metrics  # the lean MLflow store still ends on the run's last values
    assert latest["spike/count"] == len(durations) and latest["perf/mfu"] == hist("perf/mfu")[80]
    summary = hist("spike/single_step_fraction")
    assert set(summary) == {20, 40, 60, 80}  # every spike_summary_every steps and at the end
    assert summary[80] == pytest.approx(durations.count(1) / len(durations))
    assert hist("spike/longest")[80] == max(durations)
    spikes = json.loads((tmp_path / "run" / "plots" / "spikes.json").read_text())
    assert spikes["count"] == len(durations)

    tokens_per_s, mfu = hist("perf/tokens_per_s"), hist("perf/mfu")
    assert set(mfu) == set(range(10, 81, 10))
    ftok = float(client.get_run(rid).data.params["perf.flops_per_token"])
    assert mfu[80] == pytest.approx(tokens_per_s[80] * ftok / 0.5e12)
    assert hist("perf/cost_per_4m_tokens")[80] == pytest.approx(2.0 * 4e6 / tokens_per_s[80] / 3600)
    assert 0.05 < hist("sys/peak_rss_gib")[80] < 20
    assert hist("perf/sequences_per_s")[80] == pytest.approx(tokens_per_s[80] / 64)
    # Per-layer gradient norms every 20 steps; their squares add up to the (pre-clip) global norm's square.
    layers = [k for k in client.get_run(rid).data.metrics if k.startswith("grad_norm/")]
    assert sorted(layers) == [
        "grad_norm/embed",
        "grad_norm/layers.0",
        "grad_norm/layers.1",
        "grad_norm/lm_head",
        "grad_norm/norm",
    ]
    for step in (20, 40, 60, 80):
        total = sum(hist(k)[step] ** 2 for k in layers)
        assert total == pytest.approx(hist("train/grad_norm")[step] ** 2, rel=1e-4)
    assert set(hist("grad_norm/layers.0")) == {20, 40, 60, 80}


def test_7b_is_refused_before_allocation(tmp_path: Path, monkeypatch) -> None:
    """In-process: the command line's exit 2 and one clean line for a ConfigError are test_bad_input.py's."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"model=7b needs about .* GiB") as e:
        main(run_config("model=7b"), run_dir=tmp_path)
    assert "model=tiny" in str(e.value)  # the way out
    assert not (tmp_path / "mlflow.db").exists()


def test_dry_run_prints_the_paper_recipe(tmp_path: Path, capsys) -> None:
    result = main(run_config("experiment=hlat_70b", "train.dry_run=true"), run_dir=tmp_path)
    out = capsys.readouterr().out
    assert result.state is None
    assert "68,976.6M parameters" in out and "1024 x 4096 = 4,194,304 tokens/step" in out


def test_cli_shows_override_and_rejects_typos(tmp_path: Path) -> None:
    """One process for ``--cfg job``; a typo through the command line (exit 2, did you mean) is test_bad_input.py's
    test_train_py_misspellings_say_did_you_mean_and_exit_2[modle=tiny], a bad value is refused naming its key."""
    from hlat.config import to_run_config

    shown = cli("optimizer.beta2=0.99", "--cfg", "job", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "beta2: 0.99" in shown.stdout
    with pytest.raises(ConfigError, match=r"model\.n_kv_heads"):
        to_run_config(compose_cfg("model.n_kv_heads=3"))


def test_hlat_summary_console_script(tmp_path: Path) -> None:
    from hlat.cli import main as hlat_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        hlat_main(["summary", "model=70b"])
    assert "model=70b: 68,976.6M parameters" in out.getvalue()
    assert not list(tmp_path.iterdir())  # a summary writes no run directory


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16_sr", "master_weights"])  # fp32: test_smoke.py, in the fast suite
def test_resume_continues_exactly(tmp_path: Path, cache_dir: Path, monkeypatch, precision: str) -> None:
    monkeypatch.chdir(tmp_path)
    # decay_steps pins the schedule, so the 3-step first leg sees the 6-step run's learning rates. Under bf16_sr the
    # rounding is reseeded per step and master_weights' fp32 copies come back as fp32: both resume bit-identically.
    common = [
        *SMALL_RUN,
        "train.steps=6",
        "train.log_every=1",
        "optimizer.warmup_steps=2",
        "optimizer.decay_steps=4",
        f"data.cache_dir={cache_dir}",
        "tracker=console",
        f"precision={precision}",
    ]
    full = main(run_config(*common), run_dir=tmp_path / "full").history.series("train/loss")
    main(run_config(*common, "train.steps=3"), run_dir=tmp_path / "first")
    assert (tmp_path / "first" / "checkpoints" / "step_00000003" / "manifest.json").is_file()
    resumed = main(
        run_config(*common, f"train.resume={tmp_path / 'first' / 'checkpoints'}"), run_dir=tmp_path / "second"
    ).history.series("train/loss")
    assert [s for s, _ in resumed] == [4, 5, 6]
    assert resumed == full[3:]


@pytest.mark.slow
def test_own_jsonl_data_with_a_trained_tokenizer(tmp_path: Path, monkeypatch) -> None:
    import json
    from pydoc_data.topics import topics

    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"body": text}) + "\n" for text in topics.values()))
    overrides = [
        *SMALL_RUN,
        "train.steps=4",
        "train.log_every=2",
        "optimizer.warmup_steps=1",
        "tracker=console",
        f"data.path={corpus}",
        "data.text_column=body",
        "model.vocab_size=512",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    result = main(run_config(*overrides), run_dir=tmp_path / "run")
    assert result.state is not None and result.state.step == 4
    assert list((tmp_path / "cache" / "tokenizers").glob("*.model"))  # trained on this data, cached
    assert result.history.series("train/loss")[0][1] == pytest.approx(math.log(512), abs=0.3)
    with pytest.raises(ConfigError, match=r"data\.text_column"):
        main(run_config(*overrides, "data.text_column=missing"), run_dir=tmp_path / "bad")


def test_precision_ablation_sweep_composes_every_arm(tmp_path: Path) -> None:
    r = cli(
        "-m",
        "--config-dir",
        str(ROOT / "sweeps"),
        "--config-name",
        "precision_ablation",
        "train.dry_run=true",
        f"hydra.sweep.dir={tmp_path}",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    summaries = [line for line in r.stdout.splitlines() if line.startswith("model=tiny")]
    assert [s.split("precision=")[1].split()[0] for s in summaries] == [
        "fp32",
        "bf16",
        "bf16_sr",
        "master_weights",
        "bf16_sr",
    ]
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "sweeps"), version_base="1.3"):  # as --cfg job composes it
        job = compose(
            config_name="precision_ablation",
            overrides=[f"hydra.searchpath=[file://{ROOT / 'conf'}]", "+precision_arm=bf16_sr_beta2_0.99"],
        )
    assert (job.precision.name, job.optimizer.beta2, job.train.steps) == ("bf16_sr", 0.99, 600)


@pytest.mark.slow
def test_resume_with_another_model_shape_fails_before_any_work(tmp_path: Path, cache_dir: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    common = [
        *SMALL_RUN,
        "train.steps=2",
        "optimizer.warmup_steps=1",
        f"data.cache_dir={cache_dir}",
        "tracker=console",
        "tracker.plots=false",
    ]
    main(run_config(*common), run_dir=tmp_path / "first")
    resume = f"train.resume={tmp_path / 'first' / 'checkpoints'}"
    with pytest.raises(ConfigError, match=r"cannot resume .*step_00000002: model\.dim=128 in the checkpoint but 64"):
        main(run_config(*common, "model.dim=64", resume), run_dir=tmp_path / "second")
    assert not (tmp_path / "second").exists()  # refused before the run directory, model or data were made


def test_a_second_trainer_into_a_live_runs_directory_is_refused_before_any_work(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = run_config(*SMALL_RUN, "tracker=console", f"data.cache_dir={tmp_path / 'cache'}")
    refused = pytest.raises(ConfigError, match=r"another process is training into .*run/checkpoints")
    with lock_held_elsewhere(tmp_path / "run" / "checkpoints"), refused:
        main(cfg, run_dir=tmp_path / "run")
    assert not (tmp_path / "cache").exists()  # refused before the data (corpus, tokenizer) was touched


@pytest.mark.slow
def test_activation_checkpointing_modes_train_identically(tmp_path: Path, cache_dir: Path) -> None:
    """Recomputation changes memory and time, never the numbers: the same losses, bit for bit, in every mode."""
    common = [
        *SMALL_RUN,
        "train.steps=3",
        "train.log_every=1",
        "optimizer.warmup_steps=1",
        "tracker=console",
        "tracker.plots=false",
        f"data.cache_dir={cache_dir}",
        "train.checkpoint_every=0",
    ]
    losses = {
        mode: main(
            run_config(*common, f"parallelism.activation_checkpointing={mode}"), run_dir=tmp_path / mode
        ).history.series("train/loss")
        for mode in ("none", "full", "selective")
    }
    assert losses["full"] == losses["none"] and losses["selective"] == losses["none"]
    # ... and the backend really applies it: the recomputing call sits where the mode says.
    from hlat.backends.torch.backend import TorchBackend
    from hlat.backends.torch.recompute import run_recomputed
    from hlat.config import ModelConfig, ParallelismConfig
    from hlat.parallel import ParallelDims

    for mode, recomputed in (("none", ()), ("full", ("block",)), ("selective", ("core",))):
        par = ParallelismConfig(activation_checkpointing=mode)
        m = TorchBackend(backend_config(model=ModelConfig(n_layers=1), parallelism=par)).build_model(
            ParallelDims(1, 1, 1, 1)
        )
        found = {"block": m.layers[0].run is run_recomputed, "core": m.layers[0].attn.core.run is run_recomputed}
        assert {k for k, v in found.items() if v} == set(recomputed), mode
