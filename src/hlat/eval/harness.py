"""lm-evaluation-harness on hlat checkpoints: the ``hlat`` model class, the local tasks and ``evaluate``.

lm-eval has no plugin discovery, so ``python -m hlat.eval.harness --model hlat --model_args checkpoint=<dir>
--tasks hlat_local`` is lm-eval's own command line with ``hlat`` registered (in Python: import this module before
``lm_eval.simple_evaluate(model="hlat", ...)``, or call ``evaluate``). Imports lm-eval and ``hlat.eval``.
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (registers lm-eval's own models first: get_model only does that in an empty registry)
import numpy as np
import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from hlat.eval.inference import decode_continuation, describe, greedy_batch, load
from hlat.eval.kv_cache import new_cache
from hlat.eval.tasks import TASKS_DIR, task_manager

log = logging.getLogger(__name__)
DEFAULT_BATCH_SIZE = 16
DEFAULT_MAX_GEN_TOKS = 256

__all__ = ["HlatLM", "evaluate", "main", "task_manager"]


class HlatLM(TemplateLM):
    """An hlat checkpoint as an lm-eval language model (``--model hlat``).

    It answers ``loglikelihood`` (batched, longest first, contexts cut from the left to ``max_length``),
    ``loglikelihood_rolling`` (disjoint windows of ``max_length`` tokens) and ``generate_until`` (greedy, batched:
    left-padded prompts with the pads masked, through ``hlat.eval.kv_cache``). Documents were separated by EOS in
    training, so EOS is the "start of text" token every context begins with (the role BOS plays for LLaMA).

    Args:
        checkpoint: A ``step_N`` checkpoint, a run's ``checkpoints/`` directory or the run directory.
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        batch_size: Sequences per forward pass, for log-likelihoods and generation (``auto``: 16).
        max_length: Longest input in tokens; default the run's ``train.seq_len`` (longer positions were never
            trained; ``model.max_seq_len`` for a weights-only checkpoint), at most ``model.max_seq_len``.
        dtype: ``float32`` (default) or ``bfloat16`` weights.
        tokenizer: A sentencepiece ``.model`` to use instead of the run's tokenizer.
        **kwargs: Other arguments lm-eval passes (``max_batch_size``), ignored.
    """

    def __init__(
        self,
        checkpoint: str,
        device: str | None = "cpu",
        batch_size: int | str | None = DEFAULT_BATCH_SIZE,
        max_length: int | str | None = None,
        dtype: str = "float32",
        tokenizer: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.loaded = load(checkpoint, device=device or "cpu", dtype=dtype, tokenizer=tokenizer)
        self.model, self.tok = self.loaded.model, self.loaded.tokenizer
        longest = self.model.cfg.max_seq_len
        self._device = self.model.embed.weight.device
        auto = batch_size is None or str(batch_size).startswith("auto")
        self.batch_size = DEFAULT_BATCH_SIZE if auto else int(batch_size)
        self.max_length = int(max_length) if max_length is not None else self.loaded.context_len
        if not 1 <= self.max_length <= longest:
            raise ValueError(f"max_length={self.max_length} must be between 1 and model.max_seq_len={longest}")
        self._cache = new_cache(self.model, self.max_length)
        self._warned_sampling = False
        if kwargs:
            log.debug("ignoring model arguments %s", kwargs)

    # --- what lm-eval asks of a TemplateLM -------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(self.tok.path)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string``, after EOS (the start-of-document token) unless ``add_special_tokens`` is False."""
        ids = self.tok.encode([string])[0]
        return ids if add_special_tokens is False else [self.tok.eos_id, *ids]

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tok.decode(tokens)

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding yields the continuation) per request."""
        # Longest first: each batch pads to its first sequence, and memory errors come at the start, not the end.
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for lo in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, desc="hlat loglikelihood"):
            batch = [requests[i] for i in order[lo : lo + self.batch_size]]
            for i, res in zip(order[lo : lo + self.batch_size], self._score_batch(batch), strict=True):
                out[i] = res
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], res)
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def _score_batch(self, batch: list[tuple[Any, list[int], list[int]]]) -> list[tuple[float, bool]]:
        inputs, conts = [], []
        for _, ctx, cont in batch:
            if not ctx or not cont:
                raise ValueError("a log-likelihood request needs a non-empty context and continuation")
            if len(cont) > self.max_length:
                raise ValueError(
                    f"a continuation of {len(cont)} tokens does not fit max_length={self.max_length}; raise max_length"
                )
            inputs.append((ctx + cont)[-(self.max_length + 1) :][:-1])  # the last token is only predicted
            conts.append(cont)
        width = max(len(x) for x in inputs)
        # Right padding with EOS: causal attention keeps it from changing the scored positions.
        tokens = torch.full((len(inputs), width), self.tok.eos_id, dtype=torch.long)
        for row, x in enumerate(inputs):
            tokens[row, : len(x)] = torch.tensor(x)
        logits = self.model(tokens.to(self.device))  # (B, T, V)
        results = []
        for row, (x, cont) in enumerate(zip(inputs, conts, strict=True)):
            # Only the positions predicting the continuation, in fp32: (len(cont), V).
            lp = F.log_softmax(logits[row, len(x) - len(cont) : len(x)].float(), dim=-1)
            target = torch.tensor(cont, device=lp.device)
            total = lp.gather(-1, target[:, None]).sum()
            greedy_hit = bool((lp.argmax(-1) == target).all())
            results.append((float(total), greedy_hit))
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text, scored in disjoint windows of ``max_length`` tokens after EOS."""
        windows, owner = [], []
        for i, req in enumerate(requests):
            ids = self.tok_encode(req.args[0], add_special_tokens=False)
            rolling = get_rolling_token_windows(ids, self.prefix_token_id, self.max_length, context_len=1)
            for ctx, cont in map(make_disjoint_window, rolling):
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm), strict=True):
            totals[i] += ll
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, each cut before the first of its ``until`` strings.

        Requests with the same generation arguments decode together, ``batch_size`` at a time (``greedy_batch``:
        left-padded, the pads masked), longest prompt first so that each batch pads little and memory errors come
        at the start; the results come back in the requests' order.
        """
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(req.args[1]), []).append(i)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="hlat generate_until")
        for members in groups.values():
            until, max_new = self._generation_args(dict(requests[members[0]].args[1] or {}))
            ctxs = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - max_new) :] for i in members}
            order = sorted(members, key=lambda i: -len(ctxs[i]))
            for lo in range(0, len(order), self.batch_size):
                batch = order[lo : lo + self.batch_size]
                texts = self._generate_batch([ctxs[i] for i in batch], until, max_new)
                for i, text in zip(batch, texts, strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return out  # type: ignore[return-value]

    def _generation_args(self, gen_kwargs: dict[str, Any]) -> tuple[list[str], int]:
        """The ``until`` strings and the most new tokens of a request's generation arguments."""
        until = gen_kwargs.pop("until", None) or [self.tok.decode([self.tok.eos_id])]
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(gen_kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        if (gen_kwargs.get("do_sample") or gen_kwargs.get("temperature", 0.0)) and not self._warned_sampling:
            log.warning("hlat generates greedily; ignoring sampling arguments %s", gen_kwargs)
            self._warned_sampling = True
        return until, min(max_new, self.max_length - 1)  # room for at least one context token

    def _generate_batch(self, ctxs: list[list[int]], until: list[str], max_new: int) -> list[str]:
        """The greedy continuation text of each context, cut before the first ``until`` string."""

        def stop(row: int, new: list[int]) -> bool:
            text = decode_continuation(self.tok, ctxs[row], new)
            return any(u and u in text for u in until)

        eos = self.tok.eos_id
        news = greedy_batch(self.model, ctxs, max_new, eos_id=eos, stop=stop, cache=self._cache)
        texts = []
        for ctx, new in zip(ctxs, news, strict=True):
            if new and new[-1] == eos:
                new = new[:-1]
            text = decode_continuation(self.tok, ctx, new)
            for u in until:
                if u:
                    text = text.split(u, 1)[0]
            texts.append(text)
        return texts


if "hlat" not in model_registry:  # the decorator's job, but `python -m hlat.eval.harness` may import this module twice
    model_registry.register("hlat")(HlatLM)


def evaluate(
    checkpoint: str | Path,
    tasks: Sequence[str] | str = ("hlat_local",),
    num_fewshot: int | Mapping[str, int] | None = None,
    limit: int | float | None = None,
    device: str = "cpu",
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_length: int | None = None,
    include_defaults: bool = False,
    bootstrap_iters: int = 1000,
    tokenizer: str | None = None,
    dtype: str = "float32",
    **kwargs: Any,
) -> dict[str, Any]:
    """Evaluate a checkpoint on lm-eval tasks; lm-eval's results dict (``results``, ``groups``, ``configs``, ...).

    lm-eval seeds Python's, NumPy's and torch's generators; they are restored afterwards, so a training run that
    evaluates along the way draws the same numbers as one that does not.

    Args:
        checkpoint: A ``step_N`` checkpoint, a run's ``checkpoints/`` directory or the run directory.
        tasks: Task or group names (``hlat_local`` by default; built-in ones need ``include_defaults``).
        num_fewshot: Few-shot examples per prompt, for every task or per task name (e.g. the paper's
            ``{"mmlu": 5, "bbh": 3, "arc_easy": 0}``); None or a task left out: the task's default.
        limit: At most this many documents per task (a fraction if below 1).
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        batch_size: Sequences per forward pass.
        max_length: Longest input; default the run's ``train.seq_len``.
        include_defaults: Index lm-eval's built-in tasks too (~10 s; their datasets download when they run).
        bootstrap_iters: Resamples for the standard errors of the metrics that need them (0: none).
        tokenizer: A sentencepiece ``.model`` to use instead of finding the run's.
        dtype: Weight dtype for inference: ``float32`` or ``bfloat16``.
        **kwargs: More keyword arguments for ``lm_eval.simple_evaluate`` (e.g. ``log_samples``).

    Returns:
        lm-eval's results, with ``hlat`` (checkpoint, step, model, params, tokenizer) added.
    """
    by_shots = _tasks_by_shots(tasks, num_fewshot)
    kwargs.setdefault("log_samples", False)
    with _rng_preserved():
        lm = HlatLM(
            str(checkpoint),
            device=device,
            batch_size=batch_size,
            max_length=max_length,
            dtype=dtype,
            tokenizer=tokenizer,
        )
        manager = task_manager(include_defaults)
        results = _evaluate_groups(
            lm, by_shots, limit=limit, task_manager=manager, bootstrap_iters=bootstrap_iters, **kwargs
        )
    results["hlat"] = describe(lm.loaded)
    return results


def _tasks_by_shots(
    tasks: Sequence[str] | str, num_fewshot: int | Mapping[str, int] | None
) -> dict[int | None, list[str]]:
    """The task names grouped by their few-shot count (None: the task's default), in the order given."""
    names = [tasks] if isinstance(tasks, str) else list(tasks)
    shots = dict(num_fewshot) if isinstance(num_fewshot, Mapping) else dict.fromkeys(names, num_fewshot)
    by_shots: dict[int | None, list[str]] = {}
    for name in names:
        by_shots.setdefault(shots.get(name), []).append(name)
    return by_shots


def _evaluate_groups(lm: HlatLM, by_shots: Mapping[int | None, list[str]], **kwargs: Any) -> dict[str, Any]:
    """One ``simple_evaluate`` call per few-shot count on the one loaded model; their results merged."""
    from lm_eval import simple_evaluate

    results: dict[str, Any] = {}
    for n, group in by_shots.items():
        part = simple_evaluate(model=lm, tasks=group, num_fewshot=n, **kwargs)
        for key, value in (part or {}).items():  # None only on a non-zero rank of a distributed lm-eval run
            if isinstance(value, dict) and isinstance(results.get(key), dict):
                results[key].update(value)
            else:
                results.setdefault(key, value)
    return results


@contextlib.contextmanager
def _rng_preserved() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's (CPU and CUDA) random states on exit."""
    py, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(np_state)


def main(argv: Iterable[str] | None = None) -> None:
    """lm-eval's command line with the ``hlat`` model registered and the local tasks on the include path."""
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in args):
        args += ["--include_path", str(TASKS_DIR)]
    sys.argv = [sys.argv[0], *args]
    cli_evaluate()


if __name__ == "__main__":
    main()
