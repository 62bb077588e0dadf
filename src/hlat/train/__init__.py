"""Training: build a run from the composed config and fit it, and keep it alive through crashes and signals.

Owns ``run`` (the build graph: config -> backend -> model/optimizer -> data -> trackers/monitors -> state -> fit),
``loop`` (``fit``: the step, micro-batches, hooks), ``checkpoint`` and ``job_dir`` (atomic, verified checkpoints
and the job files beside them), ``resume`` (restore, restart accounting, roll-back on a non-finite step),
``launch`` (the command-line entry, torch elastic supervision, exit codes and "how to continue" hints),
``preempt`` (signals -> a checkpoint of the step in flight), ``attempt`` (which restart this is), ``faults``
(fault injection), ``rendezvous``, ``weights`` (reading an hlat checkpoint's or a Hugging Face directory's
weights), ``evals`` (evaluations along training, as child processes), ``sweep_job`` (one job of a multirun) and
``sweep_launcher`` (the submitit launcher that collects a sweep's results).

May import: everything below it (``hlat.config``, the core modules, ``hlat.plan``, ``hlat.data``,
``hlat.backends``, ``hlat.track``, ``hlat.health``'s monitors and checks). Never ``hlat.eval``, ``hlat.cli``,
``hlat.deploy`` or ``hlat.health.doctor``.
"""
