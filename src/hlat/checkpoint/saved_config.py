"""The config a checkpoint was written with, as recorded in its ``manifest.json`` (``RunConfig`` / ``ModelConfig``).

Keys this version of hlat does not know are ignored; nested dataclasses are rebuilt from ``dataclasses.asdict``.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

from hlat.checkpoint.manifest import MANIFEST, manifest
from hlat.config import ConfigError, ModelConfig, RunConfig


def run_config(path: Path) -> RunConfig:
    """The resolved config recorded in a checkpoint's manifest (keys this version does not know are ignored).

    Raises:
        ConfigError: The manifest records no config, or one this version of hlat rejects.
    """
    saved = (manifest(path) or {}).get("config")
    if not isinstance(saved, dict):
        raise ConfigError(f"checkpoint {path}: its {MANIFEST} records no config (written by an older hlat?)")
    try:
        return _build(RunConfig, saved)
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"checkpoint {path}: the config in its {MANIFEST} is not valid now ({e}); use the hlat version "
            "that wrote it"
        ) from e


def model_config(path: Path) -> ModelConfig:
    """The model config alone from a checkpoint's manifest (all a weights-only checkpoint records)."""
    meta = manifest(path) or {}
    saved = (meta.get("config") or {"model": meta.get("model")}).get("model")  # top-level: before the whole config
    if not isinstance(saved, dict):
        raise ConfigError(f"checkpoint {path}: its {MANIFEST} records no model config (not written by hlat?)")
    return _build(ModelConfig, saved)


def config_from_dict(values: dict[str, Any]) -> RunConfig:
    """The ``RunConfig`` of ``dataclasses.asdict`` output (validated as any config is)."""
    return _build(RunConfig, values)


def _build(cls: type, values: dict[str, Any]) -> Any:
    """The dataclass ``cls`` from ``dataclasses.asdict`` output, nested dataclasses (and lists of them) included."""
    hints = typing.get_type_hints(cls)
    return cls(
        **{
            f.name: _value(hints[f.name], values[f.name])
            for f in dataclasses.fields(cls)
            if f.init and f.name in values
        }
    )


def _value(tp: Any, v: Any) -> Any:
    if dataclasses.is_dataclass(tp) and isinstance(v, dict):
        return _build(tp, v)
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (list, tuple) and args and isinstance(v, list):
        return type(v)(_value(args[0], x) for x in v)
    for arg in args:  # X | None
        if dataclasses.is_dataclass(arg) and isinstance(v, dict):
            return _build(arg, v)
    return v
