"""A mixture's micro-batch, and the per-source loss tally that backends keep on the device while they train on it.

A mixture's loader hands out :class:`Batch`: ``(inputs, targets)`` as every loader does, plus the source of each
sequence and the run's :class:`SourceTally`. A backend that sees one computes the per-token loss once (no extra
forward), adds each sequence's loss sum and window count to its source's entry with a ``(B, M)`` one-hot matmul on
the device, and trains on their mean; the metrics logger fetches the tally with the loss every log interval (no
host synchronization inside a step). ``M`` counts every declared source, so the shapes do not change with the mix's
stages (XLA compiles no new graph at a stage change).
"""

from __future__ import annotations

import torch


class SourceTally:
    """Per-source sums of trained-token loss and trained windows since the last :meth:`take`, on the device."""

    def __init__(self, sources: int) -> None:
        self.sources = sources
        self._sums: torch.Tensor | None = None  # (2, M): loss sums, window counts; made on the first add's device

    def add(self, token_losses: torch.Tensor, sources: torch.Tensor) -> None:
        """Add a micro-batch: ``token_losses`` (B, T) per-token losses (detached), ``sources`` (B,) source indices."""
        per_window = token_losses.detach().sum(dim=1)  # (B,)
        ids = sources.to(per_window.device)
        onehot = (ids[:, None] == torch.arange(self.sources, device=per_window.device)[None, :]).to(per_window.dtype)
        part = torch.stack([per_window @ onehot, onehot.sum(dim=0)])  # (2, M)
        self._sums = part if self._sums is None else self._sums + part

    def take(self) -> torch.Tensor | None:
        """The (2, M) sums since the last call (loss sums, windows), and start again; None if nothing was added."""
        sums, self._sums = self._sums, None
        return sums


class Batch(tuple):
    """``(inputs, targets)`` of a mixture's micro-batch, with ``sources`` (B,) int64 and the run's ``tally``."""

    sources: torch.Tensor
    tally: SourceTally

    def __new__(cls, inputs: torch.Tensor, targets: torch.Tensor, sources: torch.Tensor, tally: SourceTally) -> Batch:
        self = super().__new__(cls, (inputs, targets))
        self.sources, self.tally = sources, tally
        return self

    def __reduce__(self):  # a tuple subclass with attributes: pickle them too
        return (Batch, (self[0], self[1], self.sources, self.tally))


def mixture_of(batch: tuple) -> Batch | None:
    """``batch`` if it is a mixture's (its per-token losses go to its tally), else None."""
    return batch if isinstance(batch, Batch) else None
