"""Tests of hlat.data.identity: the data is identified by content, the digests are cached, and a change is named."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hlat.config import ConfigError, DataConfig
from hlat.data import TextSource, build_loader, load_or_train_tokenizer
from hlat.data.identity import SAMPLE_BLOCK_BYTES, SAMPLE_BLOCKS, content_digest, describe_change, file_digests
from hlat.data.loader import CHECKPOINT, STATE_VERSION, check_identity
from tests.timeouts import hang_guard

VOCAB = 300
ARROW_TEXTS = [f"arrow document {i:06d} " * 8 for i in range(30000)]
"""~5 MB of Arrow IPC: more than 4x the sampled blocks."""
STREAM = dict(version=STATE_VERSION, seed=1, shuffle=True, global_batch_size=4, tokenizer="a1")


def _lines(n: int, start: int = 0) -> list[str]:
    return [
        json.dumps({"text": f"document number {i} says something about {i % 7} things"}) + "\n"
        for i in range(start, start + n)
    ]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("tok")
    texts = [json.loads(line)["text"] for line in _lines(200)]
    return load_or_train_tokenizer(DataConfig(cache_dir=str(cache)), texts, VOCAB, cache).path


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["shuf", "shuf-then-touch-r"])
def test_a_corpus_shuffled_in_place_is_refused_on_resume_naming_the_file(
    tmp_path: Path, tokenizer: Path, keep_mtime: bool
) -> None:
    rows = _lines(60)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(rows))
    cfg = DataConfig(path=str(corpus), tokenizer=str(tokenizer), cache_dir=str(tmp_path / "cache"), worker="none")
    layout = {"vocab_size": VOCAB, "seq_len": 16, "micro_batch_size": 2, "seed": 1}
    loader = build_loader(cfg, **layout)
    next(loader)
    state = loader.state_dict()  # as a checkpoint saves it, before the kill
    before = corpus.stat()
    corpus.write_text("".join(reversed(rows)))  # `shuf corpus.jsonl -o corpus.jsonl`: same file, size and rows
    if keep_mtime:  # `touch -r` from a copy: only the ctime, which no user sets, still tells
        os.utime(corpus, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert corpus.stat().st_size == before.st_size
    with pytest.raises(ConfigError) as e:
        build_loader(cfg, **layout).load_state_dict(state)
    assert str(e.value) == (
        "cannot resume the data stream exactly: the data (data.path) changed since the checkpoint was saved: "
        f"corpus.jsonl has the same size ({before.st_size:,} bytes) but other content. Resume with the data as it "
        f"was, or start a new run (a new hydra.run.dir; train.init_from={CHECKPOINT} keeps its trained weights)"
    )
    corpus.write_text("".join(rows))  # the data as it was (a new mtime: the content decides)
    build_loader(cfg, **layout).load_state_dict(state)


def test_digests_are_read_once_and_again_only_for_a_file_written_since(tmp_path: Path) -> None:
    files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for i, f in enumerate(files):
        f.write_text("".join(_lines(20, start=100 * i)))
    cache = tmp_path / "cache"
    digests, read = file_digests(files, cache)
    assert read == files and digests == [content_digest(f) for f in files]
    assert file_digests(files, cache) == (digests, [])  # a restart reads no data
    stat = files[1].stat()
    files[1].write_text("".join(_lines(20, start=200)))  # same size, other bytes, the mtime put back
    os.utime(files[1], ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again, read = file_digests(files, cache)
    assert read == [files[1]] and again[0] == digests[0] and again[1] != digests[1]


def _digest_in_child(files: list[Path], cache: Path, barrier, results) -> None:
    barrier.wait()
    digests, read = file_digests(files, cache)
    results.put((digests, [str(f) for f in read]))


def test_processes_that_start_at_once_read_each_file_once(tmp_path: Path) -> None:
    files = []
    for i in range(6):  # big enough that the processes overlap (SHA-256 runs at ~1 GB/s)
        files.append(tmp_path / f"part-{i}.jsonl")
        files[-1].write_bytes(os.urandom(4 << 20))
    ctx = multiprocessing.get_context("fork")  # a spawned child would import torch: ~10 s
    barrier, results = ctx.Barrier(3, timeout=hang_guard(120)), ctx.Queue()
    procs = [ctx.Process(target=_digest_in_child, args=(files, tmp_path / "cache", barrier, results)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [results.get(timeout=hang_guard(120)) for _ in procs]
    for p in procs:
        p.join(timeout=hang_guard(60))
        assert p.exitcode == 0
    assert all(digests == [content_digest(f) for f in files] for digests, _ in got)
    assert sorted(f for _, read in got for f in read) == sorted(map(str, files))  # each file read by one process


def _write_arrow(path: Path, texts: list[str]) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, pa.schema([("text", pa.string())])) as writer:
        writer.write_table(pa.table({"text": texts}))


def test_a_data_directory_names_each_file_that_changed_and_how(tmp_path: Path) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    (data / "sub").mkdir(parents=True)
    (data / "a.jsonl").write_text("".join(_lines(5)))
    pq.write_table(pa.table({"text": [f"parquet row {i}" for i in range(5)]}), data / "b.parquet")
    texts = ARROW_TEXTS  # hashed on sampled blocks
    _write_arrow(data / "sub" / "c.arrow", texts)
    before = TextSource(data, cache_dir=cache).fingerprint

    _write_arrow(data / "sub" / "c.arrow", texts[::-1])  # the same documents in another order: the same size
    size = (data / "sub" / "c.arrow").stat().st_size
    assert describe_change(before, TextSource(data, cache_dir=cache).fingerprint) == (
        "the data (data.path) changed since the checkpoint was saved: "
        f"sub/c.arrow has the same size ({size:,} bytes) but other content"
    )
    _write_arrow(data / "sub" / "c.arrow", texts)
    old_size = (data / "b.parquet").stat().st_size
    pq.write_table(pa.table({"text": [f"parquet row {i}" for i in range(6)]}), data / "b.parquet")
    (data / "a.jsonl").rename(data / "d.jsonl")
    new_size = (data / "b.parquet").stat().st_size
    assert describe_change(before, TextSource(data, cache_dir=cache).fingerprint) == (
        "the data (data.path) changed since the checkpoint was saved: a.jsonl is gone, d.jsonl is new, "
        f"b.parquet has {new_size:,} bytes now, {old_size:,} then, 30,011 rows now, 30,010 then"
    )


def test_a_large_arrow_file_is_hashed_on_sampled_blocks_only(tmp_path: Path) -> None:
    path = tmp_path / "c.arrow"
    _write_arrow(path, ARROW_TEXTS)
    raw = bytearray(path.read_bytes())
    assert len(raw) > 4 * SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES
    digest = content_digest(path)
    gap = (len(raw) - SAMPLE_BLOCK_BYTES) // (SAMPLE_BLOCKS - 1)  # between block 0's end and block 1's start
    raw[SAMPLE_BLOCK_BYTES + (gap - SAMPLE_BLOCK_BYTES) // 2] ^= 1
    path.write_bytes(raw)
    assert content_digest(path) == digest  # the documented limit: a same-size edit between the blocks
    raw[0] ^= 1
    path.write_bytes(raw)
    assert content_digest(path) != digest


def test_an_older_sizes_only_fingerprint_resumes_on_the_same_sizes_and_names_a_change(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(_lines(30)))
    older = f"30|corpus.jsonl:{corpus.stat().st_size}"  # what an hlat before content digests saved
    check_identity({**STREAM, "data": older}, {**STREAM, "data": TextSource(corpus).fingerprint})
    corpus.write_text("".join(_lines(31)))
    with pytest.raises(ConfigError, match=r"corpus\.jsonl has [\d,]+ bytes now, [\d,]+ then, 31 rows now, 30 then"):
        check_identity({**STREAM, "data": older}, {**STREAM, "data": TextSource(corpus).fingerprint})


def test_the_sampled_formats_are_the_memory_mapped_ones() -> None:
    """identity.py keeps its own copy of the Arrow suffixes (it sits below sources.py): the two lists agree."""
    from hlat.data.identity import SAMPLED_SUFFIXES
    from hlat.data.sources import ARROW_SUFFIXES

    assert SAMPLED_SUFFIXES == ARROW_SUFFIXES
