"""Who this process is within its job, as Hydra's resolvers ask: its rank, and the one time stamp of the launch.

``hydra.run.dir`` and the log names resolve here, so every rank of a job writes into one directory. Only the
standard library at import (``hlat summary`` composes without torch).
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

    Hydra's ``${now:...}`` differs between ranks that start a second apart, so under torchrun the first rank stores
    its time in the agent's store and every other rank (and restart) reads it back.
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
    """``level`` on global rank 0, ``WARNING`` on the others: one rank narrates, each keeps INFO in its own log."""
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
