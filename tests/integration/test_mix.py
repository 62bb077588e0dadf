"""A data mixture through ``train.py``: trained on two ranks and resumed on one, it trains the batches of a run on one
rank throughout, and the per-source metrics add up to the tokens trained and the loss logged; a sweep over a weight
with ``-m`` gives runs that differ in the mix only, compared by weight and share.

The sources are written in alphabets of their own (tests/mix_data.py), so each window's source is read off its text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.integration.test_resume_layout import TINY, slot_cursors
from tests.integration.test_resume_layout import recorded_run as train_in_process
from tests.mix_data import source_of, write_source
from tests.timeouts import hang_guard

VOCAB = 320
STEPS, LOG_EVERY, G, SEQ = 6, 1, 4, 32  # TINY logs every step


@pytest.fixture(scope="module")
def mix(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Three sources and their tokenizer, as the overrides of a mixture with a stage from step 3."""
    from hlat.config import DataConfig
    from hlat.data import load_documents, load_or_train_tokenizer

    root = tmp_path_factory.mktemp("mix-data")
    files = {n: write_source(root, n) for n in "abc"}
    cache = root / "cache"
    docs = [d for f in files.values() for d in load_documents(f).texts]
    tok = load_or_train_tokenizer(DataConfig(cache_dir=str(cache)), docs, VOCAB, cache)
    weights = {"a": 0.5, "b": 0.25, "c": 0.25}
    return [
        *(f"++data.mix.{n}={{path: {f}, weight: {weights[n]}}}" for n, f in files.items()),
        "+data.stages.late={start: 3, weights: {a: 0.25, c: 0.75}}",
        f"data.tokenizer={tok.path}",
        f"data.cache_dir={cache}",
        f"model.vocab_size={VOCAB}",
    ]


def window_sources(batches: list[torch.Tensor], tokenizer_path: str) -> np.ndarray:
    """(steps, G) source names of the trained windows, read off their letters."""
    from hlat.data import Tokenizer

    tok = Tokenizer(tokenizer_path)
    return np.array([[source_of(tok.decode([t for t in w.tolist() if t != tok.eos_id])) for w in b] for b in batches])


@pytest.mark.slow
def test_a_mixture_on_two_ranks_resumed_on_one_trains_the_same_batches_and_its_metrics_add_up(
    tmp_path: Path, mix: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    from hlat.track.series import read_points
    from tests.integration.test_train import cli

    monkeypatch.chdir(tmp_path)
    common = [*mix, "tracker.uri=sqlite:///" + str(tmp_path / "mlflow.db")]
    ref, ref_batches = train_in_process(
        monkeypatch, tmp_path / "ref", *common, "train.micro_batch_size=2", f"train.steps={STEPS}", "tracker=console"
    )
    down = tmp_path / "down"
    r = cli(*TINY, *common, "cluster=cpu_x2", "train.micro_batch_size=1", "train.steps=3", f"hydra.run.dir={down}",
            cwd=tmp_path, timeout=hang_guard(900))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    for step in (1, 2, 3):  # the same per-slot, per-source positions as one rank's: the same tokens in between
        name = f"step_{step:08d}"
        assert slot_cursors(down / "checkpoints" / name) == slot_cursors(tmp_path / "ref" / "checkpoints" / name)
    resumed, batches = train_in_process(monkeypatch, down, *common, "train.micro_batch_size=4", f"train.steps={STEPS}")
    assert len(batches) == 3 and all(torch.equal(a, b) for a, b in zip(batches, ref_batches[3:], strict=True))

    sources = window_sources(ref_batches, resumed.config.data.tokenizer)
    assert (sources[:3] != None).all() and set(sources[3:].ravel()) <= {"a", "c"}  # noqa: E711  the stage from step 3
    points = read_points(down / "checkpoints" / "series")  # every logged point, both ranks' run and the resumed one
    series = {k: dict(zip(s.tolist(), v.tolist(), strict=True)) for k, (s, v) in points.items()}
    for step in range(LOG_EVERY, STEPS + 1, LOG_EVERY):
        trained = {n: int((sources[:step] == n).sum()) * SEQ for n in "abc"}  # read off the windows' letters
        assert {n: series[f"data/mix/{n}/tokens"][step] for n in "abc"} == trained, step
        assert sum(trained.values()) == step * G * SEQ == series["train/tokens_seen"][step]
        interval = sources[step - LOG_EVERY : step]
        shares = {n: (interval == n).mean() for n in "abc"}
        assert {n: series[f"data/mix/{n}/share"][step] for n in "abc"} == shares
        losses = [series["train/loss"][s] for s in range(step - LOG_EVERY + 1, step + 1)]
        by_source = sum(shares[n] * series[f"train/loss/{n}"][step] for n in "abc" if shares[n])
        assert by_source == pytest.approx(np.mean(losses), rel=1e-4)  # token-weighted: the interval's mean loss
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = [r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])]
    assert run.data.params["data.mix.c.weight"] == "0.25" and run.data.params["data.mix.c.fraction"] == "0.25"
    assert run.data.tags["data.mix_revision"] == "0"
    assert "mixture_plan.json" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert ref.state.step == STEPS


@pytest.mark.slow
def test_a_sweep_over_a_weight_gives_runs_that_differ_in_the_mix_only_and_hlat_compare_puts_it_in_a_column(
    tmp_path: Path, mix: list[str]
) -> None:
    from mlflow import MlflowClient

    from tests.integration.test_train import cli

    db = tmp_path / "mlflow.db"
    r = cli("-m", *TINY, *mix, "train.steps=4", "train.micro_batch_size=4", f"tracker.uri=sqlite:///{db}",
            "data.mix.c.weight=0.25,0.75", "hydra.sweep.dir=sweep", cwd=tmp_path, timeout=hang_guard(900))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    children = [x for x in runs if "mlflow.parentRunId" in x.data.tags]
    assert len(children) == 2 and len(runs) == 3
    for child in children:
        weight = float(child.data.params["data.mix.c.weight"])
        fraction = float(child.data.params["data.mix.c.fraction"])
        assert fraction == pytest.approx(weight / (0.75 + weight), abs=1e-6)
        c_windows = child.data.metrics["data/mix/c/tokens"] / SEQ  # over 3 steps of the first weights, then 1 late
        expected = fraction * 3 * G + 0.75 * G
        assert abs(c_windows - expected) < 2, (c_windows, expected)  # within one window in each stage
    comparison = next((tmp_path / "sweep").rglob("comparison.md")).read_text()
    assert "data.mix.c.weight" in comparison
