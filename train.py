"""Train a LLaMA-style model as the composed Hydra config says: ``python train.py model=small``."""

import hydra
from omegaconf import DictConfig

from hlat.cli import job_started, run_hydra
from hlat.config import register_configs
from hlat.train.entry import entry

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point: compose ``conf/`` with the command-line overrides, then train.

    Returns:
        In a multirun, the job's objective (final training loss) for sweepers such as Optuna; None otherwise.
    """
    job_started()
    return entry(cfg)


if __name__ == "__main__":
    run_hydra(main)  # what Hydra rejects (an unknown key or option, a bad override, the run directory) exits 2
