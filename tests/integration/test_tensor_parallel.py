"""Tensor (+ sequence) parallelism on the torch backend: two CPU ranks over gloo against one process."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hlat.backends.torch import TorchBackend
from hlat.config import ClusterConfig, ParallelismConfig, PrecisionConfig
from hlat.model import Transformer
from hlat.parallel import ParallelDims
from tests.integration.test_data_parallel import TINY, batches, free_port

pytestmark = pytest.mark.slow


def forward_backward(tp: int, sp: bool) -> dict[str, torch.Tensor]:
    """Logits, loss and every gradient (gathered whole, gate_up rows in the model's [gate; up] order)."""
    backend = TorchBackend()
    backend.setup(ClusterConfig(num_threads=1), PrecisionConfig(), seed=0)
    par = ParallelismConfig(tp=tp, sequence_parallel=sp)
    model = backend.build_model(functools.partial(Transformer, TINY), ParallelDims(tp, tp, 1, 1), par)
    b = batches(0)
    logits = model(b[:, :-1])
    loss = backend.loss(model, b[:, :-1], b[:, 1:])
    loss.backward()
    norm = backend.clip_grad_norm(model, 0.0)
    out = {"logits": logits.detach(), "loss": loss.detach(), "grad_norm": norm.detach()}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if name.endswith("gate_up.weight") and tp > 1:  # undo the per-rank interleave of the gate and up rows
            parts = g.chunk(2 * tp)
            g = torch.cat([*parts[0::2], *parts[1::2]])
        out[f"grad.{name}"] = g.detach().clone()
    return out


def _worker(rank: int, port: int, sp: bool, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
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
    (up to fp32 reduction order), also across a checkpoint of DTensor shards and a resume."""
    from mlflow import MlflowClient

    from hlat.run import main
    from tests.conftest import compose_cfg
    from tests.integration.test_train import SMALL_RUN, cli

    common = [*SMALL_RUN, "train.global_batch_size=8", "train.micro_batch_size=4", "train.checkpoint_every=4",
              "train.log_every=2", "optimizer.warmup_steps=2", "optimizer.decay_steps=6", f"data.cache_dir={cache_dir}",
              "tracker.plots=false", "tracker.system_metrics=false", "tracker.flush_every_s=0"]  # fmt: skip
    db, run_dir = tmp_path / "mlflow.db", tmp_path / "tp2"
    tp2 = [*common, "cluster=cpu_x2", "parallelism=tp2", "parallelism.sequence_parallel=true",
           f"tracker.uri=sqlite:///{db}", f"hydra.run.dir={run_dir}"]  # fmt: skip
    for steps in (4, 8):  # the second leg resumes from the first one's checkpoint
        r = cli(*tp2, f"train.steps={steps}", cwd=tmp_path, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    tp_loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    one = dict(main(compose_cfg(*common, "train.steps=8", "tracker=console"), run_dir=tmp_path / "one")
               .history.series("train/loss"))  # fmt: skip
    assert sorted(tp_loss) == list(range(1, 9))
    for step, value in one.items():
        assert tp_loss[step] == pytest.approx(value, abs=2e-3), step
