"""Straggler detection: which rank slows the job down, and by how much.

In synchronous data parallelism every step is as long as the slowest rank's, so each rank also measures its *local*
time (forward passes plus data wait), gathered every ``health.straggler_every`` steps. Under TP or FSDP the forward
holds collectives, so it includes their waits; on the neuron backend forward time is tracing time.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hlat.health.checks import all_gather_flat

log = logging.getLogger(__name__)

Rows = list[tuple[int, dict[str, float]]]


class _ForwardTimer:
    """Seconds spent in ``model.forward`` since the last read: host clock on CPU, CUDA events on CUDA."""

    def __init__(self, model: nn.Module) -> None:
        p = next(model.parameters(), None)
        self.cuda = p is not None and p.device.type == "cuda"
        self.host_s = 0.0
        self.t0 = 0.0
        self.events: list[tuple[Any, Any]] = []
        self.handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.events.append((start, None))
        else:
            self.t0 = time.perf_counter()

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events[-1] = (self.events[-1][0], end)
        else:
            self.host_s += time.perf_counter() - self.t0

    def read(self) -> float:
        """Forward seconds since the last read (on CUDA: waits for the last recorded forward to finish)."""
        if self.cuda:
            done = [(s, e) for s, e in self.events if e is not None]
            if done:
                done[-1][1].synchronize()  # once per report: the events of earlier steps are long complete
            seconds = sum(s.elapsed_time(e) for s, e in done) / 1e3
            self.events = []
            return seconds
        seconds, self.host_s = self.host_s, 0.0
        return seconds

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class StragglerMonitor:
    """Loop hook: every ``every`` steps, gather per-rank times and log the slowest rank (on rank 0).

    Construct it on every rank at the same point (it creates a gloo process group). ``model`` None: the local time
    is the data wait only.
    """

    def __init__(
        self,
        every: int,
        log_metrics: Callable[[Rows], None],
        model: nn.Module | None = None,
        *,
        warn_ratio: float = 1.25,
        hosts: list[str] | None = None,
    ) -> None:
        self.every, self.log_metrics, self.warn_ratio = every, log_metrics, warn_ratio
        self.group = dist.new_group(backend="gloo")  # host floats, whatever the device backend (NCCL, XLA)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.hosts = hosts or _gather_hosts(self.group, self.world)
        self.timer = _ForwardTimer(model) if model is not None else None
        self.steps = 0
        self.data_wait_s = 0.0
        self.t_last = time.perf_counter()
        self.last: list[tuple[float, float, float]] = []
        """The last report's (step_s, local_s, data_wait_s) per rank."""

    def __call__(self, state: Any, out: Any) -> None:
        """Loop hook: count the step; every ``every`` steps, the all-gather and the report."""
        self.steps += 1
        self.data_wait_s += out.data_wait_s
        if state.step % self.every:
            return
        now = time.perf_counter()
        n = max(self.steps, 1)
        forward_s = self.timer.read() if self.timer is not None else 0.0
        mine = torch.tensor(
            [(now - self.t_last) / n, (forward_s + self.data_wait_s) / n, self.data_wait_s / n], dtype=torch.float64
        )
        gathered = torch.empty(self.world * 3, dtype=torch.float64)
        all_gather_flat(gathered, mine, self.group)
        self.last = [tuple(row) for row in gathered.view(self.world, 3).tolist()]  # host tensors: no device sync
        self.steps, self.data_wait_s, self.t_last = 0, 0.0, time.perf_counter()
        metrics = straggler_metrics(self.last)
        ratio, slow = metrics["health/straggler_ratio"], int(metrics["health/slowest_rank"])
        if self.rank == 0 and ratio > self.warn_ratio:
            log.warning(
                "straggler: rank %d on %s takes %.2fx the median rank's local time per step (%.4fs behind, "
                "steps %d-%d); check that host (hlat doctor)",
                slow,
                self.hosts[slow],
                ratio,
                metrics["health/straggler_lag_s"],
                state.step - self.every + 1,
                state.step,
            )
        self.log_metrics([(state.step, metrics)])

    def close(self) -> None:
        """Remove the forward hooks and the process group."""
        if self.timer is not None:
            self.timer.remove()
        dist.destroy_process_group(self.group)


def straggler_metrics(rows: list[tuple[float, float, float]]) -> dict[str, float]:
    """``health/*`` metrics from each rank's mean (step_s, local_s, data_wait_s): the slowest vs the median."""
    local = [r[1] for r in rows]
    slow = max(range(len(rows)), key=lambda i: (local[i], -i))
    median = statistics.median(local)
    return {
        "health/slowest_rank": float(slow),
        "health/straggler_lag_s": local[slow] - median,
        "health/straggler_ratio": local[slow] / median if median > 0 else 1.0,
        "health/step_time_s": max(r[0] for r in rows),
        "health/local_time_median_s": median,
    }


def _gather_hosts(group: Any, world: int) -> list[str]:
    import socket

    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return [str(h) for h in hosts]
