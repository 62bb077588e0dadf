"""NeuronBackend driven by the real loop, hooks and Checkpointer against the RECORDING FAKE of torch_xla / NxD.

The fake (tests/fakes/neuron_api.py) is installed only inside these tests. It checks that the backend calls the API
with the right arguments in the right order; what NxD then does on trn1 is not tested here (nothing has run there).
"""

from __future__ import annotations

import dataclasses
import inspect
import os

import pytest
import torch

from hlat import checkpoint
from hlat.backends import get_backend
from hlat.backends.neuron import EXTRA, neuron_env
from hlat.config import (
    ClusterConfig,
    ConfigError,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    PrecisionConfig,
    RunConfig,
    TrainConfig,
)
from hlat.optim import param_groups
from hlat.parallel import ParallelDims
from hlat.state import TrainState
from hlat.track.metrics import MetricsLogger
from hlat.train.loop import fit
from tests.fakes.neuron_api import FakeNeuronApi

MODEL = ModelConfig(name="t", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=64)
PRECISION = {
    "fp32": PrecisionConfig(),
    "bf16_sr": PrecisionConfig(
        name="bf16_sr",
        param_dtype="bfloat16",
        compute_dtype="bfloat16",
        stochastic_rounding=True,
        fp32_grad_accum=False,
        fp32_reduce=False,
        fp32_softmax_ce=False,
    ),
    "master_weights": PrecisionConfig(
        name="master_weights", param_dtype="bfloat16", compute_dtype="bfloat16", master_weights=True
    ),
}
GRAD_ACCUM = 2  # global batch 4 = micro-batch 2 x 2 on one data-parallel rank


def run_config(precision: str = "fp32", *, pp: int = 1, zero1: bool = False, ac: str = "selective") -> RunConfig:
    return RunConfig(
        model=MODEL,
        precision=PRECISION[precision],
        cluster=ClusterConfig(name="trn1_test", backend="neuron", nproc_per_node=pp, devices_per_node=pp),
        parallelism=ParallelismConfig(name="test", pp=pp, zero1=zero1, activation_checkpointing=ac),
        train=TrainConfig(steps=4, seq_len=16, global_batch_size=4, micro_batch_size=2, log_every=2),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=1),
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, MODEL.vocab_size, (4 * GRAD_ACCUM, 2, 17), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


@pytest.fixture
def fake(monkeypatch):
    """The fake installed for one test; the environment and the imported fake modules are undone afterwards."""
    saved = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(var, None)
    api = FakeNeuronApi().install(monkeypatch)
    yield api
    api.unload()
    os.environ.clear()
    os.environ.update(saved)


def train(cfg: RunConfig, root, *, until: int, resume: bool = False):
    """Build everything as run.main does and fit to step ``until``, saving every 2 steps; returns (model, rows)."""
    backend = get_backend(cfg)
    env = backend.setup()
    dims = ParallelDims.build(cfg.parallelism, env.world_size, cfg.model, cfg.train)
    model = backend.build_model(dims)
    optimizer = backend.build_optimizer(model, param_groups(model, cfg.optimizer))
    state = TrainState()
    if resume:
        extra = backend.load(checkpoint.latest(root), model, optimizer)
        state = TrainState(**extra["train_state"])
    rows: list = []
    logger = MetricsLogger(backend, model, rows.extend, every=2, last_step=until, tokens_per_step=64)
    saver = checkpoint.Checkpointer(
        backend,
        root,
        model,
        optimizer,
        lambda s: {"train_state": dataclasses.asdict(s), "rng": torch.get_rng_state()},
        every=2,
        last_step=until,
        keep_last=2,
        async_save=True,
    )
    data = iter(batches()[state.step * GRAD_ACCUM :])
    fit(
        state,
        model,
        optimizer,
        data,
        backend,
        steps=until,
        grad_accum=dims.grad_accum(cfg.train),
        tokens_per_step=64,
        lr_fn=lambda s: 1e-3,
        hooks=[logger, saver],
    )
    saver.close()
    return model, rows


def test_calls_the_api_in_order_with_the_reference_arguments(fake, tmp_path) -> None:
    cfg = run_config("bf16_sr")
    _, rows = train(cfg, tmp_path, until=4)
    # The environment was in place when torch_xla was imported (it reads XLA_USE_BF16 then).
    env = neuron_env(cfg)
    seen = fake.first("import torch_xla").kwargs["env"]
    assert seen == {k: env.get(k) for k in seen} and seen["XLA_USE_BF16"] == "1"
    assert fake.first("import neuronx_distributed").kwargs["env"] == seen
    order = [
        "import torch_xla",
        "dist.init_process_group",
        "neuronx_distributed_config",
        "model_parallel_xla_manual_seed",
        "initialize_parallel_model",
        "initialize_parallel_optimizer",
        "NxDOptimizer.step",
        "save_checkpoint",
    ]
    assert [fake.index(n) for n in order] == sorted(fake.index(n) for n in order)
    assert fake.first("dist.init_process_group").args == ("xla",)
    timeout = fake.first("dist.init_process_group").kwargs["timeout"]  # health.collective_timeout_s, not torch's 30 min
    assert timeout.total_seconds() == cfg.health.collective_timeout_s == 900
    assert fake.first("model_parallel_xla_manual_seed").args == (cfg.train.seed,)
    # The model comes from a zero-argument closure: NxD >= 0.10's include_buffers positional stays at its default.
    build = fake.first("initialize_parallel_model")
    assert len(build.args) == 3 and build.args[2] is False and not build.kwargs
    assert not inspect.signature(build.args[1]).parameters
    opt = fake.first("initialize_parallel_optimizer")
    assert opt.args[1] is torch.optim.AdamW
    assert opt.kwargs == {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    # Per step: a mark_step after each micro-batch and one at the step's end; fetch adds one per log interval.
    assert fake.names().count("NxDOptimizer.step") == 4
    assert fake.names().count("torch_xla.sync") == 4 * (GRAD_ACCUM + 1) + 2
    assert fake.names().count("xm.add_step_closure") == 2
    assert [r[0] for r in rows] == [1, 2, 3, 4] and all(
        torch.isfinite(torch.tensor(r[1]["train/grad_norm"])) for r in rows
    )
    saves = fake.all("save_checkpoint")
    assert [s.kwargs["tag"] for s in saves] == ["step_00000002.tmp", "step_00000004.tmp"]
    assert all(
        s.kwargs["checkpoint_dir_str"] == str(tmp_path)
        and s.kwargs["use_xser"] is True
        and s.kwargs["async_save"] is False
        and s.kwargs["num_kept_ckpts"] is None
        and s.kwargs["zero1_optimizer"] is False
        for s in saves
    )
    assert saves[0].kwargs["user_content"]["train_state"]["step"] == 2
    final = checkpoint.latest(tmp_path)
    assert final.name == "step_00000004" and (final / EXTRA.format(rank=0)).is_file()
    assert (final / "user_content.pt").is_file() and (final / "done").is_file()


def test_resume_through_nxd_checkpoints_is_bitwise(fake, tmp_path) -> None:
    cfg = run_config("fp32", ac="full")
    straight, _ = train(cfg, tmp_path / "a", until=4)
    fake.unload()  # a new process: torch_xla is imported afresh
    train(cfg, tmp_path / "b", until=2)
    fake.unload()
    resumed, _ = train(cfg, tmp_path / "b", until=4, resume=True)
    load = fake.first("load_checkpoint")
    assert load.kwargs["path"] == str(tmp_path / "b") and load.kwargs["tag"] == "step_00000002"
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_pipeline_parallel_hands_all_micro_batches_to_run_train(fake, tmp_path, monkeypatch) -> None:
    """The backend's PP path with the fake: all micro-batches in one ``run_train``, the model cut between blocks, the
    schedule's arithmetic equal to the flat run's. The fake runs both stages in one process and initializes the whole
    model, so it cannot see per-stage initialization or local-stage ``named_parameters``: those are checked against
    the real ``NxDPPModel`` in tests/neuron/test_nxd_cpu_mode.py (the NxD lane)."""
    flat, _ = train(run_config("master_weights", zero1=True), tmp_path / "flat", until=4)
    fake.unload()
    monkeypatch.setenv("WORLD_SIZE", "2")  # PP2 x DP1; the fake runs both stages in this process
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    piped, rows = train(run_config("master_weights", pp=2, zero1=True), tmp_path / "pp", until=4)
    cfg = fake.all("neuronx_distributed_config")[-1].kwargs
    assert cfg["pipeline_parallel_size"] == 2 and cfg["pipeline_config"]["num_microbatches"] == GRAD_ACCUM
    runs = fake.all("NxDModel.run_train")
    assert len(runs) == 4 and all(r.kwargs["input_ids"].shape == (2 * GRAD_ACCUM, 16) for r in runs)
    called = [n.target for n in fake.traced.graph.nodes if n.op == "call_module"]
    assert called == ["embed", "layers.0", "layers.1", "norm", "lm_head", "loss_fn"]  # cut between blocks
    assert fake.all("xm.all_reduce")  # metrics averaged over the 2 ranks
    assert all(r[1]["train/loss"] > 0 for r in rows)
    for (name, a), (_, b) in zip(flat.named_parameters(), piped.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_refuses_before_importing_anything(fake) -> None:
    train_cfg = TrainConfig(steps=4, seq_len=16, global_batch_size=4, micro_batch_size=2, on_nonfinite="skip_step")
    cfg = dataclasses.replace(run_config(), train=train_cfg)
    backend = get_backend(cfg)
    with pytest.raises(Exception, match="skip_step cannot be honoured"):
        backend.setup()
    assert fake.names() == []


def test_synchronize_runs_the_traced_graph_then_waits_for_the_device(fake) -> None:
    """Backend.synchronize (the pre-flight check's timer): mark_step first, or wait_device_ops waits for nothing."""
    cfg = run_config()
    backend = get_backend(cfg)
    backend.setup()
    start = len(fake.names())
    backend.synchronize()
    assert fake.names()[start:] == ["torch_xla.sync", "xm.wait_device_ops"]


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("compile", r"train\.compile=true is for the torch backend"),
        ("step_breakdown", r"train\.step_breakdown=true times eager phases"),
    ],
)
def test_torch_only_train_options_are_refused_before_importing_anything(fake, key: str, message: str) -> None:
    """torch.compile and the eager phase timer are the torch backend's: on trn1 the step is one traced graph."""
    cfg = dataclasses.replace(run_config(), train=dataclasses.replace(run_config().train, **{key: True}))
    with pytest.raises(ConfigError, match=message):
        get_backend(cfg).setup()
    assert fake.names() == []


def test_init_from_replaces_nxds_initialization_with_the_given_weights(fake) -> None:
    """``train.init_from`` on the neuron backend: the full weights (hlat's names, tp=1 layout) replace what NxD
    initialized, each parameter getting its piece; the fused qkv as NxD's [q; k; v], not hlat's grouped rows.

    Catches the weights ignored (NxD's own initialization kept), or qkv copied in hlat's row order.
    """
    from hlat.model import Transformer

    cfg = run_config()
    backend = get_backend(cfg)
    env = backend.setup()
    flat = Transformer(MODEL)
    flat.init_weights(7)  # not the run's seed: other values than NxD's initialization
    state = flat.state_dict()
    model = backend.build_model(ParallelDims.build(cfg.parallelism, env.world_size, MODEL, cfg.train), state)
    G, r, D = MODEL.kv_heads, MODEL.n_heads // MODEL.kv_heads, MODEL.head_dim
    checked = []
    for name, p in model.named_parameters():
        if name.endswith("qkv.weight_qkv"):
            g = state[name.replace("weight_qkv", "weight")].view(G, r + 2, D, MODEL.dim)
            want = torch.cat(
                [g[:, :r].reshape(-1, MODEL.dim), g[:, r].reshape(-1, MODEL.dim), g[:, r + 1].reshape(-1, MODEL.dim)]
            )
        else:
            want = state[name]
        assert torch.equal(p.detach(), want), name
        checked.append(name)
    assert len(checked) == len(list(flat.parameters()))
