"""The schema of a data mixture: ``data.mix`` (named sources and their weights) and ``data.stages`` (schedules).

``data.mix`` and ``data.stages`` are typed ``dict[str, Any]`` for Hydra, so that a whole source can be given on the
command line (``++data.mix.code={path: ..., weight: 0.3}``: OmegaConf cannot assign a mapping to a dict of
dataclasses); :func:`check_mix` turns each entry into a :class:`MixSourceConfig` or :class:`MixStageConfig` when the
config is validated, refusing unknown keys and bad values with the key to fix. ``data.mix_file`` is merged into
``data.mix`` there too, so the validated config lists every source.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hlat.config.base import ConfigError, _check, _Frozen, show

NAME = re.compile(r"^[A-Za-z0-9_-]+$")
"""A source's or stage's name: it is part of metric names (``data/mix/<source>/tokens``) and config keys."""
STARTS = ("start", "start_tokens", "start_fraction")
"""The ways a stage says where it starts: a step, a number of trained tokens, a fraction of ``train.steps``."""


@dataclass
class MixSourceConfig(_Frozen):
    """One named source of ``data.mix``: where its documents are and its share of the trained tokens."""

    path: str | None = None
    """Arrow IPC / Parquet / JSONL file or directory (as ``data.path``), or ``builtin``, ``builtin:topics``,
    ``builtin:docstrings`` (the builtin corpus or one of its two parts)."""
    weight: float | None = None
    """Relative share of trained tokens before the first stage (normalized over the sources); 0: not trained now."""
    text_column: str | None = None
    """The column holding the documents; null means ``data.text_column``."""
    max_epochs: float | None = None
    """Most passes over this source's documents the run may make (refused before step 0 if the plan needs more)."""

    def __post_init__(self) -> None:
        self._freeze()


@dataclass
class MixStageConfig(_Frozen):
    """One stage of ``data.stages``: from where on which weights apply (exactly one of the three starts)."""

    start: int | None = None
    """The step after which the stage trains (its first batch is step ``start + 1``'s)."""
    start_tokens: int | None = None
    """The stage starts once this many tokens are trained (rounded down to a step)."""
    start_fraction: float | None = None
    """The stage starts at this fraction of ``train.steps`` (rounded down to a step)."""
    weights: dict[str, float] = field(default_factory=dict)
    """Relative shares of the sources in the stage; a source left out gets 0."""

    def __post_init__(self) -> None:
        self._freeze()


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _entry(cls: type, key: str, value: Any) -> Any:
    """``value`` (a mapping, or already a ``cls``) as a ``cls``, refusing keys it lacks with the closest one."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        fields = ", ".join(_fields(cls))
        raise ConfigError(f"{key} is {show(value)}, not a mapping; give it as {{{fields}}}, e.g. {key}={_example(cls)}")
    for name in value:
        if name not in _fields(cls):
            from hlat.config.suggest import closest

            near = closest(str(name), _fields(cls))
            hint = f"; did you mean {key}.{near}?" if near else f" (its keys: {', '.join(_fields(cls))})"
            raise ConfigError(f"{key}.{name} is not a key of a {_what(cls)}{hint}")
    return cls(**value)


def _what(cls: type) -> str:
    return "data.mix source" if cls is MixSourceConfig else "data.stages stage"


def _example(cls: type) -> str:
    return "{path: data/code, weight: 0.3}" if cls is MixSourceConfig else "{start: 1000, weights: {code: 0.5}}"


def _number(key: str, value: Any, rule: str, fix: str) -> float:
    """``value`` as a float satisfying ``rule`` (``>= 0``, ``> 0``, ``[0, 1)``), else a ConfigError naming ``key``."""
    from hlat.config.base import within

    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not within(float(value), rule):
        raise ConfigError(f"{key}={show(value)} must be a number {rule}; {fix}")
    return float(value)


def read_mix_file(path: str) -> dict[str, Any]:
    """The sources of ``data.mix_file``: a YAML mapping ``{name: {path, weight, ...}}`` (or under a ``mix:`` key)."""
    import yaml

    file = Path(path).expanduser()
    try:
        loaded = yaml.safe_load(file.read_text())
    except OSError as e:
        raise ConfigError(f"data.mix_file={path} cannot be read ({e.strerror or e}); point it at a YAML file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"data.mix_file={path} is not valid YAML ({str(e).splitlines()[0]}); fix the file") from None
    if isinstance(loaded, dict) and set(loaded) == {"mix"}:
        loaded = loaded["mix"]
    if not isinstance(loaded, dict) or not loaded:
        raise ConfigError(
            f"data.mix_file={path} holds no mapping of sources; write one source a line, e.g. "
            "`code: {path: data/code, weight: 0.3}`"
        )
    return loaded


def merge_sources(from_file: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``data.mix_file``'s sources, each updated with what ``data.mix`` sets for it (the command line wins)."""
    merged = {name: dict(v) if isinstance(v, dict) else v for name, v in from_file.items()}
    for name, value in given.items():
        if isinstance(value, MixSourceConfig):
            value = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
        if isinstance(merged.get(name), dict) and isinstance(value, dict):
            merged[name] = {**merged[name], **value}
        else:
            merged[name] = value
    return merged


def check_sources(raw: dict[str, Any]) -> dict[str, MixSourceConfig]:
    """``data.mix`` as typed sources, each checked; in name order (the order of every per-source table)."""
    out: dict[str, MixSourceConfig] = {}
    for name in sorted(raw, key=str):
        key = f"data.mix.{name}"
        _check(
            bool(NAME.match(str(name))),
            f"{key}: a source's name is made of letters, digits, '_' and '-' (it names metrics such as "
            f"data/mix/<source>/tokens); rename it",
        )
        src = _entry(MixSourceConfig, key, raw[name])
        _check(
            bool(src.path),
            f"{key}.path is not set; give the source's data, e.g. {key}={{path: data/{name}, weight: 0.3}}",
        )
        _check(src.weight is not None, f"{key}.weight is not set; give the source a weight, e.g. {key}.weight=0.3")
        weight = _number(f"{key}.weight", src.weight, ">= 0", "weights are relative shares (0: not trained now)")
        epochs = src.max_epochs
        if epochs is not None:
            epochs = _number(f"{key}.max_epochs", epochs, "> 0", "set the most passes allowed, or null for no cap")
        column = src.text_column
        _check(column is None or bool(column), f"{key}.text_column is empty; set it or null for data.text_column")
        out[str(name)] = MixSourceConfig(path=str(src.path), weight=weight, text_column=column, max_epochs=epochs)
    return out


def check_stages(raw: dict[str, Any], sources: dict[str, MixSourceConfig]) -> dict[str, MixStageConfig]:
    """``data.stages`` as typed stages: exactly one start each, weights of declared sources only."""
    from hlat.config.suggest import closest

    out: dict[str, MixStageConfig] = {}
    for name in sorted(raw, key=str):
        key = f"data.stages.{name}"
        _check(bool(NAME.match(str(name))), f"{key}: a stage's name is made of letters, digits, '_' and '-'; rename it")
        stage = _entry(MixStageConfig, key, raw[name])
        given = [s for s in STARTS if getattr(stage, s) is not None]
        _check(
            len(given) == 1,
            f"{key} sets {' and '.join(given) or 'no start'}: set exactly one of {key}.start (a step), "
            f"{key}.start_tokens or {key}.start_fraction (of train.steps)",
        )
        start = getattr(stage, given[0])
        rule = "[0, 1)" if given[0] == "start_fraction" else ">= 0"
        start = _number(f"{key}.{given[0]}", start, rule, "a stage starts at or after the run's beginning")
        _check(
            given[0] == "start_fraction" or start == int(start),
            f"{key}.{given[0]}={show(getattr(stage, given[0]))} is not a whole number; give a whole {given[0]}",
        )
        weights = stage.weights
        _check(isinstance(weights, dict), f"{key}.weights must map sources to weights, e.g. {{code: 0.5, web: 0.5}}")
        checked: dict[str, float] = {}
        for source, w in weights.items():
            if source not in sources:
                near = closest(str(source), sources)
                hint = f"did you mean {near}?" if near else f"the sources are {', '.join(sources)}"
                raise ConfigError(f"{key}.weights.{source}: data.mix has no source {source!r}; {hint}")
            checked[str(source)] = _number(f"{key}.weights.{source}", w, ">= 0", "weights are relative shares")
        _check(
            any(checked.values()),
            f"{key}.weights gives no source a positive weight; a stage trains on at least one source",
        )
        value = int(start) if given[0] != "start_fraction" else start
        out[str(name)] = MixStageConfig(**{given[0]: value}, weights=dict(sorted(checked.items())))
    return out


def stage_start(stage: MixStageConfig, steps: int, tokens_per_step: int) -> int:
    """The step after which ``stage`` trains: ``start``, or its tokens or fraction of ``train.steps``, rounded down."""
    if stage.start is not None:
        return int(stage.start)
    if stage.start_tokens is not None:
        return int(stage.start_tokens) // tokens_per_step
    return int(float(stage.start_fraction or 0.0) * steps)


def check_schedule(
    sources: dict[str, MixSourceConfig], stages: dict[str, MixStageConfig], steps: int, tokens_per_step: int
) -> None:
    """Refuse two stages that start at the same step, and a mix whose first weights train nothing."""
    starts: dict[int, str] = {}
    for name, stage in stages.items():
        at = stage_start(stage, steps, tokens_per_step)
        if at in starts:
            raise ConfigError(
                f"data.stages.{starts[at]} and data.stages.{name} both start at step {at}; give them different starts "
                "(or merge them into one stage)"
            )
        starts[at] = name
    if 0 not in starts and not any(s.weight for s in sources.values()):
        raise ConfigError(
            "every data.mix.<source>.weight is 0, and no stage starts at step 0: the first steps would train on "
            "nothing; give a source a positive weight (e.g. data.mix.<source>.weight=1)"
        )
