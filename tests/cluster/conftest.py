"""Fixtures of the cluster lane: two network-namespace nodes, and a real Slurm cluster on them.

These tests make namespaces and start daemons as root, so the main suite leaves them out: they are collected only
with ``HLAT_CLUSTER_LANE=1`` (``make test-cluster``) or when named on the command line.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import slurm
from tests.cluster.nodes import Node, unavailable
from tests.cluster.nodes import two_nodes as _two_nodes
from tests.cluster.slurm import Cluster
from tests.cluster.slurm import unavailable as slurm_unavailable

if os.environ.get("HLAT_CLUSTER_LANE") != "1":
    collect_ignore_glob = ["test_*.py"]


def _cannot_run(why: str) -> None:
    """Skip where the lane was not asked for; in the lane (``make test-cluster``, CI) a missing prerequisite fails:
    a lane that skips everything on a machine without Slurm would pass while testing nothing."""
    if os.environ.get("HLAT_CLUSTER_LANE") == "1":
        pytest.fail(f"the cluster lane cannot run here: {why}")
    pytest.skip(why)


@pytest.fixture
def two_nodes() -> Iterator[tuple[Node, Node]]:
    """Two nodes ``n1`` (10.231.7.1) and ``n2`` (10.231.7.2) without Slurm, removed after the test.

    Skips where namespaces cannot be made (not root, tools missing).
    """
    why = unavailable()
    if why:
        _cannot_run(why)
    with _two_nodes() as nodes:
        yield nodes


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A two-node Slurm cluster with accounting (:mod:`tests.cluster.slurm`) for the session, torn down after it.

    One-node tests submit ``--nodes=1`` to it. Skips where it cannot run (not root, packages missing).
    """
    why = unavailable() or slurm_unavailable()
    if why:
        _cannot_run(why)
    d = Path(tempfile.mkdtemp(prefix="hlat-slurm-"))
    t0 = time.monotonic()
    try:
        cluster = slurm.up(d)
    except BaseException:
        slurm.down(d)
        raise
    print(f"\nslurm cluster up in {time.monotonic() - t0:.1f} s")
    try:
        yield cluster
    finally:
        t0 = time.monotonic()
        slurm.down(d)
        print(f"\nslurm cluster down in {time.monotonic() - t0:.1f} s")
