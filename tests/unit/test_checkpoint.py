"""Atomic checkpoint directories, retention, and finding the latest complete one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hlat import checkpoint
from hlat.backends.torch import TorchBackend
from hlat.config import ConfigError


def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_round_trip_and_retention(tmp_path: Path) -> None:
    backend, (model, opt) = TorchBackend(), model_and_opt()
    for step in (10, 20, 30):
        checkpoint.save(backend, tmp_path, model, opt, {"train_state": {"step": step}}, step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000020", "step_00000030"]
    assert checkpoint.latest(tmp_path) == tmp_path / "step_00000030"

    fresh, fresh_opt = torch.nn.Linear(4, 3), torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=0.1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    extra = backend.load(checkpoint.resolve(str(tmp_path)), fresh, fresh_opt)
    assert extra == {"train_state": {"step": 30}}
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_incomplete_checkpoints_are_never_chosen(tmp_path: Path) -> None:
    backend, (model, opt) = TorchBackend(), model_and_opt()
    good = checkpoint.save(backend, tmp_path, model, opt, {}, 5, keep_last=0)
    (tmp_path / "step_00000009.tmp").mkdir()  # a save that died before its rename
    torn = checkpoint.save(backend, tmp_path, model, opt, {}, 8, keep_last=0)
    with open(torn / "state.pt", "r+b") as f:  # a file truncated after the manifest was written
        f.truncate(10)
    assert checkpoint.latest(tmp_path) == good


def test_resume_from_nothing_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train\.resume"):
        checkpoint.resolve(str(tmp_path / "nope"))
