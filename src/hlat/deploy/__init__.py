"""Launch files for multi-node runs: per-node torchrun scripts, Slurm sbatch scripts, Kubeflow PyTorchJobs.

Every renderer is a pure function of the composed, validated :class:`hlat.config.RunConfig`, the Hydra overrides
``train.py`` receives and the environment variables to export; it returns text (or, for Kubernetes, a dict to dump
as YAML). They all start the trainer the same way ``python train.py`` supervises itself (``hlat.launch.elastic``): one
torch elastic agent (``torchrun``) per node, a c10d rendezvous on the first node, and ``--max-restarts`` from
``cluster.max_restarts``, so a failed rank restarts the whole job from its newest checkpoint. They also leave a
preempted trainer ``train.preempt_grace_s`` + 10 s to checkpoint the step in flight (``hlat.launch.preempt``), and the
Slurm script requeues such a job. The shell scripts run hlat's interpreter (``<python> -m torch.distributed.run``) and
``train.py`` by absolute path from the checkout (:class:`hlat.deploy.render.Install`), needing nothing of the shell
that starts them; the PyTorchJob runs the image's ``torchrun train.py``. ``hlat launch`` and ``hlat compile``
(``hlat.deploy.commands``) compose the config, validate the parallel layout and call them.

A top layer, beside the command line: may import anything below it (``hlat.config``, the core modules,
``hlat.backends``, ``hlat.track``); nothing imports it but :mod:`hlat.cli`.
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
