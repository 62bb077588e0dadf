"""Trainer throughput: hlat's training step against Hugging Face ``LlamaForCausalLM`` of the same shape.

    python bench/trainer_vs_hf.py                        # model=small, 4 x 512 tokens, fp32 + bf16 (~20-30 min)
    python bench/trainer_vs_hf.py --quick                # smoke run (model=tiny, 2 x 64 tokens): don't quote it
    python bench/trainer_vs_hf.py --dtypes bf16 --rounds 3 --steps 2 --json /tmp/trainer_vs_hf.json
    python bench/trainer_vs_hf.py --device cuda --model <preset> --seq-len 2048 --batch 8   # on a GPU
    python bench/trainer_vs_hf.py --help                 # --warmup, --no-hf-compile, --hf-optimizer, ...

The question: is hlat's trainer at least as fast as HF transformers' ``LlamaForCausalLM`` of the same shape,
trained on the same batches on the same machine in the same process? Per dtype (``--dtypes``, hlat's
``precision=fp32`` and ``precision=bf16`` presets) four contenders are built once and then trained:

Rows (what each one measures):

- ``hlat eager``: what ``python train.py model=<model> precision=<dtype> train.seq_len=<T>
  train.micro_batch_size=<B> train.global_batch_size=<B>`` builds: the Hydra config composed from ``conf/``,
  ``TorchBackend(cfg)``, ``setup``, ``build_model`` (init in fp32, then cast to bf16 for ``precision=bf16``),
  ``build_optimizer`` over ``hlat.optim.param_groups`` (``torch.optim.AdamW(foreach=True)`` for fp32, hlat's
  ``PrecisionAdamW`` for bf16), trained by ``hlat.train.loop.fit``: lr schedule, forward, loss (fp32 cross-entropy for
  fp32, bf16 for ``precision=bf16``, as the presets say), backward, clip, AdamW step, ``zero_grad``. No logging or
  checkpoint hook; one hook keeps the loss tensor.
- ``hlat compiled``: the same with ``train.compile=true``: each transformer block's forward goes through
  ``torch.compile`` (``compile_blocks``, ``fullgraph``); embedding, head and loss stay eager.
- ``HF eager``: ``AutoModelForCausalLM.from_config(LlamaConfig(...), attn_implementation="sdpa")`` with hlat's
  shape (hidden, layers, heads, kv heads, intermediate, vocab, ``rms_norm_eps``, ``rope_theta``,
  ``max_position_embeddings``, untied embeddings, ``initializer_range`` = hlat's ``init_std``, ``use_cache=False``
  as for training), random init, cast to bf16 for ``bf16`` (pure bf16 parameters, like hlat's). ``torch.optim.AdamW``
  with hlat's lr, betas, eps, weight decay and parameter groups, ``fused=True`` by default (``--hf-optimizer``):
  what HF's ``Trainer`` uses by default with torch >= 2.8 (``optim="adamw_torch_fused"``); a ``LambdaLR`` running
  hlat's lr schedule; ``torch.nn.utils.clip_grad_norm_`` to hlat's clip. The loss is HF's own:
  ``model(input_ids=inputs, labels=targets, shift_labels=targets).loss``, i.e. ``ForCausalLMLoss`` (logits upcast
  to fp32, mean cross-entropy). ``shift_labels`` (what HF's padding-free collators pass) makes HF score exactly
  hlat's targets; plain ``labels=inputs`` would shift them and drop the last position of every row.
- ``HF compiled``: ``torch.compile(model)`` of that model (the whole forward, loss included); ``--no-hf-compile``
  skips it.

Same data: ``(inputs, targets)`` batches are drawn once from ``hlat.data.build_loader`` over the composed ``data``
config (the builtin corpus, hlat's sentencepiece tokenizer, trained and cached under ``data.cache_dir`` the first
time) and every contender trains on the identical tensors in the same order (its k-th step on batch k).

Timing: each contender first runs ``--warmup`` untimed steps (compilation happens here; the first step's time is
reported as "first step"; torch.compile starts from fresh on-disk caches unless ``--warm-compile-cache``). Then
``--rounds`` rounds: in each, every contender trains ``--steps`` steps in one timed block (the device is
synchronized at both ends on CUDA; CPU work is synchronous), and the order of the contenders rotates from round to
round, so a slow patch of a shared machine hits all of them alike. Reported per contender: median seconds/step over
rounds with min-max, tokens/s = batch x seq_len / median, MFU = tokens/s x ``hlat.track.metrics.flops_per_token``
(PaLM's 6N + 12·L·H·Q·T, non-causal: ``perf/mfu`` of a training run; the same shape, so the same number for both) / the
peak (on CPU this host's matmul peak from ``hlat.plan.peak.cached_peak``, measured and cached with
``measure_and_cache`` first if missing or with ``--measure-peak``; on CUDA ``resolve_peak_flops``'s published
figure), and the ratio hlat/HF of
tokens/s: eager vs eager, compiled vs compiled, hlat's best vs HF's best. torch uses as many threads as the process
has usable cores. The report is markdown to paste into bench/README.md.
"""

from __future__ import annotations

import argparse
import atexit
import datetime as dt
import functools
import gc
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hlat.backends.torch.backend import TorchBackend
from hlat.backends.torch.precision import DTYPE
from hlat.config import RunConfig, register_configs
from hlat.data import build_loader
from hlat.host import host_info
from hlat.optim import lr_at, param_groups
from hlat.parallel import ParallelDims
from hlat.plan.peak import cached_peak, measure_and_cache
from hlat.state import StepOutput, TrainState
from hlat.track.metrics import flops_per_token, resolve_peak_flops
from hlat.train.loop import fit

CONF = Path(__file__).resolve().parent.parent / "conf"
DTYPES = ("fp32", "bf16")
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Contender:
    """One trainer under test: ``train(batches)`` runs one optimizer step per batch and returns the losses."""

    trainer: str
    """``hlat`` or ``HF``."""
    compiled: bool
    dtype: str
    """hlat's precision preset: ``fp32`` or ``bf16``."""
    n_params: int
    train: Callable[[Sequence[Batch]], list[torch.Tensor]]
    sync: Callable[[], None]
    cursor: int = 0
    """Index of the next batch this contender trains on."""
    first_step_s: float = math.nan
    step_s: list[float] = field(default_factory=list)
    """Mean seconds per step of each timed round."""
    losses: list[torch.Tensor] = field(default_factory=list)
    graphs: int = 0
    """Graphs that torch.compile produced during this contender's warm-up."""
    graph_breaks: int = 0

    @property
    def label(self) -> str:
        """Row label, e.g. ``hlat compiled``."""
        return f"{self.trainer} {'compiled' if self.compiled else 'eager'}"

    def run(self, batches: Sequence[Batch], n: int) -> float:
        """Train ``n`` steps on this contender's next ``n`` batches; wall seconds, device synchronized."""
        chunk = batches[self.cursor : self.cursor + n]
        assert len(chunk) == n, "not enough batches drawn"
        self.cursor += n
        self.sync()
        t0 = time.perf_counter()
        self.losses += self.train(chunk)
        self.sync()
        return time.perf_counter() - t0


def compose_cfg(args: argparse.Namespace, dtype: str, compiled: bool) -> RunConfig:
    """The run config of ``python train.py model=<model> precision=<dtype> ...`` for this benchmark's shape."""
    overrides = [
        f"model={args.model}",
        f"precision={dtype}",
        f"cluster={'gpu_1x' if args.device == 'cuda' else 'cpu'}",
        f"train.seq_len={args.seq_len}",
        f"train.micro_batch_size={args.batch}",
        f"train.global_batch_size={args.batch}",
        f"train.compile={str(compiled).lower()}",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=overrides))


def draw_batches(cfg: RunConfig, n: int) -> list[Batch]:
    """``n`` training batches from hlat's loader over ``cfg.data`` (trains and caches the tokenizer if needed)."""
    t = cfg.train
    loader = build_loader(
        cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len, micro_batch_size=t.micro_batch_size, seed=t.seed
    )
    try:
        return [(x.clone(), y.clone()) for x, y in (next(loader) for _ in range(n))]
    finally:
        loader.close()


def build_hlat(cfg: RunConfig) -> Contender:
    """Backend, model and optimizer of hlat as ``train.py`` builds them, trained through ``hlat.train.loop.fit``."""
    backend = TorchBackend(cfg)
    env = backend.setup()
    dims = ParallelDims.build(cfg.parallelism, env.world_size, cfg.model, cfg.train)
    net = backend.build_model(dims)
    opt = backend.build_optimizer(net, param_groups(net, cfg.optimizer))
    state = TrainState()
    t = cfg.train
    lr_fn = functools.partial(lr_at, cfg=cfg.optimizer, total_steps=t.steps)

    def train(batches: Sequence[Batch]) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []

        def keep_loss(_: TrainState, out: StepOutput) -> None:
            losses.append(out.loss)

        fit(
            state,
            net,
            opt,
            iter(batches),
            backend,
            steps=state.step + len(batches),
            grad_accum=1,
            tokens_per_step=t.micro_batch_size * t.seq_len,
            lr_fn=lr_fn,
            hooks=[keep_loss],
        )
        return losses

    n_params = sum(p.numel() for p in net.parameters())
    return Contender("hlat", t.compile, cfg.precision.name, n_params, train, backend.synchronize)


def hf_config(cfg: RunConfig) -> Any:
    """A ``transformers.LlamaConfig`` with the shape, norm eps, rope theta and init scale of hlat's model."""
    from transformers import LlamaConfig

    m = cfg.model
    return LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.dim,
        intermediate_size=m.ffn_dim,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.kv_heads,
        head_dim=m.head_dim,
        hidden_act="silu",
        max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps,
        initializer_range=m.init_std,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        use_cache=False,
    )


def hf_optimizer(model: torch.nn.Module, cfg: RunConfig, kind: str) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` with hlat's hyperparameters and parameter groups; ``kind``: fused, foreach or for."""
    o = cfg.optimizer
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for": {"foreach": False}}[kind]
    return torch.optim.AdamW(
        param_groups(model, o), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, **impl
    )


def build_hf(cfg: RunConfig, compiled: bool, optimizer: str) -> Contender:
    """HF ``LlamaForCausalLM`` of hlat's shape, AdamW, clip and loop as an HF user writes them."""
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if cfg.cluster.device == "cuda" else "cpu")
    torch.manual_seed(cfg.train.seed)
    model = AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    model.to(device=device, dtype=DTYPE[cfg.precision.param_dtype]).train()
    opt = hf_optimizer(model, cfg, optimizer)
    o = cfg.optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, o, cfg.train.steps) / o.lr)
    fwd = torch.compile(model) if compiled else model
    params = list(model.parameters())

    def train(batches: Sequence[Batch]) -> list[torch.Tensor]:
        losses = []
        for inputs, targets in batches:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            loss = fwd(input_ids=inputs, labels=targets, shift_labels=targets).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, o.clip_grad_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return losses

    sync = functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else lambda: None
    return Contender("HF", compiled, cfg.precision.name, sum(p.numel() for p in params), train, sync)


def _dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process, from dynamo's counters."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0)), sum(counters["graph_break"].values())


def warm_up(c: Contender, batches: Sequence[Batch], steps: int) -> None:
    """The untimed steps before the first round: the first one timed on its own (compilation), then the rest."""
    graphs, breaks = _dynamo_counts()
    c.first_step_s = c.run(batches, 1)
    if steps > 1:
        c.run(batches, steps - 1)
    after = _dynamo_counts()
    c.graphs, c.graph_breaks = after[0] - graphs, after[1] - breaks


def measure(contenders: list[Contender], batches: Sequence[Batch], args: argparse.Namespace) -> None:
    """Warm every contender up, then run the timed rounds, rotating the order each round."""
    for c in contenders:
        print(f"  warm-up {c.dtype} {c.label} ...", file=sys.stderr, flush=True)
        warm_up(c, batches, args.warmup)
    n = len(contenders)
    for r in range(args.rounds):
        order = contenders[r % n :] + contenders[: r % n]
        for c in order:
            c.step_s.append(c.run(batches, args.steps) / args.steps)
        done = ", ".join(f"{c.label} {c.step_s[-1]:.3f} s/step" for c in contenders)
        print(f"  round {r + 1}/{args.rounds} ({contenders[0].dtype}): {done}", file=sys.stderr, flush=True)


def build_contenders(args: argparse.Namespace, cfg: RunConfig) -> list[Contender]:
    """The hlat eager/compiled and HF eager(/compiled) contenders of ``cfg``'s dtype (``cfg``: hlat eager's)."""
    dtype = cfg.precision.name
    contenders = [
        build_hlat(cfg),
        build_hlat(compose_cfg(args, dtype, compiled=True)),
        build_hf(cfg, compiled=False, optimizer=args.hf_optimizer),
    ]
    if args.hf_compile:
        contenders.append(build_hf(cfg, compiled=True, optimizer=args.hf_optimizer))
    counts = {c.label: c.n_params for c in contenders}
    print(f"  {dtype} parameters: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()), file=sys.stderr)
    if len(set(counts.values())) != 1:
        raise SystemExit(f"hlat and HF models differ in size: {counts}")
    return contenders


_MEASURED: dict[str, float] = {}
"""Peaks (FLOP/s by dtype name) measured by this process, all dtypes at once."""


def peak_flops(cfg: RunConfig, remeasure: bool) -> tuple[float | None, str]:
    """The MFU denominator for ``cfg``'s compute dtype and where it comes from (measured now if not cached).

    On CPU, ``remeasure`` measures (and caches) the peak even when one is cached.
    """
    dtype = cfg.precision.compute_dtype
    if cfg.cluster.device != "cpu":
        return resolve_peak_flops(cfg.cluster, dtype, cfg.data.cache_dir)
    measured_now = f"{dtype} matmul peak measured in this run by `hlat.plan.peak.measure_and_cache` (and cached)"
    if dtype in _MEASURED:  # measure_and_cache measures every dtype at once
        return _MEASURED[dtype], measured_now
    flops = None if remeasure else cached_peak(dtype, cfg.data.cache_dir)
    if flops is not None:
        return flops, f"cached `hlat.plan.peak` {dtype} matmul peak"
    print(f"  measuring this host's matmul peak into {cfg.data.cache_dir} ...", file=sys.stderr, flush=True)
    _MEASURED.update(measure_and_cache(cfg.data.cache_dir))
    return _MEASURED[dtype], measured_now


def summarize(
    cfg: RunConfig, contenders: list[Contender], args: argparse.Namespace, peak: tuple[float | None, str]
) -> dict[str, Any]:
    """Per-dtype results: the rows of the table, the ratios and the MFU denominator ``peak`` (FLOP/s, source)."""
    m = cfg.model
    fpt = flops_per_token(contenders[0].n_params, m.vocab_size * m.dim, m.n_layers, m.n_heads, m.head_dim, args.seq_len)
    peak, peak_source = peak
    tokens = args.batch * args.seq_len
    rows = []
    for c in contenders:
        med = statistics.median(c.step_s)
        losses = [float(x) for x in torch.stack(c.losses).float().cpu()]
        rows.append(
            {
                "dtype": c.dtype,
                "trainer": c.trainer,
                "compiled": c.compiled,
                "label": c.label,
                "params": c.n_params,
                "step_s_median": med,
                "step_s_min": min(c.step_s),
                "step_s_max": max(c.step_s),
                "step_s_rounds": c.step_s,
                "tokens_per_s": tokens / med,
                "mfu": tokens / med * fpt / peak if peak else None,
                "first_step_s": c.first_step_s,
                "loss_first": losses[0],
                "loss_last": losses[-1],
                "graphs": c.graphs,
                "graph_breaks": c.graph_breaks,
            }
        )
    rate = {r["label"]: r["tokens_per_s"] for r in rows}
    ratios = {"eager": rate["hlat eager"] / rate["HF eager"]}
    if "HF compiled" in rate:
        ratios["compiled"] = rate["hlat compiled"] / rate["HF compiled"]
    best = {t: max(v for k, v in rate.items() if k.startswith(t)) for t in ("hlat", "HF")}
    ratios["best"] = best["hlat"] / best["HF"]
    return {
        "dtype": cfg.precision.name,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "peak_source": peak_source,
        "rows": rows,
        "ratios": ratios,
    }


def run_dtype(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """Build, draw the batches, measure and summarize one dtype; the models are freed afterwards."""
    cfg = compose_cfg(args, dtype, compiled=False)
    # Before any model exists, so a measurement runs alone; --measure-peak measures once, for the first dtype.
    peak = peak_flops(cfg, args.measure_peak and dtype == args.dtypes[0])
    batches = draw_batches(cfg, args.warmup + args.rounds * args.steps)
    contenders = build_contenders(args, cfg)
    measure(contenders, batches, args)
    out = summarize(cfg, contenders, args, peak)
    out["ln_vocab"] = math.log(cfg.model.vocab_size)
    keys = ("name", "dim", "n_layers", "n_heads", "kv_heads", "ffn_dim", "vocab_size", "norm_eps", "rope_theta")
    out["model"] = {k: getattr(cfg.model, k) for k in keys}
    del contenders
    gc.collect()
    return out


def _versions() -> str:
    """Python and the packages that decide the numbers."""
    parts = [f"python {platform.python_version()}"]
    for name in ("torch", "transformers", "hlat"):
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} (not installed)")
    return ", ".join(parts)


def _fmt_rate(x: float) -> str:
    """Tokens/s with a thousands separator."""
    return f"{x:,.0f}"


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table of every contender of every dtype."""
    lines = [
        "| dtype | trainer | s/step (median) | range (min-max) | tokens/s | MFU | first step (s) | loss first -> last "
        "| compiled graphs / breaks |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for r in res["rows"]:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
            graphs = f"{r['graphs']} / {r['graph_breaks']}" if r["compiled"] else "-"
            lines.append(
                f"| {r['dtype']} | {r['label']} | {r['step_s_median']:.3f} | {r['step_s_min']:.3f}-"
                f"{r['step_s_max']:.3f} | {_fmt_rate(r['tokens_per_s'])} | {mfu} | {r['first_step_s']:.1f} | "
                f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} | {graphs} |"
            )
    return "\n".join(lines)


def ratio_table(results: list[dict[str, Any]]) -> str:
    """hlat/HF tokens/s per dtype: eager vs eager, compiled vs compiled, best vs best."""
    lines = ["| dtype | eager: hlat / HF | compiled: hlat / HF | best hlat / best HF |", "|---|---:|---:|---:|"]
    for res in results:
        q = res["ratios"]
        compiled = f"{q['compiled']:.2f}x" if "compiled" in q else "-"
        lines.append(f"| {res['dtype']} | {q['eager']:.2f}x | {compiled} | **{q['best']:.2f}x** |")
    return "\n".join(lines)


def checks(results: list[dict[str, Any]]) -> list[str]:
    """Report lines on the sanity checks: equal parameter counts and first losses near ln(vocab)."""
    lines = []
    for res in results:
        rows = res["rows"]
        params = {r["label"]: r["params"] for r in rows}
        firsts = ", ".join(f"{r['label']} {r['loss_first']:.3f}" for r in rows)
        near = all(abs(r["loss_first"] - res["ln_vocab"]) < 0.5 for r in rows)
        lines.append(
            f"- {res['dtype']}: parameters hlat {params['hlat eager']:,}, HF {params['HF eager']:,} "
            f"({'equal' if len(set(params.values())) == 1 else 'DIFFERENT'}); first loss {firsts} "
            f"(ln {res['model']['vocab_size']} = {res['ln_vocab']:.3f}: {'ok' if near else 'CHECK: more than 0.5 off'})"
        )
    return lines


def report(
    results: list[dict[str, Any]],
    args: argparse.Namespace,
    started: dt.datetime,
    loads: tuple[tuple[float, ...], tuple[float, ...]],
    wall_s: float,
) -> str:
    """The markdown report to paste into bench/README.md."""
    host, m = host_info(), results[0]["model"]
    kv = f", {m['kv_heads']} kv heads" if m["kv_heads"] != m["n_heads"] else ""
    start, end = ("/".join(f"{x:.2f}" for x in load) for load in loads)
    peaks = "; ".join(
        f"{r['dtype']}: {r['peak_flops'] / 1e9:.1f} GFLOP/s ({r['peak_source']})"
        if r["peak_flops"]
        else f"{r['dtype']}: none ({r['peak_source']})"
        for r in results
    )
    lines = [
        f"## Trainer throughput: hlat vs HF `LlamaForCausalLM` ({started:%Y-%m-%d %H:%M} UTC)\n",
        f"- command: `{' '.join(shlex.quote(a) for a in ['python', 'bench/trainer_vs_hf.py', *sys.argv[1:]])}`"
        + (" (**--quick: smoke run, don't quote these numbers**)" if args.quick else ""),
        f"- machine: {host['cpu']}, {host['cores']} usable cores, torch threads {host['threads']}, "
        f"{platform.system()} {platform.release()}; device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""),
        f"- versions: {_versions()}",
        f"- model: hlat `model={m['name']}`: dim {m['dim']}, {m['n_layers']} layers, {m['n_heads']} heads{kv}, "
        f"ffn {m['ffn_dim']}, vocab {m['vocab_size']}, rms eps {m['norm_eps']:g}, rope theta {m['rope_theta']:g}, "
        "untied embeddings",
        f"- data: hlat's loader over `data={args.data_name}`, micro-batch {args.batch} x {args.seq_len} tokens, one "
        f"micro-batch per step; every contender trains on the same batches. {args.warmup} untimed warm-up step(s) "
        f"per contender, then {args.rounds} round(s) x {args.steps} timed step(s), interleaved, order rotated",
        f"- HF: sdpa attention, `torch.optim.AdamW({args.hf_optimizer})`, `clip_grad_norm_`, loss from "
        f"`labels`/`shift_labels`; {'`torch.compile(model)`' if args.hf_compile else 'not compiled (--no-hf-compile)'}",
        "- torch.compile caches: "
        + ("the user's (warm: --warm-compile-cache)" if args.warm_compile_cache else "fresh (cold compiles)"),
        f"- FLOPs/token (PaLM, non-causal): {results[0]['flops_per_token']:.4g}; MFU peak: {peaks}",
        *checks(results),
        f"- load average (1/5/15 min) at start {start}, at end {end}",
        f"- wall time {wall_s:.0f} s\n",
        table(results),
        "\n### hlat / HF tokens/s\n",
        ratio_table(results),
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line; ``--quick`` fills in tiny defaults for whatever was not given."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="hlat model preset (conf/model; default small, quick tiny)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 512, quick 64)")
    ap.add_argument("--batch", type=int, default=None, help="micro-batch = global batch (default 4, quick 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per contender and round (default 3, quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per contender first (default 2, quick 1)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timed rounds (default 5, quick 2)")
    ap.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="hlat precision presets")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda composes cluster=gpu_1x")
    ap.add_argument("--no-hf-compile", dest="hf_compile", action="store_false", help="skip the HF compiled row")
    ap.add_argument(
        "--hf-optimizer",
        choices=("fused", "foreach", "for"),
        default="fused",
        help="the HF side's torch.optim.AdamW kind (default fused: HF Trainer's default)",
    )
    ap.add_argument(
        "--measure-peak",
        action="store_true",
        help="measure and cache this host's matmul peak now instead of using the cached one",
    )
    ap.add_argument(
        "--warm-compile-cache",
        action="store_true",
        help="keep torch.compile's on-disk caches (default: fresh ones, cold compiles)",
    )
    ap.add_argument("--quick", action="store_true", help="smoke run with tiny sizes; don't quote its numbers")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = ap.parse_args(argv)
    full, quick = (
        {"model": "small", "seq_len": 512, "batch": 4, "steps": 3, "warmup": 2, "rounds": 5},
        {"model": "tiny", "seq_len": 64, "batch": 2, "steps": 2, "warmup": 1, "rounds": 2},
    )
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.seq_len, args.batch, args.steps, args.warmup, args.rounds) < 1:
        ap.error("--seq-len, --batch, --steps, --warmup and --rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the markdown report.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status, 0.
    """
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    if not args.warm_compile_cache:  # a cold compile every run: "first step" then means the same thing each time
        cache = tempfile.mkdtemp(prefix="hlat-bench-inductor-")
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"] = cache, os.path.join(cache, "triton")
    register_configs()
    args.data_name = compose_cfg(args, args.dtypes[0], compiled=False).data.name
    started, wall, load_start = dt.datetime.now(dt.timezone.utc), time.perf_counter(), os.getloadavg()
    results = [run_dtype(args, dtype) for dtype in args.dtypes]
    text = report(results, args, started, (load_start, os.getloadavg()), time.perf_counter() - wall)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps({"argv": sys.argv[1:], "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
