"""Where the agents of a job meet: a one-node job on the loopback interface, a Slurm job at its first host.

A one-node job uses :data:`BACKEND`, torch's c10d rendezvous with its stores bound to 127.0.0.1, so nothing a local
run starts listens on the network (docs/fault-recovery.md, "Supervision"). Imports nothing of hlat.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import Any

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
BACKEND = "hlat-loopback"
"""The rendezvous backend name ``LaunchConfig.rdzv_backend`` gets for a one-node job."""
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
RDZV_PORT = 29400
"""The c10d rendezvous port on a multi-node job's first host (torchrun's default)."""


def slurm_rendezvous() -> tuple[str, str, int] | None:
    """Under Hydra's submitit Slurm launcher: ``(rendezvous endpoint, run id, nodes)`` of this Slurm job.

    ``hydra/launcher=slurm`` starts one task per node; each becomes a torch elastic agent (what ``torchrun`` is)
    for its node's trainers, and the agents meet at the job's first host, as NxD's Slurm scripts do with torchrun.
    """
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return None
    import submitit

    job = submitit.JobEnvironment()
    return f"{job.hostnames[0]}:{RDZV_PORT}", f"slurm-{job.job_id}", job.num_nodes


def one_node_launch() -> dict[str, Any]:
    """Prepare this process to launch a one-node job on loopback; returns the ``LaunchConfig`` keywords for it.

    Registers :data:`BACKEND` with torch elastic, and sets the loopback interface for gloo and NCCL in this process's
    environment (where the user has not chosen one), which the trainer processes it starts inherit.
    """
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create_handler)  # the same function again: a no-op
    interface = loopback_interface()
    for name in INTERFACE_VARIABLES:
        os.environ.setdefault(name, interface)
    return {"rdzv_backend": BACKEND, "rdzv_endpoint": f"{LOOPBACK}:0", "local_addr": LOOPBACK}


def create_handler(params: Any) -> Any:
    """Torch elastic's dynamic c10d rendezvous handler with its stores served on 127.0.0.1 only.

    Takes ``RendezvousParameters``, returns a ``RendezvousHandler`` (the ``rendezvous_handler_registry`` contract).
    """
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as dynamic_handler

    class LoopbackBackend(C10dRendezvousBackend):
        """torch's c10d rendezvous backend under this backend's name (the registry checks the handler's)."""

        @property
        def name(self) -> str:
            return BACKEND

    timeout = datetime.timedelta(seconds=params.get_as_int("read_timeout", 60))  # as torch's c10d backend reads it
    store = loopback_store(timeout=timeout)
    handler = dynamic_handler(store, LoopbackBackend(store, params.run_id), params)
    if not hasattr(handler, "_create_tcp_store_server"):  # a torch whose handler shares no store (before 2.4)
        log.warning(
            "torch elastic's rendezvous handler has no shared-store hook: the workers' store may listen on "
            "every interface"
        )
    handler._create_tcp_store_server = lambda _addr, port: loopback_store(port)
    return handler


def loopback_store(port: int = 0, timeout: datetime.timedelta | None = None) -> Any:
    """A ``TCPStore`` server listening on 127.0.0.1 only (``port`` 0: any free port; ``.port`` says which).

    Handed an already bound socket (``master_listen_fd``, torch >= 2.8 with libuv): given only a host name, a
    ``TCPStore`` server listens on every interface.
    """
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, port))
    except OSError:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    extra = {"timeout": timeout} if timeout is not None else {}
    return dist.TCPStore(LOOPBACK, bound, is_master=True, multi_tenant=True, master_listen_fd=sock.detach(), **extra)


def loopback_interface() -> str:
    """The name of the network interface that holds 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addresses):
            return name
    return "lo"
