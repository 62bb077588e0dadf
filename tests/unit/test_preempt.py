"""hlat.launch.preempt and the agent's side of it: the signal flag, the stop hook and its rank agreement, the grace-path
save, the marker, the hand-over to submitit, and how hlat.launch.elastic turns torch elastic's SignalException into a
result."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.launcher.api import LaunchConfig

from hlat.launch import elastic, preempt
from hlat.launch.preempt import AbortedError, PreemptedError, SignalFlag, StopHook
from hlat.state import TrainState
from tests.unit.test_health_dist import join, run_two


@pytest.fixture
def flag():
    """A SignalFlag installed over sentinel handlers, restored (and the sentinels checked) afterwards."""
    sentinel = signal.getsignal(signal.SIGUSR1)
    f = SignalFlag()
    with f:
        yield f
    assert signal.getsignal(signal.SIGUSR1) == sentinel


def test_the_first_signal_is_recorded_and_repeats_are_the_same_request(flag: SignalFlag) -> None:
    os.kill(os.getpid(), signal.SIGUSR1)
    assert flag.signum == signal.SIGUSR1 and flag.received_at > 0
    first = flag.received_at
    os.kill(os.getpid(), signal.SIGTERM)  # a launcher forwarding what we already got: no effect, no exit
    os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C right after: the terminal and the agent both deliver it
    assert (flag.signum, flag.received_at) == (signal.SIGUSR1, first)


def test_a_second_ctrl_c_aborts_at_once(flag: SignalFlag) -> None:
    os.kill(os.getpid(), signal.SIGINT)
    assert flag.signum == signal.SIGINT
    flag.received_at -= preempt.REPEAT_S + 0.5  # the user pressed it again later
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler runs at the next bytecode boundary


def test_handlers_are_restored_after_training() -> None:
    calls = []
    previous = signal.signal(signal.SIGUSR2, lambda s, f: calls.append(s))
    try:
        with SignalFlag():
            os.kill(os.getpid(), signal.SIGUSR2)
        assert calls == []
        os.kill(os.getpid(), signal.SIGUSR2)
        assert calls == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_the_stop_hook_raises_at_the_step_boundary_but_lets_the_last_step_finish() -> None:
    f = SignalFlag()
    hook = StopHook(f, last_step=10, distributed=False)
    hook(TrainState(step=3))  # no signal: nothing happens
    f.signum, f.received_at = signal.SIGTERM, time.monotonic()
    with pytest.raises(PreemptedError) as e:
        hook(TrainState(step=4))
    assert (e.value.signum, e.value.step) == (signal.SIGTERM, 4)
    assert str(e.value) == "preempted by SIGTERM after step 4"
    hook(TrainState(step=10))  # the run is finishing anyway, with its final checkpoint


class FakeSaver:
    """The parts of hlat.checkpoint.Checkpointer that the grace path uses."""

    def __init__(self, every: int, last_step: int = 100) -> None:
        self.every, self.last_step, self.async_save = every, last_step, True
        self.last_save_s, self.last_saved = 0.1, None
        self.calls: list = []

    def wait(self) -> None:
        self.calls.append("wait")

    def save(self, state: TrainState) -> None:
        self.calls.append(("save", state.step, self.async_save))
        self.last_saved = Path(f"/ckpt/step_{state.step:08d}")


def test_the_grace_path_saves_the_step_in_flight_synchronously() -> None:
    saver = FakeSaver(every=50)
    stop = preempt.checkpoint_now(PreemptedError(signal.SIGTERM, 7, time.monotonic()), saver, TrainState(step=7), 20.0)
    assert saver.calls == ["wait", ("save", 7, False)]  # the save in flight first, then this step's, not async
    assert stop.checkpoint == "/ckpt/step_00000007" and 0 <= stop.elapsed_s < 5


def test_the_grace_path_only_waits_for_a_save_the_hook_started_at_this_step(caplog) -> None:
    saver = FakeSaver(every=5)
    late = PreemptedError(signal.SIGUSR1, 10, time.monotonic() - 30)  # the signal came 30 s ago
    preempt.checkpoint_now(late, saver, TrainState(step=10), 20.0)
    assert saver.calls == ["wait"]
    assert "may not fit in what is left of train.preempt_grace_s=20" in caplog.text
    preempt.report(late, 20.0)
    assert "more than train.preempt_grace_s=20: a launcher that gives 30 s" in caplog.text


def test_the_marker_round_trips(tmp_path: Path) -> None:
    stop = PreemptedError(signal.SIGINT, 12, 0.0, checkpoint="/c/step_00000012", elapsed_s=1.5)
    preempt.record(stop, tmp_path, None)
    got = preempt.read_marker(tmp_path)
    assert got is not None and got.to_dict() == stop.to_dict()
    assert json.loads((tmp_path / preempt.MARKER).read_text())["signal"] == "SIGINT"
    preempt.clear_marker(tmp_path)
    assert preempt.read_marker(tmp_path) is None


def test_hand_over_calls_submitits_requeue_handler_only() -> None:
    calls = []

    class SignalHandler:  # as submitit.core.job_environment.SignalHandler, which requeues the Slurm job
        def checkpoint_and_try_requeue(self, signum: int, frame: object) -> None:
            calls.append(signum)

    SignalHandler.__module__ = "submitit.core.job_environment"
    previous = signal.signal(signal.SIGUSR2, SignalHandler().checkpoint_and_try_requeue)
    try:
        preempt.hand_over(signal.SIGUSR2)
        assert calls == [signal.SIGUSR2]
        signal.signal(signal.SIGUSR2, lambda s, f: calls.append("other"))
        preempt.hand_over(signal.SIGUSR2)  # anything else is not called: hlat exits with its own code
        assert calls == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_the_launcher_grace_leaves_a_margin() -> None:
    assert preempt.launcher_grace_s(20.0) == 30 and preempt.launcher_grace_s(0.5) == 11


def test_the_agent_forwards_slurms_signals_and_waits_the_grace() -> None:
    assert elastic._stop_settings(LaunchConfig, 45) == {
        "signals_to_handle": preempt.AGENT_SIGNALS,
        "shutdown_timeout": 55,
    }
    old = type("OldLaunchConfig", (), {"__dataclass_fields__": {}})  # a torch without these fields
    assert elastic._stop_settings(old, 45) == {}


@pytest.mark.parametrize("marker", [True, False])
def test_a_signalled_agent_reports_preempted_or_interrupted(tmp_path: Path, marker: bool) -> None:
    stop = PreemptedError(signal.SIGTERM, 9, 0.0, checkpoint="c", elapsed_s=0.5)
    before = signal.getsignal(signal.SIGTERM)

    def agent(*args: object) -> dict:
        signal.signal(signal.SIGTERM, lambda s, f: None)  # torch elastic installs its own and leaves it
        if marker:
            preempt.record(stop, tmp_path, None)  # what rank 0 does once the checkpoint is complete
        raise SignalException("got SIGTERM", signal.SIGTERM)

    (tmp_path / preempt.MARKER).write_text("{}")  # a stale marker from an earlier stop is removed first
    with pytest.raises(PreemptedError if marker else AbortedError) as e:
        elastic._run_agent(agent, {}, tmp_path)
    assert e.value.signum == signal.SIGTERM
    if marker:
        assert e.value.to_dict() == stop.to_dict()
    assert signal.getsignal(signal.SIGTERM) == before


def _agree(rank: int, port: int) -> None:
    """Rank 1 alone gets a signal; both ranks must stop after the same step. Prints the per-step cost."""
    join(rank, port)
    f = SignalFlag()
    hook = StopHook(f, last_step=1000, distributed=True)
    t0 = time.perf_counter()
    for step in range(1, 201):
        hook(TrainState(step=step))
    per_step = (time.perf_counter() - t0) / 200
    if rank == 1:
        f.signum, f.received_at = signal.SIGUSR1, time.monotonic()
    try:
        hook(TrainState(step=201))
    except PreemptedError as e:
        assert (e.signum, e.step) == (signal.SIGUSR1, 201)
        hook.barrier()
        hook.close()
        print(f"rank {rank}: agreement all-reduce {per_step * 1e6:.0f} us per step")
        raise SystemExit(10 + rank) from None
    raise SystemExit(1)


@pytest.mark.slow
def test_ranks_agree_on_a_signal_that_reached_only_one() -> None:
    assert run_two(_agree) == [10, 11]


@pytest.mark.parametrize(
    ("error", "code", "says"),
    [
        (PreemptedError(signal.SIGTERM, 3, 0.0, "c/step_00000003", 0.4), 85, "hlat: preempted by SIGTERM after step 3"),
        (AbortedError(signal.SIGTERM), 143, "hlat: stopped by SIGTERM before a checkpoint of the step in flight"),
        (KeyboardInterrupt(), 130, "hlat: interrupted (Ctrl-C) before a checkpoint of the step in flight"),
    ],
)
def test_a_stopped_run_exits_with_its_documented_code_and_one_line(capsys, error, code: int, says: str) -> None:
    from hlat.train.entry import _stopped

    with pytest.raises(SystemExit) as e:
        _stopped(None, error)
    assert e.value.code == code
    assert capsys.readouterr().err.startswith(says)
