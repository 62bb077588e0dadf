"""Step time, throughput, MFU and cost of a training config on a cluster: an analytic model, no device work.

    step = (compute + tp_comm) * (m + pp - 1) / m + pp_p2p + dp_exposed + optimizer

m micro-batches per data-parallel rank, 1F1B; docs/planner.md ("Step time") gives each term and its reference.
"""

from __future__ import annotations

from dataclasses import dataclass

from hlat.config import ClusterConfig, ConfigError, RunConfig
from hlat.parallel import ParallelDims
from hlat.sizing import BYTES, bytes_per_param, flops_per_token  # torch-free: `hlat plan` starts without torch

GB = 1e9
"""Bandwidths are in decimal units, as the data sheets give them."""
CPT_TOKENS = 4e6
"""Tokens in the cost per 4M tokens (CPT, the paper's §5.4), as the trainer's ``perf/cost_per_4m_tokens`` counts
them (``hlat.track.metrics.Throughput``). One step of the paper's recipes is 1024 x 4096 = 4,194,304 tokens."""


@dataclass(frozen=True)
class Hardware:
    """What the model needs to know about a node type; built from a cluster preset (``Hardware.of``)."""

    instance_type: str
    devices_per_node: int
    peak_flops: float
    """Dense peak FLOP/s of one device at the compute dtype."""
    intra_node_bw: float
    """Bytes/s one device moves to the others of its node, per direction."""
    inter_node_bw: float
    """Bytes/s one node moves to the others, per direction, shared by its devices."""
    memory_bw: float
    """HBM bytes/s of one device."""
    price_per_hour: float | None
    """USD per node-hour; None: no cost."""
    compute_efficiency: float
    intra_node_efficiency: float
    inter_node_efficiency: float
    grad_reduce_overlap: float

    def link_bw(self, *, cross_node: bool) -> float:
        """Achieved bytes/s of one device in a collective: its link, or its share of the node's network."""
        if cross_node:
            return self.inter_node_bw / self.devices_per_node * self.inter_node_efficiency
        return self.intra_node_bw * self.intra_node_efficiency

    @classmethod
    def of(cls, cluster: ClusterConfig) -> Hardware:
        """The hardware description of ``cluster``.

        Raises:
            ConfigError: naming the ``cluster.*`` fields the step-time model lacks.
        """
        need = ("peak_tflops", "intra_node_gb_s", "inter_node_gbit_s", "memory_gb_s", "compute_efficiency")
        missing = [f"cluster.{k}" for k in need if getattr(cluster, k) is None]
        if missing:
            raise ConfigError(
                f"cluster={cluster.name} has no {', '.join(missing)}: the step-time model needs them (the trn1, trn1n, "
                "p4d and p5 presets set them; see docs/planner.md); memory is still planned"
            )
        return cls(
            instance_type=cluster.instance_type or cluster.name,
            devices_per_node=cluster.devices_per_node,
            peak_flops=cluster.peak_tflops * 1e12,
            intra_node_bw=cluster.intra_node_gb_s * GB,
            inter_node_bw=cluster.inter_node_gbit_s * GB / 8,
            memory_bw=cluster.memory_gb_s * GB,
            price_per_hour=cluster.price_per_hour,
            compute_efficiency=cluster.compute_efficiency,
            intra_node_efficiency=cluster.intra_node_efficiency,
            inter_node_efficiency=cluster.inter_node_efficiency,
            grad_reduce_overlap=cluster.grad_reduce_overlap,
        )


def ring_all_reduce_s(nbytes: float, ranks: int, bandwidth: float) -> float:
    """Seconds of a bandwidth-bound ring all-reduce of ``nbytes`` per rank over ``ranks`` at ``bandwidth`` B/s."""
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth if ranks > 1 else 0.0


def ring_all_gather_s(nbytes: float, ranks: int, bandwidth: float) -> float:
    """Seconds of a ring all-gather (or reduce-scatter) whose full result is ``nbytes``."""
    return (ranks - 1) / ranks * nbytes / bandwidth if ranks > 1 else 0.0


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """Idle fraction of a 1F1B pipeline step: (pp - 1) / (m + pp - 1) (Narayanan et al. 2021, §2.2.1)."""
    return (pp - 1) / (micro_batches + pp - 1)


def cost_per_tokens(price_per_node_hour: float, nodes: int, tokens_per_s: float, tokens: float = CPT_TOKENS) -> float:
    """USD to train ``tokens`` tokens: node-hours times price (the paper's CPT with the default ``tokens``)."""
    return price_per_node_hour * nodes * tokens / tokens_per_s / 3600


@dataclass(frozen=True)
class StepEstimate:
    """Predicted time of one optimizer step by component (seconds, per device, critical path)."""

    compute_s: float
    """Forward, backward and recomputation at the calibrated efficiency, without the bubble."""
    recompute_s: float
    """The part of ``compute_s`` that activation checkpointing recomputes."""
    tp_comm_s: float
    """Tensor-parallel collectives, without the bubble."""
    bubble_s: float
    """Pipeline bubble: idle time of (compute + tp_comm) while the pipeline fills and drains."""
    pp_p2p_s: float
    """Activations and their gradients sent between pipeline stages."""
    dp_comm_s: float
    """The whole data-parallel gradient reduction (and ZeRO-1's parameter all-gather)."""
    dp_exposed_s: float
    """The part of ``dp_comm_s`` not hidden behind the backward pass."""
    optimizer_s: float
    """AdamW update, memory bound."""
    tokens_per_step: int
    model_flops_per_token: float
    """The trainer's MFU numerator (``hlat.track.metrics.flops_per_token``, non-causal)."""
    peak_flops: float
    """Peak FLOP/s of the whole cluster."""
    nodes: int
    price_per_hour: float | None
    """USD per node-hour."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.bubble_s + self.pp_p2p_s + self.dp_exposed_s + self.optimizer_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization, as the trainer's ``perf/mfu``."""
        return self.tokens_per_s * self.model_flops_per_token / self.peak_flops

    @property
    def cost_per_4m_tokens(self) -> float | None:
        """CPT in USD, as the trainer's ``perf/cost_per_4m_tokens``; None without a price."""
        if self.price_per_hour is None:
            return None
        return cost_per_tokens(self.price_per_hour, self.nodes, self.tokens_per_s)

    def components(self) -> dict[str, float]:
        """Seconds per component, in the order they add up to ``step_s``."""
        return {
            "forward_backward": self.compute_s - self.recompute_s,
            "recompute": self.recompute_s,
            "tp_comm": self.tp_comm_s,
            "pp_bubble": self.bubble_s,
            "pp_p2p": self.pp_p2p_s,
            "dp_exposed": self.dp_exposed_s,
            "optimizer": self.optimizer_s,
        }


def hardware_flops_per_token(cfg: RunConfig, n_params: int) -> tuple[float, float]:
    """(model FLOPs, recomputed FLOPs) per token: the trainer's count, and what checkpointing adds to it.

    Selective recomputes the attention core's forward (4·L·H·Q·T), full every block's (2·N_blocks + 4·L·H·Q·T)
    (Korthikanti et al. 2022, §5; Narayanan et al. 2021, §5.1).
    """
    m, s = cfg.model, cfg.train.seq_len
    model = flops_per_token(n_params, m.vocab_size * m.dim, m.n_layers, m.n_heads, m.head_dim, s)
    attn_fwd = 4 * m.n_layers * m.n_heads * m.head_dim * s
    mode = cfg.parallelism.activation_checkpointing
    blocks = n_params - 2 * m.vocab_size * m.dim - m.dim  # untied embedding and output layer, final norm
    extra = {"none": 0.0, "selective": attn_fwd, "full": 2 * blocks + attn_fwd}[mode]
    return model, float(extra)


def _tp_comm_s(cfg: RunConfig, dims: ParallelDims, hw: Hardware, micro_batches: int) -> float:
    """Tensor-parallel collectives of one device per step (without the bubble; Korthikanti et al. 2022, §4.2.2)."""
    # Not overlapped with compute: XLA and Megatron serialise them with the matmuls they feed.
    if dims.tp == 1:
        return 0.0
    m, t = cfg.model, cfg.train
    act = t.micro_batch_size * t.seq_len * m.dim * BYTES[cfg.precision.compute_dtype]  # one (s, b, h) activation
    per_layer = 12 if cfg.parallelism.activation_checkpointing == "full" else 8  # all-gathers + reduce-scatters
    bw = hw.link_bw(cross_node=dims.tp > hw.devices_per_node)
    return per_layer * ring_all_gather_s(act, dims.tp, bw) * m.n_layers / dims.pp * micro_batches


def _pp_p2p_s(cfg: RunConfig, dims: ParallelDims, hw: Hardware, micro_batches: int) -> float:
    """Stage-to-stage sends of one device per step: an activation and its gradient per pipeline slot."""
    if dims.pp == 1:
        return 0.0
    m, t = cfg.model, cfg.train
    act = t.micro_batch_size * t.seq_len * m.dim * BYTES[cfg.precision.compute_dtype]
    if cfg.parallelism.sequence_parallel:
        act /= dims.tp
    stride = dims.tp * dims.dp  # ranks are laid out [pp, dp, tp]: neighbouring stages are tp*dp ranks apart
    bw = hw.link_bw(cross_node=stride >= hw.devices_per_node)
    return 2 * (micro_batches + dims.pp - 1) * act / bw


def dp_peers_in_node(dims: ParallelDims, devices_per_node: int) -> int:
    """Data-parallel ranks of one group that share a node (ranks [pp, dp, tp], tp innermost, as NxD lays them)."""
    return max(1, min(dims.dp, devices_per_node // dims.tp))


def _dp_comm_s(cfg: RunConfig, dims: ParallelDims, hw: Hardware, n_params: int) -> float:
    """Data-parallel gradient reduction of one device per step: in the node, then across nodes."""
    if dims.dp == 1:
        return 0.0
    p = cfg.precision
    local = n_params / (dims.tp * dims.pp)  # parameters this device holds
    grads = local * (4 if p.fp32_reduce else BYTES[p.param_dtype])
    k = dp_peers_in_node(dims, hw.devices_per_node)
    nodes = dims.dp // k  # nodes one data-parallel group spans
    intra, inter = hw.link_bw(cross_node=False), hw.link_bw(cross_node=True)
    if cfg.parallelism.zero1:  # reduce-scatter the gradients, all-gather the updated parameters
        volume = grads + local * BYTES[p.param_dtype]
        return ring_all_gather_s(volume, k, intra) + ring_all_gather_s(volume / k, nodes, inter)
    # all-reduce = reduce-scatter in the node, all-reduce of the 1/k shard across nodes, all-gather in the node
    return ring_all_reduce_s(grads, k, intra) + ring_all_reduce_s(grads / k, nodes, inter)


def _optimizer_s(cfg: RunConfig, dims: ParallelDims, hw: Hardware, n_params: int) -> float:
    """AdamW reads gradients, parameters and states and writes parameters and states, once per step."""
    bpp = bytes_per_param(cfg.precision)
    shard = dims.tp * dims.pp * (dims.dp if cfg.parallelism.zero1 else 1)
    states = bpp.optimizer + bpp.master
    return n_params / shard * (bpp.grads + 2 * bpp.params + 2 * states) / hw.memory_bw


def estimate_step(cfg: RunConfig, dims: ParallelDims, hw: Hardware, n_params: int) -> StepEstimate:
    """Predict one optimizer step of ``cfg`` laid out as ``dims`` on ``hw`` (docs/planner.md, "Step time")."""
    t = cfg.train
    mb = dims.grad_accum(t)
    tokens = t.global_batch_size * t.seq_len
    model_fpt, extra_fpt = hardware_flops_per_token(cfg, n_params)
    rate = hw.peak_flops * hw.compute_efficiency
    compute = (model_fpt + extra_fpt) * tokens / dims.world_size / rate
    tp = _tp_comm_s(cfg, dims, hw, mb)
    bubble = (compute + tp) * (dims.pp - 1) / mb
    dp = _dp_comm_s(cfg, dims, hw, n_params)
    backward_last = compute / mb * 2 / 3  # the last micro-batch's backward, which a reduction can hide behind
    hidden = min(dp * hw.grad_reduce_overlap, backward_last)
    return StepEstimate(
        compute_s=compute,
        recompute_s=extra_fpt * tokens / dims.world_size / rate,
        tp_comm_s=tp,
        bubble_s=bubble,
        pp_p2p_s=_pp_p2p_s(cfg, dims, hw, mb),
        dp_comm_s=dp,
        dp_exposed_s=dp - hidden,
        optimizer_s=_optimizer_s(cfg, dims, hw, n_params),
        tokens_per_step=tokens,
        model_flops_per_token=model_fpt,
        peak_flops=hw.peak_flops * dims.world_size,
        nodes=-(-dims.world_size // hw.devices_per_node),
        price_per_hour=hw.price_per_hour,
    )
