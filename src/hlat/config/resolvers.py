"""Who this process is within its job, as Hydra's resolvers ask: its rank, and the one time stamp of the launch.

``hydra.run.dir``, ``hydra.sweep.dir`` and the log file names of ``conf/`` resolve through here, so every rank of a
job (under torchrun, Slurm tasks or hlat's own torch elastic agent) writes into one directory. The launcher
(:mod:`hlat.launch.elastic`) and the sweep records (:mod:`hlat.track.sweep`) read the rank here too. Only the
standard library at import (``hlat summary`` composes without torch); torch's TCPStore is imported when a
torchrun job asks for its stamp.
"""

from __future__ import annotations

import datetime
import os
from typing import Any


def under_elastic() -> bool:
    """Whether this process is already a worker of torchrun / torch elastic."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def global_rank() -> int:
    """This process's rank: ``RANK`` (torchrun), else ``SLURM_PROCID`` (a Slurm task per node), else 0."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def job_stamp() -> str:
    """``DATE/TIME`` naming this launch's run or sweep directory: one value for every rank of the job.

    Hydra's own ``${now:...}`` is read by each process, so under ``torchrun`` ranks that start a second apart would
    write to different directories. Under torchrun the first rank to ask stores its time in the agent's rendezvous
    store and every other rank (on every node, and after an in-place restart) reads that value back; elsewhere it is
    simply now.
    """
    now = datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    env = os.environ
    if not under_elastic() or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in env:
        return now
    import torch.distributed as dist

    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=120)
    )
    return store.compare_set("hlat/job_stamp", "", now).decode()  # sets it if absent; returns what is stored


def rank_zero_only(value: Any) -> Any:
    """``value`` on global rank 0 (or without a launcher), None on the other ranks (Hydra resolver)."""
    return value if global_rank() == 0 else None


def rank_suffix() -> str:
    """``""`` on rank 0, ``_rank<N>`` on the others: per-rank log file names in one job directory."""
    r = global_rank()
    return f"_rank{r}" if r else ""


def console_level(level: str = "INFO") -> str:
    """``level`` on global rank 0, ``WARNING`` on the others (resolver of ``conf/hydra/job_logging/hlat.yaml``).

    Under any launcher (torchrun, srun, Slurm tasks, hlat's own) one rank narrates on the console; the others speak up
    on problems only, and keep their INFO lines in their own ``train_rank<N>.log``.
    """
    return level if global_rank() == 0 else "WARNING"


def register_resolvers() -> None:
    """Resolvers that keep ranks of one job in one directory (``hydra.run.dir``, ``hydra.sweep.dir``, logs)."""
    from omegaconf import OmegaConf

    for name, fn in (
        ("hlat.job_stamp", job_stamp),
        ("hlat.rank_zero_only", rank_zero_only),
        ("hlat.rank_suffix", rank_suffix),
        ("hlat.console_level", console_level),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=name == "hlat.job_stamp")
