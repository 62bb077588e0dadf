"""The one-node rendezvous on loopback: the stores torch elastic's agent serves listen on 127.0.0.1 only."""

from __future__ import annotations

import os

import psutil
import pytest

from hlat.launch.rendezvous import BACKEND, LOOPBACK, loopback_interface, loopback_store, one_node_launch


def listening(port: int) -> list[str]:
    """The addresses this process listens on at ``port``."""
    return [
        c.laddr.ip
        for c in psutil.Process().net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]


def test_a_loopback_store_listens_on_127_0_0_1_only_and_works() -> None:
    store = loopback_store()
    assert listening(store.port) == [LOOPBACK]
    store.set("key", "value")
    assert store.get("key") == b"value"


def test_one_node_launch_registers_the_backend_and_puts_the_collectives_on_loopback(monkeypatch) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's choice stays
    assert one_node_launch() == {"rdzv_backend": BACKEND, "rdzv_endpoint": "127.0.0.1:0", "local_addr": LOOPBACK}
    assert one_node_launch()["rdzv_backend"] == BACKEND  # registering twice is harmless
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_interface() and os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
    assert any(a.address == LOOPBACK for a in psutil.net_if_addrs()[loopback_interface()])

    params = RendezvousParameters(BACKEND, f"{LOOPBACK}:0", "t", 1, 1, local_addr=LOOPBACK)
    handler = get_rendezvous_handler(params)
    assert listening(handler._store.port) == [LOOPBACK]  # the rendezvous's own store
    shared = handler._create_tcp_store_server("any-host", 0)  # the workers' store (torch's hook, overridden)
    assert listening(shared.port) == [LOOPBACK]
    with pytest.raises(OSError):  # a port that is taken fails to bind, as torch's own store would
        loopback_store(shared.port)
