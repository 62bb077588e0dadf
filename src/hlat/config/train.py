"""Schemas of what is trained and how: model, optimizer, precision, data, parallelism, and the run's ``train`` body."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hlat.config.base import DTYPES, _check, _check_choice, _check_range, _Frozen
from hlat.config.mix import check_sources, check_stages, merge_sources, read_mix_file


@dataclass
class ModelConfig(_Frozen):
    """Architecture of the LLaMA-style decoder (``conf/model/``)."""

    name: str = "tiny"
    """Preset name, for run names and summaries."""
    dim: int = 256
    """Hidden size (d_model)."""
    n_layers: int = 6
    """Number of transformer blocks."""
    n_heads: int = 8
    """Number of query heads; head_dim = dim / n_heads."""
    n_kv_heads: int | None = None
    """Number of key/value heads for grouped-query attention; None means n_heads (plain multi-head)."""
    ffn_dim: int = 704
    """Inner size of the SwiGLU MLP (each of gate and up)."""
    vocab_size: int = 4096
    """Vocabulary size; must equal the tokenizer's."""
    max_seq_len: int = 4096
    """Longest sequence the model supports (sizes the rotary tables)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    init_std: float = 0.021
    """Std of the normal init of every linear and embedding weight (HLAT's scripts: 0.021)."""
    scaled_init: bool = True
    """Scale the init std of attention and MLP output projections by 1/sqrt(2*l), l the 1-based layer index."""
    mask_leak: int = 0
    """Future positions each query may attend to: 0 is causal (real training); > 0 reproduces the paper's leaky-mask
    bug (``experiments/information_leak``)."""

    def __post_init__(self) -> None:
        for key in ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            _check_range(self, f"model.{key}", ">= 1")
        _check_range(self, "model.n_kv_heads", ">= 1", null="as many as model.n_heads")
        _check_range(self, "model.norm_eps", ">= 0")
        _check_range(self, "model.rope_theta", "> 0")
        _check_range(self, "model.init_std", "> 0")
        _check_range(self, "model.mask_leak", ">= 0", note="(0: causal attention, the only setting for real training)")
        _check(
            self.dim % self.n_heads == 0,
            f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}; choose n_heads that divides dim",
        )
        _check(
            (self.dim // self.n_heads) % 2 == 0,
            f"head_dim = model.dim / model.n_heads = {self.dim // self.n_heads} must be even for rotary embeddings; "
            "choose model.n_heads so that model.dim / model.n_heads is even (e.g. 64 or 128)",
        )
        kv = self.kv_heads
        _check(
            0 < kv <= self.n_heads and self.n_heads % kv == 0,
            f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={kv}; "
            "n_kv_heads must divide n_heads (or be null for multi-head attention)",
        )
        self._freeze()

    @property
    def kv_heads(self) -> int:
        """Effective number of key/value heads."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.dim // self.n_heads


@dataclass
class OptimizerConfig(_Frozen):
    """AdamW and its learning-rate schedule (``conf/optimizer/``); defaults are the paper's §3.2."""

    name: str = "adamw"
    """Optimizer name (only AdamW for now)."""
    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 3e-5
    """Floor of the cosine decay."""
    warmup_steps: int = 2000
    """Linear warmup length in optimizer steps."""
    decay_steps: int | None = None
    """Steps from the end of warmup to the floor; None means until train.steps."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2 (0.95 in the paper; 0.99 was unstable with BF16 + stochastic rounding)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    decay_norms_and_biases: bool = True
    """Apply weight decay to norm weights and biases too (the paper decays all parameters)."""
    clip_grad_norm: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 disables clipping."""

    def __post_init__(self) -> None:
        _check_choice("optimizer.name", self.name, ("adamw",))
        _check_range(self, "optimizer.lr", "> 0")
        _check_range(
            self,
            "optimizer.min_lr",
            f"[0, {self.lr}]",
            note="(0 up to optimizer.lr)",
            example=min(self.lr, OptimizerConfig.min_lr),
        )
        for key in ("beta1", "beta2"):
            _check_range(self, f"optimizer.{key}", "[0, 1)")
        _check_range(self, "optimizer.eps", "> 0")
        _check_range(self, "optimizer.weight_decay", ">= 0", note="(0: no weight decay)")
        _check_range(self, "optimizer.warmup_steps", ">= 0", note="(0: no warmup)")
        _check_range(self, "optimizer.decay_steps", ">= 1", null="decay until train.steps")
        _check_range(self, "optimizer.clip_grad_norm", ">= 0", note="(0: no clipping)")
        self._freeze()


@dataclass
class PrecisionConfig(_Frozen):
    """Backend-neutral numeric policy (``conf/precision/``, docs/precision.md; arXiv 2404.10630 §3.5, §6)."""

    name: str = "fp32"
    """Preset name."""
    param_dtype: str = "float32"
    """Storage dtype of the model's parameters (and of their gradients)."""
    compute_dtype: str = "float32"
    """Dtype of the matmuls in forward and backward; bfloat16 with float32 parameters means autocast."""
    master_weights: bool = False
    """Keep fp32 master weights and AdamW moments in the optimizer, copied into the bf16 parameters after each
    update. Needs param_dtype=bfloat16."""
    stochastic_rounding: bool = False
    """Round every bf16 write of the optimizer stochastically (seeded by train.seed). Needs param_dtype=bfloat16."""
    fp32_grad_accum: bool = True
    """Accumulate gradients over micro-batches in fp32 buffers. Always true with float32 parameters."""
    fp32_reduce: bool = True
    """All-reduce gradients (and tensor-parallel partial sums) in fp32. Always true with float32 parameters."""
    fp32_softmax_ce: bool = True
    """Softmax and cross-entropy over the vocabulary in fp32 (attention's fused kernel keeps fp32 statistics
    anyway). Always true with float32 compute."""
    bf16_matmul: str = "auto"
    """How the torch backend runs bf16 matmuls: ``native``, ``emulated`` (fp32 multiply, bf16 result), or ``auto``,
    the faster on this host by a cached probe. The neuron backend takes only ``auto`` or ``native``."""

    def __post_init__(self) -> None:
        _check_choice("precision.param_dtype", self.param_dtype, DTYPES)
        _check_choice("precision.compute_dtype", self.compute_dtype, DTYPES)
        _check_choice("precision.bf16_matmul", self.bf16_matmul, ("auto", "native", "emulated"))
        low = self.param_dtype != "float32"
        _check(
            not (low and self.compute_dtype == "float32"),
            f"precision.param_dtype={self.param_dtype} with precision.compute_dtype=float32: matmuls on "
            "low-precision weights cannot run in fp32; use precision=autocast (fp32 weights, bf16 matmuls) or fp32",
        )
        for key in ("master_weights", "stochastic_rounding"):
            _check(
                low or not getattr(self, key),
                f"precision.{key}=true needs precision.param_dtype=bfloat16 (with float32 parameters there is "
                f"nothing to round or copy); use precision=master_weights or precision=bf16_sr",
            )
        for key, needs in (
            ("fp32_grad_accum", low),
            ("fp32_reduce", low),
            ("fp32_softmax_ce", self.compute_dtype != "float32"),
        ):
            _check(
                needs or getattr(self, key),
                f"precision.{key}=false cannot be honoured with precision.param_dtype={self.param_dtype} and "
                f"precision.compute_dtype={self.compute_dtype}: that work is already in fp32; leave {key}=true "
                "or pick a bf16 preset",
            )
        self._freeze()

    @property
    def optimizer_dtype(self) -> str:
        """Storage dtype of the AdamW moments: fp32 with master weights or fp32 parameters, else the param dtype."""
        return "float32" if self.master_weights else self.param_dtype


@dataclass
class DataConfig(_Frozen):
    """Where training text comes from and how it is tokenized (``conf/data/``)."""

    name: str = "builtin"
    """Preset name."""
    path: str | None = None
    """Arrow IPC / Parquet / JSONL file or directory of them; null means the builtin corpus."""
    text_column: str = "text"
    """Name of the string column (or JSONL key) holding the documents."""
    tokenizer: str | None = None
    """Path to an existing sentencepiece ``.model``; null trains one on the data at first use and caches it."""
    tokenizer_type: str = "bpe"
    """Model type when training a tokenizer: bpe or unigram."""
    cache_dir: str = "~/.cache/hlat"
    """Where the builtin corpus and trained tokenizers are cached."""
    shuffle: bool = True
    """Shuffle documents (by train.seed) before packing."""
    loader: str = "online"
    """online: tokenize and pack on the fly (the paper's loader); offline_packed: pre-tokenize once and sample
    fixed windows by index (the NeMo/Megatron baseline of the paper's dataloader ablation)."""
    worker: str = "thread"
    """Where the online loader tokenizes ahead of the trainer: thread, process, or none (inline)."""
    prefetch: int = 4
    """Micro-batches the background worker keeps ready."""
    mix: dict[str, Any] = field(default_factory=dict)
    """Named sources mixed by share of trained tokens: ``{name: {path, weight, text_column, max_epochs}}``; not with
    data.path."""
    stages: dict[str, Any] = field(default_factory=dict)
    """The mix's schedule: ``{name: {start | start_tokens | start_fraction, weights: {source: weight}}}``."""
    mix_file: str | None = None
    """YAML file of ``data.mix`` sources, merged into data.mix when the config is validated (data.mix wins)."""
    log_sources: int = 32
    """Most sources with per-source series in MLflow (by weight; the rest as ``other``, all in the Parquet series)."""

    def __post_init__(self) -> None:
        _check_choice("data.tokenizer_type", self.tokenizer_type, ("bpe", "unigram"))
        _check_choice("data.loader", self.loader, ("online", "offline_packed"))
        _check_choice("data.worker", self.worker, ("thread", "process", "none"))
        _check_range(self, "data.prefetch", ">= 1")
        _check(
            bool(self.text_column),
            "data.text_column is empty; set it to the column (or JSONL key) that holds the "
            "documents, e.g. data.text_column=text",
        )
        _check_range(self, "data.log_sources", ">= 1")
        self._check_mix()
        self._freeze()

    def _check_mix(self) -> None:
        """``data.mix`` (with ``data.mix_file``) and ``data.stages`` as typed entries, or the key to fix."""
        raw = merge_sources(read_mix_file(self.mix_file), self.mix) if self.mix_file is not None else self.mix
        self.mix_file = None  # merged: the validated config lists every source in data.mix
        self.mix = check_sources(raw)
        if not self.mix:
            _check(not self.stages, "data.stages is set without data.mix; a schedule needs sources to weigh")
            return
        sources = f"{len(self.mix)} source{'s' * (len(self.mix) > 1)}"
        _check(
            self.path is None,
            f"data.path={self.path} and data.mix ({sources}) are both set: data.path trains one corpus "
            "weighted by size, data.mix named sources by weight; set data.path=null to mix, or drop data.mix",
        )
        _check(
            self.loader == "online",
            f"data.loader={self.loader} does not mix sources; data.mix needs data.loader=online",
        )
        self.stages = check_stages(self.stages, self.mix)

    @property
    def mixed(self) -> bool:
        """Whether the run trains a mixture (``data.mix``) rather than one corpus (``data.path``)."""
        return bool(self.mix)


@dataclass
class ParallelismConfig(_Frozen):
    """Parallel degrees and memory savers (``conf/parallelism/``); data parallelism fills what tp*pp leaves."""

    name: str = "single"
    """Preset name."""
    tp: int = 1
    """Tensor-parallel degree: attention heads (whole kv groups) and the MLP's inner dimension split over tp ranks."""
    pp: int = 1
    """Pipeline-parallel degree: layers split into pp stages."""
    sequence_parallel: bool = False
    """Split norms and residual activations along the sequence over the tp ranks (Korthikanti et al.). Needs tp > 1
    and train.seq_len divisible by tp."""
    zero1: bool = False
    """ZeRO-1: shard optimizer states (and fp32 master weights) over the data-parallel ranks; the neuron backend
    needs it for master_weights and bf16 fp32_grad_accum."""
    activation_checkpointing: str = "none"
    """none; full (recompute each block from its input); selective (recompute only the attention core, the paper's
    choice)."""

    def __post_init__(self) -> None:
        _check_range(self, "parallelism.tp", ">= 1", note="(1: no tensor parallelism)")
        _check_range(self, "parallelism.pp", ">= 1", note="(1: no pipeline parallelism)")
        _check_choice(
            "parallelism.activation_checkpointing", self.activation_checkpointing, ("none", "full", "selective")
        )
        _check(
            not self.sequence_parallel or self.tp > 1,
            "parallelism.sequence_parallel=true needs parallelism.tp > 1 (it splits along the sequence over the "
            "tensor-parallel ranks); set tp or turn sequence_parallel off",
        )
        self._freeze()


@dataclass
class TrainConfig(_Frozen):
    """Run-level settings (the body of ``conf/config.yaml``)."""

    steps: int = 200
    """Optimizer steps to run."""
    seq_len: int = 256
    """Tokens per sequence."""
    global_batch_size: int = 16
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank; the rest is gradient accumulation."""
    log_every: int = 10
    """Fetch metrics from the device and log them every N steps."""
    progress_every: int | None = None
    """When stderr is not a terminal: one plain progress line every N steps instead of tqdm's bar; null: every
    ``train.log_every`` steps."""
    seed: int = 1234
    """Seed for initialization, data order and everything else random."""
    checkpoint_every: int = 100
    """Save a checkpoint every N steps (0: only after the last step)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; null means ``<run dir>/checkpoints``."""
    keep_last: int = 2
    """Keep only the newest N checkpoints (0 keeps all)."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this permanently (0: none)."""
    async_checkpoint: bool = True
    """Save in a background thread (DCP ``async_save``): the step waits only for the copy to host memory."""
    resume: str = "auto"
    """auto: the newest valid checkpoint, else start fresh; never: start fresh (refusing existing checkpoints);
    otherwise a checkpoint directory, or a checkpoints root whose newest valid one is used."""
    init_from: str | None = None
    """Start a new run from these weights: an hlat checkpoint or a Hugging Face LLaMA directory. Once the run has
    checkpoints of its own, ``train.resume`` wins."""
    on_nonfinite: str = "halt"
    """On a non-finite loss or gradient norm: halt (before it is checkpointed), rollback (reload the last checkpoint,
    skip the batch) or skip_step (drop the update; one host read per step)."""
    dry_run: bool = False
    """Validate, build on the meta device, print the summary and the memory estimate, then exit."""
    compile: bool = False
    """torch backend: ``torch.compile`` each transformer block (the first step pays the compilation); the neuron
    backend refuses it."""
    step_breakdown: bool = False
    """Log where each step's time goes (``time/<phase>_s``); synchronizes the device at each phase, hence off by
    default. The neuron backend refuses it."""
    preempt_grace_s: float = 20.0
    """Seconds from a stop signal to exit: finish the step, checkpoint it, exit 85; ``hlat launch`` grants this plus
    10 s (docs/fault-recovery.md)."""

    def __post_init__(self) -> None:
        for key in ("steps", "seq_len", "global_batch_size", "micro_batch_size", "log_every"):
            _check_range(self, f"train.{key}", ">= 1")
        _check_range(self, "train.progress_every", ">= 1", null="every train.log_every steps")
        _check_range(self, "train.checkpoint_every", ">= 0", note="(0: only after the last step)")
        _check_range(self, "train.keep_last", ">= 0", note="(0: keep all)")
        _check_range(self, "train.keep_every", ">= 0", note="(0: none kept permanently)")
        _check(bool(self.resume), "train.resume is empty; set train.resume=auto, never or a checkpoint path")
        _check_choice("train.on_nonfinite", self.on_nonfinite, ("halt", "rollback", "skip_step"))
        _check_range(self, "train.preempt_grace_s", "> 0", note="(seconds)")
        self._freeze()
