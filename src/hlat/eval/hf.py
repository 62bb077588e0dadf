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

import torch.distributed.checkpoint as dcp

from hlat import checkpoint
from hlat.checkpoint.hf_layout import DTYPES, SPM, WEIGHTS, hf_config, import_hf, model_overrides, to_hf
from hlat.checkpoint.weights import checkpoint_tokenizer, load_checkpoint_weights
from hlat.config import ConfigError, ModelConfig
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


def export_hf(
    checkpoint_path: Path,
    out_dir: Path,
    *,
    tokenizer: Path | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write an hlat checkpoint as a Hugging Face ``LlamaForCausalLM`` directory; returns ``out_dir``.

    ``tokenizer`` default: the run's (``find_tokenizer``); ``dtype`` default: the stored one.

    Raises:
        ConfigError: No valid checkpoint, an unsupported checkpoint, no tokenizer found, or ``out_dir`` not empty.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir).expanduser()
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"{out_dir} is not empty; choose a new directory or pass overwrite=True (--overwrite)")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not one of {list(DTYPES)}")
    cfg, sd, ckpt = load_checkpoint_weights(checkpoint_path)
    target = DTYPES[dtype] if dtype else sd["embed.weight"].dtype
    spm_path = checkpoint_tokenizer(ckpt, tokenizer)
    _spm_prefix(spm_path)  # refuse a unigram tokenizer before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = _write_tokenizer(spm_path, out_dir, cfg.max_seq_len)
    tensors = {k: v.to(target) for k, v in to_hf(cfg, sd).items()}
    save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    _dump(out_dir / "config.json", hf_config(cfg, target, eos, eos))  # EOS starts a sequence too (hlat's packing)
    _dump(out_dir / "generation_config.json", {"_from_model_config": True, "bos_token_id": eos, "eos_token_id": eos})
    log.info("exported %s to %s (%s, tokenizer %s)", ckpt, out_dir, target, spm_path)
    return out_dir


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


def main(argv: list[str]) -> int:
    """``hlat export CHECKPOINT --out DIR`` and ``hlat import HF_DIR --out DIR``; returns the exit status."""
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
    exp.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    imp = sub.add_parser("import", help="write a HF LLaMA directory as a weights-only hlat checkpoint")
    imp.add_argument("hf_dir", help="save_pretrained output or a downloaded model snapshot (safetensors)")
    imp.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to create")
    imp.add_argument(
        "--untie-embeddings",
        action="store_true",
        help="accept tied embeddings: the LM head starts as a copy of the embedding",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "export":
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
