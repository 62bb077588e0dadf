"""Training: build a run from the composed config and fit it, and keep it alive through crashes and signals.

Owns ``run`` (the build graph: job -> backend -> layout and memory -> data -> model/optimizer -> state -> tracking ->
hooks -> fit), ``hooks`` (the hooks ``fit`` runs, built in one place: metrics, the non-finite guard, checkpoints,
monitors, fault injection, the signal stop), ``trainer`` (``fit`` with those hooks: rollback, signals and clean-up),
``loop`` (``fit`` itself: the step, micro-batches, hooks), ``tracking`` (the run's tags, params, tracker and
throughput model), ``resume`` (which start this is, what it resumes from, restore, roll-back on a non-finite step),
``entry`` (the command-line entry, exit codes and "how to continue" hints), ``faults`` (fault injection) and
``evals`` (evaluations along training, as child processes, and the check of their tasks before anything is built).
Supervision, preemption and restart attempts are ``hlat.launch``'s, below this package; the multirun's jobs, callback
and launcher are ``hlat.sweep``'s, beside it.

May import: everything below it (``hlat.config``, the core modules, ``hlat.launch``, ``hlat.plan``, ``hlat.data``,
``hlat.backends``, ``hlat.track``, ``hlat.checkpoint``, ``hlat.health``'s checks and monitors). Never
``hlat.eval``, ``hlat.cli``, ``hlat.deploy`` or ``hlat.cli.doctor`` (tests/unit/test_import_boundaries.py draws
the graph).
"""
