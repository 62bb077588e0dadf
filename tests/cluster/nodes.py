"""Two "nodes" on one machine: network namespaces joined by a veth pair, each process with its own hostname.

Tests of multi-node launches (Slurm, torchrun over two hosts) run their commands on these nodes::

    with TwoNodes.create() as (n1, n2):
        agent = n1.popen(["hostname"], stdout=subprocess.PIPE, text=True)
        assert agent.communicate(timeout=10)[0].strip() == "n1"

Layout: namespaces ``<prefix>1`` and ``<prefix>2`` (``/run/netns/<name>``), joined by one veth pair with addresses
``10.231.7.1`` and ``10.231.7.2`` (:data:`SUBNET`, used by nothing else), ``lo`` up in each. Traffic never leaves
these two namespaces. A command on a node runs under ``nsenter --net=/run/netns/<ns>`` and
``unshare --uts --mount``, with ``hostname <name>`` and a private ``/etc/hosts`` (bind-mounted) that maps both
node names, so ``n1`` resolves to the first node everywhere and torch's rendezvous finds its own host by name.
(``ip netns exec`` remounts ``/sys``, which breaks slurmd's cgroup plugin: hence nsenter.) Extra bind mounts
(e.g. a private ``/etc/slurm``) go in :attr:`Node.binds`.

Needs root, ``ip``, ``nsenter`` and ``unshare``: :func:`unavailable` says why not, for a ``pytest.skip``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUBNET = "10.231.7"
"""The private /24 of the node addresses (``10.231.7.<i>``); used only between these namespaces."""
NETNS_DIR = Path("/run/netns")
_ENTER = 'hostname "$0" && for b in "$@"; do [ "$b" = -- ] && break; mount --bind "${b%%=*}" "${b#*=}"; done'


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, a tool missing), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [t for t in ("ip", "nsenter", "unshare", "mount", "hostname") if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)}"
    return None


@dataclass(frozen=True)
class Node:
    """One node: a network namespace, a hostname and the address other nodes reach it at.

    Attributes:
        name: The hostname inside the node (``n1``); resolves to ``addr`` on every node.
        ns: The network namespace (``/run/netns/<ns>``).
        addr: The node's address on the veth link (``10.231.7.1``).
        hosts: The hosts file bind-mounted on ``/etc/hosts`` inside the node.
        binds: More bind mounts inside the node: source path -> target path (both absolute, target existing).
    """

    name: str
    ns: str
    addr: str
    hosts: Path
    binds: Mapping[str, str] = field(default_factory=dict)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this node (network namespace, hostname, private mounts)."""
        mounts = [f"{self.hosts}=/etc/hosts", *(f"{s}={d}" for s, d in self.binds.items())]
        script = f'{_ENTER} && shift {len(mounts) + 1} && exec "$@"'
        return [
            "nsenter",
            f"--net={NETNS_DIR / self.ns}",
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            self.name,
            *mounts,
            "--",
            *argv,
        ]

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen:
        """Start ``argv`` inside this node, like ``subprocess.Popen``.

        The process (the same pid as the command, every wrapper ``exec``s) leads a new session, so
        ``os.killpg(p.pid, sig)`` reaches its children too. ``env`` replaces the environment when given.

        Args:
            argv: The command.
            env: Its whole environment (default: this process's).
            cwd: Its working directory.
            **kwargs: More ``subprocess.Popen`` arguments (``stdout``, ``text``, ...).
        """
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(self.argv(argv), env=None if env is None else dict(env), cwd=cwd, **kwargs)

    def run(
        self, argv: Sequence[str], *, timeout: float, check: bool = True, **kwargs: Any
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside this node to the end (``subprocess.run``), text output captured unless told otherwise.

        Raises:
            subprocess.TimeoutExpired: after ``timeout`` seconds (the command is killed).
            subprocess.CalledProcessError: a non-zero exit with ``check``.
        """
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.argv(argv), timeout=timeout, check=check, **kwargs)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def remove(prefix: str) -> None:
    """Delete the namespaces ``<prefix>1`` and ``<prefix>2`` if they exist (the veth pair goes with them)."""
    for i in (1, 2):
        if (NETNS_DIR / f"{prefix}{i}").exists():
            subprocess.run(["ip", "netns", "delete", f"{prefix}{i}"], capture_output=True, timeout=30)


def create(prefix: str, workdir: Path, names: tuple[str, str] = ("n1", "n2")) -> tuple[Node, Node]:
    """Make the two namespaces, the veth pair between them and the hosts file; stale ones of ``prefix`` go first.

    Args:
        prefix: Namespace name prefix (≤ 12 characters: the veth names ``<prefix>v1`` are ≤ 15).
        workdir: Where the hosts file goes.
        names: The two hostnames.
    """
    if len(prefix) > 12:
        raise ValueError(f"namespace prefix {prefix!r} is longer than 12 characters")
    remove(prefix)
    hosts = workdir / "hosts"
    lines = ["127.0.0.1 localhost", *(f"{SUBNET}.{i} {n}" for i, n in enumerate(names, 1))]
    hosts.write_text("\n".join(lines) + "\n")
    nodes = tuple(Node(n, f"{prefix}{i}", f"{SUBNET}.{i}", hosts) for i, n in enumerate(names, 1))
    try:
        for node in nodes:
            _ip("netns", "add", node.ns)
        _ip("link", "add", f"{prefix}v1", "type", "veth", "peer", "name", f"{prefix}v2")
        for i, node in enumerate(nodes, 1):
            dev = f"{prefix}v{i}"
            _ip("link", "set", dev, "netns", node.ns)
            _ip("-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", dev)
            _ip("-n", node.ns, "link", "set", "lo", "up")
            _ip("-n", node.ns, "link", "set", dev, "up")
    except BaseException:
        remove(prefix)
        raise
    return nodes[0], nodes[1]


@contextmanager
def two_nodes(prefix: str | None = None) -> Iterator[tuple[Node, Node]]:
    """Two nodes for the block, removed after it (namespaces and hosts file), however the block ends.

    Args:
        prefix: Namespace name prefix; default ``hlat<pid>`` (unique per process, so parallel sessions coexist:
            each pair is its own isolated link, so their equal addresses never meet).
    """
    prefix = prefix or f"hlat{os.getpid()}"
    workdir = Path(tempfile.mkdtemp(prefix="hlat-nodes-"))
    try:
        yield create(prefix, workdir)
    finally:
        remove(prefix)
        shutil.rmtree(workdir, ignore_errors=True)
