"""Data parallelism and ZeRO-1 on the torch backend: two CPU processes over gloo against one process."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hlat.backends.torch.backend import TorchBackend
from hlat.config import ClusterConfig, ModelConfig, OptimizerConfig, ParallelismConfig, PrecisionConfig
from hlat.optim import param_groups
from hlat.parallel import ParallelDims
from tests.conftest import backend_config
from tests.timeouts import hang_guard

TINY = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=128, max_seq_len=64)
OPT = OptimizerConfig(lr=1e-2, warmup_steps=0)
STEPS = 3


def batches(step: int) -> torch.Tensor:
    """The global batch of ``step``: 4 sequences of 17 tokens, the same in every process."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, TINY.vocab_size, (4, 17), generator=g)


def train(rank: int, world: int, zero1: bool, precision: PrecisionConfig) -> dict[str, torch.Tensor]:
    """STEPS optimizer steps; rank r of ``world`` takes its contiguous share of every global batch.

    Returns the final weights, and the first step's (reduced, clipped) gradients under ``grad.<name>``.
    """
    backend = TorchBackend(
        backend_config(
            model=TINY,
            cluster=ClusterConfig(num_threads=1),
            precision=precision,
            parallelism=ParallelismConfig(zero1=zero1),
            optimizer=OPT,
        )
    )
    backend.setup()
    dims = ParallelDims(world_size=world, tp=1, pp=1, dp=world)
    model = backend.build_model(dims)
    opt = backend.build_optimizer(model, param_groups(model, OPT))
    grads = {}
    for step in range(STEPS):
        b = batches(step).chunk(world)[rank]
        backend.loss(model, b[:, :-1], b[:, 1:]).backward()
        backend.clip_grad_norm(model, 1.0)
        if step == 0:
            grads = {f"grad.{n}": p.grad.float().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()} | grads


def _worker(rank: int, world: int, port: int, zero1: bool, precision: PrecisionConfig, out: str) -> None:
    torchrun_env(rank, world, port)
    state = train(rank, world, zero1, precision)
    if rank == 0:
        torch.save(state, out)
    torch.distributed.destroy_process_group()


def torchrun_env(rank: int, world: int, port: int) -> None:
    """Become rank ``rank`` of a ``world``-process job on this host, as torchrun's variables would make it."""
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks(tmp_path: Path, zero1: bool, precision: PrecisionConfig) -> dict[str, torch.Tensor]:
    out = str(tmp_path / f"dp2-{zero1}.pt")
    mp.spawn(_worker, args=(2, free_port(), zero1, precision, out), nprocs=2, join=True)
    return torch.load(out, weights_only=True)


def test_two_ranks_get_the_gradient_of_the_whole_batch(tmp_path: Path) -> None:
    """DDP averages the two halves' gradients: the gradient one process gets on the whole batch (fp32). Not slow (a
    few seconds): the fast suite's cover of the multi-process tests here and in test_tensor_parallel.py.

    (Weights after a few AdamW steps are not compared: Adam's first steps are ~lr * sign(g), so a last-bit
    difference in a near-zero gradient moves a weight by 2 lr.)
    """
    torch.set_num_threads(1)
    one = train(0, 1, False, PrecisionConfig())
    two = two_ranks(tmp_path, False, PrecisionConfig())
    assert one.keys() == two.keys()
    for k in (k for k in one if k.startswith("grad.")):
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-7, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero1_matches_plain_data_parallelism(tmp_path: Path, precision: str) -> None:
    """ZeRO-1 only moves where the AdamW state lives: the weights after 3 steps are bitwise those of plain DP.

    (Not under stochastic rounding: its random bits are drawn per optimizer, so a rank that owns a different share
    of the parameters rounds them with different bits.)
    """
    p = PrecisionConfig()
    if precision == "bf16":  # bf16 weights and moments, gradients all-reduced in fp32 by the DDP hook
        p = PrecisionConfig(
            name="bf16",
            param_dtype="bfloat16",
            compute_dtype="bfloat16",
            fp32_grad_accum=False,
            fp32_reduce=True,
            fp32_softmax_ce=True,
        )
    plain, sharded = two_ranks(tmp_path, False, p), two_ranks(tmp_path, True, p)
    for k in plain:
        assert torch.equal(plain[k], sharded[k]), k


@pytest.mark.slow
def test_python_train_py_starts_two_ranks_that_checkpoint_and_resume(tmp_path: Path, cache_dir: Path) -> None:
    """``cluster=cpu_x2``: elastic starts the ranks; sharded checkpoint; the rerun resumes; DP=2 trains as DP=1."""
    from mlflow import MlflowClient

    from hlat.train.run import main
    from tests.conftest import run_config
    from tests.integration.test_train import SMALL_RUN, cli

    run_dir, db = tmp_path / "dp2", tmp_path / "mlflow.db"
    common = [
        *SMALL_RUN,
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "train.checkpoint_every=4",
        "train.log_every=2",
        "optimizer.warmup_steps=2",
        "optimizer.decay_steps=12",  # the schedule of a 12-step run in both legs of the DP=2 run (8, then 12 steps)
        f"data.cache_dir={cache_dir}",
        "tracker.plots=false",
        "tracker.system_metrics=false",
        "tracker.flush_every_s=0",
        "health=off",
    ]
    dp2 = [*common, "cluster=cpu_x2", f"tracker.uri=sqlite:///{db}", f"hydra.run.dir={run_dir}"]
    r = cli(*dp2, "train.steps=8", cwd=tmp_path, timeout=hang_guard(900))
    assert r.returncode == 0, r.stderr[-3000:]
    meta = (run_dir / "checkpoints" / "step_00000008" / "manifest.json").read_text()
    assert all(f in meta for f in ("__0_0.distcp", "extra.rank0.pt", "extra.rank1.pt"))  # one loader state per rank
    r = cli(*dp2, "train.steps=12", cwd=tmp_path, timeout=hang_guard(900))  # the same run directory: resume=auto
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in (run_dir / "train.log").read_text()

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    dp2_loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert sorted(dp2_loss) == list(range(1, 13))
    one = main(run_config(*common, "train.steps=12", "tracker=console"), run_dir=tmp_path / "dp1")
    dp1_loss = dict(one.history.series("train/loss"))
    # The same global batches as one process (hlat.data.slots), summed in another order: the same losses up to fp32
    # rounding (measured: at most 5e-7 apart over the 12 steps; another batch moves a loss by ~0.1).
    gap = max(abs(dp2_loss[s] - dp1_loss[s]) for s in dp2_loss)
    assert dp2_loss[12] < dp2_loss[1] - 0.3 and gap < 2e-3, (dp1_loss, dp2_loss)


@pytest.mark.slow
def test_two_ranks_roll_back_to_the_same_checkpoint_just_saved(tmp_path: Path, cache_dir: Path) -> None:
    """``train.on_nonfinite=rollback`` at DP=2, one step after an asynchronous save: rank 0 renames that save into
    place after the others have written their files, and every rank must then list, verify (together: each file
    hashed by one rank) and restore the same checkpoint, the one just saved.

    Catches: a rank that lists the checkpoints before rank 0's rename (it would go back to an older one, or its
    share of the shared checksum pairs with another checkpoint's on rank 0, or the job hangs).
    """
    from tests.integration.test_train import SMALL_RUN, cli

    run_dir = tmp_path / "run"
    r = cli(
        *SMALL_RUN,
        "cluster=cpu_x2",
        "train.steps=7",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "train.checkpoint_every=3",
        "train.log_every=1",
        "optimizer.warmup_steps=2",
        "fault=nonfinite",
        "fault.nonfinite_at=[4]",
        "train.on_nonfinite=rollback",
        "tracker=console",
        "health=off",
        f"data.cache_dir={cache_dir}",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=hang_guard(900),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rolled = [line for line in (r.stdout + r.stderr).splitlines() if "rolled back to" in line]
    assert len(rolled) == 2 and all("step_00000003 (rollback 1)" in line for line in rolled), rolled
    extra = torch.load(run_dir / "checkpoints" / "step_00000007" / "extra.rank1.pt", weights_only=False)
    assert (extra["train_state"]["rollbacks"], extra["train_state"]["discarded_batches"]) == (1, [4])


@pytest.mark.slow
def test_a_killed_zero1_group_restarts_and_ends_bitwise_equal(tmp_path: Path, cache_dir: Path) -> None:
    """Two ZeRO-1 ranks, SIGKILLed after step 5 under supervision: torch elastic restarts the group, each rank
    reloads its share of the AdamW state from step 4, and step 8 equals an uninterrupted run bit for bit."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.integration.test_fault_recovery import assert_same
    from tests.integration.test_train import cli

    common = [
        "cluster=cpu_x2",
        "parallelism.zero1=true",
        "train.steps=8",
        "train.checkpoint_every=2",
        "train.keep_last=0",
        "train.async_checkpoint=false",
        "optimizer.warmup_steps=1",
        "optimizer.decay_steps=6",
        "train.seq_len=64",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "train.log_every=2",
        "tracker=console",
        "tracker.plots=false",
        "model.n_layers=2",
        "model.dim=64",
        "model.n_heads=4",
        "model.ffn_dim=176",
        f"data.cache_dir={cache_dir}",
        "health=off",
    ]
    states = []
    for name, extra in (("whole", []), ("killed", ["fault.kill_at=[5]", "cluster.max_restarts=1"])):
        r = cli(*common, *extra, f"hydra.run.dir={tmp_path / name}", cwd=tmp_path, timeout=hang_guard(900))
        assert r.returncode == 0, r.stderr[-3000:]
        dcp_to_torch_save(tmp_path / name / "checkpoints" / "step_00000008", tmp_path / f"{name}.pt")
        states.append(torch.load(tmp_path / f"{name}.pt", weights_only=True))
    assert "resumed from" in (tmp_path / "killed" / "train.log").read_text()
    whole, killed = states
    assert any(k.endswith("exp_avg") for k in whole["optimizer"]["state"]["layers.0.attn.qkv.weight"])
    assert_same(killed, whole)  # every tensor bitwise, every other value equal


MASTER = PrecisionConfig(name="master_weights", param_dtype="bfloat16", compute_dtype="bfloat16", master_weights=True)


def train_accumulating(rank: int, world: int, zero1: bool) -> dict[str, torch.Tensor]:
    """STEPS steps of precision=master_weights through the loop's backend calls (forward_backward, update); the
    global batch is 2 micro-batches of 2 sequences: both on one rank, or one on each of two ranks."""
    backend = TorchBackend(
        backend_config(
            model=TINY,
            cluster=ClusterConfig(num_threads=1),
            precision=MASTER,
            parallelism=ParallelismConfig(zero1=zero1),
            optimizer=OPT,
        )
    )
    backend.setup()
    dims = ParallelDims(world_size=world, tp=1, pp=1, dp=world)
    model = backend.build_model(dims)
    opt = backend.build_optimizer(model, param_groups(model, OPT))
    for step in range(STEPS):
        micro = batches(step).chunk(2)[rank::world]
        backend.forward_backward(model, ((b[:, :-1], b[:, 1:]) for b in micro), len(micro))
        backend.update(model, opt)  # clips to optimizer.clip_grad_norm=1.0
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _accumulating_worker(rank: int, port: int, zero1: bool, out: str) -> None:
    torchrun_env(rank, 2, port)
    state = train_accumulating(rank, 2, zero1)
    if rank == 0:
        torch.save(state, out)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("zero1", [False, True], ids=["dp", "zero1"])
def test_master_weights_with_fp32_accumulation_over_ranks_is_one_process(tmp_path: Path, zero1: bool) -> None:
    """precision=master_weights under DP: each rank sums its micro-batches' bf16 gradients in fp32 and the ranks
    average those sums once per step, so 2 ranks x 1 micro-batch end bitwise where 1 rank x 2 micro-batches does
    (halving is exact in binary floating point) — with and without ZeRO-1."""
    torch.set_num_threads(1)
    one = train_accumulating(0, 1, False)
    out = str(tmp_path / "dp2.pt")
    mp.spawn(_accumulating_worker, args=(free_port(), zero1, out), nprocs=2, join=True)
    two = torch.load(out, weights_only=True)
    assert one.keys() == two.keys()
    for k in one:
        assert torch.equal(one[k], two[k]), k
