"""The token stream does not depend on the layout: global batch k is the same for any DP degree, micro-batch and
gradient-accumulation split, and across a save on one degree and a restore on another (``hlat.data.slots``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hlat.config import ConfigError, DataConfig
from hlat.data import build_loader, load_or_train_tokenizer
from hlat.data.order import Permutation
from hlat.data.slots import gather, slot_range

VOCAB = 300
SEQ_LEN = 12
GLOBAL = 8  # sequences per global batch: DP 1, 2 and 4 with micro-batches 1, 2 (and 4, 8 where they fit)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Short, distinct documents (a few per window, several epochs in a few batches), with blank rows among them."""
    from pydoc_data.topics import topics

    paras = sorted({p.strip() for t in topics.values() for p in t.split("\n\n") if 20 <= len(p.strip()) <= 90})[:13]
    rows = [*paras[:5], None, *paras[5:9], "  ", *paras[9:]]  # two rows that are no document: skipped, counted
    root = tmp_path_factory.mktemp("layout")
    path = root / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    cache = root / "cache"
    tok = load_or_train_tokenizer(DataConfig(cache_dir=str(cache)), paras, VOCAB, cache)
    return {"rows": rows, "path": path, "cache": cache, "tok": tok}


def _cfg(corpus: dict, loader: str = "online", shuffle: bool = True) -> DataConfig:
    tok = str(corpus["tok"].path)
    return DataConfig(
        path=str(corpus["path"]),
        tokenizer=tok,
        cache_dir=str(corpus["cache"]),
        worker="none",
        loader=loader,
        shuffle=shuffle,
    )


def _expected_batches(corpus: dict, n: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """Oracle, from the definition: slot s packs the documents at global indices s, s + G, ... (index i: epoch
    i // N's permutation of position i % N), each whole and followed by EOS; global batch k is window k of every slot.
    """
    rows, tok = corpus["rows"], corpus["tok"]
    out = np.zeros((n, GLOBAL, SEQ_LEN + 1), dtype=np.int64)
    for s in range(GLOBAL):
        stream: list[int] = []
        i = s
        while len(stream) < n * SEQ_LEN + 1:
            epoch, pos = divmod(i, len(rows))
            row = int(Permutation(len(rows), seed, epoch)([pos])[0]) if shuffle else pos
            if rows[row] is not None and rows[row].strip():
                stream += [*tok.encode([rows[row]])[0], tok.eos_id]
            i += GLOBAL
        for k in range(n):
            out[k, s] = stream[k * SEQ_LEN : k * SEQ_LEN + SEQ_LEN + 1]
    return out


def _ranks(corpus: dict, dp: int, micro: int, seed: int, states: list[dict] | None = None, **kw) -> list:
    """The ``dp`` ranks' loaders; ``states`` (one per saved rank) are gathered as ``hlat.train.resume.restore`` does."""
    loaders = []
    for r in range(dp):
        loader = build_loader(
            _cfg(corpus, **kw),
            vocab_size=VOCAB,
            seq_len=SEQ_LEN,
            micro_batch_size=micro,
            seed=seed,
            dp_rank=r,
            dp_size=dp,
            global_batch_size=GLOBAL,
        )
        if states is not None:
            own = states[r] if r < len(states) else states[0]  # a rank the saving run had not: rank 0's file
            loader.load_state_dict(gather(own, loader.slots, lambda d: states[d]))
        loaders.append(loader)
    return loaders


def global_batches(loaders: list, n: int, micro: int, seq_len: int = SEQ_LEN) -> np.ndarray:
    """``n`` global batches as the trainer draws them: each rank its accumulation micro-batches, ranks in order; a
    batch's windows are ``seq_len`` + 1 tokens (inputs and the last target)."""
    out = []
    for _ in range(n):
        rows = []
        for loader in loaders:
            for _ in range(len(loader.slots) // micro):
                inputs, targets = next(loader)
                rows.append(np.concatenate([inputs.numpy(), targets.numpy()[:, -1:]], axis=1))
        out.append(np.concatenate(rows))
    global_batch = sum(len(loader.slots) for loader in loaders)
    return np.stack(out) if out else np.zeros((0, global_batch, seq_len + 1), dtype=np.int64)


LAYOUTS = [(dp, m) for dp in (1, 2, 4) for m in (1, 2, 4, 8) if (GLOBAL // dp) % m == 0]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    before=st.sampled_from(LAYOUTS),
    after=st.sampled_from(LAYOUTS),
    at=st.integers(0, 5),
    seed=st.integers(0, 3),
    loader=st.sampled_from(["online", "offline_packed"]),
)
def test_global_batches_are_the_same_on_every_layout_and_across_a_resume_on_another(
    corpus, before, after, at, seed, loader
):
    total = 7  # several epochs of the 15-row corpus per slot
    first = _ranks(corpus, *before, seed, loader=loader)
    head = global_batches(first, at, before[1])
    states = [json.loads(json.dumps(x.state_dict())) for x in first]  # as checkpointed: plain values
    tail = global_batches(_ranks(corpus, *after, seed, states, loader=loader), total - at, after[1])
    whole = global_batches(_ranks(corpus, *after, seed, loader=loader), total, after[1])
    got = np.concatenate([head, tail])
    np.testing.assert_array_equal(got, whole)  # bit for bit: resumed on another layout == uninterrupted
    if loader == "online":
        np.testing.assert_array_equal(got, _expected_batches(corpus, total, seed))


def test_each_epoch_reads_every_row_once_and_blank_rows_are_counted(corpus):
    n = len(corpus["rows"])
    for epoch in range(3):  # the global sequence: every row once per epoch, in a new order each epoch
        order = Permutation(n, 5, epoch)(range(n)).tolist()
        assert sorted(order) == list(range(n))
    (loader,) = _ranks(corpus, 1, 8, seed=5, shuffle=False)
    batches = global_batches([loader], 4, 8)
    np.testing.assert_array_equal(batches, _expected_batches(corpus, 4, 5, shuffle=False))
    cursors = loader.state_dict()["cursors"]
    for s, c in enumerate(cursors):  # unshuffled, slot s reads rows s, s + 8, ... (mod 15): 2 of them blank
        read = [(s + t * GLOBAL) % n for t in range(c["round"])]
        blank = [i for i in read if corpus["rows"][i] is None or not corpus["rows"][i].strip()]
        assert (c["documents"], c["skipped"]) == (len(read) - len(blank), len(blank))
    assert loader.stats()["data/skipped_documents"] == sum(c["skipped"] for c in cursors)


def test_a_rank_reads_only_the_saved_ranks_that_served_its_slots():
    states = [
        {
            "global_batch_size": 16,
            "dp_size": 8,
            "dp_rank": d,
            "slots": [2 * d, 2 * d + 2],
            "cursors": [f"c{2 * d}", f"c{2 * d + 1}"],
        }
        for d in range(8)
    ]
    read: list[int] = []

    def reader(d: int) -> dict:
        read.append(d)
        return states[d]

    got = gather(states[0], slot_range(16, 1, 2), reader)  # DP 8 -> 2: rank 1 serves slots 8..15
    assert got["cursors"] == [f"c{s}" for s in range(8, 16)] and got["slots"] == [8, 16]
    assert read == [4, 5, 6, 7]
    read.clear()
    got = gather(states[3], slot_range(16, 3, 8), reader)  # the same layout: its own file only
    assert got is states[3] and read == []
    with pytest.raises(ConfigError, match="rank 5 holds slots"):
        gather(states[0], slot_range(16, 1, 2), lambda d: states[0] if d == 5 else states[d])


def test_a_change_of_global_batch_is_refused_naming_the_key(corpus):
    (loader,) = _ranks(corpus, 1, 8, seed=0)
    global_batches([loader], 1, 8)
    state = loader.state_dict()
    bigger = build_loader(
        _cfg(corpus), vocab_size=VOCAB, seq_len=SEQ_LEN, micro_batch_size=8, seed=0, global_batch_size=16
    )
    with pytest.raises(ConfigError) as e:
        bigger.load_state_dict(gather(state, bigger.slots, lambda d: state))
    assert "train.global_batch_size was 8, is 16 now. Resume with train.global_batch_size=8, or start a new run" in (
        str(e.value)
    )


def test_a_change_of_seq_len_continues_every_slot_at_the_token_where_it_stopped(corpus):
    (first,) = _ranks(corpus, 1, 8, seed=2)
    head = global_batches([first], 3, 8)
    state = first.state_dict()
    longer = build_loader(_cfg(corpus), vocab_size=VOCAB, seq_len=20, micro_batch_size=8, seed=2, global_batch_size=8)
    longer.load_state_dict(state)
    inputs, targets = next(longer)
    tail = np.concatenate([inputs.numpy(), targets.numpy()[:, -1:]], axis=1)
    expected = _expected_batches(corpus, 5, seed=2)  # windows of 12 tokens: 3 of them, then 20 tokens on
    for s in range(GLOBAL):
        stream = np.concatenate([expected[k, s, :-1] for k in range(5)])
        np.testing.assert_array_equal(head[:, s].reshape(3, -1)[:, :-1].reshape(-1), stream[: 3 * SEQ_LEN])
        np.testing.assert_array_equal(tail[s], stream[3 * SEQ_LEN : 3 * SEQ_LEN + 21])
