"""A mixture from the config: its sources opened, its schedule resolved, its plan checked before step 0.

The plan estimates each source's tokens (characters x tokens per character, measured with the run's tokenizer on
a strided sample) and the windows the schedule gives it over ``train.steps``: the epochs each source is planned to
make. A source planned beyond its ``max_epochs`` is refused before anything trains; the cap is then enforced
exactly as the run reads (``hlat.data.mixture``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hlat.config import ConfigError, DataConfig
from hlat.config.mix import MixStageConfig, stage_start
from hlat.data.builtin import PARTS, builtin_corpus_path
from hlat.data.schedule import BASE, Cursor, Schedule, Stage, normalized
from hlat.data.sources import TextSource
from hlat.data.tokenizer import MAX_TRAIN_CHARS, Tokenizer

log = logging.getLogger(__name__)

BUILTIN = "builtin"
"""A source path naming the builtin corpus (``builtin``) or one of its parts (``builtin:topics``)."""
SAMPLE_CHARS = 2_000_000
"""Characters of all sources together that the plan tokenizes to estimate their tokens per character."""


def source_path(name: str, path: str, cache_dir: Path) -> Path:
    """The data of source ``name``: ``path`` itself, or the builtin corpus (or a part) it names."""
    kind, _, part = path.partition(":")
    if kind != BUILTIN:
        return Path(path).expanduser()
    if part and part not in PARTS:
        raise ConfigError(
            f"data.mix.{name}.path={path}: the builtin corpus has the parts {', '.join(PARTS)}; use "
            f"{', '.join(f'{BUILTIN}:{p}' for p in PARTS)} or {BUILTIN} (the whole corpus)"
        )
    return builtin_corpus_path(cache_dir, part or None)


def open_sources(cfg: DataConfig) -> dict[str, TextSource]:
    """Every source of ``data.mix``, by name; a bad path or column is refused naming the source's key."""
    cache_dir = Path(cfg.cache_dir).expanduser()
    out = {}
    for name, src in cfg.mix.items():
        column = src.text_column or cfg.text_column
        try:
            out[name] = TextSource(source_path(name, src.path, cache_dir), column, cache_dir)
        except ConfigError as e:  # the single-source messages name data.path / data.text_column
            text = str(e).replace("data.path", f"data.mix.{name}.path")
            raise ConfigError(text.replace("data.text_column", f"data.mix.{name}.text_column")) from None
    return out


def mixture_sample(sources: list[TextSource]) -> list[str]:
    """A tokenizer's training sample: every source's rows at one even stride, at most ~MAX_TRAIN_CHARS in all.

    Independent of the weights (the children of a sweep over them share a tokenizer); for one source it is
    ``hlat.data.loader.tokenizer_sample``'s.
    """
    from hlat.data.loader import tokenizer_sample

    stride = max(1, math.ceil(sum(s.total_chars() for s in sources) / MAX_TRAIN_CHARS))
    return [doc for s in sources for doc in tokenizer_sample(s, stride)]


def config_stages(cfg: DataConfig, steps: int, tokens_per_step: int) -> list[Stage]:
    """The stages the config asks for, by start: the ``data.mix`` weights first, unless a stage starts at step 0."""
    stages = [_stage(name, st, steps, tokens_per_step) for name, st in cfg.stages.items()]
    weights = {name: float(src.weight or 0.0) for name, src in cfg.mix.items()}
    if not any(s.start == 0 for s in stages):
        stages.append(Stage(BASE, 0, normalized(weights), weights, "start", 0))
    return sorted(stages, key=lambda s: s.start)


def _stage(name: str, st: MixStageConfig, steps: int, tokens_per_step: int) -> Stage:
    key = next(k for k in ("start", "start_tokens", "start_fraction") if getattr(st, k) is not None)
    return Stage(
        name, stage_start(st, steps, tokens_per_step), normalized(st.weights), dict(st.weights), key, getattr(st, key)
    )


def schedule(names: tuple[str, ...], stages: list[Stage], global_batch_size: int, seed: int) -> Schedule:
    """The schedule of ``stages`` over the sources ``names`` (sorted)."""
    return Schedule(names, tuple(stages), global_batch_size, seed)


@dataclass
class Plan:
    """The planned windows, tokens and epochs of every source over the run (``mixture_plan.json``)."""

    rows: dict[str, dict[str, Any]]
    """Per source: rows, estimated tokens, tokens per character, planned windows, tokens and epochs, cap."""
    stages: list[dict[str, Any]]
    """Per stage: name, first step, steps, fractions, weights."""

    def table(self) -> str:
        """The plan as a text table, one line a source."""
        lines = [f"{'source':<20} {'rows':>10} {'est. tokens':>14} {'planned tokens':>15} {'epochs':>7} {'cap':>6}"]
        for name, r in self.rows.items():
            cap = "-" if r["max_epochs"] is None else f"{r['max_epochs']:g}"
            lines.append(
                f"{name:<20} {r['rows']:>10,} {r['estimated_tokens']:>14,} {r['planned_tokens']:>15,} "
                f"{r['planned_epochs']:>7.2f} {cap:>6}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for the artifact."""
        return {"sources": self.rows, "stages": self.stages}


def estimate_tokens(sources: dict[str, TextSource], tokenizer: Tokenizer) -> dict[str, tuple[int, float]]:
    """Each source's estimated tokens (EOS included) and the tokens per character measured on its sample.

    The samples (rows at an even stride, ~SAMPLE_CHARS of all sources together, at least 2 KB each) go to the
    tokenizer in one call.
    """
    budget = max(2048, SAMPLE_CHARS // max(1, len(sources)))
    samples, chars = {}, {}
    for name, source in sources.items():
        chars[name] = source.total_chars()
        stride = max(1, math.ceil(chars[name] / budget))
        samples[name] = [d for d in source.get(np.arange(0, len(source), stride)) if d is not None]
    encoded = iter(tokenizer.encode([d for docs in samples.values() for d in docs]))
    out = {}
    for name, docs in samples.items():
        tokens = sum(len(next(encoded)) for _ in docs)
        per_char = tokens / max(1, sum(len(d) for d in docs)) if docs else 0.0
        rows = len(sources[name]) - sources[name].column.null_count
        out[name] = (int(chars[name] * per_char) + rows, per_char)
    return out


def make_plan(
    sched: Schedule,
    at: Cursor,
    sources: dict[str, TextSource],
    caps: dict[str, float | None],
    tokenizer: Tokenizer,
    steps: int,
    seq_len: int,
) -> Plan:
    """The windows every source gets from ``at`` to ``train.steps`` (by the stages' shares), and its epochs."""
    planned = at.counts.astype(np.float64).copy()
    g = sched.global_batch_size
    stages = []
    for i, stage in enumerate(sched.stages):
        end = sched.stages[i + 1].start if i + 1 < len(sched.stages) else steps
        lo, hi = max(stage.start, at.batch), max(min(end, steps), at.batch)
        planned += sched.fractions(i) * g * max(0, hi - lo)
        stages.append(
            {
                "name": stage.name or "data.mix",
                "start_step": stage.start,
                "steps": max(0, min(end, steps) - stage.start),
                "fractions": stage.fractions,
                "weights": stage.weights,
            }
        )
    estimates = estimate_tokens(sources, tokenizer)
    rows = {}
    for m, name in enumerate(sched.names):
        tokens, per_char = estimates[name]
        windows = int(np.rint(planned[m]))
        rows[name] = {
            "rows": len(sources[name]),
            "estimated_tokens": tokens,
            "tokens_per_char": round(per_char, 4),
            "planned_windows": windows,
            "planned_tokens": windows * seq_len,
            "planned_epochs": windows * seq_len / tokens if tokens else 0.0,
            "max_epochs": caps[name],
            "fraction": sched.fractions(sched.stage_at(0))[m],
        }
    return Plan(rows, stages)


def check_plan(plan: Plan) -> None:
    """Refuse a source the plan reads more often than its ``data.mix.<source>.max_epochs`` allows."""
    for name, r in plan.rows.items():
        if r["max_epochs"] is not None and r["planned_epochs"] > r["max_epochs"]:
            raise ConfigError(
                f"data.mix.{name}.max_epochs={r['max_epochs']:g}: the mix plans about {r['planned_epochs']:.2f} "
                f"epochs of source {name!r} over train.steps ({r['planned_tokens']:,} tokens planned of about "
                f"{r['estimated_tokens']:,} in its {r['rows']:,} rows, estimated at {r['tokens_per_char']:.3f} tokens "
                f"per character on a strided sample with the run's tokenizer); lower data.mix.{name}.weight (or its "
                f"stage weights), raise data.mix.{name}.max_epochs, or add data to the source"
            )
