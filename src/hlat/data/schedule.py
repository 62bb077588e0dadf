"""A mixture's schedule: which source fills each sequence slot of each global batch, as a pure function of the batch.

The unit of a weight is the trained window (``train.seq_len`` tokens of one source). Within a stage, the windows of
the batches so far are apportioned by Tijdeman's chairman-assignment rule (R. Tijdeman, "The chairman assignment
problem", Discrete Mathematics 32, 1980): unit ``t`` of the stage goes, among the sources whose count is at least
``c = 1 / (2K - 2)`` behind their share ``w t``, to the one whose next unit is due first (``(r + 1 - c) / w``). Every
source's count since the stage began then stays within ``1 - c`` (< 1) of ``w t`` at every unit, so at every
global batch boundary too. Ties go to the source first by name. A stage starts from the counts reached and never
catches up on an earlier stage's deficits; the counts and every source's documents carry over.

The ``n_m`` windows of batch ``k`` are laid out in source order and scattered over the ``G`` slots by a Feistel
permutation keyed by ``(train.seed, k)`` (``hlat.data.order``, its own domain), so that every slot reads every source
at its share on average and their positions in each source stay close.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hlat.data.order import Permutation

BASE = ""
"""The name of the stage before the first of ``data.stages``: the weights of ``data.mix.<source>.weight``."""
PLACE_DOMAIN = "hlat-mix"
"""The key domain of the permutation that places a batch's windows in its slots."""


@dataclass(frozen=True)
class Stage:
    """One stage of the schedule: from global batch ``start`` on, ``fractions`` (summing to 1) of the windows."""

    name: str
    """The ``data.stages`` key (:data:`BASE` for the ``data.mix`` weights)."""
    start: int
    """Its first global batch (0-based): the batch of step ``start + 1``."""
    fractions: dict[str, float]
    """Each source's share of the windows, normalized; a source not listed gets 0."""
    weights: dict[str, float] = field(default_factory=dict)
    """The weights as configured (for messages)."""
    start_key: str = "start"
    """How the config gave the start: ``start``, ``start_tokens`` or ``start_fraction`` (for messages)."""
    start_value: float = 0
    """The value it gave."""

    def key(self, source: str) -> str:
        """The config key of ``source``'s weight in this stage."""
        return f"data.mix.{source}.weight" if self.name == BASE else f"data.stages.{self.name}.weights.{source}"

    @property
    def start_config(self) -> str:
        """The config key of this stage's start."""
        return f"data.stages.{self.name}.{self.start_key}"

    def to_dict(self) -> dict:
        """Plain values, for the loader's saved state."""
        return {
            "name": self.name,
            "start": self.start,
            "fractions": dict(self.fractions),
            "weights": dict(self.weights),
            "start_key": self.start_key,
            "start_value": self.start_value,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Stage:
        """The stage :meth:`to_dict` wrote."""
        return cls(
            str(d["name"]),
            int(d["start"]),
            {str(k): float(v) for k, v in d["fractions"].items()},
            {str(k): float(v) for k, v in d.get("weights", {}).items()},
            str(d.get("start_key", "start")),
            d.get("start_value", d["start"]),
        )


def normalized(weights: dict[str, float]) -> dict[str, float]:
    """``weights`` divided by their sum, in source-name order (at least one must be positive)."""
    total = sum(weights.values())
    return {name: weights[name] / total for name in sorted(weights)}


def apportion(fractions: np.ndarray, done: np.ndarray, units: int) -> np.ndarray:
    """The counts of the next ``units`` windows per source, by Tijdeman's rule (see the module's docstring).

    ``fractions``: (M,) shares summing to 1; ``done``: (M,) windows each source got since the stage began (the
    stage's units so far are ``done.sum()``). Deterministic: the same floats on every rank.
    """
    positive = np.flatnonzero(fractions > 0)
    count = np.zeros(len(fractions), dtype=np.int64)
    if len(positive) == 1:
        count[positive[0]] = units
        return count
    c = 1.0 / (2 * len(positive) - 2)
    f = fractions[positive]
    r = done[positive].astype(np.float64)
    deficit = f * float(done.sum()) - r  # w t - r before the next unit, per positive source
    due = (r + 1 - c) / f  # when each one's next unit is due
    for _ in range(units):
        deficit += f
        j = int(np.argmin(np.where(deficit >= c - 1e-9, due, np.inf)))  # never all inf: the deficits sum to 1 >= c
        deficit[j] -= 1
        due[j] += 1 / f[j]
        count[positive[j]] += 1
    return count


def placement(count: np.ndarray, seed: int, batch: int) -> np.ndarray:
    """The source index of each slot of global batch ``batch`` (``count[m]`` windows of source ``m``)."""
    layout = np.repeat(np.arange(len(count)), count)
    if (count > 0).sum() <= 1:
        return layout
    return layout[Permutation(len(layout), seed, batch, domain=PLACE_DOMAIN)(range(len(layout)))]


@dataclass
class Cursor:
    """Where the schedule stands before global batch ``batch``: each source's windows, overall and in the stage."""

    batch: int
    stage: int
    """Index of the current stage in the schedule's stages."""
    counts: np.ndarray
    """(M,) windows per source since the run began."""
    at_stage: np.ndarray
    """(M,) windows per source when the current stage began."""


@dataclass
class Schedule:
    """The stages of a mixture and the apportionment of every global batch's ``global_batch_size`` windows."""

    names: tuple[str, ...]
    """The sources, in name order: index ``m`` everywhere (counts, placements, the per-source loss)."""
    stages: tuple[Stage, ...]
    """In order of ``start``; the first starts at batch 0."""
    global_batch_size: int
    seed: int
    _fractions: list[np.ndarray] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        assert self.stages and self.stages[0].start == 0, self.stages
        index = {n: i for i, n in enumerate(self.names)}
        self._fractions = []
        for s in self.stages:
            f = np.zeros(len(self.names))
            for name, share in s.fractions.items():
                f[index[name]] = share
            self._fractions.append(f)

    def stage_at(self, batch: int) -> int:
        """Index of the stage global batch ``batch`` belongs to."""
        return max(i for i, s in enumerate(self.stages) if s.start <= batch)

    def fractions(self, stage: int) -> np.ndarray:
        """(M,) shares of stage ``stage``."""
        return self._fractions[stage]

    def start(self) -> Cursor:
        """The cursor before the run's first batch."""
        zero = np.zeros(len(self.names), dtype=np.int64)
        return Cursor(0, self.stage_at(0), zero, zero.copy())

    def step(self, cursor: Cursor) -> tuple[np.ndarray, Cursor]:
        """The windows per source of batch ``cursor.batch`` and the cursor after it."""
        stage, at_stage = cursor.stage, cursor.at_stage
        now = self.stage_at(cursor.batch)
        if now != stage:  # a stage begins: its targets count from here
            stage, at_stage = now, cursor.counts
        count = apportion(self._fractions[stage], cursor.counts - at_stage, self.global_batch_size)
        return count, Cursor(cursor.batch + 1, stage, cursor.counts + count, at_stage)

    def place(self, count: np.ndarray, batch: int) -> np.ndarray:
        """The source index of every slot of batch ``batch``, given its counts."""
        return placement(count, self.seed, batch)
