"""Every refusal says its fix: the key or file, what is wrong (with the value), and what to set or run instead.

Issue 33, item 5. The bad-input list of ``test_bad_input`` checks that each bad input gets one clean line; here
each line must also name the way on, and where it suggests a value, that value must be accepted. Subprocesses only
where the command line's exit code is the subject.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pyarrow as pa
import pytest

from hlat import checkpoint
from hlat.config import ConfigError
from tests.conftest import compose_cfg, run_config
from tests.unit.test_bad_input import TINY, one_clean_error, train_py

# ----------------------------------------------------------------------------------------- 1. numeric ranges


def numeric_keys() -> list[tuple[str, type, str]]:
    """Every int or float key of the schema, nullable ones too: ``(key, section class, field name)``."""
    from hlat.config import RunConfig

    keys = []
    for section in dataclasses.fields(RunConfig):
        if section.name == "eval":  # EvalConfig words its checks with its tasks (hlat.config.ops), not this helper
            continue
        cls = section.default_factory
        numeric = [f.name for f in dataclasses.fields(cls) if f.type.split(" | ")[0] in ("int", "float")]
        keys += [(f"{section.name}.{name}", cls, name) for name in numeric]
    return keys


NUMERIC = numeric_keys()
NEGATIVE_OK = {"train.seed", "fault.seed"}
"""The numeric keys that take a negative value; every other one must refuse -1 with the message below."""


@pytest.mark.parametrize("value", [0, -1])
@pytest.mark.parametrize(("key", "cls", "name"), NUMERIC, ids=[k for k, _, _ in NUMERIC])
def test_a_number_out_of_range_names_the_key_the_value_and_the_range_to_set(
    key: str, cls: type, name: str, value: int
) -> None:
    """A new numeric key cannot fall back to "must be positive": its refusal has to say what to set instead."""
    from hlat.config.base import show

    kind = float if next(f for f in dataclasses.fields(cls) if f.name == name).type.startswith("float") else int
    try:
        cls(**{name: kind(value)})
    except ConfigError as e:
        msg = str(e)
    else:
        assert value == 0 or key in NEGATIVE_OK, f"{key}={value} is accepted"
        return
    k = re.escape(key)
    rule = r"(be [>=]+ \S+|lie in [\[(]\S+, \S+[\])])( or null \(.+?\))?( \(.+\))?"
    m = re.fullmatch(
        rf"{k}={re.escape(show(kind(value)))} must {rule}; set it in that range, e\.g\. {k}=(?P<ex>\S+)", msg
    )
    assert m, msg
    example = None if m["ex"] == "null" else kind(float(m["ex"]))
    cls(**{name: example})  # the value the message suggests is one the schema takes


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.steps=0", "train.steps=0 must be >= 1; set it in that range, e.g. train.steps=200"),
        (
            "optimizer.beta2=1.5",
            "optimizer.beta2=1.5 must lie in [0, 1); set it in that range, e.g. optimizer.beta2=0.95",
        ),
        (
            "cluster.num_threads=0",
            "cluster.num_threads=0 must be >= 1 or null (torch's default); set it in that range, "
            "e.g. cluster.num_threads=8",
        ),
        (
            "train.checkpoint_every=-5",
            "train.checkpoint_every=-5 must be >= 0 (0: only after the last step); set it in "
            "that range, e.g. train.checkpoint_every=100",
        ),
        (
            "optimizer.min_lr=1.0",
            "optimizer.min_lr=1.0 must lie in [0, 0.0003] (0 up to optimizer.lr); set it in that "
            "range, e.g. optimizer.min_lr=3e-05",
        ),
        (
            "fault.kill_at=[0,4]",
            "fault.kill_at=[0, 4] holds a step below 1: steps count from 1 (the first optimizer "
            "step); keep the steps >= 1, e.g. fault.kill_at=[4]",
        ),
        (
            "data.text_column=''",
            "data.text_column is empty; set it to the column (or JSONL key) that holds the "
            "documents, e.g. data.text_column=text",
        ),
    ],
)
def test_range_refusals_read_as_documented(override: str, message: str) -> None:
    from hlat.config import to_run_config

    with pytest.raises(ConfigError) as e:
        to_run_config(compose_cfg(override))
    assert str(e.value) == message


# ---------------------------------------------------------------------------- 2. data that cannot be read or continued

STREAM = dict(version=3, seed=1, shuffle=True, global_batch_size=16, data="3|a.jsonl:9", tokenizer="a1")
"""A saved online-loader identity (``hlat.data.loader.stream_identity`` and the state version)."""


def test_a_corpus_cut_in_half_before_a_rerun_names_the_file_its_sizes_and_both_ways_on(tmp_path: Path) -> None:
    from hlat.data.loader import CHECKPOINT, check_identity
    from hlat.data.sources import TextSource

    rows = [json.dumps({"text": f"document {i}"}) + "\n" for i in range(3000)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(rows))
    saved = {**STREAM, "data": TextSource(corpus).fingerprint}
    before = corpus.stat().st_size
    corpus.write_text("".join(rows[:1500]))  # cut in half between the kill and the rerun
    with pytest.raises(ConfigError) as e:
        check_identity(saved, {**saved, "data": TextSource(corpus).fingerprint})
    msg = str(e.value)
    assert msg.startswith(
        "cannot resume the data stream exactly: the data (data.path) changed since the checkpoint "
        f"was saved: corpus.jsonl has {corpus.stat().st_size:,} bytes now, {before:,} then, "
        "1,500 rows now, 3,000 then. "
    )
    assert msg.endswith(
        "Resume with the data as it was, or start a new run (a new hydra.run.dir; "
        f"train.init_from={CHECKPOINT} keeps its trained weights)"
    )
    assert "|" not in msg  # not the raw fingerprint


IDENTITY_CHANGES = {
    "seed": ({"seed": 2}, "train.seed was 1, is 2 now", "Resume with train.seed=1"),
    "shuffle": ({"shuffle": False}, "data.shuffle was true, is false now", "Resume with data.shuffle=true"),
    "global_batch_size": (
        {"global_batch_size": 32},
        "train.global_batch_size was 16, is 32 now",
        "Resume with train.global_batch_size=16",
    ),
    "loader": ({"loader": "offline_packed"}, "data.loader was online, is offline_packed now", "data.loader=online"),
    "tokenizer": (
        {"tokenizer": "b2"},
        "the tokenizer is not the one the checkpoint was trained with",
        "Resume with the same tokenizer",
    ),
    "files": (
        {"data": "4|a.jsonl:10|c.jsonl:7"},
        "c.jsonl is new, a.jsonl has 10 bytes now, 9 then, 4 rows now, 3 then",
        "data as it was",
    ),
}


@pytest.mark.parametrize("change", list(IDENTITY_CHANGES))
def test_every_change_of_the_data_stream_is_named_with_the_setting_to_restore(change: str) -> None:
    from hlat.data.loader import check_identity

    saved = STREAM
    new, what, fix = IDENTITY_CHANGES[change]
    with pytest.raises(ConfigError) as e:
        check_identity(saved, {**saved, **new})
    assert what in str(e.value) and fix in str(e.value) and "start a new run" in str(e.value)
    with pytest.raises(
        ConfigError,
        match=r"version 1, this hlat reads version 3: resume with the hlat that wrote it, or start a new run",
    ):
        check_identity({**saved, "version": 1}, saved)


def latin1_jsonl(path: Path, rows: int = 3) -> Path:
    """A JSON Lines file written in Latin-1, as a Windows tool might: every document has an 'é' (byte 0xe9)."""
    path.write_bytes(b"".join(b'{"text": "caf\xe9 number %d"}\n' % i for i in range(rows)))
    return path


def test_a_latin1_jsonl_names_the_line_and_byte_and_how_to_re_encode_it(tmp_path: Path) -> None:
    from hlat.config import DataConfig
    from hlat.data import build_loader, load_documents

    path = latin1_jsonl(tmp_path / "corpus.jsonl")
    with pytest.raises(ConfigError) as e:  # before any tokenizer is trained
        build_loader(
            DataConfig(path=str(path), cache_dir=str(tmp_path / "cache")),
            vocab_size=512,
            seq_len=8,
            micro_batch_size=1,
            seed=0,
        )
    offset = path.read_bytes().index(b"\xe9")
    assert str(e.value) == (
        f"data.path={path} holds no documents: every value of data.text_column='text' is null, blank or not UTF-8; "
        f"line 1 of {path} (byte offset {offset}) is not UTF-8: re-encode the file to UTF-8, e.g. `iconv -f latin1 "
        f"-t utf-8 {path} > {tmp_path / 'corpus.utf8.jsonl'}` for Latin-1 text, and point data.path at the result"
    )
    fixed = tmp_path / "corpus.utf8.jsonl"  # what the iconv command writes
    fixed.write_bytes(path.read_bytes().decode("latin1").encode("utf-8"))
    assert load_documents(fixed).texts == [f"caf\u00e9 number {i}" for i in range(3)]
    assert not (tmp_path / "cache" / "tokenizers").exists()


def test_other_text_that_is_not_utf8_is_named_with_its_fix(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from hlat.data.sources import TextSource

    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": pa.array([None, b"caf\xe9"], pa.binary())}), parquet)
    msg = str(TextSource(parquet).no_documents("every value"))
    assert f"row 1 of {parquet} is not UTF-8: write data.text_column as UTF-8 text" in msg
    utf16 = tmp_path / "docs.jsonl"
    utf16.write_bytes('{"text": "hello"}\n'.encode("utf-16"))
    with pytest.raises(
        ConfigError,
        match=r"docs\.jsonl is UTF-16 text, not the UTF-8 that JSON Lines is: re-encode "
        r"it, e\.g\. `iconv -f utf-16 -t utf-8 ",
    ):
        TextSource(utf16)
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": " "}\n{"text": null}\n')
    assert str(TextSource(blank).no_documents("every value")).endswith(
        "is null, blank or not UTF-8; point data.path / data.text_column at text"
    )


@pytest.mark.parametrize("vocab", ["-5", "0", "259"])
def test_hlat_data_tokenizer_refuses_a_vocabulary_too_small_before_reading_the_data(
    tmp_path: Path, capsys, vocab: str
) -> None:
    from hlat.cli import main

    with pytest.raises(SystemExit) as e:
        main(
            [
                "data",
                "tokenizer",
                "--data",
                str(tmp_path / "nowhere.jsonl"),
                "--vocab-size",
                vocab,
                "--output",
                str(tmp_path / "t.model"),
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"hlat: error: --vocab-size={vocab} must be >= 260 to train a tokenizer (256 byte-fallback")
    assert err.endswith("set it in that range, e.g. --vocab-size=4096 (LLaMA's is 32000)\n")
    assert "INTERNAL" not in err and "nowhere" not in err  # sentencepiece never ran, the data was never read


def test_a_vocabulary_below_what_the_data_needs_names_the_size_that_is_enough(tmp_path: Path, capsys) -> None:
    from pydoc_data.topics import topics

    from hlat.cli import main
    from hlat.config import DataConfig
    from hlat.data import load_or_train_tokenizer

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics)[:30]))
    argv = [
        "data",
        "tokenizer",
        "--data",
        str(data),
        "--output",
        str(tmp_path / "t.model"),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--vocab-size",
    ]
    with pytest.raises(SystemExit):
        main([*argv, "300"])
    err = capsys.readouterr().err
    needed = re.search(r"this data needs at least (\d+) pieces \(.*\); raise --vocab-size to \1 or more", err)
    assert needed and "INTERNAL" not in err and "character_coverage" not in err, err
    main([*argv, needed[1]])  # the size named is enough
    assert f"{needed[1]}-piece bpe tokenizer" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"^model\.vocab_size=100 must be >= 260 to train a tokenizer"):
        load_or_train_tokenizer(DataConfig(), ["a document"], 100, tmp_path / "cache")  # the training run's path


def test_unreadable_data_and_tokenizer_files_say_what_to_do(tmp_path: Path) -> None:
    from hlat.data.prepare import prepare
    from hlat.data.sources import TextSource
    from hlat.data.tokenizer import load_tokenizer

    (tmp_path / "array.json").write_text('[{"text": "a JSON array is not JSON Lines"}]\n')
    with pytest.raises(
        ConfigError,
        match=r"could not be read as JSON Lines .*: fix the file, or convert it with "
        r"`hlat data prepare`, which skips the lines that are not JSON$",
    ):
        TextSource(tmp_path / "array.json")
    (tmp_path / "x.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(
        ConfigError,
        match=r"data\.tokenizer=.*x\.model is not a sentencepiece model .*; point it at "
        r"a sentencepiece \.model file .* or set data\.tokenizer=null",
    ):
        load_tokenizer(tmp_path / "x.model", 512)
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(
        ConfigError,
        match=r"INPUT .*x\.parquet is not a Parquet file .*; if it holds JSON Lines or "
        r"Arrow, give it that suffix",
    ):
        prepare([tmp_path / "x.parquet"], tmp_path / "out", progress=False)
    with pytest.raises(
        ConfigError,
        match=r"^--shard-rows=0 must be >= 1 \(documents per shard\); e\.g\. "
        r"--shard-rows=100000$",
    ):
        prepare([tmp_path / "x.parquet"], tmp_path / "out", shard_rows=0, progress=False)


# ------------------------------------------------------------------ 3. files, layouts, commands and halts


def refusal(call) -> str:
    """The message of the ConfigError or ValueError ``call()`` raises."""
    with pytest.raises(ValueError) as e:  # ConfigError is a ValueError
        call()
    return str(e.value)


def test_layout_resume_import_and_launch_refusals_say_what_to_do(tmp_path: Path) -> None:
    from hlat.checkpoint.hf_layout import import_hf, model_config_from_hf
    from hlat.config import ModelConfig, ParallelismConfig, TrainConfig
    from hlat.deploy.render import check_name
    from hlat.parallel import ParallelDims

    six = ModelConfig(n_layers=6)
    msg = refusal(lambda: ParallelDims.build(ParallelismConfig(pp=4), 4, six, TrainConfig()))
    assert msg.endswith("set parallelism.pp to one of [1, 2, 3, 6]")
    msg = refusal(lambda: checkpoint.resolve(str(tmp_path)))
    assert msg.endswith(
        "point train.resume at a checkpoint or a checkpoints directory that holds one, or use "
        "train.resume=auto (this run's own checkpoints) or train.resume=never (start fresh)"
    )
    msg = refusal(lambda: checkpoint.resolve(str(tmp_path), key="eval.checkpoint"))  # hlat eval's setting
    assert msg.endswith("point eval.checkpoint at a checkpoint or a checkpoints directory that holds one")
    assert "train.resume" not in msg
    assert refusal(lambda: check_name("My_Run")).endswith("pass such a name with --name, e.g. --name hlat-7b")
    msg = refusal(lambda: import_hf(tmp_path))
    assert msg.endswith(
        "give the directory that holds config.json and the *.safetensors weights (save_pretrained writes both)"
    )
    assert "import the directory of a Hugging Face LLaMA model" in refusal(lambda: model_config_from_hf({}, "x"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--size", "0"],
            "--size=0 --seconds=1.0 --repeats=5: the size and the repeats must be >= 1 and the seconds > 0; "
            "e.g. --size 2048 --seconds 1 --repeats 5",
        ),
        (["--dtypes", "float33"], "--dtypes: unknown torch dtype 'float33'; use a name such as 'float32'"),
    ],
)
def test_hlat_bench_peak_refuses_bad_options_with_usage_not_a_traceback(tmp_path: Path, capsys, argv, message) -> None:
    from hlat.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "peak", "--cache-dir", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"hlat bench peak: error: {message}" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing measured, nothing cached


def test_a_halt_says_to_continue_only_from_a_checkpoint_that_exists(tmp_path: Path, cache_dir: Path) -> None:
    from hlat.state import HaltedError, NonFiniteError
    from hlat.train.resume import halt_message
    from hlat.train.run import main

    root = tmp_path / "run" / "checkpoints"
    cfg = run_config(
        *TINY,
        "tracker=console",
        f"data.cache_dir={cache_dir}",
        "fault=nonfinite",
        "fault.nonfinite_at=[2]",
        "train.log_every=1",
    )
    with pytest.raises(HaltedError) as e:  # before the first save (train.checkpoint_every=100)
        main(cfg, run_dir=tmp_path / "run")
    assert str(e.value) == (
        f"step 2: the loss or the gradient norm is not finite (train.on_nonfinite=halt); there is no checkpoint in "
        f"{root} to continue from. Lower optimizer.lr or raise optimizer.warmup_steps, or set "
        "train.on_nonfinite=skip_step (drop such a step's update), or save before step 2 (train.checkpoint_every "
        "below 2) so that rollback has a checkpoint; then run the command again: it starts from step 0"
    )
    assert checkpoint.latest(root) is None
    first = halt_message(NonFiniteError(1), "train.on_nonfinite=halt", None, root)
    assert "skip_step (drop such a step's update); then run" in first  # nothing can be saved before step 1
    saved = halt_message(NonFiniteError(9), "train.on_nonfinite=halt", root / "step_00000008", root)
    assert saved.endswith(
        f"the newest valid checkpoint is {root / 'step_00000008'}. Lower optimizer.lr or raise "
        "optimizer.warmup_steps, or set train.on_nonfinite=rollback / skip_step, then continue from "
        "that checkpoint in the same run directory (train.resume=auto)"
    )


@pytest.mark.slow
def test_train_py_on_a_corpus_cut_in_half_since_its_checkpoint_exits_2_naming_the_file_and_both_ways_on(
    tmp_path: Path,
) -> None:
    from pydoc_data.topics import topics

    rows = [json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics)[:60]]
    corpus, run_dir = tmp_path / "corpus.jsonl", tmp_path / "run"
    corpus.write_text("".join(rows))
    args = [
        *TINY,
        "model.vocab_size=512",
        f"data.path={corpus}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "tracker=console",
        f"hydra.run.dir={run_dir}",
    ]
    first = train_py(*args, cwd=tmp_path)  # two steps, checkpointed after the last
    assert first.returncode == 0, first.stderr[-3000:]
    before = corpus.stat().st_size
    corpus.write_text("".join(rows[:30]))
    line = one_clean_error(train_py(*args, "train.steps=4", cwd=tmp_path))
    ckpt = run_dir / "checkpoints" / "step_00000002"
    assert line.startswith(
        f"hlat: configuration error: {ckpt}: cannot resume the data stream exactly: the data "
        f"(data.path) changed since the checkpoint was saved: corpus.jsonl has "
        f"{corpus.stat().st_size:,} bytes now, {before:,} then, 30 rows now, 60 then"
    )
    assert line.endswith(f"start a new run (a new hydra.run.dir; train.init_from={ckpt} keeps its trained weights)")
