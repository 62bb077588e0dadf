"""Run by the main environment's python (torch 2.13, transformers, lm-eval; no torch-xla): an export against hlat.

``python -m tests.neuron.hf_check RUN_DIR EXPORT_DIR`` loads the run's newest checkpoint with hlat and the export
with transformers, and prints one JSON line: the largest logit difference on the local task's first text, and the
per-text log-likelihoods of lm-eval's own ``hf`` model and of hlat's ``hlat`` model on ``hlat_local_ppl``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main(run: Path, export: Path) -> None:
    """Print the comparison of ``export`` against the newest checkpoint of ``run`` as one JSON line."""
    import transformers

    from hlat.eval.harness import evaluate
    from hlat.eval.inference import load
    from tests.unit.test_hf_lm_eval import hf_model, loglikelihoods

    ours = load(run / "checkpoints")
    (text,) = ours.tokenizer.encode(["The checkpoint went from trn1 to a CPU."])
    ids = torch.tensor([[ours.tokenizer.eos_id, *text]])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (theirs(ids).logits - ours.model(ids)).abs().max().item()
    task = "hlat_local_ppl"
    hlat_ll = loglikelihoods(evaluate(run, [task], bootstrap_iters=0, log_samples=True, limit=4), task)
    hf_ll = loglikelihoods(hf_model(export, task, limit=4), task)
    print(json.dumps({"step": ours.step, "max_logit_diff": diff, "hlat": hlat_ll, "hf": hf_ll}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
