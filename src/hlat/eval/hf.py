"""Hugging Face LLaMA layout: export hlat checkpoints for other tools, import LLaMA-layout models to train on.

An export is what ``from_pretrained`` reads, with EOS as the start-of-sequence token (hlat packs documents as
``ids + [EOS]``; docs/evaluation.md). An import is a *weights-only* checkpoint: a ``train.init_from`` target, not a
``train.resume`` one. The mapping itself is ``hlat.checkpoint.hf_layout``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from hlat import checkpoint
from hlat.checkpoint import safetensors_io
from hlat.checkpoint.convert import atomic_dir, check_destination, open_checkpoint, source_dir
from hlat.checkpoint.hf_layout import DTYPES, SPM, hf_config, import_hf, model_overrides
from hlat.checkpoint.portable import HFCheckpoint, Reader, check_canonical, hf_specs, write_hf_weights, write_torch
from hlat.checkpoint.saved_config import config_from_dict
from hlat.checkpoint.weights import checkpoint_tokenizer
from hlat.checkpoint.xser_write import write_neuron_checkpoint
from hlat.config import ConfigError, ModelConfig, RunConfig
from hlat.eval.hf_tokenizer import write_tokenizer

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ export


def _spm_prefix(spm_path: Path) -> bool:
    """Whether the sentencepiece model adds a dummy "▁" prefix; ConfigError unless it is BPE (HF's LlamaTokenizer)."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # needs protobuf (mlflow brings it); without it, assume hlat's recipe
        return True
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(spm_path.read_bytes())
    if proto.trainer_spec.model_type != proto.trainer_spec.BPE:
        raise ConfigError(
            f"{spm_path} is not a BPE sentencepiece model (data.tokenizer_type=unigram?): HF's LlamaTokenizer "
            "would tokenize differently; export works for BPE tokenizers only"
        )
    return proto.normalizer_spec.add_dummy_prefix


def _write_tokenizer(spm_path: Path, out: Path, max_len: int) -> int:
    """Copy the sentencepiece model and write HF's tokenizer files (``hlat.eval.hf_tokenizer``); returns the EOS id."""
    from hlat.data.tokenizer import Tokenizer

    sp = Tokenizer(spm_path, num_threads=1).processor
    ids = {"eos_token": sp.eos_id(), "unk_token": sp.unk_id()}  # -1: none
    if ids["eos_token"] < 0:
        raise ConfigError(f"{spm_path} has no EOS piece: hlat separates documents with EOS, so no model trained on it")
    shutil.copyfile(spm_path, out / SPM)
    write_tokenizer(spm_path, out, max_len, {k: sp.id_to_piece(i) for k, i in ids.items() if i >= 0})
    return ids["eos_token"]


TARGETS = ("torch", "neuron", "hf")
SHARD_BYTES = 5 * 10**9
"""Largest safetensors file of a HF export (transformers' ``max_shard_size`` default, 5GB); past it, shards + index."""
KEPT = ("files", "step", "config", "config_hash", "weights_only", "tokenizer", "source")
"""Manifest keys a conversion writes anew; the source's other keys are carried."""


def convert(
    src: str | Path,
    dst: str | Path,
    to: str,
    *,
    tokenizer: Path | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Convert the checkpoint ``src`` into the new directory ``dst`` in the format ``to``, one tensor at a time.

    ``src``: an hlat step directory (or a checkpoints root: its newest intact one) or a HF model directory.
    ``to``: ``torch`` (a step directory with the optimizer state, or weights only), ``neuron``, or ``hf`` (weights,
    config and tokenizer; ``dtype`` default: as stored). The source is verified whole before anything is written.

    Raises:
        ConfigError: A damaged or partial source, tensors that do not fit its config, an existing ``dst``, ...
    """
    if to not in TARGETS:
        raise ConfigError(f"--to {to}: convert to one of {', '.join(TARGETS)}")
    if dtype is not None and (to != "hf" or dtype not in DTYPES):
        raise ConfigError(f"--dtype {dtype}: only --to hf takes a dtype, one of {list(DTYPES)}")
    src_dir, dst = source_dir(src), Path(dst).expanduser()
    check_destination(src_dir, dst, overwrite=overwrite)
    reader = open_checkpoint(src_dir)
    hf_source = isinstance(reader, HFCheckpoint)
    if hf_source and to == "hf":
        raise ConfigError(f"{src_dir} is a Hugging Face directory already; convert it --to torch (or hlat import)")
    optimizer = check_canonical(reader, f"checkpoint {src_dir}", dtypes=to == "torch")
    source = checkpoint.manifest(src_dir) or {}
    meta = {k: v for k, v in source.items() if k not in KEPT}
    backend = (source.get("config") or {}).get("cluster", {}).get("backend", "torch")
    kind = "hf-llama" if hf_source else {"torch": "torch-dcp", "neuron": "neuron-xser"}.get(backend, backend)
    meta["source"] = {"format": kind, "path": str(src_dir.resolve())}
    spm = _source_tokenizer(src_dir, tokenizer, source, hf_source, needed=to == "hf")
    if to == "hf":
        _spm_prefix(spm)  # refuse a unigram tokenizer, and a model LlamaForCausalLM cannot compute, before writing
        target = DTYPES[dtype] if dtype else reader.tensors()["model.embed.weight"][1]
        hf_config(reader.config.model, target, None, None)
        needed = sum(map(safetensors_io.nbytes, hf_specs(reader, target).values()))
    else:
        needed = sum(map(safetensors_io.nbytes, reader.tensors().values()))
    with atomic_dir(dst, needed=needed) as tmp:
        if to == "hf":
            _write_hf_dir(reader, tmp, spm, target, max_shard_bytes)
        elif to == "torch":
            files = {SPM: spm} if spm is not None and not optimizer else {}
            write_torch(
                reader, tmp, optimizer=optimizer, meta=meta | ({"tokenizer": SPM} if files else {}), files=files
            )
        else:
            tmp.rmdir()  # the xser writer makes its directory itself, atomically
            write_neuron_checkpoint(reader, tmp, neuron_target(reader.config))
    log.info("converted %s to %s (%s%s)", src_dir, dst, to, "" if optimizer or to == "hf" else ", weights only")
    return dst


def _source_tokenizer(
    src: Path, explicit: Path | None, manifest: dict, hf_source: bool, *, needed: bool
) -> Path | None:
    """The sentencepiece model that travels with the conversion (``needed``: a HF export must have one)."""
    if explicit is not None:
        return Path(explicit).expanduser()
    if hf_source:
        return src / SPM if (src / SPM).is_file() else None
    if needed:
        return checkpoint_tokenizer(src)
    return src / manifest["tokenizer"] if manifest.get("tokenizer") else None


def _write_hf_dir(reader: Reader, out: Path, spm: Path, dtype: torch.dtype, max_shard_bytes: int) -> None:
    """Weights, ``config.json``, ``generation_config.json`` and the tokenizer files of a HF export."""
    cfg = reader.config.model
    write_hf_weights(reader, out, dtype=dtype, max_shard_bytes=max_shard_bytes)
    eos = _write_tokenizer(spm, out, cfg.max_seq_len)
    _dump(out / "config.json", hf_config(cfg, dtype, eos, eos))  # EOS starts a sequence too (hlat's packing)
    _dump(out / "generation_config.json", {"_from_model_config": True, "bos_token_id": eos, "eos_token_id": eos})


def neuron_target(source: RunConfig) -> RunConfig:
    """The config a ``--to neuron`` checkpoint is written with: the source's, on the neuron backend at TP = PP = DP = 1.

    A neuron run on any layout resumes it (hlat rewrites the files for its layout as it starts); fp32 masters need
    ZeRO-1 there (NxD keeps them inside it).
    """
    values = dataclasses.asdict(source)
    values["cluster"]["backend"] = "neuron"
    zero1 = values["parallelism"]["zero1"] or values["precision"]["master_weights"]
    values["parallelism"].update(tp=1, pp=1, zero1=zero1)
    return config_from_dict(values)


def export_hf(
    checkpoint_path: Path,
    out_dir: Path,
    *,
    tokenizer: Path | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write an hlat checkpoint as a Hugging Face ``LlamaForCausalLM`` directory; returns ``out_dir``.

    :func:`convert` to ``hf``: ``tokenizer`` default: the run's (``find_tokenizer``); ``dtype`` default: the stored one.

    Raises:
        ConfigError: No valid checkpoint, an unsupported checkpoint, no tokenizer found, or ``out_dir`` not empty.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not one of {list(DTYPES)}")
    return convert(checkpoint_path, out_dir, "hf", tokenizer=tokenizer, dtype=dtype, overwrite=overwrite)


def _dump(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


# ------------------------------------------------------------------------------------------------ import


def import_hf_checkpoint(hf_dir: Path, out_dir: Path, *, untie_embeddings: bool = False) -> Path:
    """Write a HF LLaMA-layout model as a weights-only hlat checkpoint directory ``out_dir`` (atomically).

    DCP weights in HF's dtype, the tokenizer if any, and a manifest with ``"step": 0`` and ``"weights_only": true``.

    Raises:
        ConfigError: See ``hlat.checkpoint.hf_layout.import_hf``; or ``out_dir`` already exists.
    """
    out_dir = Path(out_dir).expanduser()
    if out_dir.exists():
        raise ConfigError(f"{out_dir} already exists; choose a new directory for the imported checkpoint")
    cfg, sd, spm_path = import_hf(hf_dir, untie_embeddings=untie_embeddings)
    if spm_path is not None:
        from hlat.data.tokenizer import Tokenizer

        pieces = Tokenizer(spm_path, num_threads=1).vocab_size
        if pieces != cfg.vocab_size:
            log.warning(
                "%s has %d pieces but the model %d rows: hlat's data.tokenizer check will refuse it",
                spm_path,
                pieces,
                cfg.vocab_size,
            )
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is disabled": one process writes it all
        dcp.save({"model": sd}, checkpoint_id=tmp, no_dist=True)
    if spm_path is not None:
        shutil.copyfile(spm_path, tmp / SPM)
    files = {
        str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": checkpoint.sha256(p)}
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    }
    config = {"model": dataclasses.asdict(cfg)}
    _dump(
        tmp / checkpoint.MANIFEST,
        {
            "step": 0,
            "files": files,
            "config": config,
            "config_hash": checkpoint.config_hash(config),
            "weights_only": True,
            "tokenizer": SPM if spm_path is not None else None,
            "source": {"format": "hf-llama", "path": str(Path(hf_dir).expanduser().resolve())},
        },
    )
    os.replace(tmp, out_dir)
    log.info("imported %s into %s (%s)", hf_dir, out_dir, cfg)
    return out_dir


# ------------------------------------------------------------------------------------------------ the CLI


def _convert(args: argparse.Namespace) -> None:
    """``hlat convert``: convert, then say what to do with the result."""
    out = convert(
        args.src,
        args.dst,
        args.to,
        tokenizer=Path(args.tokenizer) if args.tokenizer else None,
        dtype=args.dtype,
        overwrite=args.overwrite,
        max_shard_bytes=int(args.max_shard_gb * 1e9),
    )
    meta = checkpoint.manifest(out) or {}
    if args.to == "hf":
        use = f"transformers: AutoModelForCausalLM.from_pretrained({str(out)!r})"
    elif meta.get("weights_only"):
        use = f"weights only: start a run from them with train.init_from={out}"
    else:
        backend = "on the neuron backend (any TP/PP layout) " if args.to == "neuron" else ""
        use = f"continue training {backend}with train.resume={out}"
    print(f"converted -> {out} ({use})")


def main(argv: list[str]) -> int:
    """``hlat export``, ``hlat import`` and ``hlat convert SRC DST --to ...``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="hlat",
        description="Convert between hlat checkpoints and the Hugging Face "
        "LLaMA layout (LlamaForCausalLM + sentencepiece LlamaTokenizer).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="write a checkpoint as a HF LlamaForCausalLM directory")
    exp.add_argument("checkpoint", help="a checkpoint directory, or a checkpoints root (its newest valid one)")
    exp.add_argument("--out", required=True, metavar="DIR", help="directory to write (must be empty)")
    exp.add_argument("--tokenizer", metavar="FILE.model", help="the run's sentencepiece model (default: found)")
    exp.add_argument("--dtype", choices=list(DTYPES), help="weight dtype (default: as saved)")
    exp.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    imp = sub.add_parser("import", help="write a HF LLaMA directory as a weights-only hlat checkpoint")
    imp.add_argument("hf_dir", help="save_pretrained output or a downloaded model snapshot (safetensors)")
    imp.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to create")
    imp.add_argument(
        "--untie-embeddings",
        action="store_true",
        help="accept tied embeddings: the LM head starts as a copy of the embedding",
    )
    conv = sub.add_parser("convert", help="convert a checkpoint to the torch or neuron backend or to HF, streaming")
    conv.add_argument("src", help="a checkpoint (or checkpoints root: its newest valid one), or a HF model directory")
    conv.add_argument("dst", help="the directory to create (written atomically)")
    conv.add_argument("--to", required=True, choices=TARGETS, help="the format of DST")
    conv.add_argument("--tokenizer", metavar="FILE.model", help="the run's sentencepiece model (default: found)")
    conv.add_argument("--dtype", choices=list(DTYPES), help="--to hf: weight dtype (default: as saved)")
    conv.add_argument("--max-shard-gb", type=float, default=SHARD_BYTES / 1e9, help="--to hf: largest file (5)")
    conv.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "convert":
            _convert(args)
        elif args.command == "export":
            out = export_hf(
                Path(args.checkpoint),
                Path(args.out),
                dtype=args.dtype,
                overwrite=args.overwrite,
                tokenizer=Path(args.tokenizer) if args.tokenizer else None,
            )
            print(f"exported -> {out} (transformers: LlamaForCausalLM.from_pretrained({str(out)!r}))")
        else:
            out = import_hf_checkpoint(Path(args.hf_dir), Path(args.out), untie_embeddings=args.untie_embeddings)
            cfg = ModelConfig(**(checkpoint.manifest(out) or {})["config"]["model"])
            tok = f" data.tokenizer={out / SPM}" if (out / SPM).is_file() else ""
            print(
                f"imported -> {out}; continue pretraining with: hlat train train.init_from={out}{tok} "
                + " ".join(model_overrides(cfg))
            )
    except ConfigError as err:
        print(f"hlat: error: {err}", file=sys.stderr)
        return 2
    return 0
