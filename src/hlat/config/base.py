"""What every config schema shares: the error type, freezing after validation, the check helpers."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A user-facing configuration error; the message names the key(s) and the fix."""


class UnknownKeyError(ConfigError):
    """A key the schema ``cls`` lacks; :func:`hlat.config.to_run_config` words it with the closest existing key."""

    def __init__(self, cls: type, name: str, value: object) -> None:
        super().__init__(f"{cls.__name__} has no key {name!r}")
        self.cls, self.name, self.value = cls, name, value


class _Frozen:
    """Mixin: instances become immutable once ``__post_init__`` has validated them.

    Not ``dataclass(frozen=True)``: OmegaConf would mark the schema read-only and break Hydra's overrides.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            if name not in {f.name for f in dataclasses.fields(self)}:  # type: ignore[arg-type]
                # OmegaConf.to_object sets keys the schema lacks (``+modle=tiny`` appends one) after __init__
                raise UnknownKeyError(type(self), name, value)
            raise dataclasses.FrozenInstanceError(
                f"cannot assign {type(self).__name__}.{name}: configs are frozen after validation; "
                "use dataclasses.replace() to derive a new one"
            )
        object.__setattr__(self, name, value)

    def _freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: config keys as dotted names (MLflow params, config hashes, diffs)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{key}={value!r} is not one of {list(choices)}; set {key} to one of them")


_RULE = re.compile(r"^(?:(>=|>) (\S+)|([\[(])(\S+), (\S+)([\])]))$")


def within(value: float, rule: str) -> bool:
    """Whether ``value`` satisfies ``rule``: ``>= 1``, ``> 0``, or an interval such as ``[0, 1)`` or ``(0, 1]``."""
    m = _RULE.match(rule)
    assert m, f"not a range rule: {rule!r}"
    op, bound, left, low, high, right = m.groups()
    if op:
        return value >= float(bound) if op == ">=" else value > float(bound)
    above = value >= float(low) if left == "[" else value > float(low)
    below = value <= float(high) if right == "]" else value < float(high)
    return above and below


def show(value: object) -> str:
    """A value as an override writes it: null, true/false, numbers as they are."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _check_range(
    obj: object, key: str, rule: str, *, null: str | None = None, note: str = "", example: object = None
) -> None:
    """Refuse the field ``key`` (``section.field``) of ``obj`` outside ``rule`` (see :func:`within`).

    ``null``: what null means where allowed; ``note``: what a special value means; ``example``: the value the
    message suggests (default: the field's default).
    """
    name = key.rpartition(".")[2]
    value = getattr(obj, name)
    if (value is None and null is not None) or (value is not None and within(value, rule)):  # NaN: within no rule
        return
    allowed = f"{'lie in' if rule[0] in '[(' else 'be'} {rule}" + (f" or null ({null})" if null else "")
    if example is None:
        example = next(f.default for f in dataclasses.fields(obj) if f.name == name)  # type: ignore[arg-type]
    note = f" {note}" if note else ""
    raise ConfigError(f"{key}={show(value)} must {allowed}{note}; set it in that range, e.g. {key}={show(example)}")
