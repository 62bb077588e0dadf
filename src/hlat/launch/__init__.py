"""Launching a job and keeping it going: torch elastic supervision, the rendezvous, restart attempts, preemption.

Owns ``elastic`` (this process as the torch elastic agent of the worker function it is handed), ``rendezvous``
(where a job's agents meet), ``attempt`` (which restart of the job this is, one number on every rank) and
``preempt`` (a signal -> a checkpoint of the step in flight, exit 85); docs/fault-recovery.md tells how they fit.

May import: ``hlat.config`` and the core modules only; the backends, checkpoints, health checks, the trainer, the
multirun and the commands import it. Nothing here runs at import.
"""
