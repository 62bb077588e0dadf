"""Data mixtures at the loader, checked from outside: sources written in alphabets of their own (tests/mix_data.py),
so a window's source and documents are read off its text, never off hlat's labels.

Shares are token-exact at every global batch, a one-source mixture is the ``data.path`` stream, the stream is the
same on every layout and across a resume on another, stages repeat and skip no document of any source, the future
of a mix may be edited at resume and its past may not, and the repetition cap is planned and enforced.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hlat.config import ConfigError, DataConfig
from hlat.data import build_loader, load_documents, load_or_train_tokenizer
from hlat.data.order import Permutation
from hlat.data.schedule import Schedule, Stage, normalized
from hlat.data.slots import gather
from tests.mix_data import ALPHABETS, document_ids, source_of, write_source
from tests.unit.test_data_layout import global_batches

VOCAB = 320
SEQ_LEN = 32
GLOBAL = 8
LAYOUTS = [(dp, m) for dp in (1, 2, 4, 8) for m in (1, 2, 4, 8) if (GLOBAL // dp) % m == 0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Sources a (400 short documents), b (100 long ones), c (40), d (60, for additions), and their tokenizer."""
    root = tmp_path_factory.mktemp("mix")
    files = {name: write_source(root / "data", name) for name in ALPHABETS}
    docs = [d for f in files.values() for d in load_documents(f).texts]
    cache = root / "cache"
    tok = load_or_train_tokenizer(DataConfig(cache_dir=str(cache)), docs, VOCAB, cache)
    return {"root": root, "files": files, "cache": cache, "tok": tok}


def _cfg(corpus: dict, weights: dict[str, float], stages: dict | None = None, **kw) -> DataConfig:
    mix = {n: {"path": str(corpus["files"][n]), "weight": w, **kw.pop(n, {})} for n, w in weights.items()}
    return DataConfig(
        mix=mix,
        stages=stages or {},
        tokenizer=str(corpus["tok"].path),
        cache_dir=str(corpus["cache"]),
        worker="none",
        **kw,
    )


def _ranks(cfg: DataConfig, dp: int, micro: int, states: list[dict] | None = None, steps: int = 0, **kw) -> list:
    loaders = []
    for r in range(dp):
        loader = build_loader(
            cfg,
            vocab_size=VOCAB,
            seq_len=kw.get("seq_len", SEQ_LEN),
            micro_batch_size=micro,
            seed=kw.get("seed", 3),
            dp_rank=r,
            dp_size=dp,
            global_batch_size=GLOBAL,
            steps=steps,
        )
        if states is not None:
            own = states[r] if r < len(states) else states[0]
            loader.load_state_dict(gather(own, loader.slots, lambda d: states[d]))
        loaders.append(loader)
    return loaders


def _sources(corpus: dict, batches: np.ndarray) -> np.ndarray:
    """The source of every window, read off its letters: (batches, G) of source names."""
    tok = corpus["tok"]
    out = np.empty(batches.shape[:2], dtype=object)
    for k, s in np.ndindex(*batches.shape[:2]):
        out[k, s] = source_of(tok.decode([t for t in batches[k, s].tolist() if t != tok.eos_id]))
    return out


def _documents(corpus: dict, batches: np.ndarray, sources: np.ndarray) -> dict[tuple[int, str], list[int]]:
    """The document ids each (slot, source) packed, in order: its windows joined (they share one token)."""
    tok, out = corpus["tok"], {}
    for s in range(batches.shape[1]):
        for name in ALPHABETS:
            ks = [k for k in range(len(batches)) if sources[k, s] == name]
            if ks:
                stream = [batches[ks[0], s, 0], *[t for k in ks for t in batches[k, s, 1:]]]
                out[(s, name)] = [
                    i for piece in _split(stream, tok.eos_id) for i in document_ids(tok.decode(piece), name)
                ]
    return out


def _split(tokens: list, eos: int) -> list[list[int]]:
    pieces, cur = [], []
    for t in tokens:
        if t == eos:
            pieces.append(cur)
            cur = []
        else:
            cur.append(int(t))
    return [*pieces, cur]


def _oracle(corpus: dict, name: str, slot: int, n: int, seed: int = 3) -> list[int]:
    """The first ``n`` documents slot ``slot`` reads of source ``name``: its indices slot, slot + G, ... through
    each epoch's permutation (the order ``data.path=<the source>`` reads)."""
    rows = len(load_documents(corpus["files"][name]).texts)
    return [int(Permutation(rows, seed, i // rows)([i % rows])[0]) for i in range(slot, slot + n * GLOBAL, GLOBAL)]


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.integers(0, 20), min_size=1, max_size=7).filter(any),
    later=st.lists(st.integers(0, 20), min_size=7, max_size=7),
    size=st.integers(1, 33),
    start=st.integers(0, 40),
)
def test_every_source_is_within_one_window_of_its_share_at_every_batch_of_every_stage(weights, later, size, start):
    names = tuple(f"s{i}" for i in range(len(weights)))
    stages = [Stage("", 0, normalized(dict(zip(names, map(float, weights), strict=True))))]
    second = dict(zip(names, map(float, later), strict=False))
    if any(second.values()) and start:
        stages.append(Stage("b", start, normalized(second)))
    sched = Schedule(names, tuple(stages), size, seed=0)
    cursor = sched.start()
    for _ in range(50):
        count, cursor = sched.step(cursor)
        assert count.sum() == size and (count >= 0).all()
        placed = sched.place(count, cursor.batch - 1)
        assert np.bincount(placed, minlength=len(names)).tolist() == count.tolist()
        stage = sched.stages[cursor.stage]
        target = sched.fractions(cursor.stage) * size * (cursor.batch - stage.start)
        assert np.abs(cursor.counts - cursor.at_stage - target).max() < 1


def test_shares_read_off_the_windows_are_token_exact_at_every_batch(corpus):
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    (loader,) = _ranks(_cfg(corpus, weights), 1, 8)
    batches = global_batches([loader], 200, 8, SEQ_LEN)
    sources = _sources(corpus, batches)
    assert (sources != None).all()  # noqa: E711  every window is one source's letters only
    counts = np.zeros(3)
    for k in range(200):
        counts += [(sources[k] == n).sum() for n in weights]
        assert np.abs(counts - np.array(list(weights.values())) * GLOBAL * (k + 1)).max() < 1, k
    stats = loader.stats()
    assert [stats[f"data/mix/{n}/tokens"] for n in weights] == (counts * SEQ_LEN).tolist()


def test_a_one_source_mixture_is_the_data_path_stream(corpus):
    plain = DataConfig(
        path=str(corpus["files"]["a"]), tokenizer=str(corpus["tok"].path), cache_dir=str(corpus["cache"]), worker="none"
    )
    (one,) = _ranks(plain, 1, 4)
    (mixed,) = _ranks(_cfg(corpus, {"a": 1.0}), 1, 4)
    np.testing.assert_array_equal(global_batches([mixed], 100, 4, SEQ_LEN), global_batches([one], 100, 4, SEQ_LEN))


STAGES = {
    "mid": {"start": 5, "weights": {"a": 0.2, "b": 0.2, "c": 0.6}},
    "end": {"start_tokens": 9 * GLOBAL * SEQ_LEN, "weights": {"b": 1.0}},
}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=st.sampled_from(LAYOUTS), after=st.sampled_from(LAYOUTS), at=st.integers(0, 12))
def test_global_batches_are_the_same_on_every_layout_and_across_a_resume_on_another(corpus, before, after, at):
    cfg = _cfg(corpus, {"a": 0.5, "b": 0.3, "c": 0.2}, STAGES)
    total = 12
    first = _ranks(cfg, *before)
    head = global_batches(first, at, before[1], SEQ_LEN)
    states = [json.loads(json.dumps(x.state_dict())) for x in first]  # as checkpointed: plain values
    tail = global_batches(_ranks(cfg, *after, states), total - at, after[1], SEQ_LEN)
    whole = global_batches(_ranks(cfg, *after), total, after[1], SEQ_LEN)
    np.testing.assert_array_equal(np.concatenate([head, tail]), whole)


def test_across_stages_every_slot_reads_each_source_in_its_order_no_document_skipped_or_repeated(corpus):
    cfg = _cfg(corpus, {"a": 0.5, "b": 0.3, "c": 0.2}, STAGES)
    batches = global_batches(_ranks(cfg, 2, 2), 30, 2, SEQ_LEN)
    sources = _sources(corpus, batches)
    assert set(sources[9:].ravel()) == {"b"} and (sources[5:9] != None).all()  # noqa: E711
    for (slot, name), ids in _documents(corpus, batches, sources).items():
        assert ids == _oracle(corpus, name, slot, len(ids)), (slot, name)


# ------------------------------------------------------------------------------ editing the mix at resume


def _saved(loaders: list) -> list[dict]:
    return [json.loads(json.dumps(x.state_dict())) for x in loaders]


def test_a_later_stage_moved_and_a_new_source_from_it_are_accepted_and_counted_as_a_revision(corpus):
    old = _cfg(corpus, {"a": 0.5, "b": 0.3, "c": 0.2}, STAGES)
    first = _ranks(old, 2, 2)
    head = global_batches(first, 6, 2, SEQ_LEN)
    moved = {"mid": STAGES["mid"], "end": {"start": 11, "weights": {"b": 0.5, "d": 0.5}}}
    new = _cfg(corpus, {"a": 0.5, "b": 0.3, "c": 0.2, "d": 0.0}, moved)
    resumed = _ranks(new, 1, 4, _saved(first))
    tail = global_batches(resumed, 10, 4, SEQ_LEN)
    got = np.concatenate([head, tail])
    # the past was kept and the new source, weight 0 until its stage, changes no earlier choice: the same batches
    # as a run of the new mix from the start
    np.testing.assert_array_equal(got, global_batches(_ranks(new, 2, 2), 16, 2, SEQ_LEN))
    sources = _sources(corpus, got)
    assert "d" not in sources[:11] and set(sources[11:].ravel()) == {"b", "d"}
    for (slot, name), ids in _documents(corpus, got, sources).items():
        assert ids == _oracle(corpus, name, slot, len(ids)), (slot, name)
    info = resumed[0].run_info()
    assert info["tags"]["data.mix_revision"] == "1"
    assert "stage end changed (from step 12)" in info["tags"]["data.mix_edits"]
    assert "source d added" in info["tags"]["data.mix_edits"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"stages": {**STAGES, "mid": {"start": 5, "weights": {"a": 0.3, "b": 0.2, "c": 0.6}}}},
            "cannot resume the data mix at step 6: data.stages.mid.weights.a was 0.2 for steps 6-6 (a 0.2 share), is "
            "0.3 now (a 0.2727 share); a stage already trained keeps its weights: restore it; or change the mix from "
            "step 6 on with a stage there (data.stages.<name>={start: 6, weights: {...}}); or start a new run from "
            "the checkpoint's weights (train.init_from=<the checkpoint>)",
        ),
        (
            {"stages": {**STAGES, "mid": {"start": 4, "weights": STAGES["mid"]["weights"]}}},
            "cannot resume the data mix at step 6: data.stages.mid.start=4 starts the stage after step 4, it began "
            "after step 5; restore data.stages.mid.start=5, or restore it;",
        ),
        (
            {"weights": {"a": 0.6, "b": 0.3, "c": 0.2}},
            "cannot resume the data mix at step 6: data.mix.a.weight was 0.5 for steps 1-6",
        ),
        (
            {"weights": {"a": 0.5, "b": 0.3}, "stages": {"mid": {"start": 5, "weights": {"a": 0.2, "b": 0.2}}}},
            "cannot resume the data mix at step 6: data.mix.c is gone from the config, but the stage in progress "
            "(data.stages.mid.weights.c, since step 6) trains it; put the source back",
        ),
    ],
    ids=["weight-of-the-stage-in-progress", "start-moved-into-the-past", "first-weights", "source-still-trained"],
)
def test_a_change_to_the_mix_before_the_checkpoint_is_refused_naming_the_key_the_value_and_the_ways_on(
    corpus, change, message
):
    first = _ranks(_cfg(corpus, {"a": 0.5, "b": 0.3, "c": 0.2}, STAGES), 1, 8)
    global_batches(first, 6, 8, SEQ_LEN)
    cfg = _cfg(corpus, change.get("weights", {"a": 0.5, "b": 0.3, "c": 0.2}), change.get("stages", STAGES))
    with pytest.raises(ConfigError) as e:
        _ranks(cfg, 1, 8, _saved(first))
    assert str(e.value).startswith(message) or message in str(e.value), str(e.value)


def test_a_read_source_whose_file_changed_is_refused_and_an_unread_one_may_change(corpus, tmp_path):
    files = {n: write_source(tmp_path, n) for n in ("a", "c", "d")}
    mix = {"files": files, "tok": corpus["tok"], "cache": corpus["cache"]}
    weights = {"a": 0.5, "c": 0.5, "d": 0.0}
    first = _ranks(_cfg(mix, weights), 1, 8)
    global_batches(first, 4, 8, SEQ_LEN)
    states = _saved(first)
    write_source(tmp_path, "d", docs=7)  # never read: free to change
    resumed = _ranks(_cfg(mix, weights), 1, 8, states)
    global_batches(resumed, 1, 8, SEQ_LEN)
    write_source(tmp_path, "c", docs=39)  # read: its data must stay
    with pytest.raises(ConfigError) as e:
        _ranks(_cfg(mix, weights), 1, 8, states)
    msg = str(e.value)
    assert msg.startswith("cannot resume the data mix: source 'c' (data.mix.c.path) changed since the checkpoint was ")
    assert "c.jsonl has" in msg and "39 rows now, 40 then" in msg and "Restore its data; or give the new data a " in msg


def test_a_source_that_left_keeps_its_position_and_comes_back_where_it_stopped(corpus):
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    stages = {"end": {"start": 3, "weights": {"a": 0.5, "b": 0.5}}, "back": {"start": 8, "weights": weights}}
    whole = global_batches(_ranks(_cfg(corpus, weights, stages), 1, 8), 12, 8, SEQ_LEN)
    first = _ranks(_cfg(corpus, weights, stages), 1, 8)
    head = global_batches(first, 4, 8, SEQ_LEN)
    without = _ranks(_cfg(corpus, {"a": 0.5, "b": 0.3}, {"end": stages["end"]}), 1, 8, _saved(first))
    middle = global_batches(without, 3, 8, SEQ_LEN)
    back = _ranks(_cfg(corpus, weights, stages), 1, 8, _saved(without))
    np.testing.assert_array_equal(np.concatenate([head, middle, global_batches(back, 5, 8, SEQ_LEN)]), whole)


# ------------------------------------------------------------------------------------------ repetition


def test_a_plan_beyond_max_epochs_is_refused_before_step_0_with_the_estimate_and_the_fixes(corpus):
    cfg = _cfg(corpus, {"a": 0.4, "b": 0.3, "c": 0.3}, c={"max_epochs": 2})
    with pytest.raises(ConfigError) as e:
        _ranks(cfg, 1, 8, steps=200)
    msg = str(e.value)
    assert msg.startswith("data.mix.c.max_epochs=2: the mix plans about ")
    planned = float(msg.split("plans about ")[1].split(" ")[0])
    assert 5 < planned < 50, msg  # 0.3 x 200 x 8 windows of 32 tokens of c's ~2,000 tokens
    assert "tokens per character on a strided sample with the run's tokenizer" in msg
    assert msg.endswith(
        "lower data.mix.c.weight (or its stage weights), raise data.mix.c.max_epochs, or add data to the source"
    )
    raised = _cfg(corpus, {"a": 0.4, "b": 0.3, "c": 0.3}, c={"max_epochs": 100})
    (loader,) = _ranks(raised, 1, 8, steps=200)
    assert loader.plan.rows["c"]["planned_epochs"] == pytest.approx(planned, abs=0.005)


def test_the_cap_stops_at_the_same_batch_on_every_layout_naming_the_key(corpus):
    cfg = _cfg(corpus, {"a": 0.4, "b": 0.3, "c": 0.3}, c={"max_epochs": 1.5})

    def failing_batch(dp: int, micro: int) -> tuple[int, str]:
        loaders = _ranks(cfg, dp, micro)
        for k in range(100):
            try:
                global_batches(loaders, 1, micro, SEQ_LEN)
            except ConfigError as e:
                return k, str(e)
        raise AssertionError("the cap was never reached")

    k, msg = failing_batch(1, 8)
    assert failing_batch(2, 4) == (k, msg) and failing_batch(4, 1)[0] == k
    assert msg.startswith(f"data.mix.c.max_epochs: global batch {k} (step {k + 1}) needs row ")
    assert "beyond its cap of 60 rows (1.5 epochs of 40 rows); raise data.mix.c.max_epochs" in msg


def test_a_longer_seq_len_continues_every_slot_and_source_at_the_token_where_it_stopped(corpus):
    cfg = _cfg(corpus, {"a": 0.5, "b": 0.3, "c": 0.2}, {"mid": STAGES["mid"]})
    whole = global_batches(_ranks(cfg, 1, 8), 12, 8, SEQ_LEN)
    first = _ranks(cfg, 1, 8)
    head = global_batches(first, 3, 8, SEQ_LEN)
    longer = _ranks(cfg, 1, 8, _saved(first), seq_len=48)
    tail = []
    for _ in range(5):
        inputs, targets = next(longer[0])
        tail.append(np.concatenate([inputs.numpy(), targets.numpy()[:, -1:]], axis=1))
    sources = _sources(corpus, whole)
    for s in range(GLOBAL):
        for name in ALPHABETS:
            expected = [t for k in range(12) if sources[k, s] == name for t in whole[k, s, :-1]]
            got = [t for k in range(3) if sources[k, s] == name for t in head[k, s, :-1]]
            got += [t for k in range(5) if sources[3 + k, s] == name for t in tail[k][s, :-1]]
            n = min(len(expected), len(got))
            assert got[:n] == expected[:n], (s, name)


# ------------------------------------------------------------------------------------------- accounting


def test_per_source_metrics_add_up_to_what_the_windows_hold(corpus):
    from hlat.data.mix_metrics import interval_metrics

    cfg = _cfg(corpus, {"a": 0.5, "b": 0.3, "c": 0.2}, STAGES)
    ranks = _ranks(cfg, 2, 2)
    batches, losses = [], {"a": 1.0, "b": 2.0, "c": 3.0}
    for _ in range(7):
        rows = []
        for loader in ranks:
            for _ in range(2):
                batch = next(loader)
                inputs, targets = batch
                w = np.concatenate([inputs.numpy(), targets.numpy()[:, -1:]], axis=1)
                names = _sources(corpus, w[None])[0]
                per_token = np.array([[losses[n]] * SEQ_LEN for n in names])  # a loss known from the letters
                batch.tally.add(torch.from_numpy(per_token), batch.sources)
                rows.append(w)
        batches.append(np.concatenate(rows))
    fetched = [loader.interval(torch.device("cpu")) for loader in ranks]
    mean = {k: ((fetched[0][0][k] + fetched[1][0][k]) / 2).reshape(-1).tolist() for k in fetched[0][0]}
    got = fetched[0][1](mean)  # what the metrics logger makes of the values averaged over the ranks
    assert got == interval_metrics(*fetched[0][1].args, mean)
    sources = _sources(corpus, np.stack(batches))
    windows = {n: int((sources == n).sum()) for n in losses}
    for n, loss in losses.items():
        assert got[f"train/loss/{n}"] == pytest.approx(loss)
        assert got[f"data/mix/{n}/share"] == windows[n] / sources.size
    stats = ranks[0].stats()
    assert {n: stats[f"data/mix/{n}/tokens"] for n in losses} == {n: w * SEQ_LEN for n, w in windows.items()}
    assert sum(stats[f"data/mix/{n}/tokens"] for n in losses) == 7 * GLOBAL * SEQ_LEN
    starts = {n: 0 for n in losses}
    for (_, n), ids in _documents(corpus, np.stack(batches), sources).items():
        starts[n] += len(ids)
    for n in losses:  # a slot's position counts the documents before the one its next window starts in
        touched = sum(1 for s in range(GLOBAL) if (sources[:, s] == n).any())
        assert starts[n] - touched <= got[f"data/mix/{n}/documents"] <= starts[n], n


# ------------------------------------------------------------------------------------------------ config


def test_a_mix_given_on_the_command_line_of_the_default_preset_or_in_a_file_is_validated_into_typed_sources(tmp_path):
    from tests.conftest import run_config

    cfg = run_config("++data.mix.code={path: data/code, weight: 0.3}", "++data.mix.web={path: data/web, weight: 0.7}")
    assert cfg.data.path is None and {n: s.weight for n, s in cfg.data.mix.items()} == {"code": 0.3, "web": 0.7}
    listed = tmp_path / "mix.yaml"
    listed.write_text("web: {path: data/web, weight: 1}\nbooks: {path: data/books, weight: 2, max_epochs: 3}\n")
    cfg = run_config(f"data.mix_file={listed}", "++data.mix.web.weight=5", "++data.mix.code={path: c, weight: 1}")
    assert {n: (s.path, s.weight, s.max_epochs) for n, s in cfg.data.mix.items()} == {
        "books": ("data/books", 2.0, 3.0),
        "code": ("c", 1.0, None),
        "web": ("data/web", 5.0, None),
    }
    assert cfg.data.mix_file is None  # merged: the validated config (and the run's params) list every source


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["data.path=corpus.jsonl", "++data.mix.code={path: c, weight: 1}"],
            "data.path=corpus.jsonl and data.mix (1 source) are both set: data.path trains one corpus weighted by "
            "size, data.mix named sources by weight; set data.path=null to mix, or drop data.mix",
        ),
        (
            ["data=offline_packed", "++data.mix.code={path: c, weight: 1}"],
            "data.loader=offline_packed does not mix sources; data.mix needs data.loader=online",
        ),
        (
            ["++data.mix.code={path: c, wieght: 1}"],
            "data.mix.code.wieght is not a key of a data.mix source; did you mean data.mix.code.weight?",
        ),
        (
            ["++data.mix.code={path: c}"],
            "data.mix.code.weight is not set; give the source a weight, e.g. data.mix.code.weight=0.3",
        ),
        (
            ["++data.mix.code={path: c, weight: 0}"],
            "every data.mix.<source>.weight is 0, and no stage starts at step 0: the first steps would train on "
            "nothing; give a source a positive weight (e.g. data.mix.<source>.weight=1)",
        ),
        (
            ["++data.mix.code={path: c, weight: 1}", "+data.stages.late={start: 5, weights: {cod: 1}}"],
            "data.stages.late.weights.cod: data.mix has no source 'cod'; did you mean code?",
        ),
        (
            [
                "++data.mix.code={path: c, weight: 1}",
                "+data.stages.late={start: 5, start_fraction: 0.5, weights: {code: 1}}",
            ],
            "data.stages.late sets start and start_fraction: set exactly one of data.stages.late.start (a step), "
            "data.stages.late.start_tokens or data.stages.late.start_fraction (of train.steps)",
        ),
        (
            ["data.mix_file=missing.yaml"],
            "data.mix_file=missing.yaml cannot be read (No such file or directory); point it at a YAML file",
        ),
    ],
    ids=["path-and-mix", "offline", "typo", "no-weight", "all-zero", "unknown-source", "two-starts", "no-file"],
)
def test_a_bad_mix_is_refused_before_anything_is_built_naming_the_key_and_the_fix(overrides, message):
    from tests.conftest import run_config

    with pytest.raises(ConfigError) as e:
        run_config(*overrides)
    assert str(e.value) == message


def test_the_torch_backend_tallies_each_sources_token_losses_from_the_one_forward_it_trains_on():
    import torch.nn.functional as F

    from hlat.backends.torch.backend import TorchBackend
    from hlat.config import ModelConfig
    from hlat.parallel import ParallelDims
    from hlat.tally import Batch, SourceTally
    from tests.conftest import backend_config

    cfg = backend_config(model=ModelConfig(dim=32, n_layers=1, n_heads=2, ffn_dim=64, vocab_size=50, max_seq_len=8))
    backend = TorchBackend(cfg)
    backend.setup()
    model = backend.build_model(ParallelDims.build(cfg.parallelism, 1, cfg.model, cfg.train))
    g = torch.Generator().manual_seed(0)
    tally = SourceTally(3)
    batches = [
        Batch(torch.randint(0, 50, (4, 8), generator=g), torch.randint(0, 50, (4, 8), generator=g), src, tally)
        for src in (torch.tensor([0, 2, 2, 0]), torch.tensor([1, 0, 2, 2]))
    ]
    loss = backend.forward_backward(model, iter(batches), 2)
    sums, windows = tally.take()
    assert tally.take() is None  # taken: the next interval starts from nothing
    with torch.no_grad():  # the oracle: each window's summed token loss, by source
        per_window = torch.cat(
            [F.cross_entropy(model(x).transpose(1, 2), y, reduction="none").sum(1) for x, y in batches]
        )
    sources = torch.cat([b.sources for b in batches])
    expected = torch.stack([per_window[sources == m].sum() for m in range(3)])
    torch.testing.assert_close(sums, expected)
    assert windows.tolist() == [3.0, 1.0, 4.0]
    torch.testing.assert_close(loss, per_window.sum() / (8 * 8))  # the mean token loss of the step
    plain = sum(backend.loss(model, x, y) for x, y in batches) / 2
    torch.testing.assert_close(loss, plain)  # the same loss as without a mixture, to fp32 rounding
    assert all(p.grad is not None for p in model.parameters())


def test_a_resume_whose_trained_tokenizer_would_change_names_the_runs_tokenizer(corpus, tmp_path):
    first = _ranks(_cfg(corpus, {"a": 1.0}), 1, 8)
    global_batches(first, 1, 8, SEQ_LEN)
    texts = load_documents(corpus["files"]["b"]).texts  # another sample: another tokenizer
    other = load_or_train_tokenizer(DataConfig(cache_dir=str(tmp_path)), texts, VOCAB, tmp_path)
    cfg = dataclasses.replace(_cfg(corpus, {"a": 1.0}), tokenizer=str(other.path))
    with pytest.raises(ConfigError) as e:
        _ranks(cfg, 1, 8, _saved(first))
    assert f"resume with data.tokenizer={corpus['tok'].path} (the run's)" in str(e.value)


def test_beyond_log_sources_mlflow_gets_the_largest_sources_and_other_and_the_series_gets_every_one(corpus):
    from hlat.track.series_only import SeriesOnly
    from hlat.track.trackers import NoopTracker

    class Recording(NoopTracker):
        def __init__(self) -> None:
            self.rows, self.params = [], {}

        def log_metrics(self, rows):
            self.rows += rows

        def log_params(self, params):
            self.params |= params

    (loader,) = _ranks(_cfg(corpus, {"a": 0.5, "b": 0.1, "c": 0.4}, log_sources=2), 1, 8)
    global_batches([loader], 3, 8, SEQ_LEN)
    tensors, make = loader.interval(torch.device("cpu"))
    row = loader.stats() | make({k: v.reshape(-1).tolist() for k, v in tensors.items()})
    assert row["data/mix/other/tokens"] == row["data/mix/b/tokens"]  # b, the smallest, is the only other
    assert sum(row[f"data/mix/{n}/tokens"] for n in "abc") == 3 * GLOBAL * SEQ_LEN
    mlflow, info = Recording(), loader.run_info()
    tracker = SeriesOnly(mlflow, **info["series_only"])
    tracker.log_metrics([(3, row)])
    tracker.log_params({"data.mix.a.weight": 0.5, "data.mix.b.weight": 0.1, "data.mix.b.fraction": 0.1})
    logged = set(mlflow.rows[-1][1])
    per_source = {k for k in logged if k.startswith(("data/mix/", "train/loss/")) and k != "data/mix/stage"}
    assert {k.split("/")[-2] if k.startswith("data/") else k.split("/")[-1] for k in per_source} == {"a", "c", "other"}
    assert set(row) - logged == {f"data/mix/b/{k}" for k in ("tokens", "target", "documents", "epochs")}
    assert mlflow.params == {"data.mix.a.weight": 0.5}


def test_a_worker_gives_the_inline_stream_across_a_restart_within_a_step_and_a_process_could_reopen_it(corpus):
    import pickle

    cfg = _cfg(corpus, {"a": 0.5, "b": 0.3, "c": 0.2}, {"mid": STAGES["mid"]})
    runs, reopened = [], None
    for worker in ("none", "thread"):
        (loader,) = _ranks(dataclasses.replace(cfg, worker=worker), 1, 4)
        got = []
        for i in range(14):  # two micro-batches a global batch
            batch = next(loader)
            got.append(np.concatenate([batch[0].numpy(), batch.sources.numpy()[:, None]], axis=1))
            if i == 6:  # half a global batch given: its other half comes from the restarted worker
                loader.load_state_dict(json.loads(json.dumps(loader.state_dict())))
                # what a worker process gets: the spec and position, pickled; it opens the data again
                reopened = pickle.loads(pickle.dumps(loader._reopen()))().next_windows()
        loader.close()
        runs.append(np.stack(got))
    np.testing.assert_array_equal(runs[1], runs[0])
    np.testing.assert_array_equal(reopened[0][:, :-1], runs[0][7][:, :-1])
    np.testing.assert_array_equal(reopened[1]["sources"], runs[0][7][:, -1])
