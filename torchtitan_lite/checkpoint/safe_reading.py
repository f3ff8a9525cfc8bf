"""Reading DCP checkpoints without unpickling arbitrary objects, and one line for a DCP failure.

DCP's metadata file is read with an unpickler that only builds DCP's own metadata classes;
non-tensor values (the optimizer's hyper-parameters) are read with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "failure_reason"]


_SAFE_BUILTINS = {"set", "frozenset", "slice", "tuple", "list", "dict", "int", "float", "complex",
                  "bytes", "bytearray", "str", "bool", "getattr"}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata classes, torch dtypes/sizes/layouts and plain containers."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint."):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))):
            return super().find_class(module, name)
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        if (module, name) == ("torch.serialization", "_get_layout"):  # layout name -> torch.layout
            return super().find_class(module, name)
        if module == "pathlib" and name in {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}:
            return super().find_class(module, name)
        if module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata is unpickled with an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as fh:
            data = fh.read()
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values (saved by ``torch.save``, e.g.
    the optimizer's ``param_groups``) are read with ``weights_only=True``: plain data only."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            why = next((line for line in lines if "Unsupported global" in line), lines[0] if lines else "")
            raise pickle.UnpicklingError(
                f"value {read_item.dest_index.fqn!r} is not plain data: {why}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def failure_reason(exc: BaseException) -> str:
    """One line for an exception: for DCP's (which wraps one per rank), the first rank's."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        exc = next(iter(failures.values()))
        if isinstance(exc, tuple):  # (exception, traceback frames)
            exc = exc[0]
    # An operating-system error (no space left, permission denied, I/O error) anywhere in the
    # chain is the cause a user can act on: name it, not the wrapper's message.
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.strerror:
            where = f": {cause.filename!r}" if cause.filename else ""
            return f"{cause.strerror} (errno {cause.errno}){where}"
        cause = cause.__cause__ or cause.__context__
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
