"""The heartbeat and the hang's verdict in one process: who is blamed, the report, the boards, a store that hangs.

The oracle of the verdict: the rank whose beat stopped (or, with every rank alive, the one behind) is named with its
host, pid and phase, and the rank that waits for it is not; the launcher's message repeats the newest verdict.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hlat.config import HealthConfig
from hlat.health.blame import BEHIND, SILENT, STOPPED, blame, last_verdict, stale_after, verdict
from hlat.health.heartbeat import STEP_END, Beat, FileBoard, Heartbeat, PhaseMarks, StoreBoard, beat_period
from hlat.health.watchdog import HANG_EXIT_CODE, HangWatchdog
from hlat.state import NULL_TIMER, StepTimer
from tests.timeouts import hang_guard

NOW = 10_000.0


def beat(rank: int, step: int = 6, phase: str = "backward", seq: int = 2, age: float = 0.5, **kw) -> Beat:
    """Rank ``rank``'s beat, ``age`` seconds before :data:`NOW`, on host ``node<rank>``."""
    known = dict(host=f"node{rank}", pid=100 + rank, local_rank=rank % 8, attempt=0, step=step, phase=phase, seq=seq)
    return Beat(rank=rank, **{**known, "phase_since": NOW - age - 1.0, "time": NOW - age, **kw})


# --- the verdict ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("beats", "me", "named", "words"),
    [
        pytest.param(
            {0: beat(0), 1: beat(1, step=5, phase=STEP_END, seq=0, age=40.0)},
            0,
            {1: STOPPED},
            [
                "rank 1 on node1 (pid 101) stopped: last heartbeat 40.0s ago, when it was after step 5",
                "rank 0 waits in step 7 (backward)",
            ],
            id="one-stopped",
        ),
        pytest.param(
            {0: beat(0, age=35.0), 1: beat(1), 2: beat(2, age=50.0, phase="optimizer"), 3: beat(3)},
            1,
            {0: STOPPED, 2: STOPPED},
            [
                "rank 0 on node0 (pid 100) stopped: last heartbeat 35.0s ago, when it was in step 7 (backward); "
                "rank 2 on node2 (pid 102) stopped: last heartbeat 50.0s ago, when it was in step 7 (optimizer)",
                "rank 1 waits in step 7 (backward)",
            ],
            id="two-stopped",
        ),
        pytest.param(
            {0: beat(0), 1: beat(1, age=3.0)},
            1,
            {},
            ["no rank stopped: every rank's heartbeat is fresh and at the same point (in step 7 (backward))"],
            id="none-stopped",
        ),
        pytest.param(
            {0: beat(0), 1: beat(1, phase=STEP_END, seq=0), 2: beat(2)},
            1,
            {1: BEHIND},
            [
                "rank 1 (this rank) on node1 (pid 101) is behind: after step 6 for 1.5s, while the others are in "
                "step 7 (backward)"
            ],
            id="self-behind",
        ),  # alive, but stuck before the collective the others wait in
        pytest.param({0: beat(0), 1: None}, 0, {1: SILENT}, ["rank 1 sent no heartbeat in this attempt"], id="silent"),
    ],
)
def test_the_verdict_names_the_ranks_that_stopped_not_the_ones_waiting(beats, me, named, words) -> None:
    suspects = blame(beats, NOW, stale_s=30.0)
    assert {s.rank: s.why for s in suspects} == named
    said = verdict(suspects, beats, me, NOW)
    for w in words:
        assert w in said, said
    for r in set(beats) - set(named):  # a rank that is not a suspect is never said to have stopped
        assert f"rank {r} on node{r} (pid {100 + r}) stopped" not in said and f"rank {r} sent no" not in said


def test_a_beat_is_stale_after_half_the_threshold_and_never_within_a_few_beats() -> None:
    assert stale_after(limit_s=600.0, every_s=1.0) == 300.0  # the stopped rank's beat is about limit_s old
    assert stale_after(limit_s=4.0, every_s=1.0) == 5.0  # a live rank may have missed a beat or two
    assert beat_period(64) == 1.0 and beat_period(8192) == pytest.approx(8.192)  # at most ~1000 beats/s in all


def test_an_unreadable_board_is_said_and_blames_nobody() -> None:
    said = verdict([], {0: beat(0)}, 0, NOW, unread="the store did not answer within 10s")
    assert said == (
        "the other ranks' heartbeats could not be read (the store did not answer within 10s); rank 0 is "
        "in step 7 (backward)"
    )


# --- the record -------------------------------------------------------------------------------------------------------


class Wall:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def test_the_record_follows_the_phases_the_timer_is_told() -> None:
    wall = Wall()
    hb = Heartbeat(3, wall=wall)
    hb.start(4)
    assert (hb.beat().step, hb.beat().phase, hb.beat().where()) == (4, "start", "starting at step 5")
    marks, timer = PhaseMarks(NULL_TIMER, hb), StepTimer()
    wall.now += 2
    with marks.phase("forward"):
        assert (hb.beat().phase, hb.beat().seq, hb.beat().phase_since) == ("forward", 1, NOW + 2)
    with PhaseMarks(timer, hb).phase("backward"):
        pass
    assert "backward" in timer.take() and not marks.enabled  # the wrapped timer still times (and is the one read)
    assert hb.beat().position == (4, 2) and hb.beat().where() == "in step 5 (backward)"
    hb.stepped(5)
    wall.now += 1
    b = hb.beat()
    assert (b.step, b.phase, b.seq, b.time, b.where()) == (5, STEP_END, 0, NOW + 3, "after step 5")
    assert (b.rank, b.host, b.pid) == (3, socket.gethostname(), os.getpid())
    assert Beat.from_json(b.to_json()) == b


def test_the_thread_publishes_beats_that_another_process_reads_and_other_attempts_are_ignored(tmp_path: Path) -> None:
    board = FileBoard(tmp_path / "heartbeat", world_size=3)
    FileBoard(tmp_path / "heartbeat", 3).publish(beat(1, attempt=0))
    FileBoard(tmp_path / "heartbeat", 3).publish(beat(2, attempt=1))  # left by the previous attempt
    hb = Heartbeat(0, board, attempt=0, every_s=0.01)
    hb.start(0)
    try:
        hb.stepped(2)
        deadline = time.monotonic() + hang_guard(60)
        while (board.read()[0] is None or board.read()[0].step != 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert board.read()[0] is not None and board.read()[0].step == 2  # published by the thread alone
    finally:
        hb.close()
    beats, unread = hb.read()
    assert unread is None and beats[1] == beat(1) and beats[2] is None and beats[0].step == 2
    assert not [p.name for p in (tmp_path / "heartbeat").iterdir() if p.name.endswith(".tmp")]  # replaced whole


def test_the_store_board_reads_every_rank_and_a_store_that_never_answers_does_not_hang_the_reader() -> None:
    """A store whose server process is stopped (SIGSTOP) never answers a get, whatever the client's time-out: the
    reader gives up after its own time-out and says why."""
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import time, torch.distributed as d; "
                "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
                f"print(s.port, flush=True); time.sleep({hang_guard(600)})"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        import torch.distributed as dist

        assert server.stdout is not None
        port = int(server.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=hang_guard(60)))
        board = StoreBoard(client, world_size=3, where=f"the store at 127.0.0.1:{port}")
        board.publish(beat(2))
        hb = Heartbeat(0, board, every_s=3600)
        hb.publish()
        assert board.read()[2] == beat(2) and board.read()[0] is not None and board.read()[1] is None
        os.kill(server.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        beats, unread = hb.read(timeout_s=0.5)
        assert time.monotonic() - t0 < hang_guard(30)
        assert unread == f"the store at 127.0.0.1:{port} did not answer within 0.5s" and list(beats) == [0]
        os.kill(server.pid, signal.SIGCONT)  # the stuck reader thread then returns
        deadline = time.monotonic() + hang_guard(60)
        while any(t.name == "hlat-heartbeat-read" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.kill()
        server.wait()


# --- the watchdog's report --------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Step:
    step: int


def test_the_watchdog_of_the_waiting_rank_names_the_stopped_one_and_the_launcher_repeats_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from hlat.train import entry

    wall, clock, exits = Wall(), Clock(), []
    board = FileBoard(tmp_path / "heartbeat", world_size=2)
    board.publish(beat(1, step=3, phase=STEP_END, seq=0, age=0.0))  # rank 1 beat once, then stopped
    hb = Heartbeat(0, board, wall=wall)
    cfg = HealthConfig(watchdog_first_step_s=60, watchdog_floor_s=20, watchdog_grace_s=0)
    wd = HangWatchdog(cfg, tmp_path / "hang", 0, last_step=100, heartbeat=hb, exit_fn=exits.append, clock=clock)
    wd(Step(3))  # the threads stay off: the fake clocks drive the watchdog
    clock.now += 61
    wall.now += 61
    with caplog.at_level(logging.ERROR, logger="hlat.health.watchdog"):
        assert wd.check() and exits == [HANG_EXIT_CODE]
    (message,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hang: ")]
    assert message.startswith(
        "hang: rank 1 on node1 (pid 101) stopped: last heartbeat 61.0s ago, when it was after step 3; "
        f"rank 0 waits after step 3. Seen by rank 0 on {socket.gethostname()}: step 4 has run "
        "61.0s, more than the watchdog's 60.0s"
    )
    assert f"What every rank was doing: {tmp_path / 'hang' / 'report.txt'}; this rank's stacks: " in message
    report = (tmp_path / "hang" / "report.txt").read_text()
    rows = {line.split()[0]: line.split() for line in report.splitlines() if line[:1].isdigit()}
    assert rows["1"][1:3] == ["node1", "101"] and rows["1"][-1] == "stopped"
    assert rows["0"][1:3] == [socket.gethostname(), str(os.getpid())] and rows["0"][-1] != "stopped"
    (record,) = [json.loads(line) for line in (tmp_path / "hang" / "report.jsonl").read_text().splitlines()]
    assert record["suspects"] == [{"rank": 1, "why": "stopped"}] and record["rank"] == 0 and record["step"] == 4
    assert (tmp_path / "hang" / "rank0.txt").exists() and not (tmp_path / "hang" / "rank1.txt").exists()
    # restarts exhausted: python train.py's message names the stopped rank, not the one that reported it
    assert entry._exit_text(HANG_EXIT_CODE, tmp_path) == (
        f"exit code 75 (a hang: {record['verdict']}; the watchdog's report and stack dumps are in {tmp_path / 'hang'})"
    )
    assert last_verdict(tmp_path / "nowhere") is None


def test_a_report_cut_short_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    (tmp_path / "report.jsonl").write_text(json.dumps({"verdict": "rank 3 stopped"}) + '\n{"verdict": "rank 4 st')
    assert last_verdict(tmp_path) == "rank 3 stopped"


def test_under_a_short_threshold_the_report_waits_until_a_stopped_rank_s_beat_is_stale(tmp_path: Path) -> None:
    """Real clocks and threads: rank 1 beat once when the step began and never again. The watchdog fires after 0.3 s,
    before that beat is older than the staleness bound (5 beats of 0.1 s): it waits until it is, then names rank 1."""
    board = FileBoard(tmp_path / "heartbeat", world_size=2)
    board.publish(Heartbeat(1).beat())
    fired, codes = threading.Event(), []
    cfg = HealthConfig(watchdog_first_step_s=0.3, watchdog_grace_s=0)
    wd = HangWatchdog(
        cfg,
        tmp_path / "hang",
        0,
        last_step=10,
        heartbeat=Heartbeat(0, board, every_s=0.1),
        exit_fn=lambda c: (codes.append(c), fired.set()),
    ).start()
    try:
        assert fired.wait(hang_guard(120)), "the watchdog thread never fired"
    finally:
        wd.close()
    (record,) = [json.loads(line) for line in (tmp_path / "hang" / "report.jsonl").read_text().splitlines()]
    assert record["suspects"] == [{"rank": 1, "why": "stopped"}] and codes == [HANG_EXIT_CODE]
