"""Tests of hlat.data: sources, builtin corpus, tokenizer, packing and the resumable loader."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hlat.config import ConfigError, DataConfig
from hlat.data import (
    PackedStream,
    Packer,
    StreamSpec,
    TextSource,
    Tokenizer,
    build_loader,
    builtin_corpus_path,
    load_documents,
    load_or_train_tokenizer,
)
from hlat.data import builtin as builtin_mod
from hlat.data import tokenizer as tokenizer_mod
from hlat.data.loader import ENCODE_ROWS
from hlat.data.order import Permutation
from hlat.data.worker import OnlineLoader

VOCAB = 512


def _real_paragraphs() -> list[str]:
    """Real English paragraphs from the pydoc topics, plus a few with non-ASCII text and odd whitespace."""
    from pydoc_data.topics import topics

    paras = [p.strip() for key in sorted(topics) for p in topics[key].split("\n\n") if len(p.strip()) >= 80]
    extra = [
        "Unicode survives: naïve café, ℵ₀ and 😀 fall back to bytes when rare.",
        "Tabs\tand  double  spaces,\nand a second line\n\nafter an empty one.",
        "Frequent numbers would merge into pieces without split_digits: " + "2024, 1000 and 65536; " * 200,
    ]
    return paras[:300] + extra


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _write_arrow(path: Path, table: pa.Table, stream: bool = False) -> Path:
    with pa.OSFile(str(path), "wb") as sink:
        writer = pa.ipc.new_stream(sink, table.schema) if stream else pa.ipc.new_file(sink, table.schema)
        with writer:
            writer.write_table(table)
    return path


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return _real_paragraphs()


@pytest.fixture(scope="module")
def short_docs(docs) -> list[str]:
    """The 12 shortest documents, so that a few small batches span several epochs."""
    return sorted(docs, key=lambda d: (len(d), d))[:12]


@pytest.fixture(scope="module")
def env(tmp_path_factory, docs):
    """The corpus in every format, plus a tokenizer trained once on it into a shared cache."""
    root = tmp_path_factory.mktemp("data")
    table = pa.table({"text": docs, "id": list(range(len(docs)))})
    files = {
        "jsonl": _write_jsonl(root / "docs.jsonl", [{"text": d, "id": i} for i, d in enumerate(docs)]),
        "parquet": root / "docs.parquet",
        "arrow": _write_arrow(root / "docs.arrow", table),
        "arrow_stream": _write_arrow(root / "docs_stream.ipc", table, stream=True),
    }
    pq.write_table(table, files["parquet"])
    cache = root / "cache"
    tok = load_or_train_tokenizer(DataConfig(cache_dir=str(cache)), docs, VOCAB, cache)
    return {"root": root, "files": files, "cache": cache, "tok": tok}


def _cfg(env, **kw) -> DataConfig:
    kw.setdefault("path", str(env["files"]["jsonl"]))
    return DataConfig(cache_dir=str(env["cache"]), **kw)


def _spec(path: Path, tok: Tokenizer, **kw) -> StreamSpec:
    kw = {"seq_len": 16, "micro_batch_size": 3, "seed": 7, "shuffle": True, "dp_rank": 0, "dp_size": 1, **kw}
    kw.setdefault("global_batch_size", kw["micro_batch_size"] * kw["dp_size"])
    return StreamSpec(str(path), "text", str(tok.path), tok.vocab_size, **kw)


def _stream(path: Path, tok: Tokenizer, cursor: dict | None = None, **kw) -> PackedStream:
    return PackedStream(_spec(path, tok, **kw), TextSource(path, "text"), tok, cursor)


def _docs_file(tmp_path: Path, docs: list[str], name: str = "d.jsonl") -> Path:
    return _write_jsonl(tmp_path / name, [{"text": d} for d in docs])


def _epoch_rows(stream: PackedStream, epoch: int) -> list[int]:
    """Oracle: the rows a rank's slots read in an epoch: the permutation applied to the positions whose global index
    (``epoch * rows + position``) falls in one of its slots (``index % global_batch_size``)."""
    spec, n = stream.spec, len(stream.source)
    positions = [p for p in range(n) if (epoch * n + p) % spec.global_batch_size in spec.slots]
    return Permutation(n, spec.seed, epoch)(positions).tolist() if spec.shuffle else positions


def _slot_stream(stream: PackedStream, slot: int, docs: list[str], tok: Tokenizer, epochs: int) -> list[int]:
    """Oracle: the documents of sequence slot ``slot`` (global indices slot, slot + G, ...), whole, EOS after each."""
    spec, n, out = stream.spec, len(docs), []
    for i in range(slot, epochs * n, spec.global_batch_size):
        epoch, position = divmod(i, n)
        row = int(Permutation(n, spec.seed, epoch)([position])[0]) if spec.shuffle else position
        out += [*tok.encode([docs[row]])[0], tok.eos_id]
    return out


def _windows(stream: PackedStream, n: int) -> list[list[int]]:
    return [w.tolist() for _ in range(n) for w in stream.next_windows()[0]]


def _batches(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [loader.next_batch() for _ in range(n)]


# ---------------------------------------------------------------- sources


def test_all_formats_read_the_same_documents(env, docs):
    for name, path in env["files"].items():
        got = load_documents(path, "text")
        assert got.texts == docs, name
        assert got.skipped == 0


def test_directory_reads_supported_files_in_sorted_order(tmp_path):
    _write_jsonl(tmp_path / "b.jsonl", [{"text": "second"}])
    pq.write_table(pa.table({"text": ["first"]}), tmp_path / "a.parquet")
    (tmp_path / "sub").mkdir()
    _write_arrow(tmp_path / "sub" / "c.arrow", pa.table({"text": ["third"]}))
    (tmp_path / "README.md").write_text("not data")
    _write_jsonl(tmp_path / ".hidden.jsonl", [{"text": "hidden"}])
    (tmp_path / "dataset_info.json").write_text('{"description": "HF metadata"}\n')
    got = load_documents(tmp_path, "text")
    assert got.texts == ["first", "second", "third"]
    assert [p.name for p in got.files] == ["a.parquet", "b.jsonl", "c.arrow"]


def test_null_and_empty_documents_are_counted_and_skipped(tmp_path):
    rows = [{"text": "one"}, {"text": None}, {"text": ""}, {"other": 1}, {"text": " \n\t"}, {"text": "two"}]
    got = load_documents(_write_jsonl(tmp_path / "d.jsonl", rows), "text")
    assert got.texts == ["one", "two"]
    assert got.skipped == 4
    pq.write_table(pa.table({"text": ["x", None, ""]}), tmp_path / "d.parquet")
    assert load_documents(tmp_path / "d.parquet", "text").skipped == 2


@pytest.mark.parametrize(
    "case, keys",
    [
        ("missing_path", ["data.path=", "does not exist"]),
        ("unsupported_extension", ["data.path=", "'.txt'"]),
        ("empty_directory", ["data.path=", "directory"]),
        ("missing_column", ["data.text_column='body'", "['text', 'n']"]),
        ("non_string_column", ["data.text_column='n'", "int64"]),
        ("bad_jsonl", ["data.path", "JSON Lines"]),
    ],
)
def test_bad_sources_raise_config_error_naming_the_key(tmp_path, case, keys):
    column = "text"
    if case == "missing_path":
        path = tmp_path / "nope.parquet"
    elif case == "unsupported_extension":
        path = tmp_path / "docs.txt"
        path.write_text("hello")
    elif case == "empty_directory":
        path = tmp_path / "empty"
        path.mkdir()
    elif case == "bad_jsonl":
        path = tmp_path / "array.json"
        path.write_text('[{"text": "a JSON array is not JSON Lines"},\n{"text": "b"}]\n')
    else:
        path = tmp_path / "t.parquet"
        pq.write_table(pa.table({"text": ["a"], "n": [1]}), path)
        column = "body" if case == "missing_column" else "n"
    with pytest.raises(ConfigError) as err:
        load_documents(path, column)
    for key in keys:
        assert key in str(err.value)


def test_no_documents_at_all_is_a_config_error(env, tmp_path):
    path = _write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}, {"text": None}])
    with pytest.raises(ConfigError, match=r"data.path=.*no documents"):
        build_loader(_cfg(env, path=str(path)), vocab_size=VOCAB, seq_len=8, micro_batch_size=2, seed=0)


# ---------------------------------------------------------------- builtin corpus


@pytest.fixture(scope="module")
def builtin_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("builtin_cache")


def test_builtin_corpus_builds_once_and_is_reused(builtin_cache, monkeypatch):
    from pydoc_data.topics import topics

    path = builtin_corpus_path(builtin_cache)
    assert path.parent == builtin_cache / "builtin" and path.suffix == ".arrow"
    texts = load_documents(path, "text").texts
    assert sum(len(t.encode()) for t in texts) > 1_000_000
    assert topics["if"] in texts  # pydoc topics are part of it
    assert min(len(t) for t in texts[len(topics) :]) >= builtin_mod.MIN_DOCSTRING_CHARS
    assert len(set(texts)) == len(texts)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind

    mtime = path.stat().st_mtime_ns
    monkeypatch.setattr(builtin_mod, "collect_documents", lambda: pytest.fail("corpus rebuilt instead of reused"))
    assert builtin_corpus_path(str(builtin_cache)) == path
    assert path.stat().st_mtime_ns == mtime


def test_build_loader_on_builtin_corpus(builtin_cache):
    cfg = DataConfig(path=None, cache_dir=str(builtin_cache), worker="none")
    loader = build_loader(cfg, vocab_size=VOCAB, seq_len=32, micro_batch_size=2, seed=1)
    inputs, targets = loader.next_batch()
    assert inputs.shape == targets.shape == (2, 32)
    assert loader.tokenizer.vocab_size == VOCAB
    assert ENCODE_ROWS <= loader._stream._rows_read < 2 * ENCODE_ROWS < len(loader.source)  # lazily, one call


# ---------------------------------------------------------------- tokenizer


def test_trained_tokenizer_llama_layout_and_roundtrip(env, docs):
    tok = env["tok"]
    assert (tok.vocab_size, tok.processor.unk_id(), tok.bos_id, tok.eos_id, tok.processor.pad_id()) == (
        VOCAB,
        0,
        1,
        2,
        -1,
    )
    ids = tok.encode([*docs[-3:], "  leading spaces\n\n\ttrailing \n"])
    assert all(2 not in x and 1 not in x for x in ids)  # no BOS/EOS added by encode
    assert [tok.decode(x) for x in ids] == [*docs[-3:], "  leading spaces\n\n\ttrailing \n"]
    assert any(tok.processor.is_byte(i) for i in ids[0])  # the emoji went through byte fallback
    pieces = [tok.processor.id_to_piece(i) for i in range(VOCAB) if not tok.processor.is_byte(i)]
    digit_pieces = [p for p in pieces if any(c.isdigit() for c in p)]
    assert digit_pieces and all(len(p.lstrip("▁")) == 1 for p in digit_pieces)  # split_digits


def test_trained_tokenizer_is_cached_and_reused(env, docs, monkeypatch):
    monkeypatch.setattr(tokenizer_mod, "_train", lambda *a: pytest.fail("tokenizer retrained instead of reused"))
    again = load_or_train_tokenizer(DataConfig(cache_dir=str(env["cache"])), docs, VOCAB, env["cache"])
    assert again.path == env["tok"].path and again.path.parent == env["cache"] / "tokenizers"
    # Reading the documents from a file gives the same key, hence the same cached model.
    from_file = load_or_train_tokenizer(_cfg(env), env["files"]["parquet"], VOCAB, env["cache"])
    assert from_file.fingerprint == env["tok"].fingerprint


def test_given_tokenizer_is_loaded_and_checked(env):
    path = str(env["tok"].path)
    assert (
        load_or_train_tokenizer(_cfg(env, tokenizer=path), [], VOCAB, env["cache"]).fingerprint
        == env["tok"].fingerprint
    )
    with pytest.raises(ConfigError) as err:
        # The data path does not exist: the vocab check must come first, before reading any data.
        build_loader(
            _cfg(env, tokenizer=path, path="/does/not/exist"), vocab_size=1000, seq_len=8, micro_batch_size=1, seed=0
        )
    assert "model.vocab_size=1000" in str(err.value) and "data.tokenizer=" in str(err.value)
    with pytest.raises(ConfigError, match=r"data.tokenizer=.*does not exist"):
        load_or_train_tokenizer(_cfg(env, tokenizer=str(env["root"] / "missing.model")), [], VOCAB, env["cache"])
    with pytest.raises(ConfigError, match=r"data.tokenizer=.*not a sentencepiece model"):
        load_or_train_tokenizer(_cfg(env, tokenizer=str(env["files"]["jsonl"])), [], VOCAB, env["cache"])


def test_tokenizer_without_eos_is_rejected(env, docs, tmp_path):
    import sentencepiece as spm

    prefix = tmp_path / "noeos"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs[:50]), model_prefix=str(prefix), vocab_size=300, eos_id=-1, minloglevel=2
    )
    with pytest.raises(ConfigError, match=r"data\.tokenizer=.*no EOS"):
        load_or_train_tokenizer(_cfg(env, tokenizer=f"{prefix}.model"), [], 300, env["cache"])


def test_unreachable_vocab_size_is_a_config_error(env, docs):
    with pytest.raises(ConfigError) as err:
        load_or_train_tokenizer(_cfg(env, tokenizer_type="unigram"), docs[:40], 20000, env["cache"])
    assert "model.vocab_size=20000" in str(err.value) and "data.tokenizer=" in str(err.value)


# ---------------------------------------------------------------- packing


def test_packer_windows_reproduce_the_eos_joined_stream():
    rng = random.Random(0)
    docs = [[rng.randrange(3, 100) for _ in range(rng.randrange(0, 30))] for _ in range(50)]
    stream = [t for d in docs for t in [*d, 2]]
    packer, seq_len, windows = Packer(seq_len=7, eos_id=2), 7, []
    for i in range(0, len(docs), 4):  # documents arrive in uneven groups
        packer.add(docs[i : i + 4], tags=range(i, i + len(docs[i : i + 4])))
        while packer.windows_ready():
            windows.append(packer.pop().tolist())
    assert all(len(w) == seq_len + 1 for w in windows)
    assert windows == [stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(len(windows))]
    # Leftover tokens are carried, not dropped, and position() names where the next window starts.
    doc, offset = packer.position()
    starts = [sum(len(d) + 1 for d in docs[:k]) for k in range(len(docs))]
    assert starts[doc] + offset == len(windows) * seq_len and 0 <= offset <= len(docs[doc])
    with pytest.raises(IndexError):
        packer.pop()


def test_packer_resumes_from_a_document_and_offset():
    docs = [list(range(10, 10 + n)) for n in (13, 0, 4, 9, 21, 2, 17)]
    a = Packer(5, eos_id=0)
    a.add(docs, tags=range(len(docs)))
    for _ in range(3):
        a.pop()
    doc, offset = a.position()
    b = Packer(5, eos_id=0)  # rebuilt from the document index and offset alone
    b.add(docs[doc:], tags=range(doc, len(docs)), skip=offset)
    while a.windows_ready():
        assert a.pop().tolist() == b.pop().tolist()
    assert b.windows_ready() == 0


# ---------------------------------------------------------------- order


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_permutation_is_a_seeded_bijection(n):
    p = Permutation(n, seed=3, epoch=0)
    image = p(range(n))
    assert sorted(image.tolist()) == list(range(n))
    assert p(range(n)).tolist() == image.tolist() == Permutation(n, 3, 0)(range(n)).tolist()
    if n >= 64:
        assert image.tolist() != list(range(n))
        assert Permutation(n, 3, 1)(range(n)).tolist() != image.tolist()
        assert Permutation(n, 4, 0)(range(n)).tolist() != image.tolist()
    with pytest.raises(IndexError):
        p([n])


# ---------------------------------------------------------------- loader


def test_batches_are_shifted_windows_of_each_slots_document_stream(env, short_docs, tmp_path):
    tok, path = env["tok"], _docs_file(tmp_path, short_docs)
    loader = OnlineLoader(_spec(path, tok, shuffle=False), TextSource(path, "text"), tok, worker="none")
    batches = _batches(loader, 40)
    assert loader.stats()["data/epochs"] >= 2
    oracle = _stream(path, tok, shuffle=False)
    for slot in range(3):  # row j of every batch is sequence slot j's next window
        rows_in = torch.stack([b[0][slot] for b in batches])
        rows_tg = torch.stack([b[1][slot] for b in batches])
        assert rows_in.dtype == rows_tg.dtype == torch.int64 and rows_in.shape == (40, 16)
        assert torch.equal(rows_in[:, 1:], rows_tg[:, :-1])  # targets = inputs shifted by one
        assert torch.equal(rows_in[1:, 0], rows_tg[:-1, -1])  # consecutive windows share one token
        stream = _slot_stream(oracle, slot, short_docs, tok, epochs=40)
        expected = torch.tensor([stream[i * 16 : i * 16 + 17] for i in range(40)])
        assert torch.equal(rows_in, expected[:, :-1]) and torch.equal(rows_tg, expected[:, 1:])
    stats = loader.stats()
    assert stats["data/tokens_produced"] == 40 * 3 * 16 and stats["data/padding_fraction"] == 0.0


def test_shuffled_stream_separates_whole_documents_with_eos(env, docs, tmp_path):
    tok, path = env["tok"], _docs_file(tmp_path, docs[:30])
    loader = OnlineLoader(_spec(path, tok, seed=3, seq_len=64, micro_batch_size=4), TextSource(path, "text"), tok)
    batches = _batches(loader, 30)
    loader.close()
    for slot in range(4):  # each slot's windows, end to end, are whole documents with an EOS after each
        stream = torch.cat([inp[slot] for inp, _ in batches]).tolist()
        assert tok.eos_id in stream and all(0 <= t < tok.vocab_size for t in stream)
        segments = " ".join(map(str, stream)).split(f" {tok.eos_id} ")[1:-1]  # drop the possibly partial ends
        assert len(segments) > 2
        for seg in segments:
            assert tok.decode([int(t) for t in seg.split()]) in docs[:30]


@pytest.mark.parametrize("worker", ["none", "thread", "process"])
def test_resume_gives_identical_batches(env, short_docs, tmp_path, worker):
    path = _docs_file(tmp_path, short_docs)  # 25 batches cross several epochs
    cfg = _cfg(env, path=str(path), tokenizer=str(env["tok"].path), worker=worker)
    kwargs = {"vocab_size": VOCAB, "seq_len": 16, "micro_batch_size": 4, "seed": 11}
    reference = build_loader(cfg, **kwargs)
    expected = _batches(reference, 25)

    first = build_loader(cfg, **kwargs)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(_batches(first, 9), expected[:9], strict=True))
    state = json.loads(json.dumps(first.state_dict()))  # plain python values only
    assert state["slots"] == [0, 4] and max(s + 4 * c["round"] for s, c in enumerate(state["cursors"])) >= 12
    first.close()

    resumed = build_loader(cfg, **kwargs)
    resumed.load_state_dict(state)
    for (a_in, a_tg), (b_in, b_tg) in zip(_batches(resumed, 16), expected[9:], strict=True):
        assert torch.equal(a_in, b_in) and torch.equal(a_tg, b_tg)
    assert resumed.state_dict() == reference.state_dict()
    assert resumed.stats()["data/documents_consumed"] == reference.stats()["data/documents_consumed"]
    for loader in (reference, resumed):
        loader.close()


@pytest.mark.parametrize("dp_size", [1, 2])
def test_token_hash_after_resume_equals_uninterrupted(env, docs, tmp_path, dp_size):
    path = _docs_file(tmp_path, docs[:60])
    cfg = _cfg(env, path=str(path), tokenizer=str(env["tok"].path))
    kwargs = {"vocab_size": VOCAB, "seq_len": 32, "micro_batch_size": 2, "seed": 5, "dp_size": dp_size}

    def digest(batches) -> str:
        h = hashlib.sha256()
        for inputs, targets in batches:
            h.update(inputs.numpy().tobytes() + targets.numpy().tobytes())
        return h.hexdigest()

    for rank in range(dp_size):
        whole = build_loader(cfg, dp_rank=rank, **kwargs)
        uninterrupted = digest(_batches(whole, 50))
        first = build_loader(cfg, dp_rank=rank, **kwargs)
        head = _batches(first, 17)
        state = first.state_dict()
        second = build_loader(cfg, dp_rank=rank, **kwargs)
        second.load_state_dict(state)
        assert digest(head + _batches(second, 33)) == uninterrupted
        for loader in (whole, first, second):
            loader.close()


def test_bad_layout_fails_before_reading_data(env, docs, tmp_path):
    cfg = _cfg(env, path="/does/not/exist")
    with pytest.raises(ValueError, match="dp_rank=2"):
        build_loader(cfg, vocab_size=VOCAB, seq_len=8, micro_batch_size=1, seed=0, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="seq_len=0"):
        build_loader(cfg, vocab_size=VOCAB, seq_len=0, micro_batch_size=1, seed=0)
    with pytest.raises(ValueError, match="global_batch_size=6"):
        build_loader(cfg, vocab_size=VOCAB, seq_len=8, micro_batch_size=2, seed=0, dp_size=2, global_batch_size=6)
    path = _docs_file(tmp_path, docs[:3])  # fewer rows than slots: every slot reads the global sequence
    loader = build_loader(
        _cfg(env, path=str(path), tokenizer=str(env["tok"].path)),
        vocab_size=VOCAB,
        seq_len=8,
        micro_batch_size=1,
        seed=0,
        dp_rank=3,
        dp_size=4,
    )
    assert loader.next_batch()[0].shape == (1, 8)
    loader.close()


def test_resume_rejects_a_different_stream(env, docs, tmp_path):
    path = _docs_file(tmp_path, docs)
    cfg = _cfg(env, path=str(path), tokenizer=str(env["tok"].path))
    kwargs = {"vocab_size": VOCAB, "seq_len": 16, "micro_batch_size": 2}
    state = build_loader(cfg, seed=1, **kwargs).state_dict()
    with pytest.raises(ConfigError, match=r"train\.seed"):
        build_loader(cfg, seed=2, **kwargs).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"train\.global_batch_size was 2, is 4 now"):
        build_loader(cfg, seed=1, dp_size=2, **kwargs).load_state_dict(state)
    other = _docs_file(tmp_path, docs[:-1], "other.jsonl")
    other_cfg = _cfg(env, path=str(other), tokenizer=str(env["tok"].path))
    with pytest.raises(ConfigError, match=r"data\.path"):
        build_loader(other_cfg, seed=1, **kwargs).load_state_dict(state)


def test_dp_ranks_serve_disjoint_slots_covering_each_epoch(env, short_docs, tmp_path):
    tok, small = env["tok"], short_docs[:11]
    path = _docs_file(tmp_path, small)
    ranks = [_stream(path, tok, seed=5, micro_batch_size=1, dp_rank=r, dp_size=2) for r in range(2)]
    assert [r.spec.slots for r in ranks] == [range(0, 1), range(1, 2)]
    for epoch in range(3):
        orders = [_epoch_rows(r, epoch) for r in ranks]
        assert not set(orders[0]) & set(orders[1])
        assert sorted(orders[0] + orders[1]) == list(range(len(small)))
    for r in ranks:
        got = _windows(r, 20)
        stream = _slot_stream(r, r.spec.dp_rank, small, tok, epochs=40)
        assert got == [stream[i * 16 : i * 16 + 17] for i in range(len(got))]


def test_each_epoch_is_reshuffled_deterministically(env, docs, tmp_path):
    tok, path = env["tok"], _docs_file(tmp_path, docs)
    a, b, c = (_stream(path, tok, seed=s) for s in (7, 7, 8))
    order0, order1 = _epoch_rows(a, 0), _epoch_rows(a, 1)
    assert sorted(order0) == sorted(order1) == list(range(len(docs)))
    assert order0 != order1 and _epoch_rows(c, 0) != order0
    assert _epoch_rows(_stream(path, tok, seed=7, shuffle=False), 1) == list(range(len(docs)))
    assert _windows(a, 5) == _windows(b, 5)
    assert _windows(a, 5) != _windows(c, 5)


def test_counters_and_skipped_rows(env, short_docs, tmp_path):
    docs = short_docs[:10]
    rows = (
        [d.encode() for d in docs[:6]] + [b"", None, b"caf\xe9 is not UTF-8", b"   \n"] + [d.encode() for d in docs[6:]]
    )
    path = _write_arrow(tmp_path / "d.arrow", pa.table({"text": pa.array(rows, pa.binary())}))
    cfg = _cfg(env, path=str(path), tokenizer=str(env["tok"].path), shuffle=False, worker="none")
    loader = build_loader(cfg, vocab_size=VOCAB, seq_len=32, micro_batch_size=2, seed=0)
    _batches(loader, 30)
    state, stats, n = loader.state_dict(), loader.stats(), len(rows)
    indices = [s + 2 * c["round"] for s, c in enumerate(state["cursors"])]  # the next global index of each slot
    assert min(indices) >= n  # every slot is past the first epoch
    # Oracle: a slot's counters count the rows it read before the document its next window starts in.
    for s, c in enumerate(state["cursors"]):
        before = [rows[(s + 2 * t) % n] for t in range(c["round"])]  # unshuffled: global index i is row i % n
        bad = [r for r in before if r is None or not r.strip() or r.startswith(b"caf")]
        assert (c["skipped"], c["documents"]) == (len(bad), len(before) - len(bad))
    assert stats["data/skipped_documents"] == sum(c["skipped"] for c in state["cursors"])
    assert stats["data/documents_consumed"] == sum(c["documents"] for c in state["cursors"])
    assert stats["data/epochs"] == pytest.approx(sum(indices) / 2 / n)


def test_worker_errors_reach_the_trainer(env, tmp_path):
    # Unshuffled, slot 0 of a 3-sequence global batch reads row 0 of every epoch: blank, so it never fills a window.
    path = _write_jsonl(tmp_path / "blank.jsonl", [{"text": " "}, {"text": "real text"}, {"text": "\n"}])
    cfg = _cfg(env, path=str(path), tokenizer=str(env["tok"].path), worker="thread", shuffle=False)
    loader = build_loader(cfg, vocab_size=VOCAB, seq_len=16, micro_batch_size=1, seed=0, dp_rank=0, dp_size=3)
    with pytest.raises(ConfigError, match="null, blank or not UTF-8"):
        loader.next_batch()


def test_arrow_sources_are_memory_mapped(tmp_path):
    table = pa.table({"text": ["word " * 200] * 50_000})  # ~50 MB of text
    path = _write_arrow(tmp_path / "big.arrow", table)
    del table
    before = pa.total_allocated_bytes()
    source = TextSource(path, "text")
    assert pa.total_allocated_bytes() - before < 5_000_000  # offsets at most; the text stays on disk
    assert source.get([49_999, 0]) == ["word " * 200] * 2 and len(source) == 50_000
