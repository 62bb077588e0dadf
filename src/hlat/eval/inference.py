"""Load an hlat checkpoint for use outside training, and greedy decoding with the KV cache.

``load(checkpoint)`` takes a checkpoint directory (``step_N``), a run's ``checkpoints/`` directory or a run
directory holding one (then the newest checkpoint whose files match their checksums), rebuilds the model from the
config in the checkpoint's manifest, reads only the model weights from the torch backend's
torch.distributed.checkpoint files (no process group; tensor- or FSDP-sharded saves are resharded into one plain
model, and the fused gate_up rows a tensor-parallel run interleaved are put back in order), and finds the tokenizer
the run trained with: ``data.tokenizer`` if the run named one, else the run's trained tokenizer from
``data.cache_dir`` (retrained from the same data, deterministically, if the cache is gone), checked against the
fingerprint the data loader saved in the checkpoint. A weights-only checkpoint (``hlat import``) brings its own
tokenizer file. ``hlat.eval.hf`` (export, ``train.init_from``) reads checkpoints through the same functions
(``load_checkpoint_weights``, ``find_tokenizer``). Example::

    loaded = load("outputs/2025-01-01/12-00-00/checkpoints", device="cuda")
    ids = greedy(loaded.model, loaded.tokenizer.encode(["def f():"])[0], max_new_tokens=20)

``greedy_batch`` decodes several prompts of different lengths together (left-padded, the pads masked out).
"""

from __future__ import annotations

import dataclasses
import logging
import typing
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hlat import safe_load
from hlat.backends.torch_dist import gate_up_in_model_order
from hlat.bf16_matmul import apply_auto_policy
from hlat.config import DTYPES, ConfigError, DataConfig, ModelConfig, RunConfig
from hlat.data.builtin import builtin_corpus_path
from hlat.data.loader import tokenizer_sample
from hlat.data.sources import TextSource
from hlat.data.tokenizer import Tokenizer, load_or_train_tokenizer, load_tokenizer
from hlat.model import KVCache, Transformer
from hlat.train import checkpoint as ckpt

log = logging.getLogger(__name__)
EXTRA = "extra.rank0.pt"
"""The rank-0 train-state file the torch backend writes next to the weights (holds the tokenizer fingerprint)."""
Tensors = dict[str, torch.Tensor]


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


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: itself, or the newest intact one under it.

    Args:
        path: A ``step_N`` checkpoint (or a weights-only one from ``hlat import``), a checkpoints root holding
            ``step_*`` directories, or a run directory holding ``checkpoints/``.

    Raises:
        ConfigError: Nothing is there, the named checkpoint is damaged, or no complete checkpoint is found.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"checkpoint={path} does not exist; give a step_N checkpoint or a run's checkpoints/ dir")
    if ckpt.manifest(p) is not None:
        bad = ckpt.problems(p, checksums=True)
        if bad:
            raise ConfigError(f"checkpoint={path} is damaged ({'; '.join(bad)}); give its parent directory to use "
                              "the newest intact checkpoint")  # fmt: skip
        return p
    for root in (p, p / "checkpoints"):
        found = ckpt.latest(root)
        if found is not None:
            return found
    raise ConfigError(f"checkpoint={path} is neither a checkpoint nor a directory of them: no complete checkpoint "
                      f"there (a step_* directory with {ckpt.MANIFEST}); give a step_N checkpoint or a run's "
                      "checkpoints/ dir")  # fmt: skip


def run_config(path: Path) -> RunConfig:
    """The resolved config recorded in a checkpoint's manifest (keys this version does not know are ignored).

    Raises:
        ConfigError: The manifest records no config, or one this version of hlat rejects.
    """
    saved = (ckpt.manifest(path) or {}).get("config")
    if not isinstance(saved, dict):
        raise ConfigError(f"checkpoint {path}: its {ckpt.MANIFEST} records no config (written by an older hlat?)")
    try:
        return _build(RunConfig, saved)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint {path}: the config in its {ckpt.MANIFEST} is not valid now ({e})") from e


def model_config(path: Path) -> ModelConfig:
    """The model config alone from a checkpoint's manifest (all a weights-only checkpoint records)."""
    meta = ckpt.manifest(path) or {}
    saved = (meta.get("config") or {"model": meta.get("model")}).get("model")  # top-level: before the whole config
    if not isinstance(saved, dict):
        raise ConfigError(f"checkpoint {path}: its {ckpt.MANIFEST} records no model config (not written by hlat?)")
    return _build(ModelConfig, saved)


def _build(cls: type, values: dict[str, Any]) -> Any:
    """The dataclass ``cls`` from ``dataclasses.asdict`` output, nested dataclasses (and lists of them) included."""
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _value(hints[f.name], values[f.name]) for f in dataclasses.fields(cls)
                  if f.init and f.name in values})  # fmt: skip


def _value(tp: Any, v: Any) -> Any:
    if dataclasses.is_dataclass(tp) and isinstance(v, dict):
        return _build(tp, v)
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (list, tuple) and args and isinstance(v, list):
        return type(v)(_value(args[0], x) for x in v)
    for arg in args:  # X | None
        if dataclasses.is_dataclass(arg) and isinstance(v, dict):
            return _build(arg, v)
    return v


def check_torch_backend(path: Path) -> None:
    """ConfigError unless the checkpoint holds torch.distributed.checkpoint files (torch backend or ``hlat import``).

    They are the only checkpoints read outside training: evaluation, ``hlat export`` and ``train.init_from``.
    """
    backend = ((ckpt.manifest(path) or {}).get("config") or {}).get("cluster", {}).get("backend", "torch")
    if backend != "torch":
        what = f"was written by the {backend} backend (NxD xser shards, not torch.distributed.checkpoint)"
    elif not (path / ".metadata").is_file():
        what = "has no .metadata: it is not a torch.distributed.checkpoint"
    else:
        return
    raise ConfigError(f"checkpoint {path} {what}: evaluation runs on the torch backend, and NxD checkpoints "
                      "cannot be exported or loaded by train.init_from yet; evaluate a torch-backend run")  # fmt: skip


def expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Name -> shape of every saved tensor of hlat's model (built on the meta device: allocates nothing)."""
    with torch.device("meta"):
        return {k: v.shape for k, v in Transformer(cfg).state_dict().items()}


def check_tensors(have: dict[str, torch.Size], want: dict[str, torch.Size], where: str) -> None:
    """ConfigError naming the missing, unexpected and wrongly shaped tensors of ``where`` (up to 4 of each)."""
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    wrong = [f"{k} {tuple(have[k])} (expected {tuple(want[k])})" for k in sorted(set(want) & set(have))
             if have[k] != want[k]]  # fmt: skip
    if missing or extra or wrong:
        parts = [f"missing {missing[:4]}" if missing else "", f"unexpected {extra[:4]}" if extra else "",
                 f"wrong shapes {wrong[:4]}" if wrong else ""]  # fmt: skip
        raise ConfigError(f"{where} does not match its config: {'; '.join(p for p in parts if p)}")


def read_weights(path: Path, cfg: ModelConfig, into: Tensors | None = None) -> Tensors:
    """The model weights of the DCP checkpoint at ``path`` (no optimizer state), in the tp=1 layout.

    One process reads the whole model without a process group: tensor- or FSDP-sharded saves are resharded into
    whole tensors, and the fused gate_up rows that a run with ``parallelism.tp`` = t > 1 stored as
    ``[gate_0; up_0; ..; gate_{t-1}; up_{t-1}]`` (``backends/torch_dist.py``) are put back as ``[gate; up]``.

    Args:
        path: A checkpoint directory (see :func:`check_torch_backend`).
        cfg: Its model config; the stored tensors must have its shapes.
        into: Tensors to load into, cast to their dtype and device (a model's ``state_dict()``); default: new CPU
            tensors in the stored dtype.

    Raises:
        ConfigError: The stored tensors do not match ``cfg``, or the checkpoint holds more than data (it is not
            trusted: see :mod:`hlat.safe_load`).
    """
    md = safe_load.read_metadata(path).state_dict_metadata  # never unpickles code from the checkpoint
    stored = {k.removeprefix("model."): m for k, m in md.items()
              if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}  # fmt: skip
    check_tensors({k: m.size for k, m in stored.items()}, expected_shapes(cfg), f"checkpoint {path}")
    sd = into if into is not None else {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in stored.items()}
    with warnings.catch_warnings():  # "torch.distributed is disabled": no process group, as intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        safe_load.load({"model": sd}, path, no_dist=True)  # in place; only the "model" keys
    tp = ((ckpt.manifest(path) or {}).get("config") or {}).get("parallelism", {}).get("tp", 1)
    if tp > 1:
        with torch.no_grad():
            for i in range(cfg.n_layers):
                w = sd[f"layers.{i}.mlp.gate_up.weight"]
                w.copy_(gate_up_in_model_order(w, tp))
    return sd


def load_checkpoint_weights(path: str | Path) -> tuple[ModelConfig, Tensors, Path]:
    """The model of an hlat checkpoint (torch backend, or weights-only) in its stored dtype, in the tp=1 layout.

    Args:
        path: A checkpoint directory, a checkpoints root or a run directory (see :func:`find_checkpoint`).

    Returns:
        The model config from the manifest, the state dict (hlat names, CPU), and the checkpoint directory used.
    """
    path = find_checkpoint(path)
    check_torch_backend(path)
    cfg = model_config(path)
    return cfg, read_weights(path, cfg), path


def load_weights(path: Path, cfg: ModelConfig, device: torch.device | str = "cpu",
                 dtype: str = "float32") -> Transformer:  # fmt: skip
    """The decoder of ``cfg`` in eval mode with the weights of the checkpoint at ``path`` (see :func:`read_weights`).

    Raises:
        ConfigError: ``dtype`` is not a dtype name, or see :func:`read_weights`.
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


def saved_tokenizer_fingerprint(path: Path) -> str | None:
    """The tokenizer fingerprint the data loader recorded in the checkpoint (None if it is not there)."""
    try:
        extra = torch.load(path / EXTRA, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError):
        return None
    return (extra.get("data") or {}).get("tokenizer")


def find_tokenizer(path: Path, explicit: str | Path | None = None, *, vocab: int | None = None,
                   retrain: bool = False) -> Tokenizer:  # fmt: skip
    """The sentencepiece tokenizer a checkpoint's model was trained with.

    The first of: ``explicit``; the file a weights-only checkpoint carries; the run's ``data.tokenizer``; the
    tokenizer the run trained and cached under ``data.cache_dir``, found by the fingerprint that the data loader
    saved in the checkpoint; with ``retrain``, the one ``hlat.data.build_loader`` trains on the run's data
    (deterministically: the same one, unless the data changed). All but ``explicit`` must have that fingerprint.

    Args:
        path: The checkpoint directory.
        explicit: A sentencepiece ``.model`` to use instead (another fingerprint is only a warning).
        vocab: The model's vocabulary size, to check the tokenizer against (None: unchecked).
        retrain: Train the tokenizer again when it is not in the cache (needs ``vocab``).

    Raises:
        ConfigError: No tokenizer is found, or the one found is not the one the run trained with.
    """
    meta = ckpt.manifest(path) or {}
    data = None if meta.get("weights_only") else _build(DataConfig, (meta.get("config") or {}).get("data") or {})
    saved = saved_tokenizer_fingerprint(path)
    hint = "pass tokenizer=<the .model it was trained with> (hlat export: --tokenizer)"
    stored = path / meta["tokenizer"] if meta.get("tokenizer") else None
    given = next((t for t in (explicit, stored, data.tokenizer if data else None) if t), None)
    if given is not None:
        tok = _open_tokenizer(given, vocab)
    elif data is None:
        raise ConfigError(f"checkpoint {path} holds weights only and no tokenizer; {hint}")
    else:
        cache_dir = Path(data.cache_dir).expanduser()
        cached = sorted((cache_dir / "tokenizers").glob("spm-*.model"))
        hit = next((c for c in cached if saved and Tokenizer(c, num_threads=1).fingerprint == saved), None)
        if hit is not None:
            tok = _open_tokenizer(hit, vocab)
        elif retrain and vocab is not None:
            corpus = builtin_corpus_path(cache_dir) if data.path is None else data.path
            column = "text" if data.path is None else data.text_column
            tok = load_or_train_tokenizer(data, tokenizer_sample(TextSource(corpus, column)), vocab, cache_dir)
        else:
            raise ConfigError(f"cannot find the tokenizer of {path} (fingerprint {saved}) among the {len(cached)} "
                              f"cached in {cache_dir / 'tokenizers'}; {hint}")  # fmt: skip
    if saved is not None and tok.fingerprint != saved and explicit is not None:
        log.warning("tokenizer=%s is not the tokenizer the run trained with (fingerprint %s, the checkpoint says %s)",
                    explicit, tok.fingerprint, saved)  # fmt: skip
    elif saved is not None and tok.fingerprint != saved:
        why = f"{given} changed after the run" if given else "the data or the builtin corpus's Python version changed"
        raise ConfigError(f"the tokenizer found for checkpoint {path} ({tok.path}) is not the one the run trained "
                          f"with (fingerprint {tok.fingerprint}, the checkpoint says {saved}): {why}; "
                          f"{hint}")  # fmt: skip
    return tok


def _open_tokenizer(path: str | Path, vocab: int | None) -> Tokenizer:
    """A sentencepiece model file, checked against the model's vocabulary size when that is given."""
    if vocab is not None:
        return load_tokenizer(path, vocab)
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"tokenizer {path} does not exist; pass tokenizer=<a sentencepiece .model>")
    return Tokenizer(path)


def load(checkpoint: str | Path, device: str = "cpu", dtype: str = "float32", tokenizer: str | None = None) -> Loaded:
    """Load a torch-backend checkpoint's model and the run's tokenizer (see the module docstring).

    Args:
        checkpoint: A ``step_N`` checkpoint, a checkpoints root or a run directory.
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: Weight dtype for inference (``float32`` or ``bfloat16``), whatever the checkpoint stores.
        tokenizer: A sentencepiece ``.model`` to use instead of the run's.

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
def greedy(model: Transformer, prompt: Sequence[int], max_new_tokens: int, *, eos_id: int | None = None,
           stop: Callable[[list[int]], bool] | None = None, cache: KVCache | None = None,
           use_cache: bool = True) -> list[int]:  # fmt: skip
    """Greedy continuation of one prompt: the new token ids (stopping after ``eos_id`` or when ``stop`` says so).

    Args:
        model: The decoder.
        prompt: Token ids, at least one; prompt + new tokens must fit ``model.max_seq_len``.
        max_new_tokens: Most tokens to generate.
        eos_id: Stop after generating this id (it is included in the result).
        stop: Called with the tokens generated so far after each one; True stops.
        cache: A cache to reuse (it is reset first); by default one sized for this generation.
        use_cache: False recomputes the whole sequence for every token (quadratic; a reference for tests).
    """
    if not prompt:
        raise ValueError("greedy needs a non-empty prompt (start with the EOS id for an unconditioned sample)")
    device = model.embed.weight.device
    tokens = torch.tensor([list(prompt)], dtype=torch.long, device=device)  # (1, T)
    if use_cache:
        cache = cache or model.new_cache(len(prompt) + max_new_tokens)
        cache.reset()
    out: list[int] = []
    logits = model(tokens, cache) if use_cache else model(tokens)
    while len(out) < max_new_tokens:
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        out.append(int(nxt))
        if out[-1] == eos_id or (stop is not None and stop(out)) or len(out) == max_new_tokens:
            break
        if use_cache:
            logits = model(nxt, cache)
        else:
            tokens = torch.cat([tokens, nxt], dim=1)
            logits = model(tokens)
    return out


@torch.inference_mode()
def greedy_batch(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 eos_id: int | None = None, stop: Callable[[int, list[int]], bool] | None = None,
                 cache: KVCache | None = None, pad_id: int | None = None) -> list[list[int]]:  # fmt: skip
    """Greedy continuations of several prompts decoded together: each row's new token ids, as ``greedy`` gives.

    The prompts are left-padded to the longest and the pads masked out of attention (``Transformer.forward``'s
    ``mask``), so each row attends only to its own tokens; with rotary embeddings the shared column positions give
    every row what it would get alone (up to float rounding). A row is done after ``eos_id`` (kept in its result)
    or when ``stop`` says so; done rows are fed ``pad_id`` and their outputs dropped, and decoding ends when every
    row is done or after ``max_new_tokens``.

    Args:
        model: The decoder.
        prompts: Token ids per row, each at least one; the longest + ``max_new_tokens`` must fit
            ``model.max_seq_len``.
        max_new_tokens: Most tokens to generate per row.
        eos_id: A row stops after generating this id.
        stop: Called with a row's index and its tokens generated so far after each new one; True stops that row.
        cache: A cache to reuse (it is reset first); by default one sized for this generation.
        pad_id: The id fed at padding and to finished rows (default ``eos_id``, else 0); masked or ignored.
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
    cache = cache or model.new_cache(width + max_new_tokens)
    cache.reset()
    out: list[list[int]] = [[] for _ in prompts]
    done = [max_new_tokens <= 0] * B
    logits = model(tokens.to(device), cache, mask.to(device))
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
        logits = model(feed.to(device)[:, None], cache)
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
    return {"checkpoint": str(loaded.path), "step": loaded.step, "model": loaded.model.cfg.name,
            "params": sum(p.numel() for p in loaded.model.parameters()), "tokenizer": str(loaded.tokenizer.path),
            "context_len": loaded.context_len}  # fmt: skip
