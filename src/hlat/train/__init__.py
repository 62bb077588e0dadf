"""Training: build a run from the composed config and fit it, and keep it alive through crashes and signals.

``launch`` (entry, supervision, exit codes) -> ``run`` (the build graph) -> ``trainer`` (rollback, signals,
clean-up) -> ``loop`` (``fit``); ``hlat.sweep`` sits beside it. May import everything below it; never ``hlat.eval``,
``hlat.cli`` or ``hlat.deploy``.
"""
