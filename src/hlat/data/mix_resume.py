"""Resuming a mixture with its config edited: the past is kept exactly, the future may change.

The schedule up to the checkpoint's batch ``k`` is what the run trained on: the stages that began before ``k`` and
their weights must read the same in the config (else the key, the saved value and the ways on are named), and they
continue with the saved values. Stages from ``k`` on, new sources (read from their first document) and sources gone
from the config (whose weight is 0 from ``k`` on; their position is kept, so they can come back) are accepted: the
run's ``data.mix_revision`` counts such edits. A source that has been read must keep its data.
"""

from __future__ import annotations

from dataclasses import dataclass

from hlat.config import ConfigError
from hlat.config.base import show
from hlat.data.identity import describe_change
from hlat.data.schedule import BASE, Stage

SAME = 1e-9
"""Normalized shares closer than this are the same weights (a weight written another way: 1 and 1.0, 0.5 and 1/2)."""
CHECKPOINT = "<the checkpoint>"
"""Stands for the checkpoint in messages (``hlat.train.resume.restore`` puts in its path), as the loader's does."""


@dataclass
class Resumed:
    """The schedule a resumed mixture continues with, and whether its future differs from the saved run's."""

    past: list[Stage]
    """The stages that began before the checkpoint's batch, as saved (the last one is current)."""
    future: list[Stage]
    """The config's stages from that batch on."""
    edited: list[str]
    """What the config changes from that batch on, in words (empty: the same run)."""


def _ways(k: int) -> str:
    return (
        f"restore it; or change the mix from step {k} on with a stage there (data.stages.<name>={{start: {k}, "
        f"weights: {{...}}}}); or start a new run from the checkpoint's weights (train.init_from={CHECKPOINT})"
    )


def _share(stage: Stage, name: str, present: set[str]) -> float:
    """``name``'s share in ``stage`` among the sources in ``present`` only (others removed from the config)."""
    total = sum(f for n, f in stage.fractions.items() if n in present)
    return stage.fractions.get(name, 0.0) / total if total else 0.0


def _weight(stage: Stage, name: str) -> str:
    return show(stage.weights.get(name, 0.0 if name in stage.fractions else "unset (not in the mix)"))


def compare_past(saved: list[Stage], config: list[Stage], sources: set[str], k: int) -> None:
    """Refuse a config whose stages before batch ``k`` differ from the ``saved`` ones (the key, the saved value)."""
    before = [s for s in config if s.start < k]
    by_name = {s.name: s for s in before}
    for old in saved:
        new = by_name.get(old.name)
        if new is None:
            moved = next((s for s in config if s.name == old.name), None)
            if old.name == BASE:
                what = f"a stage starting at step 0 replaces the data.mix weights that trained steps 1-{k}"
            elif moved is None:
                what = f"data.stages.{old.name} is gone, and it trained from step {old.start + 1}"
            else:
                what = f"{moved.start_config}={show(moved.start_value)} moves it to step {moved.start + 1}"
            raise ConfigError(
                f"cannot resume the data mix at step {k}: {what} (it began after step {old.start}, before the "
                f"checkpoint); the past of a mix cannot change: {_ways(k)}"
            )
        if new.start != old.start:
            raise ConfigError(
                f"cannot resume the data mix at step {k}: {new.start_config}={show(new.start_value)} starts the stage "
                f"after step {new.start}, it began after step {old.start}; restore {old.start_config}="
                f"{show(old.start_value)}, or {_ways(k)}"
            )
        present = sources & (set(old.fractions) | set(new.fractions))
        for name in sorted(present):
            if abs(_share(old, name, present) - new.fractions.get(name, 0.0)) > SAME:
                raise ConfigError(
                    f"cannot resume the data mix at step {k}: {old.key(name)} was {_weight(old, name)} for steps "
                    f"{old.start + 1}-{k} (a {_share(old, name, present):.4g} share), is {_weight(new, name)} now (a "
                    f"{new.fractions.get(name, 0.0):.4g} share); a stage already trained keeps its weights: "
                    f"{_ways(k)}"
                )
    extra = [s for s in before if s.name not in {o.name for o in saved}]
    if extra:
        s = extra[0]
        raise ConfigError(
            f"cannot resume the data mix at step {k}: {s.start_config}={show(s.start_value)} starts a stage after "
            f"step {s.start}, before the checkpoint, where the run trained another mix; give it a start at step {k} "
            f"or later, or {_ways(k)}"
        )


def check_removed(current: Stage | None, future: list[Stage], gone: set[str], k: int) -> None:
    """Refuse dropping a source from the config while the stage in progress still trains it."""
    for name in sorted(gone):
        if current is not None and current.fractions.get(name, 0.0) > 0:
            raise ConfigError(
                f"cannot resume the data mix at step {k}: data.mix.{name} is gone from the config, but the stage in "
                f"progress ({current.key(name)}, since step {current.start + 1}) trains it; put the source back, or "
                f"{_ways(k)} (a source may leave once its weight is 0)"
            )


def check_sources(saved_data: dict[str, str], now: dict[str, str], read: dict[str, int]) -> None:
    """Refuse a source that has been read (``read``: its windows so far) and whose data changed since."""
    for name, fingerprint in now.items():
        old = saved_data.get(name)
        if old is None or old == fingerprint or not read.get(name):
            continue
        change = describe_change(old, fingerprint)
        if change is None:
            continue
        change = change.replace("the data (data.path)", f"source {name!r} (data.mix.{name}.path)")
        raise ConfigError(
            f"cannot resume the data mix: {change}, and it trained {read[name]:,} windows before the checkpoint. "
            f"Restore its data; or give the new data a new source name (data.mix.<new>={{path: ..., weight: ...}}) "
            f"and the old one weight 0 from now on (a stage from the checkpoint's step); or start a new run from the "
            f"checkpoint's weights (train.init_from={CHECKPOINT})"
        )


def resume_schedule(
    saved: list[Stage], planned: list[Stage], config: list[Stage], names: set[str], gone: set[str], k: int
) -> Resumed:
    """The schedule to continue at batch ``k``: the saved past, the config's future; refused if the past changed.

    ``saved``: the stages that began before ``k``; ``planned``: every stage the saved run had planned; ``config``:
    the config's stages now; ``names``: the config's sources; ``gone``: saved sources no longer in the config.
    """
    compare_past(saved, config, names, k)
    future = [s for s in config if s.start >= k]
    check_removed(saved[-1] if saved else None, future, gone, k)
    edited = []
    old_future = {s.name: s for s in planned if s.start >= k}
    for s in future:
        old = old_future.pop(s.name, None)
        if old is None:
            edited.append(f"stage {s.name or 'data.mix'} added from step {s.start + 1}")
        elif old.start != s.start or any(
            abs(old.fractions.get(n, 0.0) - s.fractions.get(n, 0.0)) > SAME for n in set(old.fractions) | names
        ):
            edited.append(f"stage {s.name} changed (from step {s.start + 1})")
    edited += [f"stage {name} removed" for name in old_future]
    return Resumed(saved, future, edited)
