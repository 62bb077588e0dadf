"""What each rank reads to resume the paper's neuron checkpoints on another layout: before and after ranged reads.

    python bench/reshard_reads.py                      # HLAT-7B and HLAT-70B, each on three other layouts
    python bench/reshard_reads.py experiment=hlat_70b --change parallelism.pp=4 --per-rank

A count from the configs alone (``hlat.checkpoint.xser_reshard.read_counts``; no tensor is allocated, no file read):
the tensor bytes each rank of the new layout holds, what the full-tensor reader read to write them (every piece of
every tensor of its pipeline stage, from every saved rank's files), and what the ranged reader reads (the rows and
columns of the saved pieces its own piece overlaps). The reference pickles and manifest aside (a few MB per rank).
"""

from __future__ import annotations

import argparse
import math
import statistics

from hlat.checkpoint.hf_layout import expected_shapes
from hlat.checkpoint.xser import STATE_KEYS, disk_dtype
from hlat.checkpoint.xser_reshard import read_counts
from hlat.config import RunConfig
from hlat.config.compose import compose_run_config

SCENARIOS = {
    "experiment=hlat_7b": (["parallelism.tp=4"], ["parallelism.tp=16"], ["cluster.nodes=32"]),
    "experiment=hlat_70b": (["parallelism.pp=4"], ["parallelism.tp=16"], ["cluster.nodes=16"]),
}
"""The paper's two recipes, each resumed with half or twice a degree, or on half the nodes."""


def dp(cfg: RunConfig) -> int:
    """The data-parallel degree of ``cfg``'s cluster and layout."""
    return cfg.cluster.world_size // (cfg.parallelism.tp * cfg.parallelism.pp)


def checkpoint_bytes(cfg: RunConfig) -> int:
    """About the tensor bytes of a whole checkpoint of ``cfg`` (kv-head copies and ZeRO-1 padding aside)."""
    keys = ["model", *STATE_KEYS[1:], *(["master"] if cfg.precision.master_weights else [])]
    total = 0
    for name, shape in expected_shapes(cfg.model).items():
        for key in keys:
            own = f"model.{name}" if key == "model" else f"optimizer.state.{name}.{key}"
            total += math.prod(shape) * disk_dtype(own, cfg.precision).itemsize
    return total


def describe(cfg: RunConfig) -> str:
    """The layout and precision of ``cfg`` in a few words."""
    par = cfg.parallelism
    return f"TP {par.tp} x PP {par.pp} x DP {dp(cfg)}{' ZeRO-1' if par.zero1 else ''}, {cfg.precision.name}"


def report(base: list[str], change: list[str], per_rank: bool) -> None:
    """Print the table of one resume: the run of ``base`` overrides resumed with ``change`` on top."""
    saved, now = compose_run_config(base), compose_run_config([*base, *change])
    counts = read_counts(saved, dp(saved), now, dp(now))
    print(f"\n### {' '.join(base)}: {describe(saved)} -> {' '.join(change)}: {describe(now)}, {len(counts)} ranks")
    print(f"checkpoint ~{checkpoint_bytes(saved) / 1e9:,.0f} GB\n")
    print("| per rank | held GB | read GB (min / median / max) | max read / held | all ranks read TB |")
    print("|---|---|---|---|---|")
    held = [c.held for c in counts]
    for label, field in (("before (full tensors)", "before"), ("after (byte ranges)", "after")):
        reads = [getattr(c, field) for c in counts]
        ratio = max(getattr(c, field) / c.held for c in counts)
        print(
            f"| {label} | {min(held) / 1e9:.2f}-{max(held) / 1e9:.2f} | {min(reads) / 1e9:.2f} / "
            f"{statistics.median(reads) / 1e9:.2f} / {max(reads) / 1e9:.2f} | {ratio:.2f} | {sum(reads) / 1e12:.2f} |"
        )
    if per_rank:
        print("\n| rank | held GB | before GB | after GB |\n|---|---|---|---|")
        for c in counts:
            print(f"| {c.rank} | {c.held / 1e9:.3f} | {c.before / 1e9:.3f} | {c.after / 1e9:.3f} |")


def main() -> None:
    """Count the given resume, or the paper's six."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("saved", nargs="*", help="overrides of the run that saved the checkpoint (default: the paper's)")
    p.add_argument("--change", nargs="+", default=[], help="what the resumed run changes")
    p.add_argument("--per-rank", action="store_true", help="one line per rank too")
    args = p.parse_args()
    if args.saved:
        runs = [(args.saved, args.change)]
    else:
        runs = [([base], change) for base, changes in SCENARIOS.items() for change in changes]
    for base, change in runs:
        report(base, change, args.per_rank)


if __name__ == "__main__":
    main()
