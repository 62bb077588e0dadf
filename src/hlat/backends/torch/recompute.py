"""Activation checkpointing: trade recomputation in the backward pass for activation memory.

``parallelism.activation_checkpointing`` picks what the forward pass keeps for the backward pass:

- ``none``: everything autograd saves;
- ``full``: only each ``Block``'s inputs; the whole block runs again when its gradient is needed;
- ``selective``: the attention core's (``AttentionCore``, softmax(QK^T)V) inputs instead of what it saves; only the
  core runs again (Korthikanti et al. 2022; the HLAT paper's choice: a little more memory than ``full``, less
  recomputation). It pays off only with an attention kernel that materializes the (B, H, T, T) softmax; a flash
  kernel keeps little more than those inputs, so there it costs time for no memory
  (``experiments/activation_checkpointing/``).

The recomputation is PyTorch's own non-reentrant ``torch.utils.checkpoint.checkpoint``, the one torch recommends and
the one that composes with hooks, autocast and FSDP2. It is applied by swapping the class of each chosen module for a
subclass whose ``forward`` runs the original under ``checkpoint``, as FSDP2's ``fully_shard`` does, rather than
wrapping it in another module (``checkpoint_wrapper``): a wrapper inserts ``_checkpoint_wrapped_module.`` into every
parameter name that ``named_parameters()`` yields, and per-layer metrics, checkpoints and tests key on those names.
Here no name, parameter or buffer changes. The recomputation replays autocast and the RNG state but no other context:
a context such as ``sdpa_kernel`` must be held over the backward pass too. As with FSDP2, the subclasses are made
at run time, so a whole model cannot be pickled (its state dict can, and checkpoints hold only that). Example::

    apply_activation_checkpointing(model, cfg.parallelism.activation_checkpointing)
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from hlat.config import ConfigError
from hlat.model import AttentionCore, Block, Transformer

MODES: dict[str, type[nn.Module] | None] = {"none": None, "full": Block, "selective": AttentionCore}
"""Each mode and the module type it recomputes (``None``: nothing)."""


class Recomputed(nn.Module):
    """Mixin placed before a module's own class: its forward saves only the inputs and runs again in backward."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # super().forward is the original class's forward. It is called directly, not through __call__: hooks on
        # this module (e.g. FSDP2's all-gather) run once around the checkpointed forward, never again in the
        # recomputation, as with torch's checkpoint_wrapper placed inside them. Submodules' hooks do run again.
        # preserve_rng_state stays on (the default): the model has no dropout today, but a random op added later
        # must draw the same numbers in the recomputation or the gradients would be silently wrong.
        return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)


_SUBCLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def recompute(module: nn.Module) -> None:
    """Make ``module`` recompute its forward in the backward pass, in place; a no-op if it already does."""
    cls = type(module)
    if issubclass(cls, Recomputed):
        return
    if cls not in _SUBCLASSES:  # one subclass per class, so modules of one type keep sharing a type
        _SUBCLASSES[cls] = type(f"Recomputed{cls.__name__}", (Recomputed, cls), {"__module__": cls.__module__})
    module.__class__ = _SUBCLASSES[cls]


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """Apply activation checkpointing of the given mode to ``model`` in place.

    Parameters, buffers and their names are untouched, so it may be called on the meta device before ``to_empty``
    and ``init_weights`` or on a materialized model, before or after tensor parallelism (whose hooks sit on the
    Linear layers inside), and before FSDP2's ``fully_shard`` (the order torchtitan uses). Call it once.

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
            recompute(module)
