"""The Hugging Face tokenizer files of an export: ``tokenizer.json`` that tokenizes exactly as hlat's sentencepiece.

hlat's identity-normalized BPE only prepends "▁" and writes spaces as "▁"; the file does the same, as one word, with
BPE over sentencepiece's pieces. EOS is also the start-of-sequence token: hlat packs documents as ``ids + [EOS]``, so
EOS (id 2), never ``<s>``, precedes every document.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TOKENIZER_JSON = "tokenizer.json"
SPACE = "▁"  # sentencepiece's whitespace symbol (U+2581)


def _proto(spm_path: Path) -> Any:
    """The parsed ``ModelProto`` of a sentencepiece model (needs protobuf, which mlflow brings)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(spm_path.read_bytes())
    return proto


def merges(pieces: list[tuple[str, float, bool]]) -> list[tuple[str, str]]:
    """BPE merges reproducing sentencepiece's: every split of a normal piece into two normal pieces, by score.

    ``pieces``: ``(piece, score, normal)`` per id. Highest merged-piece score first (ties: lower id, then shorter
    left part), the order in which sentencepiece merges pairs.
    """
    normal = {p: i for i, (p, _, ok) in enumerate(pieces) if ok}
    out = []
    for piece, i in normal.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        out += [(-pieces[i][1], i, len(a), a, b) for a, b in splits if a in normal and b in normal]
    return [(a, b) for *_, a, b in sorted(out)]


def tokenizer_json(spm_path: Path) -> dict[str, Any]:
    """The ``tokenizers`` serialization that encodes and decodes as the sentencepiece model at ``spm_path``."""
    proto = _proto(spm_path)
    norm = proto.normalizer_spec
    if norm.name != "identity" or norm.remove_extra_whitespaces or norm.precompiled_charsmap:
        log.warning(
            "%s normalizes text (rule %r, remove_extra_whitespaces=%s); the exported tokenizer.json does "
            "not, so transformers may tokenize some texts differently",
            spm_path,
            norm.name,
            norm.remove_extra_whitespaces,
        )
    pieces = [(p.piece, p.score, p.type == proto.SentencePiece.NORMAL) for p in proto.pieces]
    prefix = norm.add_dummy_prefix
    replace_space = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    decoders = [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if prefix:  # sentencepiece drops the dummy prefix's space when decoding
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    unk = proto.pieces[proto.trainer_spec.unk_id].piece if proto.trainer_spec.unk_id >= 0 else None
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],  # none: transformers adds the declared special tokens, not matched in text (below)
        "normalizer": {
            "type": "Sequence",
            "normalizers": ([{"type": "Prepend", "prepend": SPACE}] if prefix else []) + [replace_space],
        },
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {},
        },
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": proto.trainer_spec.byte_fallback,
            "ignore_merges": False,
            "vocab": {p: i for i, (p, _, _) in enumerate(pieces)},
            "merges": [list(m) for m in merges(pieces)],
        },
    }


def write_tokenizer(spm_path: Path, out: Path, max_len: int, piece: dict[str, str]) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into ``out``.

    ``piece``: ``eos_token`` (required) and ``unk_token``; ``bos_token`` is set to EOS.
    """
    special = {**piece, "bos_token": piece["eos_token"]}
    _dump(out / TOKENIZER_JSON, tokenizer_json(spm_path))
    _dump(
        out / "tokenizer_config.json",
        {
            # Not LlamaTokenizer: its Metaspace drops the dummy prefix of a text led by spaces ("  a" -> "▁▁▁a" in
            # sentencepiece), and in transformers 5 it rebuilds its pipeline whatever tokenizer.json says.
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "pad_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "split_special_tokens": True,  # "</s>" in a text is text, as hlat's sentencepiece encoded it
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_len,
            "spaces_between_special_tokens": False,
        },
    )
    _dump(out / "special_tokens_map.json", special)


def _dump(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
