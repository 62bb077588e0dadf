"""The Trainium backend (torch-neuronx + neuronx-distributed, Neuron SDK 2.28; shared/reference/neuron-nxd.md).

The only module allowed to import ``torch_xla`` / ``neuronx_distributed``, and only inside functions: those wheels
come from the Neuron repository in the Docker image and cannot be installed elsewhere. What is here so far is the
pure mapping of hlat's precision config onto the Neuron switches, and of a checkpoint onto ``nxd.save_checkpoint`` /
``load_checkpoint`` arguments; the Backend class itself (NxD model and optimizer) arrives with the Trainium issue.
None of this has run on a trn1 host yet.

Precision on Neuron (reference §1.2, §1.8, §2.1, §3):

- fp32: no XLA variable, SR 0, compiler ``--auto-cast=none``.
- autocast: no XLA variable, SR 0, ``torch.autocast("xla", bf16)``.
- bf16: ``XLA_USE_BF16=1``, SR 0.
- bf16_sr: ``XLA_USE_BF16=1``, SR 1 (seeded by train.seed).
- master_weights: ``XLA_DOWNCAST_BF16=1``, SR 0, ZeRO-1 required, NxD ``mixed_precision_config`` with
  ``use_master_weights`` and ``use_fp32_grad_acc``.

Under ``XLA_USE_BF16`` every float *and double* tensor is bf16, so no operation can be kept in fp32: fp32
softmax/cross-entropy and fp32 reductions are config errors there. Under ``XLA_DOWNCAST_BF16`` doubles become fp32,
which is how NxD's model code keeps softmax and RMSNorm in fp32 (``.double()``): ``upcast_dtype`` says which to use.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hlat.config import ConfigError, ParallelismConfig, PrecisionConfig

XLA_MODULES = ("torch_xla", "torch_neuronx", "neuronx_distributed")


@dataclass(frozen=True)
class NeuronPrecision:
    """What a precision config becomes on Trainium."""

    env: dict[str, str]
    """Variables to set before torch_xla is imported (``apply_env``)."""
    cc_flags: tuple[str, ...]
    """neuronx-cc flags to append to ``NEURON_CC_FLAGS`` (NxDT adds the same ones per precision type)."""
    mixed_precision_config: dict[str, bool]
    """``neuronx_distributed_config(mixed_precision_config=...)``."""
    autocast: bool
    """Wrap forward in ``torch.autocast("xla", dtype=torch.bfloat16)`` (fp32 parameters, bf16 matmuls)."""
    upcast_dtype: str
    """The dtype model code casts to for an fp32 operation: float64 under XLA_DOWNCAST_BF16 (mapped to fp32)."""
    reduce_dtype: str
    """``reduce_dtype`` of the ColumnParallelLinear / RowParallelLinear / GQAQKV layers (tensor-parallel sums)."""
    notes: list[str] = field(default_factory=list)
    """Human-readable lines for the run log."""


def precision_plan(p: PrecisionConfig, par: ParallelismConfig, seed: int) -> NeuronPrecision:
    """Map ``precision`` (with ``parallelism.zero1``) onto Neuron env vars, compiler flags and NxD config.

    Args:
        p: The precision config.
        par: The parallelism config (only ``zero1`` matters here).
        seed: train.seed, which seeds the hardware's stochastic rounding.

    Returns:
        The Neuron settings.

    Raises:
        ConfigError: for a combination NxD or torch-xla cannot honour, naming the keys and the fix.
    """
    low = p.param_dtype == "bfloat16"
    if p.master_weights and not par.zero1:
        raise ConfigError(
            f"precision={p.name} (master_weights=true) on the neuron backend needs parallelism.zero1=true: NxD keeps "
            "fp32 master weights inside its ZeRO-1 optimizer (without it neuronx_distributed raises 'Non Zero-1 "
            "optimizer does not support use_master_weights'); add parallelism.zero1=true"
        )
    if low and p.fp32_grad_accum and not par.zero1:
        raise ConfigError(
            f"precision.fp32_grad_accum=true with bf16 parameters (precision={p.name}) on the neuron backend needs "
            "parallelism.zero1=true (NxD's use_fp32_grad_acc lives in the ZeRO-1 optimizer); add "
            "parallelism.zero1=true or set precision.fp32_grad_accum=false"
        )
    if low and not p.master_weights:
        # XLA_USE_BF16: float and double both become bf16, so an "fp32" operation is impossible.
        for key in ("fp32_softmax_ce", "fp32_reduce"):
            if getattr(p, key):
                raise ConfigError(
                    f"precision.{key}=true cannot be honoured by precision={p.name} on the neuron backend: "
                    "XLA_USE_BF16=1 turns every float and double tensor into bf16; set "
                    f"precision.{key}=false or use precision=master_weights (XLA_DOWNCAST_BF16 keeps doubles in fp32)"
                )
    env = {"NEURON_RT_STOCHASTIC_ROUNDING_EN": "1" if p.stochastic_rounding else "0"}
    if p.stochastic_rounding:
        env["NEURON_RT_STOCHASTIC_ROUNDING_SEED"] = str(seed)
    if low:
        env["XLA_DOWNCAST_BF16" if p.master_weights else "XLA_USE_BF16"] = "1"
    autocast = not low and p.compute_dtype == "bfloat16"
    if not low:
        flags: tuple[str, ...] = ("--auto-cast=none",)  # torch decides the dtypes, not the compiler
        if autocast:
            flags += ("--enable-mixed-precision-accumulation",)
    else:
        flags = ("--enable-mixed-precision-accumulation",)
    return NeuronPrecision(
        env=env,
        cc_flags=flags,
        mixed_precision_config={
            "use_master_weights": p.master_weights,
            "use_fp32_grad_acc": low and p.fp32_grad_accum,
            "use_master_weights_in_ckpt": False,
        },
        autocast=autocast,
        upcast_dtype="float64" if (low and p.master_weights) else "float32",
        reduce_dtype="float32" if p.fp32_reduce else "bfloat16",
        notes=[f"precision={p.name}: " + " ".join(f"{k}={v}" for k, v in sorted(env.items()))],
    )


def apply_env(env: dict[str, str]) -> None:
    """Export ``env`` into this process; refuses once torch_xla is imported, because it reads them at import.

    Raises:
        RuntimeError: if a Neuron/XLA module is already imported.
    """
    loaded = [m for m in XLA_MODULES if m in sys.modules]
    if loaded:
        raise RuntimeError(
            f"{', '.join(loaded)} already imported: precision variables {sorted(env)} must be set before torch_xla "
            "is imported (it reads XLA_USE_BF16 / XLA_DOWNCAST_BF16 once); set them at process start"
        )
    os.environ.update(env)


def checkpoint_calls(path: Path, extra: dict[str, Any], *, async_save: bool, zero1: bool) -> tuple[dict, dict]:
    """Keyword arguments of ``nxd.save_checkpoint`` and ``nxd.load_checkpoint`` for one hlat checkpoint directory.

    ``hlat.checkpoint`` keeps owning atomicity and retention (the ``.tmp`` directory, manifest with checksums,
    keep_last / keep_every), so NxD writes into ``path`` as one tag and prunes nothing (``num_kept_ckpts=None``).
    xser serialization writes one tensor at a time (no host OOM at 70B; reference §1.4); loader position, train
    state and RNG travel in ``user_content``. ``async_save`` uses NxD's own thread pool, which
    ``nxd.finalize_checkpoint()`` waits for. Not run on trn1 yet.
    """
    save = {"checkpoint_dir_str": str(path.parent), "tag": path.name, "user_content": extra, "use_xser": True,
            "async_save": async_save, "num_kept_ckpts": None, "zero1_optimizer": zero1}  # fmt: skip
    load = {"path": str(path.parent), "tag": path.name}
    return save, load
