"""``hlat convert`` on a checkpoint of ~1.1B parameters with AdamW state: peak memory, MB/s, time.

    python bench/convert_checkpoint.py --dir /big/disk/convert-bench      # TinyLlama's shape, fp32 + AdamW: ~13 GB
    python bench/convert_checkpoint.py --dir /tmp/x --dim 64 --layers 2 --ffn 128 --vocab 256 --disk-gb 0.01  # smoke

1. The disk's sequential write speed in this run: ``--disk-gb`` written in 64 MiB blocks, then fsync.
2. The source: a torch-backend step directory (DCP, fp32 weights and AdamW moments, manifest with sha256s) written
   by hlat's streaming DCP writer from tensors generated one at a time, so it never exists in memory.
3. Each conversion (``--to hf``, then ``--to torch``) runs in a fresh process that reports its own peak RSS
   (``ru_maxrss``), the seconds it spent verifying the source (sha256 of every file, tensor names and shapes) and
   writing; peak RSS is compared with the largest tensor and with the RSS of the same process before converting
   (the interpreter, torch and hlat), MB/s with the disk's. Every output is removed after it is measured, the source
   at the end (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import json
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
import json, sys, time
from pathlib import Path
from hlat.eval import hf

def rss(key):  # VmRSS: now, VmHWM: the peak (ru_maxrss would carry the parent's peak over fork and exec)
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024

import safetensors.torch, sentencepiece  # noqa: E401  imports out of the timings: only the conversion is timed
from hlat.checkpoint import convert, portable  # noqa: F401
before, writing = rss("VmRSS"), {}
for name in ("write_torch", "write_hf_weights"):  # time the writing apart from the verification before it
    def timed(*a, _f=getattr(hf, name), **k):
        writing["start"] = time.perf_counter()
        return _f(*a, **k)
    setattr(hf, name, timed)
start = time.perf_counter()
hf.convert(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], tokenizer=Path(sys.argv[4]))
end = time.perf_counter()
print(json.dumps({"rss_before": before, "rss_peak": rss("VmHWM"), "verify_s": writing["start"] - start,
                  "write_s": end - writing["start"], "total_s": end - start}))
"""


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


def disk_write_speed(path: Path, gib: float) -> float:
    """MB/s of writing ``gib`` GiB sequentially in 64 MiB blocks, fsync included."""
    block = os.urandom(1 << 20) * 64
    n = max(1, int(gib * 1024 / 64))
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return n * len(block) / seconds / 1e6


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


def convert(src: Path, dst: Path, to: str, spm: Path) -> dict:
    """One conversion in a fresh process: its own report, plus the bytes it wrote."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), str(dst), to, str(spm)], env=env, check=True, capture_output=True
    )
    report = json.loads(out.stdout.decode().strip().splitlines()[-1])
    report["bytes"] = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    shutil.rmtree(dst)
    return report


def main() -> None:
    """Measure the disk, build the source, convert it to each target, print the markdown report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, required=True, help="work directory on the disk to measure")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--disk-gb", type=float, default=4.0, help="GiB written to measure the disk (default 4)")
    p.add_argument("--keep", action="store_true", help="keep the source checkpoint")
    args = p.parse_args()
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
    disk = disk_write_speed(args.dir / "disk-probe", args.disk_gb)
    src = args.dir / "source"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir()
    start = time.perf_counter()
    portable.write_torch(reader, src, optimizer=True, meta={})
    built, build_rss = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    size = sum(f.stat().st_size for f in src.iterdir())
    rows = []
    try:
        for to in ("hf", "torch"):
            rows.append((to, convert(src, args.dir / f"to-{to}", to, spm)))
    finally:
        if not args.keep:
            shutil.rmtree(src)
    print(f"\n{platform.node()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; torch {torch.__version__}")
    print(
        f"model: {params / 1e9:.3f}B parameters (dim {args.dim}, {args.layers} layers, ffn {args.ffn}, vocab "
        f"{args.vocab}); source {size / 1e9:.2f} GB (fp32 weights + AdamW moments), written in {built:.0f} s by "
        f"the streaming DCP writer (peak RSS of this process {build_rss / 1024:.0f} MiB)"
    )
    print(
        f"largest tensor {largest / 2**20:.0f} MiB; disk sequential write {disk:.0f} MB/s ({args.disk_gb} GiB, fsync)\n"
    )
    print(
        "| to | output GB | verify s | write s | total s | write MB/s | vs disk | peak RSS MiB | before MiB | "
        "(peak - before) / largest |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for to, r in rows:
        mbs = r["bytes"] / r["write_s"] / 1e6
        print(
            f"| {to} | {r['bytes'] / 1e9:.2f} | {r['verify_s']:.1f} | {r['write_s']:.1f} | {r['total_s']:.1f} | "
            f"{mbs:.0f} | {mbs / disk:.2f} | {r['rss_peak'] / 2**20:.0f} | {r['rss_before'] / 2**20:.0f} | "
            f"{(r['rss_peak'] - r['rss_before']) / largest:.1f} |"
        )


if __name__ == "__main__":
    main()
