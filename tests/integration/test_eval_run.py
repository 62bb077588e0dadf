"""Evaluation along training and afterwards: scores in the training run's MLflow history, tables, Fig. 3 curves."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlat.cli import main as cli_main
from hlat.train.run import main
from tests.conftest import compose_cfg
from tests.integration.test_train import SMALL_RUN

pytestmark = pytest.mark.slow
pytest.importorskip("lm_eval")


def test_checkpoints_are_evaluated_along_training_and_afterwards(tmp_path: Path, cache_dir: Path,
                                                                 monkeypatch) -> None:  # fmt: skip
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = [*SMALL_RUN, "train.steps=8", "train.checkpoint_every=4", f"data.cache_dir={cache_dir}", f"tracker.uri={uri}",
           "tracker.plots=false", "tracker.system_metrics=false", "tracker.flush_every_s=0", "health=off"]  # fmt: skip
    # 16 x 64 = 1,024 tokens per step: every 4,096 tokens is every checkpoint (steps 4 and 8)
    result = main(compose_cfg(*run, "eval=local", "eval.every_tokens=4096", "eval.limit=4"), run_dir=tmp_path / "r")
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
