"""The Backend protocol: the complete list of differences between platforms.

``run.py`` picks a backend once (``get_backend(cfg)``); everything else talks to it through these methods. A backend
holds the run config from its construction, so a method takes only what differs from call to call. A new platform
difference becomes a method here, never an ``if backend == ...`` (or a ``getattr(backend, ...)``) elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from hlat.parallel import ParallelDims

if TYPE_CHECKING:
    from hlat.backends.graphs import GraphLedger


@dataclass(frozen=True)
class Env:
    """What ``Backend.setup`` learned about this process."""

    rank: int
    world_size: int
    device: torch.device
    memory_budget_bytes: int
    """Memory this rank's device can give the run (free memory x cluster.memory_fraction)."""
    bf16_matmul: str | None = None
    """How bf16 matmuls run (``native`` or ``emulated``, ``hlat.plan.bf16_policy``) when the run computes in bf16
    on the torch backend; None where the platform decides (Neuron) or nothing computes in bf16."""
    bf16_matmul_reason: str = ""
    """Why that policy: the forcing config value, or the probe's figures."""


class Backend(Protocol):
    """Platform-specific operations used by ``run.main`` and ``loop.fit``.

    ``get_backend(cfg)`` builds one for the run config; ``run.main`` calls ``setup``, ``build_model``,
    ``build_optimizer``; each step of ``loop.fit`` calls ``forward_backward``, ``update`` and ``step_end``; hooks call
    ``param_norm``, ``fetch``, ``save`` and ``load``.
    """

    name: str

    def setup(self) -> Env:
        """Initialize the process (distributed group, device, seeds, threads); refuse what it cannot honour."""
        ...

    def build_model(self, dims: ParallelDims, init_state: dict[str, torch.Tensor] | None = None) -> nn.Module:
        """Build the decoder of the run's ``model`` config: parallelize, materialize on the device, ``init_weights()``.

        ``dims`` (the run's layout) and ``parallelism`` say how: data/tensor parallelism, activation checkpointing,
        ZeRO-1 (for ``build_optimizer``). ``init_state`` (``train.init_from``: whole fp32-layout weights under hlat's
        names) replaces the initialization before any cast or split. Each backend builds its own decoder (``hlat.model``
        on torch, NxD's layers on neuron) with the same parameter names.
        """
        ...

    def build_optimizer(self, model: nn.Module, groups: list[dict]) -> torch.optim.Optimizer:
        """The AdamW of ``optimizer`` over ``groups`` (ZeRO-1 wrapped where the platform does that)."""
        ...

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward under the precision policy; mean token cross-entropy as a 0-d fp32 tensor."""
        ...

    def forward_backward(
        self, model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], n: int
    ) -> torch.Tensor:
        """Forward and backward over the ``n`` micro-batches of one optimizer step, drawn from ``batches``.

        The gradients of the step's mean loss accumulate in the parameters (each micro-batch's loss scaled by 1/n).
        Returns that mean loss on this rank (0-d, on the device). Eager backends run ``loss`` and ``backward`` per
        micro-batch as they are drawn; a pipeline-parallel one hands all of them to its schedule at once.
        """
        ...

    def update(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, bool]:
        """Clip the gradients to ``optimizer.clip_grad_norm`` (0: no clipping) and apply ``optimizer``'s step.

        Returns the global gradient L2 norm before clipping (a device tensor) and whether the update was applied:
        under ``train.on_nonfinite=skip_step`` it is not when that norm is not finite (one flag read on the host).
        Where the optimizer clips inside its own step (NxD), the norm is read after it.
        """
        ...

    def param_norm(self, model: nn.Module) -> torch.Tensor:
        """Global L2 norm of the whole model's parameters, the same on every rank (a device tensor).

        A backend whose ranks hold parts of the model (pipeline stages, tensor-parallel shards) reduces it itself.
        """
        ...

    def step_end(self) -> None:
        """End-of-step barrier for lazy devices (``xm.mark_step`` on XLA); a no-op on eager PyTorch."""
        ...

    def synchronize(self) -> None:
        """Wait until the device has finished the work queued so far (timing the device: ``hlat doctor``).

        CUDA: ``torch.cuda.synchronize``; XLA: ``xm.mark_step`` then ``xm.wait_device_ops``; CPU: nothing (eager).
        Never inside a training step: on XLA it cuts the step's graph.
        """
        ...

    def fetch(self, tensors: dict[str, torch.Tensor], fn: Callable[[dict[str, list[float]]], None]) -> None:
        """Move ``tensors`` to the host in one transfer and call ``fn`` with each flattened to a list of floats.

        On XLA this is a step closure that runs after the graph executes, so it never splits the graph.
        """
        ...

    def host_metrics(self) -> dict[str, float]:
        """Platform counters read on the host, logged with each log interval's last row; ``{}`` where there are none.

        Never touches the device (no graph, no transfer). Neuron: the XLA graph counters of ``neuron_graphs``
        (``xla/graphs_compiled``, ``xla/compile_time_s``, ``xla/device_to_host_transfers`` ...), cumulative.
        """
        ...

    def graph_ledger(self) -> GraphLedger | None:
        """Which step and phase compiled new graphs (``hlat.backends.graphs``); None where nothing compiles graphs.

        Neuron: every sync of the backend is a phase of the ledger (set-up, each micro-batch, the optimizer step, the
        fetch, a checkpoint); the trainer stamps the step and hands the events to the divergence guard.
        """
        ...

    def save(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any], *, async_save: bool
    ) -> Future | None:
        """Write model and optimizer state plus ``extra`` (plain python values) into the directory ``path``.

        With ``async_save``, return once the state is copied off the training tensors, with a future that completes
        when every file is on disk (or raises the write error); otherwise write it all and return None.
        """
        ...

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Restore model and optimizer state in place from ``path``; return the ``extra`` saved with them."""
        ...


EXTRA = "extra.rank{rank}.pt"
"""Each rank's ``extra`` in a checkpoint directory (train state, loader position, RNG, spikes, job record)."""


def read_extra(path: Path, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s ``extra`` from the checkpoint at ``path``; rank 0's where the saving run had no such rank.

    A run resumed on more ranks than saved it (another data-parallel degree) gives a new rank rank 0's train state,
    spike statistics, job record and RNG state (every rank seeds and draws it alike); its loader then gathers its
    sequence slots' positions from the ranks that served them (``hlat.train.resume.restore``).
    """
    own = path / EXTRA.format(rank=rank)
    # weights_only: a checkpoint is data; refusing pickled code keeps a shared checkpoint from running it.
    return torch.load(own if own.is_file() else path / EXTRA.format(rank=0), map_location="cpu", weights_only=True)
