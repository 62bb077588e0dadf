"""What the leaky model really learned: its loss on held-out text with its own mask and with a causal one.

    python experiments/information_leak/held_out.py multirun/information_leak/<date>/<time>

Loads the newest checkpoint of each job of the ``information_leak`` sweep and scores hlat's 20 held-out passages
(``src/hlat/eval/tasks/hlat_local_ppl.jsonl``: none occurs in the builtin corpus) twice: with the attention the
model trained with (``model.mask_leak`` as in its run) and with causal attention (what generation, and any real
use, can offer: the next token is not there yet). Then each model continues a few prompts greedily (KV-cache
decoding is causal). Prints a markdown report; ``--out`` writes it to a file too.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from hlat.eval.inference import greedy, load
from hlat.eval.tasks import TASKS_DIR

PROMPTS = ("Return a new", "If the argument is", "This module provides")


def set_leak(model: torch.nn.Module, leak: int) -> None:
    """Give every attention core ``leak`` future positions (0: causal)."""
    for module in model.modules():
        if hasattr(module, "leak"):
            module.leak = leak


@torch.inference_mode()
def held_out_loss(model: torch.nn.Module, docs: list[list[int]]) -> float:
    """Mean next-token cross-entropy (nats per token) over ``docs``, each scored as one sequence."""
    total, count = 0.0, 0
    for ids in docs:
        tokens = torch.tensor([ids])
        logits = model(tokens[:, :-1])  # (1, T-1, V)
        total += F.cross_entropy(logits[0].float(), tokens[0, 1:], reduction="sum").item()
        count += len(ids) - 1
    return total / count


def main() -> None:
    """Score the sweep's leaky and causal models on held-out text and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep_dir", type=Path, help="the sweep directory, multirun/information_leak/<date>/<time>")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    jobs = sorted(p.parent for p in args.sweep_dir.glob("*/checkpoints"))
    if not jobs:
        raise SystemExit(f"no job with checkpoints under {args.sweep_dir}: run the sweep first (see README.md)")
    passages = [json.loads(line)["text"] for line in (TASKS_DIR / "hlat_local_ppl.jsonl").read_text().splitlines()]
    rows, samples = [], []
    for job in jobs:
        loaded = load(job / "checkpoints")
        model, tok, leak = loaded.model, loaded.tokenizer, loaded.config.model.mask_leak
        docs = [[tok.eos_id, *ids, tok.eos_id] for ids in tok.encode(passages)]  # EOS-framed, as in training
        set_leak(model, leak)
        own = held_out_loss(model, docs)
        set_leak(model, 0)
        causal = held_out_loss(model, docs)
        rows.append(
            f"| {job.name} | {leak} | {loaded.step} | {own:.3f} | {math.exp(own):,.1f} | {causal:.3f} | "
            f"{math.exp(causal):,.1f} |"
        )
        for prompt in PROMPTS:
            ids = tok.encode([prompt])[0]
            new = greedy(model, [tok.eos_id, *ids], max_new_tokens=16, eos_id=tok.eos_id)
            text = tok.decode([i for i in new if i != tok.eos_id]).replace("|", "\\|").replace("\n", " ")
            samples.append(f"| {job.name} (mask_leak={leak}) | `{prompt}` | {text} |")
    report = "\n".join(
        [
            f"Held-out text ({len(passages)} passages, `hlat_local_ppl`), sweep `{args.sweep_dir}`:",
            "",
            "| job | model.mask_leak | step | loss, own mask | perplexity, own mask "
            "| loss, causal | perplexity, causal |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "Greedy continuations (decoding is causal: the next token does not exist yet):",
            "",
            "| model | prompt | continuation |",
            "|---|---|---|",
            *samples,
        ]
    )
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
