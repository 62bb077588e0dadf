"""hlat: Hydra-configured pretraining of LLaMA-style models the way the HLAT paper did, tracked in MLflow.

The packages are the layers, bottom to top (each may import only from the layers below it or its own):

- ``config``: the typed schemas, composing ``conf/``, the job's rank and stamp.
- the core, directly in ``hlat/``: ``model``, ``attention``, ``parallel``, ``norms``, ``optim``, ``sizing``,
  ``layouts``, ``host``, ``state``, ``attempt``, ``safe_load``, ``logs``; and ``experiments``, what experiments
  change in the model (the information leak's attention).
- ``plan``: memory, step time, MFU and cost, without a device.
- ``data``, ``backends``, ``track``: batches, devices (the torch backend's precision, emulated bf16 matmuls and
  activation checkpointing among them), and what a run reports.
- ``checkpoint``: checkpoint files, their manifests and job files, reading weights, the Hugging Face layout.
- ``health``: the checks and monitors a run carries.
- ``train``, ``sweep``: the trainer (``train.run.main`` is the build graph) and its launcher; the multirun.
- ``eval``, ``deploy``, ``cli`` (and ``hlat doctor``, ``hlat plan``): the commands.

tests/unit/test_import_boundaries.py holds the graph to this.
"""

__version__ = "0.1.0"
