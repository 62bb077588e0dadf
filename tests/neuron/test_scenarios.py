"""Precision and activation-checkpointing scenarios through the real NxD 0.17 on XLA:CPU (world size 1).

Every scenario runs ``python train.py cluster=xla_cpu`` (the neuron backend on the real library) and, as its oracle,
``cluster=cpu`` (the torch backend) on the same config and data, and compares the per-step ``train/loss`` and pre-clip
``train/grad_norm`` of the micro model's 3 steps. The learning rate is 10x the micro default (``LR``): at 3e-4 the
update moves the step-2/3 grad norm by only 0.1-0.3 %, below what the bf16 modes can resolve; at 3e-3 it moves it by
14-22 %, so a run whose optimizer writes nothing back fails too.

Tolerances come from two measurements (2-core AVX2 host, torch 2.9.0, torch-xla 2.9.0, NxD 0.17.0, 2026-11-25): the
difference between the backends in each mode (in each test's docstring), and what a bug costs, measured on the torch
backend, fp32, lr 3e-3 (relative change of steps 1, 2, 3; "growth" is the grad norm over step 1's, steps 2 and 3):

- other initial weights (train.seed + 1): loss -0.2, -0.9, -1.7 %; grad norm +17, -3, -13 %; growth -18, -26 %;
- one of the two micro-batches missing (train.global_batch_size=2): loss -0.9 %; grad norm +45, +31, +67 %; growth
  -10, +15 %;
- a wrong loss scale (the mean over micro-batches not divided by 2, or divided twice): grad norm x2 or /2;
- an optimizer that does not write its update back (lr 1e-12): loss 0, +0.5, +1.3 %; grad norm 0, -14, -22 %;
- beta2 0.999 instead of 0.95: 1.1e-4 in the step-3 grad norm (9e-6 at lr 3e-4). Only the fp32 comparisons
  (activation checkpointing, 1e-5) can see it; in the bf16 modes it is far below the backends' honest difference.

Numerics alone cannot tell a mode that was not applied from one that was (fp32 and master weights agree to 6e-4), so
each scenario also checks what it changes structurally: the dtype of what the device stored (from the run's final xser
checkpoint) or the recomputation in the traced graphs (``XLA_SAVE_TENSORS_FILE``).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.neuron.lane import KEYS, train

LR = "optimizer.lr=3e-3"
"""Every scenario's learning rate (see the module docstring)."""
ORACLE = ("cluster=cpu", "precision.bf16_matmul=emulated")
"""The torch backend with bf16 matmuls as bf16 hardware and XLA's dot do them (bf16 operands, fp32 accumulation, the
result rounded to bf16), whatever bf16 kernels this host has; ``auto`` picks the same on this AVX2 machine."""
NEURON = ("cluster=xla_cpu",)


def rel(got: list[float], want: list[float]) -> list[float]:
    """Per-step relative difference ``got / want - 1``."""
    assert len(got) == len(want), (got, want)
    return [g / w - 1 for g, w in zip(got, want, strict=True)]


def ratios(values: list[float]) -> list[float]:
    """Each step's value over step 1's: cancels a bias that is the same at every step."""
    return [v / values[0] for v in values[1:]]


def assert_close(got: dict[str, list[float]], want: dict[str, list[float]], tol: dict[str, float]) -> None:
    """Every key of ``tol`` within its relative tolerance at every step (the message shows all measured diffs)."""
    assert all(len(got[key]) == len(want[key]) == 3 for key in tol), (got, want)  # every step logged
    diffs = {key: rel(got[key], want[key]) for key in tol}
    for key, limit in tol.items():
        assert max(map(abs, diffs[key])) <= limit, f"{key}: relative diffs {diffs} exceed {limit}: {got} vs {want}"


def bf16_exact(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is a bf16 value (what a bf16 device tensor becomes in fp32)."""
    return bool((t.to(torch.bfloat16).to(t.dtype) == t).all())


def stored(run_dir: Path, part: str) -> list[torch.Tensor]:
    """The floating tensors (more than one element: no step counters) of the run's newest xser checkpoint's ``part``
    (``model`` or ``optim``); xser writes each as a plain CPU tensor file."""
    step = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    files = sorted(step.glob(f"{part}/*.tensors/tensor_*.pt"))
    assert files, f"no xser tensors under {step / part}"
    tensors = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
    return [t for t in tensors if t.is_floating_point() and t.numel() > 1]


@pytest.mark.parametrize("precision", ["bf16", "bf16_sr"])
def test_pure_bf16_on_xla_cpu_matches_the_torch_backend(tmp_path: Path, cache: Path, precision: str) -> None:
    """``precision=bf16`` / ``bf16_sr`` (XLA_USE_BF16=1) through NxD against the torch backend's pure bf16.

    What differs, measured (loss; grad norm; grad norm over step 1's at steps 2-3), the same for both presets:
    -2.0 %, -3.0 %, -1.5 %; -5.1 %, -5.7 %, -5.9 % (bf16_sr -6.2 %); -0.6 %, -0.9 % (bf16_sr -1.2 %). The losses are
    bf16 values (6.0625 vs 6.25 is 6 bf16 steps of 2^-5). The bias comes from XLA:CPU, not from hlat or NxD: with
    XLA_USE_BF16 every float op, reductions included, accumulates in bf16 (the mean of 64 x 6.26 is 6.09 there, 6.25
    in torch, which accumulates bf16 sums in fp32), so the cross-entropy's logsumexp, the token mean and the softmax
    backward come out low. The plain ``hlat.model.Transformer`` without NxD shows the same bias on one batch (loss
    6.125 vs 6.219, grad norm -3.9 %); Trainium accumulates in fp32 and would not. The bias is systematic, so besides
    loss 6 % and grad norm 12 % (2x the measured) the growth of the grad norm over the steps must agree to 3 %
    (2.5-5x the measured). ``NEURON_RT_STOCHASTIC_ROUNDING_EN`` is the Neuron runtime's and does nothing on XLA:CPU
    (bf16_sr gives bf16's numbers to the bit); the torch oracle rounds stochastically, 0.3 % from round-to-nearest.

    Catches: XLA_USE_BF16 not set or set too late (fp32 weights in the checkpoint; fp32 is within the numeric
    tolerances, so only the dtype checks see it), AdamW moments not kept in bf16, wrong initial weights (growth
    -18 %, -26 %: the step-1 +17 % alone would hide in the -5 % bias), a missing micro-batch (+45 %), a wrong loss
    scale (x2), an update not written back to the bf16 weights (growth -14 %, -22 %).
    """
    ref = train(tmp_path, "torch", cache, *ORACLE, f"precision={precision}", LR)
    nxd = train(tmp_path, "xla", cache, *NEURON, f"precision={precision}", LR)
    assert_close(nxd, ref, {"train/loss": 0.06, "train/grad_norm": 0.12})
    growth = rel(ratios(nxd["train/grad_norm"]), ratios(ref["train/grad_norm"]))
    assert max(map(abs, growth)) <= 0.03, f"grad norm over step 1's: {growth}, {nxd} vs {ref}"
    assert all(bf16_exact(torch.tensor(v)) for v in nxd["train/loss"]), f"loss not computed in bf16: {nxd}"
    weights, moments = stored(tmp_path / "xla", "model"), stored(tmp_path / "xla", "optim")
    assert len(weights) == 15 and all(map(bf16_exact, weights)), "the device's weights are not bf16"
    assert len(moments) == 30 and all(map(bf16_exact, moments)), "the device's AdamW moments are not bf16"


def test_master_weights_with_zero1_on_xla_cpu_matches_the_torch_backend(tmp_path: Path, cache: Path) -> None:
    """``precision=master_weights parallelism.zero1=true`` (XLA_DOWNCAST_BF16=1, NxD's ``NeuronZero1Optimizer`` with
    fp32 masters and fp32 gradient accumulation) against the torch backend's master weights (``PrecisionAdamW``; its
    ZeRO-1 is a no-op at one rank). The neuron backend refuses master weights without ``parallelism.zero1=true``.

    What differs, measured (loss; grad norm): 7e-6, 4e-5, 1.4e-4; -2.3e-4, -7.5e-4, -1.6e-4. Both keep the weights
    in bf16 and the masters, gradient sums, norms, softmax and cross-entropy in fp32 (float64 under
    XLA_DOWNCAST_BF16); they round matmul outputs to bf16 at different places (the torch oracle's attention is one
    fused fp32 kernel with a bf16 output, NxD's attention rounds scores and probabilities to bf16). Tolerances: loss
    5e-4, grad norm 2.5e-3 (3.3-3.6x the measured).

    Catches: wrong initial weights (17 %), a missing micro-batch (45 %), a wrong loss scale, masters that do not
    reach the bf16 weights (14-22 % at steps 2-3), bf16 softmax/cross-entropy (the loss would be a bf16 value, 0.5 %
    steps), and, through the checkpoint, bf16 device weights missing (XLA_DOWNCAST_BF16 unset: fp32 weights, which the
    tolerances alone would let through: fp32 is 6e-4 from master weights) or the fp32 masters and moments missing.
    """
    mode = ("precision=master_weights", "parallelism.zero1=true", LR)
    ref = train(tmp_path, "torch", cache, *ORACLE, *mode)
    nxd = train(tmp_path, "xla", cache, *NEURON, *mode)
    assert_close(nxd, ref, {"train/loss": 5e-4, "train/grad_norm": 2.5e-3})
    weights, state = stored(tmp_path / "xla", "model"), stored(tmp_path / "xla", "optim")
    assert len(weights) == 15 and all(map(bf16_exact, weights)), "the device's weights are not bf16"
    # 15 fp32 masters (in the checkpoint: use_master_weights_in_ckpt) and 30 fp32 moments, all off the bf16 grid.
    assert len(state) == 45 and not any(map(bf16_exact, state)), "the optimizer's masters or moments are not fp32"


@pytest.fixture(scope="module")
def lane_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory (and MLflow store) for the runs this module shares."""
    return tmp_path_factory.mktemp("scenarios")


@pytest.fixture(scope="module")
def torch_fp32(lane_tmp: Path, cache: Path) -> dict[str, list[float]]:
    """The torch backend's fp32 run: the oracle of every activation-checkpointing mode."""
    return train(lane_tmp, "torch-fp32", cache, *ORACLE, LR)


Recomputed = tuple[dict[str, list[float]], Counter[str]]
"""A neuron run's metrics and the count of each op in its traced graphs."""


@pytest.fixture(scope="module")
def recomputed(lane_tmp: Path, cache: Path) -> Callable[[str], Recomputed]:
    """``parallelism.activation_checkpointing=<mode>`` on the neuron backend, fp32, run once per mode.

    torch-xla writes the IR of every graph it executes to ``XLA_SAVE_TENSORS_FILE`` (as ``<file>.<ordinal>``).
    """
    runs: dict[str, Recomputed] = {}

    def run(mode: str) -> Recomputed:
        if mode not in runs:
            ir = lane_tmp / f"{mode}.ir"
            env = {"XLA_SAVE_TENSORS_FILE": str(ir), "XLA_SAVE_TENSORS_FMT": "text"}
            metrics = train(
                lane_tmp, f"xla-{mode}", cache, *NEURON, LR, f"parallelism.activation_checkpointing={mode}", env=env
            )
            text = "".join(p.read_text() for p in sorted(lane_tmp.glob(f"{ir.name}*")))
            runs[mode] = metrics, Counter(re.findall(r"\b(?:aten|xla)::(\w+)\(", text))
        return runs[mode]

    return run


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_on_xla_cpu_keeps_the_fp32_math(
    torch_fp32: dict[str, list[float]], recomputed: Callable[[str], Recomputed], mode: str
) -> None:
    """``parallelism.activation_checkpointing=selective`` (NxD wraps ``NeuronAttentionCore``) and ``full``
    (``NeuronBlock``), fp32 on XLA:CPU, equal the torch backend's fp32 run (no recomputation) to 1e-5 relative.

    Recomputing a forward does not change the math: measured, both modes give the neuron backend's ``none`` numbers
    to the bit, at most 3.2e-7 from the torch backend (XLA fuses and orders fp32 sums differently); 1e-5 is the fp32
    comparison's tolerance (``test_real_nxd.py``; ``none`` is its ``test_fp32_on_xla_cpu_equals_the_torch_backend``).

    Catches: a recomputation that differs from the forward it replaces (rotary tables, mask or upcast dtype not carried
    into the recompute), gradients counted twice (x2) or lost through the checkpoint wrapper, parameters of the
    wrapped modules left out of the optimizer, and at lr 3e-3 an optimizer config that NxD does not receive
    (beta2 1.1e-4, lr, weight decay). Also that NxD recomputes at all (see the next test).
    """
    nxd, ops = recomputed(mode)
    assert_close(nxd, torch_fp32, dict.fromkeys(KEYS, 1e-5))
    # Each attention's softmax ran twice per micro-batch (forward, and again in the backward), once without recompute.
    assert ops["optimization_barrier"] > 0, f"torch_xla's checkpoint did not run: {ops}"
    assert ops["softmax"] == 2 * ops["_softmax_backward_data"] > 0, f"attention not recomputed: {ops}"


def test_full_activation_checkpointing_recomputes_more_than_selective(recomputed: Callable[[str], Recomputed]) -> None:
    """``full`` recomputes whole blocks (their RMSNorms too), ``selective`` only the attention core.

    Counted in the traced IR of the two runs of the previous test: the same softmax count (attention recomputed in
    both), more ``rsqrt`` under ``full`` (measured 54 vs 30 over 3 steps x 2 micro-batches: the 4 block norms
    recomputed on top of the 5 forward ones). Catches ``RECOMPUTED`` mapping one mode onto the other's module class,
    which numerics cannot see (all modes give the same numbers).
    """
    (_, selective), (_, full) = recomputed("selective"), recomputed("full")
    assert full["softmax"] == selective["softmax"] > 0, (selective, full)
    assert full["rsqrt"] > selective["rsqrt"] > 0, (selective, full)
