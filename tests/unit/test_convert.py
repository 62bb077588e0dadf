"""hlat convert: torch <-> torch <-> HF, tensor by tensor; bad sources refused before anything is written; atomic."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hlat import checkpoint
from hlat.backends.torch.backend import TorchBackend
from hlat.backends.torch.dist import _interleave_gate_up
from hlat.backends.torch.precision import build_optimizer
from hlat.checkpoint import portable, ranges, safetensors_io, weights
from hlat.checkpoint.convert import open_checkpoint
from hlat.config import (
    ConfigError,
    DataConfig,
    OptimizerConfig,
    ParallelismConfig,
    PrecisionConfig,
    RunConfig,
    TrainConfig,
)
from hlat.eval import hf
from hlat.optim import param_groups
from hlat.state import TrainState
from tests.timeouts import hang_guard
from tests.unit.test_hf import CFG, logits, random_model, tok, tokens  # noqa: F401  tok: the module's tokenizer

ROOT = Path(__file__).resolve().parents[2]
MASTER = PrecisionConfig(name="master_weights", param_dtype="bfloat16", compute_dtype="bfloat16", master_weights=True)


def save_trained(root: Path, tok, precision: PrecisionConfig = MASTER, tp: int = 1) -> Path:  # noqa: F811
    """A checkpoint after one real AdamW step of the precision's optimizer, saved by the Checkpointer and backend.

    With ``tp`` > 1 the weights and their moments are saved in the row order a tensor-parallel run saves gate_up.
    """
    cfg = RunConfig(
        model=CFG,
        data=DataConfig(cache_dir=str(tok.path.parents[1])),
        train=TrainConfig(seq_len=32),
        optimizer=OptimizerConfig(warmup_steps=10),
        precision=precision,
        parallelism=ParallelismConfig(tp=tp),
    )
    model = random_model(dtype=torch.bfloat16 if precision.param_dtype == "bfloat16" else torch.float32).train()
    opt = build_optimizer(param_groups(model, cfg.optimizer), cfg.optimizer, cfg.precision, 0)
    model(tokens()).float().logsumexp(-1).mean().backward()
    opt.step()
    for block in model.layers if tp > 1 else ():
        w = block.mlp.gate_up.weight
        for t in (w, *(v for k, v in opt.state[w].items() if k != "step")):
            _interleave_gate_up(t, tp)
    config = dataclasses.asdict(cfg)
    extra = {"train_state": {"step": 1, "tokens_seen": 64}, "data": {"tokenizer": tok.fingerprint}}
    saver = checkpoint.Checkpointer(
        TorchBackend(cfg),
        root,
        model,
        opt,
        lambda s: extra,
        every=0,
        last_step=1,
        keep_last=0,
        async_save=False,
        meta={"config": config, "config_hash": checkpoint.config_hash(config), "data_id": "abc"},
    )
    saver.save(TrainState(step=1))
    saver.close()
    return saver.last_saved


@pytest.fixture(scope="module")
def source(tok, tmp_path_factory) -> Path:  # noqa: F811
    return save_trained(tmp_path_factory.mktemp("convert") / "checkpoints", tok)


def everything(path: Path) -> dict[str, torch.Tensor]:
    reader = open_checkpoint(path)
    return {k: reader.read(k) for k in reader.tensors()}


def files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_torch_to_torch_keeps_every_tensor_bitwise(source, tmp_path) -> None:
    before = files(source)
    out = hf.convert(source.parent, tmp_path / "copy", "torch")  # a checkpoints root: its newest checkpoint
    assert checkpoint.problems(out, checksums=True) == [] and files(source) == before  # the source is untouched
    want, got = everything(source), everything(out)
    assert {k for k in want if k.endswith(".master")} and want.keys() == got.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    assert torch.load(out / "extra.rank0.pt", weights_only=True) == torch.load(source / "extra.rank0.pt")
    meta, old = checkpoint.manifest(out), checkpoint.manifest(source)
    assert meta["step"] == 1 and meta["config"] == old["config"] and meta["data_id"] == "abc"  # other keys carried
    assert meta["source"] == {"format": "torch-dcp", "path": str(source.resolve())} and "weights_only" not in meta
    assert checkpoint.resolve(str(out)) == out  # what train.resume=<out> accepts


def test_torch_to_neuron_to_torch_keeps_every_tensor_bitwise(source, tmp_path) -> None:
    """--to neuron writes NxD's xser layout (read back by hlat's own reader); back --to torch nothing has changed."""
    neuron = hf.convert(source, tmp_path / "neuron", "neuron")
    meta = checkpoint.manifest(neuron)
    assert meta["config"]["cluster"]["backend"] == "neuron" and meta["config"]["parallelism"]["zero1"]  # masters
    assert checkpoint.problems(neuron, checksums=True) == [] and (neuron / "model").is_dir()
    back = hf.convert(neuron, tmp_path / "torch", "torch")
    want, got = everything(source), everything(back)
    assert want.keys() == got.keys() == everything(neuron).keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    assert checkpoint.manifest(back)["source"]["format"] == "neuron-xser"
    # Resuming the neuron checkpoint on the torch backend as it is: refused before anything is built, naming the way.
    with pytest.raises(ConfigError, match=r"written by the neuron backend .* \(hlat convert .* --to torch\)"):
        checkpoint.check_compatible(neuron, checkpoint.manifest(source)["config"])


def test_a_tensor_parallel_checkpoint_becomes_the_tp1_layout(tok, source, tmp_path) -> None:  # noqa: F811
    """gate_up rows and their AdamW moments and master copy saved in a tp=2 run's order come back as [gate; up]."""
    tp2 = save_trained(tmp_path / "tp2", tok, tp=2)
    out = hf.convert(tp2, tmp_path / "tp1", "torch")
    assert checkpoint.manifest(out)["config"]["parallelism"]["tp"] == 1
    want, got = everything(source), everything(out)  # the same model and step, saved at tp=1
    gate_up = [k for k in want if "gate_up" in k and not k.endswith(".step")]
    assert len(gate_up) == 4 * CFG.n_layers and all(torch.equal(got[k], want[k]) for k in want)


def test_torch_to_hf_to_torch(source, tok, tmp_path) -> None:  # noqa: F811
    """Sharded HF output (an index): transformers loads it and computes hlat's logits; back to the same weights."""
    transformers = pytest.importorskip("transformers")
    out = hf.convert(source, tmp_path / "hf", "hf", dtype="float32", max_shard_bytes=40_000)
    index = json.loads((out / safetensors_io.INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / safetensors_io.SINGLE).exists()
    from safetensors.torch import load_file

    hf_tensors = {k: v for s in shards for k, v in load_file(str(out / s)).items()}
    assert hf_tensors.keys() == index["weight_map"].keys() and len(hf_tensors) == 3 + 9 * CFG.n_layers
    sd = {k.removeprefix("model."): v for k, v in everything(source).items() if k.startswith("model.")}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens()).logits, logits(CFG, {k: v.float() for k, v in sd.items()}))
    back = hf.convert(out, tmp_path / "back", "torch")  # weights only, in the HF files' dtype
    meta = checkpoint.manifest(back)
    assert meta["weights_only"] and meta["tokenizer"] == "tokenizer.model" and meta["source"]["format"] == "hf-llama"
    cfg, again, _ = weights.load_checkpoint_weights(back)  # what train.init_from and hlat eval read
    assert cfg == CFG and all(torch.equal(again[k], v.float()) for k, v in sd.items())
    bf16 = hf.convert(back, tmp_path / "bf16", "hf", dtype="bfloat16")
    assert all(torch.equal(v, hf_tensors[k].bfloat16()) for k, v in load_file(str(bf16 / "model.safetensors")).items())


class Watched:
    """A reader that measures, every ``every`` reads, the bytes of the storages it handed out that are still alive."""

    def __init__(self, reader: portable.Reader, every: int) -> None:
        self.reader, self.config, self.every, self.given, self.held = reader, reader.config, every, set(), []
        self.names: list[str] = []

    def tensors(self) -> dict:
        return self.reader.tensors()

    def extra(self) -> dict:
        return self.reader.extra()

    def read(self, name: str) -> torch.Tensor:
        # Every ``every`` reads, by count: storage addresses are reused once freed, so ``given`` may not grow.
        if len(self.names) % self.every == self.every - 1:  # a scan of every live object takes a while
            live = {  # a mapped tensor's pages are given up once written (ranges.release): its storage stays
                o.untyped_storage()._cdata: o.untyped_storage().nbytes()
                for o in gc.get_objects()
                if type(o) is torch.Tensor and (o.untyped_storage().resizable() or ranges.is_mapped(o))
            }
            self.held.append(sum(n for cdata, n in live.items() if cdata in self.given))
        t = self.reader.read(name)
        self.names.append(name)
        self.given.add(t.untyped_storage()._cdata)  # the storage's identity (views and detached copies share it)
        return t


def test_writers_read_each_tensor_once_and_hold_at_most_two(source, tmp_path) -> None:
    """The streaming claim: when a tensor is read, what was read before it and is still in memory is the tensor
    being written and, for DCP, what is read ahead (at most the largest tensor's bytes); HF reads one ahead."""
    specs = open_checkpoint(source).tensors()
    largest, total = max(map(safetensors_io.nbytes, specs.values())), sum(map(safetensors_io.nbytes, specs.values()))
    dcp_reader, hf_reader = Watched(open_checkpoint(source), 8), Watched(open_checkpoint(source), 3)
    (tmp_path / "dcp").mkdir()
    portable.write_torch(dcp_reader, tmp_path / "dcp", optimizer=True, meta={})
    (tmp_path / "hf").mkdir()
    portable.write_hf_weights(hf_reader, tmp_path / "hf", dtype=None, max_shard_bytes=10**9)
    assert total > 10 * largest and len(dcp_reader.held) > 5 and len(hf_reader.held) >= 3
    assert max(dcp_reader.held) <= 2 * largest and max(hf_reader.held) <= largest
    assert sorted(dcp_reader.names) == sorted(specs)  # read ahead, each once


def corrupt_config(src: Path, dst: Path, **changes: dict) -> Path:
    """A copy of ``src`` whose manifest records a changed config (its files, and so its checksums, intact)."""
    shutil.copytree(src, dst)
    meta = json.loads((dst / checkpoint.MANIFEST).read_text())
    for group, values in changes.items():
        meta["config"][group] |= values
    (dst / checkpoint.MANIFEST).write_text(json.dumps(meta))
    return dst


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": {"n_layers": 1}}, r"unknown: model\.layers\.1\.attn\.o_proj\.weight, .* and \d+ more"),
        ({"model": {"n_layers": 3}}, r"missing: model\.layers\.2\.attn\.o_proj\.weight"),
        (
            {"model": {"ffn_dim": 64}},
            r"wrong shape: model\.layers\.0\.mlp\.down\.weight \(64, 96\) \(expected \(64, 64\)\)",
        ),
        ({"precision": {"master_weights": False}}, r"unknown: optimizer\.state\.embed\.weight\.master"),
    ],
)
def test_tensors_that_do_not_fit_the_config_are_listed(source, tmp_path, changes, message) -> None:
    bad = corrupt_config(source, tmp_path / "bad", **changes)
    with pytest.raises(ConfigError, match=message + r".*Nothing was written"):
        hf.convert(bad, tmp_path / "out", "torch")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))


def test_damaged_sources_and_destinations_are_refused(source, tmp_path, capsys) -> None:
    damaged = shutil.copytree(source, tmp_path / "damaged")
    data = damaged / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1  # one bit: the size is right, the sha256 is not
    data.write_bytes(bytes(raw))
    truncated = shutil.copytree(source, tmp_path / "truncated")
    with open(truncated / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    cases = {
        damaged: r"damaged \(__0_0\.distcp does not match its sha256\)",
        truncated: r"damaged \(__0_0\.distcp has 1000 bytes, the manifest says",
        tmp_path / "nothing": "does not exist",
    }
    for src, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            hf.convert(src, tmp_path / "out", "torch")
        assert not (tmp_path / "out").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(ConfigError, match="full is not empty; choose a new directory or pass --overwrite"):
        hf.convert(source, tmp_path / "full", "torch")
    with pytest.raises(ConfigError, match=r"overlaps the source .* never writes into its source"):
        hf.convert(source, source / "inside", "torch", overwrite=True)
    assert hf.main(["convert", str(source), str(tmp_path / "full"), "--to", "torch", "--overwrite"]) == 0
    assert "continue training with train.resume=" in capsys.readouterr().out and not (tmp_path / "full" / "x").exists()
    hf_dir = hf.convert(source, tmp_path / "hf", "hf")
    with open(hf_dir / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 4)
    assert hf.main(["convert", str(hf_dir), str(tmp_path / "from_hf"), "--to", "torch"]) == 2
    assert "model.safetensors has" in capsys.readouterr().err and not (tmp_path / "from_hf").exists()


KILL_MID_WRITE = """
import sys, time
from pathlib import Path
from hlat.checkpoint import portable
from hlat.eval import hf

read, n = portable.TorchCheckpoint.read, [0]
def slow_read(self, name):
    n[0] += 1
    if n[0] == 5:  # some tensors are written: say so, then wait to be killed
        print("writing", flush=True)
        time.sleep(600)
    return read(self, name)
portable.TorchCheckpoint.read = slow_read
hf.convert(Path(sys.argv[1]), Path(sys.argv[2]), "torch")
"""


def test_a_failed_conversion_leaves_nothing(source, tmp_path, monkeypatch) -> None:
    read, n = portable.TorchCheckpoint.read, [0]

    def failing(self, name: str) -> torch.Tensor:
        n[0] += 1
        if n[0] == 5:
            raise OSError("disk gone")
        return read(self, name)

    monkeypatch.setattr(portable.TorchCheckpoint, "read", failing)
    for to in ("torch", "hf"):
        n[0] = 0
        with pytest.raises(OSError, match="disk gone"):
            hf.convert(source, tmp_path / "out", to)
        assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_conversion_killed_mid_write_leaves_no_destination(source, tmp_path) -> None:
    dst = tmp_path / "dst"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    child = subprocess.Popen(
        [sys.executable, "-c", KILL_MID_WRITE, str(source), str(dst)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout.readline().strip() == "writing"
        partial = dst.with_name(f"dst.tmp-{child.pid}")
        assert partial.is_dir()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=hang_guard(60))
    assert not dst.exists() and partial.is_dir()
    hf.convert(source, dst, "torch")  # the next conversion removes what the killed one left
    assert not partial.exists() and checkpoint.problems(dst, checksums=True) == []


@pytest.mark.slow
def test_a_converted_checkpoint_resumes_as_its_source(tmp_path, cache_dir) -> None:
    """Training on from the conversion gives, bit for bit, what training on from the original gives."""
    from hlat.train.run import main
    from tests.conftest import run_config
    from tests.unit.test_evaluate import TINY

    common = [*TINY, "precision=master_weights", f"data.cache_dir={cache_dir}"]
    main(run_config(*common), run_dir=tmp_path / "a")
    source = checkpoint.latest(tmp_path / "a" / "checkpoints")
    converted = hf.convert(source, tmp_path / "converted", "torch")
    for name, start in (("from_source", source), ("from_converted", converted)):
        main(run_config(*common, "train.steps=3", f"train.resume={start}"), run_dir=tmp_path / name)
    want = everything(checkpoint.latest(tmp_path / "from_source" / "checkpoints"))
    got = everything(checkpoint.latest(tmp_path / "from_converted" / "checkpoints"))
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert checkpoint.manifest(checkpoint.latest(tmp_path / "from_converted" / "checkpoints"))["step"] == 3


@pytest.mark.slow
def test_the_benchmark_runs_at_a_tiny_size(tmp_path) -> None:
    """bench/convert_checkpoint.py end to end on a tiny model: a row per arm asked for (one from each kind of source:
    a conversion and a resharded resume), and it removes what it wrote."""
    shape = ["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "256"]
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "convert_checkpoint.py"),
            "--dir",
            str(tmp_path),
            *shape,
            "--disk-gb",
            "0.01",
            "--arms",
            "hf,reshard",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        check=True,
        timeout=hang_guard(900),
    ).stdout
    assert [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "GB" not in line] == [
        "hf",
        "reshard",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]  # the tokenizer's cache only
