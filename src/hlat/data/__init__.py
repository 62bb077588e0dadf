"""Training data: corpus sources, the builtin corpus, tokenizer, packing and the resumable loaders.

Also the pre-packed baseline (``offline``) and ``hlat data`` (``prepare``).
May import: ``hlat.config`` and the core modules only.
"""

from hlat.data.build import Loader, build_loader
from hlat.data.builtin import builtin_corpus_path
from hlat.data.loader import PackedStream, StreamSpec
from hlat.data.packing import Packer
from hlat.data.sources import Documents, TextSource, load_documents
from hlat.data.tokenizer import Tokenizer, load_or_train_tokenizer, load_tokenizer

__all__ = [
    "Documents",
    "Loader",
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
