"""``hlat doctor [overrides]``: the pre-flight burn-in of the configured cluster, on its own (docs/health.md).

It checks the processes ``python train.py`` would start, each set up as training does; it writes the table to
``--out`` (default ``outputs/doctor/<time>-<cluster>.md``), logs it to MLflow with ``--mlflow``, and exits 0
(healthy), 1 (a node failed) or 2 (configuration error).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

from hlat.config import ConfigError, RunConfig
from hlat.health.neuron_tools import ToolResult, nccom_test, neuron_ls
from hlat.health.report import HealthReport, PreflightError

log = logging.getLogger(__name__)

USAGE = """hlat doctor [--out FILE.md] [--mlflow] [--manifest compile-manifest.json] [hydra overrides...]

Pre-flight health check of the cluster the overrides configure (the same overrides as `python train.py`): per rank,
the device computes a known matmul correctly, matmul TFLOP/s against the expected peak and the median rank, and
all-reduce / all-gather bus bandwidth and latency within each node and over the job; neuron-ls and nccom-test where
installed. On Trainium, first: every /dev/neuron* device, EFA devices (several nodes), the memlock and nofile
limits and /dev/shm, each missing one named with the docker/podman run or Kubernetes setting that grants it.
Thresholds: health.min_matmul_fraction, health.min_relative_fraction, health.expected_busbw_gbps_intra / _world,
health.min_bandwidth_fraction. Exit 0: healthy, 1: a node failed (named), 2: configuration error.

options:
  --out FILE.md  where the report (the table and the verdict) goes; default outputs/doctor/<time>-<cluster>.md
  --mlflow       also log the result to MLflow: a run in experiment <tracker.experiment>-health (tracker.uri;
                 tracker=console turns it off), with preflight/* metrics and the table as doctor.md
  --manifest F   first compare this image's neuronx-cc with the one `hlat compile -m` pinned in F (its
                 compile-manifest.json): another compiler finds none of the sweep's compiled graphs (exit 1)

examples:
  hlat doctor cluster=cpu_x2
  hlat doctor cluster=gpu_8x health.expected_busbw_gbps_intra=150 --mlflow
  torchrun --nnodes 4 --nproc-per-node 32 ... -m hlat.cli.doctor cluster=trn1_x4
"""


def main(argv: list[str] | None = None) -> int:
    """``hlat doctor``: check, print the table, write the report (and log to MLflow with ``--mlflow``); exit status."""
    from hlat.config.resolvers import global_rank
    from hlat.launch.elastic import LOG_FORMAT, JobFailedError
    from hlat.logs import console_logging

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    try:
        argv, out, to_mlflow, manifest = _flags(argv)
    except ValueError as e:
        print(f"hlat doctor: {e}\n\n{USAGE}", file=sys.stderr)
        return 2
    console_logging(LOG_FORMAT)
    if manifest is not None:
        problem = check_manifest(manifest)
        if problem is not None:
            print(f"hlat doctor: {problem}", file=sys.stderr)
            return 1
    try:
        from hlat.config.compose import compose_run_config

        cfg = compose_run_config(argv)
        if to_mlflow and cfg.tracker.kind == "mlflow":  # the store, said before the checks take their time
            from hlat.track.mlflow_store import command_tracker

            tracker, store = command_tracker(cfg.tracker, argv)
            if global_rank() == 0:
                print(store.line("hlat doctor"), file=sys.stderr)
            cfg = dataclasses.replace(cfg, tracker=tracker)
        report = check(cfg, argv)
    except PreflightError as e:  # the node lacks a device, a limit or a package (hlat.health.host)
        print(f"hlat doctor: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:
        print(f"hlat: configuration error: {e}", file=sys.stderr)
        return 2
    except JobFailedError as e:
        print(f"hlat doctor: {e}", file=sys.stderr)
        return 1
    if global_rank() == 0:  # under an external torchrun every rank has the report; one prints it
        print(report.table())
        _write_report(cfg, report, out)
        if to_mlflow:
            _log_to_mlflow(cfg, report)
        if report.passed:
            print(f"hlat doctor: all {len(report.ranks)} rank(s) on {report.nodes} node(s) passed")
        else:
            print(f"hlat doctor: {report.failure_message()}", file=sys.stderr)
    return 0 if report.passed else 1


def _flags(argv: list[str]) -> tuple[list[str], Path | None, bool, Path | None]:
    """Split ``--out FILE``, ``--manifest FILE`` (or ``--x=FILE``) and ``--mlflow`` from the Hydra overrides.

    Raises:
        ValueError: a flag without its file, or another ``--`` flag.
    """
    rest, files, to_mlflow = [], {"--out": None, "--manifest": None}, False
    it = iter(argv)
    for a in it:
        flag = a.partition("=")[0]
        if a == "--mlflow":
            to_mlflow = True
        elif flag in files:
            value = a.partition("=")[2] if "=" in a else next(it, "")
            if not value:
                raise ValueError(f"{flag} needs a file name ({flag} FILE)")
            files[flag] = Path(value).expanduser()
        elif a.startswith("--"):
            raise ValueError(f"unknown option {a!r} (the options are --out FILE.md, --manifest FILE and --mlflow)")
        else:
            rest.append(a)
    return rest, files["--out"], to_mlflow, files["--manifest"]


def check_manifest(path: Path) -> str | None:
    """Why this image cannot use the graphs compiled for ``hlat compile -m``'s manifest at ``path``, or None.

    The Neuron cache keeps each compiler version's entries apart (``neuronxcc-<version>/``), so an image with another
    neuronx-cc than the one that compiled them recompiles every graph, for minutes each.
    """
    import importlib.metadata
    import json

    try:
        pinned = json.loads(path.read_text())["neuronx-cc"]
    except (OSError, ValueError, KeyError) as e:
        return f"--manifest {path}: not a compile manifest of `hlat compile -m` ({type(e).__name__}: {e})"
    try:
        here = importlib.metadata.version("neuronx-cc")
    except importlib.metadata.PackageNotFoundError:
        here = None
    if pinned is None:
        print(f"hlat doctor: {path} pins no compiler (rendered where neuronx-cc was not installed): nothing to compare")
        return None
    if here is None:
        return (
            f"{path} was compiled with neuronx-cc {pinned}, and this environment has no neuronx-cc: run hlat doctor "
            "in the image the sweep runs in (docker build --target trn1)"
        )
    if here.split("+")[0] != str(pinned).split("+")[0]:
        return (
            f"this image has neuronx-cc {here}, {path} was compiled with {pinned}: the runs would find none of the "
            f"compiled graphs (the cache keeps them under neuronxcc-{pinned}/); use the image of {pinned} or compile "
            "the sweep again with this one (hlat compile -m ...)"
        )
    print(f"hlat doctor: neuronx-cc {here} is the compiler {path} was compiled with")
    return None


def _write_report(cfg: RunConfig, report: HealthReport, out: Path | None) -> Path | None:
    """The markdown report at ``out`` (default ``outputs/doctor/<time>-<cluster>.md``); its path is printed."""
    from hlat.health.preflight import write_table

    path = out or Path("outputs", "doctor", f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{cfg.cluster.name}.md")
    try:
        write_table(report, path)
    except OSError as e:
        print(f"hlat doctor: could not write the report to {path}: {e}", file=sys.stderr)
        return None
    print(f"hlat doctor: report written to {path}")
    return path


def check(cfg: RunConfig, overrides: list[str]) -> HealthReport:
    """Run the checks over the configured processes of this node (or as one rank of an external torchrun).

    Raises:
        PreflightError: A Neuron node lacks a device, a limit, shared memory or the Neuron packages.
        ConfigError: Several nodes without an external launcher; a bad ``health`` value for this job.
        JobFailedError: A checking process died.
    """
    from hlat.config.resolvers import under_elastic
    from hlat.health.host import check_neuron_host

    c = cfg.cluster
    check_neuron_host(c)  # a trn1 node's devices, limits and packages, before any checking process starts
    if under_elastic() or (c.nproc_per_node == 1 and c.nodes == 1):
        return _worker(overrides, configure_logging=False)
    if c.nodes > 1:
        raise ConfigError(
            f"cluster={c.name} spans {c.nodes} nodes, but `hlat doctor` starts the processes of this node only; run "
            f"`torchrun --nnodes {c.nodes} --nproc-per-node {c.nproc_per_node} --rdzv-backend c10d --rdzv-endpoint "
            "HOST:29400 -m hlat.cli.doctor <same overrides>` on every node"
        )
    return _launch(cfg, overrides)


def _launch(cfg: RunConfig, overrides: list[str]) -> HealthReport:
    """``cluster.nproc_per_node`` checking processes on this node under torch elastic (no restarts)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from hlat.launch.elastic import JobFailedError
    from hlat.launch.rendezvous import one_node_launch

    logs = tempfile.mkdtemp(prefix="hlat-doctor-")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.cluster.nproc_per_node,
        run_id=f"doctor-{uuid.uuid4().hex[:8]}",
        **one_node_launch(),
        max_restarts=0,
        monitor_interval=0.5,  # stores and sockets on 127.0.0.1 only
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=logs),
    )
    try:
        results = elastic_launch(config, _worker)(overrides)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        raise JobFailedError(
            f"checking process {rank} failed with exit code {failure.exitcode} "
            f"({failure.message or 'no message'}); logs in {logs}"
        ) from None
    report = results[min(results)]
    if isinstance(report, str):  # a ConfigError inside the workers, reported as text
        raise ConfigError(report)
    return report


def _worker(overrides: list[str], configure_logging: bool = True) -> HealthReport | str:
    """One checking process: node tools (local rank 0), backend setup as in training, the checks.

    Returns the report, or a ConfigError's message (the agent re-raises it).
    """
    import torch.distributed as dist

    from hlat.backends import get_backend
    from hlat.backends.torch.dist import Ranks
    from hlat.config.compose import compose_run_config
    from hlat.health.preflight import run_checks
    from hlat.launch.elastic import LOG_FORMAT

    if configure_logging:  # a spawned process: log like the agent
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, force=True)
    try:
        cfg = compose_run_config(overrides)
        ranks = Ranks.from_env()
        tools = node_tools(cfg, ranks.local_world_size) if ranks.local_rank == 0 else []
        backend = get_backend(cfg)
        env = backend.setup()
        try:
            return run_checks(cfg, env, tools=tools, sync=backend.synchronize)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except ConfigError as e:
        if not configure_logging:
            raise
        return str(e)


def node_tools(cfg: RunConfig, nproc: int) -> list[ToolResult]:
    """``neuron-ls`` and ``nccom-test`` (all-reduce, all-gather over this node's ``nproc`` ranks), where installed.

    Run before this node's processes claim their devices: nccom-test needs the NeuronCores free.
    """
    h, host = cfg.health, socket.gethostname()
    nbytes = int(h.collective_mib * 2**20)
    want = h.expected_busbw_gbps_intra * h.min_bandwidth_fraction if h.expected_busbw_gbps_intra else None
    found = [neuron_ls(host, nproc)]
    if nproc > 1:
        found += [nccom_test(host, "allr", nproc, nbytes, want), nccom_test(host, "allg", nproc, nbytes)]
    return [t for t in found if t is not None]


def _log_to_mlflow(cfg: RunConfig, report: HealthReport) -> None:
    """One MLflow run in experiment ``<tracker.experiment>-health``: ``preflight/*`` metrics and the table."""
    if cfg.tracker.kind != "mlflow":
        return
    from hlat.health.preflight import log_preflight
    from hlat.track.trackers import MLflowTracker

    tcfg = dataclasses.replace(cfg.tracker, experiment=f"{cfg.tracker.experiment}-health", system_metrics=False)
    tags = {"hlat.kind": "doctor", "cluster": cfg.cluster.name, "passed": str(report.passed)}
    tracker = MLflowTracker(tcfg, run_name=f"doctor-{cfg.cluster.name}", tags=tags)
    with tempfile.TemporaryDirectory() as d:  # the tracker sends its artifacts in the background: finish inside
        log_preflight(report, tracker, Path(d) / "doctor.md")
        tracker.finish("FINISHED" if report.passed else "FAILED")
    print(tracker.ui_hint())


if __name__ == "__main__":
    raise SystemExit(main())
