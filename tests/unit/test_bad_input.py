"""Every bad input gets one clear error naming the key or file and the fix, the documented exit code, early.

Issue 21, item 4. Subprocesses only where the behaviour is the real command line's (message and exit code); they
stop before any data or model is built, so none trains.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hlat import checkpoint
from hlat.config import ConfigError, TrackerConfig
from tests.conftest import backend_config, compose_cfg
from tests.timeouts import hang_guard

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.n_layers=1",
    "model.dim=64",
    "model.n_heads=4",
    "model.ffn_dim=128",
    "train.seq_len=32",
    "train.global_batch_size=2",
    "train.micro_batch_size=2",
    "train.steps=2",
    "optimizer.warmup_steps=1",
    "health=off",
]


def train_py(*args: str, cwd: Path, **extra_env: str) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` in ``cwd``; MLflow gets no retries, so a regression fails fast instead of hanging
    (the timeout is a hang guard only)."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env |= {"PYTHONPATH": str(ROOT / "src"), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}
    env |= extra_env
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_guard(600),
    )


def one_clean_error(r: subprocess.CompletedProcess, code: int = 2) -> str:
    """The ``hlat: ...`` line of a run that failed with ``code`` and no stack trace."""
    assert r.returncode == code, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("hlat: ")]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


# ------------------------------------------------------------------------------------ 1. damaged checkpoint manifests


def fake_checkpoint(root: Path, step: int, manifest: object | None = None) -> Path:
    """A checkpoint directory with one file and ``manifest`` (default: a correct one) as its manifest.json."""
    d = checkpoint.step_dir(root, step)
    d.mkdir(parents=True)
    (d / "w.bin").write_bytes(b"x" * 8)
    if manifest is None:
        manifest = {"step": step, "files": {"w.bin": {"size": 8, "sha256": checkpoint.sha256(d / "w.bin")}}}
    (d / checkpoint.MANIFEST).write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    return d


BAD_MANIFESTS = {
    "empty object": {},
    "list": [],
    "string": "checkpoint",
    "number": 3,
    "files is a list": {"step": 2, "files": ["w.bin"]},
    "size is a string": {"step": 2, "files": {"w.bin": "8"}},
    "sha256 is a number": {"step": 2, "files": {"w.bin": {"size": 8, "sha256": 5}}},
    "record without size": {"step": 2, "files": {"w.bin": {"sha256": "ab"}}},
    "step is a string": {"step": "2", "files": {"w.bin": 8}},
    "config is a list": {"step": 2, "files": {"w.bin": 8}, "config": []},
}


@pytest.mark.parametrize("bad", list(BAD_MANIFESTS), ids=list(BAD_MANIFESTS))
def test_a_manifest_of_the_wrong_shape_is_skipped_like_a_damaged_checkpoint(
    tmp_path: Path, caplog, bad: str, monkeypatch
) -> None:
    good = fake_checkpoint(tmp_path, 1)
    damaged = fake_checkpoint(tmp_path, 2, BAD_MANIFESTS[bad])
    assert checkpoint.manifest(damaged) is None
    with caplog.at_level("WARNING", logger="hlat.checkpoint"):
        assert checkpoint.find_resume("auto", tmp_path) == good
    assert f"skipping checkpoint {damaged}: manifest.json" in caplog.text
    assert checkpoint.newest_complete(tmp_path) == good  # what a "how to continue" message may name
    assert checkpoint.checkpoint_bytes(damaged) is None
    checkpoint.check_compatible(damaged, {"model": {"dim": 1}})  # nothing to compare, no crash
    with pytest.raises(ConfigError, match=r"train\.resume=.*step_00000002: this checkpoint is damaged .*parent"):
        checkpoint.resolve(str(damaged))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert checkpoint.find_resume(checkpoint.restart_resume("never", tmp_path), tmp_path) == good


def test_only_damaged_checkpoints_mean_a_fresh_start_and_no_continue_hint(tmp_path: Path) -> None:
    fake_checkpoint(tmp_path, 3, [])
    fake_checkpoint(tmp_path, 4, "{not json")
    assert checkpoint.find_resume("auto", tmp_path) is None
    assert checkpoint.newest_complete(tmp_path) is None
    assert checkpoint.find_resume("never", tmp_path) is None  # nothing valid to mix with


def test_a_failed_save_never_calls_a_damaged_checkpoint_intact(tmp_path: Path) -> None:
    import errno

    import torch

    from hlat.backends.torch.backend import TorchBackend

    fake_checkpoint(tmp_path, 1)
    fake_checkpoint(tmp_path, 2, {"files": "w.bin"})
    model = torch.nn.Linear(2, 2)
    backend = TorchBackend(backend_config())
    saver = checkpoint.Checkpointer(
        backend,
        tmp_path,
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda s: {},
        every=0,
        last_step=3,
        keep_last=0,
        async_save=False,
    )
    try:
        err = saver._failed(OSError(errno.ENOSPC, "No space left on device"), tmp_path / "step_00000003.tmp", 3)
    finally:
        saver.close()
    assert "the earlier checkpoints are intact (step_00000001)" in str(err)
    assert "step_00000002" not in str(err)


def test_a_job_record_of_the_wrong_shape_reads_as_none(tmp_path: Path) -> None:
    (tmp_path / checkpoint.JOB).write_text("[1, 2]")
    assert checkpoint.read_job(tmp_path) == {}


# ------------------------------------------------------------------------------------- 2. an unreachable tracker.uri


def spy_urlopen(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record the timeout of every ``urllib.request.urlopen`` call (which still goes through)."""
    import urllib.request

    timeouts: list[float] = []
    real = urllib.request.urlopen

    def urlopen(url, *args, timeout: float, **kwargs):
        timeouts.append(timeout)
        return real(url, *args, timeout=timeout, **kwargs)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return timeouts


def test_a_dead_tracking_server_is_named_in_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """One request bounded by a few seconds, not MLflow's minutes of retries (asserted by what the check asks for,
    not by a stopwatch: a busy machine must not fail this)."""
    from hlat.track.trackers import check_reachable

    timeouts = spy_urlopen(monkeypatch)
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(ConfigError) as e:
            check_reachable(TrackerConfig(uri=f"http://127.0.0.1:{port}"))
    assert timeouts == [3.0]  # one GET /health, given at most 3 s
    msg = str(e.value)
    assert f"tracker.uri=http://127.0.0.1:{port}" in msg and "nothing answers" in msg and "within 3 s" in msg
    assert "start the server" in msg and "fix tracker.uri" in msg and "tracker=console" in msg
    with pytest.raises(ConfigError) as e:  # a database server: a TCP connect (a password never gets this far:
        check_reachable(TrackerConfig(uri=f"postgresql://me@127.0.0.1:{port}/runs"))  # tests/unit/test_credentials.py)
    assert f"tracker.uri=postgresql://me@127.0.0.1:{port}/runs: nothing answers" in str(e.value)


def test_a_server_that_accepts_but_never_answers_is_named_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from hlat.track.trackers import check_reachable

    timeouts = spy_urlopen(monkeypatch)
    with socket.socket() as s:  # listening, never accepting: the connect succeeds, no HTTP answer comes
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ConfigError, match=r"tracker\.uri=.*: nothing answers at 127\.0\.0\.1:\d+ within 0\.5 s"):
            check_reachable(TrackerConfig(uri=f"http://127.0.0.1:{s.getsockname()[1]}"), timeout_s=0.5)
    assert timeouts == [0.5]  # one request, bounded by the timeout asked for


def test_a_postgresql_unix_socket_is_checked_where_libpq_would_connect(tmp_path: Path) -> None:
    """``postgresql://user@/db?host=<dir>``: a Unix socket in ``dir`` (scripts/mlflow-server.sh's PostgreSQL), not
    TCP to localhost."""
    from hlat.track.trackers import check_reachable

    uri = f"postgresql://mlflow@/runs?host={tmp_path}"
    with pytest.raises(ConfigError, match=f"nothing answers at {tmp_path}/.s.PGSQL.5432 within"):
        check_reachable(TrackerConfig(uri=uri))
    with socket.socket(socket.AF_UNIX) as s:  # a live socket where libpq looks: passes
        s.bind(str(tmp_path / ".s.PGSQL.5432"))
        s.listen()
        check_reachable(TrackerConfig(uri=uri))


def test_any_http_answer_and_other_ranks_pass(tmp_path: Path) -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from hlat.track.trackers import check_reachable

    server = HTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)  # answers every GET with 501: an answer
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        check_reachable(TrackerConfig(uri=f"http://127.0.0.1:{server.server_port}"))
    finally:
        server.shutdown()
        server.server_close()
    check_reachable(TrackerConfig(uri="http://127.0.0.1:9"), rank=1)  # only rank 0 tracks
    check_reachable(TrackerConfig(kind="console", uri="http://127.0.0.1:9"))
    check_reachable(TrackerConfig(uri=f"sqlite:///{tmp_path / 'mlflow.db'}"))
    check_reachable(TrackerConfig(uri=f"file://{tmp_path / 'not' / 'yet'}"))  # MLflow creates a file store


def test_a_local_store_that_cannot_be_written_is_named(tmp_path: Path) -> None:
    from hlat.track.trackers import check_reachable

    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=r"tracker\.uri=sqlite:///.*missing/m\.db: the directory .* does not exist"):
        check_reachable(TrackerConfig(uri=f"sqlite:///{tmp_path / 'missing' / 'm.db'}"))
    with pytest.raises(ConfigError, match=r"tracker\.uri=file://.*afile is a file, not a directory; fix tracker\.uri"):
        check_reachable(TrackerConfig(uri=f"file://{tmp_path / 'afile' / 'mlruns'}"))


def test_train_py_with_a_dead_tracker_fails_before_data_and_model(tmp_path: Path) -> None:
    # Fast by construction, not by a stopwatch: the pre-check's message (one bounded request, named above) ends the
    # run before MLflow is asked anything; MLflow's own retries (~279 s) would end with another message. The dead
    # store is MLflow's variable's (a team server in a shell profile): training honours it, and the error names it.
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    r = train_py(*TINY, cache, cwd=tmp_path, MLFLOW_TRACKING_URI="http://127.0.0.1:9")
    line = one_clean_error(r)
    assert line.startswith(
        "hlat: configuration error: MLFLOW_TRACKING_URI=http://127.0.0.1:9: nothing answers at 127.0.0.1:9 within 3 s"
    )
    assert "start the server" in line and "tracker=console" in line
    assert not (tmp_path / "cache").exists()  # no tokenizer trained, no corpus read


# ---------------------------------------------------------------------------------------------- 3. bad data files


@pytest.mark.parametrize("content", [os.urandom(4096), b""], ids=["random bytes", "empty file"])
def test_a_garbage_arrow_file_names_the_file_the_format_and_the_fix(tmp_path: Path, content: bytes) -> None:
    from hlat.data.sources import TextSource

    (tmp_path / "x.arrow").write_bytes(content)
    with pytest.raises(ConfigError) as e:
        TextSource(tmp_path / "x.arrow")
    msg = str(e.value)
    assert f"data.path: {tmp_path / 'x.arrow'} is not an Arrow IPC file or stream" in msg
    assert "Arrow's file or stream format" in msg and "give it that suffix (.parquet, .jsonl)" in msg
    assert "write it again" in msg and "point data.path at" in msg


def test_a_missing_path_and_an_empty_directory_are_named(tmp_path: Path) -> None:
    from hlat.data.sources import TextSource

    with pytest.raises(ConfigError, match=r"data\.path=.*nope does not exist; point data\.path at"):
        TextSource(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"data\.path=.*empty is a directory without any .* file; point data\.path"):
        TextSource(tmp_path / "empty")


def test_train_py_with_a_garbage_arrow_file_exits_2(tmp_path: Path) -> None:
    (tmp_path / "x.arrow").write_bytes(os.urandom(4096))
    r = train_py(f"data.path={tmp_path / 'x.arrow'}", "tracker=console", *TINY, cwd=tmp_path)
    line = one_clean_error(r)
    assert "x.arrow is not an Arrow IPC file or stream" in line and "hlat data prepare" in line


# ------------------------------------------------------------------------------- 4. run and checkpoint directories


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_run_dir_under_proc_is_a_configuration_error(tmp_path: Path) -> None:
    line = one_clean_error(train_py("hydra.run.dir=/proc/hlat", "tracker=console", *TINY, cwd=tmp_path))
    assert line.startswith(
        "hlat: configuration error: hydra.run.dir: cannot create or write the run directory /proc/hlat"
    )
    assert "set hydra.run.dir to a writable directory" in line


def test_an_unwritable_run_dir_in_a_container_says_which_uid_must_own_the_mount(tmp_path: Path, monkeypatch) -> None:
    import errno

    from hlat.config import compose

    denied = PermissionError(errno.EACCES, "Permission denied", "outputs/run")
    monkeypatch.setattr(compose, "CONTAINER_MARKERS", (str(tmp_path / ".containerenv"),))
    assert "uid" not in compose.hydra_error_message(denied)  # not in a container: no such hint
    (tmp_path / ".containerenv").touch()  # what podman creates in every container
    line = compose.hydra_error_message(denied)
    assert line.startswith("hydra.run.dir: cannot create or write the run directory outputs/run (Permission denied)")
    assert f"hlat runs as uid {os.getuid()}: a host folder mounted here must be writable by uid" in line


def test_a_checkpoint_dir_under_a_file_is_a_configuration_error(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    r = train_py(
        f"train.checkpoint_dir={tmp_path / 'afile' / 'ckpt'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        "tracker=console",
        *TINY,
        f"data.cache_dir={tmp_path / 'cache'}",
        cwd=tmp_path,
    )
    line = one_clean_error(r)
    assert f"train.checkpoint_dir={tmp_path / 'afile' / 'ckpt'}: {tmp_path / 'afile'} is a file" in line
    assert "set train.checkpoint_dir" in line and "to a writable directory" in line
    assert not (tmp_path / "cache").exists()


def test_check_writable_names_the_key(tmp_path: Path) -> None:
    assert checkpoint.check_writable(tmp_path / "not" / "yet") == tmp_path
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=r"train\.checkpoint_dir=.*f/c: .*f is a file, not a directory"):
        checkpoint.check_writable(tmp_path / "f" / "c")
    with pytest.raises(ConfigError, match=r"train\.checkpoint_dir=.*f/c: .*f is a file"):
        checkpoint.write_job(tmp_path / "f" / "c", {})


# --------------------------------------------------------------------- 5 and 6. misspelled keys: did you mean, exit 2

TYPOS = {
    "+modle=tiny": "modle is not a config key; did you mean model=tiny?",
    "modle=tiny": "modle is not a config key; did you mean model=tiny?",
    "train.max_steps=10": "train.max_steps is not a config key; did you mean train.steps=10?",
    "precison=bf16": "precison is not a config key; did you mean precision=bf16?",
    "model=tinny": "model=tinny: conf/model/ has no option 'tinny'; did you mean model=tiny?",
}


@pytest.mark.parametrize("typo", list(TYPOS))
def test_train_py_misspellings_say_did_you_mean_and_exit_2(tmp_path: Path, typo: str) -> None:
    line = one_clean_error(train_py(typo, "train.dry_run=true", cwd=tmp_path))
    assert line.startswith(f"hlat: configuration error: {TYPOS[typo]}")
    assert "--cfg job` prints every key" in line or "(options: 70b, 7b, small, tiny)" in line
    assert typo.startswith("+") or not (tmp_path / "outputs").exists()  # Hydra stops before the run directory


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trian.steps=3", "trian.steps is not a config key; did you mean train.steps=3?"),
        ("+train.max_step=3", "train.max_step is not a config key; did you mean train.steps=3?"),
        ("model=tinny", "did you mean model=tiny?"),
        (
            "train.steps=abc",
            "train.steps: Value 'abc' of type 'str' could not be converted to Integer; give train.steps",
        ),
        ("eval.tasks=[hlat_local_mc]", "e.g. eval.tasks=[{task:hlat_local_mc,num_fewshot:0}]"),
        ("train.steps=[", "cannot parse the override 'train.steps=['"),
    ],
)
def test_composition_errors_name_the_key_and_the_fix(override: str, expected: str) -> None:
    from hlat.config.compose import compose_run_config

    with pytest.raises(ConfigError) as e:
        compose_run_config([override])
    assert expected in str(e.value)


def test_the_schema_refuses_an_appended_key_with_a_suggestion() -> None:
    from hlat.config import to_run_config

    with pytest.raises(ConfigError, match=r"^modle is not a config key; did you mean model=tiny\?"):
        to_run_config(compose_cfg("+modle=tiny"))
    with pytest.raises(ConfigError, match=r"^train\.max_step is not a config key; did you mean train\.steps=7\?"):
        to_run_config(compose_cfg("+train.max_step=7"))


def test_the_readme_documents_exit_2_for_configuration_errors() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "exits 2" in readme and "did you mean" in readme


# ---------------------------------------------------------------------- 7. eval overrides reach along-training evals


def test_eval_tasks_from_the_command_line_reach_the_evaluation_along_training() -> None:
    from hlat.config import to_run_config
    from hlat.config.compose import compose_run_config
    from hlat.train.evals import scheduler as _eval_scheduler

    tasks = "eval.tasks=[{task:hlat_local_mc,num_fewshot:2}]"
    cfg = to_run_config(compose_cfg("eval=local", "eval.every_tokens=1024", tasks, "eval.limit=3", "tracker=console"))
    scheduler = _eval_scheduler(cfg, tokens_per_step=512, tokens_seen=0)
    assert scheduler is not None
    assert "eval=local" in scheduler.overrides and "eval.limit=3" in scheduler.overrides
    child = compose_run_config(["eval.checkpoint=/x", *scheduler.overrides])  # what `hlat eval` composes
    assert [(t.task, t.num_fewshot) for t in child.eval.tasks] == [("hlat_local_mc", 2)]
    assert (child.eval.limit, child.eval.batch_size, child.eval.device) == (3, cfg.eval.batch_size, None)
    preset = compose_run_config(
        [
            "eval.checkpoint=/x",
            *_eval_scheduler(to_run_config(compose_cfg("eval=local", "eval.every_tokens=1024")), 512, 0).overrides,
        ]
    )
    assert [t.task for t in preset.eval.tasks] == ["hlat_local"]


# ------------------------------------------------------------------------------------------------ 8. the hlat command


def test_an_unknown_hlat_command_lists_every_command(capsys) -> None:
    from hlat.cli import COMMANDS, main

    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "hlat: unknown command 'frobnicate'" in err
    assert all(c in err for c in COMMANDS) and len(COMMANDS) == 15
    with pytest.raises(SystemExit):
        main(["trian"])
    assert "did you mean `hlat train`?" in capsys.readouterr().err


def test_hlat_plan_names_the_nodes_option_and_its_type(capsys) -> None:
    from hlat.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", "--nodes", "abc"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "argument --nodes: expected comma-separated positive integers" in err and "'abc'" in err
