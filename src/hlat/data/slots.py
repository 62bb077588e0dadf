"""The global batch as sequence slots: which slots a data-parallel rank serves, and a saved position per slot.

Global batch ``k`` is window ``k`` of every slot ``0 .. global_batch_size - 1``, in slot order. DP rank ``r`` of
``d`` serves the contiguous slots ``r * G / d .. (r + 1) * G / d``, micro-batch ``j`` of a step the ``j``-th
``micro_batch_size`` of them; so the batch does not depend on the layout. A loader's saved state holds one cursor per
slot it served (``slots``: ``[lo, hi)``; ``cursors``), and :func:`gather` assembles the cursors a rank of another
data-parallel degree needs from the states of the saved ranks that served them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hlat.config import ConfigError


def slot_range(global_batch_size: int, dp_rank: int, dp_size: int) -> range:
    """The sequence slots of the global batch that data-parallel rank ``dp_rank`` of ``dp_size`` serves."""
    if global_batch_size % dp_size or not 0 <= dp_rank < dp_size:
        raise ValueError(f"global_batch_size={global_batch_size} does not split over dp rank {dp_rank} of {dp_size}")
    share = global_batch_size // dp_size
    return range(dp_rank * share, (dp_rank + 1) * share)


def holders(wanted: range, global_batch_size: int, dp_size: int) -> range:
    """The data-parallel ranks of a ``dp_size`` layout whose slots overlap ``wanted`` (contiguous, so few)."""
    share = global_batch_size // dp_size
    return range(wanted.start // share, (wanted.stop - 1) // share + 1)


def covers(state: dict[str, Any], wanted: range) -> bool:
    """Whether a saved loader state holds the cursors of exactly the slots ``wanted``."""
    return list(state.get("slots", ())) == [wanted.start, wanted.stop]


def gather(own: dict[str, Any], wanted: range, read: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """The saved loader state of the slots ``wanted``, from the saved data-parallel ranks that served them.

    ``own`` is one saved rank's state (this rank's, or rank 0's for a rank the saving run did not have); ``read(d)``
    reads saved DP rank ``d``'s state, and is called only for the ranks that held ``wanted`` (at 8192 ranks, a rank
    reads one or two files, not all). A state of another global batch, or another version, is returned as it is:
    the loader's identity check refuses it with the key to restore.

    Raises:
        ConfigError: A saved rank's state does not hold the slots the saved layout says it served.
    """
    if covers(own, wanted) or "slots" not in own:
        return own
    size, dp_size = int(own["global_batch_size"]), int(own["dp_size"])
    if wanted.stop > size or size % dp_size:
        return own
    cursors: dict[int, Any] = {}
    for d in holders(wanted, size, dp_size):
        state = own if own.get("dp_rank") == d else read(d)
        held = slot_range(size, d, dp_size)
        if not covers(state, held):
            raise ConfigError(
                f"the checkpoint's data loader state of data-parallel rank {d} holds slots {state.get('slots')}, not "
                f"[{held.start}, {held.stop}) of the {dp_size}-rank layout that saved it: the checkpoint is damaged; "
                "resume from another checkpoint"
            )
        cursors.update(zip(held, state["cursors"], strict=True))
    return {**own, "slots": [wanted.start, wanted.stop], "cursors": [cursors[s] for s in wanted]}
