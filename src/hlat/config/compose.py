"""Composing ``conf/`` outside ``@hydra.main``, and Hydra's composition errors in one line.

Every command that takes ``python train.py``'s overrides composes here, so a mistyped key reads the same everywhere.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hlat.config import RunConfig

CONTAINER_MARKERS = ("/.dockerenv", "/run/.containerenv")
"""Files Docker and podman create in every container."""


def config_dir() -> Path:
    """conf/ inside an installed wheel, else the checkout's top-level conf/."""
    from hlat.config.suggest import find_conf_dir

    found = find_conf_dir()
    if found is None:
        raise FileNotFoundError("hlat's conf/ directory was not found next to the package or in the checkout")
    return found


def compose_run_config(overrides: Sequence[str]) -> RunConfig:
    """Compose ``conf/`` with Hydra overrides as ``python train.py`` would, and validate it.

    Raises:
        ConfigError: On a composition or validation error, in one line (:func:`hydra_error_message`).
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from hlat.config import ConfigError, register_configs, to_run_config

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            return to_run_config(compose(config_name="config", overrides=list(overrides)))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(hydra_error_message(e, overrides) or str(e)) from None


def _container_hint(e: OSError) -> str:
    """Whose a mounted host folder must be, for a permission error inside a container (``CONTAINER_MARKERS``)."""
    if e.errno not in (errno.EACCES, errno.EPERM) or not any(Path(p).exists() for p in CONTAINER_MARKERS):
        return ""
    uid = os.getuid()
    return (
        f"; in this container hlat runs as uid {uid}: a host folder mounted here must be writable by uid {uid} "
        f"(chown {uid} it on the host, or run the container with --user set to the folder's owner)"
    )


def hydra_error_message(e: BaseException, overrides: Sequence[str] = ()) -> str | None:
    """One line for an error of Hydra's composition, or of its making the run directory; None for any other error.

    ``overrides``: the command line, for the override at fault (``modle=tiny`` -> did you mean model=tiny?).
    """
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    from hlat.config import ConfigError
    from hlat.config.suggest import correct_option

    if isinstance(e, ConfigError):
        return str(e)
    if isinstance(e, MissingConfigException) and e.missing_cfg_file and "/" in e.missing_cfg_file:
        group, _, option = e.missing_cfg_file.rpartition("/")
        fix = correct_option(group, option)
        hint = f"; did you mean {group}={fix}?" if fix else ""
        return f"{group}={option}: conf/{group}/ has no option {option!r}{hint} (options: {', '.join(e.options or [])})"
    if isinstance(e, OSError) and e.filename and not isinstance(e, HydraException):
        key = "hydra.sweep.dir" if {"-m", "--multirun"} & set(overrides) else "hydra.run.dir"
        return (
            f"{key}: cannot create or write the run directory {e.filename} ({e.strerror or e}); set {key} to "
            f"a writable directory (e.g. a path under your home or the working directory){_container_hint(e)}"
        )
    if isinstance(e, OverrideParseException):
        bad = next((o for o in overrides if "=" in o and not o.startswith("-") and not _parses(o)), None)
        what = f"cannot parse the override {bad!r}" if bad else "cannot parse an override"
        return (
            f"{what} ({str(e).splitlines()[0]}); quote a value with spaces or special characters (key='a b'), "
            "write lists as key=[1,2] (https://hydra.cc/docs/advanced/override_grammar/basic)"
        )
    if isinstance(e, (HydraException, OmegaConfBaseException)):
        return _composition_message(e, overrides)
    return None


def _parses(override: str) -> bool:
    """Whether Hydra's override grammar accepts ``override``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        OverridesParser.create().parse_overrides([override])
    except OverrideParseException:
        return False
    return True


def _composition_message(e: BaseException, overrides: Sequence[str]) -> str:
    """An unknown key (with the closest existing one), a value of the wrong type, or Hydra's own words."""
    from hlat.config import RunConfig
    from hlat.config.suggest import did_you_mean

    text = str(e).split("\nConfig search path:")[0].strip()  # Hydra's search path says nothing to the user
    cause = e.__cause__
    key = getattr(cause, "full_key", None)
    reason = str(cause).strip().splitlines()[0] if cause else ""
    if key and text.startswith("Could not override"):  # an unknown key: Hydra names its first unknown part
        given = [o.lstrip("+~").partition("=") for o in overrides]
        key, value = next(((k, v) for k, _, v in given if k == key or k.startswith(f"{key}.")), (key, None))
        listing = "--cfg hydra" if key.startswith("hydra.") else "--cfg job"
        hint = did_you_mean(key, RunConfig, value)
        return f"{key} is not a config key{hint} (`python train.py {listing}` prints every key)"
    if key and reason:
        section = key.split("[")[0]
        fix = _VALUE_HINTS.get(section, f"give {section} a value of its type (`python train.py --cfg job` shows them)")
        return f"{section}: {reason}; {fix}"
    return f"{' '.join(text.split())}: {reason}" if reason else " ".join(text.split())


_VALUE_HINTS = {
    "eval.tasks": "each entry is a task and its shots, e.g. eval.tasks=[{task:hlat_local_mc,num_fewshot:0}]",
}
"""The fix for a value of the wrong type, where "a value of its type" would not say enough."""


@dataclass(frozen=True)
class Sweep:
    """The runs that ``python train.py -m [--config-dir D --config-name N] overrides`` would start, as overrides."""

    kind: str
    """``basic`` (Hydra's grid: every arm listed), ``optuna`` (a search: trials are not known ahead) or ``single``."""
    arms: list[list[str]]
    """Each arm's overrides (for ``optuna``: the fixed overrides, one arm)."""
    search: dict[str, str]
    """``optuna``: the searched keys and their Hydra search space (``tag(log, interval(1e-4, 1e-2))``)."""
    config_name: str = "config"
    search_dir: str | None = None
    """The sweep's ``--config-dir`` (absolute), searched before hlat's conf/."""


def sweep_arms(overrides: Sequence[str], *, config_name: str = "config", search_dir: str | None = None) -> Sweep:
    """Expand a multirun as Hydra's basic sweeper would: ``hydra.sweeper.params`` and ``key=a,b`` overrides.

    Raises:
        ConfigError: a sweep config or override Hydra cannot compose or parse, in one line.
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from hlat.config import ConfigError

    try:
        hydra_cfg = _compose(overrides=[], config_name=config_name, search_dir=search_dir, hydra=True).hydra
        sweeper = hydra_cfg.sweeper
        params = {str(k): str(v) for k, v in (sweeper.get("params") or {}).items()}
        if "optuna" in str(sweeper.get("_target_", "")).lower():
            return Sweep("optuna", [list(overrides)], params, config_name, search_dir)
        parsed = OverridesParser.create().parse_overrides([*(f"{k}={v}" for k, v in params.items()), *overrides])
        if not any(o.is_sweep_override() for o in parsed):
            return Sweep("single", [list(overrides)], {}, config_name, search_dir)
        arms = [list(arm) for batch in BasicSweeper.split_arguments(parsed, None) for arm in batch]
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(hydra_error_message(e, overrides) or str(e)) from None
    return Sweep("basic", arms, {}, config_name, search_dir)


def compose_arm(overrides: Sequence[str], *, config_name: str = "config", search_dir: str | None = None) -> RunConfig:
    """One arm of a sweep, composed and validated as its job would be (:func:`compose_run_config` for a sweep)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from hlat.config import ConfigError, to_run_config

    try:
        return to_run_config(_compose(overrides, config_name=config_name, search_dir=search_dir))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(hydra_error_message(e, overrides) or str(e)) from None


def _compose(overrides: Sequence[str], *, config_name: str, search_dir: str | None, hydra: bool = False) -> Any:
    """Hydra's compose of ``config_name``: from ``search_dir`` (a sweep's ``--config-dir``) with conf/ behind it."""
    from hydra import compose, initialize_config_dir

    from hlat.config import register_configs

    register_configs()
    primary = search_dir or str(config_dir())
    extra = [f"hydra.searchpath=[file://{config_dir()}]"] if search_dir else []
    with initialize_config_dir(config_dir=primary, version_base="1.3"):
        return compose(config_name=config_name, overrides=[*extra, *overrides], return_hydra_config=hydra)


def search_values(key: str, space: str) -> list[Any]:
    """Two values inside a Hydra search space (``interval``, ``range``, ``choice``), for probing a search.

    Raises:
        ValueError: a search space of another kind.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

    value = OverridesParser.create().parse_override(f"{key}={space}").value()
    if isinstance(value, IntervalSweep):
        lo, hi = float(value.start), float(value.end)
        if "log" in value.tags and lo > 0:
            return [float(f"{lo * (hi / lo) ** f:.3g}") for f in (1 / 3, 2 / 3)]
        return [float(f"{lo + (hi - lo) * f:.3g}") for f in (1 / 3, 2 / 3)]
    if isinstance(value, RangeSweep):
        grid = list(range(int(value.start), int(value.stop), int(value.step or 1)))
        return [grid[len(grid) // 3], grid[(2 * len(grid)) // 3]]
    if isinstance(value, ChoiceSweep):
        return list(value.list[:2]) if len(value.list) >= 2 else list(value.list) * 2
    raise ValueError(f"{key}={space}: a search space hlat graphs cannot probe (interval, range or choice)")
