"""The pre-flight check across the job: every rank measures, every rank gets every result, one verdict.

Shared by ``hlat doctor`` and the trainer; a failure raises the same error on every rank, which is not retried.
"""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hlat.backends.base import Env
from hlat.backends.torch.dist import Ranks
from hlat.config import DTYPES, ClusterConfig, ConfigError, RunConfig
from hlat.health.checks import (
    Sync,
    Throttle,
    check_all_reduce,
    check_device,
    collective_figures,
    device_sync,
    matmul_flops,
)
from hlat.health.neuron_tools import ToolResult, neuron_ls
from hlat.health.report import HealthReport, PreflightError, RankResult, evaluate, observations

log = logging.getLogger(__name__)


def preflight(
    cfg: RunConfig, env: Env, *, out_dir: Path | None = None, sync: Sync | None = None
) -> HealthReport | None:
    """The trainer's pre-flight check: on every rank after ``backend.setup``, before data and model are built.

    Rank 0 writes ``<out_dir>/preflight.md``. ``sync`` (``backend.synchronize``) is needed on devices other than CPU
    and CUDA: without it ``auto`` skips the check with a warning, ``on`` is an error. Returns None when off.

    Raises:
        PreflightError: A node failed; the message names it, the reasons and the fix.
    """
    if not cfg.health.preflight_enabled(env.world_size):
        return None
    if cfg.health.preflight == "auto" and sync is None and env.device.type not in ("cpu", "cuda"):
        log.warning(
            "no pre-flight check: timing work on a %s device needs the backend's synchronization "
            "(Backend.synchronize); health.preflight=on makes this an error",
            env.device.type,
        )
        return None
    log.info("pre-flight check of %d rank(s) (health.preflight=%s) ...", env.world_size, cfg.health.preflight)
    ranks = Ranks.from_env()
    tools = [t for t in [neuron_ls(socket.gethostname(), ranks.local_world_size)] if t] if ranks.local_rank == 0 else []
    report = run_checks(cfg, env, tools=tools, sync=sync)
    if env.rank == 0:
        log.info("pre-flight check %s:\n%s", "passed" if report.passed else "FAILED", report.table())
        for note in report.notes:
            log.warning("pre-flight check: %s", note)
        if out_dir is not None:
            write_table(report, out_dir / "preflight.md")
    if not report.passed:
        where = f" (the table: {out_dir / 'preflight.md'})" if out_dir is not None else ""
        raise PreflightError(report.failure_message() + where)
    return report


def log_preflight(report: HealthReport, tracker: Any, path: Path) -> None:
    """Record ``report`` as the run's pre-flight record: ``preflight/*`` metrics at step 0 and the table artifact.

    Metrics rather than params: a restarted job checks again, and MLflow params cannot change.
    """
    if not path.exists():
        write_table(report, path)
    tracker.log_metrics([(0, report.metrics())])
    tracker.log_artifact(path)


def write_table(report: HealthReport, path: Path) -> Path:
    """Write the markdown table (and the verdict) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    verdict = "passed" if report.passed else report.failure_message()
    path.write_text(f"# pre-flight check: {verdict}\n\n{report.table()}\n", encoding="utf-8")
    return path


def run_checks(cfg: RunConfig, env: Env, *, tools: Sequence[ToolResult] = (), sync: Sync | None = None) -> HealthReport:
    """Measure on this rank, gather every rank's results and ``tools`` on every rank, and judge them.

    Collective calls: every rank of the job must call this at the same point.

    Raises:
        ConfigError: ``health.inject_slow_rank`` is not a rank of the job; a device this cannot time.
    """
    h = cfg.health
    if h.inject_slow_rank is not None and h.inject_slow_rank >= env.world_size:
        raise ConfigError(
            f"health.inject_slow_rank={h.inject_slow_rank} is not a rank of this {env.world_size}-rank "
            "job; use a rank below the world size, or null"
        )
    wait = device_sync(env.device, sync)
    ranks, host = Ranks.from_env(), socket.gethostname()
    distributed = env.world_size > 1
    group = dist.new_group(backend="gloo") if distributed else None  # host objects, whatever the device backend
    where = _gather(group, (host, ranks.local_rank), env.world_size)
    ok, note = check_device(env.device, wait)
    if distributed:
        ar_ok, ar_note = check_all_reduce(env.device, env.world_size)
        ok, note = ok and ar_ok, f"{note}; {ar_note}"
    tflops, expected, source = _matmul_in_turn(cfg, env, wait, sync, group, ranks.local_world_size)
    intra, world, nodes = _collectives(cfg, env, wait, where) if distributed else ({}, {}, 1)
    mine = RankResult(
        env.rank,
        host,
        ranks.local_rank,
        str(env.device),
        ok,
        note,
        tflops,
        expected,
        source,
        intra,
        world,
        expected_is_reference=reference_peak(cfg.cluster),
    )
    rows: list[RankResult] = _gather(group, mine, env.world_size)
    all_tools = [t for part in _gather(group, list(tools), env.world_size) for t in part]
    if group is not None:
        dist.destroy_process_group(group)
    return HealthReport(rows, all_tools, evaluate(rows, all_tools, h), nodes, observations(rows, h))


def reference_peak(cluster: ClusterConfig) -> bool:
    """Whether ``cluster``'s peak is one to fail a rank on: configured or published, not a CPU's measured one."""
    return cluster.peak_tflops is not None or cluster.backend == "neuron" or cluster.device == "cuda"


def node_ranks(where: Sequence[tuple[str, int]]) -> dict[str, list[int]]:
    """The global ranks of each node, from every rank's ``(host, local rank)`` in rank order."""
    nodes: dict[str, list[int]] = {}
    for rank, (host, _) in enumerate(where):
        nodes.setdefault(host, []).append(rank)
    return nodes


def _matmul_in_turn(
    cfg: RunConfig, env: Env, wait: Sync, sync: Sync | None, group: Any, local_world: int
) -> tuple[float, float | None, str]:
    """:func:`_matmul` on every rank: all at once on accelerators (a burn-in under load), one after the other on CPU."""
    # The ranks of a CPU host share its cores: measured together they would compare the OS scheduler's shares.
    ranks = Ranks.from_env()
    if env.device.type != "cpu" or group is None or local_world == 1:
        return _matmul(cfg, env, wait, sync)
    result: tuple[float, float | None, str] = (0.0, None, "")
    for turn in range(local_world):  # the same number of barriers on every rank of every node
        if turn == ranks.local_rank:
            result = _matmul(cfg, env, wait, sync)
        dist.barrier(group=group)
    return result


def _matmul(cfg: RunConfig, env: Env, wait: Sync, sync: Sync | None) -> tuple[float, float | None, str]:
    """This rank's matmul TFLOP/s, and the per-device peak it is held to (None if none is known) with its source."""
    from hlat.track.metrics import resolve_peak_flops

    h, dtype_name = cfg.health, cfg.precision.compute_dtype
    assert dtype_name in DTYPES, dtype_name
    n = h.matmul_size or (1024 if env.device.type == "cpu" else 8192)
    measure = functools.partial(
        matmul_flops,
        env.device,
        getattr(torch, dtype_name),
        n,
        h.matmul_seconds,
        h.matmul_repeats,
        sync,
        emulated=env.bf16_matmul == "emulated",
    )
    if h.inject_slow_rank == env.rank:
        log.warning(
            "health.inject_slow_rank=%d: this rank's matmuls run at %g of their speed (a test hook)",
            env.rank,
            h.inject_slow_factor,
        )
        with Throttle(h.inject_slow_factor, wait):
            flops = measure()
    else:
        flops = measure()
    peak, source = resolve_peak_flops(cfg.cluster, dtype_name, cfg.data.cache_dir, env.bf16_matmul)
    return flops / 1e12, (peak / 1e12 if peak else None), source


def _collectives(
    cfg: RunConfig, env: Env, wait: Sync, where: Sequence[tuple[str, int]]
) -> tuple[dict[str, float], dict[str, float], int]:
    """Collective figures within this rank's node and over the job (one node: measured once), and the node count."""
    h = cfg.health
    nbytes = int(h.collective_mib * 2**20)
    nodes = node_ranks(where)
    if len(nodes) == 1:
        world = collective_figures(env.device, wait, nbytes, h.collective_iters)
        return world, world, 1
    groups = {host: dist.new_group(ranks=members) for host, members in nodes.items()}
    members = nodes[where[env.rank][0]]
    intra = {}
    if len(members) > 1:
        intra = collective_figures(
            env.device, wait, nbytes, h.collective_iters, group=groups[where[env.rank][0]], size=len(members)
        )
    dist.barrier()
    world = collective_figures(env.device, wait, nbytes, h.collective_iters)
    for g in groups.values():
        if g != dist.GroupMember.NON_GROUP_MEMBER:  # a rank can only destroy the groups it belongs to
            dist.destroy_process_group(g)
    return intra, world, len(nodes)


def _gather(group: Any, obj: Any, world: int) -> list[Any]:
    """``obj`` of every rank, in rank order (a one-rank job: ``[obj]``)."""
    if group is None:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out
