"""Graph ledger overhead: what recording which phase compiled costs a neuron step, measured on XLA:CPU (NxD lane env).

    .venv-neuron/bin/python bench/graph_ledger_overhead.py              # 2 x 2 runs of 40 steps, micro model
    .venv-neuron/bin/python bench/graph_ledger_overhead.py --steps 80 --rounds 3

Two measurements, side by side in one invocation:

1. per call: ``GraphLedger.phase`` around nothing, with the real ``torch_xla.debug.metrics`` counters the neuron
   backend reads (``neuron_graphs.compile_counters``), against a bare ``contextlib.nullcontext``; and the trainer's
   ledger hook (``hlat.health.graph_watch.GraphWatch``) per step, with nothing to write;
2. end to end: ``python train.py cluster=xla_cpu`` on the NxD lane's micro model, with the ledger (as shipped) and
   without it (``GraphLedger.phase`` replaced by a null context in that process only: the bench's switch, not a
   config key), interleaved; per run the median ``perf/step_time_s`` of the steady steps and the run's final
   ``xla/graphs_compiled`` and ``xla/device_to_host_transfers`` (which must be equal with and without).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MICRO = [
    "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
    "model.vocab_size=512", "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=2",
    "optimizer.warmup_steps=1", "health=off", "train.checkpoint_every=0", "tracker.flush_every_s=0",
]  # fmt: skip
OFF = (
    "import contextlib, runpy, sys; import hlat.backends.graphs as g; "
    "g.GraphLedger.phase = lambda self, name, micro=None: contextlib.nullcontext(); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def per_call(fn, n: int) -> float:
    """Microseconds per call of ``fn`` over ``n`` calls (best of 3 rounds)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def micro(n: int) -> dict[str, float]:
    """Microseconds per ledger phase (and bare), and per ledger hook call."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla.debug.metrics as met

    from hlat.backends.neuron_graphs import neuron_ledger
    from hlat.config.compose import compose_run_config
    from hlat.health.graph_watch import GraphWatch

    ledger = neuron_ledger(met, None, 0)

    def phase() -> None:
        with ledger.phase("optimizer"):
            pass

    def bare() -> None:
        with contextlib.nullcontext():
            pass

    with tempfile.TemporaryDirectory() as tmp:
        watch = GraphWatch(compose_run_config(["train.steps=1000000"]), ledger, 1, Path(tmp), lambda rows: None)
        watch.start(0)

        class State:
            step = 1

        hook = per_call(lambda: watch(State), n // 10)
    return {"phase": per_call(phase, n), "bare": per_call(bare, n), "hook": hook}


def run(tmp: Path, name: str, steps: int, ledger: bool) -> dict[str, float]:
    """One ``python train.py`` run; its steady step time and final graph counters (from its Parquet series)."""
    from hlat.track.series import read_series, to_points

    args = [str(ROOT / "train.py"), *MICRO, "cluster=xla_cpu", f"train.steps={steps}", "train.log_every=5",
            f"data.cache_dir={tmp / 'cache'}", f"tracker.uri=sqlite:///{tmp / 'mlflow.db'}", f"tracker.run_name={name}",
            f"hydra.run.dir={tmp / name}"]  # fmt: skip
    cmd = [sys.executable, *args] if ledger else [sys.executable, "-c", OFF, *args]
    r = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, check=False)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    table = read_series(tmp / name / "checkpoints" / "series")
    step_s = to_points(table, "perf/step_time_s")[1].tolist()
    return {
        "step_s": statistics.median(step_s[2:]),
        "graphs": to_points(table, "xla/graphs_compiled")[1].tolist()[-1],
        "d2h": to_points(table, "xla/device_to_host_transfers")[1].tolist()[-1],
    }


def main() -> None:
    """Measure both and print the markdown report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--calls", type=int, default=200_000)
    args = p.parse_args()
    started = time.time()
    m = micro(args.calls)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for i in range(args.rounds):
            for ledger in (True, False) if i % 2 == 0 else (False, True):
                rows.append((ledger, run(tmp, f"r{i}-{'on' if ledger else 'off'}", args.steps, ledger)))
    load = os.getloadavg()
    print(f"# graph ledger overhead ({time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, load {load[0]:.1f}, "
          f"{time.time() - started:.0f} s)\n")  # fmt: skip
    print(
        f"per call: ledger phase {m['phase']:.2f} us (bare context {m['bare']:.2f} us), ledger hook {m['hook']:.2f} us"
    )
    phases = 2 + 2 + 1  # per step of the micro model: 2 micro-batches, the optimizer, the fetch (every 5th), "other"
    print(f"per step: ~{phases * m['phase'] + m['hook']:.1f} us of ledger work\n")
    print("| ledger | median steady step (s) | xla/graphs_compiled | xla/device_to_host_transfers |")
    print("|---|---:|---:|---:|")
    for ledger, r in rows:
        print(f"| {'on' if ledger else 'off'} | {r['step_s']:.4f} | {r['graphs']:.0f} | {r['d2h']:.0f} |")
    on = [r["step_s"] for ledger, r in rows if ledger]
    off = [r["step_s"] for ledger, r in rows if not ledger]
    print(f"\nmedian on/off: {statistics.median(on) / statistics.median(off):.3f}; off runs spread "
          f"{min(off):.4f}-{max(off):.4f} s")  # fmt: skip


if __name__ == "__main__":
    main()
