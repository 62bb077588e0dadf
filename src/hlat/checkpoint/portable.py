"""Checkpoints in the layout-free form: readers and streaming writers of torch DCP step dirs and Hugging Face dirs.

The canonical form is what the torch backend saves at TP=1, PP=1: ``model.<name>`` and
``optimizer.state.<name>.{step,exp_avg,exp_avg_sq[,master]}``, full shapes, the backend's dtypes. A reader lists
them (``tensors``) and hands out one at a time (``read``), with the run's ``config`` and rank 0's small state
(``extra``); the writers ask for one tensor at a time and read the next while one is written, so a conversion
holds about two tensors, never the model.
May import: ``hlat.config``, the core, ``hlat.backends.torch``, the rest of ``hlat.checkpoint``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from hlat import checkpoint as ckpt
from hlat import safe_load
from hlat.backends.torch.dist import gate_up_in_model_order
from hlat.backends.torch.precision import DTYPE, build_optimizer
from hlat.checkpoint import dcp_stream, ranges, safetensors_io
from hlat.checkpoint.hf_layout import (
    IGNORED,
    check_tensors,
    expected_shapes,
    from_hf_one,
    hf_names,
    hlat_names,
    model_config_from_hf,
    to_hf,
    to_hf_one,
)
from hlat.checkpoint.weights import EXTRA, model_config, run_config
from hlat.checkpoint.writer import ahead, unmap_freed_tensors
from hlat.config import ConfigError, ModelConfig, OptimizerConfig, RunConfig, TrainConfig
from hlat.model import Transformer
from hlat.optim import param_groups

Spec = safetensors_io.Spec
STATE = "optimizer.state."


class Reader(Protocol):
    """A checkpoint in the canonical form, read one tensor at a time."""

    config: RunConfig

    def tensors(self) -> dict[str, Spec]:
        """Canonical name -> (full shape, dtype) of every tensor it holds."""
        ...

    def read(self, name: str) -> torch.Tensor:
        """That one full tensor, on CPU, in a storage the caller may free."""
        ...

    def extra(self) -> dict[str, Any]:
        """Rank 0's small state (train state, loader state, spikes, job record); empty for weights only."""
        ...


def canonical_tensors(cfg: RunConfig, *, optimizer: bool = True) -> dict[str, Spec]:
    """Name -> (shape, dtype) of everything the torch backend saves for ``cfg`` at TP=1 (``optimizer``: AdamW too)."""
    p = cfg.precision
    shapes = {k: tuple(s) for k, s in expected_shapes(cfg.model).items()}
    out: dict[str, Spec] = {f"model.{k}": (s, DTYPE[p.param_dtype]) for k, s in shapes.items()}
    if optimizer:
        moments = DTYPE[p.optimizer_dtype]
        for k, s in shapes.items():
            out |= {f"{STATE}{k}.step": ((), torch.float32), f"{STATE}{k}.exp_avg": (s, moments)}
            out[f"{STATE}{k}.exp_avg_sq"] = (s, moments)
            if p.master_weights:
                out[f"{STATE}{k}.master"] = (s, torch.float32)
    return out


def listed(names: list[str], limit: int = 8) -> str:
    """Up to ``limit`` names, and how many more."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{', '.join(names[:limit])}{more}"


def check_canonical(reader: Reader, where: str, *, dtypes: bool = True) -> bool:
    """ConfigError naming every missing, unknown or misshapen tensor; returns whether optimizer state is there.

    Weights alone (an import, a HF directory) are whole too, in any floating dtype. With ``dtypes``, optimizer
    state and the weights beside it must have the dtypes of the recorded precision (a resume would cast them).
    """
    have = reader.tensors()
    optimizer = any(n.startswith("optimizer.") for n in have)
    want = canonical_tensors(reader.config, optimizer=optimizer)
    both = sorted(set(want) & set(have))
    problems = {
        "missing": sorted(set(want) - set(have)),
        "unknown": sorted(set(have) - set(want)),
        "wrong shape": [f"{k} {have[k][0]} (expected {want[k][0]})" for k in both if have[k][0] != want[k][0]],
        "wrong dtype": [
            f"{k} {have[k][1]} (expected {want[k][1]})"
            for k in both
            if (have[k][1] != want[k][1] if optimizer and dtypes else not have[k][1].is_floating_point)
        ],
    }
    said = [f"{what}: {listed(names)}" for what, names in problems.items() if names]
    if said:
        raise ConfigError(
            f"{where} does not hold the tensors of its config (model {reader.config.model.name}): {'; '.join(said)}. "
            "Nothing was written; convert a checkpoint as hlat wrote it"
        )
    return optimizer


# ------------------------------------------------------------------------------------------------ readers


def weights_config(model: ModelConfig) -> RunConfig:
    """The config of weights alone: the model's, the rest defaults (a context no longer than the model's)."""
    train = TrainConfig(seq_len=min(TrainConfig().seq_len, model.max_seq_len))
    return RunConfig(model=model, train=train, optimizer=OptimizerConfig(warmup_steps=0))


class TorchCheckpoint:
    """A torch-backend step directory (DCP), verified by its manifest's checksums before anything is read."""

    def __init__(self, path: Path) -> None:
        bad = ckpt.problems(path, checksums=True)
        if bad:
            raise ConfigError(f"checkpoint {path} is damaged ({'; '.join(bad)}); nothing was written")
        md = safe_load.read_metadata(path)  # refuses pickled code, names the file
        listed_files = set((ckpt.manifest(path) or {})["files"])
        absent = sorted({s.relative_path for s in md.storage_data.values()} - listed_files)
        if absent:
            raise ConfigError(f"checkpoint {path}: its .metadata points at {absent}, which its manifest does not list")
        weights_only = (ckpt.manifest(path) or {}).get("weights_only")
        self.path, self.config = path, weights_config(model_config(path)) if weights_only else run_config(path)
        self.tp = self.config.parallelism.tp
        self._md = md
        self._tensors = {
            k: (tuple(m.size), m.properties.dtype)
            for k, m in md.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)
        }

    def tensors(self) -> dict[str, Spec]:
        return dict(self._tensors)

    def read(self, name: str) -> torch.Tensor:
        shape, dtype = self._tensors[name]
        t = self._ranged(name, shape, dtype)
        if t is None:  # not stored as plain records: DCP's own reading, every item checked
            t = torch.empty(shape, dtype=dtype)
            with warnings.catch_warnings():  # "torch.distributed is disabled": one process, as intended
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
                safe_load.load({name: t}, self.path, no_dist=True)
        if self.tp > 1 and _gate_up(name):  # a TP run saves gate_up rows as [gate_0; up_0; gate_1; up_1; ...]
            t = gate_up_in_model_order(t, self.tp)
        return t

    def _ranged(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Tensor ``name`` with each saved chunk's bytes read straight into place, or mapped (None: not stored so).

        DCP appends each chunk to its ``.distcp`` file as a ``torch.save`` zip; its metadata (read and checked once,
        in ``__init__``) says where, and the zip's directory where the bytes start (``hlat.checkpoint.ranges``). DCP's
        own path reads each chunk, unpickles it and copies it into place: three copies and a planning round a tensor.
        """
        meta = self._md.state_dict_metadata[name]
        chunks = meta.chunks  # type: ignore[union-attr]
        out: torch.Tensor | None = None
        for chunk in chunks:
            info = self._md.storage_data.get(MetadataIndex(name, chunk.offsets))
            if info is None or getattr(info, "transform_descriptors", None):
                return None
            whole = not any(chunk.offsets) and tuple(chunk.sizes) == tuple(shape)
            nbytes = math.prod(chunk.sizes) * dtype.itemsize
            f = self.path / info.relative_path
            with open(f, "rb") as fh:
                start = ranges.data_offset(fh, nbytes, info.offset, info.length)
                if start is None:
                    return None
                if whole and len(chunks) == 1 and nbytes:
                    return ranges.mapped(fh, start, shape, dtype)  # the page cache in place: nothing copied
                out = ranges.empty(shape, dtype) if out is None else out
                into = out if whole else ranges.empty(tuple(chunk.sizes), dtype)
                ranges.pread_into(fh.fileno(), ranges.writable(into), start, f)
            if not whole:
                out[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))] = into
        return out

    def extra(self) -> dict[str, Any]:
        f = self.path / EXTRA
        return torch.load(f, map_location="cpu", weights_only=True) if f.is_file() else {}


def _gate_up(name: str) -> bool:
    """Whether ``name`` is a gate_up weight or optimizer state shaped like one (row-ordered like it; not the step)."""
    return ".mlp.gate_up.weight" in name and not name.endswith(".step")


class HFCheckpoint:
    """A Hugging Face ``LlamaForCausalLM`` directory (safetensors, one file or sharded): the weights alone."""

    def __init__(self, path: Path) -> None:
        model = model_config_from_hf(_json(path / "config.json"), path.resolve().name)
        self.path, self.config = path, weights_config(model)
        index = path / safetensors_io.INDEX
        if index.is_file():
            files = sorted(set(_json(index).get("weight_map", {}).values()))
        elif (path / safetensors_io.SINGLE).is_file():
            files = [safetensors_io.SINGLE]
        else:
            raise ConfigError(
                f"{path} has no {safetensors_io.SINGLE} or {safetensors_io.INDEX}: no safetensors weights"
            )
        absent = [f for f in files if not (path / f).is_file()]
        if absent:
            raise ConfigError(f"{path}: its index names {absent}, which are not there; the download is incomplete")
        self._file: dict[str, str] = {}
        self._hf: dict[str, Spec] = {}
        for f in files:
            for name, spec in safetensors_io.read_header(path / f).items():
                if not name.endswith(IGNORED):
                    self._file[name], self._hf[name] = f, spec
        meta = {k: torch.empty(s, device="meta") for k, s in expected_shapes(model).items()}
        want = {k: v.shape for k, v in to_hf(model, meta).items()}
        check_tensors({k: torch.Size(s) for k, (s, _) in self._hf.items()}, want, str(path))

    def tensors(self) -> dict[str, Spec]:
        shapes = expected_shapes(self.config.model)
        return {f"model.{k}": (tuple(shapes[k]), self._hf[hf_names(k)[0]][1]) for k in hlat_names(self.config.model)}

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        parts = []
        for n in hf_names(name.removeprefix("model.")):
            with safe_open(str(self.path / self._file[n]), framework="pt") as f:
                parts.append(f.get_tensor(n))
        return from_hf_one(self.config.model, name.removeprefix("model."), parts).clone()

    def extra(self) -> dict[str, Any]:
        return {}


def _json(path: Path) -> dict[str, Any]:
    """A JSON object file; ConfigError naming it if it is not one."""
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON ({e}); the directory is damaged") from e
    if not isinstance(out, dict):
        raise ConfigError(f"{path} holds a JSON {type(out).__name__}, not an object; the directory is damaged")
    return out


# ------------------------------------------------------------------------------------------------ writers


def optimizer_param_groups(cfg: RunConfig) -> list[dict[str, Any]]:
    """The torch backend's AdamW ``param_groups`` for ``cfg`` as it saves them (parameter names, not indices).

    Built from empty stand-ins of the parameters: the groups depend on the config and the parameter names only.
    """
    with torch.device("meta"):
        model = Transformer(cfg.model)
    name = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups(model, cfg.optimizer)
    dtype = DTYPE[cfg.precision.param_dtype]
    stand_ins = [
        {**g, "params": [torch.nn.Parameter(torch.empty(0, dtype=dtype)) for _ in g["params"]]} for g in groups
    ]
    saved = build_optimizer(stand_ins, cfg.optimizer, cfg.precision, cfg.train.seed).state_dict()["param_groups"]
    order = [name[id(p)] for g in groups for p in g["params"]]
    return [{**g, "params": [order[i] for i in g["params"]]} for g in saved]


def torch_config(cfg: RunConfig) -> dict[str, Any]:
    """The config a converted torch checkpoint records: ``cfg`` on the torch backend with the TP=1, PP=1 layout."""
    out = dataclasses.asdict(cfg)
    out["cluster"]["backend"] = "torch"
    out["parallelism"] |= {"tp": 1, "pp": 1, "sequence_parallel": False}
    return out


def write_torch(
    reader: Reader, out: Path, *, optimizer: bool, meta: dict[str, Any], files: dict[str, Path] | None = None
) -> list[str]:
    """Write ``reader``'s tensors as a torch-backend step directory into ``out`` (DCP, rank 0's extra, manifest).

    Without optimizer state it is a weights-only checkpoint (``train.init_from``), as ``hlat import`` writes.
    ``meta``: more manifest keys (the source, a tokenizer file's name); ``files``: name -> file to copy in.
    """
    unmap_freed_tensors()
    specs = reader.tensors()
    model = {
        k.removeprefix("model."): torch.empty(s, dtype=d, device="meta")
        for k, (s, d) in specs.items()
        if k.startswith("model.")
    }
    state: dict[str, Any] = {"model": model}
    if optimizer:
        per_param: dict[str, dict[str, torch.Tensor]] = {}
        for k, (s, d) in specs.items():
            if k.startswith(STATE):
                param, _, key = k.removeprefix(STATE).rpartition(".")
                per_param.setdefault(param, {})[key] = torch.empty(s, dtype=d, device="meta")
        state["optimizer"] = {"state": per_param, "param_groups": optimizer_param_groups(reader.config)}
    digests = dcp_stream.save(state, out, reader.read)
    config = torch_config(reader.config) if optimizer else {"model": dataclasses.asdict(reader.config.model)}
    extra = reader.extra()
    if extra:
        torch.save(extra, out / EXTRA)
    for name, f in (files or {}).items():
        shutil.copyfile(f, out / name)
    step = (extra.get("train_state") or {}).get("step", 0)
    meta = {"step": step, **meta, "config": config, "config_hash": ckpt.config_hash(config)}
    if not optimizer:
        meta["weights_only"] = True
    return write_manifest(out, meta, digests)


def write_manifest(out: Path, meta: dict[str, Any], digests: dict[Path, tuple[int, str]] | None = None) -> list[str]:
    """``manifest.json`` last, as the Checkpointer writes it: every file's size and sha256, and ``meta``.

    ``digests``: size and sha256 of the files hashed as they were written; the others are read.
    """
    files = {}
    for p in sorted(out.rglob("*")):
        if p.is_file():
            size, digest = (digests or {}).get(p) or (p.stat().st_size, ckpt.sha256(p))
            files[str(p.relative_to(out))] = {"size": size, "sha256": digest}
    (out / ckpt.MANIFEST).write_text(json.dumps({**meta, "files": files}, indent=1) + "\n")
    return [*files, ckpt.MANIFEST]


def hf_specs(reader: Reader, dtype: torch.dtype | None) -> dict[str, Spec]:
    """HF name -> (shape, dtype) of the HF weights of ``reader``'s model tensors, in the order they are produced."""
    cfg, out = reader.config.model, {}
    specs = reader.tensors()
    for k in hlat_names(cfg):
        shape, stored = specs[f"model.{k}"]
        meta = to_hf_one(cfg, k, torch.empty(shape, dtype=stored, device="meta"))
        out |= {n: (tuple(t.shape), dtype or stored) for n, t in meta.items()}
    return out


def hf_tensors(reader: Reader, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF weights of ``reader``, one hlat tensor read at a time (its HF parts in :func:`hf_specs`' order)."""
    cfg = reader.config.model
    for k in hlat_names(cfg):
        for n, t in to_hf_one(cfg, k, reader.read(f"model.{k}")).items():
            yield n, t.to(dtype) if dtype is not None else t


def write_hf_weights(reader: Reader, out: Path, *, dtype: torch.dtype | None, max_shard_bytes: int) -> list[str]:
    """The model's weights as HF safetensors in ``out`` (sharded with an index past ``max_shard_bytes``)."""
    unmap_freed_tensors()
    tensors = ahead(hf_tensors(reader, dtype))  # the next tensor read and converted while one is written
    return safetensors_io.write_sharded(out, hf_specs(reader, dtype), tensors, max_shard_bytes)
