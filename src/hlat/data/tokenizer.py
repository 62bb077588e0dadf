"""SentencePiece tokenizer: load a user's ``.model`` or train a LLaMA-style one on the data and cache it.

Training follows LLaMA's recipe (BPE, byte fallback, split digits, no normalization; unk=0, bos=1, eos=2),
deterministically, and is cached under a hash of the text and settings so every later run and rank reuses it.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from hlat.config import ConfigError, DataConfig

log = logging.getLogger(__name__)

# Bump when the trainer arguments below change: it is part of the cache key.
_TRAINER_VERSION = 1
# Fixed rather than os.cpu_count(): unigram training gives slightly different pieces for different
# thread counts, and a cached tokenizer must not depend on the machine that trained it.
_TRAIN_THREADS = 8
# sentencepiece silently drops sentences longer than max_sentence_length *bytes*; lines are cut into
# pieces of at most this many characters (<= 4 UTF-8 bytes each) so that nothing is dropped.
_MAX_SENTENCE_BYTES = 16384
_MAX_LINE_CHARS = _MAX_SENTENCE_BYTES // 4
# Cap on the training text; beyond it documents are taken at an even stride (deterministic, unlike
# sentencepiece's random sentence sampling). Tens of MB already give a stable vocabulary.
MAX_TRAIN_CHARS = 32_000_000
MIN_TRAINED_VOCAB = 256 + 3 + 1
"""The smallest vocabulary hlat can train: 256 byte-fallback pieces, <unk>, <s>, </s>, and one piece of text (the
data's characters raise sentencepiece's minimum further; :func:`_train` names it)."""


def check_trainable_vocab(vocab_size: int) -> None:
    """Refuse, before any data is read, a ``model.vocab_size`` too small for any trained tokenizer."""
    if vocab_size < MIN_TRAINED_VOCAB:
        raise ConfigError(
            f"model.vocab_size={vocab_size} must be >= {MIN_TRAINED_VOCAB} to train a tokenizer (256 byte-fallback "
            "pieces, <unk>, <s> and </s>, and at least one piece of text; the data's characters may need more); "
            "set it in that range, e.g. model.vocab_size=4096 (LLaMA's is 32000)"
        )


def _default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # Not on Linux.
        return os.cpu_count() or 1


class Tokenizer:
    """A loaded SentencePiece model; ``fingerprint`` (a hash of the model) tells tokenizers apart in checkpoints."""

    def __init__(self, path: Path | str, num_threads: int | None = None) -> None:
        """Load ``path``; ``num_threads`` (default: the usable cores) parallelizes :meth:`encode`."""
        self.path = Path(path)
        self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        self.vocab_size: int = self._sp.vocab_size()
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        self.num_threads = num_threads or _default_threads()
        self.fingerprint = hashlib.sha256(self._sp.serialized_model_proto()).hexdigest()[:16]

    @property
    def processor(self) -> spm.SentencePieceProcessor:
        """The underlying ``SentencePieceProcessor`` (piece lookup, special ids, sampling, ...)."""
        return self._sp

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without BOS/EOS; texts are encoded in parallel."""
        return self._sp.encode(list(texts), out_type=int, num_threads=self.num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; with the identity normalization this inverts :meth:`encode`."""
        return self._sp.decode(list(ids))

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"


def _training_sample(docs: Sequence[str]) -> list[str]:
    """At most ``MAX_TRAIN_CHARS`` of documents, taken at an even stride over the corpus."""
    total = sum(len(d) for d in docs)
    if total <= MAX_TRAIN_CHARS:
        return list(docs)
    stride = -(-total // MAX_TRAIN_CHARS)  # ceil
    return list(docs[::stride])


def _sentences(docs: Sequence[str]) -> Iterator[str]:
    # LLaMA trains on lines: newlines never become part of a piece (they fall back to the <0x0A>
    # byte), and empty lines would only waste the trainer's time.
    for doc in docs:
        for line in doc.splitlines():
            if line.strip():
                for i in range(0, len(line), _MAX_LINE_CHARS):
                    yield line[i : i + _MAX_LINE_CHARS]


def _cache_key(docs: Sequence[str], vocab_size: int, model_type: str) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(f"hlat-spm-v{_TRAINER_VERSION}|{model_type}|{vocab_size}|{len(docs)}|".encode())
    for doc in docs:
        data = doc.encode("utf-8", "surrogatepass")
        # Length prefixes keep ["ab", "c"] and ["a", "bc"] apart.
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _train(docs: Sequence[str], vocab_size: int, model_type: str) -> bytes:
    buf = io.BytesIO()
    spm.set_random_generator_seed(0)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sentences(docs),
            model_writer=buf,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            character_coverage=0.9995,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=_MAX_SENTENCE_BYTES,
            num_threads=_TRAIN_THREADS,
            minloglevel=2,  # sentencepiece logs every merge to stderr otherwise
        )
    except RuntimeError as err:
        # Drop sentencepiece's "INTERNAL: file.cc(744) [check] " prefix; the sentence after it is the news.
        msg = re.sub(r"^.*?\] ", "", str(err).strip()).rstrip(".")
        needed = re.search(r"smaller than required_chars\. \d+ vs (\d+)", msg)
        if needed:  # sentencepiece's own advice there (character_coverage) is not a setting of hlat
            msg = f"this data needs at least {needed[1]} pieces (the byte pieces, the special pieces, every character)"
            hint = f"raise model.vocab_size to {needed[1]} or more"
        elif "too high" in msg:
            hint = "the training text is too small for that many pieces; lower model.vocab_size"
        else:
            hint = "adjust model.vocab_size"
        raise ConfigError(
            f"sentencepiece could not train a {model_type} tokenizer with model.vocab_size={vocab_size} on this data: "
            f"{msg}; {hint}, or set data.tokenizer=<path to a tokenizer.model> to use an existing tokenizer"
        ) from err
    return buf.getvalue()


def _warn_unused_pieces(tok: Tokenizer, docs: Sequence[str]) -> None:
    # BPE never fails to reach vocab_size: once no pair occurs any more it keeps adding zero-frequency
    # merges. Such pieces never appear in the data, so their embeddings would never be trained.
    sp = tok.processor
    used = set()
    for ids in tok.encode(docs):
        used.update(ids)
    normal = [i for i in range(tok.vocab_size) if not (sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i))]
    unused = sum(1 for i in normal if i not in used)
    if unused > 0.1 * len(normal):
        log.warning(
            "%d of the tokenizer's %d vocabulary pieces never occur in its training text: the data is too small for "
            "model.vocab_size=%d; consider a smaller model.vocab_size or data.tokenizer=<path to a tokenizer.model>",
            unused,
            tok.vocab_size,
            tok.vocab_size,
        )


def load_tokenizer(path: Path | str, vocab_size: int) -> Tokenizer:
    """Load the user's tokenizer (``data.tokenizer``) and check it against ``model.vocab_size``.

    Raises:
        ConfigError: The file is missing or unreadable, its vocabulary size differs, or it has no EOS piece.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"data.tokenizer={path} does not exist; point it at a sentencepiece .model file "
            "or set data.tokenizer=null to train one on the data"
        )
    try:
        tok = Tokenizer(path)
    except (RuntimeError, OSError) as err:
        raise ConfigError(
            f"data.tokenizer={path} is not a sentencepiece model ({err}); point it at a sentencepiece .model file "
            "(`hlat data tokenizer` trains one) or set data.tokenizer=null to train one on the data"
        ) from err
    if tok.vocab_size != vocab_size:
        raise ConfigError(
            f"data.tokenizer={path} has {tok.vocab_size} pieces but model.vocab_size={vocab_size}; "
            f"set model.vocab_size={tok.vocab_size} or use a tokenizer with {vocab_size} pieces"
        )
    if tok.eos_id < 0:
        raise ConfigError(
            f"data.tokenizer={path} has no EOS piece; packing needs one to separate documents: use a tokenizer "
            "with one (`hlat data tokenizer` trains one) or set data.tokenizer=null to train one on the data"
        )
    return tok


def load_or_train_tokenizer(
    cfg: DataConfig,
    texts_or_corpus_path: Sequence[str] | Path | str,
    vocab_size: int,
    cache_dir: Path | str,
) -> Tokenizer:
    """The tokenizer for a run: ``data.tokenizer`` if set, else one trained on the data, cached in ``cache_dir``.

    Raises:
        ConfigError: See :func:`load_tokenizer`; or training cannot produce ``vocab_size`` pieces.
    """
    if cfg.tokenizer is not None:
        return load_tokenizer(cfg.tokenizer, vocab_size)
    check_trainable_vocab(vocab_size)
    if isinstance(texts_or_corpus_path, (str, Path)):
        from hlat.data.sources import load_documents

        docs: Sequence[str] = load_documents(texts_or_corpus_path, cfg.text_column).texts
    else:
        docs = texts_or_corpus_path
    sample = _training_sample(docs)
    if not sample:
        raise ConfigError("cannot train a tokenizer without documents; check data.path and data.text_column")
    key = _cache_key(sample, vocab_size, cfg.tokenizer_type)
    path = Path(cache_dir).expanduser() / "tokenizers" / f"spm-{cfg.tokenizer_type}-{vocab_size}-{key}.model"
    if path.is_file():
        return load_tokenizer(path, vocab_size)

    log.info(
        "training a %d-piece %s tokenizer on %d documents (%.1f MB; one-off, cached)",
        vocab_size,
        cfg.tokenizer_type,
        len(sample),
        sum(len(d) for d in sample) / 1e6,
    )
    start = time.perf_counter()
    model = _train(sample, vocab_size, cfg.tokenizer_type)
    # Atomic write: ranks training concurrently write the same model, and a reader never sees half a file.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(model)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    tok = load_tokenizer(path, vocab_size)
    log.info("trained the tokenizer in %.1fs -> %s", time.perf_counter() - start, path)
    _warn_unused_pieces(tok, sample)
    return tok
