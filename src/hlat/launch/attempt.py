"""Which attempt of the job this is: one number that every rank on every node agrees on (:func:`current`).

Torch elastic counts a restart only on the agent whose worker failed, so ranks agree on the number through the store
the agent keeps for the whole job (:func:`handshake`); without that store, the only agent's count is the job's.
docs/fault-recovery.md says why. Imports nothing of hlat.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import uuid
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "hlat/restart"
POLL_S = 0.05
"""How often rank 0 reads the other ranks' hellos while it waits for them (seconds)."""
DEFAULT_TIMEOUT_S = 900.0
"""How long the handshake waits for every rank when the caller gives no time-out (``health.collective_timeout_s``'s
default)."""

_agreed: tuple[tuple[int, str | None, str | None], int] | None = None
"""((pid, run id, agent's restart count), attempt) of the last agreement."""


class AttemptError(RuntimeError):
    """The ranks of a restarted job could not agree on the attempt in time (a rank never started)."""


def current(store: Any | None = None, timeout_s: float | None = None) -> int:
    """This job's attempt: 0 for its first start, n after its n-th restart; the same number on every rank.

    The first call agrees on it with the other ranks (every rank calls it first thing in ``hlat.train.run.main``; the
    process group's set-up and the resume decision then read the same number back).

    Args:
        store: The job's shared store; None connects to torch elastic's (``MASTER_ADDR``/``MASTER_PORT``).
        timeout_s: How long to wait for the other ranks (default :data:`DEFAULT_TIMEOUT_S`).

    Raises:
        AttemptError: A rank did not take part within ``timeout_s``.
    """
    global _agreed
    env = os.environ
    key = (os.getpid(), env.get("TORCHELASTIC_RUN_ID"), env.get("TORCHELASTIC_RESTART_COUNT"))
    if _agreed is None or _agreed[0] != key:  # once per process and job (tests change the environment in place)
        if shared():
            number, how = _agree(store, DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s), "agreed by all ranks"
        else:  # one agent (or no store that outlives an attempt): its own count is the job's
            number, how = int(env.get("TORCHELASTIC_RESTART_COUNT", "0")), "counted by its only agent"
        _agreed = (key, number)
        if number:
            log.warning("restart %d of this job (%s): resuming from the newest valid checkpoint", number, how)
    return _agreed[1]


def forget() -> None:
    """Forget the agreed attempt (tests, and a process that starts a new job in place)."""
    global _agreed
    _agreed = None


def shared() -> bool:
    """Whether this worker shares torch elastic's store with more ranks (and so must agree on the attempt)."""
    env = os.environ
    return (
        "TORCHELASTIC_RUN_ID" in env
        and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and int(env.get("WORLD_SIZE", "1")) > 1
        and "MASTER_ADDR" in env
    )


def _agree(store: Any | None, timeout_s: float) -> int:
    env = os.environ
    if store is None:
        import torch.distributed as dist

        store = dist.TCPStore(
            env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
    return handshake(store, int(env["RANK"]), int(env["WORLD_SIZE"]), timeout_s)


def handshake(store: Any, rank: int, world_size: int, timeout_s: float, nonce: str | None = None) -> int:
    """Agree on the attempt through ``store``; returns it.

    Rank 0 takes the next number (``store.add``) and answers every hello with it; every other rank says hello under a
    nonce of its own, waits for the welcome addressed to that nonce, and confirms under the new number. A hello left
    by an earlier attempt is answered too, but nobody waits for that answer: rank 0 reads on until every rank of this
    attempt confirmed (torch elastic stops every worker of an attempt before the next one starts).

    Args:
        store: A ``torch.distributed.Store`` every rank of the job reaches (it may hold earlier attempts' keys).
        rank: This process's global rank.
        world_size: The job's number of ranks.
        timeout_s: How long to wait for the other ranks.
        nonce: This process's identity in the handshake (default: a random one; tests pass their own).

    Raises:
        AttemptError: Some rank did not take part within ``timeout_s``.
    """
    if rank == 0:
        return _lead(store, world_size, timeout_s)
    return _follow(store, rank, nonce or uuid.uuid4().hex, timeout_s)


def _lead(store: Any, world_size: int, timeout_s: float) -> int:
    attempt = store.add(f"{PREFIX}/count", 1) - 1
    deadline = time.monotonic() + timeout_s
    welcomed: dict[int, bytes] = {}
    pending = set(range(1, world_size))
    while True:
        for r in sorted(pending):
            if store.check([f"{PREFIX}/ready/{attempt}/{r}"]):
                pending.discard(r)
                continue
            hello = store.get(f"{PREFIX}/hello/{r}") if store.check([f"{PREFIX}/hello/{r}"]) else None
            if hello is not None and welcomed.get(r) != hello:
                store.set(f"{PREFIX}/welcome/{r}/{hello.decode()}", str(attempt))
                welcomed[r] = hello
        if not pending:
            return attempt
        if time.monotonic() > deadline:
            raise AttemptError(
                f"rank(s) {sorted(pending)} did not join attempt {attempt} of this job within {timeout_s:.0f} s "
                "(health.collective_timeout_s); a node's trainer did not start. The agents restart the job if "
                "restarts are left"
            )
        time.sleep(POLL_S)


def _follow(store: Any, rank: int, nonce: str, timeout_s: float) -> int:
    store.set(f"{PREFIX}/hello/{rank}", nonce)
    key = f"{PREFIX}/welcome/{rank}/{nonce}"
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # torch raises DistStoreError (a RuntimeError) on a time-out
        raise AttemptError(
            f"rank {rank} was not welcomed by rank 0 within {timeout_s:.0f} s (health.collective_timeout_s): rank 0's "
            f"trainer did not start or died ({e})"
        ) from e
    attempt = int(store.get(key))
    store.set(f"{PREFIX}/ready/{attempt}/{rank}", nonce)
    return attempt
