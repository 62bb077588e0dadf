"""A run's full-resolution metric series as Parquet: one long table ``(key, step, value)``, one value per step.

The writer (rank 0, a tracker) keeps every point it is given and writes a part file ``series/part-<seq>.parquet`` at
each checkpoint, beside the checkpoints (so a restart continues it), and logs it as an MLflow artifact ``series/``.
A restarted attempt's first part records the step it resumed from (``hlat.after_step``): a reader drops the earlier
parts' rows after that step, so the replayed steps count once. At the end the parts are compacted into one
``compact-<seq>.parquet``. Readers (:func:`read_series`) take the newest compact file plus the parts after it and
keep the newest value per ``(key, step)``.

The MLflow store gets a lean subset (:class:`LeanTracker`): what a user reads per step, every step; the rest every
point in runs of up to :data:`STORE_POINTS` steps, and at most :data:`STORE_POINTS` points per metric in longer ones
(:func:`store_every`). The full resolution is here.

May import: the rest of ``hlat.track``; pyarrow and numpy (mlflow only inside functions).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
from array import array
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hlat.track.trackers import NoopTracker, Rows, Tracker

log = logging.getLogger(__name__)

SERIES_DIR = "series"
"""Under the job's checkpoint directory, and the artifact path of the run in MLflow."""
PER_STEP = ("train/loss", "train/grad_norm")
"""The metrics MLflow gets at every step (what a user reads per step); the Parquet series has every metric."""
STORE_POINTS = 4_500
"""Every other metric goes to MLflow at most about this many times a run: every point of a run of up to this many
steps; the paper's 450k-step run keeps one step in 100 (~0.5 GB of PostgreSQL store, bench/tracking_scale.py)."""
AFTER_STEP = b"hlat.after_step"
"""Part metadata: this attempt resumed from that step, so earlier parts' rows after it are replaced."""
RUN_ID = b"hlat.run_id"
KEYS = b"hlat.keys"
"""File metadata: the metric of each row group, in order (JSON)."""
_PART = re.compile(r"^(part|compact)-(\d{6,})\.parquet$")
_SCHEMA = pa.schema([("key", pa.dictionary(pa.int32(), pa.string())), ("step", pa.int64()), ("value", pa.float64())])
_UPLOAD_WAIT_S = 60.0


class SeriesError(ValueError):
    """A series file that cannot be read."""


def _files(directory: Path) -> list[tuple[int, str, Path]]:
    """``(seq, kind, path)`` of the series files in ``directory``, in write order."""
    found = []
    for p in directory.iterdir() if directory.is_dir() else ():
        m = _PART.match(p.name)
        if m:
            found.append((int(m.group(2)), m.group(1), p))
    return sorted(found, key=lambda f: (f[0], f[1] == "part"))  # a compact file before the part of the same seq


def latest_files(names: Iterable[str]) -> list[str]:
    """Of the series file names, the ones a reader needs: the newest compact file and the parts after it, in order."""
    found = sorted((int(m.group(2)), m.group(1), n) for n in names if (m := _PART.match(Path(n).name)))
    compacts = [seq for seq, kind, _ in found if kind == "compact"]
    start = max(compacts, default=-1)
    return [n for seq, kind, n in found if (kind == "compact" and seq == start) or (kind == "part" and seq > start)]


def _complete(first: tuple[int, str, Path]) -> bool:
    """Whether a series that begins with ``first`` holds the run from its start (compact files do)."""
    _, kind, path = first
    if kind == "compact":
        return True
    try:
        return (pq.read_schema(path).metadata or {}).get(AFTER_STEP) == b"0"
    except Exception:  # damaged: not merged, the reader says so
        return False


Arrays = tuple[np.ndarray, np.ndarray]
"""``(steps, values)`` of one metric."""


def _last_per_step(chunks: list[Arrays]) -> Arrays:
    """One point per step, the LAST one given (``chunks`` in write order), in step order."""
    if len(chunks) == 1:  # one file: deduplicated and sorted when written
        return chunks[0]
    steps, values = np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks])
    _, first_in_reversed = np.unique(steps[::-1], return_index=True)
    idx = len(steps) - 1 - first_in_reversed
    return steps[idx], values[idx]


def _damaged(path: Path, e: Exception) -> SeriesError:
    return SeriesError(
        f"metric series file {path} is damaged ({type(e).__name__}: {e}); delete it (readers then use the run's "
        "MLflow histories) or restore it from the run's MLflow artifacts (series/)"
    )


_NUMPY = {"step": (pa.int64(), np.dtype(np.int64)), "value": (pa.float64(), np.dtype(np.float64))}


def _numpy(column: pa.ChunkedArray, name: str) -> np.ndarray:
    """Column ``name`` (step or value) as a numpy array: a view of Arrow's buffer.

    Not ``to_numpy()``: pyarrow's conversion imports pandas on first use (~50 MiB and 0.2 s of ``hlat compare``).
    """
    kind, dtype = _NUMPY[name]
    array = column.combine_chunks()
    if array.type != kind:  # a foreign file's int32 steps, say
        array = array.cast(kind)
    if array.null_count:  # never written so
        return array.to_numpy(zero_copy_only=False)
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


def _read_one(path: Path, keys: Iterable[str] | None) -> tuple[dict[str, Arrays], int | None, str]:
    """One file's points by key (``keys`` only, if given), resume marker and run id; :class:`SeriesError` if damaged.

    Each key is a row group of its own (:data:`KEYS`), so a reader decodes only the keys it asks for.
    """
    wanted = None if keys is None else set(keys)
    try:
        pf = pq.ParquetFile(path)
        meta = pf.schema_arrow.metadata or {}
        out = {}
        for i, key in enumerate(json.loads(meta[KEYS])):
            if wanted is None or key in wanted:
                group = pf.read_row_group(i, columns=["step", "value"])
                out[key] = _numpy(group["step"], "step"), _numpy(group["value"], "value")
    except Exception as e:  # ArrowInvalid, OSError, KeyError: a truncated or foreign file
        raise _damaged(path, e) from e
    after = int(meta[AFTER_STEP]) if AFTER_STEP in meta else None
    return out, after, meta.get(RUN_ID, b"").decode()


def read_files(paths: list[Path], keys: Iterable[str] | None = None, run_id: str | None = None) -> dict[str, Arrays]:
    """The points of ``paths`` (in write order) by key, one per step; a resume marker drops earlier ones after it.

    ``run_id``: only the files of that MLflow run (a checkpoint directory reused by a new run holds both).
    """
    chunks: dict[str, list[Arrays]] = {}
    for path in paths:
        points, after, owner = _read_one(path, keys)
        if run_id is not None and owner != run_id:
            continue
        if after is not None:
            chunks = {k: [(s[s <= after], v[s <= after]) for s, v in c] for k, c in chunks.items()}
        for key, arrays in points.items():
            chunks.setdefault(key, []).append(arrays)
    return {key: _last_per_step(c) for key, c in chunks.items()}


def read_points(
    directory: Path | str, keys: Iterable[str] | None = None, run_id: str | None = None
) -> dict[str, Arrays]:
    """A series directory's points by key, the newest value per step (``run_id``: only that MLflow run's files).

    Raises:
        SeriesError: A file in it cannot be read (the message names it and the way out).
    """
    by_name = {p.name: p for _, _, p in _files(Path(directory))}
    return read_files([by_name[n] for n in latest_files(by_name)], keys, run_id)


def read_series(directory: Path | str, keys: Iterable[str] | None = None, run_id: str | None = None) -> pa.Table:
    """A series directory as one long table ``(key, step, value)``, the newest value per ``(key, step)``."""
    return _table(read_points(directory, keys, run_id))


def _table(points: dict[str, Arrays]) -> pa.Table:
    """The long table of ``points``, grouped by key."""
    names = list(points)
    codes = np.concatenate([np.full(len(points[k][0]), i, np.int32) for i, k in enumerate(names)] or [[]])
    return pa.table(
        {
            "key": pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()), pa.array(names, pa.string())),
            "step": np.concatenate([points[k][0] for k in names] or [np.zeros(0, np.int64)]).astype(np.int64),
            "value": np.concatenate([points[k][1] for k in names] or [np.zeros(0)]).astype(np.float64),
        },
        schema=_SCHEMA,
    )


def _write(points: dict[str, Arrays], path: Path, meta: dict[bytes, bytes]) -> None:
    """Write ``points`` atomically as a series file: one row group per key (readers never see half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    meta = {**meta, KEYS: json.dumps(list(points)).encode()}
    with pq.ParquetWriter(tmp, _SCHEMA.with_metadata(meta), compression="zstd") as out:
        for key, arrays in points.items():
            out.write_table(_table({key: arrays}), row_group_size=len(arrays[0]) + 1)
    os.replace(tmp, path)


def to_points(table: pa.Table, key: str) -> Arrays:
    """``(steps, values)`` of one key of a :func:`read_series` table, in step order."""
    import pyarrow.compute as pc

    rows = table.filter(pc.equal(table["key"].cast(pa.string()), key))
    return rows["step"].to_numpy(), rows["value"].to_numpy()


class SeriesWriter(NoopTracker):
    """Tracker that keeps every point and writes it as Parquet parts at checkpoints and at the end (rank 0).

    ``first_step``: the step this attempt starts from (its first part replaces the rows after it); 0 for a new run.
    """

    def __init__(self, root: Path, first_step: int) -> None:
        self.dir = Path(root) / SERIES_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".*.tmp"):  # a write a kill cut short
            stale.unlink(missing_ok=True)
        files = _files(self.dir)
        self._seq = max((seq for seq, _, _ in files), default=0) + 1
        self._after: int | None = first_step
        self._codes: dict[str, int] = {}
        self._keys, self._steps, self._values = array("i"), array("q"), array("d")
        self.run_id = ""
        self._uploads: queue.Queue[Path | None] | None = None
        self._uploader: threading.Thread | None = None

    def upload_with(self, upload: Callable[[Path], None], run_id: str, logged: Iterable[str] = ()) -> None:
        """Log every file written from now on as an artifact with ``upload``, from a background thread.

        ``logged``: the series files the run already has in MLflow (a restart in another directory numbers on).
        """
        self.run_id = run_id
        seqs = [int(m.group(2)) for name in logged if (m := _PART.match(Path(name).name))]
        self._seq = max([self._seq - 1, *seqs]) + 1
        self._uploads = queue.Queue()
        self._uploader = threading.Thread(target=self._upload_loop, args=(upload,), name="hlat-series", daemon=True)
        self._uploader.start()

    def _upload_loop(self, upload: Callable[[Path], None]) -> None:
        assert self._uploads is not None
        while (path := self._uploads.get()) is not None:
            if not path.exists():  # merged into a compact file since (uploaded next)
                continue
            try:
                upload(path)
            except Exception as e:  # the file stays here; the end of the run uploads the compacted series again
                log.warning("could not log %s as an MLflow artifact (%s); it is kept there", path, e)

    def log_metrics(self, rows: Rows) -> None:
        for step, row in rows:
            for key, value in row.items():
                code = self._codes.setdefault(key, len(self._codes))
                self._keys.append(code)
                self._steps.append(step)
                self._values.append(float(value))

    def checkpoint(self, step: int) -> Path | None:
        """Write the points up to ``step`` (a checkpoint of it is being made) as the next part; None if none."""
        steps = np.frombuffer(self._steps, dtype=np.int64) if self._steps else np.zeros(0, np.int64)
        kept = steps > step
        if kept.all():
            return None
        return self._write(~kept)

    def _write(self, mask: np.ndarray) -> Path:
        """Write the buffered points selected by ``mask`` as the next part; keep the others buffered."""
        codes = np.frombuffer(self._keys, dtype=np.int32)
        steps, values = np.frombuffer(self._steps, dtype=np.int64), np.frombuffer(self._values, dtype=np.float64)
        points = {}
        for key, code in self._codes.items():
            mine = mask & (codes == code)
            if mine.any():
                points[key] = _last_per_step([(steps[mine], values[mine]), (steps[:0], values[:0])])
        meta = {RUN_ID: self.run_id.encode()}
        if self._after is not None:
            meta[AFTER_STEP] = str(self._after).encode()
        path = self._save(points, f"part-{self._seq:06d}.parquet", meta)
        self._seq, self._after = self._seq + 1, None
        rest = ~mask
        self._keys, self._steps = array("i", codes[rest].tobytes()), array("q", steps[rest].tobytes())
        self._values = array("d", values[rest].tobytes())
        return path

    def _save(self, points: dict[str, Arrays], name: str, meta: dict[bytes, bytes]) -> Path:
        """Write ``points`` as ``name`` and queue its upload."""
        path = self.dir / name
        _write(points, path, meta)
        if self._uploads is not None:
            self._uploads.put(path)
        return path

    def whole(self, keys: Iterable[str]) -> dict[str, Arrays] | None:
        """``keys`` over the whole run so far (every attempt), or None when this directory does not hold its start.

        The points buffered here are written as a part first.
        """
        if self._steps or self._after is not None:
            self._write(np.ones(len(self._steps), dtype=bool))
        files = _files(self.dir)
        by_name = {p.name: p for _, _, p in files}
        names = latest_files(by_name)
        if not names or not _complete(next(f for f in files if f[2].name == names[0])):
            return None
        return read_files([by_name[n] for n in names], keys)

    def compact(self) -> list[Path]:
        """Merge every file into ``compact-<last seq>.parquet``; returns the merged files (the caller deletes them)."""
        files = _files(self.dir)
        if not files or not _complete(files[0]):
            return []  # this directory holds a restart's part only: the run's artifacts hold the rest
        last = files[-1][0]
        path = self._save(read_points(self.dir), f"compact-{last:06d}.parquet", {RUN_ID: self.run_id.encode()})
        return [p for _, _, p in files if p != path]

    def finish(self, status: str = "FINISHED") -> None:
        merged: list[Path] = []
        try:
            if self._steps or self._after is not None:
                self._write(np.ones(len(self._steps), dtype=bool))
            merged = self.compact()
        except Exception:  # the run's outcome must not depend on its metric file; the parts written so far stay
            log.exception("could not write the metric series in %s", self.dir)
        if self._uploader is not None and self._uploads is not None:
            self._uploads.put(None)
            self._uploader.join(_UPLOAD_WAIT_S)
            if self._uploader.is_alive():
                log.warning("the metric series is not yet logged to MLflow; it is kept in %s", self.dir)
        for path in merged:  # after their uploads: the compact file holds them now
            path.unlink(missing_ok=True)


def store_every(steps: int, log_every: int, budget: int = STORE_POINTS) -> int:
    """The stride of the thinned metrics in MLflow for a run of ``steps`` steps logged every ``log_every``.

    1 (every point) up to ``budget`` steps, else ``ceil(steps / budget)`` rounded up to a multiple of ``log_every``
    (every window of the stride then starts at a logged interval, so the kept points are evenly spaced). A function
    of the configuration alone: a resumed run keeps the stride of the attempt before it, and so the shape of its
    curves, whatever that attempt sent.
    """
    every = max(1, -(-steps // budget))
    if every > log_every > 0:
        every = -(-every // log_every) * log_every
    return every


class LeanTracker:
    """Passes to ``inner`` (MLflow) the :data:`PER_STEP` metrics every step, others at most once per ``every`` steps.

    Of the others, the first point in each window ``[k * every, (k + 1) * every)`` is sent (sparse ones, e.g.
    evaluations, all) and, at the end, the latest one if it was held back, so the run's last values are in MLflow.
    ``first_step``: the step a resumed attempt starts after; the attempt before it sent the first point of that
    step's window, so this one starts with the next window (a new run: 0, the first point is sent).
    """

    def __init__(
        self, inner: Tracker, every: int = 1, per_step: tuple[str, ...] = PER_STEP, first_step: int = 0
    ) -> None:
        self.inner, self.every, self.per_step = inner, max(1, every), frozenset(per_step)
        self._start = (first_step // self.every + 1) * self.every if first_step > 0 else 0
        self._due: dict[str, int] = {}
        self._held: dict[str, tuple[int, float]] = {}

    def log_params(self, params: dict[str, Any]) -> None:
        self.inner.log_params(params)

    def log_metrics(self, rows: Rows) -> None:
        out: Rows = []
        for step, row in rows:
            kept = {}
            for key, value in row.items():
                first = self._start if step else 0  # step 0: each start's pre-flight record, always sent
                if key in self.per_step or step >= self._due.get(key, first):
                    kept[key] = value
                    self._due[key] = (step // self.every + 1) * self.every
                    self._held.pop(key, None)
                else:
                    self._held[key] = (step, value)
            if kept:
                out.append((step, kept))
        if out:
            self.inner.log_metrics(out)

    def log_artifact(self, path: Path) -> None:
        self.inner.log_artifact(path)

    def finish(self, status: str = "FINISHED") -> None:
        by_step: dict[int, dict[str, float]] = {}
        for key, (step, value) in self._held.items():
            by_step.setdefault(step, {})[key] = value
        if by_step:
            self.inner.log_metrics(sorted(by_step.items()))
        self._held = {}
        self.inner.finish(status)
