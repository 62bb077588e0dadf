"""Heartbeat overhead: what the hang watchdog's heartbeat costs the training thread per step, and its thread per beat.

    python bench/heartbeat_overhead.py                  # 200k marks, 2000 beats per board, a read of 8192 ranks
    python bench/heartbeat_overhead.py --ranks 1024

The training thread only records (``hlat.health.heartbeat``): ``PhaseMarks.phase`` (one per forward, backward,
optimizer, logging and checkpoint phase: ``2 x grad_accum + 3`` a step) and the watchdog's loop hook (one a step).
Both are timed here against what they wrap (the null timer's ``phase``; a watchdog hook without a heartbeat was not
kept, so the hook is timed whole). The heartbeat thread publishes one beat per period (one second up to 1000 ranks):
JSON plus a ``TCPStore.set`` to a store served by another process on loopback (torch elastic's is in the agent), or
a file written and renamed. A firing watchdog reads every rank's beat once: ``--ranks`` beats from the store.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hlat.config import HealthConfig
from hlat.health.heartbeat import FileBoard, Heartbeat, PhaseMarks, StoreBoard
from hlat.health.watchdog import HangWatchdog
from hlat.state import NULL_TIMER


def per_call(fn, n: int) -> float:
    """Microseconds per call of ``fn`` over ``n`` calls (best of 3 rounds)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


class State:
    """The loop's state, as far as the watchdog's hook reads it."""

    step = 0


def training_thread(n: int, tmp: Path) -> dict[str, float]:
    """Microseconds per phase entered (bare null timer and with marks) and per watchdog hook."""
    hb = Heartbeat(0)
    marks = PhaseMarks(NULL_TIMER, hb)

    def bare() -> None:
        with NULL_TIMER.phase("forward"):
            pass

    def marked() -> None:
        with marks.phase("forward"):
            pass

    cfg = HealthConfig(watchdog_first_step_s=3600, watchdog_floor_s=3600)
    wd = HangWatchdog(cfg, tmp / "hang", 0, last_step=1 << 40, heartbeat=hb)
    state = State()

    def hook() -> None:
        state.step += 1
        wd(state)

    return {"null phase": per_call(bare, n), "marked phase": per_call(marked, n), "hook": per_call(hook, n)}


def store_server() -> tuple[subprocess.Popen, int]:
    """A TCPStore server in another process on loopback (as torch elastic's agent hosts it); its port."""
    code = "import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)"
    code += "; print(s.port, flush=True); time.sleep(3600)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def beats(n: int, ranks: int, tmp: Path) -> dict[str, float]:
    """Microseconds per published beat (store, file) and milliseconds to read ``ranks`` beats from the store."""
    import torch.distributed as dist

    proc, port = store_server()
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        store = StoreBoard(client, ranks)
        hb = Heartbeat(0, store)
        out = {"store publish": per_call(hb.publish, n)}
        client.check([store.key(0)])  # a round trip: every set before it has been served
        sample = hb.beat()
        for r in range(ranks):  # every rank's beat, for the read
            client.set(store.key(r), dataclasses.replace(sample, rank=r).to_json())
        t0 = time.perf_counter()
        read = store.read()
        out["store read all (ms)"] = (time.perf_counter() - t0) * 1e3
        assert sum(b is not None for b in read.values()) == ranks
        out["file publish"] = per_call(Heartbeat(0, FileBoard(tmp / "beats", ranks)).publish, n)
        out["beat bytes"] = len(sample.to_json())
    finally:
        proc.kill()
        proc.wait()
    return out


def main() -> None:
    """Run the measurements and print the report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--marks", type=int, default=200_000)
    ap.add_argument("--beats", type=int, default=2000)
    ap.add_argument("--ranks", type=int, default=8192)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = training_thread(args.marks, Path(tmp))
        b = beats(args.beats, args.ranks, Path(tmp))
    mark = t["marked phase"] - t["null phase"]
    where = (
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}"
    )
    print(f"`python bench/heartbeat_overhead.py` on {where}\n")
    print("| what | cost |\n|---|---:|")
    print(f"| a phase entered, null timer (no heartbeat) | {t['null phase']:.2f} µs |")
    print(f"| a phase entered, marked on the heartbeat | {t['marked phase']:.2f} µs (+{mark:.2f} µs) |")
    print(f"| the watchdog's loop hook (with the heartbeat's step) | {t['hook']:.2f} µs |")
    for accum in (1, 8):
        per_step = (2 * accum + 3) * mark + t["hook"]
        print(f"| training thread per step, grad_accum={accum} ({2 * accum + 3} phases + hook) | {per_step:.1f} µs |")
    print(f"| one beat published to a TCPStore on loopback (heartbeat thread) | {b['store publish']:.1f} µs |")
    print(f"| one beat published as a file (heartbeat thread) | {b['file publish']:.1f} µs |")
    print(f"| one beat's size | {b['beat bytes']:.0f} bytes |")
    read = b["store read all (ms)"]
    print(f"| reading {args.ranks} beats from the store (once, when a watchdog fires) | {read:.1f} ms |")


if __name__ == "__main__":
    main()
