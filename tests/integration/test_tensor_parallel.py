"""Tensor (+ sequence) parallelism on the torch backend: two CPU ranks over gloo against one process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hlat.backends.torch.backend import TorchBackend
from hlat.backends.torch.dist import gate_up_in_model_order
from hlat.config import ClusterConfig, ParallelismConfig, PrecisionConfig
from hlat.parallel import ParallelDims
from tests.conftest import backend_config
from tests.integration.test_data_parallel import TINY, batches, free_port
from tests.timeouts import hang_guard

pytestmark = pytest.mark.slow


def forward_backward(tp: int, sp: bool) -> dict[str, torch.Tensor]:
    """Logits, loss and every gradient (gathered whole, gate_up rows in the model's [gate; up] order)."""
    par = ParallelismConfig(tp=tp, sequence_parallel=sp)
    backend = TorchBackend(backend_config(model=TINY, cluster=ClusterConfig(num_threads=1), parallelism=par))
    backend.setup()
    model = backend.build_model(ParallelDims(tp, tp, 1, 1))
    b = batches(0)
    logits = model(b[:, :-1])
    loss = backend.loss(model, b[:, :-1], b[:, 1:])
    loss.backward()
    norm = backend.clip_grad_norm(model, 0.0)
    out = {"logits": logits.detach(), "loss": loss.detach(), "grad_norm": norm.detach()}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if name.endswith("gate_up.weight") and tp > 1:  # undo the per-rank interleave of the gate and up rows
            g = gate_up_in_model_order(g, tp)
        out[f"grad.{name}"] = g.detach().clone()
    return out


def _worker(rank: int, port: int, sp: bool, out: str) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    result = forward_backward(2, sp)
    if rank == 0:
        torch.save(result, out)
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_gives_the_logits_loss_and_gradients_of_one_process(tmp_path: Path, sp: bool) -> None:
    torch.set_num_threads(1)
    one = forward_backward(1, False)
    out = str(tmp_path / "tp2.pt")
    mp.spawn(_worker, args=(free_port(), sp, out), nprocs=2, join=True)
    two = torch.load(out, weights_only=True)
    assert one.keys() == two.keys()
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-6, msg=k)


def test_python_train_py_tp2_sp_trains_resumes_and_matches_one_process(tmp_path: Path, cache_dir: Path) -> None:
    """``cluster=cpu_x2 parallelism=tp2``: both ranks read the same data, so the loss per step is one process's
    (up to fp32 reduction order), also across a checkpoint of DTensor shards resumed by one process at TP 1 (the
    weights and AdamW state resharded), which the same MLflow run records as ``restart.changed.parallelism.tp``."""
    from mlflow import MlflowClient

    from hlat.train.run import main
    from tests.conftest import run_config
    from tests.integration.test_train import SMALL_RUN, cli

    common = [
        *SMALL_RUN,
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.checkpoint_every=4",
        "train.log_every=2",
        "optimizer.warmup_steps=2",
        "optimizer.decay_steps=6",
        f"data.cache_dir={cache_dir}",
        "tracker.plots=false",
        "tracker.system_metrics=false",
        "tracker.flush_every_s=0",
        "health=off",
    ]
    db, run_dir = tmp_path / "mlflow.db", tmp_path / "tp2"
    here = [f"tracker.uri=sqlite:///{db}", f"hydra.run.dir={run_dir}"]
    tp2 = [*common, *here, "cluster=cpu_x2", "parallelism=tp2", "parallelism.sequence_parallel=true"]
    # The second leg resumes the first one's checkpoint in one process, without TP.
    for leg in ([*tp2, "train.steps=4"], [*common, *here, "train.steps=8"]):
        r = cli(*leg, cwd=tmp_path, timeout=hang_guard(900))
        assert r.returncode == 0, r.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.tags["restart.changed.parallelism.tp"] == "2 -> 1"
    tp_loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    one = dict(
        main(run_config(*common, "train.steps=8", "tracker=console"), run_dir=tmp_path / "one").history.series(
            "train/loss"
        )
    )
    assert sorted(tp_loss) == list(range(1, 9))
    for step, value in one.items():
        assert tp_loss[step] == pytest.approx(value, abs=2e-3), step


def train_tp(tp: int, precision: PrecisionConfig, sp: bool = True) -> dict[str, torch.Tensor]:
    """STEPS AdamW steps on the same global batches; the losses and the final weights gathered whole."""
    from hlat.optim import param_groups
    from tests.integration.test_data_parallel import OPT, STEPS

    par = ParallelismConfig(tp=tp, sequence_parallel=sp and tp > 1)
    backend = TorchBackend(
        backend_config(
            model=TINY, cluster=ClusterConfig(num_threads=1), precision=precision, parallelism=par, optimizer=OPT
        )
    )
    backend.setup()
    model = backend.build_model(ParallelDims(tp, tp, 1, 1))
    opt = backend.build_optimizer(model, param_groups(model, OPT))
    losses = []
    for step in range(STEPS):
        b = batches(step)
        loss = backend.loss(model, b[:, :-1], b[:, 1:])
        loss.backward()
        if precision.master_weights:  # the fp32 accumulation hooks survived parallelize_module
            assert all(p.main_grad is not None and p.grad is None for p in model.parameters())
        backend.clip_grad_norm(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    out = {"loss": torch.stack(losses)}
    for name, p in model.named_parameters():
        w = p.full_tensor() if hasattr(p, "full_tensor") else p
        if name.endswith("gate_up.weight") and tp > 1:
            w = gate_up_in_model_order(w, tp)
        out[name] = w.detach().float().clone()
    return out


def _train_worker(rank: int, port: int, precision: PrecisionConfig, out: str, sp: bool = True) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.save(train_tp(2, precision, sp), f"{out}.rank{rank}")
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("mode", ["bf16", "bf16_sr", "master_weights"])
def test_tp2_trains_bf16_weights_like_one_process(tmp_path: Path, mode: str) -> None:
    """bf16 parameters under TP2 + SP: PrecisionAdamW rounds each shard (round-to-nearest or stochastically),
    or keeps fp32 master shards with fp32 gradient accumulation.

    bf16 matmuls sum in another order when split, and AdamW turns tiny gradient differences into update flips of
    up to 2 x lr on single elements, so weights cannot match elementwise; the losses of 3 steps match closely and
    every weight agrees on average to a fraction of one step's lr (plus one ulp of rounding noise under SR, whose
    bits for a weight depend on where it falls in the shard's random stream). Replicated weights (the norms) stay
    bitwise equal on both ranks, also under stochastic rounding (every rank draws the same bits for them).
    """
    from tests.integration.test_data_parallel import OPT

    torch.set_num_threads(1)
    sr, master = mode == "bf16_sr", mode == "master_weights"
    p = PrecisionConfig(
        name=mode,
        param_dtype="bfloat16",
        compute_dtype="bfloat16",
        stochastic_rounding=sr,
        master_weights=master,
        fp32_grad_accum=master,
        fp32_reduce=master,
    )
    one = train_tp(1, p)
    out = str(tmp_path / "tp2.pt")
    mp.spawn(_train_worker, args=(free_port(), p, out), nprocs=2, join=True)
    two, other = (torch.load(f"{out}.rank{r}", weights_only=True) for r in (0, 1))
    assert one.keys() == two.keys()
    torch.testing.assert_close(two.pop("loss"), one.pop("loss"), rtol=0, atol=5e-3)
    for k in one:
        noise = 2**-7 * one[k].abs().mean() if sr else 0.0  # SR: up to one bf16 ulp per element, other bits here
        assert (two[k] - one[k]).abs().mean() < 0.25 * OPT.lr + noise, k
        assert torch.equal(two[k], other[k]), k  # gathered shards and replicated norms agree across the ranks


def _tp_dp_worker(rank: int, port: int, out: str) -> None:
    """Rank ``rank`` of TP 2 x DP 2: the tp pair (rank // 2) takes its half of every global batch."""
    from hlat.optim import param_groups
    from tests.integration.test_data_parallel import OPT, STEPS

    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    par = ParallelismConfig(tp=2, sequence_parallel=True, zero1=True)
    backend = TorchBackend(
        backend_config(model=TINY, cluster=ClusterConfig(num_threads=1), parallelism=par, optimizer=OPT)
    )
    backend.setup()
    model = backend.build_model(ParallelDims(4, 2, 1, 2))
    opt = backend.build_optimizer(model, param_groups(model, OPT))
    losses = []
    for step in range(STEPS):
        b = batches(step).chunk(2)[rank // 2]
        loss = backend.loss(model, b[:, :-1], b[:, 1:])
        loss.backward()
        backend.clip_grad_norm(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    result = {"loss": torch.stack(losses)}
    for name, p in model.named_parameters():
        w = p.full_tensor()
        if name.endswith("gate_up.weight"):
            w = gate_up_in_model_order(w, 2)
        result[name] = w.detach().clone()
    torch.save(result, f"{out}.rank{rank}")
    torch.distributed.destroy_process_group()


def test_tp2_x_dp2_trains_like_one_process(tmp_path: Path) -> None:
    """A (dp 2, tp 2) mesh: DTensor TP inside, FSDP2 over dp (``zero1`` then changes nothing: FSDP2 shards the
    AdamW state already). After 3 fp32 AdamW steps every weight is one process's on the whole batch (AdamW turns
    reduction-order differences into up to ~5e-5 at lr 1e-2), on all four ranks; the dp halves' mean loss is its loss.
    """
    torch.set_num_threads(1)
    one = train_tp(1, PrecisionConfig())
    out = str(tmp_path / "tpdp.pt")
    mp.spawn(_tp_dp_worker, args=(free_port(), out), nprocs=4, join=True)
    ranks = [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(4)]
    torch.testing.assert_close((ranks[0]["loss"] + ranks[2]["loss"]) / 2, one["loss"], rtol=1e-5, atol=1e-6)
    for k in one:
        if k != "loss":
            for r in ranks:
                torch.testing.assert_close(r[k], one[k], rtol=1e-4, atol=1e-4, msg=k)  # measured: max 4.4e-5


def test_tp2_without_sp_trains_like_one_process(tmp_path: Path) -> None:
    """Without SP the norms stay plain tensors beside DTensor weights; AdamW's foreach kernels need them in groups
    of their own. 3 fp32 steps end at one process's weights (AdamW-amplified reduction order aside)."""
    torch.set_num_threads(1)
    one = train_tp(1, PrecisionConfig())
    out = str(tmp_path / "tp2.pt")
    mp.spawn(_train_worker, args=(free_port(), PrecisionConfig(), out, False), nprocs=2, join=True)
    two = torch.load(f"{out}.rank0", weights_only=True)
    torch.testing.assert_close(two.pop("loss"), one.pop("loss"), rtol=1e-5, atol=1e-6)
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-4, msg=k)
