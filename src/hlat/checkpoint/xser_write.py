"""Writing full tensors as a neuron-backend checkpoint in NxD's xser layout, for any TP, PP, DP and ZeRO-1.

The inverse of ``hlat.checkpoint.xser``: from any reader (``tensors()``, ``read(name)``, ``extra()``) it writes the
files ``nxd.save_checkpoint(use_xser=True)`` would have written for the target layout, so that NxD's
``load_checkpoint`` loads them, plus hlat's ``extra.rank<r>.pt`` and ``manifest.json``. Everything is checked before
the first file is written; the files go into ``<dst>.tmp`` and the directory is renamed when complete. Each rank's
piece comes from a :class:`~hlat.checkpoint.xser_reshard.Pieces` (cut from one full tensor at a time, or read as
byte ranges of a neuron checkpoint's pieces) and is written on a background thread while the next is made
(``hlat.checkpoint.writer``): about two tensors are in memory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pickle
import shutil
import types
from pathlib import Path
from typing import Any, Protocol

import torch

from hlat.backends.neuron_shards import nxd_name, optimizer_order, param_names, stage_of, tp_split
from hlat.checkpoint.hf_layout import check_tensors, expected_shapes
from hlat.checkpoint.manifest import MANIFEST, config_hash, sha256
from hlat.checkpoint.writer import Writer, unmap_freed_tensors
from hlat.checkpoint.xser import (
    EXTRA,
    STATE_KEYS,
    Layout,
    NeuronCheckpoint,
    TensorReference,
    disk_dtype,
    rank_file,
    saved_layout,
    tensor_file,
)
from hlat.checkpoint.xser_reshard import Cutter, Pieces, RangedPieces
from hlat.config import ConfigError, RunConfig
from hlat.parallel import ParallelDims

log = logging.getLogger(__name__)


class Reader(Protocol):
    """What the writer reads from: any checkpoint reader of ``hlat.checkpoint`` (names are the torch backend's)."""

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...

    def read(self, name: str) -> torch.Tensor: ...

    def extra(self) -> dict[str, Any]: ...


class _Pickler(pickle._Pickler):
    """Names ``xser.TensorReference`` as torch-xla's class, so that NxD's ``torch.load`` builds its own."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is TensorReference:
            self.write(pickle.GLOBAL + b"torch_xla.utils.serialization\nTensorReference\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)


_PICKLE = types.ModuleType("hlat_xser_pickle")
_PICKLE.Pickler, _PICKLE.Unpickler = _Pickler, pickle.Unpickler


def _check_source(have: dict[str, tuple], cfg: RunConfig, where: str) -> tuple[bool, bool]:
    """Refuse a source whose tensors do not fit ``cfg`` (names listed); (has optimizer state, has masters)."""
    full = expected_shapes(cfg.model)
    weights = {k.removeprefix("model."): torch.Size(v[0]) for k, v in have.items() if k.startswith("model.")}
    check_tensors(weights, full, where)
    state = {k for k in have if k.startswith("optimizer.state.")}
    unknown = sorted(set(have) - state - {f"model.{n}" for n in weights})
    keys = {k: k.removeprefix("optimizer.state.").rpartition(".") for k in state}
    unknown += sorted(k for k, (p, _, s) in keys.items() if p not in full or s not in (*STATE_KEYS, "master"))
    if unknown:  # never dropped silently
        raise ConfigError(f"{where} holds tensors a neuron checkpoint has no place for: {unknown[:8]}")
    want = {f"optimizer.state.{n}.{s}": full[n] if s != "step" else torch.Size() for n in full for s in STATE_KEYS}
    masters = {k for k in state if k.endswith(".master")}
    if state:
        got = {k: torch.Size(have[k][0]) for k in state - masters}
        check_tensors(got, want, f"{where} (optimizer state)")
    if masters and not cfg.precision.master_weights:
        raise ConfigError(
            f"{where} holds fp32 master weights, but precision={cfg.precision.name} keeps none "
            "(precision.master_weights=false): they would be lost; write it with precision=master_weights"
        )
    if masters and len(masters) != len(full):
        raise ConfigError(f"{where} holds fp32 master weights for {len(masters)} of {len(full)} parameters")
    return bool(state), bool(masters)


def write_neuron_checkpoint(
    source: Reader,
    dst: Path,
    cfg: RunConfig,
    *,
    dp: int = 1,
    rank: int | None = None,
    pieces: Pieces | None = None,
    fsync: bool = True,
    checksums: bool = True,
) -> Path:
    """Write ``source`` as a neuron step directory ``dst`` in the layout of ``cfg`` (tp, pp, zero1) with ``dp``.

    With ``rank``, only the files that global rank loads (a resharded resume: each rank writes its own). ``pieces``:
    where each rank's piece comes from (default: cut from the source's full tensors, each read once). ``fsync``:
    make the files durable before the directory is renamed into place (a resharded copy, read once, needs not).
    ``checksums``: record each file's sha256 in the manifest (a resharded copy, loaded at once by the rank that
    wrote it, records sizes only: hashing it would cost as much CPU as writing it).

    Masters missing from the source under ``precision.master_weights`` are widened from the weights (the one
    precision change with one meaning: bf16_sr -> master_weights). A source without optimizer state gives a
    weights-only checkpoint (``train.init_from`` takes it, ``train.resume`` does not).

    Raises:
        ConfigError: ``dst`` exists, or the source's tensors do not fit ``cfg`` (names listed); nothing is written.
    """
    dst = Path(dst)
    if dst.exists():
        raise ConfigError(f"{dst} exists: write the converted checkpoint to a new directory")
    par = cfg.parallelism
    if cfg.precision.master_weights and not par.zero1:  # NxD keeps fp32 masters inside ZeRO-1 only
        raise ConfigError("precision=master_weights on the neuron backend needs parallelism.zero1=true")
    layout = Layout(par.tp, par.pp, dp, par.zero1)
    has_state, has_masters = _check_source(source.tensors(), cfg, "the source checkpoint")
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if rank is None:  # a conversion: its own process (a resume's copy leaves the trainer's allocator as it is)
        unmap_freed_tensors()
    ranks = range(par.tp * par.pp * dp) if rank is None else [rank]
    try:
        pieces = pieces or Cutter(source.read, cfg.model, par.tp)
        largest = max(math.prod(s) * d.itemsize for s, d in source.tensors().values())
        with Writer(tmp, largest, fsync=fsync, digest=checksums) as files:  # a tensor written while the next is cut
            writer = _Writer(tmp, cfg, layout, pieces, {_place(r, layout) for r in ranks}, files)
            writer.model()
            if has_state:
                writer.optimizer(masters=cfg.precision.master_weights, widen=not has_masters)
        extra = source.extra()
        _save(extra, tmp / "user_content.pt")
        for r in ranks:
            _save(_rank_extra(source, extra, layout, r), tmp / EXTRA.format(rank=r))
        for marker in ("checkpoint", "done"):  # NxD's own markers of a complete tag
            (tmp / marker).write_text("1")
        _write_manifest(tmp, cfg, extra, files.digests, weights_only=not has_state, checksums=checksums)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # no partial output
        raise
    log.info("wrote neuron checkpoint %s (tp=%d, pp=%d, dp=%d, zero1=%s)", dst, par.tp, par.pp, dp, par.zero1)
    return dst


def _place(rank: int, layout: Layout) -> tuple[int, int, int]:
    """``(dp, tp, pp)`` of global ``rank`` in NxD's order (tp innermost, then dp, then pp)."""
    return (rank // layout.tp) % layout.dp, rank % layout.tp, rank // (layout.tp * layout.dp)


def _rank_extra(source: Reader, extra: dict[str, Any], layout: Layout, rank: int) -> dict[str, Any]:
    """The extra of target ``rank``: its data-parallel replica's where the source has the same dp, else rank 0's."""
    src_layout = getattr(source, "layout", None)
    dp_rank = (rank // layout.tp) % layout.dp
    if dp_rank and src_layout is not None and src_layout.dp == layout.dp:
        return source.extra(dp_rank)  # type: ignore[call-arg]
    return extra


def _save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path, pickle_module=_PICKLE)


def _write_manifest(
    tmp: Path,
    cfg: RunConfig,
    extra: dict[str, Any],
    digests: dict[Path, tuple[int, str | None]],
    *,
    weights_only: bool,
    checksums: bool = True,
) -> None:
    """``manifest.json`` last, as ``hlat.checkpoint.Checkpointer`` writes it: sizes, sha256s, the target config.

    The sha256s of the files in ``digests`` were taken as they were written; the few others are read. Without
    ``checksums``, sizes alone (a manifest's files may be name -> size).
    """
    files: dict[str, Any] = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file() and not checksums:
            files[str(p.relative_to(tmp))] = p.stat().st_size
        elif p.is_file():
            size, digest = digests.get(p) or (p.stat().st_size, sha256(p))
            files[str(p.relative_to(tmp))] = {"size": size, "sha256": digest}
    config = dataclasses.asdict(cfg)
    meta: dict[str, Any] = {"step": int((extra.get("train_state") or {}).get("step", 0)), "files": files}
    meta |= {"config": config, "config_hash": config_hash(config)}
    if weights_only:
        meta["weights_only"] = True
    with open(tmp / MANIFEST, "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())


class _Writer:
    """Writes one tensor's pieces at a time into the ranks' files, then each rank's reference and info files."""

    def __init__(
        self,
        root: Path,
        cfg: RunConfig,
        layout: Layout,
        pieces: Pieces,
        places: set[tuple[int, int, int]],
        files: Writer,
    ) -> None:
        self.root, self.cfg, self.layout, self.pieces, self.files = root, cfg, layout, pieces, files
        self.places = places
        """``(dp, tp, pp)`` of the ranks whose files are written (a model file serves every dp)."""
        names = param_names(cfg.model)
        self.full = expected_shapes(cfg.model)
        self.stages = [[n for n in names if stage_of(n, cfg.model, layout.pp) == s] for s in range(layout.pp)]
        decay_all = cfg.optimizer.decay_norms_and_biases
        self.order = [optimizer_order(ns, [len(self.full[n]) for n in ns], decay_all) for ns in self.stages]

    def _wanted(self, part: str, d: int, t: int, s: int) -> bool:
        """Whether a rank written loads file ``(part, d, t, s)`` (only ZeRO-1's optimizer files are per dp)."""
        if part == "optim" and self.layout.zero1:
            return (d, t, s) in self.places
        return any((t, s) == (pt, ps) for _, pt, ps in self.places)

    def _put(self, part: str, d: int, t: int, s: int, tid: int, tensor: torch.Tensor) -> None:
        whole = tensor.is_contiguous() and not tensor.storage_offset()
        if not whole or tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()  # a view would save its whole storage
        self.files.save(tensor, tensor_file(self.root / rank_file(part, d, t, s), tid))

    def _piece(self, name: str, key: str, t: int, d: int, *, widen: bool = False) -> torch.Tensor:
        """Tp rank ``t``'s piece of ``name``'s ``key`` (``model`` or an AdamW state; ZeRO-1: chunk ``d``), on disk.

        ``widen``: the fp32 master is the weight (bf16_sr -> master_weights).
        """
        lay = self.layout
        own = f"model.{name}" if key == "model" else f"optimizer.state.{name}.{key}"
        src = f"model.{name}" if key == "master" and widen else own
        chunks = lay.dp if lay.zero1 and key not in ("model", "step") else 1
        piece = self.pieces.piece(src, name, t, d, chunks)
        if key == "master":
            piece = piece.to(torch.float32)
        return piece.to(disk_dtype(own, self.cfg.precision))

    def model(self) -> None:
        for s, names in enumerate(self.stages):
            ts = [t for t in range(self.layout.tp) if self._wanted("model", 0, t, s)]
            info: dict[int, dict[int, dict]] = {t: {} for t in ts}
            for tid, name in enumerate(names if ts else []):
                for t in ts:
                    piece = self._piece(name, "model", t, 0)
                    self._put("model", 0, t, s, tid, piece)
                    info[t][tid] = _info(piece)
            for t in ts:
                refs = {nxd_name(n): TensorReference(tid) for tid, n in enumerate(names)}
                self._refs("model", 0, t, s, refs, info[t])

    def optimizer(self, *, masters: bool, widen: bool) -> None:
        lay = self.layout
        dps = lay.dp if lay.zero1 else 1
        keys = [*STATE_KEYS, "master"] if masters else list(STATE_KEYS)
        for s, order in enumerate(self.order):
            places = [(d, t) for t in range(lay.tp) for d in range(dps) if self._wanted("optim", d, t, s)]
            n = len(order)
            info: dict[tuple[int, int], dict[int, dict]] = {p: {} for p in places}
            for i, name in enumerate(order if places else []):
                for k, key in enumerate(keys):
                    tid = 3 * n + i if key == "master" else 3 * i + k
                    for d, t in places:
                        chunk = self._piece(name, key, t, d, widen=widen)
                        self._put("optim", d, t, s, tid, chunk)
                        info[d, t][tid] = _info(chunk)
            meta = {i: torch.empty(self.full[name], device="meta") for i, name in enumerate(order)}
            shapes = {i: list(tp_split(order[i], m, self.cfg.model, lay.tp)[0].shape) for i, m in meta.items()}
            groups = _param_groups(self.cfg, [len(g) for g in _groups(self.cfg, order)])
            for (d, t), tinfo in info.items():
                self._refs("optim", d, t, s, _optim_refs(n, groups, lay.zero1, masters, shapes), tinfo)

    def _refs(self, part: str, d: int, t: int, s: int, refs: dict, info: dict[int, dict]) -> None:
        ref_file = self.root / rank_file(part, d, t, s)
        self.files.save(refs, ref_file, pickle_module=_PICKLE)
        self.files.save(
            dict(sorted(info.items())), ref_file.with_name(ref_file.name + ".info.pt"), pickle_module=_PICKLE
        )


def _info(t: torch.Tensor) -> dict[str, Any]:
    return {"dtype": t.dtype, "shape": t.shape, "expert_model_parallel": False}


def _groups(cfg: RunConfig, order: list[str]) -> list[list[str]]:
    """The stage's parameter groups (``hlat.optim.param_groups``): one, or the matrices and the 1-D ones."""
    if cfg.optimizer.decay_norms_and_biases:
        return [order]
    full = expected_shapes(cfg.model)
    return [[n for n in order if len(full[n]) >= 2], [n for n in order if len(full[n]) < 2]]


def _param_groups(cfg: RunConfig, sizes: list[int]) -> list[dict[str, Any]]:
    """The ``param_groups`` of torch's AdamW as NxD saves them (indices for parameters, betas a list)."""
    o = cfg.optimizer
    decays = [o.weight_decay] if len(sizes) == 1 else [o.weight_decay, 0.0]
    dummy = [{"params": [torch.zeros(1)], "weight_decay": wd} for wd in decays]
    groups = torch.optim.AdamW(dummy, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps).state_dict()["param_groups"]
    start = 0
    for g, size in zip(groups, sizes, strict=True):
        g["params"], start = list(range(start, start + size)), start + size
        g["betas"] = list(g["betas"])
    return groups


def _optim_refs(n: int, groups: list[dict], zero1: bool, masters: bool, shapes: dict[int, list[int]]) -> dict[str, Any]:
    """The optimizer's state dict with tensor references: NxD's plain AdamW, or ZeRO-1's (torch-xla's layout)."""
    state = {i: {k: TensorReference(3 * i + j) for j, k in enumerate(STATE_KEYS)} for i in range(n)}
    if not zero1:
        return {"state": state, "param_groups": groups}
    refs: dict[str, Any] = {"state": {}, "param_groups": groups, "base_state": state, "shape_info": shapes}
    if masters:
        refs["sharded_master_weights"] = {i: TensorReference(3 * n + i) for i in range(n)}
    return refs


def resharded_copy(path: Path, cfg: RunConfig, dims: ParallelDims, rank: int) -> Path | None:
    """For a resume: this rank's files of neuron checkpoint ``path`` resharded to this run's layout (None: same).

    The layout is ``cfg`` and ``dims`` (TP, PP, DP, ZeRO-1); the copy goes in ``.<step>.resharded.rank<r>`` beside
    the checkpoint. NxD loads only the layout it saved; each rank writes what it loads (no collective), the
    checkpoint itself is not changed, and the caller removes the copy once loaded.
    """
    from hlat.checkpoint.saved_config import run_config

    try:
        saved_cfg = run_config(path)
    except ConfigError:  # written before manifests recorded the config: NxD loads it as it is, as before
        return None
    if saved_cfg.cluster.backend != "neuron":
        raise ConfigError(
            f"train.resume: {path} was written by the {saved_cfg.cluster.backend} backend, and the neuron backend "
            f"resumes NxD checkpoints only: convert it (hlat convert {path} <new dir> --to neuron) and resume from "
            f"that, or start a new run from its weights with train.init_from={path}"
        )
    saved = saved_layout(path, saved_cfg)
    now = Layout(dims.tp, dims.pp, dims.dp, cfg.parallelism.zero1)
    if saved == now:
        return None
    copy = path.with_name(f".{path.name}.resharded.rank{rank}")
    shutil.rmtree(copy, ignore_errors=True)
    if rank == 0:
        log.info("resharding %s from %s to this run's %s", path, saved, now)
    source = NeuronCheckpoint(path, saved_cfg, verify=False, every_file=False)  # it checks what it reads
    pieces = RangedPieces(source, cfg.model, dims.tp)  # this rank's byte ranges, never a whole tensor it does not hold
    write_neuron_checkpoint(source, copy, cfg, dp=dims.dp, rank=rank, pieces=pieces, fsync=False, checksums=False)
    log.log(
        logging.INFO if rank == 0 else logging.DEBUG,
        "rank %d read %.1f MiB of tensors from %s to hold %.1f MiB",
        rank,
        pieces.bytes_read / 2**20,
        path,
        _tensor_bytes(copy) / 2**20,
    )
    return copy


def _tensor_bytes(path: Path) -> int:
    """Bytes of the tensor files under ``path`` (a rank's resharded copy: what it holds, with their zip headers)."""
    return sum(f.stat().st_size for f in path.rglob("tensor_*.pt"))
