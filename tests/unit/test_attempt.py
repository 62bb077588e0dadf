"""The job-wide restart attempt (``hlat.launch.attempt``): every rank agrees on one number through a real
``TCPStore``, however earlier attempts died, and the per-agent ``TORCHELASTIC_RESTART_COUNT`` no longer decides it."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hlat.checkpoint import restart_resume
from hlat.launch import attempt
from hlat.launch.rendezvous import loopback_store
from tests.timeouts import hang_guard

WORLD = 3


def run_attempt(
    store: dist.Store, world: int, ranks: list[int], timeout_s: float | None = None, lead_s: float = 0.0
) -> dict[int, int | str]:
    """Run the handshake of ``ranks`` concurrently: rank -> number, or the error's text.

    ``timeout_s`` is the handshake's own timeout: the subject where a test expects it to fire, else (None) a hang
    guard, ``hang_guard(60)``.

    Each rank starts after a small random delay, the non-zero ranks ``lead_s`` later still (rank 0 then reads what
    earlier attempts left in the store before the live ranks overwrite it).
    """
    out: dict[int, int | str] = {}
    timeout_s = hang_guard(60) if timeout_s is None else timeout_s

    def one(rank: int) -> None:
        time.sleep(random.uniform(0, 0.05) + (lead_s if rank else 0.0))
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        try:
            out[rank] = attempt.handshake(client, rank, world, timeout_s)
        except attempt.AttemptError as e:
            out[rank] = str(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    return out


def leave_debris(store: dist.Store, world: int, how: list[str]) -> None:
    """What an attempt whose workers died at various points left in the store (``how[rank]``).

    ``never``: the rank died before the handshake; ``hello``: a non-zero rank said hello and died; ``counted``: rank 0
    took a number and died; ``done``: the rank finished the handshake (with rank 0, when rank 0 also did).
    """
    number = None
    if how[0] in ("counted", "done"):
        number = store.add(f"{attempt.PREFIX}/count", 1) - 1
    for r in range(1, world):
        nonce = f"dead{random.getrandbits(32):x}"
        if how[r] in ("hello", "done"):
            store.set(f"{attempt.PREFIX}/hello/{r}", nonce)
        if how[r] == "done" and number is not None:
            store.set(f"{attempt.PREFIX}/welcome/{r}/{nonce}", str(number))
            store.set(f"{attempt.PREFIX}/ready/{number}/{r}", nonce)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.lists(st.sampled_from(["never", "hello", "counted", "done"]), min_size=WORLD, max_size=WORLD), max_size=4
    ),
    st.sampled_from([0.0, 0.3]),
)
def test_every_rank_agrees_whatever_earlier_attempts_left_behind(dead: list[list[str]], lead_s: float) -> None:
    store = loopback_store()
    seen = []
    for how in dead:
        leave_debris(store, WORLD, how)
    for _ in range(2):  # two live attempts in a row
        got = run_attempt(store, WORLD, list(range(WORLD)), lead_s=lead_s)  # a hang guard
        assert len(set(got.values())) == 1, got
        number = got[0]
        assert isinstance(number, int)
        assert all(number > s for s in seen), "an attempt's number is never reused"
        seen.append(number)


def test_the_first_attempt_is_zero_and_the_next_one() -> None:
    store = loopback_store()
    assert run_attempt(store, 2, [0, 1]) == {0: 0, 1: 0}
    assert run_attempt(store, 2, [0, 1]) == {0: 1, 1: 1}


def test_a_rank_that_never_comes_fails_the_handshake_instead_of_hanging() -> None:
    store = loopback_store()
    got = run_attempt(store, 3, [0, 1], timeout_s=2.0)
    assert "did not join attempt 0" in str(got[0]) and "2]" in str(got[0])  # rank 2 named (rank 1 too, if slow)
    lonely = run_attempt(store, 2, [1], timeout_s=1.0)
    assert "was not welcomed by rank 0" in str(lonely[1])


def test_per_agent_restart_counts_no_longer_split_the_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Node 1's agent counted a retry (1), node 0's restarted on the membership change and did not (0): the
    regression of issue 23. Both ranks must use one store prefix and both must resume."""
    store = loopback_store()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    run_attempt(store, 2, [0, 1])  # the first attempt of the job
    (tmp_path / "step_00000004").mkdir()
    (tmp_path / "step_00000004" / "manifest.json").write_text("{}")
    got: dict[int, tuple[int, str]] = {}

    def worker(rank: int) -> None:  # what each restarted worker computes, with its own agent's count
        attempt.forget()
        number = attempt.handshake(dist.TCPStore("127.0.0.1", store.port, is_master=False), rank, 2, 30.0)
        got[rank] = (number, "auto" if number > 0 else "never")

    threads = [threading.Thread(target=worker, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert got == {0: (1, "auto"), 1: (1, "auto")}

    attempt.forget()  # and through the functions the trainer calls, one process per rank emulated in turn
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    rank1 = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    follower = threading.Thread(target=attempt.handshake, args=(rank1, 1, 2, 30.0))
    follower.start()
    try:
        assert restart_resume("never", tmp_path) == "auto"  # rank 0 on the node that did not count a retry
    finally:
        follower.join(40)
        attempt.forget()


def test_without_a_shared_store_the_agents_count_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert attempt.current() == 2
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert attempt.current() == 0
