"""Which attempt of the job this is: one number that every rank on every node agrees on.

Torch elastic restarts a job's workers in two ways. The agent whose worker failed counts a retry
(``TORCHELASTIC_RESTART_COUNT``, its ``max_restarts - remaining_restarts``); every other agent restarts its workers
because the rendezvous membership changed, which torch does not count. So after one node's worker dies, that node's
new workers see count 1 and the other nodes' see count 0. hlat used to key each attempt's store prefix, its resume
decision and its logs with that count: rank 0 waited under ``attempt_0``, rank 1 under ``attempt_1``, and the job
hung until its allocation was cancelled (issue 23; single-host jobs never saw it, having one agent).

The workers of one job share the agent's ``TCPStore`` (``TORCHELASTIC_USE_AGENT_STORE``), which outlives every
attempt. In it they agree on a number by a handshake that cannot be fooled by what earlier attempts left behind:

- rank 0 takes the next number (``store.add``): the attempt;
- every other rank announces a nonce of its own (``hello/<rank>``), and waits for the welcome addressed to that
  nonce (``welcome/<rank>/<nonce>``), which holds the number;
- rank 0 welcomes each nonce it reads and waits until every rank confirmed under the new number
  (``ready/<attempt>/<rank>``).

An earlier attempt's hello may still be in the store when rank 0 reads it; it is welcomed too, but nobody waits for
that welcome, and rank 0 keeps reading until the live rank's own hello arrives and is confirmed. This relies on what
torch elastic guarantees: every worker of an attempt is stopped before the next attempt's workers start. A rank that
does not arrive in time fails the handshake with an error (the agents then restart the job), never a silent hang.

Without torch elastic's shared store (one process, or a torch that predates it), the agent's own count is the job's:
there is one agent, or the store does not outlive an attempt.
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
    """Agree on the attempt through ``store`` (see the module docstring); returns it.

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
