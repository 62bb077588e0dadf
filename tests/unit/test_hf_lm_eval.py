"""lm-eval's own ``hf`` model on an exported checkpoint gives hlat's numbers: the start-of-sequence convention.

hlat trains on documents packed as ``ids + [EOS]``, so its ``hlat`` lm-eval model starts every text after EOS; the
export declares EOS as the start-of-sequence token, and lm-eval's ``hf`` model (HFLM) must pick it up with no flag.
Tolerance: HF's LlamaForCausalLM gives hlat's logits to ~1e-6 in float32 (test_hf.py), so per-text
log-likelihoods (sums of 10-100 token log-probabilities) agree to ~1e-5 relative; conditioning on the wrong start
token (sentencepiece's ``<s>``, id 1, which the model never saw) moves them by ~1e-3 or more, far outside.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # lm-eval's hf model imports it (the eval extra)

from hlat.eval import hf
from hlat.eval.harness import evaluate
from hlat.eval.tasks import task_manager
from tests.conftest import run_config
from tests.unit.test_evaluate import TINY

# model.max_seq_len = train.seq_len: HFLM's context is config.json's max_position_embeddings, hlat's is the trained
# train.seq_len; equal here, so that texts longer than one window are cut into the same windows by both.
RUN = [*TINY, "model.max_seq_len=64"]
REL = 1e-5
MC_DOCS = 8  # x 4 choices


@pytest.fixture(scope="module")
def run_and_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 2-step run on a small corpus (the local tasks' texts are longer than its 64-token windows), and its export."""
    from hlat.train.run import main

    tmp = tmp_path_factory.mktemp("hflm")
    docs = [
        d
        for m in (json, Path, pytest)
        for n in dir(m)
        if isinstance(d := getattr(getattr(m, n), "__doc__", None), str) and len(d) > 40
    ]
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    main(run_config(*RUN, f"data.path={corpus}", f"data.cache_dir={tmp / 'cache'}"), run_dir=tmp / "run")
    return tmp / "run", hf.export_hf(tmp / "run" / "checkpoints", tmp / "export")


def loglikelihoods(out: dict[str, Any], task: str) -> dict[int, list[float]]:
    """Per document, the log-likelihood of each request (one per text, or one per choice)."""
    return {
        s["doc_id"]: [float(r[0]) if isinstance(r, (list, tuple)) else float(r) for r in s["filtered_resps"]]
        for s in out["samples"][task]
    }


def hf_model(export: Path, task: str, extra: str = "", limit: int | None = None) -> dict[str, Any]:
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model="hf",
        model_args=f"pretrained={export},dtype=float32{extra}",
        tasks=[task],
        device="cpu",
        batch_size=4,
        task_manager=task_manager(),
        bootstrap_iters=0,
        log_samples=True,
        limit=limit,
    )


def close(a: dict[int, list[float]], b: dict[int, list[float]], rel: float) -> bool:
    assert a.keys() == b.keys()
    return all(abs(x - y) <= rel * abs(y) for k in a for x, y in zip(a[k], b[k], strict=True))


def test_perplexity_of_the_export_is_hlats_with_no_flag(run_and_export) -> None:
    run, export = run_and_export
    ours = evaluate(run, ["hlat_local_ppl"], bootstrap_iters=0, log_samples=True)
    theirs = hf_model(export, "hlat_local_ppl")
    want = loglikelihoods(ours, "hlat_local_ppl")
    assert close(loglikelihoods(theirs, "hlat_local_ppl"), want, REL)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert theirs["results"]["hlat_local_ppl"][metric] == pytest.approx(
            ours["results"]["hlat_local_ppl"][metric], rel=REL
        )
    # The control: LLaMA's <s> (id 1) as the start token, the convention the export used to declare.
    bos = loglikelihoods(hf_model(export, "hlat_local_ppl", ",prefix_token_id=1"), "hlat_local_ppl")
    assert not close(bos, want, 10 * REL)  # ~2e-3 apart for this run


def test_multiple_choice_of_the_export_is_hlats_with_add_bos_token(run_and_export) -> None:
    """hlat's model puts EOS before a context; HFLM adds the tokenizer's BOS (EOS here) with add_bos_token=True."""
    run, export = run_and_export
    ours = evaluate(run, ["hlat_local_mc"], bootstrap_iters=0, log_samples=True, limit=MC_DOCS)
    want = loglikelihoods(ours, "hlat_local_mc")
    theirs = hf_model(export, "hlat_local_mc", ",add_bos_token=True", MC_DOCS)
    assert close(loglikelihoods(theirs, "hlat_local_mc"), want, REL)
    # Without it HFLM encodes a context with no start token at all (what the README says).
    bare = loglikelihoods(hf_model(export, "hlat_local_mc", limit=MC_DOCS), "hlat_local_mc")
    assert not close(bare, want, 10 * REL)
