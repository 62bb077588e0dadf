"""Launch files for multi-node runs: per-node torchrun scripts, Slurm sbatch scripts, Kubeflow PyTorchJobs.

Each renderer is a pure function of the validated config, the overrides and the environment to export; all start
one torch elastic agent per node, as ``python train.py`` supervises itself (docs/deploy.md).
A top layer: may import anything below it; nothing imports it but :mod:`hlat.cli`.
"""

from hlat.deploy.k8s import pytorchjob, to_yaml
from hlat.deploy.render import (
    Install,
    compile_overrides,
    job_name,
    node_script,
    torchrun_argv,
    torchrun_line,
    train_overrides,
)
from hlat.deploy.slurm import sbatch_script

__all__ = [
    "Install",
    "compile_overrides",
    "job_name",
    "node_script",
    "pytorchjob",
    "sbatch_script",
    "to_yaml",
    "torchrun_argv",
    "torchrun_line",
    "train_overrides",
]
