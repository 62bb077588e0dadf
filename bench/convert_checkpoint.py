"""``hlat convert`` and a neuron resharded resume of ~1.1B parameters with AdamW state: MB/s, CPU, peak memory.

    python bench/convert_checkpoint.py --dir /big/disk/convert-bench       # TinyLlama's shape, fp32 + AdamW: ~13 GB
    python bench/convert_checkpoint.py --dir /big/disk/x --code /tmp/before/src --code src   # two trees, interleaved
    python bench/convert_checkpoint.py --dir /tmp/x --dim 64 --layers 2 --ffn 128 --vocab 256 --heads 4 \
        --kv-heads 2 --disk-gb 0.01                                                                       # smoke

1. The disk's sequential write speed, measured again before each arm: ``--disk-gb`` written in 64 MiB blocks, then
   fsync, through the page cache and with ``O_DIRECT`` (other work on the machine moves it; each arm is compared
   with the faster of the two measures taken just before it).
2. A torch-backend source (DCP, fp32 weights and AdamW moments, manifest with sha256s) written by hlat's streaming
   DCP writer from tensors generated one at a time; its arms: ``--to hf``, ``--to torch``, ``--to neuron``. Then a
   neuron-backend source at TP 2 (xser), written by this tree's xser writer; its arms: ``--to torch`` (``n2t``) and
   a resharded resume at TP 1 (``reshard``: ``resharded_copy`` of rank 0, which holds everything). One source and one
   output are on the disk at a time.
3. Each arm runs in a fresh process per code tree (``--code``: the ``src`` directory it imports hlat from), which
   reports its peak RSS (``VmHWM``), its RSS before converting, the CPU seconds the conversion took (every thread;
   imports aside) and the seconds it spent verifying the source (sha256 of every file, names and shapes) and
   writing. MB/s are the output's bytes over the writing seconds; the CPU ceiling is what the writing's CPU seconds
   per GB would allow on two idle cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from hlat.checkpoint import portable, safetensors_io
from hlat.config import ModelConfig, OptimizerConfig, RunConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import dataclasses, json, resource, sys, time
from pathlib import Path
from hlat.eval import hf

def rss(key):  # VmRSS: now, VmHWM: the peak (ru_maxrss would carry the parent's peak over fork and exec)
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024

import safetensors.torch, sentencepiece  # noqa: E401  imports out of the timings: only the conversion is timed
from hlat.checkpoint import convert, portable, xser_write  # noqa: F401
from hlat.checkpoint.saved_config import run_config
from hlat.parallel import ParallelDims
arm, src, dst, spm = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
before, writing = rss("VmRSS"), {}
for name in ("write_torch", "write_hf_weights", "write_neuron_checkpoint"):  # the writing timed apart
    def timed(*a, _f=getattr(hf, name), **k):
        writing["start"], writing["cpu"] = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        return _f(*a, **k)
    setattr(hf, name, timed)
cpu, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
if arm == "reshard":  # rank 0 of the same run at TP 1: what a resume on the new layout writes before NxD loads it
    cfg = run_config(src)
    cfg = dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, tp=1))
    writing["start"], writing["cpu"] = start, cpu
    dst = xser_write.resharded_copy(src, cfg, ParallelDims(1, 1, 1, 1), 0)
else:
    hf.convert(src, dst, {"n2t": "torch"}.get(arm, arm), tokenizer=spm)
end = time.perf_counter()
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"rss_before": before, "rss_peak": rss("VmHWM"), "verify_s": writing["start"] - start,
                  "write_s": end - writing["start"], "total_s": end - start, "out": str(dst),
                  "cpu_s": usage.ru_utime + usage.ru_stime - cpu.ru_utime - cpu.ru_stime,
                  "write_cpu_s": usage.ru_utime + usage.ru_stime - writing["cpu"].ru_utime - writing["cpu"].ru_stime}))
"""
ARMS = {"hf": "torch", "torch": "torch", "neuron": "torch", "n2t": "neuron", "reshard": "neuron"}
"""Each arm and the source it converts."""


class Generated:
    """A reader of random tensors of the canonical form of ``cfg`` with AdamW state, made one at a time."""

    def __init__(self, cfg: RunConfig) -> None:
        self.config, self.specs = cfg, portable.canonical_tensors(cfg)

    def tensors(self) -> dict[str, safetensors_io.Spec]:
        return self.specs

    def read(self, name: str) -> torch.Tensor:
        shape, dtype = self.specs[name]
        if name.endswith(".step"):
            return torch.tensor(1.0)
        t = torch.empty(shape, dtype=dtype)
        return t.normal_(0, 0.02) if not name.endswith("exp_avg_sq") else t.uniform_(0, 1e-4)

    def extra(self) -> dict:
        return {"train_state": {"step": 1}}


def disk_write_speed(path: Path, gib: float) -> dict[str, float]:
    """MB/s of writing ``gib`` GiB sequentially in 64 MiB blocks, fsync included: through the page cache and past it.

    ``O_DIRECT`` (where the file system takes it) is the disk's own speed; a buffered write adds the kernel's copy
    into freshly allocated page-cache pages, which costs CPU and, on a VM, often more than the disk does.
    """
    block = mmap.mmap(-1, 64 << 20)  # page-aligned, as O_DIRECT asks
    block.write(os.urandom(1 << 20) * 64)
    n = max(1, int(gib * 1024 / 64))
    out = {}
    for how, extra in (("buffered", 0), ("direct", getattr(os, "O_DIRECT", 0))):
        if how == "direct" and not extra:
            continue
        start = time.perf_counter()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | extra, 0o644)
        except OSError:  # no O_DIRECT on this file system
            continue
        try:
            for _ in range(n):
                os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)
        out[how] = n * len(block) / (time.perf_counter() - start) / 1e6
        path.unlink()
    return out


def tokenizer(where: Path) -> Path:
    """A small BPE sentencepiece model (a HF export carries one; its size does not matter here)."""
    from hlat.config import DataConfig
    from hlat.data.builtin import builtin_corpus_path
    from hlat.data.loader import tokenizer_sample
    from hlat.data.sources import TextSource
    from hlat.data.tokenizer import load_or_train_tokenizer

    data = DataConfig(cache_dir=str(where))
    sample = tokenizer_sample(TextSource(builtin_corpus_path(where), "text"))
    return load_or_train_tokenizer(data, sample, 512, where).path


def run_arm(arm: str, code: Path, src: Path, dst: Path, spm: Path) -> dict:
    """One arm in a fresh process importing hlat from ``code``: its own report, plus the bytes it wrote."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", CHILD, arm, str(src), str(dst), str(spm)], env=env, capture_output=True)
    if out.returncode:
        raise SystemExit(f"arm {arm} ({code}) failed:\n{out.stderr.decode()[-3000:]}")
    report = json.loads(out.stdout.decode().strip().splitlines()[-1])
    written = Path(report["out"])
    report["bytes"] = sum(p.stat().st_size for p in written.rglob("*") if p.is_file())
    report["load"] = (load + os.getloadavg()[0]) / 2
    shutil.rmtree(written)
    return report


def neuron_source(reader: Generated, dst: Path) -> None:
    """The generated checkpoint as a neuron-backend one at TP 2, written by this tree's xser writer."""
    from hlat.checkpoint.xser_write import write_neuron_checkpoint
    from hlat.eval.hf import neuron_target

    cfg = neuron_target(reader.config)
    cfg = dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, tp=2))
    write_neuron_checkpoint(reader, dst, cfg)


def main() -> None:
    """Measure the disk, build each source, run its arms with each tree, print the markdown report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, required=True, help="work directory on the disk to measure")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--disk-gb", type=float, default=4.0, help="GiB written to measure the disk (default 4)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--code", type=Path, action="append", help="a src directory to import hlat from (repeatable)")
    args = p.parse_args()
    codes = [c.resolve() for c in args.code or [ROOT / "src"]]
    arms = [a for a in ARMS if a in args.arms.split(",")]
    model = ModelConfig(
        name="bench",
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_dim=args.ffn,
        vocab_size=args.vocab,
        max_seq_len=2048,
    )
    cfg = RunConfig(model=model, optimizer=OptimizerConfig(warmup_steps=0), train=TrainConfig(seq_len=2048))
    reader = Generated(cfg)
    specs = reader.tensors()
    params = sum(safetensors_io.nbytes(s) // 4 for k, s in specs.items() if k.startswith("model."))
    largest = max(map(safetensors_io.nbytes, specs.values()))
    args.dir.mkdir(parents=True, exist_ok=True)
    spm = tokenizer(args.dir / "cache")
    rows, built = [], {}
    for kind, make in (
        ("torch", lambda d: portable.write_torch(reader, d, optimizer=True, meta={})),
        ("neuron", lambda d: neuron_source(reader, d)),
    ):
        todo = [a for a in arms if ARMS[a] == kind]
        if not todo:
            continue
        src = args.dir / f"source-{kind}" / "step_00000001"
        shutil.rmtree(src.parent, ignore_errors=True)
        src.parent.mkdir()
        start = time.perf_counter()
        make(src)
        built[kind] = (time.perf_counter() - start, sum(f.stat().st_size for f in src.rglob("*") if f.is_file()))
        try:
            for arm in todo:
                disk = disk_write_speed(args.dir / "disk-probe", args.disk_gb)
                for code in codes:
                    rows.append((arm, code, disk, run_arm(arm, code, src, args.dir / f"to-{arm}", spm)))
        finally:
            shutil.rmtree(src.parent)
    print(
        f"\n{platform.node()}, {os.cpu_count()} cores; torch {torch.__version__}; build peak RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    )
    print(
        f"model: {params / 1e9:.3f}B parameters (dim {args.dim}, {args.layers} layers, ffn {args.ffn}, vocab "
        f"{args.vocab}); largest tensor {largest / 2**20:.0f} MiB; sources: "
        + ", ".join(f"{k} {b / 1e9:.2f} GB written in {s:.0f} s" for k, (s, b) in built.items())
    )
    print(
        "\n| arm | code | load | disk MB/s buffered | disk MB/s direct | output GB | verify s | write s | write MB/s "
        "| vs disk | CPU s | write CPU s/GB | CPU ceiling MB/s (2 cores) | peak RSS MiB | (peak - before) / largest |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for arm, code, speeds, r in rows:
        mbs, gb = r["bytes"] / r["write_s"] / 1e6, r["bytes"] / 1e9
        per_gb, disk = r["write_cpu_s"] / gb, max(speeds.values())
        print(
            f"| {arm} | {code.parent.name}/{code.name} | {r['load']:.1f} | {speeds['buffered']:.0f} | "
            f"{speeds.get('direct', float('nan')):.0f} | {gb:.2f} | "
            f"{r['verify_s']:.1f} | {r['write_s']:.1f} | {mbs:.0f} | {mbs / disk:.2f} | {r['cpu_s']:.1f} | "
            f"{per_gb:.1f} | {2e3 / per_gb:.0f} | {r['rss_peak'] / 2**20:.0f} | "
            f"{(r['rss_peak'] - r['rss_before']) / largest:.1f} |"
        )


if __name__ == "__main__":
    main()
