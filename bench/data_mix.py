"""A data mixture of 1,000 sources against the one-source loader on the same documents: start-up, tokens/s, state.

The documents are the builtin corpus's (no download), 10 to a source, 1,000 sources written as JSONL files, the same
documents concatenated into one file for the one-source loader (``data.path``, the "before" row); weights are drawn
from Dirichlet(0.3) (seed 0) and listed in a ``data.mix_file``. Both loaders tokenize with the same sentencepiece
``.model`` (trained once on the builtin corpus, cached), pack ``train.seq_len=256`` windows into global batches of
``G=16`` sequences on one rank (``micro_batch_size=16``, ``data.worker=none``: the producer runs inline, so its busy
time is the wall time measured).

Each measurement runs in a fresh subprocess, the rows interleaved over ``--reps`` repetitions so that load drifts hit
every row alike; the table gives medians:

* start-up: ``compose_run_config`` with the overrides (``data.mix_file`` of 1,000 sources), ``build_loader`` (the
  sources opened, their content digests with an empty digest cache, the plan's token estimate) and the first batch.
* tokens/s: the producer's tokens per second over ``--batches`` global batches after ``--warmup`` (the mixture's
  per-slot, per-source packers fill up in its first batches: each of 16 x 1,000 slot-source pairs reads whole
  documents the first time it is needed; that regime is the "first batches" column).
* state: the bytes of ``torch.save(loader.state_dict())`` of the one rank (all 16 slots) after the run, and the
  number of per-source series MLflow gets (``data.log_sources=32``: at most 32 sources plus ``other``).

Run from the repository root::

    python bench/data_mix.py             # ~6 min on 2 cores
    python bench/data_mix.py --quick     # smoke run (< 2 min): don't quote it
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOURCES, PER_SOURCE, VOCAB, SEQ_LEN, G = 1000, 10, 4096, 256, 16
TAG = "BENCH_RESULT "


def prepare(work: Path, cache: Path) -> dict[str, str]:
    """The sources, the concatenated file, the mix file and the tokenizer (once per work directory)."""
    import numpy as np

    from hlat.config import DataConfig
    from hlat.data import load_or_train_tokenizer
    from hlat.data.builtin import collect_documents

    docs = collect_documents()
    tok = load_or_train_tokenizer(DataConfig(cache_dir=str(cache)), docs, VOCAB, cache)
    weights = np.random.default_rng(0).dirichlet(np.full(SOURCES, 0.3))
    (work / "sources").mkdir(parents=True, exist_ok=True)
    lines, mix = [], {}
    for m in range(SOURCES):
        texts = [docs[(m * PER_SOURCE + i) % len(docs)] for i in range(PER_SOURCE)]
        path = work / "sources" / f"s{m:04d}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        lines += texts
        mix[f"s{m:04d}"] = {"path": str(path), "weight": float(weights[m])}
    (work / "all.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    (work / "mix.yaml").write_text(json.dumps(mix))  # JSON is YAML
    return {"tokenizer": str(tok.path), "one": str(work / "all.jsonl"), "mix": str(work / "mix.yaml")}


def child(kind: str, files: dict[str, str], cache: str, warmup: int, batches: int) -> dict:
    """One measurement in this (fresh) process: start-up, early and steady tokens/s, state size."""
    import shutil

    import torch

    from hlat.config.compose import compose_run_config
    from hlat.data import build_loader

    shutil.rmtree(Path(cache) / "digests", ignore_errors=True)  # cold digests
    data = [f"data.mix_file={files['mix']}"] if kind == "mix" else [f"data.path={files['one']}"]
    t0 = time.perf_counter()
    cfg = compose_run_config([
        *data, f"data.tokenizer={files['tokenizer']}", f"data.cache_dir={cache}", "data.worker=none",
        f"model.vocab_size={VOCAB}", f"train.seq_len={SEQ_LEN}", f"train.global_batch_size={G}",
        f"train.micro_batch_size={G}", "train.steps=2000",
    ])  # fmt: skip
    t1 = time.perf_counter()
    t = cfg.train
    loader = build_loader(cfg.data, vocab_size=VOCAB, seq_len=t.seq_len, micro_batch_size=G, seed=t.seed,
                          global_batch_size=G, steps=t.steps)  # fmt: skip
    t2 = time.perf_counter()
    next(loader)
    t3 = time.perf_counter()
    early = min(250, warmup)
    for _ in range(early - 1):
        next(loader)
    t4 = time.perf_counter()
    for _ in range(warmup - early):
        next(loader)
    t5 = time.perf_counter()
    for _ in range(batches):
        next(loader)
    t6 = time.perf_counter()
    buf = io.BytesIO()
    torch.save(loader.state_dict(), buf)
    series = None
    if kind == "mix":
        tensors, make = loader.interval(torch.device("cpu"))
        keys = set(loader.stats()) | set(make({k: v.reshape(-1).tolist() for k, v in tensors.items()}))
        hidden = set(loader.run_info()["series_only"].get("metrics", []))
        series = max(
            len({k for k in keys - hidden if k.startswith("data/mix/") and k.endswith(f"/{f}")})
            for f in ("tokens", "share", "epochs")
        )
    tokens = G * SEQ_LEN
    return {
        "compose_s": t1 - t0,
        "build_s": t2 - t1,
        "first_batch_s": t3 - t2,
        "startup_s": t3 - t0,
        "early_tps": early * tokens / (t4 - t2),
        "steady_tps": batches * tokens / (t6 - t5),
        "state_bytes": len(buf.getvalue()),
        "mlflow_series": series,
    }


def main() -> None:
    """Prepare the data once, run every measurement in a fresh subprocess, print the report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1500, help="global batches before the steady measurement")
    p.add_argument("--batches", type=int, default=1000, help="global batches measured after the warm-up")
    p.add_argument("--quick", action="store_true", help="1 repetition, 300 + 200 batches: a smoke run")
    p.add_argument("--work", default=None, help="where the sources go (default: a temporary directory)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, spec = a.child
        s = json.loads(spec)
        print(TAG + json.dumps(child(kind, s["files"], s["cache"], s["warmup"], s["batches"])))
        return
    if a.quick:
        a.reps, a.warmup, a.batches = 1, 300, 200
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.work or tmp)
        cache = work / "cache"
        started = time.time()
        files = prepare(work, cache)
        results: dict[str, list[dict]] = {"one": [], "mix": []}
        for _ in range(a.reps):
            for kind in ("one", "mix"):
                spec = json.dumps({"files": files, "cache": str(cache), "warmup": a.warmup, "batches": a.batches})
                out = subprocess.run([sys.executable, __file__, "--child", kind, spec], capture_output=True,
                                     text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
                results[kind].append(json.loads(out.stdout.split(TAG)[-1]))
        report(results, a, time.time() - started)


def report(results: dict[str, list[dict]], a: argparse.Namespace, wall: float) -> None:
    """The markdown table of the medians, and the ratio."""

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in results[kind])

    print(f"`python bench/data_mix.py{' --quick' if a.quick else ''}`: {a.reps} x (one, mix), warm-up {a.warmup} + "
          f"{a.batches} batches of {G} x {SEQ_LEN} tokens; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, load average at the end {os.getloadavg()[0]:.1f}; wall {wall:.0f} s\n")  # fmt: skip
    print(
        "| loader | start-up s (compose + build + first batch) | tokens/s, first batches | tokens/s, steady | state "
        "bytes (16 slots) | MLflow per-source series |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for kind, name in (("one", "data.path (one file, before)"), ("mix", f"data.mix of {SOURCES} sources (after)")):
        parts = "+".join(f"{med(kind, k):.2f}" for k in ("compose_s", "build_s", "first_batch_s"))
        series = "-" if kind == "one" else f"{med(kind, 'mlflow_series'):.0f}"
        print(f"| {name} | {med(kind, 'startup_s'):.1f} ({parts}) | {med(kind, 'early_tps'):,.0f} | "
              f"{med(kind, 'steady_tps'):,.0f} | {med(kind, 'state_bytes'):,.0f} | {series} |")  # fmt: skip
    ratio = med("mix", "steady_tps") / med("one", "steady_tps")
    early = med("mix", "early_tps") / med("one", "early_tps")
    print(f"\nmix / one tokens/s: steady **{ratio:.2f}x**, first batches {early:.2f}x")


if __name__ == "__main__":
    main()
