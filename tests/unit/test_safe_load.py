"""Nothing read from a checkpoint directory may run code (issue 21): hlat.safe_load and the places that use it."""

from __future__ import annotations

import contextlib
import enum
import hashlib
import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict

from hlat import safe_load
from hlat.config import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class OpensAFile:
    """Unpickling it creates ``path`` (what a crafted checkpoint would do with something worse)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


class RunsAShellCommand:
    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def model_and_optimizer(dtype: torch.dtype, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False)).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1), betas=(0.9, 0.95))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return model, optimizer


def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": get_state_dict(model, optimizer)[1]}


def save(sd: dict, path: Path) -> Path:
    dcp.save(sd, checkpoint_id=path, no_dist=True)
    return path


def assert_equal(a: object, b: object) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b)
        for k in a:
            assert_equal(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_real_checkpoint_loads_through_the_safe_reader_with_equal_values(tmp_path: Path, dtype) -> None:
    saved = state(*model_and_optimizer(dtype, seed=0))
    path = save(saved, tmp_path / "ckpt")
    into = state(*model_and_optimizer(dtype, seed=1))  # other values, same layout
    assert not torch.equal(into["model"]["0.weight"], saved["model"]["0.weight"])
    safe_load.load(into, path, no_dist=True)
    assert_equal(saved, into)  # tensors, AdamW moments and step, param_groups (the non-tensor items)
    assert into["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)

    again = state(*model_and_optimizer(dtype, seed=2))  # the reader and planner as DCP plug-ins
    dcp.load(
        again, storage_reader=safe_load.SafeFileSystemReader(path), planner=safe_load.SafeLoadPlanner(), no_dist=True
    )
    assert_equal(saved, again)


def test_the_allowed_globals_cover_exactly_what_dcp_writes(tmp_path: Path) -> None:
    # How ALLOWED_GLOBALS was derived: every global the .metadata pickles of real saves reference.
    seen: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            seen.add((module, name))
            return super().find_class(module, name)

    for i, dtype in enumerate((torch.float32, torch.bfloat16)):
        sd = state(*model_and_optimizer(dtype, seed=0)) | {"extra": {"i64": torch.arange(3), "flag": True}}
        Recording(io.BytesIO((save(sd, tmp_path / str(i)) / ".metadata").read_bytes())).load()
    assert all(safe_load.allowed_global(m, n) for m, n in seen), seen
    dtypes = {("torch", "float32"), ("torch", "bfloat16"), ("torch", "int64"), ("torch", "bool")}
    assert seen - dtypes <= safe_load.ALLOWED_GLOBALS
    assert {("torch.distributed.checkpoint.metadata", "Metadata"), ("torch", "Size")} <= seen


@pytest.mark.parametrize("payload", [OpensAFile, RunsAShellCommand])
def test_a_planted_metadata_file_is_refused_without_running_it(tmp_path: Path, payload: type) -> None:
    path = save(state(*model_and_optimizer(torch.float32, seed=0)), tmp_path / "ckpt")
    marker = tmp_path / "marker"
    (path / ".metadata").write_bytes(pickle.dumps(payload(marker)))
    into = state(*model_and_optimizer(torch.float32, seed=1))

    for attempt in (lambda: safe_load.load(into, path, no_dist=True), lambda: safe_load.read_metadata(path)):
        with pytest.raises(ConfigError) as err:
            attempt()
        assert str(path / ".metadata") in str(err.value) and "not trusted" in str(err.value)
        assert "not written by hlat" in str(err.value)
    # The reader alone, inside DCP (which wraps errors, then tries a rank-local metadata file): refused as well.
    with pytest.raises(CheckpointException, match="not trusted"):
        dcp.load(
            into, storage_reader=safe_load.SafeFileSystemReader(path), planner=safe_load.SafeLoadPlanner(), no_dist=True
        )
    assert not marker.exists()


def test_dcps_own_reader_would_have_run_it(tmp_path: Path) -> None:
    # The premise of the issue, with a harmless payload: plain DCP creates the file while reading the metadata.
    path = save({"t": torch.ones(2)}, tmp_path / "ckpt")
    marker = tmp_path / "marker"
    (path / ".metadata").write_bytes(pickle.dumps(OpensAFile(marker)))
    with contextlib.suppress(Exception):  # whatever DCP makes of a file object as metadata
        FileSystemReader(path).read_metadata()
    assert marker.exists()


def test_a_pickled_object_in_a_non_tensor_item_is_refused(tmp_path: Path) -> None:
    # DCP stores non-tensor values (param_groups, ...) as torch.save bytes, and its default planner reads them back
    # with weights_only=False: a checkpoint that dcp.save itself wrote can carry the payload there.
    marker = tmp_path / "marker"
    path = save({"x": OpensAFile(marker), "t": torch.ones(2)}, tmp_path / "ckpt")
    with pytest.raises(ConfigError) as err:
        safe_load.load({"x": None, "t": torch.zeros(2)}, path, no_dist=True)
    message = str(err.value)
    assert str(path / "__0_0.distcp") in message and "item x" in message and "not trusted" in message
    # The safe reader refuses to hand such items to DCP's default planner.
    with pytest.raises(CheckpointException, match="SafeLoadPlanner"):
        dcp.load({"x": None, "t": torch.zeros(2)}, storage_reader=safe_load.SafeFileSystemReader(path), no_dist=True)
    assert not marker.exists()


def test_metadata_of_another_shape_is_refused(tmp_path: Path) -> None:
    path = save({"t": torch.ones(2)}, tmp_path / "ckpt")
    md = safe_load.read_metadata(path)
    (info,) = md.storage_data.values()
    info.relative_path = "../../outside.distcp"  # storage outside the checkpoint directory
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(ConfigError, match=r"outside the checkpoint directory"):
        safe_load.read_metadata(path)
    (path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))  # plain data, but not metadata
    with pytest.raises(ConfigError, match=r"holds a dict, not torch.distributed.checkpoint metadata"):
        safe_load.read_metadata(path)
    (path / ".metadata").write_bytes(b"\x80\x04")  # truncated
    with pytest.raises(ConfigError, match=r"not readable"):
        safe_load.read_metadata(path)
    with pytest.raises(ConfigError, match=r"has no \.metadata"):
        safe_load.read_metadata(tmp_path)


def test_an_enum_pickled_by_name_as_python_3_11_2_does_loads_and_no_other_getattr(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

    path = save({"t": torch.ones(2)}, tmp_path / "ckpt")
    md = safe_load.read_metadata(path)
    buf = io.BytesIO()
    ByNamePickler(buf).dump(md)
    assert b"getattr" in buf.getvalue()
    (path / ".metadata").write_bytes(buf.getvalue())
    [props] = {m.properties.memory_format for m in safe_load.read_metadata(path).state_dict_metadata.values()}
    assert props == torch.contiguous_format
    for cls, name in ((_MEM_FORMAT_ENCODING, "__init__"), (Metadata, "__class__")):
        with pytest.raises(ConfigError, match=r"calls getattr\(.*not an enum member"):
            safe_load.load_metadata(io.BytesIO(pickle.dumps(ByName(cls, name))), "x/.metadata")


class ByNamePickler(pickle.Pickler):
    """Pickles every enum member as ``getattr(EnumClass, "NAME")``, as early Python 3.11 releases (Debian 12's 3.11.2)
    do; 3.11.7 and later call the class with the value."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


class ByName:
    """Pickles as ``getattr(cls, name)``: how early Python 3.11 releases pickle an enum member."""

    def __init__(self, cls: type, name: str) -> None:
        self.cls, self.name = cls, name

    def __reduce__(self):
        return (getattr, (self.cls, self.name))


def plant(checkpoint: Path, payload: object) -> None:
    """Replace the checkpoint's .metadata and update manifest.json to match, as an attacker would."""
    data = pickle.dumps(payload)
    (checkpoint / ".metadata").write_bytes(data)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    rec = manifest["files"][".metadata"]
    manifest["files"][".metadata"] = (
        len(data) if isinstance(rec, int) else {**rec, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    )
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.slow
def test_resuming_a_planted_checkpoint_fails_cleanly(tmp_path: Path, cache_dir: Path, monkeypatch) -> None:
    from hlat.checkpoint.weights import load_checkpoint_weights
    from hlat.train.run import main
    from tests.conftest import run_config

    monkeypatch.chdir(tmp_path)
    common = [
        "model.n_layers=1",
        "model.dim=64",
        "model.n_heads=2",
        "model.n_kv_heads=1",
        "model.ffn_dim=128",
        "train.seq_len=32",
        "train.global_batch_size=2",
        "train.micro_batch_size=2",
        "train.steps=2",
        "optimizer.warmup_steps=1",
        "health=off",
        "tracker=console",
        "tracker.plots=false",
        f"data.cache_dir={cache_dir}",
    ]
    main(run_config(*common), run_dir=tmp_path / "first")
    checkpoint = tmp_path / "first" / "checkpoints" / "step_00000002"
    marker = tmp_path / "marker"
    plant(checkpoint, OpensAFile(marker))
    with pytest.raises(ConfigError, match=r"step_00000002/\.metadata is not trusted") as err:
        main(run_config(*common, "train.steps=3", f"train.resume={checkpoint}"), run_dir=tmp_path / "second")
    assert any(e.path.name == "backend.py" and e.name == "load" for e in err.traceback)  # TorchBackend.load refused it
    with pytest.raises(ConfigError, match=r"step_00000002/\.metadata is not trusted"):  # init_from, export, eval
        load_checkpoint_weights(checkpoint)
    assert not marker.exists()
