"""``hlat graphs plan`` on the paper's precision ablation, traced through the real NxD 0.17 on XLA:CPU.

One plan for the module (``plan`` fixture): the 5 arms of ``sweeps/precision_ablation.yaml`` on ``cluster=xla_cpu``
with 2 micro-batches a step, each arm's tiny twin run once by ``python train.py`` with the ledger's fingerprints on.
The twins are the ground truth the grouping is checked against, and they also carry what the lane checked with four
runs of its own before: graph hygiene in every precision mode (no compile after the warm-up, no transfer inside a
step, one per fetch), now per phase from each twin's ledger.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hlat.health.graph_guard import read_ledger
from tests.neuron.lane import ROOT
from tests.timeouts import hang_guard

ARMS = ("fp32", "bf16", "bf16_sr", "master_weights", "bf16_sr_beta2_0.99")
EXTRA = ("cluster=xla_cpu", "train.micro_batch_size=8")
"""The sweep on XLA:CPU with 2 micro-batches a step (its global batch is 16), so the twins accumulate too."""


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> dict[str, Any]:
    """``hlat graphs plan -m --config-dir sweeps --config-name precision_ablation``, two twins at a time."""
    out = tmp_path_factory.mktemp("plan")
    args = [sys.executable, "-m", "hlat.cli", "graphs", "plan", "-m", "--config-dir", str(ROOT / "sweeps"),
            "--config-name", "precision_ablation", *EXTRA, f"data.cache_dir={cache}", "--out", str(out),
            "--jobs", "2", "--json"]  # fmt: skip
    r = subprocess.run(args, cwd=out, capture_output=True, text=True, timeout=hang_guard(1800))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout)
    result["dir"] = out
    return result


def short(name: str) -> str:
    """``+precision_arm=bf16_sr cluster=...`` -> ``bf16_sr``."""
    return name.split()[0].split("=")[1]


def ledger(plan: dict[str, Any], arm: str) -> list:
    i = [short(a["name"]) for a in plan["arms"]].index(arm)
    return read_ledger(plan["dir"] / "twins" / f"arm{i:02d}" / "run" / "graphs" / "rank0.jsonl")


def test_the_precision_ablation_groups_by_what_its_graphs_are(plan: dict[str, Any]) -> None:
    """Four groups: fp32; bf16 with bf16_sr (stochastic rounding is the Neuron runtime's variable, in no graph and
    no compiler flag); master weights; and bf16_sr with beta2 0.99 alone, because at step 1 torch's AdamW computes
    sqrt(1 - 0.99) = 0.1 = 1 - beta1 in float32 and torch-xla passes the two as one graph input (beta2 0.95 does
    not): its first optimizer graph differs. Each split names what differs.

    Catches: arms merged whose graphs differ (a signature part missing: flags, env, shapes, a phase), arms split by
    a runtime-only variable (NEURON_RT_STOCHASTIC_ROUNDING_* in the env signature), fingerprints that differ between
    processes for the same graph (bf16 and bf16_sr would split).
    """
    assert all(a["untraced"] is None and a["refused"] is None for a in plan["arms"]), plan["arms"]
    groups = [sorted(map(short, g)) for g in plan["graph_groups"]]
    assert groups == [["fp32"], ["bf16", "bf16_sr"], ["master_weights"], ["bf16_sr_beta2_0.99"]], groups
    assert [sorted(map(short, g["arms"])) for g in plan["compile_groups"]] == groups
    why = {(short(s["a"]), short(s["b"])): s["why"] for s in plan["splits"]}
    fp32_bf16 = " | ".join(why["fp32", "bf16"])
    assert "XLA_USE_BF16=(unset) vs 1" in fp32_bf16 and "--auto-cast=none" in fp32_bf16
    beta2 = why["bf16", "bf16_sr_beta2_0.99"]
    assert beta2[0] == "graphs of the twin differ in optimizer", beta2
    assert not any(w.startswith(("shape", "environment", "compiler flags")) for w in beta2), beta2
    assert any(w.startswith("key optimizer.beta2: 0.95 vs 0.99") for w in beta2), beta2
    assert all("NEURON_RT_" not in k for a in plan["arms"] for k in a["env"])


def test_fingerprints_are_the_same_in_fresh_processes(plan: dict[str, Any]) -> None:
    """bf16 and bf16_sr ran in two processes (with different environments): every phase of every step ran graphs
    with the same canonical fingerprints and torch-xla hashes. beta2 0.99's twin differs in step 1's optimizer
    graph only."""
    a, b, c = (ledger(plan, arm) for arm in ("bf16", "bf16_sr", "bf16_sr_beta2_0.99"))
    key = [(e.step, e.seq, e.phase, e.micro) for e in a]
    assert key == [(e.step, e.seq, e.phase, e.micro) for e in b] and len(a) >= 12
    assert [(e.graphs, e.raw) for e in a] == [(e.graphs, e.raw) for e in b]
    differ = [(e.step, e.phase) for e, f in zip(a, c, strict=True) if e.graphs != f.graphs]
    assert differ == [(1, "optimizer")], differ


@pytest.mark.parametrize("arm", ["fp32", "bf16", "bf16_sr", "master_weights"])
def test_steady_steps_compile_nothing_and_fetch_once_per_interval(plan: dict[str, Any], arm: str) -> None:
    """Graph hygiene per precision mode, per phase, from the twin's ledger (3 steps, 2 micro-batches, a fetch each
    step): after step 2 nothing compiles; no forward, backward or optimizer phase moves a tensor to the host or
    falls back to the CPU; each fetch is one transfer; nothing runs between the phases.

    Catches (as the lane's four runs of its own did): a Python scalar that changes every step and is baked in, a
    shape that changes per step (a compile at step 3), ``.item()`` / ``float()`` / printing a device tensor inside
    the step, an op without a lowering (a transfer or fallback in forward_backward or optimizer), a hook that reads a
    tensor each step (an "other" phase with transfers).
    """
    events = ledger(plan, arm)
    assert not [e for e in events if e.step >= 3 and e.new_graphs], [e for e in events if e.step >= 3]
    for e in events:
        if e.step >= 1 and e.phase in ("forward_backward", "optimizer"):
            assert (e.transfers, e.fallbacks) == (0, 0), e
        if e.phase == "fetch":
            assert (e.transfers, e.fallbacks) == (1, 0), e
    assert not [e for e in events if e.step >= 1 and e.phase == "other"], events
    assert [e.micro for e in events if e.step == 2 and e.phase == "forward_backward"] == [0, 1]
    compiled = sum(e.new_graphs for e in events)
    assert compiled == len({g for e in events for g in e.graphs}), "a graph compiled twice, or one never compiled"
