"""The graph ledger, its fingerprints, the schedule's expected compiles and the divergence guard, in one process.

The real thing (torch-xla's counters and dump file, two XLA:CPU ranks, a rank that alone compiles) is the NxD lane's
(``tests/neuron/test_graph_guard.py``); here the parts that are plain Python: what is recorded when, what counts as
the same graph, which steps the schedule says compile, and what the guard concludes from the board.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hlat.backends.graphs import FETCH, FORWARD_BACKWARD, OPTIMIZER, SETUP, GraphLedger, HloTail
from hlat.config.compose import compose_run_config
from hlat.health.graph_guard import (
    DIVERGENCE_FILE,
    LEDGER_DIR,
    GraphDivergenceError,
    GraphGuard,
    find_divergence,
    refuse_restart,
)
from hlat.health.heartbeat import FileBoard, Heartbeat
from hlat.plan.graph_schedule import (
    coverage_gaps,
    expected_compiles,
    fetch_lengths,
    optimizer_patterns,
    saturation_step,
)
from hlat.plan.hlo import canonical, fingerprint, parse_dump


class Counters:
    """torch-xla's compile counters as the ledger reads them: bumped by the test where a "graph" compiles."""

    def __init__(self) -> None:
        self.count, self.seconds = 0, 0.0

    def compile(self, n: int = 1, seconds: float = 2.0) -> None:
        self.count, self.seconds = self.count + n, self.seconds + seconds

    def __call__(self) -> tuple[int, float]:
        return self.count, self.seconds


def test_the_ledger_records_the_phases_that_compiled_at_their_step_and_position() -> None:
    """Phases without a compile leave no event but count in the position; what compiles between phases is "other",
    at the position of the next phase, so every rank running the same code numbers phases alike."""
    c = Counters()
    ledger = GraphLedger(c, wall=lambda: 0.0)
    heard = []
    ledger.listener = heard.append
    with ledger.phase(SETUP):
        c.compile(2, 1.5)
    ledger.at_step(1)
    for micro in range(2):
        with ledger.phase(FORWARD_BACKWARD, micro=micro):
            c.compile()
    c.compile()  # e.g. a hook's .item() between phases
    with ledger.phase(OPTIMIZER):
        pass
    ledger.at_step(2)
    with ledger.phase(FORWARD_BACKWARD, micro=0):
        pass
    with ledger.phase(FETCH):
        c.compile(1, 0.25)
    got = [(e.step, e.seq, e.phase, e.micro, e.new_graphs, e.compile_s) for e in ledger.drain()]
    assert got == [
        (0, 0, SETUP, None, 2, 1.5),
        (1, 0, FORWARD_BACKWARD, 0, 1, 2.0),
        (1, 1, FORWARD_BACKWARD, 1, 1, 2.0),
        (1, 2, "other", None, 1, 2.0),
        (2, 1, FETCH, None, 1, 0.25),
    ]
    assert len(heard) == 5 and ledger.total == 6 and ledger.drain() == []
    assert ledger.position == (2, 2)


HLO = """HloModule IrToHlo.{m}, entry_computation_layout={{(f32[4]{{0}})->(f32[4]{{0}})}}

%AddComputation.{a} (x.{x}: f32[], y.{y}: f32[]) -> f32[] {{
  %x.{x} = f32[] parameter(0)
  %y.{y} = f32[] parameter(1)
  ROOT %add.{r} = f32[] add(f32[] %x.{x}, f32[] %y.{y}){meta}
}}

ENTRY %IrToHlo.{m} (p0.1: f32[4]) -> (f32[4]) {{
  %p0.1 = f32[4]{{0}} parameter(0)
  %constant.{k} = f32[] constant({c})
  ROOT %tuple.9 = (f32[4]{{0}}) tuple(f32[4]{{0}} %p0.1)
}}
"""


def dumped(hlo: str, graph_hash: str = "ab12") -> str:
    """One graph as torch-xla's ``XLA_SAVE_TENSORS_FMT=hlo`` writes it."""
    head = "[ScheduleSyncTensorsGraph]\nTensorsGraphInfo:\n  step (/x/loop.py:90)\n\nRoot Hashes: (ff)\n\n"
    return f"{head}## BEGIN_GRAPH\n{hlo}\n\nGraph Hash: {graph_hash}\n\n## END_GRAPH\n\n"


def test_fingerprints_ignore_numbering_and_metadata_and_see_a_constant() -> None:
    """The builder's counters and XLA_HLO_DEBUG's metadata differ between processes; a baked-in 0 or 1 does not."""
    one = HLO.format(m=29, a=15, x=16, y=17, r=18, k=4, c="1", meta="")
    renumbered = HLO.format(
        m=1389, a=43, x=44, y=45, r=46, k=7, c="1", meta=', metadata={op_type="aten__add" source_file="a.py"}'
    )
    other_constant = HLO.format(m=29, a=15, x=16, y=17, r=18, k=4, c="0", meta="")
    assert fingerprint(one) == fingerprint(renumbered)
    assert fingerprint(one) != fingerprint(other_constant)
    assert "metadata" not in canonical(renumbered) and "IrToHlo.1389" not in canonical(renumbered)


def test_parse_dump_reads_complete_graphs_and_leaves_one_being_written(tmp_path: Path) -> None:
    """A graph whose ``## END_GRAPH`` is not written yet waits for the next read (:class:`HloTail` resumes there)."""
    first, second = (HLO.format(m=1, a=2, x=3, y=4, r=5, k=6, c=c, meta="") for c in ("1", "2"))
    text = dumped(first, "aa") + dumped(second, "bb")
    cut = text.index("Graph Hash: bb")
    graphs, _ = parse_dump(text[:cut])
    assert [g.raw_hash for g in graphs] == ["aa"] and graphs[0].frames == ("step (/x/loop.py:90)",)
    path = tmp_path / "rank0.hlo.0"
    path.write_text(text[:cut])
    tail = HloTail(path)
    assert tail.read() == ((fingerprint(first),), ("aa",))
    path.write_text(text)
    assert tail.read() == ((fingerprint(second),), ("bb",))
    assert tail.read() == ((), ())


def cfg(*overrides: str):
    return compose_run_config(["train.log_every=5", "train.checkpoint_every=0", *overrides])


def test_the_schedule_predicts_fetch_lengths_checkpoint_flushes_and_the_optimizers_special_scalars() -> None:
    """Fetch lengths from the log and checkpoint grids; AdamW's bias correction rounding to 1 in float32 (beta2 0.01:
    step 4, measured on XLA:CPU in the NxD lane); a learning rate that reaches exactly 0."""
    run = cfg("train.steps=20", "train.checkpoint_every=7", "optimizer.beta2=0.01", "optimizer.warmup_steps=2")
    assert fetch_lengths(run) == [(5, 5), (7, 2), (10, 3), (14, 4), (15, 1), (20, 5)]
    got = [(e.step, e.phase) for e in expected_compiles(run)]
    assert got == [(4, "optimizer"), (5, "fetch"), (7, "checkpoint"), (7, "fetch"), (10, "fetch"), (14, "fetch"),
                   (15, "fetch")]  # fmt: skip
    assert saturation_step(0.01) == 4 and saturation_step(0.95) == 325 and saturation_step(0.99) == 1656
    zero = cfg("train.steps=20", "optimizer.min_lr=0", "optimizer.decay_steps=10", "optimizer.warmup_steps=2")
    optimizer = [e for e in expected_compiles(zero) if e.phase == "optimizer"]
    assert [e.step for e in optimizer] == [13] and "learning rate is exactly 0" in optimizer[0].why
    restart = [(e.step, e.phase) for e in expected_compiles(run, start=10)]  # a restart warms up again
    assert restart == [(14, "checkpoint"), (14, "fetch"), (15, "fetch"), (20, "fetch")]


def test_equal_scalars_share_one_graph_input() -> None:
    """beta2 0.99: at step 1 sqrt(1 - beta2) is 1 - beta1 (0.1) in float32, which torch-xla passes as one input
    (measured by ``hlat graphs plan --verify optimizer.beta2=0.95,0.99``: their step-1 optimizer graphs differ)."""
    p99, p95 = (optimizer_patterns(cfg("train.steps=40", f"optimizer.beta2={b}"), range(1, 3)) for b in (0.99, 0.95))
    assert p99[0][4] == 1 and p99[1][4] == 0  # step 1: the bias correction equals FIXED[0] (1 - beta1); step 2 not
    assert not p95[:, 4].any()


def test_coverage_gaps_name_what_a_short_compile_run_misses() -> None:
    """A 10-step ahead-of-time compile of a 600-step run: the bias correction of step 325 and a last interval of 3."""
    run = cfg("train.steps=603")
    short = cfg("train.steps=10", "optimizer.warmup_steps=9")  # hlat compile --steps 10 (a warmup that fits)
    gaps = coverage_gaps(run, short)
    assert len(gaps) == 2, gaps
    assert gaps[0].startswith("the fetch of 3 steps' metrics (first at step 603)")
    assert gaps[1].startswith("step 325's optimizer graph") and "sqrt(1-beta2^t) is 0 or 1 in float32" in gaps[1]
    assert coverage_gaps(short, short) == []


def snap(cls: str, pos: tuple[int, int], *events: tuple[int, int, str, int]) -> dict:
    return {"cls": cls, "pos": list(pos), "ev": [[*e, ""] for e in events], "full": False}


@pytest.mark.parametrize(
    ("snaps", "message"),
    [
        pytest.param(
            {0: snap("a", (5, 0)), 1: snap("a", (5, 1), (4, 2, "optimizer", 1))},
            "graph divergence: rank 1, step 4 (phase optimizer) compiled 1 new graph; ranks 0 did not",
            id="one-rank-alone",
        ),
        pytest.param(
            {0: snap("a", (9, 0), (5, 3, "fetch", 1)), 1: snap("a", (9, 0), (5, 3, "fetch", 1))},
            None,
            id="every-rank-compiled",
        ),
        pytest.param(
            {0: snap("a", (4, 2)), 1: snap("a", (5, 1), (4, 2, "optimizer", 1))},
            None,
            id="not-passed-yet",  # rank 0 is still in that phase: it may compile it too
        ),
        pytest.param(
            {0: snap("a", (9, 0)), 1: snap("b", (9, 0), (5, 1, "forward_backward", 2))},
            None,
            id="other-classes",  # pipeline stages warm up differently
        ),
        pytest.param(
            {r: snap("a", (9, 0), *([(6, 2, "optimizer", 1)] if r in (2, 3) else [])) for r in range(8)},
            "graph divergence: ranks 2,3, step 6 (phase optimizer) compiled 1 new graph; ranks 0,1,4-7 did not",
            id="two-of-eight",
        ),
    ],
)
def test_find_divergence(snaps: dict, message: str | None) -> None:
    found = find_divergence(snaps)
    assert (found.message() if found else None) == message


def test_the_guard_names_the_rank_flags_the_board_and_a_restart_refuses(tmp_path: Path) -> None:
    """Two ranks on one file board: rank 1 compiles at step 4 alone, rank 0 passed it; rank 0's check finds it,
    records it, raises the board's flag (which rank 1's check reads), and a restart of the job then refuses."""
    board = FileBoard(tmp_path / "heartbeat", world_size=2)
    guards = []
    for rank in range(2):
        c = Counters()
        ledger = GraphLedger(c)
        guard = GraphGuard("stop", ledger, Heartbeat(rank, board), tmp_path, exit_fn=pytest.fail)
        with ledger.phase(SETUP):
            c.compile(3)
        for step in range(1, 6):
            ledger.at_step(step)
            with ledger.phase(FORWARD_BACKWARD, micro=0):
                pass
            with ledger.phase(OPTIMIZER):
                if rank == 1 and step == 4:
                    c.compile()
            guard.stepped(step)
        ledger.at_step(6)
        board.publish(guard.heartbeat.beat())
        guards.append(guard)
    assert guards[0].cls == guards[1].cls != ""
    message = guards[0].check()
    assert message == "graph divergence: rank 1, step 4 (phase optimizer) compiled 1 new graph; ranks 0 did not"
    assert guards[1].check() == message and guards[1].stopped == message  # from the flag
    record = json.loads((tmp_path / LEDGER_DIR / DIVERGENCE_FILE).read_text())
    assert record["message"] == message and record["compiled"] == [1] and record["others"] == [0]
    with pytest.raises(GraphDivergenceError, match=r"rank 1, step 4 .* restarting would compile the same graphs"):
        refuse_restart(tmp_path, attempt=1)
    refuse_restart(tmp_path, attempt=0)  # a new launch starts over
    assert not (tmp_path / LEDGER_DIR / DIVERGENCE_FILE).exists()
