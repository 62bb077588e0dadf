"""Hugging Face LLaMA layout: export -> import gives back the same model; transformers computes the same logits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hlat import checkpoint
from hlat.backends.torch.backend import TorchBackend
from hlat.backends.torch.dist import _interleave_gate_up
from hlat.checkpoint import hf_layout, weights
from hlat.config import ConfigError, DataConfig, ModelConfig, OptimizerConfig, ParallelismConfig, RunConfig, TrainConfig
from hlat.data.tokenizer import Tokenizer, load_or_train_tokenizer
from hlat.eval import hf
from hlat.model import Transformer
from hlat.state import TrainState
from tests.conftest import backend_config

VOCAB = 512
# GQA with 2 query heads per kv head: the grouping of the fused qkv rows matters.
CFG = ModelConfig(
    name="hf-test",
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=96,
    vocab_size=VOCAB,
    max_seq_len=64,
    norm_eps=1e-5,
    rope_theta=500.0,
    init_std=0.02,
    scaled_init=False,
)
# Texts led by spaces too: sentencepiece's dummy prefix gives "▁▁▁" for "  x" (HF's LlamaTokenizer gave "▁▁").
TEXTS = [
    "Hello world, this is hlat.",
    "Tabs\tand  double  spaces,\nnew lines",
    "2024 naïve café 😀",
    "end space ",
    "  leading spaces",
    "    ",
    " ",
    "",
    "\n\tx",
    "</s> is text, not EOS <s>",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    """A BPE tokenizer trained by hlat's own code into a cache directory, as a run without data.tokenizer does."""
    from pydoc_data.topics import topics

    docs = [p.strip() for k in sorted(topics) for p in topics[k].split("\n\n") if len(p.strip()) >= 80][:200]
    cache = tmp_path_factory.mktemp("cache")
    return load_or_train_tokenizer(DataConfig(cache_dir=str(cache)), docs, VOCAB, cache)


def random_model(cfg: ModelConfig = CFG, dtype: torch.dtype = torch.float32) -> Transformer:
    """Random weights everywhere, norm scales included (init_weights sets them all to 1)."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    model.to(dtype)
    model.init_rope()
    return model.eval()


def run_config(tok: Tokenizer, tp: int = 1) -> dict:
    cfg = RunConfig(
        model=CFG,
        data=DataConfig(cache_dir=str(tok.path.parents[1])),
        train=TrainConfig(seq_len=32),
        optimizer=OptimizerConfig(warmup_steps=10),
        parallelism=ParallelismConfig(tp=tp),
    )
    return dataclasses.asdict(cfg)


def save_checkpoint(
    root: Path, model: Transformer, tok: Tokenizer, tp: int = 1, fingerprint: str | None = None
) -> Path:
    """A checkpoint through the real Checkpointer and TorchBackend, with the run's manifest and data state."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    extra = {"train_state": {"step": 3}, "data": {"tokenizer": fingerprint or tok.fingerprint}}
    config = run_config(tok, tp)
    backend = TorchBackend(backend_config())
    saver = checkpoint.Checkpointer(
        backend,
        root,
        model,
        opt,
        lambda s: extra,
        every=0,
        last_step=3,
        keep_last=0,
        async_save=False,
        meta={"config": config},
    )
    saver.save(TrainState(step=3))
    saver.close()
    return saver.last_saved


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def logits(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> torch.Tensor:
    model = Transformer(cfg)
    model.load_state_dict(sd)
    model.init_rope()
    with torch.no_grad():
        return model.eval()(tokens())


@pytest.fixture(scope="module")
def exported(tok, tmp_path_factory) -> tuple[Transformer, Path, Path]:
    """(model, its checkpoint, the HF export of that checkpoint)."""
    root = tmp_path_factory.mktemp("hf")
    model = random_model()
    ckpt = save_checkpoint(root / "checkpoints", model, tok)
    return model, ckpt, hf.export_hf(root / "checkpoints", root / "export")  # the root: its newest checkpoint


def test_export_then_import_gives_the_same_model(exported, tok) -> None:
    model, _, out = exported
    assert {p.name for p in out.iterdir()} == {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.model",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    cfg, sd, spm = hf_layout.import_hf(out)
    assert cfg == CFG
    assert spm == out / "tokenizer.model" and spm.read_bytes() == tok.path.read_bytes()  # found by fingerprint
    want = model.state_dict()
    assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in want)
    with torch.no_grad():
        assert torch.equal(logits(cfg, sd), model(tokens()))
    meta = json.loads((out / "config.json").read_text())
    assert meta["num_key_value_heads"] == 2 and meta["head_dim"] == 16 and meta["torch_dtype"] == "float32"
    # EOS starts a sequence: hlat packs documents as ids + [EOS] (hlat.eval.hf_tokenizer's docstring)
    assert (meta["bos_token_id"], meta["eos_token_id"]) == (tok.eos_id, tok.eos_id)
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (tok.eos_id, tok.eos_id)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    eos = tok.processor.id_to_piece(tok.eos_id)
    assert tok_cfg["add_bos_token"] is False and tok_cfg["eos_token"] == tok_cfg["bos_token"] == eos


def test_hf_names_and_splits(exported) -> None:
    """The fused weights split per kv group: q heads 2g, 2g+1 then k_g, v_g; gate_up is [gate; up]."""
    from safetensors.torch import load_file

    model, _, out = exported
    t = load_file(str(out / "model.safetensors"))
    qkv = model.layers[1].attn.qkv.weight.detach()  # rows: [q0 q1 k0 v0 q2 q3 k1 v1], 16 each
    q, k, v = (t[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(q[16:32], qkv[16:32]) and torch.equal(q[32:48], qkv[64:80])  # q1 and q2
    assert torch.equal(k[16:], qkv[96:112]) and torch.equal(v[:16], qkv[48:64])  # k1 and v0
    gate_up = model.layers[0].mlp.gate_up.weight.detach()
    assert torch.equal(t["model.layers.0.mlp.up_proj.weight"], gate_up[96:])
    assert torch.equal(t["model.layers.0.post_attention_layernorm.weight"], model.layers[0].mlp_norm.weight)
    assert len(t) == 3 + 9 * CFG.n_layers


def test_transformers_computes_the_same_logits(exported, tok) -> None:
    """The proof of the layout and of the rotary convention: HF's own LlamaForCausalLM on the exported directory."""
    transformers = pytest.importorskip("transformers")
    model, _, out = exported
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ours, want = model(tokens()), theirs(tokens()).logits
    torch.testing.assert_close(want, ours, rtol=0, atol=1e-5)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:  # the same ids as hlat's packing (no BOS), and back to the same text
        assert hf_tok(text)["input_ids"] == tok.encode([text])[0], text
        assert hf_tok.decode(tok.encode([text])[0]) == text
    assert hf_tok.bos_token_id == hf_tok.eos_token_id == tok.eos_id  # what lm-eval's hf model starts texts with
    with_bos = transformers.AutoTokenizer.from_pretrained(out, add_bos_token=True)  # lm-eval's add_bos_token=True
    assert with_bos("x")["input_ids"] == [tok.eos_id, *tok.encode(["x"])[0]]


# Pieces of text where tokenizers disagree: whitespace of every kind and length, the dummy prefix's "▁" typed in,
# code, digits (split one by one), characters outside the vocabulary (byte fallback), the control pieces as text.
SPACES = st.sampled_from([" ", "  ", "   ", "    ", "\t", "\n", "\r\n", "\u3000", "\u00a0", "▁"])
WORDS = st.sampled_from(
    [
        "the",
        "Return",
        "def f(x):",
        "__init__",
        "0",
        "2024",
        "3.14",
        "naïve",
        "😀",
        "日本語",
        "</s>",
        "<s>",
        "<unk>",
        "<0x41>",
        "x",
    ]
)
TEXT = st.one_of(
    st.text(max_size=40), st.lists(st.one_of(SPACES, WORDS, st.text(max_size=3)), max_size=20).map("".join)
)


@pytest.fixture(scope="module")
def hf_tokenizers(exported) -> tuple:
    """What transformers' AutoTokenizer loads from the export, and its tokenizer.json read by tokenizers alone."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    out = exported[2]
    return transformers.AutoTokenizer.from_pretrained(out), tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))


@settings(max_examples=300, deadline=None)
@given(text=TEXT)
def test_transformers_tokenizes_every_text_as_sentencepiece(hf_tokenizers, tok, text: str) -> None:
    auto, raw = hf_tokenizers
    ids = tok.encode([text])[0]
    assert auto(text, add_special_tokens=False).input_ids == ids
    assert auto(text).input_ids == ids  # add_bos_token is false: a plain encode is hlat's packing
    assert raw.encode(text, add_special_tokens=False).ids == ids
    assert auto.decode(ids) == tok.decode(ids)


def test_weights_only_checkpoint_round_trip(exported, tmp_path) -> None:
    model, _, out = exported
    ckpt = hf.import_hf_checkpoint(out, tmp_path / "imported")
    meta = checkpoint.manifest(ckpt)
    assert meta["weights_only"] and meta["step"] == 0 and meta["tokenizer"] == "tokenizer.model"
    assert checkpoint.problems(ckpt, checksums=True) == [] and checkpoint.latest(tmp_path) is None  # no step_*
    cfg, sd, _ = weights.load_checkpoint_weights(ckpt)
    assert cfg == CFG and all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    again = hf.export_hf(ckpt, tmp_path / "again")  # its tokenizer travels with it
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert (again / "tokenizer.model").read_bytes() == (out / "tokenizer.model").read_bytes()
    with pytest.raises(ConfigError, match="already exists"):
        hf.import_hf_checkpoint(out, tmp_path / "imported")


def test_tensor_parallel_checkpoint_gets_gate_up_back_in_order(tok, tmp_path) -> None:
    """With parallelism.tp=2 the torch backend saves gate_up as [gate_0; up_0; gate_1; up_1] (bf16 here)."""
    model = random_model(dtype=torch.bfloat16)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    for block in model.layers:
        _interleave_gate_up(block.mlp.gate_up.weight, 2)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, tok, tp=2)
    _, sd, _ = weights.load_checkpoint_weights(ckpt)
    assert all(torch.equal(sd[k], v) and sd[k].dtype == torch.bfloat16 for k, v in want.items())
    out = hf.export_hf(ckpt, tmp_path / "out", tokenizer=tok.path)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, back, _ = hf_layout.import_hf(out)
    assert torch.equal(back["layers.1.mlp.gate_up.weight"], want["layers.1.mlp.gate_up.weight"])


def _hf(**kw) -> dict:
    base = hf_layout.hf_config(CFG, torch.float32, 1, 2)
    base.pop("hlat")
    return base | kw


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "mistral"}, "model_type='mistral'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope scaling 'llama3'"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope scaling 'linear'"),
        ({"head_dim": 32}, "head_dim=32"),
        ({"tie_word_embeddings": True}, "untie_embeddings=True"),
    ],
)
def test_unsupported_hf_configs_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        hf_layout.model_config_from_hf(_hf(**change), "x")


def test_hf_config_without_hlat_keys(exported, tmp_path) -> None:
    """A config.json written by another tool: HF's fields alone, tied embeddings untied on request."""
    from safetensors.torch import load_file, save_file

    out = exported[2]

    tensors = load_file(str(out / "model.safetensors"))
    del tensors["lm_head.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # older exports saved it: ignored
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(_hf(tie_word_embeddings=True, rope_theta=500.0)))
    cfg, sd, spm = hf_layout.import_hf(tmp_path, untie_embeddings=True)
    assert cfg == dataclasses.replace(CFG, name=tmp_path.name, scaled_init=True) and spm is None
    assert torch.equal(sd["lm_head.weight"], sd["embed.weight"]) and sd["lm_head.weight"] is not sd["embed.weight"]
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"wrong shapes.*up_proj.*\(95, 64\)"):
        hf_layout.import_hf(tmp_path, untie_embeddings=True)


def test_user_errors_name_the_fix(exported, tok, tmp_path) -> None:
    _, ckpt, out = exported
    with pytest.raises(ConfigError, match="not empty"):
        hf.export_hf(ckpt, out)
    with pytest.raises(ConfigError, match="neither a checkpoint"):
        hf.export_hf(tmp_path, tmp_path / "x")
    with pytest.raises(ConfigError, match=r"no config\.json"):
        hf_layout.import_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_hf()))
    with pytest.raises(ConfigError, match="safetensors"):
        hf_layout.import_hf(tmp_path)
    other = save_checkpoint(tmp_path / "other", random_model(), tok, fingerprint="0123456789abcdef")
    with pytest.raises(ConfigError, match=r"tokenizer of .*0123456789abcdef.*--tokenizer"):
        hf.export_hf(other, tmp_path / "y")


def test_init_weights_for_a_new_run(exported, tmp_path, caplog) -> None:
    """What train.init_from loads: an HF directory, or an hlat checkpoint, checked against the run's model."""
    model, ckpt, out = exported
    want = model.state_dict()
    for source, tokenizer in ((out, out / "tokenizer.model"), (ckpt, None)):
        sd, spm = weights.load_init_weights(source, dataclasses.replace(CFG, max_seq_len=128))  # longer context: ok
        assert all(torch.equal(sd[k], v) for k, v in want.items())
        assert spm is not None and (tokenizer is None or spm == tokenizer)
    assert "model.max_seq_len=128; the weights were trained with 64" in caplog.text
    with pytest.raises(ConfigError, match=r"model\.n_kv_heads=4 but 2 there.*model\.n_kv_heads=2"):
        weights.load_init_weights(out, dataclasses.replace(CFG, n_kv_heads=None))


def test_cli(exported, tmp_path, capsys) -> None:
    _, ckpt, out = exported
    assert hf.main(["import", str(out), "--out", str(tmp_path / "imported")]) == 0
    said = capsys.readouterr().out
    assert f"train.init_from={tmp_path / 'imported'} data.tokenizer=" in said and "model.n_kv_heads=2" in said
    assert hf.main(["export", str(tmp_path / "imported"), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert hf.main(["export", str(ckpt), "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_unigram_tokenizer_is_refused(exported, tok, tmp_path) -> None:
    """HF's LlamaTokenizer is BPE: a unigram sentencepiece model would tokenize differently there."""
    from pydoc_data.topics import topics

    docs = [p.strip() for k in sorted(topics) for p in topics[k].split("\n\n") if len(p.strip()) >= 80][:200]
    cfg = DataConfig(cache_dir=str(tmp_path), tokenizer_type="unigram")
    unigram = load_or_train_tokenizer(cfg, docs, VOCAB, tmp_path)
    with pytest.raises(ConfigError, match="not a BPE sentencepiece model"):
        hf.export_hf(exported[1], tmp_path / "out", tokenizer=unigram.path)
    assert not (tmp_path / "out").exists()
