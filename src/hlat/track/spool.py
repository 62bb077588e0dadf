"""The outage spool: one append-only JSONL file per MLflow run where points wait while the tracking server is away.

Every point the tracker is given gets a sequence number. The file holds, line by line: a header (run, store), batches
of points (``{"seq": first, "m": [[key, value, timestamp_ms, step], ...]}``), watermarks (``{"sent": s}``: every
point numbered below ``s`` is in MLflow) and the latest run changes still to send (``{"meta": {"tags": ...,
"artifacts": ..., "status": ...}}``). The trainer appends what is unsent at each checkpoint and fsyncs; a sender
appends a watermark once a spooled batch is in MLflow. A torn last line (a process killed while writing) is dropped.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hlat.track.system import PREFIX as SYSTEM_PREFIX

log = logging.getLogger(__name__)

Point = tuple[str, float, int, int]
"""``(key, value, timestamp_ms, step)``: one metric value as MLflow stores it."""

MAX_BYTES = 1 << 30
"""A spool stops growing at 1 GiB (about 20M points, weeks of a 7B run's ~9 points a step); later points are counted
as dropped and said at the end of the run."""
_COMPACT_BYTES = 1 << 20
"""A spool whose every point is sent is rewritten (header and pending changes only) once it is this large."""


class SpoolBusyError(RuntimeError):
    """Another live process (a trainer continuing the run) holds the spool."""


@dataclass
class SpoolContents:
    """What a spool file holds that MLflow does not (yet)."""

    run_id: str
    uri: str
    points: list[tuple[int, Point]] = field(default_factory=list)
    """The unsent ``(seq, point)``, in order."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Run changes to send: ``tags`` (dict), ``artifacts`` (paths, or [path, artifact folder]), ``status`` and
    ``end_time`` (ms)."""
    next_seq: int = 0
    damaged: int = 0
    """Lines that could not be read (a torn last line after a crash, or a damaged disk)."""

    def steps(self) -> str:
        """The training steps of the unsent points as ``first-last`` (``-`` when there are none)."""
        span = step_range(p for _, p in self.points)
        return "-" if span is None else f"{span[0]}-{span[1]}"


def step_range(points: Iterable[Point]) -> tuple[int, int] | None:
    """The first and last training step of ``points``; system metrics, numbered by sample, do not count."""
    steps = [p[3] for p in points if not p[0].startswith(SYSTEM_PREFIX)]
    return (min(steps), max(steps)) if steps else None


def spool_path(spool_dir: Path, run_id: str) -> Path:
    """The spool file of MLflow run ``run_id`` in ``spool_dir``."""
    return spool_dir / f"{run_id}.jsonl"


def read(path: Path) -> SpoolContents:
    """Read a spool file: its unsent points and pending run changes.

    Raises:
        ValueError: ``path`` is not a spool (no header line); names the file.
    """
    contents: SpoolContents | None = None
    batches: list[tuple[int, list[list[Any]]]] = []
    sent, damaged, meta = 0, 0, {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                damaged += 1
                continue
            if "run" in rec and contents is None:
                contents = SpoolContents(rec["run"], rec["uri"])
            elif "seq" in rec:
                batches.append((rec["seq"], rec["m"]))
            elif "sent" in rec:
                sent = max(sent, rec["sent"])
            elif "meta" in rec:
                meta = rec["meta"]
    if contents is None:
        raise ValueError(
            f"{path}: not an hlat tracking spool (no header line); pass the .jsonl files of a run's mlflow-spool/"
        )
    contents.damaged, contents.meta = damaged, meta
    for first, points in batches:
        for i, (key, value, ts, step) in enumerate(points):
            if first + i >= sent:
                contents.points.append((first + i, (key, float(value), int(ts), int(step))))
        contents.next_seq = max(contents.next_seq, first + len(points))
    contents.next_seq = max(contents.next_seq, sent)
    return contents


class Spool:
    """The writer of one run's spool file; holds an exclusive lock on it while open (one writer per run).

    Raises:
        SpoolBusyError: Another live process has the file open.
    """

    def __init__(self, path: Path, run_id: str, uri: str, *, max_bytes: int = MAX_BYTES) -> None:
        self.path, self.run_id, self.uri, self.max_bytes = path, run_id, uri, max_bytes
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a+b")  # noqa: SIM115  (held open, closed by close())
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise SpoolBusyError(f"{path} is in use by another process (a trainer continuing this run)") from None
        self._drop_torn_tail()
        if self._file.tell() == 0:
            self._write({"run": run_id, "uri": uri})
        self._file.flush()
        self.loaded = read(path)
        """What the file held when opened (a previous attempt's unsent points)."""
        self.dropped = 0

    def _drop_torn_tail(self) -> None:
        """Cut a last line without its newline (a write cut short by a crash), so the next line starts clean."""
        end = self._file.seek(0, os.SEEK_END)
        keep = end
        while keep > 0:
            start = max(0, keep - (1 << 16))
            self._file.seek(start)
            chunk = self._file.read(keep - start)
            if keep == end and chunk.endswith(b"\n"):
                return  # the last line is whole
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            keep = start
        self._file.truncate(keep)
        self._file.seek(0, os.SEEK_END)

    def _write(self, rec: dict[str, Any]) -> None:
        self._file.write((json.dumps(rec, separators=(",", ":")) + "\n").encode())

    def append(self, first_seq: int, points: list[Point]) -> bool:
        """Append points numbered from ``first_seq``; False (nothing written, counted as dropped) past the bound."""
        if not points:
            return True
        line = (json.dumps({"seq": first_seq, "m": points}, separators=(",", ":")) + "\n").encode()
        self._file.seek(0, os.SEEK_END)
        if self._file.tell() + len(line) > self.max_bytes:
            self.dropped += len(points)
            return False
        self._file.write(line)
        return True

    def mark_sent(self, seq: int) -> None:
        """Every point numbered below ``seq`` is in MLflow."""
        self._write({"sent": seq})

    def set_meta(self, meta: dict[str, Any]) -> None:
        """The run changes still to send (replaces the previous ones)."""
        self._write({"meta": meta})

    def sync(self) -> None:
        """Flush and fsync: what was appended survives a crash of this process or host."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def compact(self, meta: dict[str, Any], next_seq: int) -> None:
        """Every point is sent: rewrite the file as its header, the watermark and ``meta``, if it grew large."""
        self._file.flush()
        if self._file.tell() < _COMPACT_BYTES:
            return
        self._file.seek(0)
        self._file.truncate(0)
        self._write({"run": self.run_id, "uri": self.uri})
        self.mark_sent(next_seq)
        self.set_meta(meta)
        self.sync()

    def close(self, *, remove: bool = False) -> None:
        """Close (and release the lock); ``remove``: nothing is left to send, delete the file first."""
        if remove:
            self.path.unlink(missing_ok=True)
        else:
            self.sync()
        self._file.close()


def latest_steps(metrics: Iterable[Any]) -> dict[str, int]:
    """Per key, the step of MLflow's latest value (``Run.data._metric_objs``): what a replay must not send again."""
    return {m.key: int(m.step) for m in metrics}


def not_yet_stored(points: list[tuple[int, Point]], stored: dict[str, int]) -> list[tuple[int, Point]]:
    """The points MLflow does not hold yet, given the latest step it holds per key (:func:`latest_steps`).

    A point at or before its key's latest stored step was sent already (a process killed between a send and its
    watermark); each key is sent in step order, so this is exact.
    """
    return [(seq, p) for seq, p in points if p[3] > stored.get(p[0], -1)]


def send(path: Path, uri: str | None = None) -> str:
    """Send a spool's points, tags, artifacts and final status into its MLflow run, then delete it; what was sent.

    ``uri``: the store, when it moved since the run (default: the one the spool names).

    Raises:
        SpoolBusyError: A live trainer continuing the run holds the spool (it sends it itself).
        ValueError: ``path`` is not a spool.
        ConfigError: The store does not answer.
    """
    import sys

    from mlflow import MlflowClient
    from mlflow.entities import Metric, RunTag

    from hlat.config import ConfigError, TrackerConfig
    from hlat.track.mlflow_store import check_reachable, resolve_store

    head = read(path)
    # Not MLFLOW_TRACKING_URI: the run exists in the store it was logging to, which the spool records.
    store = resolve_store(uri or head.uri, given_as="--uri" if uri else "the spool: the store its run logged to")
    print(store.line("hlat track sync"), file=sys.stderr)
    uri = store.uri
    try:  # one short request, not minutes of MLflow's retries
        check_reachable(TrackerConfig(uri=uri))
    except ConfigError as e:  # its fixes speak of tracker.uri: say what to do here
        why = str(e).partition(": ")[2].partition("; ")[0]
        raise ConfigError(
            f"{uri}: {why}; start the tracking server and run `hlat track sync` again, or pass --uri where it moved "
            "(the spool is kept)"
        ) from None
    spool = Spool(path, head.run_id, head.uri)
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(head.run_id)
    points = not_yet_stored(spool.loaded.points, latest_steps(run.data._metric_objs))
    for i in range(0, len(points), 1000):
        batch = points[i : i + 1000]
        client.log_batch(head.run_id, metrics=[Metric(k, v, ts, step) for _, (k, v, ts, step) in batch])
        spool.mark_sent(batch[-1][0] + 1)
    meta = spool.loaded.meta
    tags = [RunTag(k, v) for k, v in meta.get("tags", {}).items()]
    for i in range(0, len(tags), 100):
        client.log_batch(head.run_id, tags=tags[i : i + 100])
    for artifact in meta.get("artifacts", []):
        path, where = artifact_entry(artifact)
        if Path(path).exists():
            client.log_artifact(head.run_id, path, where)
        else:
            log.warning("artifact %s of the spool is gone; not sent", path)
    if meta.get("status"):
        client.set_terminated(head.run_id, meta["status"], meta.get("end_time"))
    spool.close(remove=True)
    what = f"{len(points)} points (steps {SpoolContents(head.run_id, uri, points).steps()}), {len(tags)} tags"
    status = f", status {meta['status']}" if meta.get("status") else ""
    return f"sent {what}, {len(meta.get('artifacts', []))} artifacts{status} to MLflow run {head.run_id} at {uri}"


def find(target: Path) -> list[Path]:
    """The spool files ``target`` names: itself, or those under a run's directory (``.../mlflow-spool/*.jsonl``)."""
    if target.is_file():
        return [target]
    if not target.is_dir():
        raise ValueError(f"{target}: no such file or directory; pass a spool file or a run's checkpoint directory")
    return sorted(target.rglob("mlflow-spool/*.jsonl"))


def main(argv: list[str]) -> int:
    """``hlat track sync PATH... [--uri URI]``: send the spools a run left when its tracking server was away."""
    import argparse
    import sys

    from hlat.config import ConfigError

    parser = argparse.ArgumentParser(prog="hlat track", description="Send what a run could not send to MLflow.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{sync}")
    sync = sub.add_parser("sync", help="send the spools a run left while its tracking server was away")
    sync.add_argument("paths", nargs="+", metavar="PATH", help="a spool file, or a run or checkpoint directory")
    sync.add_argument(
        "--uri",
        help="the MLflow store to send to, where it moved since the run (default: the run's, as the spool records "
        "it; MLFLOW_TRACKING_URI does not change it: the run exists only in its own store)",
    )
    args = parser.parse_args(argv)
    code = 0
    for target in map(Path, args.paths):
        try:
            files = find(target)
            if not files:
                raise ValueError(f"{target}: holds no spool (mlflow-spool/*.jsonl): nothing to send")
            for f in files:
                print(f"{f}: {send(f, args.uri)}")
        except (ValueError, ConfigError, SpoolBusyError) as e:
            print(f"hlat track sync: error: {e}", file=sys.stderr)
            code = 1 if isinstance(e, (ConfigError, SpoolBusyError)) else 2  # 1: try again later; 2: a wrong path
    return code


def artifact_entry(item: str | list[str]) -> tuple[str, str | None]:
    """A queued artifact as (file path, artifact folder or None): a plain path, or ``[path, folder]``."""
    return (item, None) if isinstance(item, str) else (item[0], item[1])
