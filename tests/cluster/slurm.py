"""A real Slurm cluster with accounting on the two namespace nodes of :mod:`tests.cluster.nodes`.

``n1`` runs mariadbd (127.0.0.1 of its own namespace), slurmdbd, slurmctld and a slurmd; ``n2`` runs the other
slurmd. munged runs on the host with its socket in the cluster's ``munge/``, bind-mounted on ``/run/munge`` inside
the nodes (Unix sockets cross network namespaces). Every node gets the cluster's ``etc/`` bind-mounted on
``/etc/slurm``, so plain ``sbatch``, ``sacct`` and ``scontrol`` work inside a node with no ``SLURM_CONF``, even from
an empty environment. Proctrack is ``linuxproc`` and the task plugin ``none``: no cgroups.

From the shell (``tests/cluster/slurm_up.sh`` / ``slurm_down.sh``)::

    python -m tests.cluster.slurm up DIR     # installs the packages if missing, starts everything, waits for idle
    python -m tests.cluster.slurm down DIR   # kills every process of the cluster, removes namespaces and DIR
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.cluster.nodes import Node, create, remove

PACKAGES = ("slurm-wlm", "munge", "slurmdbd", "mariadb-server")
BINARIES = ("slurmctld", "slurmd", "slurmdbd", "sbatch", "sacct", "munged", "mariadbd", "mariadb-install-db")
PREFIX = "hlatslurm"
"""Namespace prefix of the cluster's nodes (one cluster per machine at a time)."""


def ensure_installed(timeout_s: float = 900) -> None:
    """``apt-get install`` the Slurm, munge and MariaDB packages unless all their programs are there (quick then)."""
    if all(shutil.which(b) or Path("/usr/sbin", b).exists() for b in BINARIES):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], check=True, env=env, timeout=timeout_s)


def unavailable() -> str | None:
    """Why a cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "a Slurm cluster on network namespaces needs root"
    missing = [b for b in BINARIES if not (shutil.which(b) or Path("/usr/sbin", b).exists())]
    return f"missing programs {missing} (apt-get install {' '.join(PACKAGES)})" if missing else None


def slurm_conf(d: Path, nodes: tuple[Node, Node], cpus: int) -> str:
    """slurm.conf of a two-node cluster ``hlat`` with accounting through slurmdbd on the first node."""
    n1 = nodes[0]
    lines = [
        "ClusterName=hlat",
        f"SlurmctldHost={n1.name}({n1.addr})",
        "SlurmUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # A requeued job waits cred_expire seconds before it may start again (120 by default); still far longer
        # than a step's launch on these nodes takes.
        "AuthInfo=cred_expire=10",
        f"StateSaveLocation={d}/state",
        f"SlurmdSpoolDir={d}/spool/%n",
        f"SlurmctldPidFile={d}/run/slurmctld.pid",
        f"SlurmdPidFile={d}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/log/slurmctld.log",
        f"SlurmdLogFile={d}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/slurmdbd",
        f"AccountingStorageHost={n1.name}",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "ReturnToService=2",
        "KillWait=10",
        "MinJobAge=600",
        "SlurmdTimeout=60",
        "InactiveLimit=0",
        "PrologFlags=NoHold",
        *(f"NodeName={n.name} NodeAddr={n.addr} CPUs={cpus} RealMemory=4000 State=UNKNOWN" for n in nodes),
        f"PartitionName=main Nodes={','.join(n.name for n in nodes)} Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def slurmdbd_conf(d: Path) -> str:
    """slurmdbd.conf: slurmdbd on 127.0.0.1 of the first node, MariaDB there too."""
    return (
        "AuthType=auth/munge\nDbdHost=localhost\nDbdAddr=127.0.0.1\n"
        f"SlurmUser=root\nPidFile={d}/run/slurmdbd.pid\nLogFile={d}/log/slurmdbd.log\n"
        "StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\nStoragePort=3306\nStorageUser=root\n"
        "StorageLoc=slurm_acct_db\n"
    )


@dataclass
class Cluster:
    """A running cluster: its directory (configs, state, logs, pids) and its two nodes."""

    dir: Path
    nodes: tuple[Node, Node]

    def run(self, argv: list[str], *, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command (``sbatch``, ``sacct``, ...) on the first node."""
        return self.nodes[0].run(argv, timeout=timeout, check=check)

    def log(self, name: str) -> str:
        """A daemon's log (``slurmctld``, ``slurmd-n2``, ``slurmdbd``, ``mariadb``), '' when absent."""
        path = self.dir / "log" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _daemon(d: Path, node: Node | None, name: str, argv: list[str]) -> int:
    """Start a foreground daemon on ``node`` (the host with None), its output in ``log/<name>.out``; returns pid."""
    out = open(d / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the daemon keeps it
    kw = {"stdin": subprocess.DEVNULL, "stdout": out, "stderr": subprocess.STDOUT, "start_new_session": True}
    p = node.popen(argv, **kw) if node is not None else subprocess.Popen(argv, **kw)
    out.close()
    pids = json.loads((d / "pids.json").read_text()) if (d / "pids.json").exists() else {}
    pids[name] = p.pid
    (d / "pids.json").write_text(json.dumps(pids))
    return p.pid


def _wait(what: str, probe, timeout_s: float, d: Path) -> None:
    """Poll ``probe()`` until true, else raise naming ``what`` with the tail of the logs."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if probe():
            return
        time.sleep(0.5)
    tails = {p.name: p.read_text(errors="replace")[-1500:] for p in sorted((d / "log").glob("*"))}
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s; logs: {json.dumps(tails, indent=1)}")


def _ok(node: Node, argv: list[str]) -> bool:
    try:
        return node.run(argv, timeout=20, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _start_db(d: Path, n1: Node) -> None:
    """Initialise and start MariaDB on 127.0.0.1:3306 of the first node (no grant tables: any user is root)."""
    subprocess.run(
        [
            "mariadb-install-db",
            "--no-defaults",
            f"--datadir={d}/db",
            "--user=root",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    _daemon(
        d,
        n1,
        "mariadb",
        [
            "mariadbd",
            "--no-defaults",
            f"--datadir={d}/db",
            f"--socket={d}/run/mysql.sock",
            "--user=root",
            "--bind-address=127.0.0.1",
            "--port=3306",
            "--skip-grant-tables",
            f"--pid-file={d}/run/mariadb.pid",
            "--innodb-buffer-pool-size=64M",
            "--innodb-lock-wait-timeout=900",
            f"--log-error={d}/log/mariadb.log",
        ],
    )
    _wait(
        "mariadb",
        lambda: _ok(n1, ["mariadb-admin", "--no-defaults", "-h", "127.0.0.1", "-P", "3306", "-u", "root", "ping"]),
        60,
        d,
    )


def up(d: Path, cpus: int | None = None) -> Cluster:
    """Start a two-node cluster in the empty directory ``d``; waits until both nodes are idle and sacct answers.

    Args:
        d: The cluster's directory (made if missing).
        cpus: CPUs per node (default: this machine's).
    """
    ensure_installed()
    for sub in ("etc", "state", "spool/n1", "spool/n2", "run", "log", "munge", "db"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    d.chmod(0o755)
    Path("/run/munge").mkdir(exist_ok=True)  # the mount point of the cluster's munge directory inside the nodes
    nodes = create(PREFIX, d)
    etc = str(d / "etc")
    binds = {etc: "/etc/slurm", str(d / "munge"): "/run/munge"}
    nodes = tuple(Node(n.name, n.ns, n.addr, n.hosts, binds) for n in nodes)
    (d / "etc" / "slurm.conf").write_text(slurm_conf(d, nodes, cpus or os.cpu_count() or 1))
    (d / "etc" / "slurmdbd.conf").write_text(slurmdbd_conf(d))
    (d / "etc" / "slurmdbd.conf").chmod(0o600)
    (d / "etc" / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
    shutil.chown(d / "munge", "munge", "munge")
    _daemon(
        d,
        None,
        "munged",
        [
            "runuser",
            "-u",
            "munge",
            "--",
            "/usr/sbin/munged",
            "--foreground",
            f"--socket={d}/munge/munge.socket.2",
            f"--pid-file={d}/munge/munged.pid",
            f"--log-file={d}/munge/munged.log",
            f"--seed-file={d}/munge/seed",
        ],
    )
    _wait("munged", lambda: (d / "munge" / "munge.socket.2").exists(), 30, d)
    n1 = nodes[0]
    _start_db(d, n1)
    _daemon(d, n1, "slurmdbd", ["slurmdbd", "-D"])
    _wait("slurmdbd", lambda: _ok(n1, ["sacctmgr", "-n", "show", "cluster"]), 60, d)
    _ok(n1, ["sacctmgr", "-i", "add", "cluster", "hlat"])
    _daemon(d, n1, "slurmctld", ["slurmctld", "-D", "-i"])
    _wait("slurmctld", lambda: _ok(n1, ["scontrol", "ping"]), 60, d)
    for n in nodes:
        _daemon(d, n, f"slurmd-{n.name}", ["slurmd", "-D", "-N", n.name])
    idle = lambda: n1.run(["sinfo", "-h", "-N", "-o", "%T"], timeout=20, check=False).stdout.split()  # noqa: E731
    _wait("both slurmd idle", lambda: idle() == ["idle", "idle"], 90, d)
    _wait("sacct", lambda: _ok(n1, ["sacct", "-n", "-X"]), 30, d)
    return Cluster(d, nodes)


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if Path(f"/proc/{p}").exists() and "State:\tZ" not in _status(p)]


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""


def down(d: Path, *, keep_dir: bool = False) -> None:
    """Stop everything the cluster in ``d`` started: daemons, every process in its namespaces, the namespaces, ``d``."""
    ns_pids = []
    for i in (1, 2):
        out = subprocess.run(["ip", "netns", "pids", f"{PREFIX}{i}"], capture_output=True, text=True, timeout=30)
        ns_pids += [int(p) for p in out.stdout.split()]
    daemons = list(json.loads((d / "pids.json").read_text()).values()) if (d / "pids.json").exists() else []
    pids = sorted(set(ns_pids + daemons) - {os.getpid()})
    _kill(pids, signal.SIGTERM)
    end = time.monotonic() + 15
    while _alive(pids) and time.monotonic() < end:
        time.sleep(0.2)
    _kill(_alive(pids), signal.SIGKILL)
    remove(PREFIX)
    if not keep_dir:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("up", "down"):
        sys.exit("usage: python -m tests.cluster.slurm up|down DIR")
    t0 = time.monotonic()
    if sys.argv[1] == "up":
        up(Path(sys.argv[2]).resolve())
    else:
        down(Path(sys.argv[2]).resolve())
    print(f"slurm {sys.argv[1]}: {time.monotonic() - t0:.1f} s")
