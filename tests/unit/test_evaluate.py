"""lm-eval on hlat checkpoints: the KV cache against full forwards, HlatLM against hand-computed log-likelihoods,
the local tasks end to end, and clear errors for checkpoints that cannot be evaluated."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hlat.attention import AttentionCore
from hlat.config import ConfigError, ModelConfig
from hlat.model import Transformer

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from hlat.eval.harness import HlatLM, evaluate  # noqa: E402
from hlat.eval.inference import greedy, greedy_batch, load  # noqa: E402
from hlat.eval.kv_cache import decode, new_cache  # noqa: E402
from hlat.eval.tasks import TASKS, task_manager  # noqa: E402
from tests.conftest import run_config  # noqa: E402
from tests.timeouts import hang_guard  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.n_layers=2",
    "model.dim=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "model.vocab_size=384",
    "model.max_seq_len=256",
    "train.seq_len=64",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "train.steps=2",
    "optimizer.warmup_steps=1",
    "tracker=console",
    "tracker.plots=false",
    "data.worker=none",
    "train.async_checkpoint=false",
    "health=off",
]
TEXT = "Return the number of items in the container. Raise ValueError if the argument is negative."


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step run of a 120k-parameter model on a small JSONL corpus, through run.main (real checkpoint path)."""
    from hlat.train.run import main

    tmp = tmp_path_factory.mktemp("evalrun")
    docs = [
        d
        for m in (os, json, shutil, subprocess)
        for n in dir(m)
        if isinstance(d := getattr(getattr(m, n), "__doc__", None), str) and len(d) > 40
    ]
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = run_config(*TINY, f"data.path={corpus}", f"data.cache_dir={tmp / 'cache'}")
    main(cfg, run_dir=tmp / "run")
    return tmp / "run"


@pytest.fixture(scope="module")
def lm(run_dir: Path) -> HlatLM:
    return HlatLM(str(run_dir / "checkpoints"), batch_size=3)


def small_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(
        ModelConfig(
            dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=50, max_seq_len=64, init_std=0.2
        )
    )
    model.init_weights()
    return model.eval()


# --- the KV cache ------------------------------------------------------------------------------------------------


@pytest.mark.bitwise  # a prefill from position 0 is the training forward, bit for bit
@torch.no_grad()
def test_cached_decoding_matches_full_forwards() -> None:
    model = small_model()
    tokens = torch.randint(0, 50, (2, 20))
    full = model(tokens)  # (2, 20, V): the training path
    cache = new_cache(model, 32)
    prefill = decode(model, tokens[:, :8], cache)
    assert torch.equal(prefill, model(tokens[:, :8]))  # from position 0: the very same causal kernel as training
    torch.testing.assert_close(prefill, full[:, :8], atol=1e-5, rtol=0)
    chunk = decode(model, tokens[:, 8:12], cache)  # several new positions after cached ones: the explicit mask
    torch.testing.assert_close(chunk, full[:, 8:12], atol=1e-5, rtol=0)
    for t in range(12, 20):  # one position at a time
        torch.testing.assert_close(decode(model, tokens[:, t : t + 1], cache), full[:, t : t + 1], atol=1e-5, rtol=0)
    assert cache.pos == 20
    cache.reset()
    assert cache.pos == 0 and torch.equal(decode(model, tokens[:, :5], cache), model(tokens[:, :5]))


def test_cache_limits_are_clear_errors() -> None:
    model = small_model()
    cache = new_cache(model, 8)
    with torch.no_grad():
        decode(model, torch.zeros(1, 6, dtype=torch.long), cache)
        with pytest.raises(ValueError, match="holds 8 positions"):
            decode(model, torch.zeros(1, 3, dtype=torch.long), cache)
        # the error came from inside decode's swap of the attention cores: the model is back as it was
        assert all(type(layer.attn.core) is AttentionCore for layer in model.layers)
        with pytest.raises(ValueError, match="max_seq_len"):
            decode(model, torch.zeros(1, 65, dtype=torch.long), new_cache(model, 100))


def test_greedy_with_and_without_cache_agree() -> None:
    model = small_model(seed=1)
    prompt = [3, 14, 15, 9, 2, 6]
    cached = greedy(model, prompt, 25)
    assert cached == greedy(model, prompt, 25, use_cache=False)
    assert len(cached) == 25 and len(set(cached)) > 1  # a real sequence, not one token repeated
    assert greedy(model, prompt, 25, eos_id=cached[4]) == cached[:5]  # stops after EOS, which it keeps
    assert greedy(model, prompt, 25, stop=lambda new: len(new) == 3) == cached[:3]


def test_batched_greedy_matches_one_prompt_at_a_time() -> None:
    model = small_model(seed=1)
    prompts = [[3, 14, 15, 9, 2, 6], [33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42, 8, 30]]
    alone = [greedy(model, p, 20) for p in prompts]
    assert greedy_batch(model, prompts, 20) == alone
    assert all(len(set(a)) > 1 for a in alone)  # real sequences, not one token repeated
    # EOS ends a row (kept, as greedy keeps it) while the others go on; the ones that never meet it run to the end.
    eos = alone[0][3]
    want = [greedy(model, p, 20, eos_id=eos) for p in prompts]
    assert greedy_batch(model, prompts, 20, eos_id=eos) == want
    assert want[0] == alone[0][:4] and any(len(w) == 20 for w in want)
    # A per-row stop condition, and a reused cache (sized for the batch, reset first).
    cache = new_cache(model, 40)
    got = greedy_batch(model, prompts, 20, stop=lambda row, new: len(new) == row + 2, cache=cache)
    assert got == [a[: i + 2] for i, a in enumerate(alone)]
    assert greedy_batch(model, prompts[1:2], 5, cache=cache) == [alone[1][:5]]
    assert greedy_batch(model, [], 5) == []


# --- HlatLM against hand-computed log-probabilities --------------------------------------------------------------


def logprob_by_hand(model: Transformer, ids: list[int], n_scored: int) -> tuple[float, bool]:
    """Sum of log p(ids[i] | ids[:i]) over the last ``n_scored`` tokens, and whether each is the argmax."""
    with torch.no_grad():
        lp = F.log_softmax(model(torch.tensor([ids[:-1]]))[0].float(), dim=-1)  # (T-1, V): predicts ids[1:]
    target = torch.tensor(ids[1:])
    lp, target = lp[-n_scored:], target[-n_scored:]
    return float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


def test_loglikelihood_equals_a_direct_forward_pass(lm: HlatLM) -> None:
    pairs = [
        ("Return the number", " of items."),
        ("Raise ValueError if the argument is", " negative."),
        ("x", " y"),
        ("Open the file and return a corresponding file", " object."),
        ("", "Return True."),
        (TEXT * 4, " The end."),
    ]  # the last one is cut to max_length
    reqs = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    eos = lm.tok.eos_id
    for (ctx, cont), (ll, is_greedy) in zip(pairs, got, strict=True):
        ctx_ids = [eos, *lm.tok.encode([ctx])[0]] if ctx else [eos]
        whole = [eos, *lm.tok.encode([ctx + cont])[0]]
        n_cont = len(whole) - len(ctx_ids)
        want_ll, want_greedy = logprob_by_hand(lm.model, whole[-(lm.max_length + 1) :], n_cont)
        assert ll == pytest.approx(want_ll, abs=1e-4) and is_greedy == want_greedy
        assert ll < 0


def test_rolling_loglikelihood_is_the_whole_text_likelihood(lm: HlatLM) -> None:
    ids = lm.tok.encode([TEXT])[0]
    assert len(ids) < lm.max_length
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (TEXT,), 0)], disable_tqdm=True)
    want, _ = logprob_by_hand(lm.model, [lm.tok.eos_id, *ids], len(ids))
    assert got == pytest.approx(want, abs=1e-4)
    # Longer than one window: the first window predicts max_length tokens after EOS, each later one the next
    # max_length tokens after the one token before them (lm-eval's disjoint windows with context_len=1).
    long = " ".join([TEXT] * 5)
    ids, L = lm.tok.encode([long])[0], lm.max_length
    assert len(ids) > 2 * L
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (long,), 0)], disable_tqdm=True)
    want = logprob_by_hand(lm.model, [lm.tok.eos_id, *ids[:L]], L)[0]
    for start in range(L, len(ids), L):
        end = min(start + L, len(ids))
        want += logprob_by_hand(lm.model, ids[end - L - 1 : end], end - start)[0]
    assert got == pytest.approx(want, abs=1e-3)


def test_generate_until_is_greedy_and_cut_at_the_stop_string(lm: HlatLM) -> None:
    ctx, eos = "Return the number of", lm.tok.eos_id
    ids = lm.tok_encode(ctx)
    new = greedy(lm.model, ids, 12, eos_id=eos, use_cache=False)  # the uncached reference
    new = new[:-1] if new[-1] == eos else new
    full = lm.tok.decode(ids[-1:] + new)[len(lm.tok.decode(ids[-1:])) :]
    (text,) = lm.generate_until([Instance("generate_until", {}, (ctx, {"until": ["\n"], "max_gen_toks": 12}), 0)])
    assert text == full.split("\n")[0]
    visible = full.replace(" ", "")
    assert len(visible) >= 2, full  # else the stop test below could not fail
    stop = visible[1]
    (cut,) = lm.generate_until([Instance("generate_until", {}, (ctx, {"until": [stop], "max_gen_toks": 12}), 0)])
    assert cut == full.split(stop)[0] and len(cut) < len(full)


def test_batched_generate_until_equals_one_at_a_time(lm: HlatLM) -> None:
    contexts = [
        "Return the number of",
        "Raise",
        "Return the number of items in the container. Raise ValueError if",
        "the argument",
        "items",
        "Return",
    ]
    kwargs = [{"until": ["\n"], "max_gen_toks": 10}, {"until": ["e"], "max_gen_toks": 7}]
    reqs = [Instance("generate_until", {}, (c, kwargs[i % 2]), i) for i, c in enumerate(contexts)]
    assert lm.batch_size == 3
    batched = lm.generate_until(reqs)
    lm.batch_size = 1
    try:
        single = lm.generate_until(reqs)
    finally:
        lm.batch_size = 3
    assert batched == single
    assert len(set(batched)) > 1  # the requests really differ


# --- lm-eval end to end -----------------------------------------------------------------------------------------


def test_evaluate_runs_every_local_task(run_dir: Path) -> None:
    torch.manual_seed(7)
    random.seed(7)
    before = torch.get_rng_state(), random.getstate()
    out = evaluate(run_dir, ["hlat_local"], batch_size=8)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]  # lm-eval seeds them
    res = out["results"]
    assert set(TASKS) <= set(res)
    assert 0 <= res["hlat_local_mc"]["acc,none"] <= 1 and 0 <= res["hlat_local_mc"]["acc_norm,none"] <= 1
    assert res["hlat_local_mc"]["sample_len"] == 30
    ppl = res["hlat_local_ppl"]
    assert ppl["sample_len"] == 20 and 1 < ppl["byte_perplexity,none"] < 384 and ppl["bits_per_byte,none"] > 0
    assert math.isfinite(ppl["word_perplexity,none"])
    assert 0 <= res["hlat_local_gen"]["exact_match,none"] <= 1 and res["hlat_local_gen"]["sample_len"] == 12
    assert out["hlat"]["step"] == 2 and out["hlat"]["checkpoint"].endswith("step_00000002")


def test_lm_eval_finds_the_model_by_name(run_dir: Path) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model, model_registry

    assert get_model("hlat") is HlatLM and "hf" in model_registry  # lm-eval's own models stay registered
    out = simple_evaluate(
        model="hlat",
        model_args=f"checkpoint={run_dir / 'checkpoints'},max_length=60",
        tasks=["hlat_local_mc"],
        limit=4,
        device="cpu",
        batch_size=2,
        task_manager=task_manager(),
        bootstrap_iters=0,
    )
    assert out["results"]["hlat_local_mc"]["sample_len"] == 4


def test_shots_per_task(run_dir: Path) -> None:
    out = evaluate(
        run_dir, ["hlat_local_mc", "hlat_local_gen"], num_fewshot={"hlat_local_mc": 2}, limit=3, bootstrap_iters=0
    )
    assert out["n-shot"] == {"hlat_local_mc": 2, "hlat_local_gen": 0}
    assert {"hlat_local_mc", "hlat_local_gen"} <= set(out["results"]) and "hlat" in out


@pytest.mark.slow
def test_command_line(run_dir: Path, tmp_path: Path) -> None:
    # lm-eval's CLI indexes its ~15k built-in task YAMLs first: ~10-20 s.
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hlat.eval.harness",
            "--model",
            "hlat",
            "--model_args",
            f"checkpoint={run_dir}",
            "--tasks",
            "hlat_local",
            "--device",
            "cpu",
            "--limit",
            "2",
            "--output_path",
            str(tmp_path / "out"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_guard(900),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hlat_local_mc" in proc.stdout and "bits_per_byte" in proc.stdout
    (result,) = (tmp_path / "out").rglob("results_*.json")
    assert set(TASKS) <= set(json.loads(result.read_text())["results"])


# --- loading ---------------------------------------------------------------------------------------------------


def test_weights_load_exactly_and_in_bf16(run_dir: Path) -> None:
    loaded = load(run_dir)
    assert loaded.step == 2 and loaded.tokenizer.vocab_size == 384
    assert all(not p.requires_grad for p in loaded.model.parameters())
    bf16 = load(run_dir / "checkpoints" / "step_00000002", dtype="bfloat16")
    for (name, p), q in zip(loaded.model.named_parameters(), bf16.model.parameters(), strict=True):
        assert q.dtype == torch.bfloat16 and torch.equal(p.bfloat16(), q), name
    assert bf16.model.rope_cos.dtype == torch.float32


def test_bad_checkpoints_are_clear_errors(run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        load(tmp_path)
    step = run_dir / "checkpoints" / "step_00000002"
    damaged = tmp_path / "damaged" / "step_00000002"
    shutil.copytree(step, damaged)
    (damaged / "__0_0.distcp").write_bytes(b"\0" * (damaged / "__0_0.distcp").stat().st_size)
    with pytest.raises(ConfigError, match="damaged"):
        load(damaged)
    neuron = tmp_path / "neuron" / "step_00000002"
    neuron.mkdir(parents=True)
    meta = json.loads((step / "manifest.json").read_text())
    meta["config"]["cluster"]["backend"] = "neuron"
    (neuron / "manifest.json").write_text(json.dumps({**meta, "files": {}}))
    with pytest.raises(ConfigError, match="not an NxD xser checkpoint"):
        load(neuron.parent)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            load(step, device="cuda")


def test_the_tokenizer_must_be_the_runs(run_dir: Path, tmp_path: Path) -> None:
    from hlat import checkpoint

    step = tmp_path / "step_00000002"
    shutil.copytree(run_dir / "checkpoints" / "step_00000002", step)
    extra = torch.load(step / "extra.rank0.pt", weights_only=True)
    extra["data"]["tokenizer"] = "0123456789abcdef"  # as if the run had trained another tokenizer
    torch.save(extra, step / "extra.rank0.pt")
    meta = json.loads((step / "manifest.json").read_text())
    meta["files"]["extra.rank0.pt"] = {
        "size": (step / "extra.rank0.pt").stat().st_size,
        "sha256": checkpoint.sha256(step / "extra.rank0.pt"),
    }
    (step / "manifest.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="not the one the run trained with"):
        load(step)
    tok = load(run_dir).tokenizer.path
    assert load(step, tokenizer=str(tok)).tokenizer.path == tok  # an explicit tokenizer wins (with a warning)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(lm: HlatLM, run_dir: Path) -> None:
    gpu = HlatLM(str(run_dir), device="cuda", batch_size=3)
    assert gpu.model.embed.weight.is_cuda
    reqs = [
        Instance("loglikelihood", {}, ("Return the number", " of items."), 0),
        Instance("loglikelihood", {}, ("Raise ValueError if the argument is", " negative."), 1),
    ]
    for (a, _), (b, _) in zip(lm.loglikelihood(reqs), gpu.loglikelihood(reqs), strict=True):
        assert a == pytest.approx(b, abs=1e-3)
    prompt = gpu.tok_encode("Return the number of")
    assert greedy(gpu.model, prompt, 16) == greedy(gpu.model, prompt, 16, use_cache=False)


def save_weights(step: Path, state: dict[str, torch.Tensor], meta: dict) -> None:
    """A checkpoint directory holding ``state`` as DCP ``{"model": ...}`` and ``meta`` as its manifest."""
    import torch.distributed.checkpoint as dcp

    step.mkdir(parents=True)
    with pytest.warns(UserWarning, match="torch.distributed"):
        dcp.save({"model": state}, checkpoint_id=step, no_dist=True)
    (step / "manifest.json").write_text(json.dumps({"step": 0, "files": {}, **meta}))


def test_tensor_parallel_gate_up_layout_is_undone(run_dir: Path, tmp_path: Path) -> None:
    from hlat.backends.torch.dist import _interleave_gate_up

    ref = load(run_dir)
    state = {k: v.clone() for k, v in ref.model.state_dict().items()}
    for i in range(ref.config.model.n_layers):
        _interleave_gate_up(state[f"layers.{i}.mlp.gate_up.weight"], 2)  # what the torch backend saves under tp=2
    meta = json.loads((ref.path / "manifest.json").read_text())
    meta["config"]["parallelism"]["tp"] = 2
    save_weights(tmp_path / "step_00000002", state, {"config": meta["config"]})
    shutil.copy(ref.path / "extra.rank0.pt", tmp_path / "step_00000002")
    got = load(tmp_path).model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in ref.model.state_dict().items())


def test_weights_only_checkpoints_bring_their_tokenizer(run_dir: Path, tmp_path: Path, lm: HlatLM) -> None:
    meta = {
        "config": {"model": json.loads((lm.loaded.path / "manifest.json").read_text())["config"]["model"]},
        "weights_only": True,
    }
    save_weights(tmp_path / "bare", lm.model.state_dict(), meta)
    with pytest.raises(ConfigError, match="pass tokenizer="):
        load(tmp_path / "bare")
    assert load(tmp_path / "bare", tokenizer=str(lm.tok.path)).config is None
    save_weights(tmp_path / "imported", lm.model.state_dict(), {**meta, "tokenizer": "tokenizer.model"})
    shutil.copy(lm.tok.path, tmp_path / "imported" / "tokenizer.model")
    other = HlatLM(str(tmp_path / "imported"), max_length=lm.max_length)
    assert other.loaded.context_len == lm.model.cfg.max_seq_len and other.tok.fingerprint == lm.tok.fingerprint
    req = [Instance("loglikelihood", {}, ("Return the number", " of items."), 0)]
    assert other.loglikelihood(req, disable_tqdm=True) == lm.loglikelihood(req, disable_tqdm=True)


@pytest.mark.parametrize("policy", ["native", "emulated"])
def test_bf16_inference_runs_the_hosts_bf16_matmul_policy(run_dir: Path, monkeypatch, policy: str) -> None:
    """``dtype=bfloat16`` evaluation multiplies as training does on this host (``precision.bf16_matmul=auto``), and
    both policies score a text alike (within bf16 rounding of the fp32 model's logits)."""
    from hlat.backends.torch import bf16_matmul
    from hlat.backends.torch.bf16_matmul import emulated_linear
    from hlat.checkpoint.weights import find_checkpoint, model_config
    from hlat.eval.inference import load_weights

    monkeypatch.setattr(bf16_matmul, "resolve_policy", lambda requested, device, cache_dir: (policy, "test"))
    path = find_checkpoint(run_dir / "checkpoints")
    cfg = model_config(path)
    bf16, fp32 = load_weights(path, cfg, dtype="bfloat16"), load_weights(path, cfg)
    assert (bf16.lm_head.linear is emulated_linear) is (policy == "emulated")
    tokens = torch.arange(1, 33)[None] % cfg.vocab_size
    with torch.no_grad():
        got, ref = bf16(tokens).float(), fp32(tokens)
    assert float((got - ref).norm() / ref.norm()) < 2**-5


def test_scores_go_to_the_training_run_a_checkpoint_records_or_to_a_finished_run_of_their_own(tmp_path: Path) -> None:
    """A converted or copied checkpoint has no job.json: its own record names the training run. A run the sink had
    to create is ended (it was left RUNNING in the MLflow UI); the training run is left as training left it."""
    from mlflow import MlflowClient

    from hlat import checkpoint
    from hlat.eval.run import MlflowSink, training_run_id

    ckpt = tmp_path / "copy" / "step_00000002"
    ckpt.mkdir(parents=True)
    assert training_run_id(ckpt) is None
    torch.save({"job": {"mlflow_run_id": "from-extra"}}, ckpt / "extra.rank0.pt")
    assert training_run_id(ckpt) == "from-extra"
    checkpoint.write_job(ckpt.parent, {"mlflow_run_id": "from-job"})
    assert training_run_id(ckpt) == "from-job"

    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(tracking_uri=uri)
    trained = client.create_run(client.create_experiment("e")).info.run_id
    for train_run, status in ((trained, "RUNNING"), ("not-in-this-store", "FINISHED")):
        sink = MlflowSink(uri, "e", train_run)
        run_id = sink.run_id(ckpt)
        sink.close()
        assert (run_id == trained) == (train_run == trained)
        assert client.get_run(run_id).info.status == status
