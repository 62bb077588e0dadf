"""Training metrics: buffered on the device every step, fetched and logged every interval.

Also the host-side statistics computed from the fetched values: gradient spikes as the paper defines them
(``SpikeDetector``) and throughput, model FLOPs utilization and cost (``Throughput``).
"""

from __future__ import annotations

import math
import resource
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hlat.backends.base import Backend
from hlat.config import ClusterConfig
from hlat.norms import global_norm, grad_of
from hlat.sizing import flops_per_token  # noqa: F401  (defined torch-free for the planner; re-exported)
from hlat.state import PHASES, NullTimer, StepOutput, StepTimer, TrainState
from hlat.track.goodput import Ledger

Rows = list[tuple[int, dict[str, float]]]
"""Metric rows ``(step, {name: value})`` in step order."""
Interval = Callable[
    [torch.device], tuple[dict[str, torch.Tensor], Callable[[dict[str, list[float]]], dict[str, float]]] | None
]
"""Device values to fetch with an interval's (on the loss's device), and the maker of their metrics from the fetched
values (averaged over the ranks); None when there are none (a data mixture's: ``Loader.interval``)."""


class SpikeDetector:
    """Gradient spikes as the paper defines them (arXiv 2404.10630 §4.1, Fig. 2).

    A spike starts where the norm exceeds r + ``threshold`` (r: the mean of the previous ``window`` norms, spikes
    included) and lasts while it stays above; a non-finite norm counts as above and stays out of the mean.
    """

    def __init__(self, window: int = 20, threshold: float = 0.1) -> None:
        self.window, self.threshold = window, threshold
        self._recent: deque[float] = deque(maxlen=window)
        self.length = 0
        """Duration of the spike in progress (0: none)."""
        self.durations: Counter[int] = Counter()
        """Histogram of finished spikes: duration -> number of spikes."""

    def update(self, norm: float) -> dict[str, float]:
        """Feed one step's gradient norm; returns the live metrics for that step."""
        row: dict[str, float] = {}
        if len(self._recent) == self.window:
            limit = sum(self._recent) / self.window + self.threshold
            above = not math.isfinite(norm) or norm > limit
            if above:
                self.length += 1
            elif self.length:
                self.durations[self.length] += 1
                self.length = 0
            row = {
                "spike/active": float(above),
                "spike/length": float(self.length),
                "spike/count": float(self.count),
                "spike/limit": limit,
            }
        if math.isfinite(norm):
            self._recent.append(norm)
        return row

    @property
    def count(self) -> int:
        """Spikes started so far (finished ones plus the one in progress)."""
        return sum(self.durations.values()) + (self.length > 0)

    def summary(self) -> dict[str, float]:
        """Finished spikes plus the one in progress: count, single-step fraction (the paper's 86%), longest, mean."""
        durations = self.histogram()
        n = sum(durations.values())
        return {
            "spike/summary_count": float(n),
            "spike/single_step_fraction": durations.get(1, 0) / n if n else 0.0,
            "spike/longest": float(max(durations, default=0)),
            "spike/mean_duration": sum(d * c for d, c in durations.items()) / n if n else 0.0,
        }

    def histogram(self) -> dict[int, int]:
        """Duration -> number of spikes, the one in progress included."""
        durations = self.durations + (Counter({self.length: 1}) if self.length else Counter())
        return dict(sorted(durations.items()))

    def state_dict(self) -> dict:
        """Plain-python state for checkpoints, so a resumed run continues the statistics."""
        return {"recent": list(self._recent), "length": self.length, "durations": dict(self.durations)}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``."""
        self._recent = deque(state["recent"], maxlen=self.window)
        self.length = state["length"]
        self.durations = Counter({int(k): v for k, v in state["durations"].items()})


# Published dense peak TFLOP/s per device by compute dtype (vendor datasheets; no sparsity).
PEAK_TFLOPS = {
    "H100": {"bfloat16": 989.4, "float32": 66.9},  # SXM; fp32 without TF32
    "H200": {"bfloat16": 989.4, "float32": 66.9},
    "A100": {"bfloat16": 312.0, "float32": 19.5},
    "trn1": {"bfloat16": 95.0},  # one NeuronCore-v2 (arXiv 2404.10630 §2: 32 x 95 TFLOPS per trn1.32xlarge)
}


@dataclass(frozen=True)
class Throughput:
    """Converts tokens/s into MFU and cost; built once per run."""

    flops_per_token: float
    """PaLM formula (non-causal attention)."""
    flops_per_token_causal: float
    """Causal-halved attention term."""
    peak_flops: float | None
    """Peak FLOP/s of all devices of the run together; None: no MFU metric."""
    cost_per_hour: float | None
    """USD per hour for all nodes of the run; None: no cost metric."""

    def metrics(self, tokens_per_s: float) -> dict[str, float]:
        """``perf/mfu``, ``perf/mfu_causal``, ``perf/model_tflops`` and ``perf/cost_per_4m_tokens`` (CPT)."""
        out = {"perf/model_tflops": tokens_per_s * self.flops_per_token / 1e12}
        if self.peak_flops:
            out["perf/mfu"] = tokens_per_s * self.flops_per_token / self.peak_flops
            out["perf/mfu_causal"] = tokens_per_s * self.flops_per_token_causal / self.peak_flops
        if self.cost_per_hour is not None and tokens_per_s > 0:
            out["perf/cost_per_4m_tokens"] = self.cost_per_hour * 4e6 / tokens_per_s / 3600
        return out


def resolve_peak_flops(
    cluster: ClusterConfig, compute_dtype: str, cache_dir: str, bf16_matmul: str | None = None
) -> tuple[float | None, str]:
    """Peak FLOP/s of ONE device at ``compute_dtype`` and where the figure comes from, or (None, why).

    In order: ``cluster.peak_tflops``; the device's published figure; on CPU, this host's cached measured peak.
    """
    if cluster.peak_tflops is not None:
        return cluster.peak_tflops * 1e12, "cluster.peak_tflops"
    if cluster.backend == "neuron" or cluster.device == "cuda":
        name = "trn1" if cluster.backend == "neuron" else torch.cuda.get_device_name()
        for key, table in PEAK_TFLOPS.items():
            if key in name and compute_dtype in table:
                return table[compute_dtype] * 1e12, f"published {key} {compute_dtype} peak"
        return None, f"no published {compute_dtype} peak for {name!r}: set cluster.peak_tflops to get MFU"
    from hlat.plan.peak import cached_peak, peak_key

    key = peak_key(compute_dtype, bf16_matmul)
    flops = cached_peak(key, cache_dir)
    if flops is None:
        how = "" if key in ("float32", "bfloat16") else f" --dtypes {key}"
        return None, f"this CPU's {key} matmul peak is not measured yet: run `hlat bench peak{how}` once to get MFU"
    return flops, f"measured {key} matmul peak (hlat bench peak)"


def first_peak_hint(source: str, cache_dir: str) -> bool:
    """Whether to print "no MFU metric: ``source``" now: once per host, not every run (the tag records it always)."""
    from hlat.plan.peak import first_hint

    return first_hint(source, cache_dir)


class Uptime:
    """Goodput accounting of one training job across restarts (the paper's uptime, arXiv 2404.10630 §4.2, Table 1).

    uptime = productive / wall: productive counts only the steps the job keeps (restored with the checkpoint), wall
    counts from its first launch, downtime included. ``ledger`` (``hlat.track.goodput``) says where the rest went.
    """

    def __init__(self, start: float, productive_s: float = 0.0, restarts: int = 0) -> None:
        self.start, self.productive_s, self.restarts = start, productive_s, restarts
        self.ledger: Ledger | None = None
        """This attempt's goodput ledger (its ``goodput/*`` metrics join these), once the attempt has one."""

    @classmethod
    def resumed(cls, state: dict) -> Uptime:
        """The job's accounting as saved in a checkpoint, with one more restart."""
        return cls(state["start"], state["productive_s"], state["restarts"] + 1)

    def add_productive(self, seconds: float) -> None:
        """Count ``seconds`` of completed training steps."""
        self.productive_s += seconds

    def metrics(self, now: float | None = None) -> dict[str, float]:
        """``uptime/*`` metrics at wall-clock time ``now`` (default: the current time)."""
        wall = max((time.time() if now is None else now) - self.start, 1e-9)
        productive = min(self.productive_s, wall)
        return {
            "uptime/wall_s": wall,
            "uptime/productive_s": productive,
            "uptime/lost_s": wall - productive,
            "uptime/restarts": float(self.restarts),
            "uptime/pct": 100 * productive / wall,
            **(self.ledger.metrics() if self.ledger is not None else {}),
        }

    def state_dict(self) -> dict:
        """Plain-python state for checkpoints."""
        return {"start": self.start, "productive_s": self.productive_s, "restarts": self.restarts}


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def layer_grad_norms(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gradient L2 norm per layer (``grad_norm/layers.3``, ``grad_norm/embed``, ...) as device tensors."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        g = grad_of(p)
        if g is not None:
            parts = name.split(".")
            groups.setdefault(".".join(parts[:2]) if parts[0] == "layers" else parts[0], []).append(g)
    return {f"grad_norm/{k}": global_norm(v) for k, v in groups.items()}


class MetricsLogger:
    """Loop hook: keeps per-step loss and grad norm on the device, logs them every ``every`` steps.

    Each flush is ONE host transfer (``backend.fetch``): one row per step to ``sink``, the interval's throughput,
    memory, uptime, fault counters and ``extra``'s values on its last row, all computed on the host (docs/telemetry.md
    lists them); ``interval``'s device values join the transfer, their metrics the last row. ``first_nonfinite``: the
    first step whose fetched loss or gradient norm was not finite.
    """

    def __init__(
        self,
        backend: Backend,
        model: nn.Module,
        sink: Callable[[Rows], None],
        *,
        every: int,
        last_step: int,
        tokens_per_step: int,
        seq_len: int = 1,
        extra: Callable[[], dict[str, float]] | None = None,
        spikes: SpikeDetector | None = None,
        spike_summary_every: int = 0,
        throughput: Throughput | None = None,
        uptime: Uptime | None = None,
        layer_norms_every: int = 0,
        timer: StepTimer | NullTimer | None = None,
        interval: Interval | None = None,
    ) -> None:
        self.backend, self.model, self.sink, self.extra = backend, model, sink, extra
        self.interval = interval
        self.every, self.last_step, self.tokens_per_step, self.seq_len = every, last_step, tokens_per_step, seq_len
        self.spikes, self.spike_summary_every, self.throughput = spikes, spike_summary_every, throughput
        self.uptime, self.layer_norms_every = uptime, layer_norms_every
        self._layer_norms: dict[int, dict[str, torch.Tensor]] = {}
        self._steps: list[int] = []
        self._loss: list[torch.Tensor] = []
        self._grad_norm: list[torch.Tensor] = []
        self._lr: list[float] = []
        self._wait = 0.0
        self._t0 = time.perf_counter()
        self.first_nonfinite: int | None = None
        self.timer = timer
        self._startup: dict[str, float] = {}
        self._loop_start: float | None = None

    def start(self, process_start: float) -> None:
        """The loop starts now: restart the interval clock (``perf/startup_s`` counts from ``process_start``)."""
        self._t0 = self._loop_start = time.perf_counter()
        self._startup = {"perf/startup_s": time.time() - process_start}

    def __call__(self, state: TrainState, out: StepOutput) -> None:
        if self._loop_start is not None:  # the first step of this process has just ended
            self._startup["perf/first_step_s"] = time.perf_counter() - self._loop_start
            self._loop_start = None
        self._steps.append(state.step)
        self._loss.append(out.loss)
        self._grad_norm.append(out.grad_norm)
        self._lr.append(out.lr)
        self._wait += out.data_wait_s
        if state.step % self.every == 0 or state.step == self.last_step:
            self.flush(state)

    def _interval_metrics(self, n_steps: int, elapsed: float, wait: float) -> dict[str, float]:
        tokens_per_s = n_steps * self.tokens_per_step / elapsed
        out = {
            "perf/tokens_per_s": tokens_per_s,
            "perf/sequences_per_s": tokens_per_s / self.seq_len,
            "perf/step_time_s": elapsed / n_steps,
            "perf/data_wait_s": wait / n_steps,
            "sys/peak_rss_gib": peak_rss_bytes() / 2**30,
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["sys/cuda_max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        if self.throughput is not None:
            out.update(self.throughput.metrics(tokens_per_s))
        if self.uptime is not None:
            self.uptime.add_productive(elapsed)
            out.update(self.uptime.metrics())
        return out

    def capture_grads(self, step: int, model: nn.Module) -> None:
        """Grad hook for ``fit``: every ``layer_norms_every`` steps, keep per-layer gradient norms (on the device)."""
        if self.layer_norms_every and step % self.layer_norms_every == 0:
            self._layer_norms[step] = layer_grad_norms(model)

    def flush(self, state: TrainState) -> None:
        """Fetch and log the steps buffered since the last flush (nothing if there are none)."""
        if not self._steps:
            return
        tensors = {
            "loss": torch.stack(self._loss),
            "grad_norm": torch.stack(self._grad_norm),
            "param_norm": self.backend.param_norm(self.model),
        }
        for step, norms in self._layer_norms.items():
            tensors.update({f"{step}|{name}": value for name, value in norms.items()})
        fetched = self.interval(tensors["loss"].device) if self.interval is not None else None
        if fetched is not None:  # a data mixture's per-source tallies, in the same transfer
            tensors.update(fetched[0])
        # Captured by value: on lazy devices ``emit`` runs after later steps have started.
        steps, lrs, wait, tokens_seen = self._steps, self._lr, self._wait, state.tokens_seen
        faults = {
            "fault/skipped_updates": float(state.skipped_updates),
            "fault/rollbacks": float(state.rollbacks),
            "fault/discarded_batches": float(len(state.discarded_batches)),
        }
        host = self.extra() if self.extra is not None else {}
        phases = self.timer.take() if self.timer is not None else {}
        startup, self._startup = self._startup, {}  # flushed after a step: the first one has ended

        def emit(values: dict[str, list[float]]) -> None:
            # Runs once the values are on the host, so the clock covers the device work of the interval.
            elapsed = time.perf_counter() - self._t0
            self._t0 = time.perf_counter()
            rows: Rows = []
            for s, loss, gn, lr in zip(steps, values["loss"], values["grad_norm"], lrs, strict=True):
                row = {"train/loss": loss, "train/grad_norm": gn, "train/lr": lr}
                if self.first_nonfinite is None and not (math.isfinite(loss) and math.isfinite(gn)):
                    self.first_nonfinite = s
                if self.spikes is not None:
                    row.update(self.spikes.update(gn))
                rows.append((s, row))
            by_step = dict(rows)
            for key, value in values.items():
                if "|" in key:
                    step, name = key.split("|", 1)
                    by_step[int(step)][name] = value[0]
            last = rows[-1][1]
            last.update({"train/param_norm": values["param_norm"][0], "train/tokens_seen": float(tokens_seen)})
            last.update(faults)
            last.update(self._interval_metrics(len(steps), elapsed, wait))
            if self.timer is not None and self.timer.enabled:
                last.update(phase_metrics(phases, len(steps), elapsed))
            last.update(host)
            if fetched is not None:
                last.update(fetched[1]({k: values[k] for k in fetched[0]}))
            rows[0][1].update(startup)
            every = self.spike_summary_every
            summary_due = steps[-1] == self.last_step or (every and steps[-1] // every > (steps[0] - 1) // every)
            if self.spikes is not None and summary_due:
                last.update(self.spikes.summary())
            self.sink(rows)

        self.backend.fetch(tensors, emit)
        self.discard()

    def discard(self) -> None:
        """Forget the steps buffered since the last flush."""
        self._steps, self._loss, self._grad_norm, self._lr = [], [], [], []
        self._wait, self._layer_norms = 0.0, {}

    def rewind(self) -> None:
        """After a rollback: forget buffered steps and the non-finite one (they are replayed), restart the clock."""
        self.discard()
        self.first_nonfinite = None
        self._t0 = time.perf_counter()


def phase_metrics(seconds: dict[str, float], n_steps: int, elapsed: float) -> dict[str, float]:
    """Seconds per step of each phase (``time/<phase>_s``) from a ``StepTimer``'s totals over an interval.

    ``time/other_s`` is what no phase covers: the hooks other than logging and checkpointing, the loop itself.
    """
    out = {f"time/{name}_s": seconds.get(name, 0.0) / n_steps for name in PHASES}
    out["time/other_s"] = max(0.0, elapsed / n_steps - sum(out.values()))
    return out
