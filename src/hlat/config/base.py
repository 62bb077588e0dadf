"""What every config schema shares: the error type, freezing after validation, the check helpers."""

from __future__ import annotations

import dataclasses
from typing import Any

DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A user-facing configuration error; the message names the key(s) and the fix."""


class _Frozen:
    """Mixin: instances become immutable once ``__post_init__`` has validated them.

    ``dataclass(frozen=True)`` would make OmegaConf mark the schema read-only, which breaks Hydra's
    command-line overrides, so immutability is switched on after construction instead.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            if name not in {f.name for f in dataclasses.fields(self)}:  # type: ignore[arg-type]
                # OmegaConf.to_object sets keys the schema lacks (``+modle=tiny`` appends one) after __init__
                from hlat.config.suggest import unknown_key

                raise ConfigError(unknown_key(type(self), name, value))
            raise dataclasses.FrozenInstanceError(
                f"cannot assign {type(self).__name__}.{name}: configs are frozen after validation; "
                "use dataclasses.replace() to derive a new one"
            )
        object.__setattr__(self, name, value)

    def _freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{key}={value!r} is not one of {list(choices)}; set {key} to one of them")
