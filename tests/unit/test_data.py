"""Tests of hlat.data: sources, builtin corpus, tokenizer, packing and the resumable loader."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hlat.config import ConfigError, DataConfig
from hlat.data import (
    PackedLoader,
    Packer,
    Tokenizer,
    build_loader,
    builtin_corpus_path,
    load_documents,
    load_or_train_tokenizer,
)
from hlat.data import builtin as builtin_mod
from hlat.data import tokenizer as tokenizer_mod

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


def _loader(docs, tok, **kw) -> PackedLoader:
    kw = {"seq_len": 16, "micro_batch_size": 3, "seed": 7, **kw}
    return PackedLoader(docs, tok, **kw)


def _expected_stream(loader: PackedLoader, docs: list[str], tok: Tokenizer, epochs: int) -> list[int]:
    """Oracle: this rank's documents in their epoch orders, each tokenized whole and followed by EOS."""
    stream: list[int] = []
    for epoch in range(epochs):
        for ids in tok.encode([docs[i] for i in loader.epoch_document_order(epoch)]):
            stream += [*ids, tok.eos_id]
    return stream


def _batches(loader: PackedLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
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
    cfg = DataConfig(path=None, cache_dir=str(builtin_cache))
    loader = build_loader(cfg, vocab_size=VOCAB, seq_len=32, micro_batch_size=2, seed=1)
    inputs, targets = loader.next_batch()
    assert inputs.shape == targets.shape == (2, 32)
    assert loader.tokenizer.vocab_size == VOCAB
    assert 0 < loader.documents_consumed < len(loader.documents)  # tokenized lazily, not upfront


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
        packer.add(docs[i : i + 4])
        while packer.windows_ready():
            windows.append(packer.pop())
    assert all(len(w) == seq_len + 1 for w in windows)
    assert windows == [stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(len(windows))]
    # Leftover tokens are carried, not dropped: they are exactly the stream's unconsumed tail.
    assert packer.state_dict()["tokens"] == stream[len(windows) * seq_len :]
    assert len(packer.state_dict()["tokens"]) <= seq_len
    with pytest.raises(IndexError):
        packer.pop()


def test_packer_state_roundtrip():
    a, b = Packer(5, eos_id=0), Packer(5, eos_id=0)
    a.add([[1, 2, 3, 4, 5, 6, 7, 8]])
    a.pop()
    state = json.loads(json.dumps(a.state_dict()))
    b.load_state_dict(state)
    for p in (a, b):
        p.add([[9, 10, 11]])
    assert a.pop() == b.pop() == [6, 7, 8, 0, 9, 10]


# ---------------------------------------------------------------- loader


def test_batches_are_shifted_windows_of_the_document_stream(env, short_docs):
    tok = env["tok"]
    small = short_docs
    loader = _loader(small, tok, shuffle=False, seq_len=16, micro_batch_size=3)
    batches = _batches(loader, 40)
    assert loader.epoch >= 2
    rows_in = torch.cat([b[0] for b in batches])
    rows_tg = torch.cat([b[1] for b in batches])
    assert rows_in.dtype == rows_tg.dtype == torch.int64 and rows_in.shape == (120, 16)
    assert torch.equal(rows_in[:, 1:], rows_tg[:, :-1])  # targets = inputs shifted by one
    assert torch.equal(rows_in[1:, 0], rows_tg[:-1, -1])  # consecutive windows share one token
    stream = _expected_stream(loader, small, tok, loader.epoch + 1)
    expected = torch.tensor([stream[i * 16 : i * 16 + 17] for i in range(120)])
    assert torch.equal(rows_in, expected[:, :-1]) and torch.equal(rows_tg, expected[:, 1:])
    assert loader.tokens_produced == 40 * 3 * 16 and loader.batches_produced == 40


def test_shuffled_stream_separates_whole_documents_with_eos(env, docs):
    tok = env["tok"]
    loader = _loader(docs[:30], tok, seed=3, seq_len=64, micro_batch_size=4)
    # Inputs of consecutive rows are consecutive, non-overlapping stretches of the packed stream.
    stream = torch.cat([inp.reshape(-1) for inp, _ in _batches(loader, 30)]).tolist()
    assert tok.eos_id in stream and all(0 <= t < tok.vocab_size for t in stream)
    segments = " ".join(map(str, stream)).split(f" {tok.eos_id} ")[1:-1]  # drop the possibly partial ends
    assert len(segments) > 10
    for seg in segments:
        assert tok.decode([int(t) for t in seg.split()]) in docs[:30]


def test_resume_gives_identical_batches(env, short_docs, tmp_path):
    path = _write_jsonl(tmp_path / "small.jsonl", [{"text": d} for d in short_docs])  # k batches cross an epoch
    cfg = _cfg(env, path=str(path), tokenizer=str(env["tok"].path))
    kwargs = {"vocab_size": VOCAB, "seq_len": 16, "micro_batch_size": 4, "seed": 11}
    reference = build_loader(cfg, **kwargs)
    expected = _batches(reference, 25)

    first = build_loader(cfg, **kwargs)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(_batches(first, 9), expected[:9], strict=True))
    state = json.loads(json.dumps(first.state_dict()))  # plain python values only
    assert state["epoch"] >= 1 and state["packer"]["tokens"]

    resumed = build_loader(cfg, **kwargs)
    resumed.load_state_dict(state)
    for (a_in, a_tg), (b_in, b_tg) in zip(_batches(resumed, 16), expected[9:], strict=True):
        assert torch.equal(a_in, b_in) and torch.equal(a_tg, b_tg)
    assert resumed.state_dict() == reference.state_dict()


def test_bad_layout_fails_before_reading_data(env, docs):
    cfg = _cfg(env, path="/does/not/exist")
    with pytest.raises(ValueError, match="dp_rank=2"):
        build_loader(cfg, vocab_size=VOCAB, seq_len=8, micro_batch_size=1, seed=0, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="seq_len=0"):
        build_loader(cfg, vocab_size=VOCAB, seq_len=0, micro_batch_size=1, seed=0)
    with pytest.raises(ConfigError, match="fewer than the 4 data-parallel ranks"):
        _loader(docs[:3], env["tok"], dp_rank=0, dp_size=4)


def test_resume_rejects_a_different_stream(env, docs):
    state = _loader(docs, env["tok"], seed=1).state_dict()
    with pytest.raises(ConfigError, match=r"train\.seed"):
        _loader(docs, env["tok"], seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="data-parallel size"):
        _loader(docs, env["tok"], seed=1, dp_size=2).load_state_dict(state)


def test_dp_ranks_read_disjoint_streams_covering_each_epoch(env, short_docs):
    tok, small = env["tok"], short_docs[:11]
    ranks = [_loader(small, tok, seed=5, dp_rank=r, dp_size=2) for r in range(2)]
    for epoch in range(3):
        orders = [r.epoch_document_order(epoch) for r in ranks]
        assert not set(orders[0]) & set(orders[1])
        assert sorted(orders[0] + orders[1]) == list(range(len(small)))
    for r in ranks:
        batches = _batches(r, 20)
        stream = _expected_stream(r, small, tok, r.epoch + 1)
        got = [[*b[0][i].tolist(), b[1][i, -1].item()] for b in batches for i in range(3)]
        assert got == [stream[i * 16 : i * 16 + 17] for i in range(len(got))]
    fresh = [_loader(small, tok, seed=5, dp_rank=r, dp_size=2).next_batch()[0] for r in range(2)]
    assert not torch.equal(fresh[0], fresh[1])


def test_each_epoch_is_reshuffled_deterministically(env, docs):
    tok = env["tok"]
    a, b, c = (_loader(docs, tok, seed=s) for s in (7, 7, 8))
    order0, order1 = a.epoch_document_order(0), a.epoch_document_order(1)
    assert sorted(order0) == sorted(order1) == list(range(len(docs)))
    assert order0 != order1
    assert b.epoch_document_order(1) == order1 and c.epoch_document_order(0) != order0
    assert _loader(docs, tok, seed=7, shuffle=False).epoch_document_order(1) == list(range(len(docs)))
    for (x_in, x_tg), (y_in, y_tg) in zip(_batches(a, 5), _batches(b, 5), strict=True):
        assert torch.equal(x_in, y_in) and torch.equal(x_tg, y_tg)
    seed7 = torch.cat([x for x, _ in _batches(_loader(docs, tok, seed=7), 5)])
    seed8 = torch.cat([next(iter(c))[0] for _ in range(5)])  # (iteration yields the same batches)
    assert not torch.equal(seed7, seed8)


def test_counters_and_skipped_documents(env, short_docs, tmp_path):
    docs = short_docs[:10]
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs] + [{"text": ""}, {"text": None}])
    cfg = _cfg(env, path=str(path), tokenizer=str(env["tok"].path))
    loader = build_loader(cfg, vocab_size=VOCAB, seq_len=32, micro_batch_size=2, seed=0)
    assert loader.skipped_documents == 2 and len(loader.documents) == 10
    _batches(loader, 30)
    # The epoch counter agrees with the oracle stream: the tokens emitted need part of the current epoch.
    needed = 30 * 2 * 32 + 1
    assert len(_expected_stream(loader, docs, env["tok"], loader.epoch)) < needed
    assert len(_expected_stream(loader, docs, env["tok"], loader.epoch + 1)) >= needed
    assert 10 * loader.epoch < loader.documents_consumed <= 10 * (loader.epoch + 1)
    assert loader.tokens_produced == 30 * 2 * 32 and loader.batches_produced == 30
