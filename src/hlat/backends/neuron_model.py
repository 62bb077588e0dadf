"""The HLAT decoder on NeuronX Distributed's parallel layers (``NeuronTransformer``), for ``hlat.backends.neuron``.

Built from ``ModelConfig`` with the module and parameter names and the arithmetic of ``hlat.model`` (inside NxD's
layers, NxD's names: ``attn.qkv.weight_qkv``); ``hlat.parallel.TP_PLAN`` says which NxD layer each projection becomes.
Imports nothing of torch_xla or NxD: the backend injects NxD's classes (``NxDLayers``), tests inject stand-ins.
Nothing here has run on a trn1 host; it runs on CPU against the recording fake and the real NxD in the NxD lane.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hlat.backends.neuron_init import NamedInit, QKVInit, mark_fused_qkv
from hlat.config import ModelConfig
from hlat.model import apply_rope, init_stds, rms_norm, rope_tables
from hlat.parallel import TP_PLAN
from hlat.tally import Batch, mixture_of

IGNORE_INDEX = -100
"""Label of a position that does not count in the loss (masked by hand: ``parallel_cross_entropy`` does not)."""


@dataclass(frozen=True)
class NxDLayers:
    """The NxD layers and loss the decoder is built from (``neuronx_distributed`` on trn1, stand-ins in tests)."""

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


def tp_style(name: str) -> str | None:
    """The ``hlat.parallel.TP_PLAN`` style (colwise, rowwise) of module ``name``; None where it is replicated."""
    return next((style for pattern, style in TP_PLAN.items() if fnmatch.fnmatchcase(name, pattern)), None)


class ParallelLayers:
    """Makes the NxD layer of a module as ``TP_PLAN`` says, with the arguments of NxD's Llama example.

    colwise: ``ColumnParallelLinear(gather_output=False)``, or ``GQAQKVColumnParallelLinear`` for the fused qkv;
    rowwise: ``RowParallelLinear(input_is_parallel=True)``, or ``ParallelEmbedding`` (the vocabulary split) for the
    embedding. Host weights are fp32 (``XLA_USE_BF16`` / ``XLA_DOWNCAST_BF16`` make the device copies bf16), and
    each ``init_method`` draws the whole weight by its ``hlat.model`` name (``NamedInit``, ``QKVInit``).
    """

    def __init__(self, cfg: ModelConfig, nxd: NxDLayers, opts: NeuronModelOptions) -> None:
        self.cfg, self.nxd, self.opts = cfg, nxd, opts
        self.stds = init_stds(cfg)  # with the scaled init of the output projections (paper §4.3)

    def _init(self, name: str) -> NamedInit:
        return NamedInit(self.opts.seed, f"{name}.weight", self.stds[f"{name}.weight"])

    def _check(self, name: str, style: str, layer: str) -> None:
        if tp_style(name) != style:
            raise ValueError(
                f"hlat.parallel.TP_PLAN gives {name} {tp_style(name)}, but NxD's {layer} is {style}: make it {style}"
            )

    def linear(self, name: str, in_features: int, out_features: int, **kwargs: int) -> nn.Module:
        """The column- or row-parallel linear ``name`` (no bias), as its plan entry says."""
        o = self.opts
        common = {
            "bias": False,
            "dtype": torch.float32,
            "sequence_parallel_enabled": o.sequence_parallel,
            "reduce_dtype": o.reduce_dtype,
            "init_method": self._init(name),
        }
        style = tp_style(name)
        if style == "colwise":
            return self.nxd.column(in_features, out_features, gather_output=False, **common, **kwargs)
        if style == "rowwise":
            return self.nxd.row(in_features, out_features, input_is_parallel=True, **common, **kwargs)
        raise ValueError(f"hlat.parallel.TP_PLAN has no entry for {name}: add it as colwise or rowwise")

    def qkv(self, name: str) -> nn.Module:
        """The fused q, k, v projection ``name``: ``GQAQKVColumnParallelLinear`` returning ``(q, k, v)``."""
        self._check(name, "colwise", "GQAQKVColumnParallelLinear")
        c, o, D = self.cfg, self.opts, self.cfg.head_dim
        # With kv_size_multiplier > 1 NxD tiles the kv heads over the ranks: the query heads of rank r share kv head
        # r mod G, not the usual consecutive groups. The same model up to a permutation of the query heads.
        return self.nxd.qkv(
            c.dim,
            [c.n_heads * D, c.kv_heads * D],
            bias=False,
            gather_output=False,
            dtype=torch.float32,
            init_method=QKVInit(o.seed, f"{name}.weight", self.stds[f"{name}.weight"], c),
            sequence_parallel_enabled=o.sequence_parallel,
            kv_size_multiplier=o.kv_size_multiplier,
            fuse_qkv=True,
            reduce_dtype=o.reduce_dtype,
        )

    def embedding(self, name: str) -> nn.Module:
        """The token embedding ``name``, split over the vocabulary; ``[S/tp, B, H]`` out under SP."""
        self._check(name, "rowwise", "ParallelEmbedding")
        c = self.cfg
        return self.nxd.embedding(
            c.vocab_size,
            c.dim,
            init_method=self._init(name),
            dtype=torch.float32,
            sequence_parallel_enabled=self.opts.sequence_parallel,
        )


class NeuronRMSNorm(nn.Module):
    """``hlat.model.rms_norm`` in ``upcast_dtype`` (fp32 on the device, also under ``XLA_DOWNCAST_BF16``)."""

    def __init__(self, cfg: ModelConfig, opts: NeuronModelOptions) -> None:
        super().__init__()
        self.eps, self.upcast_dtype = cfg.norm_eps, opts.upcast_dtype
        self.weight = nn.Parameter(torch.empty(cfg.dim))
        if opts.sequence_parallel:  # NxDOptimizer all-reduces these gradients over the tensor-parallel ranks
            self.weight.sequence_parallel_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.upcast_dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class NeuronAttentionCore(nn.Module):
    """Causal attention as NxD's ``CoreAttention`` computes it: explicit scores, softmax in ``upcast_dtype``."""

    def __init__(self, upcast_dtype: torch.dtype) -> None:
        super().__init__()
        self.upcast_dtype = upcast_dtype

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


class NeuronAttention(nn.Module):
    """Grouped-query attention over ``GQAQKVColumnParallelLinear``'s ``(q, k, v)``; ``[S, B, ·]`` under SP."""

    def __init__(self, cfg: ModelConfig, make: ParallelLayers, name: str) -> None:
        super().__init__()
        self.head_dim, self.sequence_parallel = cfg.head_dim, make.opts.sequence_parallel
        self.qkv = make.qkv(f"{name}.qkv")
        self.core = NeuronAttentionCore(make.opts.upcast_dtype)
        self.o_proj = make.linear(f"{name}.o_proj", cfg.n_heads * cfg.head_dim, cfg.dim)
        # Each attention holds its rotary tables, filled on the host in fp32 by ModuleInit: under XLA_USE_BF16
        # positions computed on the device would round to bf16, and a pipeline stage (whole blocks) needs no input
        # but the residual stream.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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


class NeuronFeedForward(nn.Module):
    """SwiGLU over one fused gate_up projection, as ``hlat.model.FeedForward``."""

    def __init__(self, cfg: ModelConfig, make: ParallelLayers, name: str) -> None:
        super().__init__()
        # stride=2: each rank gets matching rows of the gate half and of the up half, so chunk(2) below holds.
        self.gate_up = make.linear(f"{name}.gate_up", cfg.dim, 2 * cfg.ffn_dim, stride=2)
        self.down = make.linear(f"{name}.down", cfg.ffn_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class NeuronBlock(nn.Module):
    """Pre-norm block; it holds all it needs, so pipeline stages cut between blocks pass only the residual stream."""

    def __init__(self, cfg: ModelConfig, make: ParallelLayers, name: str) -> None:
        super().__init__()
        self.attn_norm = NeuronRMSNorm(cfg, make.opts)
        self.attn = NeuronAttention(cfg, make, f"{name}.attn")
        self.mlp_norm = NeuronRMSNorm(cfg, make.opts)
        self.mlp = NeuronFeedForward(cfg, make, f"{name}.mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def forward(self, logits: torch.Tensor, labels: torch.Tensor, mixture: Batch | None = None) -> torch.Tensor:
        """``logits`` (B, T, V/tp), ``labels`` (B, T) -> 0-d loss in ``out_dtype``.

        ``mixture``: a mixture's micro-batch; its per-token losses go to its per-source tally too (``hlat.tally``).
        """
        if self.upcast_dtype is not None:
            logits = logits.to(self.upcast_dtype)
        per_token = self.cross_entropy(logits, labels)  # (B, T), summed over the vocabulary shards inside
        keep = (labels != IGNORE_INDEX).to(per_token.dtype)
        if mixture is not None:
            mixture.tally.add(per_token * keep, mixture.sources)
        return ((per_token * keep).sum() / keep.sum().clamp_min(1)).to(self.out_dtype)


class NeuronTransformer(nn.Module):
    """The decoder as NxD trains it: token ids (B, T) -> logits, or with labels the mean token loss.

    ``forward(input_ids)`` keeps ``hlat.model.Transformer``'s contract (logits (B, T, V), of which this rank holds
    the vocabulary shard V/tp); ``forward(input_ids, labels)`` returns the loss, which NxD's pipeline engine needs
    inside the traced model. Build it inside NxD's ``initialize_parallel_model`` (meta device); ``ModuleInit`` then
    fills every parameter and the rotary tables.
    """

    def __init__(self, cfg: ModelConfig, nxd: NxDLayers, opts: NeuronModelOptions) -> None:
        super().__init__()
        make = ParallelLayers(cfg, nxd, opts)
        self.cfg, self.sequence_parallel = cfg, opts.sequence_parallel
        self.embed = make.embedding("embed")
        self.layers = nn.ModuleList(NeuronBlock(cfg, make, f"layers.{i}") for i in range(cfg.n_layers))
        self.norm = NeuronRMSNorm(cfg, opts)
        self.lm_head = make.linear("lm_head", cfg.dim, cfg.vocab_size)
        upcast = opts.upcast_dtype if opts.fp32_softmax_ce else None  # None: the loss on the logits' dtype
        self.loss_fn = TokenLoss(nxd.cross_entropy, upcast, upcast if upcast is not None else torch.float32)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, batch: tuple | None = None
    ) -> torch.Tensor:
        """``input_ids`` (B, T) -> logits (B, T, V/tp); with ``labels`` (B, T), the 0-d mean token loss instead.

        Traceable by torch.fx with blocks as leaves (``labels`` is then a proxy, never None; ``batch`` None).
        ``batch``: the micro-batch; a data mixture's (``hlat.tally.Batch``) gets its per-token losses in its tally.
        """
        h = self.embed(input_ids)  # (B, T, dim), or (T/tp, B, dim) under SP
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(self.norm(h))  # (B, T, V/tp), or (T, B, V/tp) under SP (the sequence gathered)
        if self.sequence_parallel:
            logits = logits.transpose(0, 1)
        if labels is None:
            return logits
        mixture = mixture_of(batch)
        return self.loss_fn(logits, labels) if mixture is None else self.loss_fn(logits, labels, mixture)


class ModuleInit:
    """NxD's ``param_init_fn(module, device)``: initialize ``module``'s own parameters on the host.

    NxD calls it for every module once its meta parameters are empty host tensors (NxD's ``model_utils.py``). Parallel
    layers run their ``init_method`` on the whole weight and keep this rank's shard (NxD's Llama example); norms get
    ones; each attention gets the rotary tables, computed once in fp32 and shared on the host.
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
            elif isinstance(module, NeuronRMSNorm):
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
