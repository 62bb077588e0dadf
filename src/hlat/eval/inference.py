"""Load an hlat checkpoint for use outside training, and greedy decoding with the KV cache.

``loaded = load("outputs/.../checkpoints")``, then ``greedy(loaded.model, prompt_ids, max_new_tokens=20)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hlat import checkpoint as ckpt
from hlat.backends.torch.bf16_matmul import apply_auto_policy
from hlat.checkpoint.weights import (
    check_torch_backend,
    find_checkpoint,
    find_tokenizer,
    model_config,
    read_weights,
    run_config,
)
from hlat.config import DTYPES, ConfigError, ModelConfig, RunConfig
from hlat.data.tokenizer import Tokenizer
from hlat.eval.kv_cache import KVCache, decode, new_cache
from hlat.model import Transformer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loaded:
    """A checkpoint ready for inference."""

    model: Transformer
    """The decoder in eval mode, on the requested device and dtype, gradients off."""
    tokenizer: Tokenizer
    """The run's tokenizer (EOS separates documents in training; there is no BOS in the data)."""
    config: RunConfig | None
    """The run's resolved config, from the checkpoint's manifest (None for a weights-only checkpoint)."""
    path: Path
    """The checkpoint directory (``step_N``) that was loaded."""
    step: int
    """Optimizer steps trained before the checkpoint."""
    context_len: int
    """The longest context the model was trained on: ``train.seq_len``, or ``model.max_seq_len`` for a weights-only
    checkpoint (whose training run is unknown)."""


def load_weights(
    path: Path, cfg: ModelConfig, device: torch.device | str = "cpu", dtype: str = "float32"
) -> Transformer:
    """The decoder of ``cfg`` in eval mode with the weights of the checkpoint at ``path`` (see ``read_weights``).

    Raises:
        ConfigError: ``dtype`` is not a dtype name, or see :func:`hlat.checkpoint.weights.read_weights`.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.to(getattr(torch, dtype))
    model.init_rope()  # fp32 rotary tables whatever the weights' dtype (as the torch backend keeps them)
    read_weights(path, cfg, into=model.state_dict())
    if dtype == "bfloat16":  # bf16 matmuls as training runs them on this host: native, or emulated in fp32
        apply_auto_policy(model, torch.device(device))
    model.eval().requires_grad_(False)
    return model


def load(checkpoint: str | Path, device: str = "cpu", dtype: str = "float32", tokenizer: str | None = None) -> Loaded:
    """Load a torch-backend checkpoint's model in ``dtype`` and the run's tokenizer (or ``tokenizer``).

    ``checkpoint``: a ``step_N`` checkpoint, a checkpoints root or a run directory (``find_checkpoint``).

    Raises:
        ConfigError: See ``find_checkpoint``, ``check_torch_backend``, ``find_tokenizer``; or CUDA is missing.
    """
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device}, but CUDA is not available here; use device=cpu (lm_eval: --device cpu)")
    path = find_checkpoint(checkpoint)
    check_torch_backend(path)
    meta = ckpt.manifest(path) or {}
    if meta.get("weights_only"):  # hlat.eval.hf imports: a model config and a tokenizer file, no training run
        cfg, model_cfg = None, model_config(path)
        context = model_cfg.max_seq_len
    else:
        cfg = run_config(path)
        model_cfg, context = cfg.model, cfg.train.seq_len
    tok = find_tokenizer(path, tokenizer, vocab=model_cfg.vocab_size, retrain=True)
    model = load_weights(path, model_cfg, device, dtype)
    step = int(meta.get("step", 0))
    log.info("loaded %s (step %d, %s) on %s with tokenizer %s", path, step, model_cfg.name, device, tok.path.name)
    return Loaded(model, tok, cfg, path, step, context)


@torch.inference_mode()
def greedy(
    model: Transformer,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
    stop: Callable[[list[int]], bool] | None = None,
    cache: KVCache | None = None,
    use_cache: bool = True,
) -> list[int]:
    """Greedy continuation of one prompt: the new token ids, up to and including ``eos_id``, or until ``stop``.

    ``cache`` is reset first (default: one sized for this generation); ``use_cache=False`` recomputes the whole
    sequence for every token (a reference for tests).
    """
    if not prompt:
        raise ValueError("greedy needs a non-empty prompt (start with the EOS id for an unconditioned sample)")
    device = model.embed.weight.device
    tokens = torch.tensor([list(prompt)], dtype=torch.long, device=device)  # (1, T)
    if use_cache:
        cache = cache or new_cache(model, len(prompt) + max_new_tokens)
        cache.reset()
    out: list[int] = []
    logits = decode(model, tokens, cache) if use_cache else model(tokens)
    while len(out) < max_new_tokens:
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        out.append(int(nxt))
        if out[-1] == eos_id or (stop is not None and stop(out)) or len(out) == max_new_tokens:
            break
        if use_cache:
            logits = decode(model, nxt, cache)
        else:
            tokens = torch.cat([tokens, nxt], dim=1)
            logits = model(tokens)
    return out


@torch.inference_mode()
def greedy_batch(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
    stop: Callable[[int, list[int]], bool] | None = None,
    cache: KVCache | None = None,
    pad_id: int | None = None,
) -> list[list[int]]:
    """Greedy continuations of several prompts decoded together: each row's new token ids, as ``greedy`` gives.

    Prompts are left-padded and the pads masked out, so each row gets what it would alone (up to rounding: rotary
    embeddings see only relative positions). ``stop(row, tokens)`` ends a row; finished rows are fed ``pad_id``.
    """
    if not prompts:
        return []
    if any(not p for p in prompts):
        raise ValueError("greedy_batch needs non-empty prompts (start with the EOS id for an unconditioned sample)")
    device = model.embed.weight.device
    pad = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
    B, width = len(prompts), max(len(p) for p in prompts)
    tokens = torch.full((B, width), pad, dtype=torch.long)
    mask = torch.zeros(B, width, dtype=torch.bool)
    for row, p in enumerate(prompts):
        tokens[row, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[row, width - len(p) :] = True
    cache = cache or new_cache(model, width + max_new_tokens)
    cache.reset()
    out: list[list[int]] = [[] for _ in prompts]
    done = [max_new_tokens <= 0] * B
    logits = decode(model, tokens.to(device), cache, mask.to(device))
    while not all(done):
        nxt = logits[:, -1].argmax(-1)  # (B,)
        for row, tok in enumerate(nxt.tolist()):
            if done[row]:
                continue
            out[row].append(tok)
            if tok == eos_id or (stop is not None and stop(row, out[row])) or len(out[row]) == max_new_tokens:
                done[row] = True
        if all(done):
            break
        feed = torch.tensor([pad if d else o[-1] for d, o in zip(done, out, strict=True)], dtype=torch.long)
        logits = decode(model, feed.to(device)[:, None], cache)
    return out


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of one text (no special tokens)."""
    return tokenizer.encode([text])[0]


def decode_continuation(tokenizer: Tokenizer, context: Sequence[int], new: Sequence[int]) -> str:
    """The text of ``new`` as it reads after ``context`` (sentencepiece drops a leading space when decoding alone)."""
    head = list(context[-1:])
    return tokenizer.decode(head + list(new))[len(tokenizer.decode(head)) :]


def describe(loaded: Loaded) -> dict[str, Any]:
    """A few facts about a loaded checkpoint, for logs and result files."""
    return {
        "checkpoint": str(loaded.path),
        "step": loaded.step,
        "model": loaded.model.cfg.name,
        "params": sum(p.numel() for p in loaded.model.parameters()),
        "tokenizer": str(loaded.tokenizer.path),
        "context_len": loaded.context_len,
    }
