"""hlat: Hydra-configured pretraining of LLaMA-style models the way the HLAT paper did, tracked in MLflow.

The packages are layers, bottom to top: config, the core modules in ``hlat/`` (and ``experiments``), plan, data /
backends / track, checkpoint, health, train / sweep, then the commands (eval, deploy, cli). Each imports only from
its own layer or below (ARCHITECTURE.md, "The layers"; tests/unit/test_import_boundaries.py holds the graph to it).
"""

__version__ = "0.1.0"
