"""The HLAT decoder on NeuronX Distributed parallel layers, for ``hlat.backends.neuron``.

``to_neuron`` takes an ``hlat.model.Transformer`` (built on the meta device inside NxD's
``initialize_parallel_model``) and swaps, as ``hlat.parallel.TP_PLAN`` says, its fused ``qkv`` for
``GQAQKVColumnParallelLinear``, ``gate_up`` and ``lm_head`` for ``ColumnParallelLinear``, ``o_proj`` and ``down`` for
``RowParallelLinear`` and ``embed`` for ``ParallelEmbedding``, with the keyword arguments of NxD's Llama
example, ``modeling_llama_nxd.py`` (``gather_output=False``, ``input_is_parallel=True``, ``sequence_parallel_enabled``,
``stride=2`` for the fused [gate; up], ``kv_size_multiplier``, fp32 host dtype, ``reduce_dtype``, and an
``init_method`` with the model's std, scaled by 1/sqrt(2l) for the output projections). Module and parameter names
stay those of ``hlat.model`` except inside the swapped layers (``attn.qkv.weight_qkv``).

The NxD classes are *injected* (``NxDLayers``): this module imports nothing from ``torch_xla`` or
``neuronx_distributed``, so it runs on CPU with stand-ins (the model stays single-device code; the backend injects
the layers). It changes behaviour, not structure, by swapping the class of each module for a subclass defined here,
as ``hlat.recompute`` does:

- ``NeuronTransformer.forward(input_ids, labels)`` returns the loss (NxD's pipeline engine needs the loss inside the
  traced model), through ``TokenLoss``: ``parallel_cross_entropy`` on the vocabulary-sharded logits with manual
  masking of ``IGNORE_INDEX`` (NxD's function does not mask).
- Sequence parallelism uses NxD's layout: between the parallel layers activations are ``[S/tp, B, H]``
  (``ParallelEmbedding`` transposes and scatters, the column layers gather the sequence, the row layers
  reduce-scatter it). Attention transposes to batch-first around its core; the logits are transposed back.
- Each ``NeuronAttention`` holds its rotary tables (computed once on the host in fp32 by the ``param_init_fn``,
  shared there): under ``XLA_USE_BF16`` positions computed on the device would be rounded to bf16, and a block owns
  all it needs, so pipeline stages cut between blocks exchange only the residual stream.
- With ``kv_size_multiplier`` > 1 NxD *tiles* the kv heads over the ranks (``repeat``), so the query heads of
  rank r share kv head r mod G instead of the usual consecutive grouping: the same GQA model up to a permutation of
  the query heads, which matters only when converting checkpoints.
- ``NeuronAttentionCore`` is the explicit causal attention of NxD's ``CoreAttention``: a constant mask built on the
  device and softmax in ``upcast_dtype`` (float64 under ``XLA_DOWNCAST_BF16``, which the device runs in fp32).
  ``NeuronRMSNorm`` upcasts the same way.

Nothing here has run on a trn1 host; it runs on CPU against the recording fake of the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hlat.config import ModelConfig
from hlat.model import (
    Attention,
    AttentionCore,
    Block,
    RMSNorm,
    Transformer,
    apply_rope,
    init_normal,
    init_stds,
    rope_tables,
)

IGNORE_INDEX = -100
"""Label of a position that does not count in the loss (masked by hand: ``parallel_cross_entropy`` does not)."""


@dataclass(frozen=True)
class NxDLayers:
    """The NxD layer classes and loss the swap uses (``neuronx_distributed`` on trn1, stand-ins in tests)."""

    column: type[nn.Module]
    """``parallel_layers.ColumnParallelLinear``."""
    row: type[nn.Module]
    """``parallel_layers.RowParallelLinear``."""
    qkv: type[nn.Module]
    """``modules.qkv_linear.GQAQKVColumnParallelLinear`` (returns ``(q, k, v)``)."""
    embedding: type[nn.Module]
    """``parallel_layers.ParallelEmbedding``."""
    cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``parallel_layers.parallel_cross_entropy``: per-token loss of vocabulary-sharded logits, no reduction."""


@dataclass(frozen=True)
class NeuronModelOptions:
    """How the decoder is laid out and which dtypes it uses on Trainium."""

    sequence_parallel: bool
    """``parallelism.sequence_parallel``: activations ``[S/tp, B, H]`` between the parallel layers."""
    kv_size_multiplier: int
    """Copies of each kv head over the tensor-parallel ranks (``ParallelDims.kv_replicas``; 4 for 70B on TP32)."""
    reduce_dtype: torch.dtype
    """dtype of the tensor-parallel sums inside the parallel layers (``precision.fp32_reduce``)."""
    upcast_dtype: torch.dtype
    """dtype of the operations kept in fp32 (softmax, norms, loss): float64 under ``XLA_DOWNCAST_BF16``."""
    fp32_softmax_ce: bool
    """Cross-entropy on logits upcast to ``upcast_dtype`` (``precision.fp32_softmax_ce``)."""
    seed: int = 0
    """``train.seed``: with the parameter's name, it keys every initial weight (``hlat.model.init_normal``)."""


class NeuronRMSNorm(RMSNorm):
    """``RMSNorm`` computed in ``upcast_dtype`` (fp32 on the device also under ``XLA_DOWNCAST_BF16``)."""

    upcast_dtype: torch.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(self.upcast_dtype)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(self.upcast_dtype)).to(x.dtype)


class NeuronAttentionCore(AttentionCore):
    """Causal attention with a constant on-device mask and the softmax in ``upcast_dtype`` (NxD's CoreAttention)."""

    upcast_dtype: torch.dtype

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` (B, H, T, D), ``k`` and ``v`` (B, G, T, D) with G dividing H -> (B, H, T, D)."""
        rep = q.shape[1] // k.shape[1]  # query heads per local kv head
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        T = q.shape[2]
        scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5  # (B, H, T, T)
        # Built on the device from the shape, never an input: a leaky input mask sent HLAT's loss to ~0 (slides p.28).
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=self.upcast_dtype).to(q.dtype)
        return torch.matmul(probs, v)


class NeuronAttention(Attention):
    """Attention over ``GQAQKVColumnParallelLinear``'s ``(q, k, v)``; ``[S, B, ·]`` in and out under SP."""

    sequence_parallel: bool
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        q, k, v = self.qkv(x)  # this rank's heads over the whole sequence: (B, T, ·), or (T, B, ·) under SP
        if self.sequence_parallel:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        B, T, D = q.shape[0], q.shape[1], self.head_dim
        q, k, v = (t.reshape(B, T, -1, D) for t in (q, k, v))  # (B, T, local heads, D)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, -1)
        if self.sequence_parallel:
            y = y.transpose(0, 1)  # (T, B, ·): the row-parallel o_proj reduce-scatters the sequence
        return self.o_proj(y)


class NeuronBlock(Block):
    """Pre-norm block whose attention brings its own rotary tables (a pipeline stage boundary is a block)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TokenLoss(nn.Module):
    """Mean cross-entropy over the positions whose label is not ``IGNORE_INDEX``, from vocabulary-sharded logits.

    A module so that NxD's pipeline tracer keeps it whole (``leaf_module_cls``): ``parallel_cross_entropy`` is an
    autograd function that torch.fx cannot trace through.
    """

    def __init__(
        self,
        cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        upcast_dtype: torch.dtype | None,
        out_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.cross_entropy, self.upcast_dtype, self.out_dtype = cross_entropy, upcast_dtype, out_dtype

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``logits`` (B, T, V/tp), ``labels`` (B, T) -> 0-d loss in ``out_dtype``."""
        if self.upcast_dtype is not None:
            logits = logits.to(self.upcast_dtype)
        per_token = self.cross_entropy(logits, labels)  # (B, T), summed over the vocabulary shards inside
        keep = (labels != IGNORE_INDEX).to(per_token.dtype)
        return ((per_token * keep).sum() / keep.sum().clamp_min(1)).to(self.out_dtype)


class NeuronTransformer(Transformer):
    """The decoder as NxD trains it: ``forward(input_ids, labels)`` returns the mean token loss."""

    sequence_parallel: bool
    loss_fn: TokenLoss

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``input_ids`` and ``labels`` (B, T) -> 0-d loss. Traceable by torch.fx with blocks as leaves."""
        h = self.embed(input_ids)  # (B, T, dim), or (T/tp, B, dim) under SP
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(self.norm(h))  # (B, T, V/tp), or (T, B, V/tp) under SP (the sequence gathered)
        if self.sequence_parallel:
            logits = logits.transpose(0, 1)
        return self.loss_fn(logits, labels)


class NamedInit:
    """An NxD ``init_method`` keyed by name: fills the full (unsharded) weight with ``hlat.model.init_normal``.

    NxD's parallel layers call their ``init_method`` on the whole master weight and keep this rank's shard
    (``_initialize_parameter_cpu``), so the weight ``name`` gets the values the torch backend gives it, whatever the
    tensor-parallel degree, the pipeline stage that materializes it or the order NxD initializes modules in.
    """

    def __init__(self, seed: int, name: str, std: float) -> None:
        self.seed, self.name, self.std = seed, name, std

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return weight.copy_(init_normal(self.seed, self.name, weight.shape, self.std))

    def __repr__(self) -> str:
        return f"NamedInit({self.name!r}, std={self.std:g})"


class QKVInit:
    """The ``init_method`` of ``GQAQKVColumnParallelLinear``: q, k and v cut from hlat's fused qkv weight.

    The layer calls it three times per initialization, on the whole q, k and v weights in that order
    (``initialize_weight_biases``); the values come from the torch model's group-interleaved ``qkv.weight`` (rows
    ``[q_0 .. q_{r-1}, k, v]`` per kv group, ``hlat.model``), drawn once by name, so query head h keeps kv head h // r.
    """

    def __init__(self, seed: int, name: str, std: float, cfg: ModelConfig) -> None:
        self.seed, self.name, self.std, self.cfg = seed, name, std, cfg
        self._calls = 0

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The full q (H*D, dim), k and v (G*D, dim) weights of the torch model's fused projection."""
        c, D = self.cfg, self.cfg.head_dim
        r = c.n_heads // c.kv_heads
        full = init_normal(self.seed, self.name, ((c.n_heads + 2 * c.kv_heads) * D, c.dim), self.std)
        groups = full.view(c.kv_heads, r + 2, D, c.dim)
        q = groups[:, :r].reshape(c.n_heads * D, c.dim)
        return q, groups[:, r].reshape(-1, c.dim), groups[:, r + 1].reshape(-1, c.dim)

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        part = self.parts()[self._calls % 3]
        self._calls += 1
        if tuple(weight.shape) != tuple(part.shape):
            raise AssertionError(
                f"{self.name}: NxD asked for a {tuple(weight.shape)} weight, q/k/v part is {tuple(part.shape)}"
            )
        with torch.no_grad():
            return weight.copy_(part)

    def __repr__(self) -> str:
        return f"QKVInit({self.name!r}, std={self.std:g})"


def _swap_block(block: Block, cfg: ModelConfig, nxd: NxDLayers, opts: NeuronModelOptions) -> None:
    """Replace the four linears of ``block`` with NxD parallel layers and give it the neuron forwards."""
    at, stds = f"layers.{block.layer_id - 1}", init_stds(cfg)  # the parameter names of hlat.model

    def init(part: str) -> NamedInit:
        return NamedInit(opts.seed, f"{at}.{part}.weight", stds[f"{at}.{part}.weight"])

    std = cfg.init_std
    common = {
        "bias": False,
        "dtype": torch.float32,
        "sequence_parallel_enabled": opts.sequence_parallel,
        "reduce_dtype": opts.reduce_dtype,
    }
    D = cfg.head_dim
    attn, mlp = block.attn, block.mlp
    attn.qkv = nxd.qkv(
        cfg.dim,
        [cfg.n_heads * D, cfg.kv_heads * D],
        gather_output=False,
        init_method=QKVInit(opts.seed, f"{at}.attn.qkv.weight", std, cfg),
        kv_size_multiplier=opts.kv_size_multiplier,
        fuse_qkv=True,
        **common,
    )
    attn.o_proj = nxd.row(cfg.n_heads * D, cfg.dim, input_is_parallel=True, init_method=init("attn.o_proj"), **common)
    # stride=2: each rank gets matching rows of the gate half and of the up half, so FeedForward's chunk(2) holds.
    mlp.gate_up = nxd.column(
        cfg.dim, 2 * cfg.ffn_dim, gather_output=False, stride=2, init_method=init("mlp.gate_up"), **common
    )
    mlp.down = nxd.row(cfg.ffn_dim, cfg.dim, input_is_parallel=True, init_method=init("mlp.down"), **common)
    block.__class__ = NeuronBlock
    attn.__class__ = NeuronAttention
    attn.sequence_parallel = opts.sequence_parallel
    # Filled with the real tables by the param_init_fn (init_module), on the host.
    attn.register_buffer("rope_cos", torch.empty(0), persistent=False)
    attn.register_buffer("rope_sin", torch.empty(0), persistent=False)
    attn.core.__class__ = NeuronAttentionCore
    attn.core.upcast_dtype = opts.upcast_dtype


def to_neuron(model: Transformer, nxd: NxDLayers, opts: NeuronModelOptions) -> NeuronTransformer:
    """Turn ``model`` into the NxD decoder in place (see the module docstring) and return it.

    Meant to run inside NxD's ``initialize_parallel_model`` closure, under its meta-device context: the new
    layers are created there too, and ``init_module`` (the ``param_init_fn``) fills every parameter afterwards.
    """
    cfg = model.cfg
    common = {"dtype": torch.float32, "sequence_parallel_enabled": opts.sequence_parallel}
    # Host parameters are fp32: XLA_USE_BF16 / XLA_DOWNCAST_BF16 make the device copies bf16 (precision_plan).
    init = NamedInit(opts.seed, "embed.weight", cfg.init_std)
    model.embed = nxd.embedding(cfg.vocab_size, cfg.dim, init_method=init, **common)
    for block in model.layers:
        _swap_block(block, cfg, nxd, opts)
    model.lm_head = nxd.column(
        cfg.dim,
        cfg.vocab_size,
        bias=False,
        gather_output=False,
        init_method=NamedInit(opts.seed, "lm_head.weight", cfg.init_std),
        reduce_dtype=opts.reduce_dtype,
        **common,
    )
    for norm in [model.norm, *(n for b in model.layers for n in (b.attn_norm, b.mlp_norm))]:
        norm.__class__ = NeuronRMSNorm
        norm.upcast_dtype = opts.upcast_dtype
        if opts.sequence_parallel:  # NxDOptimizer all-reduces these gradients over the tensor-parallel ranks
            norm.weight.sequence_parallel_enabled = True
    del model.rope_cos, model.rope_sin  # each attention holds its own tables
    model.__class__ = NeuronTransformer
    model.sequence_parallel = opts.sequence_parallel
    out = opts.upcast_dtype if opts.fp32_softmax_ce else torch.float32
    model.loss_fn = TokenLoss(nxd.cross_entropy, opts.upcast_dtype if opts.fp32_softmax_ce else None, out)
    return model  # type: ignore[return-value]


TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "num_partitions", "rank_ordering")
"""What NxD's ``set_tensor_model_parallel_attributes`` sets on a sharded parameter."""


def mark_fused_qkv(layer: nn.Module) -> None:
    """Give ``GQAQKVColumnParallelLinear``'s fused ``weight_qkv`` the tensor-parallel attributes it lost.

    NxD 0.17 rebuilds ``weight_qkv`` as a new ``Parameter(torch.cat([q, k, v]))`` (``modules/qkv_linear.py:541``)
    after setting the attributes on the split views only, so its ``get_grad_norm`` took the fused weight for a
    replicated one and divided its share of the norm by the TP degree: clipping and ``train/grad_norm`` were wrong
    for every run with tp > 1. Each rank holds its own rows (dim 0, stride 1). With ``kv_size_multiplier`` > 1 the
    k and v rows are copies shared by that many ranks; they then count once per copy, as in NxD's unfused layer.
    """
    w = getattr(layer, "weight_qkv", None)
    if w is None or getattr(w, "tensor_model_parallel", False):
        return
    values = (True, 0, 1, layer.output_sizes[0] // layer.q_output_size_per_partition, None)
    for name, value in zip(TP_ATTRIBUTES, values, strict=True):
        setattr(w, name, value)


class ModuleInit:
    """NxD's ``param_init_fn(module, device)``: initialize ``module``'s own parameters on the host.

    NxD calls it for every module after replacing that module's meta parameters by empty host tensors (NxD's
    model_utils.py). Parallel layers initialize themselves as in NxD's Llama example: ``init_weight_cpu`` (Column/Row/
    Embedding) or ``initialize_weight_biases`` (GQAQKV) run their ``init_method`` on the full weight and keep this
    rank's shard; their ``init_method`` (``NamedInit``, ``QKVInit``) draws by name, so every rank, stage and order
    gets the torch backend's weights. The fused qkv weight gets back its tensor-parallel attributes
    (``mark_fused_qkv``). Norms get ones; each attention gets the rotary tables, computed once in fp32 and shared
    on the host.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, module: nn.Module, device: torch.device | None = None) -> None:
        with torch.no_grad():
            if hasattr(module, "init_weight_cpu"):
                module.init_weight_cpu()
            elif hasattr(module, "initialize_weight_biases"):  # GQAQKVColumnParallelLinear
                module.initialize_weight_biases()
                mark_fused_qkv(module)
            elif isinstance(module, RMSNorm):
                module.init_weights()
            if isinstance(module, NeuronAttention):
                module.rope_cos, module.rope_sin = self.rope()

    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (max_seq_len, head_dim) cosine and sine tables, fp32, computed on the first call."""
        if self._rope is None:
            c = self.cfg
            self._rope = rope_tables(c.head_dim, c.max_seq_len, c.rope_theta, "cpu")
        return self._rope

    def __repr__(self) -> str:
        return f"ModuleInit({self.cfg.name})"
