"""Memory and time of activation checkpointing: none vs selective vs full, on the `small` model.

    python experiments/activation_checkpointing/run.py                 # ~27 min on 2 cores; writes results.json
    python experiments/activation_checkpointing/run.py --batch 1 --seq 128 --rounds 2 --repeats 1   # a quick look
    python experiments/activation_checkpointing/run.py --report        # the tables of the saved results.json, and
                                                                         # comparison.png (memory against time)

The model is ``conf/model/small.yaml``, built on the meta device, given activation checkpointing
(``hlat.backends.torch.recompute``) and materialized (the order the torch backend uses), trained in fp32 on the CPU on
one fixed random batch of ``--batch`` x ``--seq`` tokens. No optimizer step: activation checkpointing does not touch it.
Per SDPA kernel:

- memory, each mode in a fresh Python process, so that one's peak cannot hide another's (``--repeats`` processes
  per mode, interleaved):
  - saved activations: the bytes autograd keeps from the forward pass for the backward pass, seen through
    ``torch.autograd.graph.saved_tensors_hooks``. Each distinct storage counts once with its full size (a view keeps
    its whole base alive); parameters are left out. Exact and free of noise, but blind to the backward pass's
    transients (for ``full``, one block's recomputed activations).
  - peak RSS delta: ``ru_maxrss`` after one forward+backward minus the RSS before it (gradients are allocated
    before, so they are not in it): activations, the backward's transients, allocator slack and one-time
    allocations (thread pools) alike in every mode.
- time, all three modes in one process, interleaved: after a warm-up round, ``--rounds`` rounds of one
  forward+backward per mode, the order rotated each round, so that a slow patch of a shared machine hits every
  mode alike; in the same rounds, the work each mode adds, timed alone (a forward of every block for ``full``, of
  every attention core for ``selective``). CPU time of the process (``time.process_time``) with ``--threads`` 1:
  another job on the machine cannot stall it at an OpenMP barrier and its waits are not counted, though cache and
  memory-bandwidth contention still move it; wall time is recorded too.

``--sdpa math`` forces PyTorch's reference attention, which materializes the (B, H, T, T) softmax as the attention of
Korthikanti et al. (2022) did; ``default`` lets PyTorch choose (on CPU a flash kernel, which keeps its inputs, output
and log-sum-exp, never a T x T matrix). The kernel context is held over forward and backward: the recomputation must
use the same kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hlat.backends.torch.recompute import apply_activation_checkpointing
from hlat.config import ModelConfig
from hlat.model import AttentionCore, Block, Transformer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODES = ("none", "selective", "full")
SDPAS = ("default", "math")
MIB = 2**20


def model_config() -> ModelConfig:
    """The ``small`` preset, read from its YAML file."""
    import yaml

    return ModelConfig(**yaml.safe_load((ROOT / "conf" / "model" / "small.yaml").read_text()))


def build(mode: str) -> Transformer:
    """The seeded ``small`` model with ``mode`` applied before materialization, gradients allocated."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(model_config())
    apply_activation_checkpointing(model, mode)
    model.to_empty(device="cpu")
    model.init_weights()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed random batch: inputs and next-token targets, (B, T) each."""
    data = torch.randint(
        0, model_config().vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0)
    )
    return data[:, :-1], data[:, 1:]


def kernel(sdpa: str) -> contextlib.AbstractContextManager:
    """The SDPA kernel context; a fresh one per use (``sdpa_kernel``'s can be entered once)."""
    return sdpa_kernel(SDPBackend.MATH) if sdpa == "math" else contextlib.nullcontext()


def loss_of(model: Transformer, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())


def memory(mode: str, args: argparse.Namespace) -> dict:
    """Saved activation bytes and peak RSS delta of one forward+backward of ``mode`` (a fresh process)."""
    model = build(mode)
    inputs, targets = batch(args)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}  # storage address -> bytes

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    attention_backward: list[str] = []  # which SDPA kernel ran, by its backward node
    model.layers[0].attn.core.register_forward_hook(lambda m, a, y: attention_backward.append(y.grad_fn.name()))
    rss_before = psutil_rss()
    with kernel(args.sdpa):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_of(model, inputs, targets)
        loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss is in KiB on Linux
    return {
        "mode": mode,
        "sdpa": args.sdpa,
        "attention_backward": attention_backward[0],
        "loss": loss.item(),
        "saved_bytes": sum(saved.values()),
        "saved_storages": len(saved),
        "peak_rss_delta_bytes": peak - rss_before,
    }


def psutil_rss() -> int:
    """Resident bytes of this process now."""
    import psutil

    return psutil.Process().memory_info().rss


def timing(args: argparse.Namespace) -> dict:
    """CPU and wall seconds per mode, interleaved in one process after a warm-up round.

    Per round: one forward+backward of each mode, and the work each mode adds to ``none``, timed on its own: a
    forward of every block (``full``) and of every attention core (``selective``) on the inputs they had.
    """
    models = {mode: build(mode) for mode in MODES}
    inputs, targets = batch(args)
    ref = models["none"]
    captured: dict[str, list[tuple]] = {"full": [], "selective": []}  # per layer, the inputs of one recomputation
    hooks = [
        m.register_forward_pre_hook(lambda m, a, key=key: captured[key].append(a))
        for key, cls in (("full", Block), ("selective", AttentionCore))
        for m in ref.modules()
        if isinstance(m, cls)
    ]
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    wall: dict[str, list[float]] = {m: [] for m in MODES}
    extra: dict[str, list[float]] = {"full": [], "selective": []}
    for r in range(args.rounds + 1):  # round 0 is the warm-up
        for mode in MODES[r % 3 :] + MODES[: r % 3]:  # rotated: no mode always runs first
            model = models[mode]
            model.zero_grad(set_to_none=False)
            t0, c0 = time.perf_counter(), time.process_time()
            with kernel(args.sdpa):
                loss_of(model, inputs, targets).backward()
            if r:
                wall[mode].append(time.perf_counter() - t0)
                cpu[mode].append(time.process_time() - c0)
        if r == 0:
            for h in hooks:
                h.remove()
            calls = {
                key: [
                    (m, [t.detach().requires_grad_(t.requires_grad) for t in a])
                    for m, a in zip([m for m in ref.modules() if isinstance(m, cls)], captured[key], strict=True)
                ]
                for key, cls in (("full", Block), ("selective", AttentionCore))
            }
        for key in ("full", "selective"):
            c0 = time.process_time()
            with kernel(args.sdpa):
                for module, a in calls[key]:
                    module(*a)  # with autograd on, as the recomputation runs; the result is dropped
            if r:
                extra[key].append(time.process_time() - c0)
    return {"sdpa": args.sdpa, "cpu_s": cpu, "wall_s": wall, "recompute_cpu_s": extra}


def child(what: str, args: argparse.Namespace, mode: str = "none") -> dict:
    """Run ``memory`` or ``timing`` in a fresh process; its result is the last line it prints."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        what,
        "--mode",
        mode,
        "--sdpa",
        args.sdpa,
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--rounds",
        str(args.rounds),
        "--threads",
        str(args.threads),
    ]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, cwd=ROOT).stdout  # stderr: shown
    return json.loads(out.strip().splitlines()[-1])


def summarize(mem: list[dict], times: list[dict]) -> list[dict]:
    """One row per (kernel, mode)."""
    rows = []
    for t in times:
        for mode in MODES:
            ms = [x for x in mem if x["sdpa"] == t["sdpa"] and x["mode"] == mode]
            m = ms[0]
            assert all(x["saved_bytes"] == m["saved_bytes"] and x["loss"] == m["loss"] for x in ms), "not deterministic"
            rss = [x["peak_rss_delta_bytes"] / MIB for x in ms]
            cpu, wall, extra = t["cpu_s"][mode], t["wall_s"][mode], t["recompute_cpu_s"]
            rows.append(
                {
                    "sdpa": t["sdpa"],
                    "mode": mode,
                    "attention_backward": m["attention_backward"],
                    "loss": m["loss"],
                    "saved_mib": m["saved_bytes"] / MIB,
                    "peak_rss_delta_mib": statistics.median(rss),
                    "peak_rss_delta_mib_min": min(rss),
                    "peak_rss_delta_mib_max": max(rss),
                    "cpu_s_median": statistics.median(cpu),
                    "cpu_s_min": min(cpu),
                    "cpu_s_max": max(cpu),
                    "wall_s_median": statistics.median(wall),
                    "timed_steps": len(cpu),
                    "recompute_cpu_s_median": statistics.median(extra.get(mode, [0.0])),
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    """The summary as two markdown tables, memory and time, with ratios against ``none`` with the same kernel."""
    mem = [
        "| SDPA kernel (its backward node) | mode | saved activations (MiB) | vs none "
        "| peak RSS delta (MiB, median) | (min-max) | vs none |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    time_ = [
        "| SDPA kernel | mode | CPU s/step (median) | (min-max) | vs none | wall s/step (median) "
        "| recomputed work alone (CPU s) | none + that, vs none |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = {r["sdpa"]: r for r in rows if r["mode"] == "none"}
    for r in rows:
        b = base[r["sdpa"]]
        mem.append(
            f"| {r['sdpa']} (`{r['attention_backward']}`) | {r['mode']} | {r['saved_mib']:,.1f} | "
            f"{r['saved_mib'] / b['saved_mib']:.2f} | {r['peak_rss_delta_mib']:,.0f} | "
            f"{r['peak_rss_delta_mib_min']:,.0f}-{r['peak_rss_delta_mib_max']:,.0f} | "
            f"{r['peak_rss_delta_mib'] / b['peak_rss_delta_mib']:.2f} |"
        )
        extra = r["recompute_cpu_s_median"]
        time_.append(
            f"| {r['sdpa']} | {r['mode']} | {r['cpu_s_median']:.2f} | "
            f"{r['cpu_s_min']:.2f}-{r['cpu_s_max']:.2f} | {r['cpu_s_median'] / b['cpu_s_median']:.3f} | "
            f"{r['wall_s_median']:.2f} | {extra:.2f} | "
            f"{(b['cpu_s_median'] + extra) / b['cpu_s_median']:.3f} |"
        )
    return "\n".join(mem) + "\n\n" + "\n".join(time_)


def plot(rows: list[dict], path: Path) -> Path:
    """Saved activations against CPU time per step, one point per mode, one series per SDPA kernel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for sdpa, marker, offset in zip(SDPAS, "os", ((6, -14), (6, 5)), strict=False):
        pts = [r for r in rows if r["sdpa"] == sdpa]
        if not pts:
            continue
        ax.plot([r["cpu_s_median"] for r in pts], [r["saved_mib"] for r in pts], marker=marker, label=f"{sdpa} SDPA")
        for r in pts:
            ax.errorbar(
                r["cpu_s_median"],
                r["saved_mib"],
                xerr=[[r["cpu_s_median"] - r["cpu_s_min"]], [r["cpu_s_max"] - r["cpu_s_median"]]],
                fmt="none",
                ecolor="grey",
                alpha=0.5,
            )
            ax.annotate(r["mode"], (r["cpu_s_median"], r["saved_mib"]), textcoords="offset points", xytext=offset)
    ax.set_xlabel("CPU s per forward + backward (median, min-max)")
    ax.set_ylabel("activations saved for backward (MiB)")
    ax.set_title("model=small, 4 x 512 tokens, fp32: activation checkpointing modes")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    """Measure every (kernel, mode) in fresh processes, write ``--out`` and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6, help="timed forward+backward passes per mode, interleaved")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per mode for the memory figures")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: immune to a co-tenant's OpenMP stalls)")
    ap.add_argument("--sdpa", default=",".join(SDPAS), help="comma-separated: default, math")
    ap.add_argument("--out", type=Path, default=HERE / "results.json")
    ap.add_argument("--report", action="store_true", help="print the table of --out and exit")
    ap.add_argument("--child", choices=("memory", "timing"), help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, default="none", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(memory(args.mode, args) if args.child == "memory" else timing(args)))
        return
    if args.report:
        rows = json.loads(args.out.read_text())["summary"]
        print(table(rows))
        print(f"\n![saved activations against time]({plot(rows, args.out.with_name('comparison.png')).name})")
        return

    mem, times = [], []
    for sdpa in args.sdpa.split(","):
        args.sdpa = sdpa
        for mode in [m for _ in range(args.repeats) for m in MODES]:
            mem.append(child("memory", args, mode))
            print(
                f"{sdpa:7s} {mode:9s} saved {mem[-1]['saved_bytes'] / MIB:,.1f} MiB, "
                f"peak RSS +{mem[-1]['peak_rss_delta_bytes'] / MIB:,.0f} MiB",
                flush=True,
            )
        t0 = time.time()
        times.append(child("timing", args))
        medians = {m: round(statistics.median(v), 2) for m, v in times[-1]["cpu_s"].items()}
        print(f"{sdpa:7s} CPU s/step {medians} ({time.time() - t0:.0f} s)", flush=True)
    setup = {
        "model": "small",
        "batch": args.batch,
        "seq": args.seq,
        "dtype": "float32",
        "device": "cpu",
        "rounds": args.rounds,
        "repeats": args.repeats,
        "threads": args.threads,
    }
    machine = {
        "cpu": cpu_name(),
        "cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    rows = summarize(mem, times)
    plot(rows, args.out.with_name("comparison.png"))
    args.out.write_text(
        json.dumps({"setup": setup, "machine": machine, "summary": rows, "memory": mem, "timing": times}, indent=1)
        + "\n"
    )
    print(table(rows))


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
