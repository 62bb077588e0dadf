"""The ``hlat`` command: ``hlat train [overrides]`` and ``hlat summary [overrides]``.

Both take Hydra overrides exactly like ``python train.py`` (``hlat train model=small precision=bf16``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

USAGE = """hlat COMMAND [hydra overrides...]

commands:
  train     train as configured (same as `python train.py ...`)
  summary   validate, count parameters on the meta device, estimate memory, and exit (train.dry_run=true)
"""


def config_dir() -> Path:
    """conf/ inside an installed wheel, else the checkout's top-level conf/."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parents[1] / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError("hlat's conf/ directory was not found next to the package or in the checkout")


def _hydra_train(argv: list[str]) -> None:
    import hydra
    from omegaconf import DictConfig

    from hlat.config import register_configs
    from hlat.run import entry

    register_configs()

    @hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
    def task(cfg: DictConfig) -> None:
        entry(cfg)

    sys.argv = ["hlat", *argv]  # Hydra reads its overrides from sys.argv
    task()


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``hlat`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="hlat", usage=USAGE, add_help=True)
    parser.add_argument("command", choices=["train", "summary"])
    args, rest = parser.parse_known_args(argv)
    if args.command == "summary":
        rest = [*rest, "train.dry_run=true", "hydra.output_subdir=null", "hydra/job_logging=disabled",
                "hydra.run.dir=."]  # fmt: skip
    _hydra_train(rest)


if __name__ == "__main__":
    main()
