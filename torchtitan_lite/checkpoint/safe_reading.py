"""Reading DCP checkpoints without running code from them, and one line for a DCP failure.

A checkpoint folder is input from elsewhere (a colleague's run, a downloaded DCP folder, a bucket
another job writes), and DCP's ``.metadata`` file is a pickle: ``torch``'s own reader unpickles it
with ``pickle.load``, which runs whatever callable the file names. Here it is read by
:class:`_MetadataUnpickler`, which builds exactly the classes DCP's metadata is made of, named one
by one in :data:`METADATA_GLOBALS` (the metadata, storage and chunk descriptions, tensor
properties, the index and storage-info classes, ``torch.Size``, dtypes, layouts, memory formats,
plain containers and scalars): no dotted names, no modules, no ``getattr``, no other callable,
and the state of nothing but those classes' instances set. Anything else is an
:class:`UnsafeCheckpointError` (exit 4) naming the file and the refused name, raised before any
tensor is read. Non-tensor values (the optimizer's hyper-parameters) are read with
``torch.load(weights_only=True)``, tensors by DCP with ``weights_only=True`` too.

What this does not do: checksums (``checksums.json``) catch damage, not an attacker who can write
the folder (they can rewrite the checksums too); what such a folder can still do is hold wrong
weights, not run code.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import metadata as _legacy_metadata
from torch.distributed.checkpoint import filesystem as _dcp_filesystem
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from torchtitan_lite.errors import CheckpointError

__all__ = ["METADATA_GLOBALS", "SafeFileSystemReader", "SafeLoadPlanner", "UnsafeCheckpointError",
           "failure_reason", "read_metadata_file"]


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that names something a checkpoint may not hold (a callable, a module, a
    class outside DCP's metadata): refused before anything of it is used. Not damage: a resume
    stops on it instead of falling back to an earlier checkpoint."""


# The classes DCP's metadata pickles are made of, each by the (module, name) that pickle writes.
_DCP_CLASSES: dict[tuple[str, str], type] = {
    ("torch.distributed.checkpoint.metadata", name): getattr(_dcp_metadata, name)
    for name in ("Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "_MEM_FORMAT_ENCODING")
}
_DCP_CLASSES[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _dcp_filesystem._StorageInfo
# DCP of torch 2.0-2.2 wrote its tensor properties from the sharded-tensor module.
_DCP_CLASSES.update({("torch.distributed._shard.sharded_tensor.metadata", name): getattr(_legacy_metadata, name)
                     for name in ("TensorProperties", "MEM_FORMAT_ENCODING")})

# Values (not callable): dtypes, layouts and memory formats, by their attribute of ``torch``.
_TORCH_VALUES: dict[tuple[str, str], Any] = {
    ("torch", name): value for name, value in vars(torch).items()
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
}

# Callables a metadata pickle reduces with: each builds plain data from plain arguments.
_PLAIN_CALLABLES: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # "torch.strided" -> layout
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    # storage_meta.checkpoint_id may be a path (pathlib moved to pathlib._local in Python 3.13)
    **{(module, name): getattr(pathlib, name) for module in ("pathlib", "pathlib._local")
       for name in ("PurePosixPath", "PosixPath")},
}

METADATA_GLOBALS: dict[tuple[str, str], Any] = {**_DCP_CLASSES, **_TORCH_VALUES, **_PLAIN_CALLABLES}
"""Every global a DCP metadata pickle may name, by exact (module, name): nothing else is built."""

_CALLABLES = tuple(_DCP_CLASSES.values()) + tuple(_PLAIN_CALLABLES.values())
_STATEFUL = tuple(_DCP_CLASSES.values())  # the only instances whose state (BUILD) may be set


class _Refused(Exception):
    """Raised inside the unpickler: ``what`` a checkpoint may not hold."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def _is_one_of(obj: Any, allowed: tuple[Any, ...]) -> bool:
    return any(obj is item for item in allowed)


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler with every way of calling something or setting state narrowed
    to :data:`METADATA_GLOBALS`: globals by exact name, reductions and ``__new__`` only of the
    allowed callables, ``BUILD`` only on instances of DCP's classes and never a dunder attribute,
    no persistent ids, no copyreg extensions."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return METADATA_GLOBALS[(module, name)]
        except (KeyError, TypeError):
            raise _Refused(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"a persistent id ({str(pid)[:60]!r})")

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if not _is_one_of(func, _CALLABLES) or type(args) is not tuple:
            raise _Refused(f"a call of {_describe(func)}")
        self.stack[-1] = func(*args)

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not _is_one_of(cls, _CALLABLES) or not isinstance(cls, type) or type(args) is not tuple:
            raise _Refused(f"a new object of {_describe(cls)}")
        self.append(cls.__new__(cls, *args))

    def _load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        if (not _is_one_of(cls, _CALLABLES) or not isinstance(cls, type) or type(args) is not tuple
                or type(kwargs) is not dict):
            raise _Refused(f"a new object of {_describe(cls)}")
        self.append(cls.__new__(cls, *args, **kwargs))

    def _load_build(self) -> None:
        inst = self.stack[-2]
        state = self.stack[-1]
        if isinstance(inst, type) or not isinstance(inst, _STATEFUL):
            raise _Refused(f"setting the state of {_describe(inst)}")
        for part in (state if isinstance(state, tuple) and len(state) == 2 else (state,)):
            if isinstance(part, dict) and any(not isinstance(k, str) or k.startswith("__") for k in part):
                raise _Refused(f"setting attributes {sorted(map(str, part))} of {_describe(inst)}")
        pickle._Unpickler.load_build(self)

    def _refuse_opcode(self) -> None:
        raise _Refused("an old-style instance or a copyreg extension code")

    dispatch[pickle.REDUCE[0]] = _load_reduce
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex
    dispatch[pickle.BUILD[0]] = _load_build
    for _opcode in (pickle.INST, pickle.OBJ, pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_opcode[0]] = _refuse_opcode
    del _opcode


def _describe(obj: Any) -> str:
    """A refused object, named without calling anything of it."""
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__} value"


def read_metadata_file(path: str | pathlib.Path, data: bytes | None = None) -> Any:
    """DCP's metadata from ``path`` (or its bytes ``data``), built by the allow-listed unpickler:
    a :class:`~torch.distributed.checkpoint.metadata.Metadata`, or :class:`UnsafeCheckpointError`
    naming the file and what it refers to. Damage (a truncated file) is an ordinary exception."""
    if data is None:
        data = pathlib.Path(path).read_bytes()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise UnsafeCheckpointError(
            f"checkpoint metadata {str(path)!r} refers to {exc.what}, which a DCP checkpoint never holds: "
            "refused without running it (only DCP's metadata classes, torch sizes, dtypes and layouts, "
            "and plain data are read); the folder was not written by DCP or was tampered with") from None
    if not isinstance(metadata, _dcp_metadata.Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeCheckpointError(f"checkpoint metadata {str(path)!r} holds a {type(metadata).__name__}, "
                                    "not DCP's Metadata: the folder was not written by DCP")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata is read by :func:`read_metadata_file`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as fh:
            data = fh.read()
        metadata = read_metadata_file(path, data)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = _dcp_metadata.StorageMeta()
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
