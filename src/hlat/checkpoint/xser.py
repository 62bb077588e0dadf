"""Reading a neuron-backend checkpoint (NxD's xser files) as full tensors, without torch_xla.

A neuron step directory holds what ``nxd.save_checkpoint(use_xser=True)`` writes (NxD 0.17's
``trainer/checkpoint.py``): per tensor-parallel rank t and pipeline stage s
``model/dp_rank_00_tp_rank_TT_pp_rank_SS.pt`` and ``optim/dp_rank_DD_tp_rank_TT_pp_rank_SS.pt`` (DD > 0 only
under ZeRO-1), each a pickled state dict whose tensors are torch-xla ``TensorReference(tid)`` objects, with each
tensor in ``<file>.tensors/tensor_<tid>.pt`` and its shape and dtype in ``<file>.info.pt``; beside them hlat's
``extra.rank<r>.pt`` and ``manifest.json``.

``NeuronCheckpoint`` lists and reads its tensors under the torch backend's names and full shapes
(``model.<param>``, ``optimizer.state.<param>.{step,exp_avg,exp_avg_sq,master}``), one at a time; the cuts are
``hlat.backends.neuron_shards``. The pickles are read with ``weights_only``: nothing in them can run code.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hlat.backends.base import EXTRA
from hlat.backends.neuron_shards import hlat_name, nxd_name, optimizer_order, tp_gather, tp_split, zero1_gather
from hlat.checkpoint import ranges
from hlat.checkpoint.hf_layout import check_tensors, expected_shapes
from hlat.checkpoint.manifest import problems
from hlat.config import ConfigError, PrecisionConfig, RunConfig

log = logging.getLogger(__name__)

MOMENTS = ("exp_avg", "exp_avg_sq")
STATE_KEYS = ("step", *MOMENTS)
"""What AdamW keeps per parameter, in NxD's (and torch's) order."""


class TensorReference:
    """Stands for ``torch_xla.utils.serialization.TensorReference``, under that name in the pickles."""

    def __init__(self, tid: int) -> None:
        self.tid = tid

    def __repr__(self) -> str:
        return f"TensorReference({self.tid})"


TensorReference.__module__ = "torch_xla.utils.serialization"  # what the pickles name; see ``xser_write._Pickler``


def rank_file(part: str, dp: int, tp: int, pp: int) -> str:
    """NxD's file of ``part`` (``model`` or ``optim``) for one rank (``_get_path``)."""
    return f"{part}/dp_rank_{dp:02d}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def tensor_file(ref_file: Path, tid: int) -> Path:
    """Where xser keeps tensor ``tid`` of ``ref_file``."""
    return ref_file.with_name(ref_file.name + ".tensors") / f"tensor_{tid}.pt"


def load_pickle(path: Path) -> Any:
    """A torch pickle of plain data, xser's tensor references allowed (``weights_only``: no code runs)."""
    with torch.serialization.safe_globals([TensorReference]):
        return torch.load(path, map_location="cpu", weights_only=True)


def canonical_dtype(key: str, precision: PrecisionConfig) -> torch.dtype:
    """The dtype the torch backend holds tensor ``key`` in under ``precision`` (weights, moments, masters, steps)."""
    if key.startswith("model."):
        return getattr(torch, precision.param_dtype)
    if key.endswith((".step", ".master")):
        return torch.float32
    return getattr(torch, precision.optimizer_dtype)


def disk_dtype(key: str, precision: PrecisionConfig) -> torch.dtype:
    """The host dtype NxD saves tensor ``key`` in: fp32, or float64 for the optimizer's fp32 tensors.

    float64 under ``XLA_DOWNCAST_BF16`` (bf16 parameters with fp32 masters): the device's fp32 is float64 on the host.
    """
    if key.startswith("model.") or key.endswith(".step"):
        return torch.float32
    return torch.float64 if precision.param_dtype == "bfloat16" and precision.master_weights else torch.float32


@dataclass(frozen=True)
class Layout:
    """The NxD layout a neuron checkpoint was written in."""

    tp: int
    pp: int
    dp: int
    zero1: bool

    def ranks(self) -> Iterator[tuple[int, int, int]]:
        """``(dp, tp, pp)`` of every rank, in NxD's global rank order (pp outermost, tp innermost)."""
        for s in range(self.pp):
            for d in range(self.dp):
                for t in range(self.tp):
                    yield d, t, s


def saved_layout(path: Path, config: RunConfig) -> Layout:
    """The layout of the neuron checkpoint at ``path`` written with ``config``.

    The data-parallel degree is not in the config (it is the world over tp x pp): ZeRO-1's optimizer files per rank,
    else the ranks' extra files over tp x pp.
    """
    par = config.parallelism
    if par.zero1:
        dp = len(list(path.glob("optim/dp_rank_*_tp_rank_00_pp_rank_00.pt")))
    else:
        dp = len(list(path.glob("extra.rank*.pt"))) // (par.tp * par.pp)
    return Layout(par.tp, par.pp, max(dp, 1), par.zero1)


@dataclass(frozen=True)
class _Param:
    """Where one parameter lives: its stage, its optimizer index there, the shape of each tp rank's piece.

    The index is the same on every tp rank: they hold the same parameters.
    """

    stage: int
    index: int
    pieces: tuple[torch.Size, ...]


class NeuronCheckpoint:
    """A neuron-backend step directory as full tensors: ``tensors()`` lists them, ``read(name)`` reads one.

    Args:
        path: The ``step_N`` directory.
        config: The config it was written with (default: its ``manifest.json``'s).
        verify: Check the manifest's sizes and sha256s first (the resume path has checked them already).
        every_file: Check that every rank's files and the tensors they reference are there, with the shapes of the
            config, before anything is read. False for a reader of a few ranks' pieces, which checks each file as it
            reads it (``xser_reshard``): on a thousand ranks each would otherwise list the whole checkpoint.
        mapped: Map each stored tensor from its file rather than read it into new memory (copy on write): the
            pieces are gathered into a new tensor, or copied by the writer that takes them, before they are
            dropped, so a mapping spares a copy and the page faults of new memory. False: read with ``read(2)``
            (what a test counts in the kernel's read bytes).

    Raises:
        ConfigError: The directory is damaged or incomplete, or its tensors do not fit its config (names listed).
    """

    def __init__(
        self,
        path: Path,
        config: RunConfig | None = None,
        *,
        verify: bool = True,
        every_file: bool = True,
        mapped: bool = True,
    ) -> None:
        self.path, self.mapped = Path(path), mapped
        if verify:
            bad = problems(self.path, checksums=True)
            if bad:
                raise ConfigError(f"neuron checkpoint {self.path} is damaged or incomplete: {'; '.join(bad[:4])}")
        if config is None:
            from hlat.checkpoint.saved_config import run_config

            config = run_config(self.path)
        if config.cluster.backend != "neuron":
            raise ConfigError(
                f"checkpoint {self.path} was written by the {config.cluster.backend} backend, not NxD: read it with "
                "the torch backend's reader"
            )
        self.config = config
        self._pickles: dict[Path, Any] = {}
        self.layout = saved_layout(self.path, config)
        if every_file:
            self._check_files()
        self._params = self._index(every_file)
        self._tensors = self._list()

    def _file(self, part: str, dp: int, tp: int, pp: int) -> Path:
        f = self.path / rank_file(part, dp, tp, pp)
        if not f.is_file():
            raise ConfigError(
                f"neuron checkpoint {self.path} has no {f.relative_to(self.path)}, which its layout "
                f"({self.layout}) needs: it is incomplete"
            )
        return f

    def _check_files(self) -> None:
        """Refuse a checkpoint missing a rank's file or a tensor one references, before anything is read."""
        lay = self.layout
        for d, t, s in lay.ranks():
            for part, dp in (("model", 0), ("optim", d if lay.zero1 else 0)):
                f = self._file(part, dp, t, s)
                missing = [r.tid for r in _references(self._pickle(f)) if not tensor_file(f, r.tid).is_file()]
                if missing:
                    raise ConfigError(
                        f"neuron checkpoint {self.path} is incomplete: {f.relative_to(self.path)} references tensors "
                        f"{missing[:8]} that are not in its .tensors directory"
                    )

    def _index(self, check_pieces: bool) -> dict[str, _Param]:
        """Every parameter's place, from each stage's tp-rank-0 files; their shapes checked against the config."""
        cfg, lay = self.config.model, self.layout
        full = expected_shapes(cfg)
        found: dict[str, _Param] = {}
        for s in range(lay.pp):
            names = [hlat_name(k) for k in self._pickle(self._file("model", 0, 0, s))]
            unknown = [n for n in names if n not in full]
            if unknown:  # never dropped: a tensor hlat does not know stops the reading
                raise ConfigError(
                    f"neuron checkpoint {self.path}: stage {s} holds tensors hlat's model has not: {unknown[:8]}"
                )
            twice = [n for n in names if n in found]
            if twice:
                raise ConfigError(f"neuron checkpoint {self.path}: {twice[:8]} are held by more than one stage")
            order = optimizer_order(names, [len(full[n]) for n in names], self.config.optimizer.decay_norms_and_biases)
            self._check_groups(s, names, full)
            for name in names:
                meta = torch.empty(full[name], device="meta")
                pieces = tuple(p.shape for p in tp_split(name, meta, cfg, lay.tp))
                found[name] = _Param(s, order.index(name), pieces)
        check_tensors({n: full[n] for n in found}, full, f"neuron checkpoint {self.path}")  # names missing
        if check_pieces:
            self._check_pieces(found)
        return found

    def _check_groups(self, stage: int, names: list[str], full: dict[str, torch.Size]) -> None:
        """Refuse optimizer files whose parameter groups are not ``hlat.optim.param_groups`` of the stage's names.

        The moments are found by their index in the groups: other groups would put them on other parameters.
        """
        decay_all = self.config.optimizer.decay_norms_and_biases
        matrices = sum(len(full[n]) >= 2 for n in names)
        want = [len(names)] if decay_all else [matrices, len(names) - matrices]
        got = [len(g["params"]) for g in self._optim(0, 0, stage)["param_groups"]]
        if got != want:
            raise ConfigError(
                f"neuron checkpoint {self.path}: stage {stage}'s optimizer has parameter groups of {got} parameters, "
                f"but optimizer.decay_norms_and_biases={decay_all} in its config gives {want}: it does not match its "
                "config"
            )

    def _check_pieces(self, params: dict[str, _Param]) -> None:
        """Refuse pieces whose stored shapes differ from the cut of the config's full shapes (names listed)."""
        wrong = []
        for s in range(self.layout.pp):
            for t in range(self.layout.tp):
                f = self._file("model", 0, t, s)
                info = load_pickle(_info(f))
                for key, ref in self._pickle(f).items():
                    name, p = hlat_name(key), params.get(hlat_name(key))
                    got = tuple(info[ref.tid]["shape"]) if ref.tid in info else None
                    if p is None:
                        wrong.append(f"{name} on tp rank {t} only")
                    elif got != tuple(p.pieces[t]):
                        wrong.append(f"{name} on tp rank {t}: {got} (expected {tuple(p.pieces[t])})")
        if wrong:
            raise ConfigError(f"neuron checkpoint {self.path} does not match its config: {wrong[:8]}")

    def _list(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        full, precision = expected_shapes(self.config.model), self.config.precision
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        optim = {s: self._optim(0, 0, s) for s in range(self.layout.pp)}
        for name in self._params:
            out[f"model.{name}"] = (tuple(full[name]), canonical_dtype(f"model.{name}", precision))
            index = self._params[name].index
            state = optim[self._params[name].stage]
            kept = (state.get("base_state") or state.get("state") or {}).get(index, {})
            keys = [k for k in STATE_KEYS if k in kept]
            unknown = sorted(set(kept) - set(STATE_KEYS))
            if unknown:
                raise ConfigError(
                    f"neuron checkpoint {self.path}: the optimizer state of {name} holds {unknown}, "
                    "which hlat does not know (AdamW keeps step, exp_avg, exp_avg_sq)"
                )
            if index in (state.get("sharded_master_weights") or {}):
                keys.append("master")
            for k in keys:
                key = f"optimizer.state.{name}.{k}"
                out[key] = ((), torch.float32) if k == "step" else (tuple(full[name]), canonical_dtype(key, precision))
        return out

    def _optim(self, dp: int, tp: int, pp: int) -> dict[str, Any]:
        return self._pickle(self._file("optim", dp, tp, pp))

    def _pickle(self, f: Path) -> Any:
        """The content of reference file ``f``, read once (they are small: one entry per tensor)."""
        if f not in self._pickles:
            self._pickles[f] = load_pickle(f)
        return self._pickles[f]

    # ------------------------------------------------------------------------------------------- the reader API

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Canonical name -> (full shape, dtype) of every tensor, in model order."""
        return dict(self._tensors)

    def read(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` on the CPU, in the dtype ``tensors()`` gives."""
        if name not in self._tensors:
            raise KeyError(f"{name} is not a tensor of neuron checkpoint {self.path}; it has {len(self._tensors)}")
        shape, dtype = self._tensors[name]
        model = name.startswith("model.")
        param = name.removeprefix("model.") if model else name.removeprefix("optimizer.state.").rpartition(".")[0]
        if name.endswith(".step"):
            return _load(self.stored(name, 0), self.mapped).reshape(shape).to(dtype)
        lay, rows = self.layout, self._params[param].pieces
        zero1 = lay.zero1 and not model
        pieces = [
            zero1_gather([_load(self.stored(name, t, d), self.mapped) for d in range(lay.dp)], rows[t][0])
            if zero1
            else _load(self.stored(name, t), self.mapped)
            for t in range(lay.tp)
        ]
        return tp_gather(param, pieces, self.config.model, ranges.empty).to(dtype).reshape(shape)

    def stored(self, name: str, t: int, d: int = 0) -> Path:
        """The file that holds tp rank ``t``'s piece of tensor ``name``.

        Under ZeRO-1, data-parallel rank ``d``'s chunk of an optimizer state (a step is stored whole on every rank).

        Raises:
            ConfigError: The file is not there: the checkpoint is incomplete.
        """
        if name.startswith("model."):
            param = name.removeprefix("model.")
            f = self._file("model", 0, t, self._params[param].stage)
            tid = self._pickle(f)[nxd_name(param)].tid
        else:
            param, _, key = name.removeprefix("optimizer.state.").rpartition(".")
            p = self._params[param]
            f = self._file("optim", d if self.layout.zero1 else 0, t, p.stage)
            state = self._pickle(f)
            refs = state["sharded_master_weights"] if key == "master" else state.get("base_state") or state["state"]
            tid = (refs[p.index] if key == "master" else refs[p.index][key]).tid
        out = tensor_file(f, tid)
        if not out.is_file():
            raise ConfigError(f"neuron checkpoint {self.path} has no {out.relative_to(self.path)}: it is incomplete")
        return out

    def stored_info(self, f: Path) -> dict[str, Any] | None:
        """The shape and dtype NxD's info file records of stored tensor ``f`` (None: no info file says)."""
        info = _info(f.parent.with_name(f.parent.name.removesuffix(".tensors")))
        if not info.is_file():
            return None
        return self._pickle(info).get(int(f.stem.removeprefix("tensor_")))

    def extra(self, dp_rank: int = 0) -> dict[str, Any]:
        """The small per-run state of the first rank of data-parallel replica ``dp_rank`` (rank 0's by default)."""
        rank = dp_rank * self.layout.tp  # NxD's rank order: tp innermost, then dp, then pp
        return torch.load(self.path / EXTRA.format(rank=rank), map_location="cpu", weights_only=True)


def _load(f: Path, mapped: bool) -> torch.Tensor:
    """One stored tensor, whole (``weights_only``), mapped from its file or read."""
    return torch.load(f, map_location="cpu", weights_only=True, mmap=mapped)


def _references(obj: Any) -> Iterator[TensorReference]:
    """Every tensor reference in a reference file's content."""
    if isinstance(obj, TensorReference):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _references(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _references(v)


def _info(ref_file: Path) -> Path:
    return ref_file.with_name(ref_file.name + ".info.pt")
