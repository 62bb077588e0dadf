"""Reading an hlat checkpoint's weights and tokenizer, or a Hugging Face LLaMA directory's, outside training.

Finding a checkpoint, its recorded config, its weights (one process, resharded to the tp=1 layout), the tokenizer
it trained with, and the weights of ``train.init_from``; evaluation, export and import read checkpoints here too.
May import: ``hlat.config``, the core, ``hlat.data``, ``hlat.backends.torch.dist``, the rest of ``hlat.checkpoint``.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hlat import checkpoint as ckpt
from hlat import safe_load
from hlat.backends.torch.dist import gate_up_in_model_order
from hlat.checkpoint.hf_layout import (
    Tensors,
    check_tensors,
    expected_shapes,
    import_hf,
    model_overrides,
)
from hlat.checkpoint.saved_config import _build, model_config, run_config  # noqa: F401  run_config re-exported
from hlat.checkpoint.xser import NeuronCheckpoint
from hlat.config import ConfigError, DataConfig, ModelConfig, RunConfig
from hlat.data.builtin import builtin_corpus_path
from hlat.data.loader import tokenizer_sample
from hlat.data.sources import TextSource
from hlat.data.tokenizer import Tokenizer, load_or_train_tokenizer, load_tokenizer

log = logging.getLogger(__name__)
EXTRA = "extra.rank0.pt"
"""The rank-0 train-state file the torch backend writes next to the weights (holds the tokenizer fingerprint)."""
SHAPE = {
    "dim": "dim",
    "n_layers": "n_layers",
    "n_heads": "n_heads",
    "kv_heads": "n_kv_heads",
    "ffn_dim": "ffn_dim",
    "vocab_size": "vocab_size",
}
"""ModelConfig attribute -> config key, for the fields that decide the shape of the weights."""


# ------------------------------------------------------------------------------------------------ hlat checkpoints


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint ``path`` names: a ``step_N`` directory, or the newest intact one in a checkpoints or run dir.

    Raises:
        ConfigError: Nothing is there, the named checkpoint is damaged, or no complete checkpoint is found.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"checkpoint={path} does not exist; give a step_N checkpoint or a run's checkpoints/ dir")
    if ckpt.manifest(p) is not None:
        bad = ckpt.problems(p, checksums=True)
        if bad:
            raise ConfigError(
                f"checkpoint={path} is damaged ({'; '.join(bad)}); give its parent directory to use "
                "the newest intact checkpoint"
            )
        return p
    for root in (p, p / "checkpoints"):
        found = ckpt.latest(root)
        if found is not None:
            return found
    raise ConfigError(
        f"checkpoint={path} is neither a checkpoint nor a directory of them: no complete checkpoint "
        f"there (a step_* directory with {ckpt.MANIFEST}); give a step_N checkpoint or a run's "
        "checkpoints/ dir"
    )


def check_torch_backend(path: Path) -> None:
    """ConfigError unless the checkpoint holds DCP files (torch backend) or NxD's xser files (neuron backend)."""
    backend = ((ckpt.manifest(path) or {}).get("config") or {}).get("cluster", {}).get("backend", "torch")
    if backend == "neuron" and (path / "model").is_dir():
        return  # read through hlat.checkpoint.xser
    if backend not in ("torch", "neuron"):
        what = f"was written by the {backend} backend, which hlat cannot read outside training"
    elif backend == "neuron":
        what = "has no model/ directory: it is not an NxD xser checkpoint"
    elif not (path / ".metadata").is_file():
        what = "has no .metadata: it is not a torch.distributed.checkpoint"
    else:
        return
    raise ConfigError(f"checkpoint {path} {what}: give a checkpoint written by hlat's torch or neuron backend")


def _read_neuron_weights(path: Path, cfg: ModelConfig, into: Tensors | None) -> Tensors:
    """The model weights of a neuron-backend checkpoint, gathered to the tp=1 layout one tensor at a time."""
    source = NeuronCheckpoint(path, verify=False)  # find_checkpoint has checked it
    weights = {k.removeprefix("model."): v for k, v in source.tensors().items() if k.startswith("model.")}
    check_tensors({k: torch.Size(v[0]) for k, v in weights.items()}, expected_shapes(cfg), f"checkpoint {path}")
    sd = into if into is not None else {}
    with torch.no_grad():
        for name in weights:
            t = source.read(f"model.{name}")
            if name in sd:
                sd[name].copy_(t)
            else:
                sd[name] = t
    return sd


def read_weights(path: Path, cfg: ModelConfig, into: Tensors | None = None) -> Tensors:
    """The model weights of the DCP (or neuron xser) checkpoint at ``path`` (no optimizer state), in the tp=1 layout.

    One process, no process group: sharded saves are resharded, and a tp > 1 run's interleaved gate_up rows are
    put back as ``[gate; up]``. ``into``: tensors to load into (default: new CPU tensors in the stored dtype).

    Raises:
        ConfigError: The stored tensors do not match ``cfg``, or the checkpoint is not trusted (:mod:`hlat.safe_load`).
    """
    if ((ckpt.manifest(path) or {}).get("config") or {}).get("cluster", {}).get("backend") == "neuron":
        return _read_neuron_weights(path, cfg, into)
    md = safe_load.read_metadata(path).state_dict_metadata  # never unpickles code from the checkpoint
    stored = {
        k.removeprefix("model."): m
        for k, m in md.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
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
    """The model config, state dict (CPU, stored dtype, tp=1 layout) and directory of the checkpoint ``path`` names."""
    path = find_checkpoint(path)
    check_torch_backend(path)
    cfg = model_config(path)
    return cfg, read_weights(path, cfg), path


def saved_tokenizer_fingerprint(path: Path) -> str | None:
    """The tokenizer fingerprint the data loader recorded in the checkpoint (None if it is not there)."""
    try:
        extra = torch.load(path / EXTRA, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError):
        return None
    return (extra.get("data") or {}).get("tokenizer")


def find_tokenizer(
    path: Path, explicit: str | Path | None = None, *, vocab: int | None = None, retrain: bool = False
) -> Tokenizer:
    """The sentencepiece tokenizer a checkpoint's model was trained with.

    The first of: ``explicit``; a weights-only checkpoint's own file; the run's ``data.tokenizer``; the one it cached
    under ``data.cache_dir``; with ``retrain`` (needs ``vocab``), trained again on the run's data. All but
    ``explicit`` must match the fingerprint the checkpoint's data state saved.

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
            raise ConfigError(
                f"cannot find the tokenizer of {path} (fingerprint {saved}) among the {len(cached)} "
                f"cached in {cache_dir / 'tokenizers'}; {hint}"
            )
    if saved is not None and tok.fingerprint != saved and explicit is not None:
        log.warning(
            "tokenizer=%s is not the tokenizer the run trained with (fingerprint %s, the checkpoint says %s)",
            explicit,
            tok.fingerprint,
            saved,
        )
    elif saved is not None and tok.fingerprint != saved:
        why = f"{given} changed after the run" if given else "the data or the builtin corpus's Python version changed"
        raise ConfigError(
            f"the tokenizer found for checkpoint {path} ({tok.path}) is not the one the run trained "
            f"with (fingerprint {tok.fingerprint}, the checkpoint says {saved}): {why}; "
            f"{hint}"
        )
    return tok


def _open_tokenizer(path: str | Path, vocab: int | None) -> Tokenizer:
    """A sentencepiece model file, checked against the model's vocabulary size when that is given."""
    if vocab is not None:
        return load_tokenizer(path, vocab)
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"tokenizer {path} does not exist; pass tokenizer=<a sentencepiece .model>")
    return Tokenizer(path)


# ---------------------------------------------------------------------------------- train.init_from


def load_init_weights(path: Path, cfg: ModelConfig) -> tuple[Tensors, Path | None]:
    """The weights a new run starts from (an hlat checkpoint or a HF LLaMA directory) and their tokenizer, if known.

    Load them after ``init_weights`` and before any dtype cast or tensor-parallel split (tp=1 layout).

    Raises:
        ConfigError: The weights' shape differs from ``cfg`` (naming each key), or see ``hf_layout.import_hf``.
    """
    path = Path(path).expanduser()
    if (path / "config.json").is_file() and ckpt.manifest(path) is None:
        have, sd, spm = import_hf(path)
    else:
        have, sd, found = load_checkpoint_weights(path)
        try:
            spm = checkpoint_tokenizer(found)
        except ConfigError:
            spm = None
    diff = [
        f"model.{key}={getattr(cfg, attr)} but {getattr(have, attr)} there"
        for attr, key in SHAPE.items()
        if getattr(cfg, attr) != getattr(have, attr)
    ]
    if diff:
        raise ConfigError(
            f"cannot start from the weights in {path}: {'; '.join(diff)}; set these model keys to the "
            f"weights' values ({' '.join(model_overrides(have))})"
        )
    for key in ("max_seq_len", "norm_eps", "rope_theta"):  # a different function, but a legitimate one (long context)
        if getattr(cfg, key) != getattr(have, key):
            log.warning(
                "starting from %s with model.%s=%s; the weights were trained with %s",
                path,
                key,
                getattr(cfg, key),
                getattr(have, key),
            )
    return sd, spm


def initial_weights(cfg: RunConfig) -> Tensors:
    """The weights of ``train.init_from``, checked against the model config and the run's tokenizer."""
    state, tokenizer = load_init_weights(Path(cfg.train.init_from), cfg.model)
    mine = cfg.data.tokenizer
    if tokenizer is not None and (mine is None or Path(mine).expanduser().read_bytes() != tokenizer.read_bytes()):
        raise ConfigError(
            f"train.init_from={cfg.train.init_from} was trained with the tokenizer {tokenizer}, but this run "
            f"{'would train its own' if mine is None else f'uses data.tokenizer={mine}'}: set "
            f"data.tokenizer={tokenizer} so the token ids mean what the weights learned"
        )
    log.info("starting from the weights of %s", cfg.train.init_from)
    return state


def checkpoint_tokenizer(ckpt: Path, explicit: Path | None = None) -> Path:
    """The sentencepiece model file a checkpoint was trained with (:func:`find_tokenizer`, no retraining).

    Raises:
        ConfigError: None is found that matches the tokenizer fingerprint the checkpoint's data state records.
    """
    return find_tokenizer(ckpt, explicit).path
