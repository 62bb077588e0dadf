"""The Hugging Face LLaMA layout: pure conversions between hlat's model and ``LlamaForCausalLM``.

Tensors and ``config.json`` both ways, safetensors, shape checks, and reading a whole HF directory; nothing here
reads an hlat checkpoint or a tokenizer (``weights`` and ``hlat.eval.hf`` build on it).
May import: ``hlat.config`` and ``hlat.model`` only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from hlat.config import ConfigError, ModelConfig
from hlat.model import Transformer

Tensors = dict[str, torch.Tensor]
log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SPM = "tokenizer.model"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Derived buffers some exporters saved; recomputed from the config, so dropped on import.
IGNORED = (".rotary_emb.inv_freq",)
REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "max_position_embeddings",
)


# ------------------------------------------------------------------------------------------------ weight mapping


_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": ("input_layernorm.weight",),
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.o_proj.weight": ("self_attn.o_proj.weight",),
    "mlp_norm.weight": ("post_attention_layernorm.weight",),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.down.weight": ("mlp.down_proj.weight",),
}
"""hlat's tensor names -> the HF ``LlamaForCausalLM`` tensors each is made of (top level, and per layer)."""


def hlat_names(cfg: ModelConfig) -> list[str]:
    """Every tensor name of hlat's state dict, in the order the HF names of :func:`hf_names` follow."""
    layers = [f"layers.{i}.{k}" for i in range(cfg.n_layers) for k in _LAYER]
    return ["embed.weight", *layers, "norm.weight", "lm_head.weight"]


def hf_names(name: str) -> tuple[str, ...]:
    """The HF tensor names one hlat tensor maps to (KeyError: not a tensor of hlat's model)."""
    if name in _TOP:
        return (_TOP[name],)
    layers, i, rest = name.split(".", 2)
    if layers != "layers" or rest not in _LAYER:
        raise KeyError(name)
    return tuple(f"model.layers.{i}.{n}" for n in _LAYER[rest])


def to_hf_one(cfg: ModelConfig, name: str, t: torch.Tensor) -> Tensors:
    """One hlat tensor (tp=1 layout) -> its HF tensors: fused qkv and gate_up are split, the rest renamed."""
    # No rotary permutation: hlat's RoPE is HF's rotate-half already (HF's convert script permutes Meta's layout).
    G, r, D = cfg.kv_heads, cfg.n_heads // cfg.kv_heads, cfg.head_dim
    if name.endswith("attn.qkv.weight"):
        qkv = t.view(G, r + 2, D, cfg.dim)  # per kv group: r query heads, k, v
        parts = [
            qkv[:, :r].reshape(cfg.n_heads * D, cfg.dim),
            qkv[:, r].reshape(G * D, cfg.dim),
            qkv[:, r + 1].reshape(G * D, cfg.dim),
        ]
    elif name.endswith("mlp.gate_up.weight"):
        parts = list(t.chunk(2))
    else:
        return {hf_names(name)[0]: t.detach().contiguous()}
    # The splits are copies: safetensors refuses tensors that share storage (views of one fused weight).
    return {n: p.detach().clone().contiguous() for n, p in zip(hf_names(name), parts, strict=True)}


def from_hf_one(cfg: ModelConfig, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """One hlat tensor from the HF tensors of :func:`hf_names` (in that order): the inverse of :func:`to_hf_one`."""
    G, r, D = cfg.kv_heads, cfg.n_heads // cfg.kv_heads, cfg.head_dim
    if name.endswith("attn.qkv.weight"):
        q, k, v = parts
        qkv = [q.reshape(G, r, D, cfg.dim), k.reshape(G, 1, D, cfg.dim), v.reshape(G, 1, D, cfg.dim)]
        return torch.cat(qkv, dim=1).reshape(-1, cfg.dim)
    if name.endswith("mlp.gate_up.weight"):
        return torch.cat(parts)
    return parts[0].contiguous()


def to_hf(cfg: ModelConfig, sd: Tensors) -> Tensors:
    """Map hlat's state dict (fused qkv and gate_up, in the tp=1 layout) -> HF ``LlamaForCausalLM`` tensor names."""
    out: Tensors = {}
    for name in hlat_names(cfg):
        out |= to_hf_one(cfg, name, sd[name])
    return out


def from_hf(cfg: ModelConfig, hf: Tensors) -> Tensors:
    """HF ``LlamaForCausalLM`` tensors -> hlat's state dict (the inverse of :func:`to_hf`)."""
    return {name: from_hf_one(cfg, name, [hf[n] for n in hf_names(name)]) for name in hlat_names(cfg)}


# ------------------------------------------------------------------------------------------------ config.json


def hf_config(cfg: ModelConfig, dtype: torch.dtype, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """``config.json`` of ``LlamaForCausalLM`` for ``cfg`` (readable by transformers 4.x and 5.x)."""
    if cfg.mask_leak:
        raise ConfigError(
            f"this model was trained with model.mask_leak={cfg.mask_leak} (the information-leak demonstration): its "
            "attention saw future tokens, and a causal LlamaForCausalLM would not compute what it learned"
        )
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,  # transformers 4.x
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # transformers 5.x
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "pretraining_tp": 1,
        "initializer_range": cfg.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "use_cache": True,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        # What the HF fields cannot say, so that an import gives back the same ModelConfig.
        "hlat": {"name": cfg.name, "n_kv_heads": cfg.n_kv_heads, "scaled_init": cfg.scaled_init},
    }


def model_config_from_hf(hf: dict[str, Any], name: str, *, untie_embeddings: bool = False) -> ModelConfig:
    """The hlat ModelConfig of a HF LLaMA ``config.json``; ConfigError for what hlat's model cannot express."""
    missing = [k for k in REQUIRED if k not in hf]
    if missing:
        raise ConfigError(
            f"config.json of {name} lacks {missing}: not a LLaMA config; import the directory of a Hugging Face "
            "LLaMA model (LlamaForCausalLM: its config.json and *.safetensors)"
        )
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
        f"head_dim={hf.get('head_dim')} != hidden_size / num_attention_heads": hf.get("head_dim")
        not in (None, hf["hidden_size"] // n_heads),
        "tie_word_embeddings=true (hlat's LM head is untied; import with untie_embeddings=True / --untie-embeddings "
        "to start from a copy of the embedding)": hf.get("tie_word_embeddings", False) and not untie_embeddings,
    }
    bad = [k for k, v in refusals.items() if v]
    if bad:
        raise ConfigError(
            f"cannot import this model into hlat: {'; '.join(bad)}; only a plain LLaMA architecture can be imported"
        )
    extra = hf.get("hlat", {})  # written by export_hf: the ModelConfig fields HF has no key for
    kv = hf.get("num_key_value_heads") or n_heads
    saved_kv = extra.get("n_kv_heads", kv)  # None (plain multi-head) and n_heads are the same model
    return ModelConfig(
        name=extra.get("name", name),
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=saved_kv if (saved_kv or n_heads) == kv else kv,
        ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_seq_len=hf["max_position_embeddings"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        init_std=hf.get("initializer_range", 0.02),
        scaled_init=extra.get("scaled_init", True),
    )


def model_overrides(cfg: ModelConfig) -> list[str]:
    """Hydra overrides that give a run this model config."""
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return [f"model.{k}={'null' if v is None else v}" for k, v in values.items()]


# ------------------------------------------------------------------------------------------------ files and shapes


def read_safetensors(hf_dir: Path) -> Tensors:
    """The tensors of a HF directory's safetensors weights: one file, or the shards its index names.

    Derived buffers (``IGNORED``) are dropped.

    Raises:
        ConfigError: The directory holds no safetensors weights.
    """
    from safetensors.torch import load_file

    if (hf_dir / INDEX).is_file():  # sharded: the index maps each tensor to its file
        files = sorted(set(json.loads((hf_dir / INDEX).read_text())["weight_map"].values()))
    elif (hf_dir / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise ConfigError(
            f"{hf_dir} has no {WEIGHTS} or {INDEX}; only safetensors weights are read (re-save the model "
            "with save_pretrained(..., safe_serialization=True))"
        )
    out: Tensors = {}
    for f in files:
        out |= load_file(str(hf_dir / f))
    return {k: v for k, v in out.items() if not k.endswith(IGNORED)}


def expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Name -> shape of every saved tensor of hlat's model (built on the meta device: allocates nothing)."""
    with torch.device("meta"):
        return {k: v.shape for k, v in Transformer(cfg).state_dict().items()}


def check_tensors(have: dict[str, torch.Size], want: dict[str, torch.Size], where: str) -> None:
    """ConfigError naming the missing, unexpected and wrongly shaped tensors of ``where`` (up to 4 of each)."""
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    wrong = [
        f"{k} {tuple(have[k])} (expected {tuple(want[k])})" for k in sorted(set(want) & set(have)) if have[k] != want[k]
    ]
    if missing or extra or wrong:
        parts = [
            f"missing {missing[:4]}" if missing else "",
            f"unexpected {extra[:4]}" if extra else "",
            f"wrong shapes {wrong[:4]}" if wrong else "",
        ]
        raise ConfigError(f"{where} does not match its config: {'; '.join(p for p in parts if p)}")


def import_hf(hf_dir: Path, *, untie_embeddings: bool = False) -> tuple[ModelConfig, Tensors, Path | None]:
    """Read a HF LLaMA-layout directory: hlat's model config, its state dict (HF's dtype), its ``tokenizer.model``.

    ``untie_embeddings`` accepts tied embeddings: the LM head starts as a copy and is trained apart.

    Raises:
        ConfigError: Missing files, an architecture hlat does not implement, or tensors that do not match.
    """
    hf_dir = Path(hf_dir).expanduser()
    if not (hf_dir / "config.json").is_file():
        raise ConfigError(
            f"{hf_dir} has no config.json: not a Hugging Face model directory; give the directory that holds "
            "config.json and the *.safetensors weights (save_pretrained writes both)"
        )
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    cfg = model_config_from_hf(hf_cfg, hf_dir.resolve().name, untie_embeddings=untie_embeddings)
    tensors = read_safetensors(hf_dir)
    if "lm_head.weight" not in tensors and hf_cfg.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    meta = {k: torch.empty(s, device="meta") for k, s in expected_shapes(cfg).items()}
    check_tensors(
        {k: v.shape for k, v in tensors.items()}, {k: v.shape for k, v in to_hf(cfg, meta).items()}, str(hf_dir)
    )
    sd = from_hf(cfg, tensors)
    spm_path = hf_dir / SPM if (hf_dir / SPM).is_file() else None
    if spm_path is None:
        log.warning(
            "%s has no %s: hlat trains with sentencepiece; set data.tokenizer to one with %d pieces",
            hf_dir,
            SPM,
            cfg.vocab_size,
        )
    return cfg, sd, spm_path
