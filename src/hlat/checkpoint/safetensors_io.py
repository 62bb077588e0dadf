"""safetensors files read and written one tensor at a time, sharded as Hugging Face does for big models.

The format (github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, ``data_offsets`` into the data that follows; ``__metadata__``: strings), then the raw
bytes. The header depends on shapes and dtypes only, so it is written first and each tensor after it as it
comes: a writer holds one tensor, never the model. May import: ``hlat.config``, ``hlat.checkpoint.direct``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from hlat.checkpoint.direct import DirectFile, DirectIO
from hlat.config import ConfigError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
Spec = tuple[tuple[int, ...], torch.dtype]
"""A tensor's full shape and dtype."""


def nbytes(spec: Spec) -> int:
    """Bytes of a tensor of that shape and dtype."""
    shape, dtype = spec
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


def read_header(path: Path) -> dict[str, Spec]:
    """Name -> (shape, dtype) of the tensors of a safetensors file, checked against the file's size.

    Raises:
        ConfigError: The header is not readable, names a dtype hlat does not read, or the file is truncated.
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if 8 + n <= size else None
    except (OSError, ValueError, struct.error) as e:
        raise ConfigError(f"{path} is not a readable safetensors file ({e}); it is damaged") from e
    if not isinstance(header, dict):
        raise ConfigError(f"{path} is not a readable safetensors file (its header is cut off); it is damaged")
    out, end = {}, 0
    for name, rec in header.items():
        if name == "__metadata__":
            continue
        if rec.get("dtype") not in DTYPES:
            raise ConfigError(f"{path}: tensor {name} has dtype {rec.get('dtype')}; hlat reads {list(DTYPES)} only")
        out[name] = (tuple(rec["shape"]), DTYPES[rec["dtype"]])
        end = max(end, rec["data_offsets"][1])
    if 8 + n + end != size:
        raise ConfigError(f"{path} has {size} bytes but its header says {8 + n + end}: it is truncated or damaged")
    return out


def shard(specs: dict[str, Spec], max_bytes: int) -> list[list[str]]:
    """The names in order, cut into consecutive shards of at most ``max_bytes`` (a bigger tensor: its own shard)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, spec in specs.items():
        if shards[-1] and size + nbytes(spec) > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes(spec)
    return shards


def _header(specs: dict[str, Spec], names: list[str]) -> bytes:
    """The 8-byte length and the JSON header of a file holding ``names`` in that order, padded to 8 bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        shape, dtype = specs[name]
        header[name] = {
            "dtype": NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes(specs[name])],
        }
        offset += nbytes(specs[name])
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the library's writer does
    return struct.pack("<Q", len(raw)) + raw


def write_sharded(
    out: Path, specs: dict[str, Spec], tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> list[str]:
    """Write ``tensors`` (arriving in the order of ``specs``) into ``out`` as HF does; returns the files written.

    One file (``model.safetensors``) if everything fits in ``max_bytes``, else ``model-0000i-of-0000n.safetensors``
    and the index ``model.safetensors.index.json`` that maps each name to its file.
    """
    shards = shard(specs, max_bytes)
    files = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    arriving = iter(tensors)
    with DirectIO() as io:
        for file, names in zip(files, shards, strict=True):
            with DirectFile(out / file, io, digest=False) as f:  # synced as it closes
                f.write(_header(specs, names))
                for t in _take(arriving, names, specs):
                    f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    if len(files) > 1:
        weight_map = {name: file for file, names in zip(files, shards, strict=True) for name in names}
        index = {"metadata": {"total_size": sum(map(nbytes, specs.values()))}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        files.append(INDEX)
    return files


def _take(
    arriving: Iterator[tuple[str, torch.Tensor]], names: list[str], specs: dict[str, Spec]
) -> Iterator[torch.Tensor]:
    """The next ``len(names)`` tensors, each checked to be the one the header announced (a bug, not a user error)."""
    for want in names:
        name, t = next(arriving)
        if name != want or (tuple(t.shape), t.dtype) != specs[want]:
            raise RuntimeError(f"expected {want} {specs[want]}, got {name} {(tuple(t.shape), t.dtype)}")
        yield t.contiguous()
