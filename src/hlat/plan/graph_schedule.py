"""Which steps of a run trace a graph that its first steps did not: computed from the schedule, without a device.

A run's graphs are fixed after its first two steps except where the host schedule changes what it traces:

- **fetch lengths**: each log interval stacks its steps' losses into one small fetch graph, one per length; a
  checkpoint off the log grid flushes a shorter interval, and so does a last interval shorter than ``log_every``
  (``hlat.track.metrics.MetricsLogger``, the ``hlat.checkpoint.Checkpointer`` hook after it);
- **special scalars in the optimizer step**: torch-xla passes a Python float into the graph as data, except when it
  equals 0 or +-1, which it bakes in as a constant (``torch::lazy::IsSpecialScalar``). torch's single-tensor AdamW
  computes ``-lr / (1 - beta1^t)``, ``sqrt(1 - beta2^t)`` and ``1 - lr * weight_decay`` on the host each step, so
  the optimizer graph changes when one of them becomes special: a learning rate reaching exactly 0, and the bias
  correction ``sqrt(1 - beta2^t)`` reaching 1. Measured on XLA:CPU (fp32, ``hlat graphs plan --verify``): the
  value counts as special once it *rounds to* 1 in float32, the parameters' dtype on the torch side (beta2 0.01:
  step 4, where float64 would say step 8). For beta2 0.95 that is step 325, for 0.99 step 1,656: late enough that
  a 10-step ahead-of-time compile never sees it.

``expected_compiles`` lists them (the divergence guard logs each as expected); :func:`coverage_gaps` says which of
them an ``hlat compile --steps N`` run would not trace. Pure: the config and ``hlat.optim`` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hlat.config import RunConfig
from hlat.optim import lr_at

WARMUP_STEPS = 2
"""A start's first steps compile its step graphs (step 1's optimizer creates AdamW's state, step 2's is the steady
one); what compiles after them is checked against the schedule."""
FETCH, OPTIMIZER, CHECKPOINT = "fetch", "optimizer", "checkpoint"


@dataclass(frozen=True)
class Expected:
    """A step at which a run traces a graph it has not traced since it started (or since its warm-up)."""

    step: int
    phase: str
    why: str

    def text(self) -> str:
        return f"step {self.step} ({self.phase}): {self.why}"


def _special(values: np.ndarray) -> np.ndarray:
    """Whether each value, rounded to float32, is 0 or +-1 (torch-xla's special scalars; see the module docstring)."""
    v = values.astype(np.float32)
    return (v == 0) | (np.abs(v) == 1)


VARYING = ("the step size -lr/(1-beta1^t)", "the bias correction sqrt(1-beta2^t)", "1 - lr * weight_decay")
FIXED = ("1 - beta1", "beta2", "1 - beta2", "eps")


def optimizer_scalars(cfg: RunConfig, steps: range) -> tuple[list[np.ndarray], list[float]]:
    """AdamW's per-step host scalars (an array each, over the 1-based ``steps``) and its fixed ones.

    As torch's single-tensor AdamW computes them (``torch/optim/adam.py``).
    """
    o, total = cfg.optimizer, cfg.train.steps
    t = np.arange(steps.start, steps.stop, dtype=np.float64)
    lr = np.array([lr_at(int(s) - 1, o, total) for s in t])
    varying = [-lr / (1.0 - o.beta1**t), np.sqrt(1.0 - o.beta2**t)]
    decays = {o.weight_decay} | (set() if o.decay_norms_and_biases else {0.0})
    varying += [1.0 - lr * wd for wd in sorted(decays) if wd != 0]  # torch skips the multiply at 0
    return varying, [1.0 - o.beta1, o.beta2, 1.0 - o.beta2, o.eps]


def optimizer_patterns(cfg: RunConfig, steps: range) -> np.ndarray:
    """Per step of ``steps``: what in AdamW's host scalars decides the optimizer graph, shape (len, 3 x varying).

    For each per-step scalar: whether it is special (a constant), which fixed scalar it equals in float32 (1-based,
    0: none) and which earlier per-step one (1-based). torch-xla passes equal scalars of one graph as ONE input
    (its device-data cache): at step 1, beta2 0.99 gives sqrt(1 - beta2) = 0.1 = 1 - beta1 in float32, so its step-1
    optimizer graph has one input fewer than beta2 0.95's (measured, ``hlat graphs plan --verify``).
    """
    varying, fixed = optimizer_scalars(cfg, steps)
    vals = [v.astype(np.float32) for v in varying]
    consts = np.array(fixed, dtype=np.float32)
    columns = []
    for j, v in enumerate(vals):
        columns.append(_special(v).astype(np.int64))
        hits = v[:, None] == consts[None, :]
        columns.append(np.where(hits.any(axis=1), hits.argmax(axis=1) + 1, 0))
        earlier = np.stack([vals[i] == v for i in range(j)], axis=1) if j else np.zeros((len(v), 1), dtype=bool)
        columns.append(np.where(earlier.any(axis=1), earlier.argmax(axis=1) + 1, 0))
    return np.stack(columns, axis=1)


def _pattern_why(before: np.ndarray, after: np.ndarray, lr: float) -> str:
    """Why step ``after``'s optimizer graph is not ``before``'s, in words."""
    names = []
    for j in range(len(after) // 3):
        name = VARYING[min(j, len(VARYING) - 1)]
        special, fixed, earlier = after[3 * j : 3 * j + 3]
        if special != before[3 * j]:
            value = (
                "the learning rate is exactly 0"
                if j == 0 and lr == 0
                else f"{name} {'is' if special else 'is no longer'} 0 or 1 in float32"
            )
            names.append(value)
        if fixed != before[3 * j + 1] or earlier != before[3 * j + 2]:
            same = [FIXED[fixed - 1]] if fixed else []
            same += [VARYING[earlier - 1]] if earlier else []
            names.append(
                f"{name} equals {' and '.join(same)} in float32"
                if same
                else f"{name} is no longer equal to another scalar"
            )
    return (
        "AdamW's host scalars change which are torch-xla constants or one shared input ("
        + "; ".join(names)
        + "): a new optimizer graph (docs/trn1.md)"
    )


def fetch_lengths(cfg: RunConfig, start: int = 0) -> list[tuple[int, int]]:
    """(step, length) of every metrics fetch from step ``start + 1`` on: log intervals and checkpoint flushes."""
    t = cfg.train
    out, buffered = [], 0
    for step in range(start + 1, t.steps + 1):
        buffered += 1
        if step % t.log_every == 0 or step == t.steps:
            out.append((step, buffered))
            buffered = 0
        saving = step == t.steps or (t.checkpoint_every and step % t.checkpoint_every == 0)
        if saving and buffered:  # the checkpoint flushes what the logger holds (off the log grid)
            out.append((step, buffered))
            buffered = 0
    return out


def expected_compiles(cfg: RunConfig, start: int = 0) -> list[Expected]:
    """The new graphs a (re)start after step ``start`` traces after its first :data:`WARMUP_STEPS` steps."""
    t = cfg.train
    warm = start + WARMUP_STEPS
    found: list[Expected] = []
    seen: set[int] = set()
    for step, length in fetch_lengths(cfg, start):
        if length not in seen:
            seen.add(length)
            if step > warm:
                first = " (the first)" if len(seen) == 1 else " (a new length)"
                found.append(Expected(step, FETCH, f"a fetch of {length} steps' metrics{first}"))
    every = t.checkpoint_every
    first_save = min([s for s in (every * ((start // every) + 1) if every else None, t.steps) if s is not None])
    if first_save > warm:
        found.append(Expected(first_save, CHECKPOINT, "the first checkpoint"))
    if t.steps > warm:
        patterns = optimizer_patterns(cfg, range(start + 1, t.steps + 1))
        known = {tuple(p) for p in patterns[:WARMUP_STEPS]}
        for i in range(WARMUP_STEPS, len(patterns)):
            key = tuple(patterns[i])
            if key not in known:
                step = start + 1 + i
                found.append(Expected(step, OPTIMIZER, _pattern_why(patterns[i - 1], patterns[i], _lr(cfg, step))))
                known.add(key)
    return sorted(found, key=lambda e: (e.step, e.phase))


def _lr(cfg: RunConfig, step: int) -> float:
    return lr_at(step - 1, cfg.optimizer, cfg.train.steps)


def coverage_gaps(cfg: RunConfig, compile_cfg: RunConfig) -> list[str]:
    """What the run ``cfg`` traces that the ahead-of-time compile run ``compile_cfg`` does not.

    Compared by what makes a graph: the fetch lengths, and the optimizer's special-scalar patterns. An empty list:
    the compile run covers every graph of the run (on the schedule's account; the traced twin says the rest).
    """
    gaps = []
    missing = sorted({n for _, n in fetch_lengths(cfg)} - {n for _, n in fetch_lengths(compile_cfg)})
    for n in missing:
        step = next(s for s, m in fetch_lengths(cfg) if m == n)
        gaps.append(
            f"the fetch of {n} steps' metrics (first at step {step}): add a compile step count that ends an "
            f"interval of {n}, or make train.checkpoint_every a multiple of train.log_every"
        )
    run = optimizer_patterns(cfg, range(1, cfg.train.steps + 1))
    comp = {tuple(p) for p in optimizer_patterns(compile_cfg, range(1, compile_cfg.train.steps + 1))}
    for i, p in enumerate(run):
        if tuple(p) not in comp:
            comp.add(tuple(p))
            before = run[i - 1] if i else np.zeros_like(p)
            gaps.append(f"step {i + 1}'s optimizer graph: {_pattern_why(before, p, _lr(cfg, i + 1))}")
    return gaps


def saturation_step(beta: float) -> int | None:
    """The first step t at which ``sqrt(1 - beta^t)`` rounds to 1 in float32 (None: never, e.g. beta = 0 or 1)."""
    if not 0 < beta < 1:
        return None

    def saturated(t: int) -> bool:
        return bool(np.float32(math.sqrt(1.0 - beta**t)) == 1)

    hi = 1
    while not saturated(hi):
        hi *= 2
        if hi > 2**40:
            return None
    lo = hi // 2  # not saturated (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if saturated(mid) else (mid, hi)
    return hi
