"""Reading torch.distributed.checkpoint (DCP) directories without running code from them.

DCP's own reader unpickles with plain ``pickle`` (a crafted checkpoint runs code); here ``.metadata`` may hold only
:data:`ALLOWED_GLOBALS` and other items load with ``weights_only=True``, else a ConfigError names the file.
"""

from __future__ import annotations

import enum
import functools
import io
import pickle
from pathlib import Path, PurePath
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from hlat.config import ConfigError

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint"
_METADATA_CLASSES = (
    "Metadata",
    "StorageMeta",
    "MetadataIndex",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "_MEM_FORMAT_ENCODING",
)
_PATH_CLASSES = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [(f"{_DCP}.metadata", name) for name in _METADATA_CLASSES]
    + [(f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout")]
    + [("collections", "OrderedDict")]
    # StorageMeta.checkpoint_id is the path given to dcp.save (pathlib._local's classes on Python 3.13)
    + [(module, name) for module in ("pathlib", "pathlib._local") for name in _PATH_CLASSES]
)
"""(module, name) of every global a DCP ``.metadata`` may reference, besides ``torch.<dtype>``: what ``dcp.save``
writes for hlat's checkpoints (model and AdamW state; fp32, bf16; plain, DTensor-sharded, async), as recorded by a
``find_class`` that logs them."""


def allowed_global(module: str, name: str) -> bool:
    """Whether a ``.metadata`` pickle may reference ``module.name``: :data:`ALLOWED_GLOBALS` or a torch dtype."""
    return (module, name) in ALLOWED_GLOBALS or (module == "torch" and isinstance(vars(torch).get(name), torch.dtype))


def untrusted(file: str | Path, why: str) -> ConfigError:
    """The error for a checkpoint file that is refused because loading it could run code."""
    return ConfigError(
        f"checkpoint {file} is not trusted: {why}. It was not written by hlat (or was altered "
        "since); it is refused because loading it could run arbitrary code"
    )


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals of :func:`allowed_global`; refuses everything else, naming ``file``."""

    def __init__(self, stream: IO[bytes], file: str | Path) -> None:
        super().__init__(stream)
        self.file = file

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return functools.partial(_enum_member, self.file)  # an enum as early Python 3.11 releases pickle it
        if not allowed_global(module, name):
            raise untrusted(
                self.file, f"it references {module}.{name}, which torch.distributed.checkpoint metadata never holds"
            )
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise untrusted(
            self.file, "it holds persistent references, which torch.distributed.checkpoint metadata never holds"
        )


def _enum_member(file: str | Path, cls: Any, name: Any) -> enum.Enum:
    """``getattr(cls, name)`` where it names a member of an allowed enum (``_MEM_FORMAT_ENCODING``), else refused.

    Early Python 3.11 releases (Debian 12's 3.11.2; 3.11.7 no longer does) pickle an enum member as
    ``getattr(EnumClass, "NAME")``; any other use of ``getattr`` could reach arbitrary attributes of an allowed class.
    """
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise untrusted(
        file, f"it calls getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}), which is not an enum member"
    )


def _check_structure(md: object, file: str | Path) -> Metadata:
    """``md`` if it has the shape of DCP metadata whose storage files all lie inside the checkpoint directory."""
    if not isinstance(md, Metadata):
        raise untrusted(file, f"it holds a {type(md).__name__}, not torch.distributed.checkpoint metadata")
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise untrusted(file, "its state_dict_metadata or storage_data is not a dict")
    for info in md.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(rel, str):
            raise untrusted(file, f"its storage_data holds a {type(info).__name__}, not a storage record")
        if PurePath(rel).is_absolute() or ".." in PurePath(rel).parts or "\\" in rel:
            raise untrusted(file, f"it points at the file {rel!r} outside the checkpoint directory")
    return md


def load_metadata(stream: IO[bytes], file: str | Path) -> Metadata:
    """The DCP metadata pickled in ``stream`` (read from ``file``, named in errors), through the restricted unpickler.

    Raises:
        ConfigError: It references a global outside :func:`allowed_global`, is not DCP metadata, or cannot be read.
    """
    try:
        md = _MetadataUnpickler(stream, file).load()
    except ConfigError:
        raise
    except Exception as e:  # truncated, or an allowed class called with arguments it does not take
        raise ConfigError(f"checkpoint file {file} is not readable torch.distributed.checkpoint metadata: {e}") from e
    return _check_structure(md, file)


def read_metadata(path: str | Path) -> Metadata:
    """The checked metadata of the DCP checkpoint directory ``path`` (or of a ``.metadata`` file).

    Raises:
        ConfigError: There is no ``.metadata``, or see :func:`load_metadata`.
    """
    path = Path(path)
    file = path / METADATA if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"checkpoint {path} has no {METADATA}: it is not a torch.distributed.checkpoint")
    with open(file, "rb") as stream:
        return load_metadata(stream, file)


def _reason(e: pickle.UnpicklingError) -> str:
    """The cause in torch's weights_only error, without its advice to load the file unsafely."""
    text = str(e)
    marker = "WeightsUnpickler error: "
    return text.split(marker, 1)[1].split(". ")[0].splitlines()[0] if marker in text else text.splitlines()[0]


class _UntrustedItem(pickle.UnpicklingError):
    """A non-tensor item that ``torch.load(weights_only=True)`` refused: which one, in which file, and why."""

    def __init__(self, fqn: str, relative_path: str, reason: str) -> None:
        super().__init__(f"{fqn} in {relative_path}: {reason}")
        self.fqn, self.relative_path, self.reason = fqn, relative_path, reason


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor items are read with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            where = getattr(self.metadata.storage_data.get(read_item.storage_index), "relative_path", "?")
            raise _UntrustedItem(fqn, where, _reason(e)) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader, with every ``.metadata`` read by :func:`load_metadata`.

    Non-tensor items go through the planner, which must therefore be a :class:`SafeLoadPlanner`.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not isinstance(planner, SafeLoadPlanner) and any(i.type == LoadItemType.BYTE_IO for i in plan.items):
            raise TypeError(
                f"{type(self).__name__} reads non-tensor items only through a SafeLoadPlanner (DCP's "
                "default one unpickles them with weights_only=False), not " + type(planner).__name__
            )
        try:
            return super().read_data(plan, planner)
        except _UntrustedItem as e:
            raise untrusted(Path(self.path) / e.relative_path, f"its item {e.fqn} holds {e.reason}") from None
        except pickle.UnpicklingError as e:  # a tensor file (already read with weights_only=True by the parent)
            raise untrusted(self.path, f"a tensor file holds {_reason(e)}") from None


def load(state_dict: dict[str, Any], path: str | Path, *, process_group: Any = None, no_dist: bool = False) -> None:
    """``dcp.load`` of the checkpoint directory ``path`` into ``state_dict`` (in place), running no code from it.

    The metadata is checked before DCP starts, so every rank refuses before its collectives.

    Raises:
        ConfigError: The checkpoint holds anything beyond tensors, DCP metadata and plain values.
    """
    read_metadata(path)
    try:
        dcp.load(
            state_dict,
            storage_reader=SafeFileSystemReader(path),
            planner=SafeLoadPlanner(),
            process_group=process_group,
            no_dist=no_dist,
        )
    except CheckpointException as e:
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, ConfigError)]
        if refused:
            raise refused[0] from None
        raise
