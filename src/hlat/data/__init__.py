"""Training data: corpus sources, the builtin corpus, tokenizer, packing and the resumable loaders."""

from hlat.data.builtin import builtin_corpus_path
from hlat.data.loader import PackedStream, StreamSpec, build_loader
from hlat.data.packing import Packer
from hlat.data.sources import Documents, TextSource, load_documents
from hlat.data.tokenizer import Tokenizer, load_or_train_tokenizer, load_tokenizer

__all__ = [
    "Documents",
    "PackedStream",
    "Packer",
    "StreamSpec",
    "TextSource",
    "Tokenizer",
    "build_loader",
    "builtin_corpus_path",
    "load_documents",
    "load_or_train_tokenizer",
    "load_tokenizer",
]
