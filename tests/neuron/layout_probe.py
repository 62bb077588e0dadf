"""Run under torchrun with NxD's CPU mode: build hlat's model through the real NxD in the layout the overrides
give, and compare every parameter this rank holds with the flat torch model of the same seed.

Prints one JSON line per rank: ``{"rank", "checked": [names], "differ": [names]}``. The expected value of a local
parameter is cut from the flat model's by NxD's own attributes: pipeline stages hold whole parameters (NxD's
``named_parameters`` yields the local stage only), tensor-parallel shards are the ``partition_dim`` / ``stride``
slices of ``create_local_weight``, and the fused ``weight_qkv`` is [q; k; v] of this rank's heads, cut from hlat's
group-interleaved qkv.
"""

from __future__ import annotations

import json
import sys

import torch

from hlat.backends.neuron import NeuronBackend
from hlat.config import ModelConfig
from hlat.config.compose import compose_run_config
from hlat.model import Transformer


def shard(full: torch.Tensor, dim: int, stride: int, rank: int, tp: int) -> torch.Tensor:
    """This rank's part of ``full`` as NxD's ``create_local_weight`` cuts it."""
    per = full.shape[dim] // tp // stride
    return torch.cat(full.split(per, dim=dim)[rank::tp], dim=dim)


def expected_qkv(full: torch.Tensor, cfg: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    """[q; k; v] of this rank's heads from the torch model's grouped ``qkv.weight``."""
    G, r, D = cfg.kv_heads, cfg.n_heads // cfg.kv_heads, cfg.head_dim
    g = full.view(G, r + 2, D, cfg.dim)
    q, k, v = g[:, :r].reshape(-1, cfg.dim), g[:, r].reshape(-1, cfg.dim), g[:, r + 1].reshape(-1, cfg.dim)
    return torch.cat([shard(t, 0, 1, rank, tp) for t in (q, k, v)])


def main(overrides: list[str]) -> None:
    cfg = compose_run_config(overrides)
    backend = NeuronBackend(cfg)
    env = backend.setup()  # sets NXD_CPU_MODE & co., imports NxD
    from neuronx_distributed.parallel_layers import parallel_state

    model = backend.build_model(backend.dims)
    flat = Transformer(cfg.model)
    flat.init_weights(cfg.train.seed)
    ref = dict(flat.named_parameters())
    tp, rank = parallel_state.get_tensor_model_parallel_size(), parallel_state.get_tensor_model_parallel_rank()
    checked, differ = [], []
    for name, p in model.named_parameters():
        if name.endswith("qkv.weight_qkv"):
            want = expected_qkv(ref[name.replace("weight_qkv", "weight")], cfg.model, rank, tp)
        elif getattr(p, "tensor_model_parallel", False) and tp > 1:
            want = shard(ref[name], p.partition_dim, p.partition_stride, rank, tp)
        else:
            want = ref[name]
        checked.append(name)
        if not torch.equal(p.detach().cpu(), want):
            differ.append(name)
    print(json.dumps({"rank": env.rank, "checked": checked, "differ": differ}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
