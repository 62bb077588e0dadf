"""The online loader of a mixture (``data.mix``): its stream run ahead, its saved state, its per-source accounting.

The saved state holds, beside each sequence slot's position per source, what every rank shares: the schedule's
cursor (global batch, windows per source overall and in the stage in progress), the stages begun so far, every
source's tokens and content fingerprint, and the revision of the mix (``hlat.data.mix_resume``).
"""

from __future__ import annotations

import json
import logging
from functools import partial
from typing import Any

import numpy as np
import torch

from hlat.config import ConfigError
from hlat.data.loader import check_identity
from hlat.data.mix_metrics import host_metrics, interval_metrics, reads_tensor, series_only, shown_sources
from hlat.data.mix_plan import Plan, check_plan, make_plan
from hlat.data.mix_resume import CHECKPOINT, check_sources, resume_schedule
from hlat.data.mixture import MixedStream, MixSpec, SourceRef
from hlat.data.schedule import Cursor, Schedule, Stage
from hlat.data.slots import covers
from hlat.data.sources import TextSource
from hlat.data.tokenizer import Tokenizer, load_tokenizer
from hlat.data.worker import OnlineLoader
from hlat.tally import Batch, SourceTally

log = logging.getLogger(__name__)

STATE_VERSION = 1
LOADER = "online_mix"
"""The ``loader`` entry of a mixture's saved state (the one-source online loader's is ``online``)."""
IDENTITY_KEYS = ("loader", "seed", "shuffle", "global_batch_size", "tokenizer")
"""What a mixture's saved position is only valid for, besides each source's data (checked per source)."""


def _reopened(spec: MixSpec, cursors: list[dict], at: Cursor) -> MixedStream:
    """The stream of ``spec`` from ``cursors``, over the data and tokenizer opened again (a worker process)."""
    sources = [TextSource(r.path, r.text_column) for r in spec.sources]
    tokenizer = load_tokenizer(spec.stream.tokenizer_path, spec.stream.vocab_size)
    return MixedStream(spec, sources, tokenizer, cursors, at)


class MixLoader(OnlineLoader):
    """Infinite iterator of a mixture's micro-batches for one data-parallel rank: :class:`hlat.tally.Batch` items.

    ``stages``: the config's stages (``hlat.data.mix_plan.config_stages``); ``steps``: ``train.steps``, for the plan;
    ``log_sources``: ``data.log_sources`` (``hlat.data.mix_metrics``).
    """

    def __init__(
        self,
        spec: MixSpec,
        sources: list[TextSource],
        tokenizer: Tokenizer,
        stages: list[Stage],
        *,
        steps: int,
        log_sources: int = 32,
        worker: str = "thread",
        prefetch: int = 4,
    ) -> None:
        super().__init__(spec.stream, sources[0], tokenizer, worker=worker, prefetch=prefetch)
        self.mix, self.sources, self.steps, self.log_sources = spec, sources, steps, log_sources
        self.names = spec.schedule.names
        self._config_stages, self._planned = stages, stages
        self._past: list[Stage] = []  # the stages begun before the batch this process resumed at, as saved
        self._resumed_at = 0
        self._identity = {
            "loader": LOADER,
            "seed": spec.stream.seed,
            "shuffle": spec.stream.shuffle,
            "global_batch_size": spec.stream.global_batch_size,
            "tokenizer": tokenizer.fingerprint,
        }
        self._data = {n: s.fingerprint for n, s in zip(self.names, sources, strict=True)}
        self._at = spec.schedule.start()  # after the last consumed batch (every rank alike)
        self._before = self._at  # before it
        self._cursors = [{"windows": 0, "read": {}} for _ in self.slots]
        self._tokens = np.zeros(len(self.names), dtype=np.int64)  # trained tokens per source, as of _base
        self._base = self._at.counts.copy()  # windows per source when this process started (tokens: + seq_len each)
        self._carried: dict[str, Any] = {}  # sources gone from the config: fingerprint, windows, tokens, positions
        self.revision, self.edited = 0, []
        self.tally = SourceTally(len(self.names))
        self.plan = self._check_plan()

    def _check_plan(self) -> Plan:
        """The plan over ``train.steps`` from the current batch, logged and checked (none when ``steps`` is 0)."""
        if self.steps <= 0:
            return Plan({}, [])
        caps = {r.name: (r.max_rows / len(s) if r.max_rows is not None else None) for r, s in self._refs_sources()}
        sources = dict(zip(self.names, self.sources, strict=True))
        s = self.mix.stream
        plan = make_plan(self.mix.schedule, self._at, sources, caps, self.tokenizer, self.steps, s.seq_len)
        log.info("data mix plan over train.steps=%d:\n%s", self.steps, plan.table())
        check_plan(plan)
        return plan

    def _refs_sources(self) -> list[tuple[SourceRef, TextSource]]:
        return list(zip(self.mix.sources, self.sources, strict=True))

    def _make_stream(self) -> MixedStream:
        return MixedStream(self.mix, self.sources, self.tokenizer, self._stream_cursors(), self._start_at())

    def _reopen(self) -> partial:
        return partial(_reopened, self.mix, self._stream_cursors(), self._start_at())

    def _start_at(self) -> Cursor:
        """The schedule's cursor before the first batch a slot has yet to give (mid-batch: the one in progress)."""
        low = min(c["windows"] for c in self._cursors)
        return self._at if low == self._at.batch else self._before

    def _stream_cursors(self) -> list[dict]:
        return [{"windows": c["windows"], "read": c["read"]} for c in self._cursors]

    def next_batch(self) -> Batch:
        """The next micro-batch: ``(inputs, targets)``, int64, ``(micro_batch_size, seq_len)`` each, with sources."""
        windows, info = self._next_windows()
        for slot, (done, name, position) in info["cursors"].items():
            cursor = self._cursors[slot - self.slots.start]
            cursor["windows"] = done
            cursor["read"][name] = position
        if info["after"].batch != self._at.batch:  # a new global batch: the cursor before it is the last one's after
            self._before, self._at = self._at, info["after"]
        w = torch.from_numpy(windows.astype(np.int64, copy=False))
        sources = torch.from_numpy(np.asarray(info["sources"], dtype=np.int64))
        return Batch(w[:, :-1].contiguous(), w[:, 1:].contiguous(), sources, self.tally)

    def tokens(self) -> np.ndarray:
        """Tokens trained per source (every rank's), as of the last consumed batch."""
        return self._tokens + (self._at.counts - self._base) * self.mix.stream.seq_len

    def state_dict(self) -> dict[str, Any]:
        """Every slot's position per source after the last batch handed out, the schedule's, and the identity.

        The schedule's cursor is the one before the first batch a slot has yet to give (within a step, some slots
        are a window ahead: their positions say where they are).
        """
        s = self.mix.stream
        names = list(self.names)
        cursors = [
            {"windows": c["windows"], "read": {**self._carried.get("read", [{}] * len(self._cursors))[i], **c["read"]}}
            for i, c in enumerate(self._cursors)
        ]
        sched, at = self.mix.schedule, self._start_at()  # at a step's end, after its batch
        now = [st for st in sched.stages if self._resumed_at <= st.start < at.batch]
        begun = [st.to_dict() for st in self._past + now]
        tokens = self._tokens + (at.counts - self._base) * s.seq_len
        mix = {
            "batch": at.batch,
            "counts": {**self._carried.get("counts", {}), **dict(zip(names, at.counts.tolist(), strict=True))},
            "at_stage": dict(zip(names, at.at_stage.tolist(), strict=True)),
            "tokens": {**self._carried.get("tokens", {}), **dict(zip(names, tokens.tolist(), strict=True))},
            "rows": {n: len(src) for n, src in zip(names, self.sources, strict=True)},
            "stages": begun,
            "planned": [st.to_dict() for st in self._planned],
            "revision": self.revision,
        }
        layout = {"seq_len": s.seq_len, "dp_rank": s.dp_rank, "dp_size": s.dp_size}
        data = {**self._carried.get("data", {}), **self._data}
        return {
            "version": STATE_VERSION,
            **self._identity,
            "data": data,
            "tokenizer_path": str(self.tokenizer.path),
            **layout,
            "slots": [self.slots.start, self.slots.stop],
            "cursors": cursors,
            "mix": mix,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the batch at which ``state`` was taken; the config may change the mix's future only.

        Raises:
            ConfigError: The state is another loader's, or of other data, tokenizer, seed or global batch; the
                config changes the mix before the checkpoint's batch; a source read so far changed.
        """
        if state.get("loader", "online") != LOADER:
            raise ConfigError(
                f"the checkpoint's data stream read one corpus (data.path), this run mixes sources (data.mix): "
                f"resume with that data.path and no data.mix, or start a new run (train.init_from={CHECKPOINT} "
                "keeps its trained weights)"
            )
        if state.get("version") == STATE_VERSION and state.get("tokenizer") != self._identity["tokenizer"]:
            raise ConfigError(
                "cannot resume the data mix: the tokenizer is not the one the checkpoint was trained with (a "
                "tokenizer trained on the sources changes with them: a source added or edited); resume with "
                f"data.tokenizer={state.get('tokenizer_path')} (the run's), or start a new run "
                f"(train.init_from={CHECKPOINT} keeps its trained weights)"
            )
        check_identity(state, self._identity, IDENTITY_KEYS, STATE_VERSION)
        if not covers(state, self.slots):
            raise ConfigError(
                f"the saved data loader state holds sequence slots {state['slots']}, this rank serves "
                f"[{self.slots.start}, {self.slots.stop}): gather them from the saved ranks (hlat.data.slots.gather)"
            )
        mix, names = state["mix"], set(self.names)
        k = int(mix["batch"])
        check_sources(state["data"], self._data, {n: int(c) for n, c in mix["counts"].items()})
        saved = [Stage.from_dict(d) for d in mix["stages"]]
        gone = set(mix["counts"]) - names
        resumed = resume_schedule(
            saved, [Stage.from_dict(d) for d in mix["planned"]], self._config_stages, names, gone, k
        )
        added = sorted(names - set(mix["counts"]))
        self.edited = resumed.edited + [f"source {n} added" for n in added] + [f"source {n} left" for n in gone]
        self.revision = int(mix["revision"]) + bool(self.edited)
        past = [
            Stage(
                s.name,
                s.start,
                {n: f for n, f in s.fractions.items() if n in names},
                s.weights,
                s.start_key,
                s.start_value,
            )
            for s in saved
        ]
        sched = Schedule(
            self.names, tuple(past + resumed.future), self.mix.stream.global_batch_size, self.mix.stream.seed
        )
        self._planned, self._past, self._resumed_at = saved + resumed.future, saved, k
        counts = np.array([int(mix["counts"].get(n, 0)) for n in self.names], dtype=np.int64)
        at_stage = np.array([int(mix["at_stage"].get(n, 0)) for n in self.names], dtype=np.int64)
        self._at = self._before = Cursor(k, len(past) - 1 if past else 0, counts, at_stage if past else counts.copy())
        self._base = counts.copy()
        self._tokens = np.array([int(mix["tokens"].get(n, 0)) for n in self.names], dtype=np.int64)
        self._carried = {
            "data": {n: state["data"][n] for n in gone if n in state["data"]},
            "counts": {n: mix["counts"][n] for n in gone},
            "tokens": {n: mix["tokens"].get(n, 0) for n in gone},
            "read": [{n: r for n, r in c["read"].items() if n in gone} for c in state["cursors"]],
        }
        self.close()
        self.mix = MixSpec(self.mix.stream, self.mix.sources, sched)
        self._cursors = [
            {"windows": int(c["windows"]), "read": {n: list(r) for n, r in c["read"].items() if n in names}}
            for c in state["cursors"]
        ]
        if self.edited:
            log.info("data mix revision %d from step %d: %s", self.revision, k, "; ".join(self.edited))
        self.plan = self._check_plan()

    def stats(self) -> dict[str, float]:
        """Loader metrics as of the last consumed batch: the one-source loader's totals, and ``hlat.data.mix_metrics``'.

        ``data/epochs`` estimates the mix's: this rank's rows read, scaled to every rank's, over all sources' rows.
        """
        reads = [r for c in self._cursors for r in c["read"].values()]
        windows = sum(c["windows"] for c in self._cursors) * self.mix.stream.seq_len
        rows = sum(len(s) for s in self.sources)
        share = self.mix.stream.global_batch_size / len(self._cursors)
        out = {
            "data/documents_consumed": float(sum(r[2] for r in reads)),
            "data/skipped_documents": float(sum(r[3] for r in reads)),
            "data/tokens_produced": float(windows),
            "data/padding_fraction": 0.0,
            "data/epochs": sum(r[0] for r in reads) * share / rows,
            "data/producer_tokens_per_s": windows / self._busy if self._busy > 0 else 0.0,
            "data/mix/stage": float(self._stage_now()),
        }
        fractions = self.mix.schedule.fractions(self._stage_now())
        return out | host_metrics(self.names, self.tokens(), fractions, self._shown())

    def _shown(self) -> list[int]:
        """The sources with series of their own (``data.log_sources``)."""
        sched = self.mix.schedule
        return shown_sources(self.names, [sched.fractions(i) for i in range(len(sched.stages))], self.log_sources)

    def _stage_now(self) -> int:
        """The stage of the next batch (the one in progress)."""
        return self.mix.schedule.stage_at(self._at.batch)

    def interval(self, device: torch.device) -> tuple[dict[str, torch.Tensor], Any]:
        """The device values of a log interval (the per-source tally, this rank's reads) and their metrics' maker.

        The maker turns the fetched values (averaged over the ranks) into ``train/loss/<source>`` and
        ``data/mix/<source>/{share,documents,epochs}``, with this moment's host values captured.
        """
        sums = self.tally.take()
        tensors = {"mix/reads": reads_tensor(self._cursors, self.names, device)}
        if sums is not None:
            tensors["mix/tally"] = sums
        rows = np.array([len(s) for s in self.sources], dtype=np.float64)
        s = self.mix.stream
        make = partial(interval_metrics, self.names, rows, s.dp_size, s.seq_len, self._shown())
        return tensors, make

    def run_info(self) -> dict[str, Any]:
        """What the run records of the mix: tags, params (each source's fraction) and the plan's file.

        Beyond ``data.log_sources`` sources, also what MLflow leaves to the Parquet series (``series_only``).
        """
        fractions = self.mix.schedule.fractions(self.mix.schedule.stage_at(0))
        params: dict[str, Any] = {}
        for m, name in enumerate(self.names):
            params[f"data.mix.{name}.fraction"] = round(float(fractions[m]), 6)
        stages = [s.name for s in self._planned if s.name]
        hidden = series_only(self.names, self._shown(), stages) if len(self._shown()) < len(self.names) else {}
        tags = {"data.mix_revision": str(self.revision)}
        if self.edited:
            tags["data.mix_edits"] = "; ".join(self.edited)[:5000]
        plan = self.plan.to_dict() | {"revision": self.revision}
        files = {"mixture_plan.json": json.dumps(plan, indent=1)}
        return {"tags": tags, "params": params, "files": files, "series_only": hidden}
