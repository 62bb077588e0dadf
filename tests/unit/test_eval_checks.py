"""Evaluation is checked before training (issue 33): lm-eval and the task names are resolved before any data or model
is built, a missing lm-eval names the extra to install, and a failed evaluation along training fails the run unless
``eval.on_error=warn``.

The end-to-end failure of a run (exit code, MLflow status) is in tests/integration/test_eval_run.py (slow).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hlat.config import ConfigError, to_run_config
from hlat.train import evals
from tests.conftest import compose_cfg
from tests.timeouts import hang_guard
from tests.unit.test_bad_input import ROOT, TINY, one_clean_error

NO_LM_EVAL = '''
import sys


class NoLmEval:
    """As if lm-evaluation-harness were not installed: importing it fails as Python's import system would."""

    def find_spec(self, name, path=None, target=None):
        if name == "lm_eval" or name.startswith("lm_eval."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoLmEval())
'''
"""A ``sitecustomize`` that every Python started with it on its path (the trainer and its children) runs first."""
INSTALL_HINT = 'pip install -c constraints.txt -e ".[eval]" (in a checkout: make install-eval)'


def run(
    args: list[str], cwd: Path, pythonpath: list[Path] = (), env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python ARGS`` in ``cwd`` with hlat's source (after ``pythonpath``) on the path, and ``env`` set."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | (env or {})
    env["PYTHONPATH"] = os.pathsep.join(map(str, [*pythonpath, ROOT / "src"]))
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=hang_guard(600)
    )


@pytest.fixture(scope="session")
def names_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding only the cached index of lm-eval's built-in task names (built once, ~10 s)."""
    pytest.importorskip("lm_eval")
    from hlat.eval.tasks import builtin_tasks

    cache = tmp_path_factory.mktemp("lm-eval-names")
    builtin_tasks(cache)
    assert [p.name for p in cache.iterdir()] == ["lm_eval_tasks.json"]
    return cache


# ------------------------------------------------------------------------------------ resolving the task names


def test_hlat_tasks_need_no_index_of_lm_evals_own(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    from hlat.eval.tasks import check_tasks

    check_tasks(["hlat_local", "hlat_local_mc", "hlat_local_ppl", "hlat_local_gen"], "local", tmp_path)
    assert not list(tmp_path.iterdir())  # lm-eval's ~15k names were never indexed: the local check stays cheap


def test_unknown_names_get_the_closest_known_ones_and_how_to_list_them(names_cache: Path) -> None:
    from hlat.eval.tasks import check_tasks

    check_tasks(["arc_easy", "hlat_local", "mmlu"], "hlat_suite", names_cache)  # built-in names and hlat's
    with pytest.raises(ConfigError) as e:
        check_tasks(["hlat_local", "hlat_local_mcc"], "local", names_cache)
    assert str(e.value) == (
        "eval.tasks: lm-eval knows no task, group or tag named 'hlat_local_mcc' (did you mean hlat_local_mc, "
        "hlat_local, hlat_local_ppl?) in eval=local; fix eval.tasks (`python -m hlat.eval.harness ls tasks` lists "
        "every name)"
    )
    with pytest.raises(ConfigError, match=r"named 'hellaswg' \(did you mean hellaswag,.*\) in eval=hlat_suite"):
        check_tasks(["hellaswg"], "hlat_suite", names_cache)
    with pytest.raises(ConfigError, match=r"named 'no_such_task' in eval=local; fix eval\.tasks"):
        check_tasks(["no_such_task"], "local", names_cache)  # nothing close: no guess


def test_the_cached_names_are_used_until_lm_evals_task_files_change(
    names_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lm_eval.tasks

    from hlat.eval.tasks import _fingerprint, builtin_tasks

    shutil.copy(names_cache / "lm_eval_tasks.json", tmp_path)
    real = set(json.loads((tmp_path / "lm_eval_tasks.json").read_text())["names"])
    indexed: list[bool] = []

    class Indexing:  # what a (re)index would find; records that one happened
        def __init__(self, include_defaults: bool = False, **_: object) -> None:
            indexed.append(include_defaults)
            self.all_tasks = ["only_this_one"]

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Indexing)
    assert builtin_tasks(tmp_path) == real and not indexed  # a valid cache: no index
    stale = json.loads((tmp_path / "lm_eval_tasks.json").read_text()) | {"fingerprint": "another lm-eval"}
    (tmp_path / "lm_eval_tasks.json").write_text(json.dumps(stale))
    assert builtin_tasks(tmp_path) == {"only_this_one"} and indexed == [True]  # stale: indexed again, and cached
    assert builtin_tasks(tmp_path) == {"only_this_one"} and indexed == [True]
    (tmp_path / "lm_eval_tasks.json").write_text("not json")
    assert builtin_tasks(tmp_path) == {"only_this_one"} and indexed == [True, True]

    tasks = tmp_path / "tasks"
    (tasks / "a").mkdir(parents=True)
    (tasks / "a" / "t.yaml").write_text("task: t\n")
    before = _fingerprint(tasks)
    (tasks / "notes.txt").write_text("not a task")
    assert _fingerprint(tasks) == before
    (tasks / "a" / "t.yaml").write_text("task: t2\n")  # an edited task
    assert _fingerprint(tasks) != before
    edited = _fingerprint(tasks)
    (tasks / "a" / "u.yml").write_text("task: u\n")  # a new one
    assert _fingerprint(tasks) != edited


# ------------------------------------------------------------------ python train.py and hlat eval: exit 2, early


def test_train_py_with_a_misspelled_task_exits_2_before_anything_is_built(tmp_path: Path, names_cache: Path) -> None:
    data_cache = tmp_path / "cache"
    shutil.copytree(names_cache, data_cache)
    tiny = [o for o in TINY if not o.startswith("train.steps=")]
    r = run(
        [
            str(ROOT / "train.py"),
            "train.steps=6",
            "eval=local",
            "eval.tasks=[{task: no_such_task, num_fewshot: 0}]",
            "eval.every_tokens=1000",
            *tiny,
            f"data.cache_dir={data_cache}",
        ],
        cwd=tmp_path,
    )
    assert one_clean_error(r) == (
        "hlat: configuration error: eval.tasks: lm-eval knows no task, group or tag named 'no_such_task' in "
        "eval=local; fix eval.tasks (`python -m hlat.eval.harness ls tasks` lists every name)"
    )
    assert [p.name for p in data_cache.iterdir()] == ["lm_eval_tasks.json"]  # no corpus read, no tokenizer trained
    assert not (tmp_path / "mlflow.db").exists()  # no MLflow run
    assert not list(tmp_path.glob("outputs/*/*/checkpoints"))


def test_hlat_eval_checks_the_tasks_before_the_checkpoint(tmp_path: Path, names_cache: Path, capsys) -> None:
    from hlat.cli import main as cli_main

    with pytest.raises(SystemExit) as e:
        cli_main(
            [
                "eval",
                f"checkpoint={tmp_path / 'nothing'}",
                "eval.tasks=[{task:hlat_local_mcc,num_fewshot:0}]",
                f"data.cache_dir={names_cache}",
                "tracker=console",
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and "'hlat_local_mcc' (did you mean hlat_local_mc" in err, err
    assert "no complete checkpoint" not in err


def test_without_lm_eval_training_and_hlat_eval_name_the_extra(tmp_path: Path) -> None:
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(NO_LM_EVAL)
    expected = (
        "hlat: configuration error: eval=local needs lm-evaluation-harness (the eval extra), which this "
        f"Python cannot import (No module named 'lm_eval'): {INSTALL_HINT}"
    )
    r = run(
        [
            str(ROOT / "train.py"),
            "eval=local",
            "eval.every_tokens=1000",
            "tracker=console",
            *TINY,
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        cwd=tmp_path,
        pythonpath=[blocker],
    )
    assert one_clean_error(r) == expected
    assert not (tmp_path / "cache").exists()
    r = run(
        ["-m", "hlat.cli", "eval", f"checkpoint={tmp_path / 'nothing'}", "tasks=local", "tracker=console"],
        cwd=tmp_path,
        pythonpath=[blocker],
    )
    assert one_clean_error(r) == expected
    # A dry run plans a cluster's run where lm-eval may be missing: it is not asked for.
    r = run(
        [str(ROOT / "train.py"), "eval=local", "eval.every_tokens=1000", "train.dry_run=true"],
        cwd=tmp_path,
        pythonpath=[blocker],
    )
    assert r.returncode == 0, r.stderr[-3000:]


# ------------------------------------------------------------------------- a failed evaluation along training


def test_eval_on_error_is_fail_or_warn() -> None:
    from hlat.config.compose import compose_run_config

    assert compose_run_config([]).eval.on_error == "fail"
    with pytest.raises(ConfigError, match=r"eval\.on_error='ignore' is not one of \['fail', 'warn'\]"):
        compose_run_config(["eval.on_error=ignore"])


def failing_evaluations(tmp_path: Path, *overrides: str) -> tuple[evals.EvalScheduler, Path]:
    """A scheduler whose evaluations fail for real: ``hlat eval`` on directories that are not checkpoints."""
    cfg = to_run_config(compose_cfg("eval=local", "eval.every_tokens=64", "tracker=console", *overrides))
    scheduler = evals.scheduler(cfg, tokens_per_step=64, tokens_seen=0)
    assert scheduler is not None
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        (root / f"step_{step:08d}").mkdir(parents=True)
    return scheduler, root


def test_a_failed_evaluation_is_reported_at_the_next_checkpoint_and_fails_the_end(tmp_path: Path, caplog) -> None:
    scheduler, root = failing_evaluations(tmp_path)
    caplog.set_level(logging.INFO, logger="hlat.train.evals")
    scheduler(root / "step_00000001", 1)
    scheduler.procs[0][0].wait()
    scheduler(root / "step_00000002", 2)  # the next checkpoint: the first evaluation's failure is logged now
    early = [r for r in caplog.records if "the evaluation of step_00000001 failed (exit 2" in r.getMessage()]
    assert len(early) == 1 and early[0].levelno == logging.ERROR
    with pytest.raises(evals.EvalFailedError) as e:
        scheduler.finish()
    msg = str(e.value)
    first_log = root / "eval" / "local_step_00000001.log"
    last_line = first_log.read_text().strip().splitlines()[-1]
    assert last_line.startswith("hlat: configuration error: ")  # what the child said
    assert msg.startswith(
        f"the evaluation along training of step_00000001 (exit 2), step_00000002 (exit 2) failed; "
        f"{first_log}: {last_line}. Training finished and its checkpoints are kept"
    )
    assert f"`hlat eval checkpoint={root} all_checkpoints=true eval=local " in msg
    assert msg.endswith("or set eval.on_error=warn to only warn when an evaluation fails")
    assert not scheduler.procs


def test_with_on_error_warn_a_failed_evaluation_only_warns(tmp_path: Path, caplog) -> None:
    scheduler, root = failing_evaluations(tmp_path, "eval.on_error=warn")
    scheduler(root / "step_00000001", 1)
    scheduler.finish()
    failed = [r for r in caplog.records if "the evaluation of step_00000001 failed (exit 2" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.WARNING
