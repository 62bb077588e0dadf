"""Activation checkpointing on the torch backend: what the forward pass keeps for the backward pass.

``none`` keeps everything; ``full`` only each ``Block``'s inputs (the block runs again in the backward pass);
``selective`` the ``AttentionCore``'s inputs (only softmax(QK^T)V runs again: Korthikanti et al. 2022, the paper's
choice). Each such module runs its computation through its ``run``, set here to torch's non-reentrant checkpoint;
not ``checkpoint_wrapper``, which renames every parameter that checkpoints and per-layer metrics key on
(docs/parallelism.md). May import: ``hlat.config`` and the core.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from hlat.config import ConfigError
from hlat.model import AttentionCore, Block, Transformer

MODES: dict[str, type[nn.Module] | None] = {"none": None, "full": Block, "selective": AttentionCore}
"""Each mode and the module type it recomputes (``None``: nothing)."""


def run_recomputed(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` keeping only ``args`` for the backward pass, where ``fn`` runs again (a module's ``run``)."""
    # preserve_rng_state stays on (the default): the model has no dropout today, but a random op added later must
    # draw the same numbers in the recomputation or the gradients would be silently wrong. The recomputation
    # replays autocast and the RNG state but no other context: hold a context such as sdpa_kernel over backward too.
    return checkpoint(fn, *args, use_reentrant=False)


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """Apply activation checkpointing of the given mode to ``model`` in place.

    Parameters, buffers and their names are untouched, so it may be called on the meta device before ``to_empty``
    and ``init_weights`` or on a materialized model, before or after tensor parallelism (whose hooks sit on the
    Linear layers inside), and before FSDP2's ``fully_shard`` and compilation (torchtitan's order).

    Args:
        model: The decoder (or any module containing ``Block``/``AttentionCore`` submodules).
        mode: ``none``, ``full`` or ``selective`` (``parallelism.activation_checkpointing``).

    Raises:
        ConfigError: ``mode`` is not one of those.
    """
    if mode not in MODES:
        raise ConfigError(
            f"parallelism.activation_checkpointing={mode!r} is not one of {', '.join(MODES)}; "
            "use none, full (recompute each block) or selective (recompute the attention core)"
        )
    target = MODES[mode]
    if target is None:
        return
    for module in model.modules():
        if isinstance(module, target):
            module.run = run_recomputed
