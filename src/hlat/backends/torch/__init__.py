"""The torch backend: plain PyTorch on CPU and CUDA, and the torch-only mechanisms it applies to the model.

Owns ``backend`` (``TorchBackend``), ``dist`` (the process group, DDP / ZeRO-1, FSDP2, DTensor tensor
parallelism; ``Ranks`` is shared with the neuron backend), ``precision`` (stochastic rounding, fp32 accumulation,
the low-precision AdamW), ``bf16_matmul`` (emulated bf16 matmuls) and ``recompute`` (activation checkpointing).
May import: ``hlat.config``, the core, ``hlat.plan`` and ``hlat.backends.base``.
"""
