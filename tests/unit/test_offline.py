"""Tests of hlat.data.offline (+ its cache, hlat.data.pretokenized): the baseline loader data.loader=offline_packed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from hlat.config import ConfigError, DataConfig
from hlat.data.offline import OfflinePackedLoader, SampleIndex, build_offline_loader
from hlat.data.pretokenized import cache_key, token_dtype
from hlat.data.sources import TextSource
from hlat.data.tokenizer import Tokenizer, load_or_train_tokenizer

VOCAB = 512


def _write_arrow(path: Path, texts: list) -> Path:
    table = pa.table({"text": pa.array(texts, type=pa.large_string())})
    with pa.OSFile(str(path), "wb") as fh, pa.ipc.new_file(fh, table.schema) as writer:
        writer.write_table(table)
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("offline")
    docs = [topics[k] for k in sorted(topics)][:40]
    rows = [*docs[:10], None, " \n ", *docs[10:]]  # one null and one blank row, counted and skipped
    path = _write_arrow(root / "corpus.arrow", rows)
    cache = root / "cache"
    tok = load_or_train_tokenizer(DataConfig(cache_dir=str(cache)), docs, VOCAB, cache)
    return {"root": root, "docs": docs, "path": path, "cache": cache, "tok": tok}


def _build(env: dict, path: Path | None = None, shuffle: bool = True, **kw) -> OfflinePackedLoader:
    kw = {"seq_len": 64, "micro_batch_size": 4, "seed": 3, "dp_rank": 0, "dp_size": 1, **kw}
    cfg = DataConfig(path=str(path or env["path"]), cache_dir=str(env["cache"]), shuffle=shuffle)
    return build_offline_loader(cfg, TextSource(cfg.path), env["tok"], **kw)


def _batches(loader: OfflinePackedLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [loader.next_batch() for _ in range(n)]


def test_cache_files_hold_every_document_followed_by_eos(env):
    loader = _build(env)
    tok: Tokenizer = env["tok"]
    meta = json.loads((loader.directory / "meta.json").read_text())
    assert (meta["documents"], meta["skipped_rows"], meta["rows"]) == (40, 2, 42)
    tokens = np.fromfile(loader.directory / "tokens.bin", dtype=np.uint16)
    offsets = np.load(loader.directory / "doc_offsets.npy")
    expected = [t for ids in tok.encode(env["docs"]) for t in [*ids, tok.eos_id]]
    assert tokens.tolist() == expected
    assert offsets.dtype == np.int64 and offsets[0] == 0 and offsets[-1] == len(expected) == meta["tokens"]
    assert all(tokens[offsets[1:] - 1] == tok.eos_id)
    assert token_dtype(VOCAB) == np.uint16 and token_dtype(65536) == np.uint32


def test_windows_are_slices_of_the_eos_joined_stream_of_shuffled_epochs(env):
    loader = _build(env, seq_len=256, micro_batch_size=8)
    tokens = np.fromfile(loader.directory / "tokens.bin", dtype=np.uint16).astype(np.int64)
    offsets = np.load(loader.directory / "doc_offsets.npy")
    index, n_docs = loader.index, len(env["docs"])
    epochs = 4
    orders = [index.doc_idx(e) for e in range(epochs)]
    for order in orders:  # every epoch visits every document exactly once
        assert sorted(order.tolist()) == list(range(n_docs))
    assert orders[0].tolist() != orders[1].tolist() != list(range(n_docs))
    stream = np.concatenate([tokens[offsets[d] : offsets[d + 1]] for order in orders for d in order])
    per_epoch = int(offsets[-1])
    n = 3 * per_epoch // (loader.seq_len * loader.micro_batch_size)  # about three epochs of batches
    seen = []
    for i, (inputs, targets) in enumerate(_batches(loader, n)):
        assert inputs.shape == targets.shape == (8, 256) and inputs.dtype == targets.dtype == torch.int64
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        for row in range(8):
            sample = loader.global_sample(i * 8 + row)
            start = sample * loader.seq_len
            want = stream[start : start + loader.seq_len + 1]
            assert inputs[row].tolist() == want[:-1].tolist() and targets[row].tolist() == want[1:].tolist()
            seen.append(sample)
    # The samples that start in an epoch are all used, permuted among themselves, before the next epoch's.
    first1 = index.first_sample(1)
    assert sorted(seen[:first1]) == list(range(first1)) and seen[:first1] != list(range(first1))
    assert loader.stats()["data/epochs"] == pytest.approx(n * 8 * 256 / per_epoch)


def test_resume_from_state_dict_gives_identical_batches(env):
    first = _build(env, micro_batch_size=3)
    _batches(first, 7)
    state = json.loads(json.dumps(first.state_dict()))  # plain Python values
    expected = _batches(first, 6)
    resumed = _build(env, micro_batch_size=3)
    resumed.load_state_dict(state)
    got = _batches(resumed, 6)
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, expected, strict=True))
    assert resumed.state_dict() == first.state_dict()
    fresh = _build(env, micro_batch_size=3)
    assert not torch.equal(fresh.next_batch()[0], expected[0][0])  # the state really moved the stream


def test_resume_refuses_another_identity(env):
    state = _build(env).state_dict()
    with pytest.raises(ConfigError, match=r"train\.seed"):
        _build(env, seed=4).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"train\.seq_len"):
        _build(env, seq_len=32).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"data\.loader"):
        _build(env).load_state_dict({"version": 1, "seed": 3, "epoch": 0, "position": 0})  # an online state


def test_data_parallel_ranks_get_disjoint_samples_covering_the_single_rank_order(env):
    single = _build(env, micro_batch_size=2)
    ranks = [_build(env, micro_batch_size=2, dp_rank=r, dp_size=2) for r in range(2)]
    n = 200
    got = [[rank.global_sample(i) for i in range(n)] for rank in ranks]
    assert not set(got[0]) & set(got[1])
    assert sorted(got[0] + got[1]) == sorted(single.global_sample(i) for i in range(2 * n))
    # A global batch of 4 = 2 ranks x 2 slots: rank 1 serves slots 2 and 3 of every one; its 5th sample is
    # slot 3 of global batch 2, the single rank's (2-sequence global batch) sample 4 * 2 + 3.
    assert got[1][5] == single.global_sample(2 * 4 + 3)
    b0, b1 = ranks[0].next_batch()[0], ranks[1].next_batch()[0]
    assert b0[0].tolist() == single.window(single.global_sample(0))[:-1].tolist()
    assert b1[0].tolist() == single.window(single.global_sample(2))[:-1].tolist()
    assert ranks[0].stats()["data/epochs"] == pytest.approx(2 * single.seq_len * 2 / single.index.tokens_per_epoch)


def test_second_build_reuses_the_cache_without_tokenizing(env, monkeypatch):
    first = _build(env)
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.directory.iterdir()}

    def boom(self, texts):
        raise AssertionError("the cache was not reused: the corpus was tokenized again")

    monkeypatch.setattr(Tokenizer, "encode", boom)
    second = _build(env)
    assert second.directory == first.directory
    assert {p.name: p.stat().st_mtime_ns for p in second.directory.iterdir()} == mtimes
    assert torch.equal(second.next_batch()[0], first.next_batch()[0])
    assert not [p for p in second.directory.parent.iterdir() if p.name.endswith(".tmp")]


def test_new_data_gets_a_new_cache(env, tmp_path):
    path = _write_arrow(tmp_path / "other.arrow", env["docs"][:20])
    assert _build(env, path=path).directory != _build(env).directory


def test_stats(env):
    loader = _build(env, micro_batch_size=4, seq_len=64)
    _batches(loader, 5)
    stats = loader.stats()
    assert stats["data/tokens_produced"] == 5 * 4 * 64
    assert stats["data/skipped_documents"] == 2
    assert stats["data/padding_fraction"] == 0.0
    mean_doc = loader.index.tokens_per_epoch / 40
    assert stats["data/documents_consumed"] == pytest.approx(5 * 4 * 64 / mean_doc)


def test_unshuffled_order_is_the_source_order(env):
    loader = _build(env, shuffle=False, micro_batch_size=2, seq_len=16)
    assert [loader.global_sample(i) for i in range(10)] == list(range(10))
    tokens = np.fromfile(loader.directory / "tokens.bin", dtype=np.uint16)
    assert loader.next_batch()[0][1].tolist() == tokens[16:32].tolist()


def test_no_documents_is_a_config_error(env, tmp_path):
    path = _write_arrow(tmp_path / "blank.arrow", ["  ", "\n", None])
    with pytest.raises(ConfigError, match=r"data\.path=.*no documents"):
        _build(env, path=path, seq_len=2)


def test_fewer_tokens_than_one_window_is_a_config_error(env, tmp_path):
    path = _write_arrow(tmp_path / "short.arrow", ["a tiny corpus"])
    with pytest.raises(ConfigError, match=r"train\.seq_len"):
        _build(env, path=path, seq_len=64)  # caught by the cheap byte bound, before tokenizing
    assert not (env["cache"] / "offline" / cache_key(TextSource(path), env["tok"])).exists()
    path = _write_arrow(tmp_path / "short2.arrow", [env["docs"][0][:300]])
    tokens = len(env["tok"].encode([env["docs"][0][:300]])[0]) + 1
    with pytest.raises(ConfigError, match=r"tokenizes to \d+ tokens.*train\.seq_len"):
        _build(env, path=path, seq_len=tokens)  # only the token count tells
    _build(env, path=path, seq_len=tokens - 1)  # exactly one window fits


def test_sample_index_arithmetic():
    index = SampleIndex(np.array([5, 3, 7]), seq_len=4, seed=0)  # 15 tokens per epoch
    # Samples start at stream tokens 0, 4, 8, 12 | 16, 20, 24, 28 | 32, ...: epoch e owns ceil(15e/4)...
    assert [index.first_sample(e) for e in range(4)] == [0, 4, 8, 12]
    assert [index.epoch_of(s) for s in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    for s in range(12):
        epoch = index.epoch_of(s)
        pos, offset = index.sample_idx(s)
        order = index.doc_idx(epoch)
        start = int(index.lengths[order[:pos]].sum()) + offset
        assert start == s * 4 - epoch * 15 and 0 <= offset < index.lengths[order[pos]]
    assert sorted(index.shuffle_idx(p) for p in range(4, 8)) == [4, 5, 6, 7]


def test_loader_keeps_working_after_close(env):
    loader = _build(env)
    loader.close()
    assert loader.next_batch()[0].shape == (4, 64)
    assert os.path.isdir(loader.directory)
