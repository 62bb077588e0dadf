"""Reading a torch checkpoint into another layout: gate_up rows across TP degrees, bf16_sr -> master_weights."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from hlat.backends.torch.backend import TorchBackend
from hlat.backends.torch.dist import gate_up_interleaved
from hlat.backends.torch.reshard import reorder_gate_up
from hlat.config import ClusterConfig, PrecisionConfig
from hlat.optim import param_groups
from hlat.parallel import ParallelDims
from tests.conftest import backend_config
from tests.integration.test_data_parallel import MASTER, OPT, TINY, batches
from tests.unit.test_precision import precision

pytestmark = pytest.mark.bitwise  # resharded AdamW state and the master's rounding, bit for bit

BF16_SR = precision("bf16_sr")


def test_gate_up_rows_move_from_one_tp_order_to_another() -> None:
    """Rows labelled by their index in [gate; up]: a TP 2 run stores [g0; u0; g1; u1], TP 4 [g0; u0; ... g3; u3]."""
    rows = torch.arange(16.0)[:, None]  # gate = rows 0-7, up = rows 8-15
    tp2 = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15.0])[:, None]
    assert torch.equal(gate_up_interleaved(rows, 2), tp2)
    assert torch.equal(reorder_gate_up(tp2, 2, 1), rows)
    assert torch.equal(reorder_gate_up(rows, 1, 2), tp2)
    assert torch.equal(reorder_gate_up(tp2, 2, 4), gate_up_interleaved(rows, 4))
    assert torch.equal(reorder_gate_up(tp2, 2, 2), tp2)


def build(precision: PrecisionConfig) -> tuple[TorchBackend, torch.nn.Module, torch.optim.Optimizer]:
    backend = TorchBackend(
        backend_config(model=TINY, cluster=ClusterConfig(num_threads=1), precision=precision, optimizer=OPT)
    )
    backend.setup()
    model = backend.build_model(ParallelDims(1, 1, 1, 1))
    return backend, model, backend.build_optimizer(model, param_groups(model, OPT))


def step(backend: TorchBackend, model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    b = batches(n)
    backend.forward_backward(model, [(b[:, :-1], b[:, 1:])], 1)
    backend.update(model, opt)
    opt.zero_grad(set_to_none=True)


def test_a_bf16_sr_checkpoint_resumes_with_master_weights_from_its_bf16_weights(tmp_path: Path, caplog) -> None:
    """precision bf16_sr -> master_weights (HLAT-70B's mode): the fp32 masters start as the bf16 weights, the bf16
    moments continue in fp32 (both exact), the step count is kept, and training goes on with the masters."""
    backend, model, opt = build(BF16_SR)
    for n in range(2):
        step(backend, model, opt, n)
    backend.save(tmp_path, model, opt, {}, async_save=False)
    saved = {name: (p.detach().clone(), opt.state[p]) for name, p in model.named_parameters()}

    backend, model, opt = build(MASTER)
    with caplog.at_level(logging.INFO, logger="hlat.backends.torch.backend"):
        backend.load(tmp_path, model, opt)
    assert "has no fp32 master weights" in caplog.text and "start as its bf16 weights" in caplog.text
    for name, p in model.named_parameters():
        weight, state = saved[name]
        now = opt.state[p]
        assert torch.equal(p, weight), name
        assert now["master"].dtype == torch.float32 and torch.equal(now["master"], weight.float()), name
        for k in ("exp_avg", "exp_avg_sq"):
            assert now[k].dtype == torch.float32 and torch.equal(now[k], state[k].float()), (name, k)
        assert int(now["step"]) == int(state["step"]) == 2, name
    step(backend, model, opt, 2)
    p = model.layers[0].attn.qkv.weight
    assert int(opt.state[p]["step"]) == 3 and torch.equal(p, opt.state[p]["master"].bfloat16())  # RNE of the master
