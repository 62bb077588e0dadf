"""What a run reports and how runs are compared: metrics, trackers, MLflow, plots, sweeps, provenance.

May import: ``hlat.config``, the core modules, ``hlat.plan`` (the peak FLOP/s behind MFU) and
``hlat.backends.base`` (what a metric asks for norms).
"""
