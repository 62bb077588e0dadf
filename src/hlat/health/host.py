"""What a Trainium trainer needs from its host or container, checked before any trainer process starts.

A container on a trn1 host sees only the devices, limits and shared memory its ``docker run`` / ``podman run`` /
Kubernetes pod grants it; when one is missing, the failure otherwise comes from deep inside the Neuron runtime, after
every trainer process has started. :func:`neuron_host_problems` names each missing piece with the setting that
grants it; ``hlat doctor`` and ``python train.py`` (:func:`check_neuron_host`) refuse to start without them.
"""

from __future__ import annotations

import importlib.util
import os
import re
import resource
from collections.abc import Callable
from pathlib import Path

from hlat.config import ClusterConfig
from hlat.health.report import PreflightError

NEURON_DEVICES = {"trn1.2xlarge": 1, "trn1.32xlarge": 16, "trn1n.32xlarge": 16}
"""``/dev/neuronN`` per instance type: one per Trainium chip, 2 NeuronCores each (Neuron docs: Trn1 Architecture)."""
MIN_NOFILE = 8192
"""Open files per process: each of a node's trainers holds data shards, checkpoint files and a socket to each peer;
the common soft default of 1024 runs out."""
MIN_SHM_BYTES = 1 << 30
"""``/dev/shm``: the data loader and the Neuron runtime pass tensors through it; Docker's default is 64 MiB."""
NEURON_PACKAGES = ("torch_xla", "neuronx_distributed")

Limit = Callable[[int], tuple[int, int]]


def neuron_devices_expected(cluster: ClusterConfig) -> int:
    """``/dev/neuronN`` devices a node of ``cluster`` must see: by instance type, else one per 2 NeuronCores."""
    if cluster.instance_type in NEURON_DEVICES:
        return NEURON_DEVICES[cluster.instance_type]
    return max(1, cluster.devices_per_node // 2)


def missing_packages() -> list[str]:
    """The Neuron packages this interpreter cannot import (looked up, not imported: importing torch_xla is slow)."""
    return [name for name in NEURON_PACKAGES if importlib.util.find_spec(name) is None]


def neuron_host_problems(
    cluster: ClusterConfig,
    *,
    dev: Path = Path("/dev"),
    getrlimit: Limit = resource.getrlimit,
    shm_bytes: int | None = None,
) -> list[str]:
    """Each device, limit or shared-memory size a node of ``cluster`` lacks, with the setting that fixes it.

    Only for Trainium (``cluster.pjrt_device`` NEURON); EFA devices and locked memory only on several nodes.
    ``dev``, ``getrlimit`` and ``shm_bytes`` (default: the size of ``dev``/shm) let tests stand in for the host.
    """
    if cluster.backend != "neuron" or cluster.pjrt_device != "NEURON":
        return []
    problems = []
    want = neuron_devices_expected(cluster)
    missing = [f"neuron{i}" for i in range(want) if not (dev / f"neuron{i}").exists()]
    if missing:
        flags = " ".join(f"--device=/dev/neuron{i}" for i in range(want))
        problems.append(
            f"{len(missing)} of the {want} Neuron devices of a {cluster.instance_type or cluster.name} node are "
            f"missing ({_names(missing)}): docker/podman run {flags}; Kubernetes: resources.limits "
            f"aws.amazon.com/neuron: {want} (the Neuron device plugin)"
        )
    if cluster.nodes > 1 and cluster.efa_devices > 0:
        found = len([p for p in _list(dev / "infiniband") if re.fullmatch(r"uverbs\d+", p)])
        if found < cluster.efa_devices:
            flags = " ".join(f"--device=/dev/infiniband/uverbs{i}" for i in range(cluster.efa_devices))
            problems.append(
                f"{cluster.nodes} nodes talk over EFA, but {found} of the {cluster.efa_devices} EFA devices "
                f"(/dev/infiniband/uverbs*) are here: docker/podman run {flags}; Kubernetes: resources.limits "
                f"vpc.amazonaws.com/efa: {cluster.efa_devices} (the EFA device plugin)"
            )
        soft = getrlimit(resource.RLIMIT_MEMLOCK)[0]
        if soft != resource.RLIM_INFINITY:
            problems.append(
                f"locked memory is limited to {_size(soft)} but EFA registers the training buffers: docker/podman "
                "run --ulimit memlock=-1; Kubernetes: the node's container runtime default (LimitMEMLOCK=infinity)"
            )
    nofile = getrlimit(resource.RLIMIT_NOFILE)[0]
    if nofile != resource.RLIM_INFINITY and nofile < MIN_NOFILE:
        problems.append(
            f"open files are limited to {nofile} (at least {MIN_NOFILE} needed): docker/podman run "
            f"--ulimit nofile={MIN_NOFILE * 8}:{MIN_NOFILE * 8}; Kubernetes: the node's container runtime "
            "default (LimitNOFILE)"
        )
    shm = _fs_bytes(dev / "shm") if shm_bytes is None else shm_bytes
    if shm < MIN_SHM_BYTES:
        problems.append(
            f"/dev/shm holds {_size(shm)} (at least {_size(MIN_SHM_BYTES)} needed): docker/podman run "
            "--shm-size=16g; Kubernetes: an emptyDir volume with medium: Memory mounted at /dev/shm"
        )
    return problems


def check_neuron_host(cluster: ClusterConfig, *, packages: bool = True) -> None:
    """Refuse a Neuron run whose node lacks the Neuron packages (``packages``), a device, a limit or shared memory.

    Raises:
        PreflightError: Every problem found, each with its fix; before any trainer process has started.
    """
    if cluster.backend != "neuron":
        return
    problems = neuron_host_problems(cluster)
    if packages and (absent := missing_packages()):
        problems.insert(
            0,
            f"the Neuron packages {', '.join(absent)} are not installed (they come from the Neuron repository, not "
            "PyPI): run inside hlat's trn1 image (docker build --target trn1), or train elsewhere with cluster=cpu "
            "or gpu_1x; train.dry_run=true plans a trn1 run anywhere",
        )
    if problems:
        raise PreflightError(f"cluster={cluster.name} cannot run on this node: " + "; ".join(problems))


def _list(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _fs_bytes(path: Path) -> int:
    """The size of the file system at ``path`` (0 where there is none)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_blocks * st.f_frsize


def _names(names: list[str]) -> str:
    """``neuron1, neuron2, ... neuron15`` (the first three and the last of a long list)."""
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])}, ... {names[-1]}"


def _size(n: int) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB" if n >= 2**20 else f"{n / 2**10:.3g} KiB"
