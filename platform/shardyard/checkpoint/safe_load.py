"""Loading a checkpoint runs no code from it.

Whoever can write into a run directory must not run code on the nodes that read it. Pickle runs
whatever a file names, so every pickle a checkpoint holds is read under an allow-list, the way
torch's `weights_only` loading does:

- DCP's `.metadata` (pickled by DCP itself) through `MetadataUnpickler`, which admits only DCP's
  own metadata types and torch's dtypes, layouts and memory formats;
- DCP's non-tensor values (the optimizer's settings) with `torch.load(weights_only=True)`
  (`SafeLoadPlanner`; DCP's default planner unpickles them unrestricted);
- DeepSpeed's ZeRO files, which DeepSpeed loads with `weights_only=False` itself: each is
  checked first (`check_zero_files`) with torch's own scan for globals outside the safe set, and
  refused unless every one found is a plain DeepSpeed data type on `ZERO_GLOBALS`.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # torch exports no public name for it
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from shardyard.checkpoint.record import COMMIT_FILE, BadCheckpoint, FileEntry
from shardyard.checkpoint.verified_reads import VerifiedFiles

_DCP_TYPES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath"},
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_TYPES.get(module, ()):
            return super().find_class(module, name)
        found = getattr(torch, name, None) if module == "torch" else None
        if isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
            return found
        raise pickle.UnpicklingError(f"'{module}.{name}' is not a DCP metadata type")


def read_metadata(stream: io.IOBase, where: str) -> Metadata:
    try:
        metadata = MetadataUnpickler(stream).load()
    except pickle.UnpicklingError as err:
        raise BadCheckpoint(f"{where} would run code if unpickled ({err}): refused") from None
    except (EOFError, ValueError, TypeError, AttributeError) as err:
        raise BadCheckpoint(f"{where} is not DCP metadata ({type(err).__name__}: {err})") from None
    if not isinstance(metadata, Metadata):
        raise BadCheckpoint(f"{where} is not DCP metadata (it holds a {type(metadata).__name__})")
    return metadata


def check_storage_paths(metadata: Metadata, listed: set[str] | None, where: str) -> None:
    """Every file DCP's metadata points its reads at is a file of this checkpoint: a relative
    name inside it and, when the checkpoint has a commit record (`listed`), one the record lists.
    A hostile `.metadata` could otherwise send the reads anywhere (an absolute path, `..`)."""
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is None:
            continue
        inside = (not PurePosixPath(relative).is_absolute() and ".." not in PurePosixPath(relative).parts
                  and "\\" not in relative)
        if not inside or (listed is not None and relative not in listed):
            raise BadCheckpoint(f"{where} points its reads at {relative!r}, not a file of this checkpoint "
                                f"that its commit record lists: refused")


class _SafeMetadata:
    """DCP's reader with its `.metadata` read by `MetadataUnpickler` instead of plain pickle, and
    its reads kept to the checkpoint's own files (`check_storage_paths`). Given the commit
    record's files (`expected`), every file it opens is checked against them as it is read
    (checkpoint/verified_reads.py)."""

    def __init__(self, path: str | Path, expected: dict[str, FileEntry] | None = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        if expected is not None:
            self.fs = VerifiedFiles(self.fs, self.path, expected)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_metadata(stream, str(path))
        check_storage_paths(metadata, self._listed_files(), str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _listed_files(self) -> set[str] | None:
        """The files the checkpoint's commit record lists (None: it has no readable record, such
        as a scratch copy; the record itself is judged before any load)."""
        path = self.fs.concat_path(self.path, COMMIT_FILE)
        if not self.fs.exists(path):
            return None
        with self.fs.create_stream(path, "rb") as stream:
            try:
                files = json.load(stream).get("files")
            except (ValueError, AttributeError):
                return None
        return set(files) if isinstance(files, dict) else None


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    pass


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    pass


def safe_reader(checkpoint_id: str | Path, expected: dict[str, FileEntry] | None = None) -> FileSystemReader:
    """The DCP reader for a local path or an object store URI, reading no code (and, given the
    commit record's files, checking each file it reads against them)."""
    text = str(checkpoint_id)
    return SafeFsspecReader(text, expected) if "://" in text else SafeFileSystemReader(text, expected)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, refusing a non-tensor value that `torch.load(weights_only=True)` refuses."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Proven safe first; DCP's own load of the same bytes then runs nothing.
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            where = read_item.dest_index.fqn
            raise BadCheckpoint(f"value '{where}' would run code if unpickled ({err}): refused") from None
        value.seek(0)
        super().load_bytes(read_item, value)


# DeepSpeed's checkpoint files hold these besides tensors and plain containers: data types
# whose unpickling only sets fields (checked against DeepSpeed 0.19's save_checkpoint).
ZERO_GLOBALS = {
    "argparse.Namespace",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
    "collections.OrderedDict",
    "torch.nn.parameter.Parameter",
    "torch._utils._rebuild_parameter",
    "builtins.set",
    "builtins.frozenset",
}


def check_zero_files(directory: Path) -> None:
    """Refuse a ZeRO checkpoint any of whose files names a global outside the allow-list: such a
    file would run code when DeepSpeed loads it."""
    for path in sorted(directory.rglob("*.pt")):
        try:
            unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
        except Exception as err:  # noqa: BLE001 (any failure to parse is a bad file)
            raise BadCheckpoint(f"{path} is not a readable torch file ({type(err).__name__}: {err})") from None
        refused = sorted(unsafe - ZERO_GLOBALS)
        if refused:
            raise BadCheckpoint(f"{path} names {', '.join(refused)}, which loading it would import and run: refused")
