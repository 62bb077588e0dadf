"""Quiet, honest output: library chatter off the console, plain progress lines in a log file, the MFU hint once per
host, ``hlat doctor``'s report file, ``hlat --help``'s usage line, and config-only commands that import no torch."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hlat import cli, logs, sizing
from hlat.config import ModelConfig, to_run_config
from hlat.model import count_params as count_on_meta
from hlat.plan import peak
from hlat.track.progress import ProgressBar
from tests.conftest import CONF, compose_cfg
from tests.timeouts import hang_guard

HEAVY = ("torch", "mlflow", "matplotlib", "pandas", "transformers")


def _record(name: str, level: int) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, "message", None, None)


def test_the_console_filter_drops_library_info_and_keeps_their_warnings_and_ours() -> None:
    quiet = logs.LibraryFilter()
    assert not quiet.filter(_record("mlflow.store.db.utils", logging.INFO))  # "Creating initial MLflow database..."
    assert not quiet.filter(_record("alembic.runtime.migration", logging.INFO))  # "Context impl SQLiteImpl"
    assert not quiet.filter(_record("mlflow.system_metrics.system_metrics_monitor", logging.INFO))
    assert quiet.filter(_record("mlflow.tracking", logging.WARNING))
    assert quiet.filter(_record("hlat.train.run", logging.INFO))
    assert quiet.filter(_record("mlflowish", logging.INFO))  # a prefix of a name is not the library


def test_mlflow_records_reach_the_log_file_but_not_the_console(tmp_path: Path) -> None:
    """Hydra's job logging (conf/hydra/job_logging/hlat.yaml) with mlflow imported after it, as a run does."""
    code = f"""
import logging.config, sys, yaml
cfg = yaml.safe_load(open({str(CONF / "hydra/job_logging/hlat.yaml")!r}))
cfg["handlers"]["console"]["level"] = "INFO"
cfg["handlers"]["file"]["filename"] = {str(tmp_path / "train.log")!r}
logging.config.dictConfig(cfg)
import mlflow
logging.getLogger("mlflow.store.db.utils").info("Creating initial MLflow database tables...")
logging.getLogger("mlflow.tracking").warning("a warning of mlflow")
logging.getLogger("hlat.train.run").info("a line of ours")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=hang_guard(600))
    assert r.returncode == 0, r.stderr
    console = r.stdout + r.stderr
    assert "Creating initial MLflow" not in console
    assert "a warning of mlflow" in console and "a line of ours" in console
    assert "Creating initial MLflow database tables" in (tmp_path / "train.log").read_text()


def test_plain_progress_prints_a_line_every_n_steps() -> None:
    out, now = io.StringIO(), [100.0]
    bar = ProgressBar(total=200, every=40, stream=out, clock=lambda: now[0])
    assert bar.plain and bar.bar is None  # a StringIO is no terminal
    for step in range(1, 201):
        now[0] += 0.5
        if step % 10 == 0:
            bar.log_metrics([(step, {"train/loss": 9.0 - step / 100, "perf/tokens_per_s": 2480.0})])
        bar(SimpleNamespace(step=step), None)
    lines = out.getvalue().splitlines()
    assert len(lines) == 5 and all(line.startswith("step ") for line in lines)
    assert lines[0] == "step 40/200 loss 8.600 2,480 tok/s eta 1m20s"  # 0.5 s a step, 160 steps to go
    assert lines[-1] == "step 200/200 loss 7.000 2,480 tok/s"
    bar.finish()


def test_progress_on_a_terminal_is_the_bar() -> None:
    bar = ProgressBar(total=10, every=2, stream=io.StringIO(), plain=False)
    bar(SimpleNamespace(step=4), None)
    assert bar.bar is not None and bar.bar.n == 4
    bar.finish()


def test_progress_every_is_a_validated_config_field() -> None:
    from hlat.config import ConfigError, TrainConfig

    assert TrainConfig().progress_every is None  # null: every train.log_every steps
    assert to_run_config(compose_cfg("train.progress_every=50")).train.progress_every == 50
    with pytest.raises(ConfigError, match=r"train\.progress_every"):
        TrainConfig(progress_every=0)


def test_the_mfu_hint_is_given_once_per_host(tmp_path: Path) -> None:
    text = "this CPU's float32 matmul peak is not measured yet: run `hlat bench peak` once to get MFU"
    assert peak.first_hint(text, tmp_path)
    assert not peak.first_hint(text, tmp_path)  # the next run of this host: silent
    assert peak.first_hint("another hint", tmp_path)  # a different hint is new
    assert any(p.name.startswith(peak.cache_path(tmp_path).stem) for p in tmp_path.iterdir())  # next to the cache


def test_doctor_flags_are_split_from_the_overrides() -> None:
    from hlat.cli.doctor import _flags

    assert _flags(["cluster=cpu", "--mlflow", "--out", "r.md"]) == (["cluster=cpu"], Path("r.md"), True, None)
    assert _flags(["--out=x/y.md", "health=off", "--manifest", "m.json"]) == (
        ["health=off"],
        Path("x/y.md"),
        False,
        Path("m.json"),
    )
    with pytest.raises(ValueError, match="unknown option"):
        _flags(["--mlfow"])


def test_doctor_help_names_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from hlat.cli.doctor import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--mlflow" in out and "--out FILE.md" in out and "outputs/doctor/" in out


def test_the_usage_line_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    usage = out.splitlines()[0]
    assert usage == f"usage: hlat {{{','.join(cli.COMMANDS)}}} [args...]"
    listed = re.findall(r"^  (\w+) ", out.split("commands:")[1], flags=re.MULTILINE)
    assert tuple(listed) == cli.COMMANDS  # the list below says the same


ODD = [
    dict(dim=96, n_layers=3, n_heads=6, n_kv_heads=2, ffn_dim=100, vocab_size=1000),  # GQA, odd widths
    dict(dim=64, n_layers=1, n_heads=1, ffn_dim=7, vocab_size=3),  # one head, tiny vocab
    dict(dim=128, n_layers=2, n_heads=8, n_kv_heads=1, ffn_dim=352, vocab_size=32_001),  # MQA
]


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF / "model").glob("*.yaml")))
def test_the_analytic_count_is_the_meta_device_count_of_every_preset(preset: str) -> None:
    m = to_run_config(compose_cfg(f"model={preset}")).model
    assert sizing.count_params(m) == count_on_meta(m)


@pytest.mark.parametrize("shape", ODD)
def test_the_analytic_count_is_the_meta_device_count_of_odd_shapes(shape: dict) -> None:
    m = ModelConfig(name="odd", max_seq_len=64, **shape)
    assert sizing.count_params(m) == count_on_meta(m)


def _imported_by(*argv: str, cwd: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``hlat *argv`` in a fresh interpreter; which of HEAVY were imported when it exited."""
    code = f"""
import json, sys
try:
    from hlat.cli import main
    main({list(argv)!r})
except SystemExit as e:
    assert not e.code, e.code
finally:
    print("HEAVY=" + json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=hang_guard(900))
    line = next((x for x in r.stdout.splitlines() if x.startswith("HEAVY=")), None)
    assert r.returncode == 0 and line, r.stdout[-2000:] + r.stderr[-2000:]
    return r, set(json.loads(line.removeprefix("HEAVY=")))


@pytest.mark.parametrize(
    "argv",
    [
        ("summary", "model=70b"),
        ("plan",),
        ("plan", "experiment=hlat_7b", "cluster=trn1_x4", "parallelism=hlat_7b", "--nodes", "4,8"),
    ],
)
def test_config_only_commands_import_no_torch_mlflow_or_plotting(argv: tuple[str, ...], tmp_path: Path) -> None:
    r, heavy = _imported_by(*argv, cwd=tmp_path)
    assert heavy == set(), f"hlat {' '.join(argv)} imported {heavy}"
    if argv[0] == "summary":
        assert "model=70b: 68,976.6M parameters" in r.stdout  # the meta-device count (test_model.py), by arithmetic
        assert list(tmp_path.iterdir()) == []  # a summary leaves no run directory
