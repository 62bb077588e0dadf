"""What a run reports and how runs are compared: metrics, trackers, MLflow, plots, sweeps, provenance.

Owns ``metrics`` (loss, norms, spike statistics, throughput/MFU, uptime: the ``MetricsLogger``), ``trackers``
(console / MLflow / in-memory sinks), ``mlflow_store`` (the store, its experiments and UI addresses), ``progress``,
``provenance`` (git state and the resolved config beside a run), ``plots``, ``runs`` (reading runs back from
MLflow), ``compare`` (``hlat compare``), ``sweep`` (a sweep's records, tags and config hashes) and
``sweep_views`` (a sweep's parent run in the MLflow UI: its arms' losses, a linked table, a saved view).

May import: ``hlat.config``, the core modules, ``hlat.state``, ``hlat.plan`` (the peak FLOP/s behind MFU) and
``hlat.backends.base`` (the interface a metric asks for norms). Never ``hlat.train``, ``hlat.eval``, ``hlat.cli``.
"""
