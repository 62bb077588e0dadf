"""Cluster health: catch a bad node before the job starts and a hung job within minutes (docs/health.md).

The pre-flight check, the hang watchdog with every rank's heartbeat and the verdict drawn from them, the
straggler monitor, and the graph ledger's hook with the divergence guard (ranks that compile different graphs).
Imports nothing at import time (``hlat.train.entry`` reads its exit code and error type).
May import: ``hlat.config``, the core, ``hlat.launch``, ``hlat.plan``, ``hlat.backends``, ``hlat.track``.
"""
