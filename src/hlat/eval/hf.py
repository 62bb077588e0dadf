"""Hugging Face LLaMA layout: export hlat checkpoints for other tools, import LLaMA-layout models to train on.

An exported directory is what ``LlamaForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` read:
``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer: hlat's sentencepiece model
(``tokenizer.model``) and ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``, with which
transformers gives sentencepiece's ids for every text (``hlat.eval.hf_tokenizer``).

Start of sequence: hlat trains on documents packed as ``ids + [EOS]``, so the token before a document is EOS (id 2),
never sentencepiece's ``<s>`` (id 1). The export says so: ``bos_token_id`` is EOS's id in ``config.json`` and
``generation_config.json``, ``bos_token`` is ``"</s>"`` with ``add_bos_token`` false (a plain encode has no
special token, as hlat's packing). lm-eval's ``hf`` model therefore starts rolling log-likelihood (perplexity)
windows with EOS, as hlat's ``hlat`` model does, and gives its numbers; for tasks with a context (multiple choice,
generation), where hlat's model puts EOS before the context, pass ``add_bos_token=True`` in ``--model_args``.

The weight mapping is a relabelling plus two splits, with no rotary permutation: hlat's RoPE already is HF's
rotate-half convention (``model.rope_tables``/``apply_rope``), so HF's ``q_proj``/``k_proj`` rows are hlat's
per-head rows as they are (the permutation in HF's ``convert_llama_weights_to_hf.py`` converts *Meta's*
interleaved-pair layout, which hlat never used). The fused qkv weight holds per kv group g the rows
``[q_{g*r} .. q_{g*r+r-1}, k_g, v_g]`` (r = n_heads / n_kv_heads, head_dim rows each): query head h uses kv
head h // r in both models. The fused gate_up weight is ``[gate; up]``; a torch-backend checkpoint saved with
``parallelism.tp`` = t > 1 holds it reordered for the split, ``[gate_0; up_0; ..; gate_{t-1}; up_{t-1}]``, which
``hlat.eval.inference.load_checkpoint_weights`` puts back in order. The LM head is never tied in hlat.

An import writes a *weights-only* hlat checkpoint (``manifest.json`` with ``"weights_only": true``): model
weights through torch.distributed.checkpoint and the tokenizer, but no optimizer state, data position or step.
Training starts from such weights at step 0 (fresh AdamW and data order); it is not a ``train.resume`` target.
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

from hlat.config import ConfigError, ModelConfig
from hlat.eval.hf_tokenizer import write_tokenizer
from hlat.eval.inference import Tensors, check_tensors, expected_shapes, find_tokenizer, load_checkpoint_weights
from hlat.train import checkpoint

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SPM = "tokenizer.model"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Derived buffers some exporters saved; recomputed from the config, so dropped on import.
IGNORED = (".rotary_emb.inv_freq",)


# ------------------------------------------------------------------------------------------------ weight mapping


def to_hf(cfg: ModelConfig, sd: Tensors) -> Tensors:
    """Map hlat's state dict (fused qkv and gate_up, in the tp=1 layout) -> HF ``LlamaForCausalLM`` tensor names."""
    G, r, D = cfg.kv_heads, cfg.n_heads // cfg.kv_heads, cfg.head_dim
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"],
           "lm_head.weight": sd["lm_head.weight"]}  # fmt: skip
    for i in range(cfg.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        qkv = sd[p + "attn.qkv.weight"].view(G, r + 2, D, cfg.dim)  # per kv group: r query heads, k, v
        gate, up = sd[p + "mlp.gate_up.weight"].chunk(2)
        # The splits are copies: safetensors refuses tensors that share storage (views of one fused weight).
        out |= {
            h + "input_layernorm.weight": sd[p + "attn_norm.weight"],
            h + "self_attn.q_proj.weight": qkv[:, :r].reshape(cfg.n_heads * D, cfg.dim).clone(),
            h + "self_attn.k_proj.weight": qkv[:, r].reshape(G * D, cfg.dim).clone(),
            h + "self_attn.v_proj.weight": qkv[:, r + 1].reshape(G * D, cfg.dim).clone(),
            h + "self_attn.o_proj.weight": sd[p + "attn.o_proj.weight"],
            h + "post_attention_layernorm.weight": sd[p + "mlp_norm.weight"],
            h + "mlp.gate_proj.weight": gate.clone(),
            h + "mlp.up_proj.weight": up.clone(),
            h + "mlp.down_proj.weight": sd[p + "mlp.down.weight"],
        }
    return {k: v.detach().contiguous() for k, v in out.items()}


def from_hf(cfg: ModelConfig, hf: Tensors) -> Tensors:
    """HF ``LlamaForCausalLM`` tensors -> hlat's state dict (the inverse of :func:`to_hf`)."""
    G, r, D = cfg.kv_heads, cfg.n_heads // cfg.kv_heads, cfg.head_dim
    sd = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"],
          "lm_head.weight": hf["lm_head.weight"]}  # fmt: skip
    for i in range(cfg.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        q = hf[h + "self_attn.q_proj.weight"].reshape(G, r, D, cfg.dim)
        k = hf[h + "self_attn.k_proj.weight"].reshape(G, 1, D, cfg.dim)
        v = hf[h + "self_attn.v_proj.weight"].reshape(G, 1, D, cfg.dim)
        sd |= {
            p + "attn_norm.weight": hf[h + "input_layernorm.weight"],
            p + "attn.qkv.weight": torch.cat([q, k, v], dim=1).reshape(-1, cfg.dim),
            p + "attn.o_proj.weight": hf[h + "self_attn.o_proj.weight"],
            p + "mlp_norm.weight": hf[h + "post_attention_layernorm.weight"],
            p + "mlp.gate_up.weight": torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]]),
            p + "mlp.down.weight": hf[h + "mlp.down_proj.weight"],
        }
    return {k: v.contiguous() for k, v in sd.items()}


# ------------------------------------------------------------------------------------------------ export


def hf_config(cfg: ModelConfig, dtype: torch.dtype, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """``config.json`` of ``LlamaForCausalLM`` for ``cfg`` (readable by transformers 4.x and 5.x)."""
    if cfg.mask_leak:
        raise ConfigError(
            f"this model was trained with model.mask_leak={cfg.mask_leak} (the information-leak demonstration): its "
            "attention saw future tokens, and a causal LlamaForCausalLM would not compute what it learned"
        )
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None,  # transformers 4.x
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # transformers 5.x
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "tie_word_embeddings": False, "pretraining_tp": 1, "initializer_range": cfg.init_std,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": None, "use_cache": True,
        "torch_dtype": dtype_name, "dtype": dtype_name,
        # What the HF fields cannot say, so that an import gives back the same ModelConfig.
        "hlat": {"name": cfg.name, "n_kv_heads": cfg.n_kv_heads, "scaled_init": cfg.scaled_init},
    }  # fmt: skip


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
    """Copy the sentencepiece model and write HF's tokenizer files (``hlat.eval.hf_tokenizer``); returns the EOS id.

    EOS is also the export's start-of-sequence token (``bos_token``/``bos_token_id``): hlat packs documents as
    ``ids + [EOS]``, so EOS is what precedes every document in training (see ``hlat.eval.hf_tokenizer``).
    """
    from hlat.data.tokenizer import Tokenizer

    sp = Tokenizer(spm_path, num_threads=1).processor
    ids = {"eos_token": sp.eos_id(), "unk_token": sp.unk_id()}  # -1: none
    if ids["eos_token"] < 0:
        raise ConfigError(f"{spm_path} has no EOS piece: hlat separates documents with EOS, so no model trained on it")
    shutil.copyfile(spm_path, out / SPM)
    write_tokenizer(spm_path, out, max_len, {k: sp.id_to_piece(i) for k, i in ids.items() if i >= 0})
    return ids["eos_token"]


def export_hf(checkpoint_path: Path, out_dir: Path, *, tokenizer: Path | None = None, dtype: str | None = None,
              overwrite: bool = False) -> Path:  # fmt: skip
    """Write an hlat checkpoint as a Hugging Face ``LlamaForCausalLM`` directory.

    Args:
        checkpoint_path: A checkpoint directory, or a checkpoints root (its newest valid checkpoint).
        out_dir: Directory to create.
        tokenizer: The sentencepiece ``.model``; default: the one recorded with the checkpoint, ``data.tokenizer``
            of its config, or the trained one in ``data.cache_dir`` whose fingerprint the checkpoint's data state
            records.
        dtype: ``float32``, ``bfloat16`` or ``float16``; default: the dtype the weights were saved in.
        overwrite: Replace the files of an existing non-empty ``out_dir``.

    Returns:
        ``out_dir``.

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
    _dump(out_dir / "config.json", hf_config(cfg, target, eos, eos))  # EOS starts a sequence too (module docstring)
    _dump(out_dir / "generation_config.json", {"_from_model_config": True, "bos_token_id": eos, "eos_token_id": eos})
    log.info("exported %s to %s (%s, tokenizer %s)", ckpt, out_dir, target, spm_path)
    return out_dir


def _dump(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


# ------------------------------------------------------------------------------------------------ import


REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
            "max_position_embeddings")  # fmt: skip


def model_config_from_hf(hf: dict[str, Any], name: str, *, untie_embeddings: bool = False) -> ModelConfig:
    """The hlat ModelConfig of a HF LLaMA ``config.json``; ConfigError for what hlat's model cannot express."""
    missing = [k for k in REQUIRED if k not in hf]
    if missing:
        raise ConfigError(f"config.json of {name} lacks {missing}: not a LLaMA config")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    n_heads = hf["num_attention_heads"]
    refusals = {
        f"model_type={hf.get('model_type')!r} (only 'llama')": hf.get("model_type") != "llama",
        f"hidden_act={hf.get('hidden_act')!r} (hlat's MLP is SwiGLU: 'silu')": hf.get("hidden_act", "silu")
        not in ("silu", "swish"),
        "attention_bias=true (hlat's projections have no bias)": hf.get("attention_bias", False),
        "mlp_bias=true (hlat's projections have no bias)": hf.get("mlp_bias", False),
        f"rope scaling {rope_type!r} (hlat's rotary embedding is unscaled)": rope_type != "default",
        "partial_rotary_factor < 1": rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0,
        f"head_dim={hf.get('head_dim')} != hidden_size / num_attention_heads": hf.get("head_dim") not in (
            None, hf["hidden_size"] // n_heads),
        "tie_word_embeddings=true (hlat's LM head is untied; import with untie_embeddings=True / --untie-embeddings "
        "to start from a copy of the embedding)": hf.get("tie_word_embeddings", False) and not untie_embeddings,
    }  # fmt: skip
    bad = [k for k, v in refusals.items() if v]
    if bad:
        raise ConfigError(f"cannot import this model into hlat: {'; '.join(bad)}")
    extra = hf.get("hlat", {})  # written by export_hf: the ModelConfig fields HF has no key for
    kv = hf.get("num_key_value_heads") or n_heads
    saved_kv = extra.get("n_kv_heads", kv)  # None (plain multi-head) and n_heads are the same model
    return ModelConfig(
        name=extra.get("name", name), dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=saved_kv if (saved_kv or n_heads) == kv else kv,
        ffn_dim=hf["intermediate_size"], vocab_size=hf["vocab_size"], max_seq_len=hf["max_position_embeddings"],
        norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        init_std=hf.get("initializer_range", 0.02), scaled_init=extra.get("scaled_init", True),
    )  # fmt: skip


def _read_safetensors(hf_dir: Path) -> Tensors:
    from safetensors.torch import load_file

    if (hf_dir / INDEX).is_file():  # sharded: the index maps each tensor to its file
        files = sorted(set(json.loads((hf_dir / INDEX).read_text())["weight_map"].values()))
    elif (hf_dir / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise ConfigError(f"{hf_dir} has no {WEIGHTS} or {INDEX}; only safetensors weights are read (re-save the model "
                          "with save_pretrained(..., safe_serialization=True))")  # fmt: skip
    out: Tensors = {}
    for f in files:
        out |= load_file(str(hf_dir / f))
    return {k: v for k, v in out.items() if not k.endswith(IGNORED)}


def import_hf(hf_dir: Path, *, untie_embeddings: bool = False) -> tuple[ModelConfig, Tensors, Path | None]:
    """Read a HF LLaMA-layout directory (``config.json``, safetensors, optional ``tokenizer.model``).

    Args:
        hf_dir: The directory (``save_pretrained`` output or a downloaded model snapshot).
        untie_embeddings: Accept ``tie_word_embeddings=true``: the LM head starts as a copy of the embedding and
            is trained separately from then on.

    Returns:
        hlat's model config, its state dict (HF's dtype), and the sentencepiece model (None if the directory has
        none: hlat then needs ``data.tokenizer`` with ``vocab_size`` pieces).

    Raises:
        ConfigError: Missing files, an architecture hlat does not implement, or tensors that do not match.
    """
    hf_dir = Path(hf_dir).expanduser()
    if not (hf_dir / "config.json").is_file():
        raise ConfigError(f"{hf_dir} has no config.json: not a Hugging Face model directory")
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    cfg = model_config_from_hf(hf_cfg, hf_dir.resolve().name, untie_embeddings=untie_embeddings)
    tensors = _read_safetensors(hf_dir)
    if "lm_head.weight" not in tensors and hf_cfg.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    meta = {k: torch.empty(s, device="meta") for k, s in expected_shapes(cfg).items()}
    check_tensors({k: v.shape for k, v in tensors.items()}, {k: v.shape for k, v in to_hf(cfg, meta).items()},
                  str(hf_dir))  # fmt: skip
    sd = from_hf(cfg, tensors)
    spm_path = hf_dir / SPM if (hf_dir / SPM).is_file() else None
    if spm_path is None:
        log.warning("%s has no %s: hlat trains with sentencepiece; set data.tokenizer to one with %d pieces",
                    hf_dir, SPM, cfg.vocab_size)  # fmt: skip
    return cfg, sd, spm_path


def import_hf_checkpoint(hf_dir: Path, out_dir: Path, *, untie_embeddings: bool = False) -> Path:
    """Write a HF LLaMA-layout model as a weights-only hlat checkpoint directory ``out_dir``.

    The directory holds the weights (torch.distributed.checkpoint, ``{"model": state_dict}``, HF's dtype), the
    tokenizer (``tokenizer.model`` when the HF directory has one), and ``manifest.json`` with checksums, the model
    config under ``config.model``, ``"step": 0`` and ``"weights_only": true``. It is written atomically (a
    ``.tmp`` sibling, then renamed), and :func:`load_checkpoint_weights` and :func:`export_hf` read it.

    Returns:
        ``out_dir``.

    Raises:
        ConfigError: See :func:`import_hf`; or ``out_dir`` already exists.
    """
    out_dir = Path(out_dir).expanduser()
    if out_dir.exists():
        raise ConfigError(f"{out_dir} already exists; choose a new directory for the imported checkpoint")
    cfg, sd, spm_path = import_hf(hf_dir, untie_embeddings=untie_embeddings)
    if spm_path is not None:
        from hlat.data.tokenizer import Tokenizer

        pieces = Tokenizer(spm_path, num_threads=1).vocab_size
        if pieces != cfg.vocab_size:
            log.warning("%s has %d pieces but the model %d rows: hlat's data.tokenizer check will refuse it",
                        spm_path, pieces, cfg.vocab_size)  # fmt: skip
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is disabled": one process writes it all
        dcp.save({"model": sd}, checkpoint_id=tmp, no_dist=True)
    if spm_path is not None:
        shutil.copyfile(spm_path, tmp / SPM)
    files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": checkpoint.sha256(p)}
             for p in sorted(tmp.rglob("*")) if p.is_file()}  # fmt: skip
    config = {"model": dataclasses.asdict(cfg)}
    _dump(tmp / checkpoint.MANIFEST, {
        "step": 0, "files": files, "config": config, "config_hash": checkpoint.config_hash(config),
        "weights_only": True, "tokenizer": SPM if spm_path is not None else None,
        "source": {"format": "hf-llama", "path": str(Path(hf_dir).expanduser().resolve())},
    })  # fmt: skip
    os.replace(tmp, out_dir)
    log.info("imported %s into %s (%s)", hf_dir, out_dir, cfg)
    return out_dir


# ------------------------------------------------------------------------------------------------ runs and the CLI

SHAPE = {"dim": "dim", "n_layers": "n_layers", "n_heads": "n_heads", "kv_heads": "n_kv_heads", "ffn_dim": "ffn_dim",
         "vocab_size": "vocab_size"}  # fmt: skip
"""ModelConfig attribute -> config key, for the fields that decide the shape of the weights."""


def load_init_weights(path: Path, cfg: ModelConfig) -> tuple[Tensors, Path | None]:
    """The weights a new run starts from (step 0, fresh optimizer): an hlat checkpoint or a HF LLaMA directory.

    Load them into the model built from ``cfg`` after ``init_weights`` and *before* any dtype cast or
    tensor-parallel split (the torch backend reorders gate_up for TP after that point).

    Args:
        path: An hlat checkpoint (full or weights-only, e.g. from ``hlat import``), a checkpoints root (its newest
            valid checkpoint), or a HF LLaMA-layout directory.
        cfg: The run's model config; the weights must have its shape.

    Returns:
        The state dict (hlat names, tp=1 layout, stored dtype) and the tokenizer that goes with it (None: unknown).

    Raises:
        ConfigError: The weights' shape differs from ``cfg`` (naming each key), or see :func:`import_hf` and
            :func:`load_checkpoint_weights`.
    """
    path = Path(path).expanduser()
    if (path / "config.json").is_file() and checkpoint.manifest(path) is None:
        have, sd, spm = import_hf(path)
    else:
        have, sd, ckpt = load_checkpoint_weights(path)
        try:
            spm = checkpoint_tokenizer(ckpt)
        except ConfigError:
            spm = None
    diff = [f"model.{key}={getattr(cfg, attr)} but {getattr(have, attr)} there" for attr, key in SHAPE.items()
            if getattr(cfg, attr) != getattr(have, attr)]  # fmt: skip
    if diff:
        raise ConfigError(f"cannot start from the weights in {path}: {'; '.join(diff)}; set these model keys to the "
                          f"weights' values ({' '.join(model_overrides(have))})")  # fmt: skip
    for key in ("max_seq_len", "norm_eps", "rope_theta"):  # a different function, but a legitimate one (long context)
        if getattr(cfg, key) != getattr(have, key):
            log.warning("starting from %s with model.%s=%s; the weights were trained with %s", path, key,
                        getattr(cfg, key), getattr(have, key))  # fmt: skip
    return sd, spm


def checkpoint_tokenizer(ckpt: Path, explicit: Path | None = None) -> Path:
    """The sentencepiece model file a checkpoint was trained with (``hlat.eval.inference.find_tokenizer``, no retraining).

    Raises:
        ConfigError: None is found that matches the tokenizer fingerprint the checkpoint's data state records.
    """
    return find_tokenizer(ckpt, explicit).path


def model_overrides(cfg: ModelConfig) -> list[str]:
    """Hydra overrides that give a run this model config."""
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return [f"model.{k}={'null' if v is None else v}" for k, v in values.items()]


def main(argv: list[str]) -> int:
    """``hlat export CHECKPOINT --out DIR`` and ``hlat import HF_DIR --out DIR``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="hlat", description="Convert between hlat checkpoints and the Hugging Face "
                                     "LLaMA layout (LlamaForCausalLM + sentencepiece LlamaTokenizer).")  # fmt: skip
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
    imp.add_argument("--untie-embeddings", action="store_true", help="accept tied embeddings: the LM head starts "
                     "as a copy of the embedding")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "export":
            out = export_hf(Path(args.checkpoint), Path(args.out), dtype=args.dtype, overwrite=args.overwrite,
                            tokenizer=Path(args.tokenizer) if args.tokenizer else None)  # fmt: skip
            print(f"exported -> {out} (transformers: LlamaForCausalLM.from_pretrained({str(out)!r}))")
        else:
            out = import_hf_checkpoint(Path(args.hf_dir), Path(args.out), untie_embeddings=args.untie_embeddings)
            cfg = ModelConfig(**(checkpoint.manifest(out) or {})["config"]["model"])
            tok = f" data.tokenizer={out / SPM}" if (out / SPM).is_file() else ""
            print(f"imported -> {out}; continue pretraining with: hlat train train.init_from={out}{tok} "
                  + " ".join(model_overrides(cfg)))  # fmt: skip
    except ConfigError as err:
        print(f"hlat: error: {err}", file=sys.stderr)
        return 2
    return 0
