"""hlat's submitit launchers, where Hydra looks for plugins: a dead job does not crash the sweep.

``hydra/launcher=slurm`` (``conf/hydra/launcher/slurm.yaml``) names :class:`SlurmLauncher`; the plugin's own presets
(``hydra/launcher=submitit_local``, ``submitit_slurm``) are swapped for these by ``hlat.sweep.callback`` at the
start of a sweep. What they do is :class:`hlat.sweep.launcher.CollectingLauncher`.
"""

from __future__ import annotations

from hlat.sweep.launcher import CollectingLauncher, require_accounting


class LocalLauncher(CollectingLauncher):
    """Every job of the sweep as a local process, all at once."""

    _EXECUTOR = "local"


class SlurmLauncher(CollectingLauncher):
    """Every job of the sweep as a Slurm job; refused where Slurm accounting is off."""

    _EXECUTOR = "slurm"

    def check_cluster(self) -> None:
        """Refuse to submit where submitit could never see a dead job end (:func:`require_accounting`)."""
        require_accounting()
