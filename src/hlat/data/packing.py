"""Pack tokenized documents, each followed by EOS, into ``seq_len + 1``-token windows: no padding, nothing dropped.

Windows start ``seq_len`` apart and so share one token (as Megatron-LM's GPT dataset): every token is predicted
exactly once. A window may span documents (no masking at EOS, as in LLaMA). The resume state is the ``(tag,
offset)`` where the next window starts: re-reading that document and dropping ``offset`` tokens rebuilds the buffer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Sequence

import numpy as np


class Packer:
    """Turns a stream of tokenized documents into ``seq_len + 1``-token windows.

    Args:
        seq_len: Tokens per training sequence; windows hold ``seq_len + 1`` tokens.
        eos_id: Token appended after every document.
    """

    # Compacting the buffer (dropping emitted tokens) only once this many are dead keeps it O(1)
    # amortized per token, instead of copying the remainder after every window.
    _COMPACT_AT = 1 << 16

    def __init__(self, seq_len: int, eos_id: int) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.seq_len = seq_len
        self.eos_id = eos_id
        self._buf: list[int] = []
        self._start = 0  # index in _buf of the first token not yet emitted as an input
        self._docs: deque[tuple[int, Hashable]] = deque()  # (index in _buf where the doc starts, its tag)

    @property
    def buffered(self) -> int:
        """Tokens in the buffer, including the one shared with the previous window."""
        return len(self._buf) - self._start

    def windows_ready(self) -> int:
        """Number of complete windows that :meth:`pop` can return now."""
        return max(0, (self.buffered - 1) // self.seq_len)

    def add(self, docs: Iterable[Sequence[int]], tags: Iterable[Hashable], skip: int = 0) -> None:
        """Append tokenized documents, each followed by EOS; ``tags`` name them for :meth:`position`.

        ``skip`` (on resume) drops that many tokens of the first document, at most all of them.
        """
        for i, (ids, tag) in enumerate(zip(docs, tags, strict=True)):
            drop = skip if i == 0 else 0
            assert drop <= len(ids), f"resume offset {drop} beyond a {len(ids)}-token document"
            self._docs.append((len(self._buf) - drop, tag))  # where the doc would start, dropped part included
            self._buf.extend(ids[drop:])
            self._buf.append(self.eos_id)

    def pop(self) -> np.ndarray:
        """The next window of ``seq_len + 1`` tokens (int64).

        Raises:
            IndexError: Fewer than ``seq_len + 1`` tokens are buffered (check :meth:`windows_ready`).
        """
        if self.windows_ready() < 1:
            raise IndexError(f"need {self.seq_len + 1} buffered tokens, have {self.buffered}")
        window = np.asarray(self._buf[self._start : self._start + self.seq_len + 1], dtype=np.int64)
        self._start += self.seq_len
        while len(self._docs) > 1 and self._docs[1][0] <= self._start:
            self._docs.popleft()  # documents wholly before the next window's first token
        if self._start >= self._COMPACT_AT:
            del self._buf[: self._start]
            self._docs = deque((at - self._start, tag) for at, tag in self._docs)
            self._start = 0
        return window

    def position(self) -> tuple[Hashable, int] | None:
        """``(tag, offset)`` of the first token of the next window; None when the buffer is empty."""
        if self.buffered == 0 or not self._docs:
            return None
        at, tag = self._docs[0]
        return tag, self._start - at
