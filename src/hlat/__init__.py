"""hlat: Hydra-configured pretraining of LLaMA-style models the way the HLAT paper did, tracked in MLflow."""

__version__ = "0.1.0"
