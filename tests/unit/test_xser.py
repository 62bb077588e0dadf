"""hlat's own reader and writer of neuron-backend (NxD xser) checkpoints, on synthetic full tensors.

The real oracle is the NxD lane (``tests/neuron/test_nxd_cpu_mode.py``: NxD 0.17 loads what the writer wrote, and
the writer reproduces NxD's own files); here: the cuts against NxD's ``create_local_weight`` formula, round trips
through every layout, and bad input refused before anything is written.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from hlat import checkpoint
from hlat.backends.neuron_shards import tp_gather, tp_split, zero1_gather, zero1_split
from hlat.checkpoint.hf_layout import expected_shapes
from hlat.checkpoint.weights import check_torch_backend, read_weights
from hlat.checkpoint.xser import NeuronCheckpoint, load_pickle
from hlat.checkpoint.xser_reshard import read_counts
from hlat.checkpoint.xser_write import resharded_copy, write_neuron_checkpoint
from hlat.config import ConfigError, RunConfig
from hlat.parallel import ParallelDims
from tests.conftest import run_config

MICRO = (
    "cluster=xla_cpu",
    "model.n_layers=2",
    "model.dim=32",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=48",
    "model.vocab_size=64",
    "train.seq_len=16",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
)


class Tensors:
    """A reader over full tensors in memory (the interface ``write_neuron_checkpoint`` reads)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.data = tensors

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(v.shape), v.dtype) for k, v in self.data.items()}

    def read(self, name: str) -> torch.Tensor:
        return self.data[name]

    def extra(self) -> dict[str, Any]:
        return {"train_state": {"step": 7}, "data": {"position": 3}}


def full_state(cfg: RunConfig, *, masters: bool) -> dict[str, torch.Tensor]:
    """Random full weights and AdamW state of ``cfg``'s model, in the torch backend's names and dtypes."""
    gen = torch.Generator().manual_seed(0)
    low = getattr(torch, cfg.precision.param_dtype)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg.model).items():
        out[f"model.{name}"] = torch.randn(shape, generator=gen).to(low)
        out[f"optimizer.state.{name}.step"] = torch.tensor(7.0)
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"optimizer.state.{name}.{key}"] = torch.randn(shape, generator=gen)
        if masters:
            out[f"optimizer.state.{name}.master"] = torch.randn(shape, generator=gen)
    return out


def nxd_cut(full: torch.Tensor, dim: int, stride: int, rank: int, tp: int) -> torch.Tensor:
    """NxD's ``create_local_weight``: rank ``rank``'s stride-interleaved blocks of ``full`` along ``dim``."""
    per = full.shape[dim] // tp // stride
    return torch.cat(full.split(per, dim=dim)[rank::tp], dim=dim)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_pieces_are_nxds_cuts_and_gather_back(tp: int) -> None:
    """Each weight's pieces are NxD's cuts (column, row, vocabulary, gate_up stride 2; qkv as [q; k; v] of the
    rank's heads, kv heads tiled at tp=4 > 2 kv heads as on trn1), and the pieces gather back to the full weight.

    Catches: gate_up taken as contiguous rows, row-parallel cut on the wrong dim, the qkv groups not un-interleaved,
    kv heads repeated per head instead of tiled.
    """
    cfg = run_config(*MICRO).model
    G, r, D = cfg.kv_heads, cfg.n_heads // cfg.kv_heads, cfg.head_dim
    cuts = {"lm_head.weight": (0, 1), "embed.weight": (0, 1), "layers.0.attn.o_proj.weight": (1, 1)}
    cuts |= {"layers.0.mlp.down.weight": (1, 1), "layers.0.mlp.gate_up.weight": (0, 2)}
    for name, shape in expected_shapes(cfg).items():
        full = torch.randn(shape)
        pieces = tp_split(name, full, cfg, tp)
        assert torch.equal(tp_gather(name, pieces, cfg), full), name
        for rank, piece in enumerate(pieces):
            if name.endswith("attn.qkv.weight"):
                g = full.view(G, r + 2, D, cfg.dim)
                q, k, v = g[:, :r].reshape(-1, cfg.dim), g[:, r].reshape(-1, cfg.dim), g[:, r + 1].reshape(-1, cfg.dim)
                m = max(1, tp // G)
                want = torch.cat([nxd_cut(t, 0, 1, rank, tp) for t in (q, k.repeat(m, 1), v.repeat(m, 1))])
            elif name in cuts or name.replace("layers.1.", "layers.0.") in cuts:
                want = nxd_cut(full, *cuts[name.replace("layers.1.", "layers.0.")], rank, tp)
            else:
                want = full  # norms: replicated
            assert torch.equal(piece, want), (name, rank)


def test_zero1_chunks_pad_and_gather_back() -> None:
    """Dim 0 padded to a multiple of dp (torch-xla's ZeRO-1), equal chunks, and back without the padding."""
    t = torch.randn(5, 3)
    chunks = zero1_split(t, 2)
    assert [c.shape[0] for c in chunks] == [3, 3] and torch.equal(chunks[1][2], torch.zeros(3))
    assert torch.equal(zero1_gather(chunks, 5), t)


@pytest.mark.parametrize(
    "layout, dp, precision",
    [
        pytest.param(("parallelism.tp=2", "parallelism.pp=2"), 1, "fp32", id="tp2xpp2"),
        pytest.param(("parallelism.tp=4", "parallelism.zero1=true"), 2, "master_weights", id="tp4-zero1-dp2"),
    ],
)
def test_written_layouts_read_back_bitwise(tmp_path: Path, layout: tuple[str, ...], dp: int, precision: str) -> None:
    """Full tensors written in a layout (TP, PP, DP, ZeRO-1 with fp32 masters) and read back are equal bit for bit,
    with the torch backend's names, shapes and dtypes; rank extras, NxD's markers and an intact manifest are there."""
    cfg = run_config(*MICRO, *layout, f"precision={precision}")
    state = full_state(cfg, masters=cfg.precision.master_weights)
    write_neuron_checkpoint(Tensors(state), tmp_path / "step_00000007", cfg, dp=dp)
    back = NeuronCheckpoint(tmp_path / "step_00000007")
    assert back.tensors() == Tensors(state).tensors()
    assert all(torch.equal(back.read(k), v) for k, v in state.items())
    assert back.extra() == Tensors(state).extra()
    world = cfg.parallelism.tp * cfg.parallelism.pp * dp
    assert sorted(p.name for p in back.path.glob("extra.rank*.pt")) == [f"extra.rank{r}.pt" for r in range(world)]
    assert (back.path / "done").is_file() and not (tmp_path / "step_00000007.tmp").exists()


def test_eval_and_export_read_a_neuron_checkpoints_weights(tmp_path: Path) -> None:
    """``read_weights`` (``hlat eval``, ``hlat export``, ``train.init_from``) takes a neuron checkpoint: the full
    weights in the tp=1 layout, into the model's own tensors."""
    cfg = run_config(*MICRO, "parallelism.tp=2", "parallelism.pp=2")
    state = full_state(cfg, masters=False)
    write_neuron_checkpoint(Tensors(state), tmp_path / "step_00000007", cfg)
    check_torch_backend(tmp_path / "step_00000007")
    into = {k: torch.empty(v[0]) for k, v in Tensors(state).tensors().items() if k.startswith("model.")}
    into = {k.removeprefix("model."): v for k, v in into.items()}
    got = read_weights(tmp_path / "step_00000007", cfg.model, into=into)
    assert got is into and all(torch.equal(v, state[f"model.{k}"]) for k, v in got.items())


def test_bf16_sr_state_gets_masters_widened_from_its_weights(tmp_path: Path) -> None:
    """bf16_sr -> master_weights, the one well-defined precision change: the masters are the bf16 weights in fp32."""
    src, dst = (
        run_config(*MICRO, "precision=bf16_sr"),
        run_config(*MICRO, "precision=master_weights", "parallelism.zero1=true"),
    )
    state = full_state(src, masters=False)
    write_neuron_checkpoint(Tensors(state), tmp_path / "out", dst)
    back = NeuronCheckpoint(tmp_path / "out")
    w = "layers.1.mlp.down.weight"
    assert torch.equal(back.read(f"optimizer.state.{w}.master"), state[f"model.{w}"].float())


@pytest.mark.parametrize(
    "change, message",
    [
        pytest.param({"optimizer.state.embed.weight.ema": torch.zeros(1)}, "ema", id="unknown-state"),
        pytest.param({"model.layers.0.attn.bias": torch.zeros(1)}, "layers.0.attn.bias", id="unknown-weight"),
        pytest.param({"model.norm.weight": None}, "missing ['norm.weight']", id="missing"),
        pytest.param({"model.lm_head.weight": torch.zeros(3, 3)}, "lm_head.weight (3, 3)", id="shape"),
        pytest.param({"optimizer.state.norm.weight.master": torch.zeros(32)}, "master", id="masters-dropped"),
    ],
)
def test_a_source_that_does_not_fit_is_refused_before_anything_is_written(
    tmp_path: Path, change: dict[str, torch.Tensor | None], message: str
) -> None:
    """Unknown tensors are never dropped, missing or misshapen ones are named, fp32 masters a precision without them
    would lose are refused; no directory is left behind."""
    cfg = run_config(*MICRO, "parallelism.tp=2")
    state = full_state(cfg, masters=False)
    for k, v in change.items():
        state.pop(k) if v is None else state.__setitem__(k, v)
    with pytest.raises(ConfigError, match=re.escape(message)):
        write_neuron_checkpoint(Tensors(state), tmp_path / "out", cfg)
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_or_incomplete_checkpoint_is_refused_naming_the_file(tmp_path: Path) -> None:
    """A truncated tensor file fails the manifest's checks, a config whose parameter groups differ from the saved
    ones is refused (the moments would land on other parameters), a rank's file gone fails the layout's check, and
    an existing directory is never written over."""
    cfg = run_config(*MICRO, "parallelism.tp=2")
    write_neuron_checkpoint(Tensors(full_state(cfg, masters=False)), tmp_path / "out", cfg)
    f = next((tmp_path / "out" / "model").glob("*tp_rank_01*.tensors/tensor_3.pt"))
    f.write_bytes(f.read_bytes()[:-8])
    with pytest.raises(ConfigError, match=re.escape("tensor_3.pt has")):
        NeuronCheckpoint(tmp_path / "out")
    other = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, decay_norms_and_biases=False))
    with pytest.raises(ConfigError, match=re.escape("parameter groups of [15] parameters")):
        NeuronCheckpoint(tmp_path / "out", other, verify=False)
    (tmp_path / "out" / "optim" / "dp_rank_00_tp_rank_01_pp_rank_00.pt").unlink()
    with pytest.raises(ConfigError, match=re.escape("no optim/dp_rank_00_tp_rank_01_pp_rank_00.pt")):
        NeuronCheckpoint(tmp_path / "out", cfg, verify=False)
    with pytest.raises(ConfigError, match="exists"):
        write_neuron_checkpoint(Tensors({}), tmp_path / "out", cfg)


def test_a_resharded_resume_refuses_a_piece_missing_or_misshapen_naming_its_file(tmp_path: Path) -> None:
    """The ranged reader checks each file as it reads it (it lists no other rank's): a tensor file gone or holding
    another shape than its layout gives is named, and no copy is left beside the checkpoint."""
    cfg, now = run_config(*MICRO, "parallelism.tp=2"), run_config(*MICRO)
    src = write_neuron_checkpoint(Tensors(full_state(cfg, masters=False)), tmp_path / "step_00000007", cfg)
    model = src / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt.tensors"
    (model / "tensor_2.pt").unlink()
    with pytest.raises(ConfigError, match=re.escape("tp_rank_01_pp_rank_00.pt.tensors/tensor_2.pt: it is incomplete")):
        resharded_copy(src, now, ParallelDims(1, 1, 1, 1), 0)
    torch.save(torch.zeros(3), model / "tensor_2.pt")
    info = load_pickle(model.with_name("dp_rank_00_tp_rank_01_pp_rank_00.pt.info.pt"))
    info[2]["shape"] = torch.Size([3])  # as if the writer had saved another tensor there
    torch.save(info, model.with_name("dp_rank_00_tp_rank_01_pp_rank_00.pt.info.pt"))
    with pytest.raises(ConfigError, match=re.escape("tensor_2.pt holds (3,), its layout gives")):
        resharded_copy(src, now, ParallelDims(1, 1, 1, 1), 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000007"]


def test_a_neuron_checkpoint_may_resume_in_another_tp_or_pp_but_not_another_dtype(tmp_path: Path) -> None:
    """``check_compatible``: parallelism.tp and .pp may change between a neuron checkpoint and a neuron run (hlat
    reshards), a storage dtype still may not."""
    from hlat import checkpoint

    cfg = run_config(*MICRO, "parallelism.tp=2")
    write_neuron_checkpoint(Tensors(full_state(cfg, masters=False)), tmp_path / "out", cfg)
    now = dataclasses.asdict(run_config(*MICRO, "parallelism.pp=2"))
    checkpoint.check_compatible(tmp_path / "out", now)
    bf16 = dataclasses.asdict(run_config(*MICRO, "precision=bf16"))
    with pytest.raises(
        ConfigError, match=re.escape("precision.param_dtype='float32' in the checkpoint but 'bfloat16' now")
    ):
        checkpoint.check_compatible(tmp_path / "out", bf16)


LARGER = ("model.dim=128", "model.ffn_dim=512", "model.vocab_size=1024")
"""Pieces of 32-512 KiB: their bytes, not the ~10 KiB of pickles and zip headers a file costs, are what is read."""


def bytes_read() -> int:
    """What this process has read through read(2) and its kin so far: the kernel's count (``/proc/self/io``)."""
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar"))[7:])


@pytest.mark.parametrize(
    "saved, saved_dp, now, dp, full_reads",
    [
        pytest.param(("parallelism.tp=2",), 1, ("parallelism.tp=1",), 1, 1.0, id="tp2-to-tp1"),
        pytest.param(("parallelism.tp=1",), 1, ("parallelism.tp=2",), 1, 1.9, id="tp1-to-tp2"),
        pytest.param(
            ("parallelism.tp=4", "parallelism.zero1=true", "precision=master_weights"),
            2,
            ("parallelism.tp=2", "parallelism.zero1=true", "precision=master_weights"),
            3,
            4.0,
            id="tp4-to-tp2-zero1",
        ),
        pytest.param(
            ("parallelism.pp=2", "precision=bf16_sr"),
            1,
            ("precision=master_weights", "parallelism.zero1=true"),
            2,
            1.0,
            id="pp2-to-pp1-masters",
        ),
    ],
)
def test_a_resharded_resume_reads_about_what_each_rank_holds(
    tmp_path: Path, saved: tuple[str, ...], saved_dp: int, now: tuple[str, ...], dp: int, full_reads: float
) -> None:
    """Every rank's resharded copy (``resharded_copy``, what a resume on another layout runs) reads at most 1.5x the
    tensor bytes it holds, as the kernel counts them (pickles and zip headers included), and its files are those the
    full-tensor path writes (the path before ranged reads: the oracle), bit for bit. The planner's count
    (``read_counts``) gives the bytes held exactly, and no more than the copy and the full path read.

    Catches: a rank reading whole tensors or other ranks' pieces (the full path reads 2x what a rank holds at TP 1 ->
    2, 5x at TP 4 -> 2 with ZeRO-1: ``full_reads``, asserted: the measure sees it), a wrong range (a kv head, a
    gate_up half, a row-parallel column block, a ZeRO-1 chunk or its padding, a master widened from a bf16_sr weight),
    a planner that undercounts.
    """
    src_cfg, cfg = run_config(*MICRO, *LARGER, *saved), run_config(*MICRO, *LARGER, *now)
    src = tmp_path / "step_00000007"
    write_neuron_checkpoint(
        Tensors(full_state(src_cfg, masters=src_cfg.precision.master_weights)), src, src_cfg, dp=saved_dp
    )
    par = cfg.parallelism
    dims = ParallelDims(par.tp * par.pp * dp, par.tp, par.pp, dp)
    counts = read_counts(src_cfg, saved_dp, cfg, dp)
    full = write_neuron_checkpoint(NeuronCheckpoint(src, verify=False), tmp_path / "full", cfg, dp=dp)  # the oracle
    held = []
    for rank in range(dims.world_size):
        start = bytes_read()
        copy = resharded_copy(src, cfg, dims, rank)
        read = bytes_read() - start
        assert copy is not None
        held.append(0)
        for f in sorted(p.relative_to(copy) for p in copy.rglob("*.pt")):  # the rank's files, with its extra
            a, b = load_pickle(copy / f), load_pickle(full / f)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), (rank, f)
                held[rank] += a.nbytes
            else:
                assert repr(a) == repr(b), (rank, f)
        assert read <= 1.5 * held[rank], f"rank {rank} read {read} bytes to hold {held[rank]}"
        assert counts[rank].held == held[rank] and counts[rank].after <= read
        assert checkpoint.problems(copy, checksums=True) == []  # a manifest of sizes: read once, not hashed
        shutil.rmtree(copy)
    start = bytes_read()
    write_neuron_checkpoint(NeuronCheckpoint(src, verify=False, mapped=False), tmp_path / "rank0", cfg, dp=dp, rank=0)
    full_read = bytes_read() - start
    assert counts[0].before <= full_read and full_read > full_reads * held[0]  # whole tensors: the measure sees them
