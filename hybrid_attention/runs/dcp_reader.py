"""Reading torch.distributed.checkpoint (DCP) folders without running code from them: DCP's pickled `.metadata` goes
through an unpickler that builds only DCP's own metadata types, non-tensor values through torch's weights-only loader.
"""

from __future__ import annotations

import io
import pathlib
import pickle

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element  # the planner's own helper, for the same job

# What DCP's metadata pickle may name: its own records, torch.Size, a dtype or layout, and the checkpoint's path.
_ALLOWED = {
    ("pathlib", "Path"): pathlib.Path,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "WindowsPath"): pathlib.WindowsPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
}
_METADATA_TYPES = (
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "_MEM_FORMAT_ENCODING",
)
_ALLOWED.update(
    {(dcp_metadata.__name__, n): getattr(dcp_metadata, n) for n in _METADATA_TYPES if hasattr(dcp_metadata, n)}
)


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's documented way to restrict globals: `find_class` resolves only the allow-listed names.

    torch has no public reader for a bare pickle with an allow-list (its weights-only loader reads torch.save files)."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a type checkpoint metadata may hold")


def read_metadata_safely(data: bytes) -> dcp_metadata.Metadata:
    """DCP's `.metadata` bytes as a Metadata, or ValueError when they name anything else."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # a damaged pickle fails in many ways
        raise ValueError(f"not torch.distributed.checkpoint metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise ValueError(f"not torch.distributed.checkpoint metadata (a {type(metadata).__name__})")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata goes through the restricted unpickler."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = read_metadata_safely(f.read())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values (optimizer hyperparameters) load with torch's weights-only loader."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise ValueError(f"{read_item.dest_index.fqn}: not a plain value ({type(e).__name__}: {e})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
