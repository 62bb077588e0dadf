"""The "did you mean" of configuration errors: the closest config key, group or option to a mistyped one.

Candidates are the schema's field names and ``conf/``'s groups and options, by :func:`difflib.get_close_matches`.
Nothing here imports Hydra.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from collections.abc import Iterable
from pathlib import Path

HYDRA_GROUPS = ("hydra",)
"""Groups of ``conf/`` that configure Hydra itself, not the run: never suggested."""


def find_conf_dir() -> Path | None:
    """``conf/`` inside an installed wheel, else the checkout's top-level ``conf/``; None when neither exists."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "conf", package.parents[1] / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    return None


@functools.cache
def _fields(cls: type) -> dict[str, type | None]:
    """Field name of the dataclass ``cls`` -> the dataclass type of that field (None: a plain value or list)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else None for f in dataclasses.fields(cls)}


def groups(conf_dir: Path | None = None) -> dict[str, list[str]]:
    """Config group -> its options (``conf/<group>/*.yaml``), Hydra's own groups left out."""
    conf_dir = conf_dir or find_conf_dir()
    if conf_dir is None or not conf_dir.is_dir():
        return {}
    return {
        d.name: sorted(p.stem for p in d.glob("*.yaml"))
        for d in sorted(conf_dir.iterdir())
        if d.is_dir() and d.name not in HYDRA_GROUPS
    }


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``word`` (difflib's ratio of at least 0.6), or None."""
    hits = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return hits[0] if hits else None


def key_path(cls: type, root: type) -> str | None:
    """The dotted key of the config section whose schema is ``cls`` (``TrainConfig`` -> ``train``; ``root``: ``""``)."""
    todo: list[tuple[type, str]] = [(root, "")]
    while todo:
        here, prefix = todo.pop()
        if here is cls:
            return prefix
        todo += [(t, f"{prefix}.{name}" if prefix else name) for name, t in _fields(here).items() if t is not None]
    return None


def correct_key(key: str, root: type, conf_dir: Path | None = None) -> str | None:
    """The existing dotted key closest to ``key`` (``modle`` -> ``model``) under the schema ``root``.

    Returns:
        The corrected key, or None when ``key`` exists or no key is close enough.
    """
    cls: type | None = root
    out, changed = [], False
    for i, part in enumerate(key.lstrip("+~").split(".")):
        if cls is None:  # below a plain value (a list, a dict): nothing to check
            out.append(part)
            continue
        fields = _fields(cls)
        names = [*fields, *(groups(conf_dir) if i == 0 else ())]
        if part not in names:
            fixed = closest(part, names)
            if fixed is None:
                return None
            part, changed = fixed, True
        out.append(part)
        cls = fields.get(part)
    return ".".join(out) if changed else None


def correct_option(group: str, option: str, conf_dir: Path | None = None) -> str | None:
    """The option of ``group`` closest to ``option`` (``tinny`` -> ``tiny``), or None (no such group, none close)."""
    return closest(option, groups(conf_dir).get(group, []))


def did_you_mean(key: str, root: type, value: str | None = None, conf_dir: Path | None = None) -> str:
    """``"; did you mean model=tiny?"`` for a mistyped key (and value, if a group's option); "" if none is close."""
    fixed = correct_key(key, root, conf_dir)
    if fixed is None:
        return ""
    if value is None:
        return f"; did you mean {fixed}?"
    options = groups(conf_dir).get(fixed)
    if options is not None and value not in options:
        value = correct_option(fixed, value, conf_dir) or value
    return f"; did you mean {fixed}={value}?"


def unknown_key(root: type, cls: type, name: str, value: object = None) -> str:
    """The message for a key ``name`` (appended with ``+``) that the schema ``cls``, a section of ``root``, lacks."""
    prefix = key_path(cls, root)
    key = f"{prefix}.{name}" if prefix else name
    shown = value if isinstance(value, (str, int, float, bool)) else None
    hint = did_you_mean(key, root, None if shown is None else str(shown))
    return (
        f"{key} is not a config key{hint or ''} (`python train.py --cfg job` prints every key; a '+' before "
        "a key adds a new one, which the schema refuses)"
    )
