"""Activation checkpointing: same numbers and names as without it, less saved, and the recomputation really runs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from hlat.backends.torch.recompute import apply_activation_checkpointing
from hlat.config import ConfigError, ModelConfig
from hlat.model import AttentionCore, Block, FeedForward, Transformer

pytestmark = pytest.mark.bitwise  # recomputed forward == the saved one, bit for bit

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=128, max_seq_len=64)
MODES = ("none", "full", "selective")


def build(mode: str, on_meta: bool = True) -> Transformer:
    """Seeded model with ``mode`` applied on the meta device (before materialization) or after ``init_weights``."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(CFG)
    if on_meta:
        apply_activation_checkpointing(model, mode)
    model.to_empty(device="cpu")
    model.init_weights()
    if not on_meta:
        apply_activation_checkpointing(model, mode)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))


def loss_of(model: Transformer, autocast: bool = False) -> torch.Tensor:
    t = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(t[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), t[:, 1:].flatten())


def loss_and_grads(model: Transformer, autocast: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = loss_of(model, autocast)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("on_meta", [True, False], ids=["before_init", "after_init"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_loss_and_every_gradient_are_bitwise_those_without_checkpointing(
    mode: str, on_meta: bool, autocast: bool
) -> None:
    ref_loss, ref_grads = loss_and_grads(build("none"), autocast)
    loss, grads = loss_and_grads(build(mode, on_meta), autocast)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert g is not None and torch.equal(g, ref_grads[name]), name
    assert all(g.abs().sum() > 0 for g in grads.values())  # the comparison is not between zeros


def test_names_are_unchanged() -> None:
    ref = build("none")
    for mode in ("full", "selective"):
        model = build(mode)
        assert list(model.state_dict()) == list(ref.state_dict())
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
        assert [n for n, _ in model.named_buffers()] == [n for n, _ in ref.named_buffers()]
    assert "layers.0.attn.qkv.weight" in ref.state_dict()


def test_the_recomputation_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Count the computations of the three module types, split into the forward and the backward pass.

    Applied twice, a mode still recomputes each module once (no checkpoint nested in another)."""
    calls: Counter[tuple[str, str]] = Counter()
    phase = ["forward"]
    for cls, method in ((Block, "compute"), (AttentionCore, "attend"), (FeedForward, "forward")):
        original = getattr(cls, method)

        def counted(self, *args, _original=original, _name=cls.__name__, **kwargs):
            calls[phase[0], _name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, method, counted)

    L = CFG.n_layers
    expected_backward = {
        "none": {},
        "full": {"Block": L, "AttentionCore": L, "FeedForward": L},
        "selective": {"AttentionCore": L},
    }
    for mode, twice in [(m, False) for m in MODES] + [("full", True), ("selective", True)]:
        model = build(mode)
        if twice:
            apply_activation_checkpointing(model, mode)
        calls.clear()
        phase[0] = "forward"
        loss = loss_of(model)
        phase[0] = "backward"
        loss.backward()
        assert {n: c for (p, n), c in calls.items() if p == "forward"} == {
            "Block": L,
            "AttentionCore": L,
            "FeedForward": L,
        }, mode
        assert {n: c for (p, n), c in calls.items() if p == "backward"} == expected_backward[mode], mode


def saved_activation_bytes(model: Transformer) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps from the forward pass for the backward pass."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(model)
    return sum(saved.values())


def test_memory_none_above_selective_above_full() -> None:
    none, full, selective = (saved_activation_bytes(build(m)) for m in MODES)
    assert none > selective > full


def test_an_unknown_mode_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"parallelism\.activation_checkpointing='attention'"):
        apply_activation_checkpointing(build("none"), "attention")
