"""Data loader throughput: hlat's online loader against the Hugging Face pipeline a user would write instead.

Both sides read the same Arrow file (the builtin corpus repeated to ``--size-mb``), tokenize with the same
sentencepiece ``.model`` and deliver ``(micro_batch_size, seq_len)`` int64 batches; tokens are counted the
same way on both sides (``micro_batch_size * seq_len`` per batch) and each side delivers the same number of
batches. The clock runs from opening the data to the last batch; imports happen before it starts.

Pipelines (one fresh subprocess per measurement, repetitions interleaved so load drifts hit every row alike):

* ``hlat``: ``hlat.data.build_loader`` over the file with ``data.tokenizer=<the .model>``; one row per
  ``data.worker`` mode when the config has that field.
* ``hlat, 1 core``: the same, pinned to a single core (``sched_setaffinity``), for the per-core rate.
* ``HF + sentencepiece``: ``datasets.Dataset.from_file`` -> ``.map(tokenize, batched=True)`` appending EOS
  -> the ``group_texts`` of transformers' ``run_clm.py`` -> ``with_format("torch")`` -> ``torch.utils.data.DataLoader``.
  Every ``.map`` uses ``keep_in_memory=True`` so no cache file is written or reused.
* ``HF + fast tokenizer``: the same with a ``tokenizers`` fast tokenizer converted from the same ``.model``
  (ids are checked against sentencepiece on a sample), ``num_proc`` at its default and at 2.
* ``sp.encode ceiling``: sentencepiece alone over every document (1 and 2 threads), no packing, no batching.

Run from the repository root::

    python bench/data_loader.py            # full run (~8 min on 2 cores)
    python bench/data_loader.py --quick    # smoke run (< 60 s)

No network access is needed: the corpus comes from the Python standard library and the tokenizer is
trained on it (cached under ``--cache-dir``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

# HLAT-7B on trn1 (paper §3, slides p.36): the figures the required loader rate is derived from.
N_PARAMS_7B = 6.74e9
N_LAYERS_7B = 32
SEQ_LEN_7B = 4096
D_MODEL_7B = 4096
TRN1_PEAK_FLOPS = 3040e12  # trn1.32xlarge, BF16: 32 NeuronCores x 95 TFLOPS
MFU_64_NODES = 0.279
NODES = 64
TP_DEGREE = 8
NEURON_CORES_PER_NODE = 32
GLOBAL_BATCH_TOKENS = 1024 * 4096

HF_MAP_BATCH = 1000  # datasets' default .map batch size; group_texts drops a remainder per map batch
FAST_CHECK_DOCS = 500
CHILD_TIMEOUT_S = 300
RESULT_TAG = "BENCH_RESULT "

PACKAGES = ("torch", "pyarrow", "sentencepiece", "datasets", "transformers", "tokenizers", "hlat")


# --------------------------------------------------------------------------------------------------
# Measurements (each runs in its own subprocess, see _child_main)
# --------------------------------------------------------------------------------------------------


def _peak_rss_mb() -> float:
    import resource

    # ru_maxrss is in KiB on Linux; children covers num_proc / loader worker processes.
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024


def _hlat_config_fields() -> set[str]:
    from hlat.config import DataConfig

    return {f.name for f in dataclasses.fields(DataConfig)}


def run_hlat(spec: dict[str, Any]) -> dict[str, Any]:
    """Time ``hlat.data.build_loader`` delivering ``spec["batches"]`` micro-batches.

    Args:
        spec: Measurement spec: ``arrow``, ``model``, ``vocab_size``, ``seq_len``, ``micro_batch_size``,
            ``batches`` and ``worker`` (a ``data.worker`` value, or None when the field does not exist).

    Returns:
        ``seconds``, ``tokens`` and ``batches`` delivered, and ``first_batch_s`` (time to the first batch).
    """
    import torch  # noqa: F401  (imported before the clock, as on the HF side; the loader imports it lazily)

    from hlat.config import DataConfig
    from hlat.data import build_loader

    kwargs: dict[str, Any] = {"path": spec["arrow"], "tokenizer": spec["model"], "cache_dir": spec["cache_dir"]}
    if spec["worker"] is not None:
        kwargs["worker"] = spec["worker"]
    cfg = DataConfig(**kwargs)
    B, T = spec["micro_batch_size"], spec["seq_len"]
    # A global batch of several micro-batches: this rank serves that many sequence slots (hlat.data.slots).
    size = {"global_batch_size": spec["global_batch_size"]} if spec.get("global_batch_size") else {}
    start = time.perf_counter()
    loader = build_loader(cfg, vocab_size=spec["vocab_size"], seq_len=T, micro_batch_size=B, seed=0, **size)
    tokens, first = 0, 0.0
    for _ in range(spec["batches"]):
        inputs, targets = next(loader)
        if targets.shape != (B, T) or inputs.dtype != targets.dtype:
            raise AssertionError(f"unexpected batch {tuple(targets.shape)} {targets.dtype}")
        first = first or time.perf_counter() - start
        tokens += targets.numel()
    seconds = time.perf_counter() - start
    close = getattr(loader, "close", None)
    if callable(close):
        close()
    return {"seconds": seconds, "tokens": tokens, "batches": spec["batches"], "first_batch_s": first}


def _group_texts_fn(block_size: int) -> Callable[[dict[str, list]], dict[str, list]]:
    """``group_texts`` as in transformers' examples/pytorch/language-modeling/run_clm.py."""
    from itertools import chain

    def group_texts(examples: dict[str, list]) -> dict[str, list]:
        # Concatenate all texts.
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples}
        total_length = len(concatenated_examples[next(iter(examples.keys()))])
        # We drop the small remainder of each map batch.
        total_length = (total_length // block_size) * block_size
        # Split by chunks of block_size.
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    return group_texts


def run_hf(spec: dict[str, Any]) -> dict[str, Any]:
    """Time the Hugging Face ``datasets`` pipeline from opening the file to the last torch batch.

    Args:
        spec: Measurement spec: ``arrow``, ``model`` (sentencepiece) or ``fast_dir`` (saved fast
            tokenizer), ``tokenizer`` (``"sp"`` or ``"fast"``), ``num_proc``, ``seq_len``, ``micro_batch_size``.

    Returns:
        ``seconds``, ``tokens`` and ``batches`` delivered, ``first_batch_s`` and the seconds of each stage.
    """
    import datasets
    import torch
    from torch.utils.data import DataLoader

    datasets.disable_progress_bars()
    if spec["tokenizer"] == "sp":
        import sentencepiece as spm
    else:
        from transformers import AutoTokenizer
    B, T, num_proc = spec["micro_batch_size"], spec["seq_len"], spec["num_proc"]
    start = time.perf_counter()
    if spec["tokenizer"] == "sp":
        sp = spm.SentencePieceProcessor(model_file=spec["model"])
        eos = sp.eos_id()

        def tokenize(batch: dict[str, list]) -> dict[str, list]:
            return {"input_ids": [[*ids, eos] for ids in sp.encode(batch["text"], out_type=int)]}

    else:
        tok = AutoTokenizer.from_pretrained(spec["fast_dir"], local_files_only=True)
        eos = tok.eos_token_id

        def tokenize(batch: dict[str, list]) -> dict[str, list]:
            out = tok(batch["text"], add_special_tokens=False, return_attention_mask=False)
            return {"input_ids": [[*ids, eos] for ids in out["input_ids"]]}

    raw = datasets.Dataset.from_file(spec["arrow"])  # memory-mapped, HF's own stream format
    tokenized = raw.map(tokenize, batched=True, remove_columns=["text"], keep_in_memory=True, num_proc=num_proc)
    t_tok = time.perf_counter()
    lm = tokenized.map(_group_texts_fn(T), batched=True, keep_in_memory=True, num_proc=num_proc)
    t_group = time.perf_counter()
    loader = DataLoader(
        lm.with_format("torch"), batch_size=B, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(0)
    )
    tokens = batches = 0
    first = 0.0
    for batch in loader:
        targets = batch["labels"]
        if targets.shape != (B, T) or targets.dtype != torch.int64:
            raise AssertionError(f"unexpected batch {tuple(targets.shape)} {targets.dtype}")
        first = first or time.perf_counter() - start
        tokens += targets.numel()
        batches += 1
    end = time.perf_counter()
    stages = {"tokenize": t_tok - start, "group": t_group - t_tok, "iterate": end - t_group}
    return {"seconds": end - start, "tokens": tokens, "batches": batches, "stages": stages, "first_batch_s": first}


def run_sp_ceiling(spec: dict[str, Any]) -> dict[str, Any]:
    """Time ``SentencePieceProcessor.encode`` over every document of the file, nothing else.

    Args:
        spec: ``arrow``, ``model`` and ``threads`` (sentencepiece's ``num_threads``).

    Returns:
        ``seconds`` and ``tokens`` (ids produced plus one EOS per document, as the loaders count them).
    """
    import pyarrow as pa
    import sentencepiece as spm

    with pa.memory_map(spec["arrow"]) as source:
        docs = pa.ipc.open_stream(source).read_all().column("text").to_pylist()
    sp = spm.SentencePieceProcessor(model_file=spec["model"])
    start = time.perf_counter()
    ids = sp.encode(docs, out_type=int, num_threads=spec["threads"])
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(map(len, ids)) + len(docs), "batches": 0}


RUNNERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "hlat": run_hlat,
    "hf": run_hf,
    "sp": run_sp_ceiling,
}


def _child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    if spec.get("cores"):
        # Pin before anything spawns threads: hlat's tokenizer sizes its pool from the affinity mask.
        os.sched_setaffinity(0, set(spec["cores"]))
        os.environ["OMP_NUM_THREADS"] = str(len(spec["cores"]))
    result = RUNNERS[spec["kind"]](spec)
    result["peak_rss_mb"] = _peak_rss_mb()
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    # Loader worker threads/processes must not keep the measurement process alive.
    os._exit(0)


# --------------------------------------------------------------------------------------------------
# Setup: input file, tokenizer, fast tokenizer, expected batch counts
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    """Everything the measurements share.

    Attributes:
        arrow: Benchmark input (Arrow IPC stream, ``text`` column).
        model: The sentencepiece ``.model`` both sides use.
        fast_dir: Saved fast tokenizer converted from ``model``, or None if transformers is missing.
        fast_match: How the fast tokenizer's ids compare with sentencepiece's on a sample.
        documents: Documents in ``arrow``.
        megabytes: UTF-8 size of the text in ``arrow``.
        corpus_tokens: Tokens of all documents, one EOS each included.
        hf_blocks: ``seq_len -> blocks`` that ``group_texts`` produces (remainders dropped per map batch).
        worker_modes: ``data.worker`` values to measure; ``[None]`` when ``DataConfig`` has no such field.
    """

    arrow: Path
    model: Path
    fast_dir: Path | None
    fast_match: str
    documents: int
    megabytes: float
    corpus_tokens: int
    hf_blocks: dict[int, int]
    worker_modes: list[str | None]

    def to_json(self) -> str:
        """The setup as JSON (paths as strings)."""
        return json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()})

    @classmethod
    def from_json(cls, text: str) -> Setup:
        """Inverse of :meth:`to_json`."""
        d = json.loads(text)
        d["arrow"], d["model"] = Path(d["arrow"]), Path(d["model"])
        d["fast_dir"] = Path(d["fast_dir"]) if d["fast_dir"] else None
        d["hf_blocks"] = {int(k): v for k, v in d["hf_blocks"].items()}
        return cls(**d)


def _write_stream(docs: Sequence[str], path: Path, batch_rows: int) -> None:
    import pyarrow as pa

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"text": pa.array(docs, type=pa.string())})
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # The IPC *stream* format is what datasets.Dataset.from_file memory-maps; hlat reads both flavours.
        with os.fdopen(fd, "wb") as fh, pa.ipc.new_stream(fh, table.schema) as writer:
            writer.write_table(table, max_chunksize=batch_rows or None)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _convert_fast_tokenizer(model: Path, out_dir: Path, docs: Sequence[str]) -> tuple[Path | None, str]:
    """Convert ``model`` to a fast tokenizer saved in ``out_dir`` and compare its ids with sentencepiece's."""
    try:
        import sentencepiece as spm
        from transformers import LlamaTokenizer
    except ImportError as err:
        return None, f"transformers not installed ({err})"
    import shutil

    if not (out_dir / "tokenizer.json").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(model, Path(tmp) / "tokenizer.model")
            tok = LlamaTokenizer.from_pretrained(tmp, local_files_only=True, legacy=False)
            tok.save_pretrained(out_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    sample = list(docs[:FAST_CHECK_DOCS])
    ours = spm.SentencePieceProcessor(model_file=str(model)).encode(sample, out_type=int)
    theirs = tok(sample, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    if same == len(sample):
        return out_dir, f"identical ids on {len(sample)} documents"
    return out_dir, f"ids DIFFER on {len(sample) - same} of {len(sample)} documents"


def _hf_blocks(lengths: Sequence[int], seq_len: int) -> int:
    """Blocks ``group_texts`` yields: per map batch of documents, floor(tokens / seq_len)."""
    return sum(sum(lengths[i : i + HF_MAP_BATCH]) // seq_len for i in range(0, len(lengths), HF_MAP_BATCH))


def prepare(cache_dir: Path, size_mb: float, vocab_size: int, seq_lens: Sequence[int], batch_rows: int) -> Setup:
    """Build (or reuse) the benchmark input, the tokenizer and the fast tokenizer.

    Args:
        cache_dir: Where the corpus, tokenizer and benchmark input are cached.
        size_mb: Approximate UTF-8 size of the benchmark input (the builtin corpus repeated).
        vocab_size: Pieces of the sentencepiece tokenizer trained on the builtin corpus.
        seq_lens: Sequence lengths to compute the HF block counts for.
        batch_rows: Rows per Arrow record batch in the input file; 0 writes a single batch.

    Returns:
        The shared setup.
    """
    import sentencepiece as spm

    from hlat.config import DataConfig
    from hlat.data import builtin_corpus_path, load_documents, load_or_train_tokenizer

    corpus = load_documents(builtin_corpus_path(cache_dir)).texts
    tokenizer = load_or_train_tokenizer(DataConfig(cache_dir=str(cache_dir)), corpus, vocab_size, cache_dir)
    corpus_mb = sum(len(d.encode("utf-8")) for d in corpus) / 1e6
    repeats = max(1, round(size_mb / corpus_mb))
    docs = corpus * repeats
    arrow = cache_dir / "bench" / f"corpus-x{repeats}-{len(corpus)}docs-rb{batch_rows}.arrow"
    if not arrow.is_file():
        _write_stream(docs, arrow, batch_rows)
    fast_dir, fast_match = _convert_fast_tokenizer(
        tokenizer.path, cache_dir / "bench" / f"fast-{tokenizer.fingerprint}", corpus
    )
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer.path))
    lengths = [len(ids) + 1 for ids in sp.encode(docs, out_type=int)]
    worker_modes: list[str | None] = ["none", "thread", "process"] if "worker" in _hlat_config_fields() else [None]
    return Setup(
        arrow=arrow,
        model=tokenizer.path,
        fast_dir=fast_dir,
        fast_match=fast_match,
        documents=len(docs),
        megabytes=corpus_mb * repeats,
        corpus_tokens=sum(lengths),
        hf_blocks={T: _hf_blocks(lengths, T) for T in seq_lens},
        worker_modes=worker_modes,
    )


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """One row of the results table.

    Attributes:
        label: Pipeline name shown in the table.
        parallelism: Workers / processes / threads it uses.
        seq_len: Tokens per sequence (0 for the tokenizer ceiling).
        spec: Measurement spec handed to the subprocess.
        side: ``hlat``, ``hf`` or ``ceiling``.
        results: One result dict per repetition (``error`` set when it failed).
    """

    label: str
    parallelism: str
    seq_len: int
    spec: dict[str, Any]
    side: str
    results: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def rates(self) -> list[float]:
        """Tokens/s of the successful repetitions."""
        return [r["tokens"] / r["seconds"] for r in self.results if "error" not in r]

    def median(self) -> float | None:
        """Median tokens/s, or None if no repetition succeeded."""
        rates = self.rates()
        return statistics.median(rates) if rates else None


def build_cases(
    setup: Setup,
    seq_lens: Sequence[int],
    micro_batch_size: int,
    vocab_size: int,
    cache_dir: Path,
    global_batch_size: int | None = None,
) -> list[Case]:
    """All measurements of a run, in the order they are printed.

    Args:
        setup: Shared input and tokenizers.
        seq_lens: Sequence lengths to measure.
        micro_batch_size: Sequences per batch.
        vocab_size: Tokenizer pieces.
        cache_dir: hlat cache directory passed to ``DataConfig``.
        global_batch_size: Sequences per global batch on hlat's side (None: one micro-batch per step).

    Returns:
        The cases (results still empty).
    """
    common = {"arrow": str(setup.arrow), "model": str(setup.model), "micro_batch_size": micro_batch_size}
    cases = []
    for T in seq_lens:
        batches = setup.hf_blocks[T] // micro_batch_size
        hlat = {**common, "kind": "hlat", "seq_len": T, "batches": batches, "vocab_size": vocab_size}
        hlat["cache_dir"] = str(cache_dir)
        hlat["global_batch_size"] = global_batch_size
        for mode in setup.worker_modes:
            label = "hlat build_loader" if mode is None else f"hlat build_loader, worker={mode}"
            cases.append(Case(label, "2 cores, sp threads=2", T, {**hlat, "worker": mode}, "hlat"))
        one_core_mode = None if setup.worker_modes == [None] else "none"
        cases.append(
            Case(
                "hlat build_loader, 1 core",
                "pinned to 1 core",
                T,
                {**hlat, "worker": one_core_mode, "cores": [0]},
                "hlat",
            )
        )
        if importlib.util.find_spec("datasets") is None:
            continue  # main() says that the HF side was skipped
        hf = {**common, "kind": "hf", "seq_len": T}
        for num_proc in (None, 2):
            cases.append(
                Case(
                    "HF datasets + sentencepiece",
                    f"num_proc={num_proc}, sp threads=all",
                    T,
                    {**hf, "tokenizer": "sp", "num_proc": num_proc},
                    "hf",
                )
            )
        if setup.fast_dir is not None:
            for num_proc in (None, 2):
                cases.append(
                    Case(
                        "HF datasets + fast tokenizer",
                        f"num_proc={num_proc}",
                        T,
                        {**hf, "tokenizer": "fast", "fast_dir": str(setup.fast_dir), "num_proc": num_proc},
                        "hf",
                    )
                )
    for threads in (1, 2):
        spec = {**common, "kind": "sp", "threads": threads}
        cases.append(Case("sp.encode ceiling (no packing)", f"{threads} thread(s)", 0, spec, "ceiling"))
    return cases


def _child_env(hf_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    # Offline, and HF's caches in a throwaway directory so that no run benefits from an earlier one.
    env.update(
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(hf_home),
        HF_DATASETS_CACHE=str(hf_home / "datasets"),
        TRANSFORMERS_VERBOSITY="error",
        PYTHONWARNINGS="ignore",
    )
    return env


def prepare_in_subprocess(args: argparse.Namespace) -> Setup:
    """Run :func:`prepare` in a child so this process stays small (children inherit its peak RSS).

    Args:
        args: Parsed command line.

    Returns:
        The shared setup.

    Raises:
        RuntimeError: Preparation failed.
    """
    spec = {"cache_dir": str(args.cache_dir), "size_mb": args.size_mb, "vocab_size": args.vocab_size}
    spec["seq_lens"], spec["batch_rows"] = args.seq_len, args.record_batch_rows
    cmd = [sys.executable, str(Path(__file__).resolve()), "--prepare", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return Setup.from_json(line[len(RESULT_TAG) :])
    raise RuntimeError(f"preparing the benchmark input failed:\n{proc.stderr}")


def _busy_cpu_seconds() -> float | None:
    """CPU seconds all processes on the machine have used (``/proc/stat``), or None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_case(case: Case, env: dict[str, str]) -> dict[str, Any]:
    """Run one repetition of ``case`` in a fresh interpreter.

    Args:
        case: The measurement.
        env: Environment of the subprocess.

    Returns:
        The measurement's result dict, or ``{"error": ...}``.
    """
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", json.dumps(case.spec)]
    load_before = os.getloadavg()[0]
    busy0, own0, wall0 = _busy_cpu_seconds(), _children_cpu_seconds(), time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {CHILD_TIMEOUT_S}s"}
    busy1, own1, wall1 = _busy_cpu_seconds(), _children_cpu_seconds(), time.perf_counter()
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG) :])
            result["load1"] = load_before
            if busy0 is not None and busy1 is not None:
                # Cores kept busy by everything except this measurement (its process tree), on average.
                result["other_cores"] = max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall1 - wall0)
            return result
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or [f"exit code {proc.returncode}"]
    return {"error": tail[0][:200]}


def _fmt_rate(rate: float | None) -> str:
    return "failed" if rate is None else f"{rate / 1e6:.3f} M"


def _fmt_range(rates: Sequence[float]) -> str:
    if not rates:
        return "-"
    return f"{min(rates) / 1e6:.3f}-{max(rates) / 1e6:.3f} M"


def results_table(cases: Sequence[Case]) -> str:
    """Markdown table of every case: median and range of tokens/s, ratio to HF + sentencepiece.

    Args:
        cases: Measured cases.

    Returns:
        The table.
    """
    baseline = {
        c.seq_len: c.median()
        for c in cases
        if c.side == "hf" and c.spec.get("tokenizer") == "sp" and c.spec.get("num_proc") is None
    }
    lines = [
        "| pipeline | parallelism | seq_len | tokens/run | tokens/s (median) | range (min-max) | "
        "÷ HF+sp (num_proc=None) | first batch (s) | peak RSS MB | other processes (cores) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cases:
        ok = [r for r in c.results if "error" not in r]
        med = c.median()
        base = baseline.get(c.seq_len)
        ratio = f"{med / base:.2f}x" if med and base else "-"
        tokens = f"{ok[0]['tokens']:,}" if ok else "-"
        rss = f"{max(r['peak_rss_mb'] for r in ok):.0f}" if ok else "-"
        firsts = [r["first_batch_s"] for r in ok if "first_batch_s" in r]
        first = f"{statistics.median(firsts):.2f}" if firsts else "-"
        others = [r["other_cores"] for r in ok if "other_cores" in r]
        load = f"{min(others):.2f}-{max(others):.2f}" if others else "-"
        seq = str(c.seq_len) if c.seq_len else "-"
        name = c.label
        errors = [r["error"] for r in c.results if "error" in r]
        if errors:
            name += f" ({len(errors)} failed: {errors[0]})"
        lines.append(
            f"| {name} | {c.parallelism} | {seq} | {tokens} | {_fmt_rate(med)} | {_fmt_range(c.rates())} | "
            f"{ratio} | {first} | {rss} | {load} |"
        )
    return "\n".join(lines)


def summary(cases: Sequence[Case], target: float = 2.0) -> str:
    """Per seq_len: best hlat mode against HF + sentencepiece and against the best HF pipeline.

    Args:
        cases: Measured cases.
        target: Required hlat / HF ratio.

    Returns:
        Markdown lines.
    """
    out = []
    ceilings = [c.median() or 0.0 for c in cases if c.side == "ceiling" and c.median() is not None]
    for T in sorted({c.seq_len for c in cases if c.seq_len}, reverse=True):
        row = [c for c in cases if c.seq_len == T and c.median() is not None]
        hlat = [c for c in row if c.side == "hlat" and "cores" not in c.spec]
        hf = [c for c in row if c.side == "hf"]
        hf_sp = [c for c in hf if c.spec["tokenizer"] == "sp" and c.spec["num_proc"] is None]
        if not hlat or not hf_sp:
            out.append(f"- seq_len={T}: incomplete (a pipeline failed)")
            continue
        best = max(hlat, key=lambda c: c.median() or 0.0)
        best_hf = max(hf, key=lambda c: c.median() or 0.0)
        r_sp = (best.median() or 0.0) / (hf_sp[0].median() or 1.0)
        r_best = (best.median() or 0.0) / (best_hf.median() or 1.0)
        verdict = "met" if r_sp >= target else "NOT met"
        out.append(
            f"- seq_len={T}: {best.label} {_fmt_rate(best.median())} tok/s = **{r_sp:.2f}x** HF + sentencepiece "
            f"(target >= {target:g}x: {verdict}); {r_best:.2f}x the fastest HF variant "
            f"({best_hf.label}, {best_hf.parallelism})"
        )
        if ceilings:
            # No loader that runs this tokenizer on these cores can beat sentencepiece alone.
            bound = max(ceilings) / (hf_sp[0].median() or 1.0)
            out.append(
                f"  - bound: the best sp.encode ceiling ({_fmt_rate(max(ceilings))} tok/s) is {bound:.2f}x "
                "HF + sentencepiece, the most any loader using this tokenizer can reach here"
            )
    return "\n".join(out)


def hlat7b_requirement() -> dict[str, float]:
    """Tokens/s one trn1.32xlarge node consumes training HLAT-7B at the paper's 64-node MFU.

    Returns:
        FLOPs per token, achieved FLOP/s per node, tokens/s per node, per data-parallel rank and cluster-wide.
    """
    flops_per_token = 6 * N_PARAMS_7B + 6 * N_LAYERS_7B * SEQ_LEN_7B * D_MODEL_7B
    achieved = TRN1_PEAK_FLOPS * MFU_64_NODES
    per_node = achieved / flops_per_token
    dp_ranks_per_node = NEURON_CORES_PER_NODE // TP_DEGREE
    return {
        "flops_per_token": flops_per_token,
        "achieved_flops_per_node": achieved,
        "tokens_per_s_node": per_node,
        "dp_ranks_per_node": dp_ranks_per_node,
        "tokens_per_s_rank": per_node / dp_ranks_per_node,
        "tokens_per_s_cluster": per_node * NODES,
        "step_seconds": GLOBAL_BATCH_TOKENS / (per_node * NODES),
    }


def requirement_text(cases: Sequence[Case]) -> str:
    """The HLAT-7B per-node rate against what one host core delivers through the hlat loader.

    Args:
        cases: Measured cases (the ``hlat build_loader, 1 core`` rows are used).

    Returns:
        Markdown lines.
    """
    req = hlat7b_requirement()
    lines = [
        f"- HLAT-7B FLOPs/token = 6*{N_PARAMS_7B:.3g} + 6*{N_LAYERS_7B}*{SEQ_LEN_7B}*{D_MODEL_7B} "
        f"= {req['flops_per_token']:.4g}",
        f"- per trn1.32xlarge: {TRN1_PEAK_FLOPS / 1e12:.0f} TFLOPS x MFU {MFU_64_NODES} = "
        f"{req['achieved_flops_per_node'] / 1e12:.1f} TFLOPS -> **{req['tokens_per_s_node']:,.0f} tokens/s per node** "
        f"({req['tokens_per_s_rank']:,.0f} per data-parallel rank, {req['dp_ranks_per_node']} ranks/node "
        f"at TP={TP_DEGREE}; {req['tokens_per_s_cluster'] / 1e6:.2f} M tokens/s on {NODES} nodes, "
        f"{req['step_seconds']:.1f} s per 4M-token step)",
    ]
    for c in cases:
        if c.side == "hlat" and "cores" in c.spec and c.median() is not None:
            rate = c.median() or 0.0
            lines.append(
                f"- seq_len={c.seq_len}: one host core through the hlat loader = {_fmt_rate(rate)} tokens/s "
                f"= **{rate / req['tokens_per_s_node']:.0f}x** one node's need "
                f"({100 * req['tokens_per_s_node'] / rate:.1f}% of a core)"
            )
    return "\n".join(lines)


def _versions() -> str:
    parts = [f"python {platform.python_version()}"]
    for name in PACKAGES:
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} (not installed)")
    return ", ".join(parts)


def _hlat_data_digest() -> str:
    """Short hash of the hlat data package's sources, to tie numbers to the loader code they measured."""
    import hashlib

    spec = importlib.util.find_spec("hlat.data")
    if spec is None or not spec.submodule_search_locations:
        return "unknown"
    root = Path(next(iter(spec.submodule_search_locations)))
    h = hashlib.sha256()
    for path in sorted(root.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small input, one repetition, one seq_len")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions per measurement (default 3, quick 1)")
    parser.add_argument("--size-mb", type=float, default=None, help="input size in MB (default 20, quick 2)")
    parser.add_argument("--seq-len", type=int, nargs="+", default=None, help="default 2048 256 (quick: 2048)")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="hlat's global batch in sequences, a multiple of the micro-batch: the loader serves that many slots "
        "(default: one micro-batch)",
    )
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument(
        "--record-batch-rows",
        type=int,
        default=HF_MAP_BATCH,
        help="rows per Arrow record batch of the input (default 1000, what HF's ArrowWriter writes; 0: one batch)",
    )
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/hlat"), help="hlat cache (corpus, tokenizer)")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prepare", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.size_mb = args.size_mb or (2.0 if args.quick else 20.0)
    args.seq_len = args.seq_len or ([2048] if args.quick else [2048, 256])
    args.cache_dir = args.cache_dir.expanduser()
    return args


def _progress(iterable: Sequence[Case], repeats: int) -> Iterator[tuple[int, Case]]:
    total = len(iterable) * repeats
    done = 0
    for rep in range(repeats):
        for case in iterable:
            done += 1
            print(
                f"  [{done}/{total}] rep {rep + 1}: {case.label}, {case.parallelism}, seq_len={case.seq_len}",
                file=sys.stderr,
                flush=True,
            )
            yield rep, case


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the markdown report.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        Exit code: 0, or 1 if any measurement failed.
    """
    args = _parse_args(argv)
    if args.measure is not None:
        _child_main(args.measure)
    if args.prepare is not None:
        spec = json.loads(args.prepare)
        setup = prepare(
            Path(spec["cache_dir"]), spec["size_mb"], spec["vocab_size"], spec["seq_lens"], spec["batch_rows"]
        )
        print(RESULT_TAG + setup.to_json())
        return 0
    started = dt.datetime.now(dt.timezone.utc)
    wall = time.perf_counter()
    load_start = os.getloadavg()
    print(f"preparing input ({args.size_mb:g} MB) and tokenizers in {args.cache_dir} ...", file=sys.stderr)
    setup = prepare_in_subprocess(args)
    cases = build_cases(
        setup, args.seq_len, args.micro_batch_size, args.vocab_size, args.cache_dir, args.global_batch_size
    )
    with tempfile.TemporaryDirectory(prefix="hlat-bench-hf-") as hf_home:
        env = _child_env(Path(hf_home))
        for _, case in _progress(cases, args.repeats):
            case.results.append(run_case(case, env))
    load_end = os.getloadavg()
    loads = [r["load1"] for c in cases for r in c.results if "load1" in r]
    others = [r["other_cores"] for c in cases for r in c.results if "other_cores" in r]

    print(f"## Data loader throughput ({started:%Y-%m-%d %H:%M} UTC)\n")
    print(
        f"- machine: {os.cpu_count()} CPU cores ({_cpu_model()}), {platform.system()} {platform.release()}, "
        "no accelerator used"
    )
    print(
        f"- load average (1/5/15 min) at start {load_start[0]:.2f}/{load_start[1]:.2f}/{load_start[2]:.2f}, "
        f"at end {load_end[0]:.2f}/{load_end[1]:.2f}/{load_end[2]:.2f}; 1-min load before each measurement "
        f"{min(loads, default=0):.2f}-{max(loads, default=0):.2f} (includes the benchmark's own previous run)"
    )
    if others:
        print(
            f"- other processes kept {statistics.mean(others):.2f} cores busy on average during the measurements "
            f"(max {max(others):.2f} in one); column 'other processes' per row"
        )
    print(
        f"- input: {setup.documents:,} documents, {setup.megabytes:.1f} MB of text, {setup.corpus_tokens:,} tokens "
        f"(vocab {args.vocab_size}, {setup.arrow.name}, {args.record_batch_rows or 'all'} rows per record batch); "
        f"micro_batch_size={args.micro_batch_size}, hlat global_batch_size={args.global_batch_size or 'the same'}; "
        f"{args.repeats} repetition(s) per row, interleaved"
    )
    if importlib.util.find_spec("datasets") is None:
        print(
            "- **HF side skipped**: `datasets` is not installed (pip install -c constraints.txt datasets transformers)"
        )
    print(f"- fast tokenizer vs sentencepiece: {setup.fast_match}")
    print(f"- versions: {_versions()}; hlat/data sources sha256 {_hlat_data_digest()}")
    print(f"- wall time {time.perf_counter() - wall:.0f} s\n")
    print(results_table(cases))
    print("\n### hlat / HF\n")
    print(summary(cases))
    print("\n### HLAT-7B on trn1: required rate against one host core\n")
    print(requirement_text(cases))
    if args.json is not None:
        args.json.write_text(json.dumps([dataclasses.asdict(c) for c in cases], indent=1))
    failed = any("error" in r for c in cases for r in c.results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
