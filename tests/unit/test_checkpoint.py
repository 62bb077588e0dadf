"""Atomic (a)synchronous checkpoint directories, retention, finding the latest valid one, compatibility."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch

from hlat import checkpoint
from hlat.backends.torch.backend import TorchBackend
from hlat.checkpoint import CheckpointError
from hlat.config import ConfigError
from hlat.state import TrainState
from tests.conftest import backend_config

WEIGHTS = "__0_0.distcp"  # torch.distributed.checkpoint's data file of rank 0


def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def save(root: Path, model, opt, step: int, extra: dict | None = None, **kw) -> Path | None:
    """One checkpoint through the Checkpointer (synchronous unless async_save=True is passed)."""
    kw = {"keep_last": 0, "async_save": False, **kw}
    saver = checkpoint.Checkpointer(
        TorchBackend(backend_config()), root, model, opt, lambda s: extra or {}, every=0, last_step=step, **kw
    )
    try:
        saver.save(TrainState(step=step))
    finally:
        saver.close()
    return saver.last_saved


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip_and_retention(tmp_path: Path, async_save: bool) -> None:
    backend, (model, opt) = TorchBackend(backend_config()), model_and_opt()
    for step in (10, 20, 30):
        save(tmp_path, model, opt, step, {"train_state": {"step": step}}, keep_last=2, async_save=async_save)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000020", "step_00000030"]
    assert checkpoint.latest(tmp_path) == tmp_path / "step_00000030"
    # Killed between the manifest and the rename: a complete-looking step_40.tmp is not a checkpoint yet.
    shutil.copytree(tmp_path / "step_00000030", tmp_path / "step_00000040.tmp")
    assert checkpoint.latest(tmp_path) == tmp_path / "step_00000030"
    shutil.rmtree(tmp_path / "step_00000040.tmp")
    meta = checkpoint.manifest(tmp_path / "step_00000030")
    assert meta["step"] == 30 and set(meta["files"]) == {WEIGHTS, ".metadata", "extra.rank0.pt"}

    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    extra = backend.load(checkpoint.resolve(str(tmp_path)), fresh, fresh_opt)
    assert extra == {"train_state": {"step": 30}}
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_an_async_save_holds_the_state_of_its_step(tmp_path: Path) -> None:
    """The training tensors change right after save() returns: the checkpoint must still hold the old values."""
    model, opt = model_and_opt()
    before = model.weight.detach().clone()
    backend = TorchBackend(backend_config())
    saver = checkpoint.Checkpointer(
        backend, tmp_path, model, opt, lambda s: {}, every=0, last_step=1, keep_last=0, async_save=True
    )
    saver.save(TrainState(step=1))
    with torch.no_grad():
        model.weight.add_(1.0)
    saver.close()
    fresh = torch.nn.Linear(4, 3)
    backend = TorchBackend(backend_config())
    backend.load(tmp_path / "step_00000001", fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1))
    assert torch.equal(fresh.weight, before)


def test_incomplete_checkpoints_are_never_chosen(tmp_path: Path, caplog) -> None:
    model, opt = model_and_opt()
    good = save(tmp_path, model, opt, 5)
    torn = save(tmp_path, model, opt, 8)
    (tmp_path / "step_00000009.tmp").mkdir()  # a save that died before its rename
    with open(torn / WEIGHTS, "r+b") as f:  # a file truncated after the manifest was written
        f.truncate(10)
    with caplog.at_level("WARNING", logger="hlat.checkpoint"):
        assert checkpoint.latest(tmp_path) == good
    assert "step_00000009.tmp: an interrupted save" in caplog.text
    assert f"step_00000008: {WEIGHTS} has 10 bytes" in caplog.text


def test_resume_from_nothing_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train\.resume"):
        checkpoint.resolve(str(tmp_path / "nope"))


def test_resume_auto_never_and_path(tmp_path: Path) -> None:
    assert checkpoint.find_resume("auto", tmp_path / "empty") is None
    assert checkpoint.find_resume("never", tmp_path / "empty") is None
    model, opt = model_and_opt()
    first = save(tmp_path / "a", model, opt, 3)
    assert checkpoint.find_resume("auto", tmp_path / "a") == first
    assert checkpoint.find_resume(str(first), tmp_path / "elsewhere") == first
    with pytest.raises(ConfigError, match=r"train\.resume=never, but .* already holds step_00000003"):
        checkpoint.find_resume("never", tmp_path / "a")


def test_a_corrupt_newest_checkpoint_is_skipped_by_checksum(tmp_path: Path, caplog) -> None:
    model, opt = model_and_opt()
    good = save(tmp_path, model, opt, 5)
    bad = save(tmp_path, model, opt, 8)
    data = bytearray((bad / WEIGHTS).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte: only the checksum can tell
    (bad / WEIGHTS).write_bytes(bytes(data))
    assert checkpoint.problems(bad) == []  # sizes still match: only the checksum can tell
    with caplog.at_level("WARNING", logger="hlat.checkpoint"):
        assert checkpoint.latest(tmp_path) == good
    assert "step_00000008" in caplog.text and "sha256" in caplog.text
    assert checkpoint.resolve(str(tmp_path)) == good
    with pytest.raises(ConfigError, match=rf"damaged .*{WEIGHTS} does not match its sha256"):
        checkpoint.resolve(str(bad))  # named explicitly: refused, not silently replaced


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_is_a_clear_error_and_loses_no_checkpoint(tmp_path: Path, async_save: bool) -> None:
    model, opt = model_and_opt()
    for step in (1, 2):
        save(tmp_path, model, opt, step, keep_last=2)

    def disk_full(stage: str, step: int, path: Path) -> None:
        if stage == "written":
            (path / WEIGHTS).write_bytes(b"short")
            raise OSError(errno.ENOSPC, "No space left on device", str(path / WEIGHTS))

    with pytest.raises(
        CheckpointError,
        match=r"no space left .* step_00000003 .* earlier checkpoints are intact "
        r"\(step_00000001, step_00000002\)",
    ):
        save(tmp_path, model, opt, 3, keep_last=2, async_save=async_save, fault=disk_full)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]  # no partial left
    assert checkpoint.latest(tmp_path) == tmp_path / "step_00000002"  # and retention deleted nothing


def test_a_stale_partial_checkpoint_is_removed_when_saving_starts(tmp_path: Path, caplog) -> None:
    model, opt = model_and_opt()
    (tmp_path / "step_00000004.tmp").mkdir(parents=True)
    with caplog.at_level("WARNING", logger="hlat.checkpoint"):
        save(tmp_path, model, opt, 5)
    assert "removing the partial checkpoint" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005"]


def test_keep_every_checkpoints_survive_retention(tmp_path: Path) -> None:
    model, opt = model_and_opt()
    for step in range(10, 70, 10):
        save(tmp_path, model, opt, step, keep_last=2, keep_every=25)
    # keep_every=25 matches no multiple of 10 below 50; 50 is kept for good, plus the newest two.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000050", "step_00000060"]
    for step in range(70, 130, 10):
        save(tmp_path, model, opt, step, keep_last=2, keep_every=50)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000050",
        "step_00000100",
        "step_00000110",
        "step_00000120",
    ]


def test_an_incompatible_config_is_refused_naming_every_key(tmp_path: Path, caplog) -> None:
    model, opt = model_and_opt()
    config = {
        "model": {"name": "tiny", "dim": 256, "init_std": 0.02},
        "parallelism": {"tp": 1},
        "precision": {"param_dtype": "float32"},
        "train": {"steps": 10},
    }
    path = save(tmp_path, model, opt, 1, meta={"config": config, "config_hash": checkpoint.config_hash(config)})
    assert checkpoint.manifest(path)["config_hash"] == checkpoint.config_hash(config)
    changed = {**config, "model": {**config["model"], "dim": 128}, "precision": {"param_dtype": "bfloat16"}}
    with pytest.raises(ConfigError) as e:
        checkpoint.check_compatible(path, changed)
    assert "model.dim=256 in the checkpoint but 128 now" in str(e.value)
    assert "precision.param_dtype='float32' in the checkpoint but 'bfloat16' now (the weights" in str(e.value)
    with caplog.at_level("INFO", logger="hlat.checkpoint"):  # not a shape or layout: allowed, and logged
        changed = checkpoint.check_compatible(
            path, {**config, "model": {**config["model"], "name": "x", "init_std": 0.01}, "train": {"steps": 20}}
        )
    assert "model.init_std=0.02 in the checkpoint but 0.01 now" in caplog.text
    assert "train.steps=10 in the checkpoint but 20 now" in caplog.text
    assert changed == {"model.init_std": "0.02 -> 0.01", "train.steps": "10 -> 20"}  # the restart.changed.* tags


def test_layout_and_precision_changes_are_loaded_where_defined_and_refused_naming_the_key(
    tmp_path: Path, caplog
) -> None:
    """The torch backend reshards a TP change and starts fp32 masters from bf16 weights; the neuron backend's
    checkpoints are rewritten by hlat for a TP change; no backend drops master weights, changes the parameter dtype or
    loads the other backend's files."""
    model, opt = model_and_opt()
    config = {
        "cluster": {"backend": "torch"},
        "train": {"global_batch_size": 16},
        "parallelism": {"tp": 2, "zero1": False},
        "precision": {"param_dtype": "bfloat16", "master_weights": False},
    }
    torch_ckpt = save(tmp_path / "torch", model, opt, 1, meta={"config": config})
    with caplog.at_level("INFO", logger="hlat.checkpoint"):
        changed = checkpoint.check_compatible(
            torch_ckpt,
            {
                **config,
                "parallelism": {"tp": 1, "zero1": True},
                "precision": {**config["precision"], "master_weights": True},
            },
        )
    assert changed == {
        "parallelism.tp": "2 -> 1",
        "parallelism.zero1": "False -> True",
        "precision.master_weights": "False -> True",
    }
    assert "parallelism.tp=2 in the checkpoint but 1 now: the weights and AdamW state are resharded" in caplog.text
    assert "master_weights=False in the checkpoint but True now: the fp32 master weights start as" in caplog.text

    masters = save(
        tmp_path / "masters", model, opt, 1, meta={"config": {**config, "precision": {"master_weights": True}}}
    )
    with pytest.raises(ConfigError) as e:
        checkpoint.check_compatible(masters, {**config, "precision": {"master_weights": False}})
    assert "precision.master_weights=True in the checkpoint but False now (" in str(e.value)
    assert f"train.init_from={masters}" in str(e.value) and "\n" not in str(e.value)  # one line, with the fixes

    with pytest.raises(ConfigError, match=r"train\.global_batch_size=16 in the checkpoint but 32 now \(the data"):
        checkpoint.check_compatible(torch_ckpt, {**config, "train": {"global_batch_size": 32}})  # before building

    neuron = {**config, "cluster": {"backend": "neuron"}}
    neuron_ckpt = save(tmp_path / "neuron", model, opt, 1, meta={"config": neuron})
    with caplog.at_level("INFO", logger="hlat.checkpoint"):
        checkpoint.check_compatible(neuron_ckpt, {**neuron, "parallelism": {"tp": 1, "zero1": False}})
    assert "parallelism.tp=2 in the checkpoint but 1 now: hlat rewrites the xser files" in caplog.text
    with pytest.raises(ConfigError, match=r"written by the neuron backend and this run is on the torch backend"):
        checkpoint.check_compatible(neuron_ckpt, config)  # each backend loads its own files: convert first


def test_disk_space_is_checked_before_work(tmp_path: Path) -> None:
    checkpoint.check_disk_space(tmp_path / "not" / "yet", 1)
    with pytest.raises(ConfigError, match=r"train\.checkpoint_dir=.*GiB free, but one checkpoint needs"):
        checkpoint.check_disk_space(tmp_path, 1 << 60)


def test_job_record_round_trip(tmp_path: Path) -> None:
    assert checkpoint.read_job(tmp_path / "nothing") == {}
    checkpoint.write_job(tmp_path / "ck", {"mlflow_run_id": "abc", "uptime": {"start": 1.0}})
    assert checkpoint.read_job(tmp_path / "ck") == {"mlflow_run_id": "abc", "uptime": {"start": 1.0}}


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_inside_the_dcp_writer_is_recognised(tmp_path: Path, monkeypatch, async_save: bool) -> None:
    """DCP wraps the writer's OSError in its CheckpointException (a BaseException): still a clear disk-full error."""
    import torch.distributed.checkpoint.filesystem as fs

    model, opt = model_and_opt()
    save(tmp_path, model, opt, 1)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs, "_write_item", full)
    with pytest.raises(CheckpointError, match=r"no space left on the device writing checkpoint step_00000002"):
        save(tmp_path, model, opt, 2, async_save=async_save)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    assert checkpoint.problems(tmp_path / "step_00000001", checksums=True) == []


def test_other_write_failures_name_the_cause_and_what_is_intact(tmp_path: Path, monkeypatch) -> None:
    import torch.distributed.checkpoint.filesystem as fs

    model, opt = model_and_opt()
    save(tmp_path, model, opt, 1)
    monkeypatch.setattr(fs, "_write_item", lambda *a, **k: (_ for _ in ()).throw(PermissionError(13, "denied")))
    with pytest.raises(
        CheckpointError,
        match=r"writing checkpoint step_00000002 failed .*denied.*earlier "
        r"checkpoints are intact \(step_00000001\)",
    ):
        save(tmp_path, model, opt, 2)
