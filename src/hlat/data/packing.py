"""Pack tokenized documents into fixed-length training sequences, without padding or loss.

Documents are joined into one token stream with EOS after each document, and the stream is cut into
windows of ``seq_len + 1`` tokens (inputs = window[:-1], targets = window[1:]). Consecutive windows
start ``seq_len`` tokens apart, i.e. they share one token: the last target of a window is the first
input of the next (Megatron-LM's GPT dataset does the same). With that stride every token of the
stream is predicted exactly once and every adjacent token pair is trained on exactly once; disjoint
windows of ``seq_len + 1`` would instead never train the pair that straddles two windows.

Tokens that do not fill a window stay in the buffer for the next one: nothing is dropped or padded,
and a window may span several documents (attention is not masked at EOS, as in LLaMA pretraining).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


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

    @property
    def buffered(self) -> int:
        """Tokens in the buffer, including the one shared with the previous window."""
        return len(self._buf) - self._start

    def windows_ready(self) -> int:
        """Number of complete windows that :meth:`pop` can return now."""
        return max(0, (self.buffered - 1) // self.seq_len)

    def add(self, docs: Iterable[Sequence[int]]) -> None:
        """Append tokenized documents, each followed by EOS, to the stream."""
        for ids in docs:
            self._buf.extend(ids)
            self._buf.append(self.eos_id)

    def pop(self) -> list[int]:
        """The next window of ``seq_len + 1`` tokens.

        Raises:
            IndexError: Fewer than ``seq_len + 1`` tokens are buffered (check :meth:`windows_ready`).
        """
        end = self._start + self.seq_len + 1
        if end > len(self._buf):
            raise IndexError(f"only {self.buffered} tokens buffered, need {self.seq_len + 1}")
        window = self._buf[self._start : end]
        # The window's last token stays in the buffer: it is the first input of the next window.
        self._start = end - 1
        if self._start >= self._COMPACT_AT:
            del self._buf[: self._start]
            self._start = 0
        return window

    def state_dict(self) -> dict[str, Any]:
        """Leftover tokens (not yet emitted as inputs) as a plain list of ints."""
        return {"tokens": list(self._buf[self._start :])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore leftover tokens saved by :meth:`state_dict`, replacing the buffer."""
        self._buf = [int(t) for t in state["tokens"]]
        self._start = 0
