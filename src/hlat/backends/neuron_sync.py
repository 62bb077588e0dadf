"""Waiting for every rank where torch-xla's own rendezvous does not: NxD's CPU mode and several XLA:CPU processes.

torch-xla's CPU processes do not communicate, so ``xm.rendezvous`` returns at once there: rank 0's NxD
``CheckpointIOState.begin`` (re)created a checkpoint's directories after another rank had written its files into them
(pipeline stage 1's part of a mid-run checkpoint was lost, found by the PP resume test; with two XLA:CPU ranks the
final save failed with "Parent directory ... does not exist", found by the graph guard's tests). A gloo barrier stands
in for it while NxD saves or loads; on the device nothing changes. Imports nothing of torch_xla: the backend hands it
``torch_xla.core.xla_model``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist


class HostBarrier:
    """Every rank's wait at NxD's rendezvous points: a gloo group of its own where torch-xla's does not wait."""

    def __init__(self, xm: Any, needed: bool) -> None:
        """``needed``: NxD's CPU mode, or more than one process on torch-xla's CPU device (build it on every rank)."""
        self.xm = xm
        self.group = dist.new_group(backend="gloo") if needed and dist.get_world_size() > 1 else None

    def wait(self, tag: str) -> None:
        """Wait for every rank: ``xm.rendezvous`` on the device, the gloo barrier where that does not wait."""
        if self.group is not None:
            dist.barrier(group=self.group)
        else:
            self.xm.rendezvous(tag)

    @contextlib.contextmanager
    def standing_in(self) -> Iterator[None]:
        """NxD's own ``xm.rendezvous`` calls wait for every rank inside (where the gloo group is needed)."""
        if self.group is None:
            yield
            return
        original, group = self.xm.rendezvous, self.group

        def barrier(tag: str, payload: bytes = b"", replicas: list[int] | None = None) -> list[bytes]:
            dist.barrier(group=group)
            return []

        self.xm.rendezvous = barrier
        try:
            yield
        finally:
            self.xm.rendezvous = original
