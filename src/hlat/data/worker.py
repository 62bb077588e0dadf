"""Run a ``PackedStream`` ahead of the trainer in a background thread or process, ``prefetch`` batches deep.

Each batch carries its slots' cursors after it, so ``state_dict()`` is what the trainer consumed, not what was
prefetched; a worker's error is re-raised in the trainer at the batch where it happened.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from hlat.config import ConfigError
from hlat.data.loader import START, STATE_VERSION, PackedStream, StreamSpec, check_identity, stream_identity
from hlat.data.slots import covers
from hlat.data.sources import TextSource
from hlat.data.tokenizer import Tokenizer, load_tokenizer


class _Failure:
    """An exception raised in the worker, carried to the trainer."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _put(q: Any, item: Any, stop: Any) -> bool:
    """Put unless asked to stop; returns False when stopping."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _produce(stream: PackedStream, q: Any, stop: Any) -> None:
    busy = 0.0
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            windows, cursors = stream.next_windows()
            busy += time.perf_counter() - t0
            # int32 halves what crosses a process boundary; token ids are < 2^31.
            if not _put(q, (windows.astype(np.int32), cursors, busy), stop):
                return
    except BaseException as exc:  # everything goes to the trainer, which re-raises it
        _put(q, _Failure(exc), stop)


def _reopened(spec: StreamSpec, cursors: list[dict]) -> PackedStream:
    """The stream of ``spec`` from ``cursors``, over the (memory-mapped) data and tokenizer opened again."""
    source = TextSource(spec.data_path, spec.text_column)
    return PackedStream(spec, source, load_tokenizer(spec.tokenizer_path, spec.vocab_size), cursors)


def _process_main(build: Callable[[], Any], q: Any, stop: Any) -> None:
    """Entry point of a worker process: ``build()`` reopens the stream (data, tokenizer), then produce."""
    _produce(build(), q, stop)
    # Prefetched batches nobody will read must not hold the process open at exit (its queue feeder
    # thread would otherwise wait to flush them into the pipe).
    q.cancel_join_thread()


class OnlineLoader:
    """Infinite iterator of packed ``(inputs, targets)`` micro-batches for one data-parallel rank.

    ``worker``: ``thread``, ``process`` or ``none`` (inline); ``prefetch``: batches it keeps ready. ``slots``: the
    sequence slots of the global batch it serves (``hlat.data.slots``).
    """

    def __init__(
        self, spec: StreamSpec, source: TextSource, tokenizer: Tokenizer, *, worker: str = "thread", prefetch: int = 4
    ) -> None:
        self.spec, self.source, self.tokenizer = spec, source, tokenizer
        self.worker, self.prefetch = worker, prefetch
        self._identity = stream_identity(spec, source, tokenizer)
        self.slots = spec.slots
        self._cursors = [dict(START) for _ in self.slots]  # of every slot, after the last consumed batch
        self._busy = 0.0
        self._stream: PackedStream | None = None
        self._queue: Any = None
        self._stop: Any = None
        self._runner: threading.Thread | mp.Process | None = None

    def _make_stream(self) -> Any:
        """The stream from the current position, over this loader's open data (inline or in a thread)."""
        return PackedStream(self.spec, self.source, self.tokenizer, self._cursors)

    def _reopen(self) -> Callable[[], Any]:
        """A picklable ``() -> stream`` from the current position that opens the data again (a worker process)."""
        return partial(_reopened, self.spec, self._cursors)

    def _start(self) -> None:
        if self.worker == "none":
            self._stream = self._make_stream()
            return
        if self.worker == "thread":
            self._queue, self._stop = queue.Queue(self.prefetch), threading.Event()
            stream = self._make_stream()
            self._runner = threading.Thread(
                target=_produce,
                args=(stream, self._queue, self._stop),
                daemon=True,
                name=f"hlat-data-rank{self.spec.dp_rank}",
            )
        else:
            # spawn, not fork: forking a process whose torch runtime already started threads can deadlock.
            ctx = mp.get_context("spawn")
            self._queue, self._stop = ctx.Queue(self.prefetch), ctx.Event()
            self._runner = ctx.Process(
                target=_process_main,
                args=(self._reopen(), self._queue, self._stop),
                daemon=True,
                name=f"hlat-data-rank{self.spec.dp_rank}",
            )
        self._runner.start()

    def __iter__(self) -> OnlineLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch: ``(inputs, targets)``, int64, ``(micro_batch_size, seq_len)`` each."""
        windows, info = self._next_windows()
        for slot, cursor in info.items():
            self._cursors[slot - self.slots.start] = cursor
        w = torch.from_numpy(windows.astype(np.int64, copy=False))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def _next_windows(self) -> tuple[np.ndarray, Any]:
        """The stream's next micro-batch of windows and what it says of them (this loader's stream: the cursors)."""
        if self._stream is None and self._runner is None:
            self._start()
        if self._stream is not None:
            t0 = time.perf_counter()
            windows, info = self._stream.next_windows()
            self._busy += time.perf_counter() - t0
            return windows, info
        item = self._get()
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        windows, info, self._busy = item
        return windows, info

    def _get(self) -> Any:
        """The next queue item; fails loudly (instead of waiting forever) if the worker died silently."""
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._runner.is_alive():
                    code = getattr(self._runner, "exitcode", None)
                    self.close()
                    raise RuntimeError(
                        f"the data worker ({self.worker}) exited (exit code {code}) without producing a batch. "
                        "A spawned worker re-imports the main script: guard its entry point with "
                        "`if __name__ == '__main__':`, or use data.worker=thread"
                    ) from None

    def state_dict(self) -> dict[str, Any]:
        """Every slot's position after the last batch handed out, and the stream's identity, as plain values.

        ``dp_rank``, ``dp_size`` and ``seq_len`` record where it was saved; only the identity must match on resume.
        """
        layout = {"seq_len": self.spec.seq_len, "dp_rank": self.spec.dp_rank, "dp_size": self.spec.dp_size}
        slots = [self.slots.start, self.slots.stop]
        return {"version": STATE_VERSION, **self._identity, **layout, "slots": slots, "cursors": list(self._cursors)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the batch at which ``state`` was taken (restarts a running worker).

        ``state`` must hold this rank's slots: one rank's state from the same layout, or one that
        :func:`hlat.data.slots.gather` assembled from the saved ranks of another data-parallel degree.

        Raises:
            ConfigError: The state comes from different data, tokenizer, seed or global batch.
        """
        check_identity(state, self._identity)
        if not covers(state, self.slots):
            raise ConfigError(
                f"the saved data loader state holds sequence slots {state['slots']}, this rank serves "
                f"[{self.slots.start}, {self.slots.stop}): gather them from the saved ranks (hlat.data.slots.gather)"
            )
        self.close()
        self._cursors = [{k: int(c[k]) for k in START} for c in state["cursors"]]

    def stats(self) -> dict[str, float]:
        """Loader metrics of this rank's slots as of the last consumed batch (host values, for the trackers).

        ``data/epochs`` is how far, in epochs of the global stream, this rank's slots have read on average.
        """
        cursors, size = self._cursors, self.spec.global_batch_size
        tokens = sum(c["windows"] for c in cursors) * self.spec.seq_len
        index = sum(s + c["round"] * size for s, c in zip(self.slots, cursors, strict=True)) / len(cursors)
        return {
            "data/documents_consumed": float(sum(c["documents"] for c in cursors)),
            "data/skipped_documents": float(sum(c["skipped"] for c in cursors)),
            "data/tokens_produced": float(tokens),
            "data/padding_fraction": 0.0,  # packing never pads: every window is full of real tokens
            "data/epochs": index / len(self.source),
            # What the producer could sustain if never blocked: tokens per second of its busy time.
            "data/producer_tokens_per_s": tokens / self._busy if self._busy > 0 else 0.0,
        }

    def interval(self, device: torch.device) -> None:
        """One corpus: nothing to fetch from the device (``hlat.data.mix_loader.MixLoader`` has per-source tallies)."""
        return None

    def run_info(self) -> dict[str, Any]:
        """One corpus: nothing to record beside the config."""
        return {}

    def close(self) -> None:
        """Stop the worker (if any); the next batch restarts it from the current position."""
        if self._runner is not None:
            self._stop.set()
            deadline = time.monotonic() + 10
            while self._runner.is_alive() and time.monotonic() < deadline:
                with contextlib.suppress(queue.Empty):  # drain, so a blocked put returns and sees the stop
                    self._queue.get(timeout=0.05)
                self._runner.join(timeout=0.05)
            if isinstance(self._runner, mp.Process) and self._runner.is_alive():
                self._runner.terminate()
        self._runner, self._queue, self._stop, self._stream = None, None, None, None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn down the modules
            self.close()
