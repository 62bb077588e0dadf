"""The goodput ledger's arithmetic on a scripted clock: buckets, replayed work, gaps, ETTR, the job-dir record."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from hlat.checkpoint import job_dir
from hlat.track.goodput import LOST, Attempt, Ledger, summarize
from tests.timeouts import hang_guard


def run_attempt(
    previous: list[Attempt], start: float, resumed: int, steps: int, *, save_every: int = 0, died_at: int = 0
) -> Ledger:
    """An attempt on a scripted clock: start-up 10 s (load 2 s of it), then steps of 1 s (0.25 s of it data wait,
    one more second of blocking save at a checkpoint). ``died_at``: the last step it completed (0: ran to the end)."""
    now = start + 10.0
    ledger = Ledger.begin(previous, start, resumed, load_s=2.0, now=now)
    for step in range(resumed + 1, (died_at or steps) + 1):
        now += 1.0
        if save_every and step % save_every == 0:
            ledger.saving(step)
            ledger.note("save_s", 1.0)
            now += 1.0
        ledger.step_end(step, data_wait_s=0.25, now=now)
    return ledger


def assert_sums(attempts: list[Attempt]) -> None:
    """Every attempt's buckets + productive = its wall + the gap before it; the job's likewise, exactly."""
    rows, total = summarize(attempts)
    for row in rows:
        assert sum(row[k] for k in LOST) + row["productive_s"] == pytest.approx(row["wall_s"] + row["gap_s"])
    assert sum(total[k] for k in LOST) + total["productive_s"] == pytest.approx(total["wall_s"])


def test_one_attempt_splits_its_wall_time_into_the_buckets() -> None:
    ledger = run_attempt([], start=100.0, resumed=0, steps=8, save_every=4)
    ledger.charge("eval_s", now=ledger.attempt.end + 3.0)  # the wait for the evaluations at the end
    a = ledger.attempt
    assert (a.startup_s, a.load_s) == (8.0 + 0.75, 2.0)  # the first step is start-up (compile), less its data wait
    assert (a.save_s, a.eval_s, a.data_wait_s) == (2.0, 3.0, 8 * 0.25)
    assert a.steps_s == pytest.approx(7 * 0.75) and a.at_step == {4: pytest.approx(3 * 0.75), 8: pytest.approx(5.25)}
    _, total = summarize([a])
    assert total["wall_s"] == a.end - a.start == 10 + 8 + 2 + 3
    assert total["replayed_s"] == 0.0 and total["ettr"] == pytest.approx(5.25 / 23)
    assert_sums([a])


def test_a_killed_attempt_replays_its_steps_after_the_checkpoint_the_next_one_resumed_from() -> None:
    first = run_attempt([], start=0.0, resumed=0, steps=20, save_every=4, died_at=10)  # SIGKILLed after step 10
    dead = first.attempt
    second = run_attempt([dead], start=dead.end + 30.0, resumed=8, steps=20, save_every=4)
    rows, total = summarize(second.attempts())
    assert rows[0]["replayed_s"] == pytest.approx(2 * 0.75)  # steps 9 and 10, as its own record timed them
    assert rows[0]["replayed_s"] == pytest.approx(dead.steps_s - dead.at_step[8])
    assert rows[1]["gap_s"] == 30.0 and rows[1]["replayed_s"] == 0.0
    assert total["productive_s"] == pytest.approx(dead.at_step[8] + second.attempt.steps_s)
    assert second.attempt.attempt == 1
    assert_sums(second.attempts())


def test_an_attempt_that_never_reached_its_own_checkpoint_replays_all_its_steps() -> None:
    first = run_attempt([], start=0.0, resumed=0, steps=20, save_every=4, died_at=6)
    second = run_attempt([first.attempt], start=first.attempt.end + 5, resumed=4, steps=20, died_at=7)
    third = run_attempt(second.attempts(), start=second.attempt.end + 5, resumed=4, steps=20)
    rows, _ = summarize(third.attempts())
    assert rows[1]["replayed_s"] == pytest.approx(second.attempt.steps_s) and rows[1]["productive_s"] == 0.0
    assert rows[0]["replayed_s"] == pytest.approx(first.attempt.steps_s - first.attempt.at_step[4])
    assert_sums(third.attempts())


def test_a_rollback_counts_the_steps_since_the_checkpoint_as_replayed_each_time() -> None:
    ledger = run_attempt([], start=0.0, resumed=0, steps=20, save_every=4, died_at=6)
    kept = ledger.attempt.at_step[4]
    ledger.rewind(4, now=ledger.attempt.end)  # steps 5 and 6 are thrown away
    assert ledger.attempt.rolled_back_s == pytest.approx(ledger.attempt.steps_s - kept) == pytest.approx(1.5)
    now = ledger.attempt.end
    for step in (5, 6):
        now += 1.0
        ledger.step_end(step, 0.25, now=now)
    ledger.rewind(4, now=now)  # the same two steps again
    assert ledger.attempt.rolled_back_s == pytest.approx(3.0)
    _, total = summarize(ledger.attempts())
    assert total["replayed_s"] == pytest.approx(3.0) and total["productive_s"] == pytest.approx(kept)
    assert_sums(ledger.attempts())


def test_noted_time_beyond_the_interval_is_never_counted_twice() -> None:
    ledger = Ledger.begin([], 0.0, 0, load_s=0.0, now=1.0)
    ledger.note("save_s", 3.0)
    ledger.note("data_wait_s", 1.0)  # 4 s noted in a 2 s interval: another clock disagreed
    ledger.charge("steps_s", now=3.0)
    a = ledger.attempt
    assert (a.save_s, a.data_wait_s, a.steps_s) == (1.5, 0.5, 0.0)
    assert_sums([a])


def test_the_record_survives_the_job_dir_round_trip(tmp_path: Path) -> None:
    writes = []

    def write(a: Attempt) -> None:
        writes.append(a.last_step)
        job_dir.write_attempt(tmp_path, a.attempt, a.to_dict())

    ledger = Ledger.begin([], 0.0, 0, load_s=0.0, write=write, now=1.0)
    for step in (1, 2, 3, 4):
        if step == 4:
            ledger.saving(4)
        ledger.step_end(step, 0.0, now=1.0 + step)
    assert writes == [0, 4]  # at the start and at the checkpoint (the loop hook adds the log intervals)
    (tmp_path / "goodput" / "attempt_0007.json").write_text("{not json")  # a torn file is skipped, not fatal
    back = [Attempt.from_dict(r) for r in job_dir.read_attempts(tmp_path)]
    assert back == [ledger.attempt] and back[0].at_step == {4: 3.0}
    job_dir.clear_attempts(tmp_path)
    assert job_dir.read_attempts(tmp_path) == []


def test_metrics_and_table_show_the_job() -> None:
    first = run_attempt([], start=0.0, resumed=0, steps=8, save_every=4, died_at=6)
    second = run_attempt([first.attempt], start=first.attempt.end + 4.0, resumed=4, steps=8)
    m = second.metrics()
    assert m["goodput/gap_s"] == 4.0 and m["goodput/attempts"] == 2.0
    assert m["goodput/ettr"] == pytest.approx(m["goodput/productive_s"] / m["goodput/wall_s"])
    lines = second.table().splitlines()
    assert lines[0].startswith("| attempt | status | steps | wall | productive | startup |")
    assert lines[2].startswith("| 0 | died | 0-6 |") and lines[3].startswith("| 1 | running | 4-8 |")
    assert lines[-1].startswith("| job |  | 0-8 |")


def test_process_start_is_when_the_process_started_to_well_under_a_second() -> None:
    """psutil's create_time can be up to a second early (whole-second boot time): as much as a short gap."""
    code = "from hlat.track.goodput import process_start; print(repr(process_start()))"
    before = time.time()
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    started = float(child.stdout)
    assert before - 0.05 <= started <= before + hang_guard(60)  # the start, not some time during the import


def test_a_failed_write_is_logged_once_and_never_stops_training(caplog: pytest.LogCaptureFixture) -> None:
    def full_disk(a: Attempt) -> None:
        raise OSError(28, "No space left on device")

    ledger = Ledger.begin([], 0.0, 0, load_s=0.0, write=full_disk, now=1.0)
    for step in (1, 2, 3):
        ledger.step_end(step, 0.0, now=1.0 + step)
        ledger.flush()
    assert ledger.attempt.last_step == 3
    warnings = [r for r in caplog.records if "could not write the goodput ledger" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
