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


def test_a_corrupt_newest_checkpoint_is_skipped_by_checksum(tmp_path: Path, caplog) -> None:
    backend, (model, opt) = TorchBackend(), model_and_opt()
    good = checkpoint.save(backend, tmp_path, model, opt, {}, 5, keep_last=0)
    bad = checkpoint.save(backend, tmp_path, model, opt, {}, 8, keep_last=0)
    data = bytearray((bad / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte: only the checksum can tell
    (bad / "state.pt").write_bytes(bytes(data))
    assert checkpoint.problems(bad) == []  # sizes still match: only the checksum can tell
    with caplog.at_level("WARNING", logger="hlat.checkpoint"):
        assert checkpoint.latest(tmp_path) == good
    assert "step_00000008" in caplog.text and "sha256" in caplog.text
    assert checkpoint.resolve(str(tmp_path)) == good
    with pytest.raises(ConfigError, match=r"damaged .*state\.pt does not match its sha256"):
        checkpoint.resolve(str(bad))  # named explicitly: refused, not silently replaced


def test_keep_every_checkpoints_survive_retention(tmp_path: Path) -> None:
    backend, (model, opt) = TorchBackend(), model_and_opt()
    for step in range(10, 70, 10):
        checkpoint.save(backend, tmp_path, model, opt, {}, step, keep_last=2, keep_every=25)
    # keep_every=25 matches no multiple of 10 below 50; 50 is kept for good, plus the newest two.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000050", "step_00000060"]
    for step in range(70, 130, 10):
        checkpoint.save(backend, tmp_path, model, opt, {}, step, keep_last=2, keep_every=50)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000050", "step_00000100", "step_00000110",
                                                         "step_00000120"]  # fmt: skip


def test_resuming_another_model_shape_is_refused_naming_the_fields(tmp_path: Path, caplog) -> None:
    backend, (model, opt) = TorchBackend(), model_and_opt()
    shape = {"name": "tiny", "dim": 256, "n_layers": 6, "init_std": 0.02}
    path = checkpoint.save(backend, tmp_path, model, opt, {}, 1, keep_last=0, meta={"model": shape})
    with pytest.raises(ConfigError, match=r"model\.dim=256 in the checkpoint but 128 now"):
        checkpoint.check_compatible(path, {**shape, "dim": 128})
    with caplog.at_level("INFO", logger="hlat.checkpoint"):
        checkpoint.check_compatible(path, {**shape, "name": "other", "init_std": 0.01})  # not a shape: allowed
    assert "model.init_std=0.02 in the checkpoint but 0.01 now" in caplog.text
