"""Composing ``conf/`` outside ``@hydra.main``, and Hydra's composition errors in one line.

Every command that takes ``python train.py``'s overrides composes here, so a mistyped key reads the same everywhere.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

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
