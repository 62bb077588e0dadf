"""Cluster health: catch a bad node before the job starts and a hung job within minutes (``conf/health/``).

- :mod:`hlat.health.preflight`: the pre-flight check of ``python train.py`` and ``hlat doctor`` (:mod:`hlat.cli.doctor`,
  beside the command line): per rank, the device answers a known matmul correctly, its matmul FLOP/s against a reference
  peak (and each node's median against the other nodes'), all-reduce / all-gather bus bandwidth and small-message
  latency within each node and over the job (torch.distributed: gloo, NCCL, or the XLA process group), ``neuron-ls`` /
  ``nccom-test`` where installed; a failing node is named before any model is built.
- :mod:`hlat.health.watchdog`: a thread fed by a loop hook; a step far slower than the running median dumps every
  thread's stack into ``<run dir>/hang/`` and exits with a code torch elastic restarts from the newest checkpoint.
- :mod:`hlat.health.heartbeat` and :mod:`hlat.health.blame`: every rank's step, phase and time, published where the
  other ranks read them, and the verdict a firing watchdog draws from them: the rank that stopped, not the ones
  waiting for it.
- :mod:`hlat.health.stragglers`: every N steps, each rank's step time and local (forward + data wait) time gathered,
  the slowest rank and its lag logged.

This package imports nothing at import time: :mod:`hlat.train.entry` reads the exit code and error type from it.

May import: ``hlat.config``, the core modules, ``hlat.launch``, ``hlat.plan``, ``hlat.backends`` and ``hlat.track``
(the trainer runs the checks and monitors). Never ``hlat.train`` or the commands: ``hlat doctor``, which starts
processes as training does, lives in ``hlat.cli``.
"""
