"""Tests of hlat.data.prepare and the `hlat data ...` commands."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from hlat.cli import main
from hlat.config import ConfigError
from hlat.data.prepare import prepare
from hlat.data.sources import TextSource


def _jsonl(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _read_shards(directory: Path) -> list[str | None]:
    source = TextSource(directory, "text")
    return [doc for batch in source.iter_rows() for doc in batch]


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def inputs(tmp_path: Path) -> dict:
    raw = tmp_path / "raw"
    raw.mkdir()
    jsonl = _jsonl(
        raw / "a.jsonl",
        [
            json.dumps({"text": "first json doc", "id": 1}).encode(),
            json.dumps({"text": None}).encode(),
            json.dumps({"text": "   \n"}).encode(),
            json.dumps({"text": 42}).encode(),
            b'{"text": "bad \xff\xfe bytes"}',  # invalid UTF-8 inside the document
            b'{"text": "ok despite", "other": "\xff"}',  # invalid UTF-8 in another field only
            json.dumps({"id": 7}).encode(),  # no text key: a null document
            b"{not json",
            json.dumps({"text": "lone \udcff surrogate"}).encode(),  # escaped surrogate: not encodable as UTF-8
            b"",  # a blank line between records is not a row
            json.dumps({"text": "last json doc \u00e9"}).encode(),
        ],
    )
    parquet = raw / "b.parquet"
    pq.write_table(pa.table({"text": pa.array([b"parquet one", None, b"", b"\xc3\x28", b"parquet two"])}), parquet)
    txt = tmp_path / "txt"
    txt.mkdir()
    (txt / "1.txt").write_text("A whole file\n\nis one document.\n")
    (txt / "2.txt").write_bytes(b"broken \xff text")
    (txt / "3.txt").write_text(" \n\n")
    (txt / "notes.md").write_text("ignored: not a supported extension")
    return {"jsonl": jsonl, "parquet": parquet, "txt": txt, "out": tmp_path / "shards"}


def test_prepare_converts_jsonl_parquet_and_text_into_readable_shards(inputs):
    report = prepare([inputs["jsonl"], inputs["parquet"], inputs["txt"]], inputs["out"], shard_rows=3, progress=False)
    expected = [
        "first json doc",
        "ok despite",
        "last json doc \u00e9",
        "parquet one",
        "parquet two",
        "A whole file\n\nis one document.\n",
    ]
    assert _read_shards(inputs["out"]) == expected
    assert report.documents == 6
    assert report.skipped == {"null": 3, "blank": 3, "not a string": 1, "invalid UTF-8": 4, "invalid JSON": 1}
    assert [p.name for p in report.shards] == ["shard-00000.arrow", "shard-00001.arrow"]
    assert sorted(p.name for p in inputs["out"].iterdir()) == ["shard-00000.arrow", "shard-00001.arrow"]
    with pa.memory_map(str(report.shards[0])) as source:  # the random-access file format, one large_string column
        reader = pa.ipc.open_file(source)
        assert reader.schema == pa.schema([("text", pa.large_string())])
        assert reader.read_all().num_rows == 3
    assert report.output_bytes == sum(p.stat().st_size for p in report.shards)
    assert "wrote 6 documents to 2 shards" in report.summary() and "4 invalid UTF-8" in report.summary()


def test_lines_mode_makes_one_document_per_non_blank_line(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_bytes(b"line one\r\n\n  \nline two  \nbad \xff line\nline three")
    report = prepare([path], tmp_path / "out", lines=True, progress=False)
    assert _read_shards(tmp_path / "out") == ["line one", "line two  ", "line three"]
    assert report.skipped == {"invalid UTF-8": 1}
    with pytest.raises(ConfigError, match=r"no documents.*invalid UTF-8"):  # without --lines: one invalid document
        prepare([path], tmp_path / "whole", progress=False)


@pytest.mark.parametrize("writer", [pa.ipc.new_stream, pa.ipc.new_file])  # HF's stream format and the file format
def test_arrow_input_and_other_column(tmp_path, writer):
    table = pa.table({"id": [1, 2, 3], "body": ["alpha", None, "gamma"]})
    path = tmp_path / "in.arrow"
    with pa.OSFile(str(path), "wb") as fh, writer(fh, table.schema) as w:
        w.write_table(table)
    report = prepare([path], tmp_path / "out", text_column="body", progress=False)
    assert _read_shards(tmp_path / "out") == ["alpha", "gamma"]
    assert report.skipped == {"null": 1}


def test_arrow_input_that_is_not_arrow(tmp_path):
    path = tmp_path / "fake.arrow"
    path.write_bytes(b"not arrow at all")
    with pytest.raises(ConfigError, match=r"INPUT: .*fake\.arrow is not an Arrow IPC file or stream"):
        prepare([path], tmp_path / "out", progress=False)


def test_prepare_refuses_bad_input_cleanly(inputs, tmp_path):
    with pytest.raises(ConfigError, match=r"INPUT .*missing.jsonl does not exist"):
        prepare([tmp_path / "missing.jsonl"], inputs["out"], progress=False)
    with pytest.raises(ConfigError, match=r"--text-column='body' is not a column"):
        prepare([inputs["parquet"]], inputs["out"], text_column="body", progress=False)
    with pytest.raises(ConfigError, match=r"--text-column='body' is not a key"):
        prepare([inputs["jsonl"]], inputs["out"], text_column="body", progress=False)
    assert not list(inputs["out"].glob("*.arrow"))  # nothing half-written is left for data.path to read
    blank = tmp_path / "blank.txt"
    blank.write_text("\n \n")
    with pytest.raises(ConfigError, match="no documents"):
        prepare([blank], inputs["out"], progress=False)
    prepare([inputs["parquet"]], inputs["out"], progress=False)
    with pytest.raises(ConfigError, match=r"--output .* already holds"):
        prepare([inputs["parquet"]], inputs["out"], progress=False)


def test_cli_prepare_prints_a_summary(inputs, capsys):
    code, out, _ = _run(["data", "prepare", str(inputs["parquet"]), "--output", str(inputs["out"])], capsys)
    assert code == 0
    assert "wrote 2 documents to 1 shards" in out and "skipped 3 rows" in out
    assert _read_shards(inputs["out"]) == ["parquet one", "parquet two"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["data", "prepare", "/does/not/exist.jsonl", "--output", "OUT"], "INPUT /does/not/exist.jsonl does not exist"),
        (["data", "prepare", "PARQUET", "--output", "OUT", "--text-column", "nope"], "--text-column='nope'"),
        (["data", "prepare", "PARQUET", "--output", "OUT", "--shard-rows", "0"], "--shard-rows=0"),
        (["data", "tokenizer", "--data", "/nope", "--vocab-size", "300", "--output", "OUT"], "--data=/nope"),
    ],
)
def test_cli_errors_are_one_clean_line_and_exit_2(inputs, capsys, argv, message):
    argv = [str(inputs["parquet"]) if a == "PARQUET" else str(inputs["out"]) if a == "OUT" else a for a in argv]
    code, _, err = _run(argv, capsys)
    assert code == 2
    assert err.startswith("hlat: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_usage_errors_and_help(capsys):
    code, _, err = _run(["data", "prepare", "x.jsonl"], capsys)  # --output missing: argparse's usage error
    assert code == 2 and "--output" in err
    code, out, _ = _run(["data", "--help"], capsys)
    assert code == 0 and "prepare" in out and "tokenizer" in out
    code, out, _ = _run(["--help"], capsys)
    assert code == 0 and "data" in out and "summary" in out


def test_cli_tokenizer_trains_a_model_of_the_requested_size(tmp_path, capsys):
    from pydoc_data.topics import topics

    docs = [topics[k] for k in sorted(topics)][:30]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    out = tmp_path / "tok" / "my.model"
    argv = ["data", "tokenizer", "--data", str(data), "--text-column", "body", "--vocab-size", "400"]
    code, stdout, _ = _run([*argv, "--output", str(out), "--cache-dir", str(tmp_path / "cache")], capsys)
    assert code == 0 and "400-piece bpe tokenizer" in stdout
    sp = spm.SentencePieceProcessor(model_file=str(out))
    assert sp.vocab_size() == 400 and sp.eos_id() == 2
    code, _, err = _run([*argv[:-1], "100000", "--output", str(out), "--cache-dir", str(tmp_path / "c")], capsys)
    assert code == 2 and err.startswith("hlat: error: ") and "--vocab-size" in err
