"""Evaluation along training and afterwards: scores in the training run's MLflow history, tables, Fig. 3 curves."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlat.cli import main as cli_main
from hlat.train.run import main
from tests.conftest import run_config
from tests.integration.test_train import SMALL_RUN

pytestmark = pytest.mark.slow
pytest.importorskip("lm_eval")


def test_checkpoints_are_evaluated_along_training_and_afterwards(tmp_path: Path, cache_dir: Path, monkeypatch) -> None:
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = [
        *SMALL_RUN,
        "train.steps=8",
        "train.checkpoint_every=4",
        f"data.cache_dir={cache_dir}",
        f"tracker.uri={uri}",
        "tracker.plots=false",
        "tracker.system_metrics=false",
        "tracker.flush_every_s=0",
        "health=off",
    ]
    # 16 x 64 = 1,024 tokens per step: every 4,096 tokens is every checkpoint (steps 4 and 8)
    result = main(run_config(*run, "eval=local", "eval.every_tokens=4096", "eval.limit=4"), run_dir=tmp_path / "r")
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(result.mlflow_run_id, "eval/hlat_local_mc/acc")
    assert [m.step for m in sorted(history, key=lambda m: m.step)] == [4, 8]
    assert all(0 <= m.value <= 1 for m in history)
    ppl = client.get_metric_history(result.mlflow_run_id, "eval/hlat_local_ppl/bits_per_byte")
    assert len(ppl) == 2 and all(m.value > 0 for m in ppl)
    root = tmp_path / "r" / "checkpoints"
    assert "| hlat_local_mc | 0 | acc |" in (root / "eval" / "local_step_00000008.md").read_text()
    assert "hlat_local_mc" in (root / "eval" / "local_step_00000004.log").read_text()  # the child's output, in a file

    # afterwards, over all checkpoints: the same steps again (MLflow keeps both points), and the curves
    with pytest.raises(SystemExit) as done:
        cli_main(["eval", f"checkpoint={root}", "all_checkpoints=true", "eval.limit=4", f"tracker.uri={uri}"])
    assert done.value.code == 0
    assert (root / "eval" / "local_curves.png").stat().st_size > 10_000
    artifacts = [a.path for a in client.list_artifacts(result.mlflow_run_id, "plots")]
    assert "plots/local_curves.png" in artifacts
    assert len(client.get_metric_history(result.mlflow_run_id, "eval/hlat_local_mc/acc")) == 4


def test_hlat_eval_refuses_what_it_cannot_evaluate(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["eval", f"checkpoint={tmp_path / 'nothing'}", "tracker=console"])
    assert e.value.code == 2 and "no complete checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli_main(["eval", "tracker=console"])
    assert e.value.code == 2 and "needs a checkpoint" in capsys.readouterr().err


def test_a_failed_evaluation_fails_the_run_unless_on_error_warn(tmp_path: Path, cache_dir: Path) -> None:
    """Issue 33: the evaluation child fails for real (``eval.device=cuda`` where no GPU is visible); the run exits 1
    with MLflow status FAILED, its training and checkpoints complete, also under torch elastic, which must not
    restart it; ``eval.on_error=warn`` finishes the run."""
    from mlflow import MlflowClient

    from hlat import checkpoint
    from tests.unit.test_bad_input import ROOT, TINY, one_clean_error
    from tests.unit.test_eval_checks import run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # 2 x 32 tokens per step: the checkpoint of step 2 is evaluated
    evaluated = [
        *TINY,
        "train.checkpoint_every=2",
        "eval=local",
        "eval.every_tokens=128",
        "eval.limit=2",
        "eval.device=cuda",
        f"data.cache_dir={cache_dir}",
        f"tracker.uri={uri}",
        "tracker.plots=false",
        "tracker.system_metrics=false",
    ]
    client = MlflowClient(tracking_uri=uri)
    for name, extra, code, status in [
        ("fail", ["cluster.max_restarts=1"], 1, "FAILED"),
        ("warn", ["eval.on_error=warn"], 0, "FINISHED"),
    ]:
        args = [str(ROOT / "train.py"), *evaluated, *extra, f"hydra.run.dir={tmp_path / name}"]
        r = run(args, cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
        root = tmp_path / name / "checkpoints"
        log = root / "eval" / "local_step_00000002.log"
        if code:
            line = one_clean_error(r, code)
            assert line.startswith(
                f"hlat: the evaluation along training of step_00000002 (exit 2) failed; {log}: "
                "hlat: configuration error: device=cuda, but CUDA is not available here"
            )
            assert "Training finished and its checkpoints are kept" in line and "eval.on_error=warn" in line
        else:
            assert r.returncode == 0, r.stderr[-3000:]
            assert "the evaluation of step_00000002 failed (exit 2" in r.stdout
        assert checkpoint.newest_complete(root) == checkpoint.step_dir(root, 2)  # training was not lost
        mlflow_run = client.get_run(checkpoint.read_job(root)["mlflow_run_id"])
        assert mlflow_run.info.status == status
        assert max(m.step for m in client.get_metric_history(mlflow_run.info.run_id, "train/loss")) == 2
