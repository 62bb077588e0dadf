"""Resuming a torch-backend checkpoint on another layout: TP, ZeRO-1, FSDP and the DP degree changed on load.

Four CPU ranks over gloo run four legs, each resuming the previous leg's checkpoint in another layout; then one
process resumes the first. The oracle of "restored exactly" is the checkpoint itself read whole by DCP's own
``dcp_to_torch_save`` (gate_up rows put in model order for the TP degree that wrote it): every tensor each rank holds
after the load, model and AdamW state, gathered whole, must equal it bit for bit, and together the ranks hold all of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from hlat.backends.torch.backend import TorchBackend
from hlat.backends.torch.dist import gate_up_in_model_order, mean_over_ranks
from hlat.config import ClusterConfig, ParallelismConfig
from hlat.optim import param_groups
from hlat.parallel import ParallelDims
from tests.conftest import backend_config
from tests.integration.test_data_parallel import OPT, TINY, batches, free_port, torchrun_env

pytestmark = [pytest.mark.slow, pytest.mark.bitwise]  # ZeRO-1 on -> off at DP 4 and DCP's restore, bit for bit

WORLD = 4
LEGS = (  # (tp, sequence_parallel, zero1) on 4 ranks; each leg resumes the previous one's checkpoint
    (2, True, False),  # TP 2 + SP inside, FSDP2 over dp 2
    (1, False, True),  # TP 2 -> 1, FSDP off, ZeRO-1 on, DP 2 -> 4
    (1, False, False),  # ZeRO-1 off at the same DP: the same arithmetic
    (2, False, False),  # TP 1 -> 2 (no SP), FSDP on, DP 4 -> 2
)
STEPS = 2
"""Steps each leg trains after its load, then again (the unchanged layout's losses) after its save."""
LOSS_RTOL = 1e-5
"""A TP or DP change sums the same fp32 products in another order (the split matmuls, the gradient all-reduce): the
resumed forward, on bitwise-equal weights, differs by rounding alone, a few fp32 ulps (eps 1.2e-7) per reduction
over at most 176 terms, and the step after it by AdamW's response to such gradient differences. The multi-rank
tests in test_tensor_parallel.py hold 3 steps from scratch to the same bound; a layout bug (a scrambled shard, a
lost moment) moves the loss by 1e-2 or more."""


def build(tp: int, sp: bool, zero1: bool, world: int) -> tuple[TorchBackend, torch.nn.Module, torch.optim.Optimizer]:
    par = ParallelismConfig(tp=tp, sequence_parallel=sp, zero1=zero1)
    backend = TorchBackend(
        backend_config(model=TINY, cluster=ClusterConfig(num_threads=1), parallelism=par, optimizer=OPT)
    )
    backend.setup()
    model = backend.build_model(ParallelDims(world, tp, 1, world // tp))
    return backend, model, backend.build_optimizer(model, param_groups(model, OPT))


def train(backend: TorchBackend, model, opt, first: int, rank: int, world: int) -> list[float]:
    """STEPS steps from step ``first``; the dp group of ``rank`` takes its share of every global batch."""
    dp = world // backend.tp
    losses = []
    for step in range(first, first + STEPS):
        b = batches(step).chunk(dp)[rank // backend.tp]
        loss = backend.loss(model, b[:, :-1], b[:, 1:])
        loss.backward()
        backend.clip_grad_norm(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(mean_over_ranks(loss.detach())))  # the mean over dp groups of equal shares
    return losses


def whole(state: dict, tp: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of (nested) ``state``, gathered whole, gate_up rows in the model's order, by flat name."""
    out = {}
    for k, v in state.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= whole(v, tp, f"{name}.")
        elif torch.is_tensor(v):
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[name] = gate_up_in_model_order(v, tp) if ".mlp.gate_up.weight" in name and tp > 1 and v.ndim else v
    return out


def save(backend: TorchBackend, model, opt, path: Path, rank: int) -> None:
    """The checkpoint, its manifest's config (the TP degree that wrote it) and its oracle, ``path``.pt."""
    path.mkdir(parents=True, exist_ok=True)
    backend.save(path, model, opt, {}, async_save=False)
    if rank == 0:
        (path / "manifest.json").write_text(json.dumps({"files": {}, "config": {"parallelism": {"tp": backend.tp}}}))
        dcp_to_torch_save(path, f"{path}.pt")
        full = torch.load(f"{path}.pt", weights_only=True)
        torch.save(
            whole({"model": full["model"], "optimizer": {"state": full["optimizer"]["state"]}}, backend.tp),
            f"{path}.pt",
        )


def check_restored(backend: TorchBackend, model, opt, oracle: Path) -> tuple[list[str], list[str]]:
    """The names this rank holds after the load, and those of them that differ from the checkpoint's tensors."""
    expected = torch.load(oracle, weights_only=True)
    state = {"model": model.state_dict(), "optimizer": {"state": backend._optim_state(model, opt)["state"]}}
    got = whole(state, backend.tp)
    return sorted(got), [k for k, v in got.items() if not torch.equal(v, expected[k])]


def _legs(rank: int, port: int, tmp: str) -> None:
    torchrun_env(rank, WORLD, port)
    torch.set_num_threads(1)
    result: dict = {"resumed": [], "unchanged": [], "held": [], "differ": [], "weights": {}}
    for i, (tp, sp, zero1) in enumerate(LEGS):
        backend, model, opt = build(tp, sp, zero1, WORLD)
        first = STEPS * i  # the previous leg saved after step STEPS * i
        if i > 0:
            backend.load(Path(tmp) / f"leg{i - 1}", model, opt)
            held, differ = check_restored(backend, model, opt, Path(tmp) / f"leg{i - 1}.pt")
            result["held"].append(held)
            result["differ"].append(differ)
        result["resumed"].append(train(backend, model, opt, first, rank, WORLD))
        if i == 2:  # the weights after the resumed steps of ZeRO-1 -> off (leg 1's continuation holds the same steps)
            result["weights"]["resumed"] = {k: v.clone() for k, v in whole(model.state_dict(), tp).items()}
        if i < len(LEGS) - 1:
            save(backend, model, opt, Path(tmp) / f"leg{i}", rank)
            torch.distributed.barrier()  # the oracle is written
            result["unchanged"].append(train(backend, model, opt, first + STEPS, rank, WORLD))
            if i == 1:
                result["weights"]["unchanged"] = whole(model.state_dict(), tp)
    torch.save(result, Path(tmp) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_layout_changes_restore_every_tensor_and_continue_the_losses(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    mp.spawn(_legs, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for i in range(1, len(LEGS)):
        oracle = torch.load(tmp_path / f"leg{i - 1}.pt", weights_only=True)
        assert all(r["differ"][i - 1] == [] for r in ranks), [r["differ"][i - 1] for r in ranks]
        assert set().union(*(r["held"][i - 1] for r in ranks)) == set(oracle), i  # ZeRO-1: each rank its share
    # ZeRO-1 -> off at DP 4 changes no arithmetic: each weight's AdamW step runs whole on one rank or on all, and DDP
    # all-reduces in the same bucket layout on every start (hlat.backends.torch.dist.data_parallel). So the weights
    # after the resumed steps are bitwise those of the run that went on under ZeRO-1, on any ISA. (The losses alone
    # were too weak an oracle: with DDP's bucket rebuild the first step after a restart differed by fp32 rounding
    # in 13 of 15 gradients, and the two losses compared showed it on some kernels and hid it on others.)
    for r in ranks:
        weights = r["weights"]
        assert [k for k, v in weights["resumed"].items() if not torch.equal(v, weights["unchanged"][k])] == []
    assert ranks[0]["resumed"][2] == ranks[0]["unchanged"][1]
    for i in (1, 3):  # TP changed: within fp32 reduction order
        torch.testing.assert_close(
            torch.tensor(ranks[0]["resumed"][i]), torch.tensor(ranks[0]["unchanged"][i - 1]), rtol=LOSS_RTOL, atol=0
        )

    # One process resumes the first leg's TP 2 x DP 2 checkpoint: TP 2 -> 1, DP 2 -> 1, no FSDP.
    backend, model, opt = build(1, False, False, 1)
    backend.load(tmp_path / "leg0", model, opt)
    held, differ = check_restored(backend, model, opt, tmp_path / "leg0.pt")
    assert differ == [] and set(held) == set(torch.load(tmp_path / "leg0.pt", weights_only=True))
    torch.testing.assert_close(
        torch.tensor(train(backend, model, opt, STEPS, 0, 1)),
        torch.tensor(ranks[0]["unchanged"][0]),
        rtol=LOSS_RTOL,
        atol=0,
    )
