"""A mixture's per-source metrics, every log interval, from values the run has anyway.

Host values, exact and the same on every rank (the schedule is global): each source's trained tokens and target
share. Device values, fetched with the loss in the interval's one transfer and averaged over the ranks (so times the
data-parallel degree: every data-parallel group holds each of its sequences once): each source's loss sum and
trained windows in the interval (``hlat.tally``), and the documents and rows its slots read on each rank.

Beyond ``data.log_sources`` sources, the sources but the largest by weight in any stage are also summed as
``other``, and the run keeps their own series in its Parquet series only (:func:`series_only`): MLflow gets at most
``data.log_sources`` per-source series and ``other``.
"""

from __future__ import annotations

import numpy as np
import torch

OTHER = "other"
"""The name the sources beyond ``data.log_sources`` are summed under."""


def shown_sources(names: tuple[str, ...], fractions: list[np.ndarray], limit: int) -> list[int]:
    """Indices of the sources with series of their own: all, or the ``limit`` largest by weight in any stage."""
    if len(names) <= limit:
        return list(range(len(names)))
    largest = np.max(np.stack(fractions), axis=0)
    return sorted(np.argsort(-largest, kind="stable")[:limit].tolist())


SOURCE_KEYS = (
    "data/mix/{}/tokens",
    "data/mix/{}/target",
    "data/mix/{}/documents",
    "data/mix/{}/epochs",
    "data/mix/{}/share",
    "train/loss/{}",
)
"""The metrics of one source."""


def series_only(names: tuple[str, ...], shown: list[int], stages: list[str]) -> dict[str, list[str]]:
    """What MLflow leaves out of the sources not ``shown`` (the Parquet series has it): their metrics and params."""
    hidden = [n for m, n in enumerate(names) if m not in set(shown)]
    metrics = [key.format(n) for n in hidden for key in SOURCE_KEYS]
    params = [f"data.mix.{n}." for n in hidden] + [f"data.stages.{s}.weights.{n}" for s in stages for n in hidden]
    return {"metrics": metrics, "params": params}


def reads_tensor(cursors: list[dict], names: tuple[str, ...], device: torch.device) -> torch.Tensor:
    """(2, M) documents and rows this rank's slots have read per source (``cursors``: the loader's per slot)."""
    index = {n: i for i, n in enumerate(names)}
    out = np.zeros((2, len(names)), dtype=np.float64)
    for c in cursors:
        for name, (round_, _, documents, _) in c["read"].items():
            if name in index:
                out[0, index[name]] += documents
                out[1, index[name]] += round_
    return torch.from_numpy(out).to(device=device, dtype=torch.float32)


def _group(values: np.ndarray, shown: list[int], names: tuple[str, ...]) -> dict[str, float]:
    """``values`` (M,) under every source's name, and those not ``shown`` summed as ``other`` (if any)."""
    out = {name: float(v) for name, v in zip(names, values.tolist(), strict=True)}
    if len(shown) < len(names):
        rest = np.ones(len(names), dtype=bool)
        rest[shown] = False
        out[OTHER] = float(values[rest].sum())
    return out


def host_metrics(
    names: tuple[str, ...], tokens: np.ndarray, fractions: np.ndarray, shown: list[int]
) -> dict[str, float]:
    """``data/mix/<source>/tokens`` and ``/target`` (the stage in progress)."""
    out = {f"data/mix/{n}/tokens": v for n, v in _group(tokens.astype(np.float64), shown, names).items()}
    out |= {f"data/mix/{n}/target": v for n, v in _group(fractions, shown, names).items()}
    return out


def interval_metrics(
    names: tuple[str, ...],
    rows: np.ndarray,
    dp: int,
    seq_len: int,
    shown: list[int],
    values: dict[str, list[float]],
) -> dict[str, float]:
    """The fetched values (averaged over the ranks) as ``train/loss/<source>`` and ``data/mix/<source>/*``."""
    m = len(names)
    reads = np.rint(np.asarray(values["mix/reads"], dtype=np.float64).reshape(2, m) * dp)
    documents, read_rows = _group(reads[0], shown, names), _group(reads[1], shown, names)
    all_rows = _group(rows, shown, names)
    out: dict[str, float] = {}
    for n in documents:
        out[f"data/mix/{n}/documents"] = documents[n]
        out[f"data/mix/{n}/epochs"] = read_rows[n] / all_rows[n] if all_rows[n] else 0.0
    if "mix/tally" in values:
        tally = np.asarray(values["mix/tally"], dtype=np.float64).reshape(2, m) * dp
        losses, windows = _group(tally[0], shown, names), _group(np.rint(tally[1]), shown, names)
        total = sum(windows.values())
        for n, w in windows.items():
            out[f"data/mix/{n}/share"] = w / total if total else 0.0
            if w:
                out[f"train/loss/{n}"] = losses[n] / (w * seq_len)
    return out
