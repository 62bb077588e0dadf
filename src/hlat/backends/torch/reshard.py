"""Reading a torch-backend checkpoint into this run's layout, whatever TP / DP / ZeRO-1 / FSDP layout wrote it.

DCP stores every tensor as its global tensor (chunks at their offsets) and reads back the slice each rank of the
loading layout owns, so a change of DP degree, of ZeRO-1 (AdamW state keyed by parameter name, on the rank that owns
it or on all) or of FSDP (dp-sharded DTensors) is DCP's own resharding, and bitwise. Two things are not:

- TP: the fused MLP weight ``gate_up`` is stored in the row order its TP degree interleaves
  (:func:`hlat.backends.torch.dist.gate_up_interleaved`); another degree would read it scrambled. Its tensors (the
  weight, its AdamW moments and fp32 master) are read whole, one layer at a time, put into this run's order, and
  each rank keeps its shard.
- A checkpoint without fp32 master weights (``precision=bf16_sr``) resumed with them (``master_weights``): its
  masters are not read; the caller starts them from the bf16 weights (``PrecisionAdamW.init_missing_masters``).

The optimizer's param_groups are not read either: they hold the run's hyperparameters, which come from its config,
and their number depends on the layout (TP puts DTensor and plain parameters into groups of their own).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from hlat import safe_load
from hlat.backends.torch.dist import gate_up_in_model_order, gate_up_interleaved

GATE_UP = ".mlp.gate_up.weight"
MANIFEST = "manifest.json"
"""The checkpoint's manifest (``hlat.checkpoint.manifest``), whose config records the TP degree that wrote it."""


def written_tp(path: Path) -> int | None:
    """The TP degree of the run that wrote the checkpoint at ``path`` (None: its manifest does not say)."""
    try:
        config = json.loads((path / MANIFEST).read_text()).get("config") or {}
    except (OSError, ValueError, AttributeError):
        return None
    tp = (config.get("parallelism") or {}).get("tp", 1)
    return tp if isinstance(tp, int) and tp >= 1 else None


def reorder_gate_up(weight: torch.Tensor, from_tp: int, to_tp: int) -> torch.Tensor:
    """The rows of a whole gate_up tensor stored by a ``from_tp`` run, in the order a ``to_tp`` run stores them."""
    canonical = gate_up_in_model_order(weight, from_tp) if from_tp > 1 else weight
    return gate_up_interleaved(canonical, to_tp) if to_tp > 1 else canonical


def load_state(state: dict[str, Any], path: Path, tp: int, load: Callable[[dict[str, Any]], None]) -> int:
    """Read the checkpoint at ``path`` into ``state`` in place (``model``, and ``optimizer`` from get_state_dict).

    Args:
        state: This rank's state dicts in this run's layout.
        path: The checkpoint.
        tp: This run's TP degree.
        load: Reads a (partial) state dict from the checkpoint in place; collective, as DCP's load.

    Returns:
        How many parameters' fp32 masters the checkpoint lacks: removed from ``state["optimizer"]``, for the
        optimizer to start from the weights.
    """
    stored = set(safe_load.read_metadata(path).state_dict_metadata)
    optim = state["optimizer"]["state"]
    no_master = [f for f, st in optim.items() if "master" in st and f"optimizer.state.{f}.master" not in stored]
    for fqn in no_master:
        del optim[fqn]["master"]
    direct = {"model": dict(state["model"]), "optimizer": {"state": {f: dict(st) for f, st in optim.items()}}}
    from_tp = written_tp(path) or tp
    layers = sorted(k for k in state["model"] if k.endswith(GATE_UP)) if from_tp != tp else []
    for fqn in layers:  # read below, one layer at a time
        del direct["model"][fqn]
        for name, t in optim.get(fqn, {}).items():
            if t.ndim:
                del direct["optimizer"]["state"][fqn][name]
    load(direct)
    for fqn in layers:  # every rank the same number of loads: each is collective
        targets = {"model": {fqn: state["model"][fqn]}}
        if fqn in optim:  # under ZeRO-1, on the rank that owns it
            targets["optimizer"] = {"state": {fqn: {n: t for n, t in optim[fqn].items() if t.ndim}}}
        whole = _whole_like(targets)
        load(whole)
        _copy_shards(targets, whole, lambda t: reorder_gate_up(t, from_tp, tp))
    return len(no_master)


def _whole_like(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` with each tensor replaced by an empty CPU tensor of its global shape and dtype."""
    if isinstance(tree, dict):
        return {k: _whole_like(v) for k, v in tree.items()}
    return torch.empty(tree.shape, dtype=tree.dtype)


def _copy_shards(targets: Any, whole: Any, reorder: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Copy each reordered whole tensor into its target: this rank's shard of a DTensor, or all of a plain tensor."""
    if isinstance(targets, dict):
        for k, t in targets.items():
            _copy_shards(t, whole[k], reorder)
        return
    full = reorder(whole)
    with torch.no_grad():
        if isinstance(targets, DTensor):  # src_data_rank=None: slice locally, no scatter
            local = targets.to_local()
            shard = distribute_tensor(
                full.to(local.device), targets.device_mesh, targets.placements, src_data_rank=None
            )
            local.copy_(shard.to_local())
        else:
            targets.copy_(full)
