"""Verifying a checkpoint's sha256s once per job, not once per rank.

Every rank asks which checkpoint it resumes from before anything is built, and the answer must be the same on all of
them. Each one hashing every file would read the whole checkpoint once per rank: about 1.9 TB per rank at 70B (weights
and optimizer state), 256 nodes x 32 ranks over the same shared file system. Instead rank k hashes every n-th file
from the k-th (sizes are checked everywhere, cheaply) and the ranks pool what they found over a gloo group, so each
byte is read once per job and every rank reaches the same verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from hlat.checkpoint.manifest import problems


@dataclass(frozen=True)
class Checks:
    """How this process verifies a checkpoint: alone (the default), or its share of the files with the job's ranks.

    Every rank of the job must verify the same checkpoints in the same order (they do: the directory is shared and
    listed the same way everywhere), since each verdict is one collective.
    """

    rank: int = 0
    world: int = 1
    pool: Callable[[list[str]], list[str]] | None = None
    """Gathers every rank's problems into one list (None: alone)."""

    def problems(self, path: Path) -> list[str]:
        """What is wrong with the checkpoint at ``path``, sha256s included, as every rank found it together."""
        found = problems(path, checksums=True, part=(self.rank, self.world))
        return found if self.pool is None else self.pool(found)

    def together(self) -> None:
        """Wait here until every rank has come (alone: return at once).

        Rank 0 renames a save into place after the others have written their files: a rank that lists the
        checkpoints after this sees the same directories as rank 0.
        """
        if self.pool is not None:
            self.pool([])


ALONE = Checks()
"""This process alone hashes every file (a single-process command, or a default)."""


def shared_checks() -> Checks:
    """Checks shared by the job's ranks when torch.distributed is up with more than one rank, else alone.

    A collective: every rank calls it (it makes a gloo group, for host objects whatever the device backend).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ALONE
    group = dist.new_group(backend="gloo")
    world = dist.get_world_size()

    def pool(found: list[str]) -> list[str]:
        everyone: list[list[str] | None] = [None] * world
        dist.all_gather_object(everyone, found, group=group)
        return list(dict.fromkeys(p for part in everyone for p in part or []))  # sizes: found by every rank

    return Checks(dist.get_rank(), world, pool)
