"""The graph ledger and the divergence guard on two real XLA:CPU ranks (the real NxD 0.17, ``python train.py``).

XLA:CPU processes do not communicate (an all-reduce returns the local value), which is enough here: each rank traces
and compiles its own graphs exactly as on trn1, and the guard compares them over torch elastic's store. On trn1 the
rank that compiles alone would leave the others waiting in a collective; here they run on, so the guard is what
stops them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from hlat.health.graph_guard import GRAPH_DIVERGENCE_EXIT_CODE, read_ledger
from tests.neuron.lane import MICRO, ROOT
from tests.timeouts import hang_guard

TWO_RANKS = ("cluster=xla_cpu", "cluster.nproc_per_node=2", "health.graph_guard=stop", "tracker=console")
"""Two ranks of data parallelism (global batch 4 = 2 ranks x micro-batch 2: no accumulation); the lane's ``health=off``
with the guard on (its default)."""


def run(tmp: Path, cache: Path, *overrides: str) -> tuple[int, str]:
    """``python train.py`` on two XLA:CPU ranks; its exit code and output.

    Every rank writes the same xser checkpoint files here (the ranks do not know each other's data-parallel rank
    through XLA:CPU), so the runs save no checkpoint a rank could trip over (``train.checkpoint_dir`` per rank is
    not a thing): the final save is the last thing they do, after what these tests look at.
    """
    args = [sys.executable, str(ROOT / "train.py"), *MICRO, *TWO_RANKS, f"data.cache_dir={cache}"]
    args += [f"hydra.run.dir={tmp}", *overrides]
    r = subprocess.run(args, cwd=tmp.parent, capture_output=True, text=True, timeout=hang_guard(900), env=os.environ)
    return r.returncode, r.stdout + r.stderr


def test_one_rank_compiling_alone_stops_the_job_naming_rank_step_and_phase(tmp_path: Path, cache: Path) -> None:
    """``fault=graph_divergence``: at step 4 rank 1 alone traces an extra op into its update. The job must stop at
    the next step's boundary on both ranks (every beat of step 4 is on the board then: no step 6), exit 76 with the
    guard's line, keep both ranks' ledgers (rank 1's with the step-4 optimizer compile, rank 0's without), and not
    restart although ``cluster.max_restarts=1``.

    Catches: a guard that compares nothing (exit 0), ranks stopping at different steps (one blocks in the stop hook's
    all-reduce and the job ends in a gloo error, exit 1: what the first version did), a restart loop, a ledger that
    misattributes the phase or the step.
    """
    code, out = run(
        tmp_path / "run", cache, "train.steps=8", "train.log_every=1", "fault=graph_divergence", "fault.graph_at=4",
        "cluster.max_restarts=1",
    )  # fmt: skip
    assert code == GRAPH_DIVERGENCE_EXIT_CODE, out[-5000:]
    line = "graph divergence: rank 1, step 4 (phase optimizer) compiled 1 new graph; ranks 0 did not"
    assert f"hlat: {line}" in out, out[-5000:]
    assert not re.search(r"^step 6: train/loss", out, re.M), "a rank trained on past the divergence"
    assert "restart 1 of this job" not in out, out[-5000:]
    ledgers = {r: read_ledger(tmp_path / "run" / "graphs" / f"rank{r}.jsonl") for r in (0, 1)}
    late = {r: [(e.step, e.phase, e.new_graphs) for e in ev if e.step > 2] for r, ev in ledgers.items()}
    assert late == {0: [], 1: [(4, "optimizer", 1)]}, late
    assert [e.phase for e in ledgers[0] if e.step <= 1] == [e.phase for e in ledgers[1] if e.step <= 1]


def test_late_compiles_on_every_rank_are_expected_and_the_job_finishes(tmp_path: Path, cache: Path) -> None:
    """20 steps whose schedule makes every rank compile after the warm-up: the first fetch (step 5), a checkpoint off
    the log grid (flushes of 2 and 3 steps at 7 and 10, 4 at 14, 1 at 15), AdamW's bias correction rounding to 1 at
    step 8 (beta2 0.1) and the learning rate reaching exactly 0 at step 13 (min_lr 0, 10 decay steps). Both ranks
    compile the same late graphs, so the job ends with exit 0 and rank 0 logs each as expected by the schedule.

    Catches: a guard that stops on compiles every rank makes, a schedule analysis that misses one of these (an
    "unexpected" line), special-scalar rules that differ from torch-xla's (the step-8 and step-13 optimizer graphs),
    a ledger that does not reach the Parquet series (``graphs/*``) or that counts other compiles than torch-xla's.
    """
    code, out = run(
        tmp_path / "run", cache, "train.steps=20", "train.log_every=5", "train.checkpoint_every=7",
        "optimizer.warmup_steps=2", "optimizer.beta2=0.1", "optimizer.min_lr=0", "optimizer.decay_steps=10",
    )  # fmt: skip
    assert code == 0, out[-5000:]
    assert "unexpected" not in out and "graph divergence" not in out, out[-5000:]
    planned = re.findall(r"graph ledger: step (\d+) \(phase (\w+)\) compiled \d+ new graph.*: expected \(planned", out)
    late = {(int(s), p) for s, p in planned}
    assert {(5, "fetch"), (7, "fetch"), (8, "optimizer"), (10, "fetch"), (13, "optimizer")} <= late, out[-5000:]
    ledgers = [read_ledger(tmp_path / "run" / "graphs" / f"rank{r}.jsonl") for r in (0, 1)]
    compiled = [[(e.step, e.seq, e.phase, e.new_graphs) for e in ledger if e.step > 2] for ledger in ledgers]
    assert compiled[0] == compiled[1] and len(compiled[0]) >= 5, compiled
    # Rank 0's ledger also goes to the run's Parquet series, beside the interval's xla/* counters.
    from hlat.track.series import read_series, to_points

    table = read_series(tmp_path / "run" / "checkpoints" / "series")
    steps, new = (a.tolist() for a in to_points(table, "graphs/new"))
    assert {5, 8, 13} <= set(steps) and sum(new) == sum(e.new_graphs for e in ledgers[0]), (steps, new)
    assert to_points(table, "xla/graphs_compiled")[0].tolist() == [5, 7, 10, 14, 15, 20]  # each fetch's last row
