"""How each config key can change the graphs a run compiles on Trainium: the classification ``hlat graphs`` uses.

Four classes (``hlat graphs keys`` prints the table):

- ``shape``: changes tensor shapes, the layout or the graph's size; arms are compared on these at full scale (the
  *shape signature*), never through the tiny twin that is traced.
- ``traced``: may change the traced step through a code path or a Python scalar that torch-xla bakes in (exactly 0
  or +-1): the twin is traced with the arm's value and its graphs fingerprinted.
- ``host``: never enters a graph, or only through the host schedule (fetch lengths, the learning rate reaching 0,
  AdamW's bias correction rounding to 1), which ``hlat.plan.graph_schedule`` computes.
- ``env``: acts through the environment or the compiler flags the neuron backend sets (``neuron_plan.neuron_env``);
  arms are compared on the graph-affecting part of those (the *env signature*).

``tests/unit/test_graph_keys.py`` fails on a config field missing here: a new key must say how it acts. The
mechanisms were checked by tracing where the NxD lane can (docs/trn1.md, "Which keys recompile"). Pure data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SHAPE, TRACED, HOST, ENV = "shape", "traced", "host", "env"
CLASSES = (SHAPE, TRACED, HOST, ENV)

_DIMS = "tensor shapes"
_LABEL = "a preset's name: its fields carry the meaning"
_RUN = "what the host does around the step (files, tracking, checks)"
_SCHED = "host schedule: a Python float passed as graph data; 0 or 1 is a new graph (graph_schedule)"
_PLAN = "the planner's cost model only"

KEYS: dict[str, tuple[str, str]] = {
    "model.name": (HOST, _LABEL),
    "model.dim": (SHAPE, _DIMS),
    "model.n_layers": (SHAPE, "graph size (and pipeline stages)"),
    "model.n_heads": (SHAPE, _DIMS),
    "model.n_kv_heads": (SHAPE, "tensor shapes; kv replication when below tp"),
    "model.ffn_dim": (SHAPE, _DIMS),
    "model.vocab_size": (SHAPE, _DIMS),
    "model.max_seq_len": (SHAPE, "the rotary tables' shape (graph inputs)"),
    "model.norm_eps": (TRACED, "a Python scalar in the RMSNorm (graph data unless 0)"),
    "model.rope_theta": (HOST, "values of the rotary tables, computed on the host"),
    "model.init_std": (HOST, "initial values, drawn on the host"),
    "model.scaled_init": (HOST, "initial values, drawn on the host"),
    "model.mask_leak": (TRACED, "code path (refused on the neuron backend)"),
    "optimizer.name": (TRACED, "code path: the optimizer's ops and state"),
    "optimizer.lr": (HOST, _SCHED),
    "optimizer.min_lr": (HOST, _SCHED + "; min_lr 0 reaches it"),
    "optimizer.warmup_steps": (HOST, _SCHED),
    "optimizer.decay_steps": (HOST, _SCHED),
    "optimizer.beta1": (TRACED, "a Python scalar (1 - beta1 is 1 at beta1 = 0)"),
    "optimizer.beta2": (TRACED, "a Python scalar; also when sqrt(1 - beta2^t) rounds to 1 (graph_schedule)"),
    "optimizer.eps": (TRACED, "a Python scalar (graph data unless 0)"),
    "optimizer.weight_decay": (TRACED, "code path: torch's AdamW skips the decay at exactly 0"),
    "optimizer.decay_norms_and_biases": (TRACED, "code path: a parameter group without decay"),
    "optimizer.clip_grad_norm": (TRACED, "NxD's max_norm, a Python scalar (1.0 is a constant; 0 means no limit)"),
    "precision.name": (HOST, _LABEL),
    "precision.param_dtype": (ENV, "XLA_USE_BF16 / XLA_DOWNCAST_BF16 and the compiler flags: dtypes"),
    "precision.compute_dtype": (ENV, "autocast and --enable-mixed-precision-accumulation"),
    "precision.master_weights": (ENV, "XLA_DOWNCAST_BF16 and ZeRO-1's fp32 masters"),
    "precision.stochastic_rounding": (ENV, "NEURON_RT_STOCHASTIC_ROUNDING_EN: the runtime's, not the graph's"),
    "precision.fp32_grad_accum": (TRACED, "NxD's use_fp32_grad_acc: dtypes of the accumulated gradients"),
    "precision.fp32_reduce": (TRACED, "reduce_dtype of the parallel layers' collectives"),
    "precision.fp32_softmax_ce": (TRACED, "the loss's dtype"),
    "precision.bf16_matmul": (HOST, "a torch-backend policy (refused on the neuron backend unless auto)"),
    "data.name": (HOST, _LABEL),
    "data.path": (HOST, "which tokens: batches are graph data of a fixed shape"),
    "data.text_column": (HOST, "which tokens"),
    "data.tokenizer": (HOST, "which tokens (model.vocab_size is the shape)"),
    "data.tokenizer_type": (HOST, "which tokens"),
    "data.cache_dir": (HOST, _RUN),
    "data.shuffle": (HOST, "which tokens"),
    "data.loader": (HOST, "online or offline packing: which tokens, same batch shape"),
    "data.worker": (HOST, _RUN),
    "data.prefetch": (HOST, _RUN),
    "data.mix": (TRACED, "the number of sources sizes the per-source loss tally in the graph; weights, paths: tokens"),
    "data.mix_file": (TRACED, "merged into data.mix: the number of sources sizes the loss tally"),
    "data.stages": (HOST, "the weights the host schedules; the tally keeps its size, no new graph (NxD lane)"),
    "data.log_sources": (HOST, _RUN),
    "cluster.name": (HOST, _LABEL),
    "cluster.backend": (ENV, "which backend: the planner traces the neuron backend"),
    "cluster.device": (HOST, "the torch backend's device"),
    "cluster.num_threads": (HOST, _RUN),
    "cluster.memory_fraction": (HOST, _PLAN),
    "cluster.peak_tflops": (HOST, _PLAN),
    "cluster.devices_per_node": (SHAPE, "the world size: data-parallel degree and collectives"),
    "cluster.device_memory_gib": (HOST, _PLAN),
    "cluster.price_per_hour": (HOST, _PLAN),
    "cluster.nproc_per_node": (SHAPE, "the world size: data-parallel degree and collectives"),
    "cluster.nodes": (SHAPE, "the world size: data-parallel degree and collectives"),
    "cluster.cpus_per_task": (HOST, _RUN),
    "cluster.instance_type": (HOST, _RUN),
    "cluster.efa_devices": (ENV, "FI_* variables: the runtime's, not the graph's"),
    "cluster.compile_cache": (ENV, "NEURON_COMPILE_CACHE_URL: where entries go, not in the compiler flags"),
    "cluster.pjrt_device": (ENV, "which PJRT device (CPU in the NxD lane)"),
    "cluster.nxd_cpu_mode": (ENV, "NXD_CPU_MODE: no XLA graphs at all"),
    "cluster.max_restarts": (HOST, _RUN),
    "cluster.intra_node_gb_s": (HOST, _PLAN),
    "cluster.inter_node_gbit_s": (HOST, _PLAN),
    "cluster.memory_gb_s": (HOST, _PLAN),
    "cluster.compute_efficiency": (HOST, _PLAN),
    "cluster.intra_node_efficiency": (HOST, _PLAN),
    "cluster.inter_node_efficiency": (HOST, _PLAN),
    "cluster.grad_reduce_overlap": (HOST, _PLAN),
    "parallelism.name": (HOST, _LABEL),
    "parallelism.tp": (SHAPE, "per-rank shapes, collectives and replica groups"),
    "parallelism.pp": (SHAPE, "pipeline stages: each its own graphs"),
    "parallelism.sequence_parallel": (SHAPE, "activation layout and collectives"),
    "parallelism.zero1": (SHAPE, "sharded optimizer state and its collectives"),
    "parallelism.activation_checkpointing": (TRACED, "code path: recomputation in the backward graph"),
    "tracker.name": (HOST, _LABEL),
    "tracker.kind": (HOST, _RUN),
    "tracker.uri": (HOST, _RUN),
    "tracker.experiment": (HOST, _RUN),
    "tracker.run_name": (HOST, _RUN),
    "tracker.flush_every_s": (HOST, _RUN),
    "tracker.spike_window": (HOST, "host statistics of fetched values"),
    "tracker.spike_threshold": (HOST, "host statistics of fetched values"),
    "tracker.spike_summary_every": (HOST, "host statistics of fetched values"),
    "tracker.plots": (HOST, _RUN),
    "tracker.layer_grad_norms_every": (TRACED, "per-layer norms traced into those steps and fetched: more graphs"),
    "tracker.system_metrics": (HOST, _RUN),
    "tracker.skip_finished": (HOST, _RUN),
    "train.steps": (HOST, _SCHED + "; and the last interval's fetch length"),
    "train.seq_len": (SHAPE, _DIMS),
    "train.global_batch_size": (
        TRACED,
        "micro-batches per step: 1 -> 2 adds an accumulating graph; 1/n is a graph scalar, which can equal another",
    ),
    "train.micro_batch_size": (SHAPE, _DIMS),
    "train.log_every": (HOST, "host schedule: one fetch graph per interval length"),
    "train.progress_every": (HOST, _RUN),
    "train.seed": (HOST, "initial values and data order; NEURON_RT_STOCHASTIC_ROUNDING_SEED"),
    "train.checkpoint_every": (HOST, "host schedule: a checkpoint off the log grid flushes a shorter fetch"),
    "train.checkpoint_dir": (HOST, _RUN),
    "train.keep_last": (HOST, _RUN),
    "train.keep_every": (HOST, _RUN),
    "train.async_checkpoint": (HOST, "no effect on the neuron backend"),
    "train.resume": (HOST, _RUN),
    "train.init_from": (HOST, "initial values, copied on the host"),
    "train.on_nonfinite": (TRACED, "skip_step reads a flag each step (refused on the neuron backend)"),
    "train.dry_run": (HOST, "nothing runs"),
    "train.compile": (TRACED, "torch.compile (refused on the neuron backend)"),
    "train.step_breakdown": (TRACED, "syncs inside the step (refused on the neuron backend)"),
    "train.preempt_grace_s": (HOST, _RUN),
    "fault.name": (HOST, _LABEL),
    "fault.kill_at": (HOST, "a test hook"),
    "fault.kill_random": (HOST, "a test hook"),
    "fault.seed": (HOST, "a test hook"),
    "fault.crash_in_save_at": (HOST, "a test hook"),
    "fault.corrupt_at": (HOST, "a test hook"),
    "fault.disk_full_at": (HOST, "a test hook"),
    "fault.nonfinite_at": (TRACED, "a test hook that writes NaN into a gradient: an op in that step"),
    "fault.hang_at": (HOST, "a test hook"),
    "fault.sigstop_at": (HOST, "a test hook"),
    "fault.hang_rank": (HOST, "a test hook"),
    "fault.graph_at": (TRACED, "a test hook: one rank traces an extra op at that step"),
    "fault.graph_rank": (TRACED, "a test hook: the rank that traces the extra op"),
    "fault.min_step_s": (HOST, "a test hook"),
    "eval.name": (HOST, _LABEL),
    "eval.tasks": (HOST, "evaluations run in a child process on the torch backend"),
    "eval.checkpoint": (HOST, "evaluations run in a child process on the torch backend"),
    "eval.all_checkpoints": (HOST, "evaluations run in a child process on the torch backend"),
    "eval.every_tokens": (HOST, "evaluations run in a child process on the torch backend"),
    "eval.limit": (HOST, "evaluations run in a child process on the torch backend"),
    "eval.batch_size": (HOST, "evaluations run in a child process on the torch backend"),
    "eval.device": (HOST, "evaluations run in a child process on the torch backend"),
    "eval.on_error": (HOST, "evaluations run in a child process on the torch backend"),
    **{
        f"health.{k}": (HOST, "pre-flight check, watchdog, stragglers: host-side")
        for k in (
            "name",
            "preflight",
            "matmul_size",
            "matmul_seconds",
            "matmul_repeats",
            "min_matmul_fraction",
            "min_relative_fraction",
            "collective_mib",
            "collective_iters",
            "expected_busbw_gbps_intra",
            "expected_busbw_gbps_world",
            "min_bandwidth_fraction",
            "watchdog",
            "watchdog_factor",
            "watchdog_floor_s",
            "watchdog_first_step_s",
            "watchdog_grace_s",
            "collective_timeout_s",
            "straggler_every",
            "straggler_warn_ratio",
            "graph_guard",
            "inject_slow_rank",
            "inject_slow_factor",
        )
    },
    "health.graph_hlo_dir": (ENV, "XLA_SAVE_TENSORS_FILE: writes each graph out (for hlat graphs plan)"),
}
"""Every config key -> (class, mechanism)."""

SHAPE_DERIVED = ("world_size", "dp", "kv_replicas")
"""Derived values the shape signature adds: the world, the data-parallel degree, kv-head copies over tp."""


def leaves(cls: type, prefix: str = "") -> list[str]:
    """Every leaf key of the dataclass ``cls`` (``model.dim``...), as the config spells them."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            out += leaves(type(default), f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def flat(cfg: Any) -> dict[str, Any]:
    """The config's leaf values by key (lists as tuples: hashable, comparable)."""
    out: dict[str, Any] = {}
    for key in leaves(type(cfg)):
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        out[key] = tuple(map(_plain, value)) if isinstance(value, list) else value
    return out


def _plain(v: Any) -> Any:
    return tuple(sorted(dataclasses.asdict(v).items())) if dataclasses.is_dataclass(v) else v


def table() -> str:
    """``hlat graphs keys``: the classification, one key a line, by class."""
    lines = [f"{'key':44s} {'class':7s} mechanism"]
    for cls in CLASSES:
        lines += [f"{k:44s} {c:7s} {m}" for k, (c, m) in KEYS.items() if c == cls]
    return "\n".join(lines)
