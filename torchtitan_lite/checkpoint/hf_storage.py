"""Hugging Face safetensors folders: sharded import and export for any family with an adapter.

Works on plain models and on FSDP2-sharded ones (``DTensor`` parameters on a 1-D mesh or a 2-D
HSDP mesh) without any rank holding the whole model: DCP's Hugging Face storage reader and
writer move each rank's shard, and only weights whose row order differs between the layouts
(the family's :meth:`~torchtitan_lite.models.spec.HFAdapter.row_permutation`) are gathered, one
matrix at a time.

A Hugging Face folder holds one or more ``*.safetensors`` files (plus
``model.safetensors.index.json``) and ``config.json``. Only safetensors and JSON are read:
nothing is unpickled. Loading checks names, shapes and ``config.json`` against the model before
reading any weight and raises :class:`~torchtitan_lite.errors.CheckpointError` with one line
naming the folder, the tensor or field, and the mismatch. The family's names, row layouts and
``config.json`` fields come from its adapter (``models/<family>/hf.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import shutil
import struct
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.futures import Future

from torchtitan_lite.checkpoint.plain import plain_tensor
from torchtitan_lite.checkpoint.safe_reading import failure_reason
from torchtitan_lite.distributed.fsdp import reshard_all
from torchtitan_lite.distributed.lora import (
    adapter_parameter_names,
    lora_expert_modules,
    lora_modules,
    merged_stacked_weight,
    merged_weight,
)
from torchtitan_lite.errors import CheckpointError
from torchtitan_lite.models.nf4 import is_nf4, quantize_into
from torchtitan_lite.models.spec import HFAdapter, ModelSpec
from torchtitan_lite.progress import Progress

__all__ = [
    "CONFIG_FILE",
    "HFExportExtras",
    "check_hf_checkpoint",
    "barrier_if_distributed",
    "check_hf_config",
    "copy_full_into",
    "is_distributed",
    "load_hf_weights",
    "quiet_without_process_group",
    "read_hf_config",
    "save_hf_weights",
    "state_dict_from_hf",
    "state_dict_to_hf",
]

logger = logging.getLogger("torchtitan_lite")

CONFIG_FILE = "config.json"
SAFETENSORS_SUFFIX = ".safetensors"
# Hugging Face's own default shard size for save_pretrained.
DEFAULT_MAX_FILE_BYTES = 5 * 1024**3


def _adapter(spec: ModelSpec) -> HFAdapter:
    if spec.hf is None:
        raise CheckpointError(f"model.name {spec.name!r} has no Hugging Face import/export")
    return spec.hf


# --------------------------------------------------------------------------------------------
# Plain state dicts (converter)
# --------------------------------------------------------------------------------------------


def state_dict_to_hf(sd: Mapping[str, torch.Tensor], spec: ModelSpec, args: Any) -> dict[str, torch.Tensor]:
    """Our (unsharded) state dict → Hugging Face names and row layout. Tensors not permuted are
    shared, not copied (``ValueError`` for a name the family does not have)."""
    adapter = _adapter(spec)
    written = adapter.expected_shapes(args)  # a tied output projection is not written
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        hf_names = adapter.hf_names(name, args)
        if hf_names[0] not in written:
            continue
        index = adapter.row_permutation(name, args, to_hf=True)
        tensor = tensor if index is None else tensor[index]
        out.update(zip(hf_names, tensor, strict=True) if len(hf_names) > 1 else {hf_names[0]: tensor})
    return out


def state_dict_from_hf(sd: Mapping[str, torch.Tensor], spec: ModelSpec, args: Any) -> dict[str, torch.Tensor]:
    """Hugging Face state dict → our names and row layout. Tensors the family recomputes (e.g.
    ``rotary_emb.inv_freq``) are dropped; any other unknown name is a ``ValueError``."""
    adapter = _adapter(spec)
    needed = adapter.expected_shapes(args)
    out: dict[str, torch.Tensor] = {}
    slices: dict[str, dict[int, torch.Tensor]] = {}  # stacked expert weights, per expert
    for hf_name, tensor in sd.items():
        if adapter.ignored(hf_name, args):
            continue
        name, expert = adapter.from_hf_part(hf_name)
        if hf_name not in needed:  # a tied model's copy of its output projection
            continue
        if expert is not None:
            slices.setdefault(name, {})[expert] = tensor
            continue
        index = adapter.row_permutation(name, args, to_hf=False)
        out[name] = tensor if index is None else tensor[index]
    for name, parts in slices.items():
        if sorted(parts) != list(range(len(parts))):
            missing = sorted(set(range(max(parts) + 1)) - set(parts))
            raise ValueError(f"{name}: the Hugging Face state dict lacks expert(s) {missing}")
        out[name] = torch.stack([parts[e] for e in range(len(parts))])
    if adapter.to_hf_name(adapter.output_name) not in needed and adapter.embedding_name in out:
        out[adapter.output_name] = out[adapter.embedding_name]  # tied: one tensor under both names
    return out


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------


def read_hf_config(path: Path) -> dict[str, Any] | None:
    file = path / CONFIG_FILE
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _error(path, f"{CONFIG_FILE} cannot be read: {failure_reason(exc)}") from None
    if not isinstance(config, dict):
        raise _error(path, f"{CONFIG_FILE} is not a JSON object")
    return config


def check_hf_config(path: str | Path, spec: ModelSpec, args: Any) -> None:
    """Raise ``CheckpointError`` if the folder's ``config.json`` disagrees with ``args``.

    The family's adapter compares the fields that decide shapes and numerics. A folder without ``config.json`` passes:
    the tensor shapes are still checked when loading.
    """
    path = Path(path)
    config = read_hf_config(path)
    if config is None:
        return
    problem = _adapter(spec).config_mismatch(config, args)
    if problem is not None:
        from torchtitan_lite.models import family_hint

        raise _error(path, problem + family_hint(config, spec))


# --------------------------------------------------------------------------------------------
# Reading safetensors headers (no tensor data) and checking them
# --------------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_FLOATING = ("F64", "F32", "F16", "BF16")
_MAX_HEADER_BYTES = 100 * 1024**2


@dataclasses.dataclass(frozen=True)
class _TensorEntry:
    file: Path
    dtype: str
    shape: tuple[int, ...]


def _error(path: Path, problem: str) -> Exception:
    return CheckpointError(f"HF checkpoint {str(path)!r}: {problem}")


def _read_header(file: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and the byte offset where its data starts."""
    with file.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError("file is too short for a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"header length {length} is not plausible")
        header = json.loads(fh.read(length))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header, 8 + length


def _read_safetensors_index(path: str | Path) -> dict[str, _TensorEntry]:
    """Name → (file, dtype, shape) of every tensor in the folder's ``*.safetensors``
    files, read from their headers only. Raises ``CheckpointError`` if the folder is missing,
    holds no safetensors file, or a header is malformed."""
    path = Path(path)
    if not path.is_dir():
        raise _error(path, "folder does not exist" if not path.exists() else "is not a folder")
    files = sorted(p for p in path.iterdir() if p.name.endswith(SAFETENSORS_SUFFIX) and p.is_file())
    if not files:
        raise _error(path, f"folder holds no {SAFETENSORS_SUFFIX} files")
    entries: dict[str, _TensorEntry] = {}
    for file in files:
        try:
            header, data_start = _read_header(file)
            needed = data_start + max((int(info["data_offsets"][1]) for name, info in header.items()
                                       if name != "__metadata__"), default=0)
            if file.stat().st_size < needed:
                raise ValueError(f"it has {file.stat().st_size} bytes, its header needs {needed} "
                                 "(a truncated file)")
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                entry = _TensorEntry(file, str(info["dtype"]), tuple(int(s) for s in info["shape"]))
                if name in entries:
                    raise ValueError(f"tensor {name!r} is also in {entries[name].file.name}")
                entries[name] = entry
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise _error(path, f"{file.name} is not a readable safetensors file: "
                               f"{failure_reason(exc)}") from None
    return entries


def _check_tensors(path: Path, entries: Mapping[str, _TensorEntry], adapter: HFAdapter, args: Any,
                   config: Mapping[str, Any]) -> None:
    """Every tensor the model needs is present with the right shape and a floating dtype, and
    every tensor of the folder is one the model uses (or a recomputed buffer, or the copy of a
    tied output projection that ``config.json`` declares tied); the first problem is reported."""
    expected = adapter.expected_shapes(args)
    for name, shape in expected.items():
        entry = entries.get(name)
        if entry is None:
            missing = [n for n in expected if n not in entries]
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise _error(path, f"tensor {name!r} is missing{more}")
        if entry.shape != shape:
            raise _error(path, f"tensor {name!r} has shape {list(entry.shape)} in {entry.file.name} "
                               f"but this model needs {list(shape)}")
        if entry.dtype not in _FLOATING:
            raise _error(path, f"tensor {name!r} has dtype {entry.dtype}, expected one of "
                               f"{', '.join(_FLOATING)}")
    tied_copy = adapter.to_hf_name(adapter.output_name) if config.get("tie_word_embeddings") else None
    unused = [n for n in entries if n not in expected and not adapter.ignored(n, args) and n != tied_copy]
    if unused:
        more = f" and {len(unused) - 1} more" if len(unused) > 1 else ""
        raise _error(path, f"tensor {unused[0]!r}{more} belong to no parameter of this model (a model "
                           "of another family or with parts this one lacks, e.g. biases or q/k norms)")


def check_hf_checkpoint(path: str | Path, spec: ModelSpec, args: Any) -> None:
    """Check a Hugging Face folder against the model ``args`` of family ``spec`` from file headers
    and ``config.json`` only.

    Raises ``CheckpointError`` (one line naming the folder, the tensor or field and the
    mismatch) for a missing folder, no ``*.safetensors`` file, a missing or unused tensor, a
    wrong shape or dtype, or a ``config.json`` that disagrees (family, shape, tied embeddings,
    RoPE, or computation the model lacks). A model with tied embeddings needs no
    ``lm_head.weight``.
    """
    path = Path(path)
    entries = _read_safetensors_index(path)
    config = read_hf_config(path) or {}
    check_hf_config(path, spec, args)
    _check_tensors(path, entries, _adapter(spec), args, config)


# --------------------------------------------------------------------------------------------
# DCP reader: plain reads of contiguous row ranges
# --------------------------------------------------------------------------------------------


class _HFRowReader(HuggingFaceStorageReader):
    """``HuggingFaceStorageReader`` that reads row ranges with ordinary file reads.

    DCP's reader goes through ``safe_open``, which memory-maps each file: every page a rank
    touches (plus read-ahead) is then counted in its resident memory until the file is closed.
    FSDP shards are ranges of rows, i.e. contiguous byte ranges of the file, so they are read
    here straight into the destination (or into one buffer of that size when the dtype differs).
    Any other slice falls back to DCP's own path.
    """

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        fallback: list[ReadItem] = []
        for file_name, items in per_file.items():
            header, data_start = _read_header(Path(file_name))
            with open(file_name, "rb", buffering=0) as fh:
                for item in items:
                    if not self._read_rows(fh, header, data_start, item, planner):
                        fallback.append(item)
        if fallback:
            return super().read_data(dataclasses.replace(plan, items=fallback), planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @staticmethod
    def _read_rows(fh: Any, header: Mapping[str, Any], data_start: int, item: ReadItem,
                   planner: LoadPlanner) -> bool:
        info = header[item.storage_index.fqn]
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        shape = [int(s) for s in info["shape"]]
        offsets, lengths = list(item.storage_offsets), list(item.lengths)
        if dtype is None or len(shape) == 0 or len(shape) != len(offsets):
            return False
        if any(o != 0 or n != s for o, n, s in zip(offsets[1:], lengths[1:], shape[1:], strict=True)):
            return False  # not a range of whole rows
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        target = planner.resolve_tensor(item).detach()
        if list(target.shape) != lengths:
            raise AssertionError(f"{item.storage_index.fqn}: target {list(target.shape)} vs {lengths}")
        direct = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
        buffer = target if direct else torch.empty(lengths, dtype=dtype)
        nbytes = lengths[0] * row_bytes
        if nbytes:
            fh.seek(data_start + int(info["data_offsets"][0]) + offsets[0] * row_bytes)
            view = memoryview(buffer.view(-1).view(torch.uint8).numpy())
            read = 0
            while read < nbytes:
                count = fh.readinto(view[read:])
                if not count:
                    raise OSError(f"{item.storage_index.fqn}: file ends early")
                read += count
        if not direct:
            target.copy_(buffer)
        planner.commit_tensor(item, target)
        return True


# --------------------------------------------------------------------------------------------
# Sharded load and save
# --------------------------------------------------------------------------------------------


def _named_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters as they are stored: sharded DTensors under FSDP2 (a unit left
    unsharded after a forward pass would expose full tensors), as plain tensors (see
    :func:`~.plain.plain_tensor`); LoRA adapters left out (no Hugging Face model tensor: see
    :mod:`.peft_storage`); then its persistent buffers (a router's expert bias), which every rank
    holds whole."""
    reshard_all(model)
    adapters = set(adapter_parameter_names(model))
    tensors = {name: plain_tensor(param) for name, param in model.named_parameters() if name not in adapters}
    return {**tensors, **_persistent_buffers(model)}


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{module_name}.{name}" if module_name else name: buffer
            for module_name, module in model.named_modules() for name, buffer in module.named_buffers(recurse=False)
            if buffer is not None and name not in module._non_persistent_buffers_set}


def _hf_parts(hf_names: list[str], tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """``tensor`` under its Hugging Face name, or for stacked expert weights (``hf_names``: one
    per expert) each expert's slice under its name, as views of this rank's storage: on an
    FSDP-sharded tensor only the experts this rank holds (sharded along the experts), or every
    expert's rows this rank holds (sharded along the next dimension), as DTensors of the expert's
    shape so that DCP reads and writes each rank's part."""
    if len(hf_names) == 1:
        return {hf_names[0]: tensor}
    if not isinstance(tensor, DTensor):
        return dict(zip(hf_names, tensor, strict=True))
    mesh, placements = tensor.device_mesh, tensor.placements
    local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    # Along the experts (plainly, or strided: FSDP over expert-parallel experts): this rank's
    # experts, whole; along a later dimension: that dimension of each expert.
    along = [getattr(p, "dim", None) if isinstance(p, (Shard, _StridedShard)) else None for p in placements]
    if any(d not in (None, 0) for d in along) and any(d == 0 for d in along):
        raise ValueError(f"stacked weights sharded as {placements} (along the experts and another dimension)")
    inner = [Replicate() if d in (None, 0) else Shard(d - 1) for d in along]
    shape = tensor.shape[1:]
    local = tensor.to_local()
    parts: dict[str, torch.Tensor] = {}
    for e in range(offset[0], offset[0] + local_shape[0]):
        piece = local[e - offset[0]]
        parts[hf_names[e]] = piece if all(isinstance(p, Replicate) for p in inner) else DTensor.from_local(
            piece, mesh, inner, run_check=False, shape=shape, stride=torch.empty(shape, device="meta").stride())
    return parts


def _local_rows(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of a full row index that ``like`` (a DTensor sharded on rows) holds locally."""
    replicated = DTensor.from_local(index, like.device_mesh, [Replicate()] * like.device_mesh.ndim,
                                    run_check=False)
    return replicated.redistribute(like.device_mesh, like.placements).to_local()


def _rows_sharded_only(param: DTensor) -> bool:
    return all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)
               for p in param.placements)


def _permute_into(dest: torch.Tensor, source: torch.Tensor, index: torch.Tensor) -> None:
    """``dest ← source[index]`` (a permutation of rows), sharded or not; ``dest`` may be
    ``source`` (the permuted values are computed from a copy before ``dest`` is written).

    Sharded: the full matrix is gathered once (the only full weight any rank holds) and each
    rank keeps the permuted rows of its own shard.
    """
    with torch.no_grad():
        if not isinstance(source, DTensor):
            dest.copy_(source.index_select(0, index.to(source.device)))
            return
        assert isinstance(dest, DTensor)
        full = source.full_tensor()
        index = index.to(full.device)
        local = dest.to_local()
        if _rows_sharded_only(dest):
            local.copy_(full.index_select(0, _local_rows(index, dest)))
        else:
            copy_full_into(dest, full.index_select(0, index))
        del full


def copy_full_into(dest: torch.Tensor, full: torch.Tensor) -> None:
    """``dest ← full``: ``dest`` plain, or a DTensor that keeps its own part of ``full`` (which
    every rank holds whole)."""
    with torch.no_grad():
        if not isinstance(dest, DTensor):
            dest.copy_(full)
            return
        mesh = dest.device_mesh
        replicated = DTensor.from_local(full.to(dest.device, dest.dtype), mesh, [Replicate()] * mesh.ndim,
                                        run_check=False)
        dest.to_local().copy_(replicated.redistribute(mesh, dest.placements).to_local())


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def quiet_without_process_group() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process (expected without a process group)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def barrier_if_distributed() -> None:
    if is_distributed():
        dist.barrier()


def load_hf_weights(model: nn.Module, path: str | Path, *, spec: ModelSpec,
                    buffer_device: torch.device | str | None = None) -> None:
    """Fill ``model``'s parameters (sharded or not) from a Hugging Face folder of family ``spec``.

    Collective when the model is sharded: every rank calls it and reads only its own rows;
    weights whose rows the two layouts order differently (Llama's query/key projections) are
    gathered one matrix at a time to reorder them. Parameters keep their dtype (a bf16 file
    fills fp32 parameters with the upcast values). Non-persistent buffers are rebuilt on
    ``buffer_device`` (``model.init_buffers``; default: where they are, CPU if on meta), so a
    model that was only ``to_empty``-ed is complete afterwards.

    Raises ``CheckpointError`` before reading any weight if the folder does not fit the model.
    """
    with Progress(f"loading the Hugging Face weights of {path}"):
        path = Path(path)
        adapter = _adapter(spec)
        args = model.args
        check_hf_checkpoint(path, spec, args)
        params = _named_params(model)  # a tied parameter once, under its first name
        quantized = {name: param for name, param in params.items() if is_nf4(param)}
        _read_hf(path, adapter, args, {name: p for name, p in params.items() if name not in quantized})
        # QLoRA's 4-bit weights: read into full-precision shards of their own, one block's weights
        # at a time, then quantized into the weights (the whole model is never in full precision).
        groups: dict[str, dict[str, torch.Tensor]] = {}
        for name, param in quantized.items():
            groups.setdefault(".".join(name.split(".")[:2]), {})[name] = param  # (by block: "layers.3")
        for group in groups.values():
            staging = {name: _full_precision_like(param) for name, param in group.items()}
            _read_hf(path, adapter, args, staging)
            for name, values in staging.items():
                quantize_into(group[name], values.to_local() if isinstance(values, DTensor) else values)
            del staging
        model.init_buffers(buffer_device)


def _read_hf(path: Path, adapter: HFAdapter, args: Any, params: Mapping[str, torch.Tensor]) -> None:
    """Read ``params`` (our names: the model's tensors or stand-ins laid out as them) from the
    Hugging Face folder ``path``: each rank its own rows, in our row order."""
    to_load: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        # (a pipeline's last stage holds the tied weight as the output's: the embedding's tensor)
        tied = args.tie_word_embeddings
        source = "tok_embeddings.weight" if name == "output.weight" and tied else name
        to_load.update(_hf_parts(adapter.hf_names(source, args), param.detach()))
    with torch.no_grad(), quiet_without_process_group():
        # Each rank reads its own rows of every tensor straight into its shard.
        try:
            dcp.load(to_load, storage_reader=_HFRowReader(str(path)))
        except (Exception, CheckpointException) as exc:  # DCP's exception is a BaseException
            raise _error(path, f"cannot be read: {failure_reason(exc)}") from None
    # Permuted weights now hold Hugging Face's row order; each is gathered (the only full
    # matrix any rank holds, one at a time) and its shard rewritten in our order.
    for name, param in params.items():
        index = adapter.row_permutation(name, args, to_hf=False)
        if index is not None:
            _permute_into(param.detach(), param.detach(), index)


def _full_precision_like(weight: torch.Tensor) -> torch.Tensor:
    """An empty tensor laid out as the NF4 ``weight`` (a DTensor of the same placements when it
    is one), in its dtype, where its codes are."""
    local = weight._local_tensor if isinstance(weight, DTensor) else weight
    values = torch.empty(local.shape, dtype=local.dtype, device=local.quantized_data.device)
    if not isinstance(weight, DTensor):
        return values
    return DTensor.from_local(values, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape,
                              stride=weight.stride())


def _file_index_mapping(shapes: Mapping[str, tuple[int, ...]], itemsize: int,
                        max_file_bytes: int) -> dict[str, int]:
    """HF name → 1-based file number, packing tensors in file order into files of at most
    ``max_file_bytes`` (a single tensor larger than that gets a file of its own)."""
    mapping: dict[str, int] = {}
    index, used = 1, 0
    for name, shape in shapes.items():
        size = math.prod(shape) * itemsize
        if used and used + size > max_file_bytes:
            index, used = index + 1, 0
        mapping[name] = index
        used += size
    return mapping


@dataclasses.dataclass(frozen=True)
class HFExportExtras:
    """What a Hugging Face export needs besides the weights to be used as it is: the job's
    special token ids and the ``tokenizer.json`` it trained with (None: the built-in byte
    tokenizer, which has no Hugging Face form)."""

    bos_id: int | None = None
    eos_id: int | None = None
    tokenizer_file: Path | None = None


GENERATION_CONFIG_FILE = "generation_config.json"
_TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""Copied beside an export's tokenizer.json when the job's tokenizer folder has them (transformers 5
keeps a folder's chat template in chat_template.jinja, not in tokenizer_config.json)."""


def _write_extras(path: Path, config: dict[str, Any], extras: HFExportExtras) -> None:
    """Token ids into ``config`` and ``generation_config.json``; the tokenizer files beside the
    weights (its :data:`_TOKENIZER_SIDE_FILES` that the job's folder has; without a
    ``tokenizer_config.json``, one naming the fast tokenizer class and the tokens)."""
    ids = {"bos_token_id": extras.bos_id, "eos_token_id": extras.eos_id}
    config.update(ids)
    generation = {"_from_model_config": True, **{k: v for k, v in ids.items() if v is not None}}
    (path / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    if extras.tokenizer_file is None:
        return
    shutil.copyfile(extras.tokenizer_file, path / "tokenizer.json")
    beside = [extras.tokenizer_file.parent / name for name in _TOKENIZER_SIDE_FILES]
    for file in beside:
        if file.is_file():
            shutil.copyfile(file, path / file.name)
    if not beside[0].is_file():
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(extras.tokenizer_file))
        tokens = {f"{which}_token": vocab.id_to_token(token_id)
                  for which, token_id in (("bos", extras.bos_id), ("eos", extras.eos_id)) if token_id is not None}
        tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens}
        (path / beside[0].name).write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")


def _export_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a Hugging Face export holds, by our names: :func:`_named_params`, a linear with
    LoRA adapters (and LoRA'd stacked experts) merged, ``W + (alpha/rank) · B A``."""
    params = _named_params(model)
    if model.args.tie_word_embeddings:
        # (a pipeline's last stage holds the tied weight as the output's: the first stage's rank
        # writes it, as the embedding, once)
        params.pop("output.weight", None)
    for name, module in lora_modules(model).items():
        params[f"{name}.weight"] = plain_tensor(merged_weight(module))
    for name, module in lora_expert_modules(model).items():
        for weight in module.stacked_weights:
            params[f"{name}.{weight}"] = plain_tensor(merged_stacked_weight(module, weight))
    return params


def hf_named_tensors(model: nn.Module, *, spec: ModelSpec,
                     dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each of ``model``'s weights under its Hugging Face name as a full tensor, one at a time (what
    an inference engine's weight sync reads): the tensors :func:`save_hf_weights` writes (LoRA
    merged, query/key rows in Hugging Face's order, stacked experts one per name), in ``dtype``
    (default the parameters'; buffers keep theirs). Collective when the model is sharded: every
    rank iterates it to the end, and each gathered tensor is freed once the next is asked for."""
    adapter = _adapter(spec)
    args = model.args
    params = _export_params(model)
    buffers = _persistent_buffers(model)
    for name, param in params.items():
        with torch.no_grad():
            tensor = param.detach()
            tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            index = adapter.row_permutation(name, args, to_hf=True)
            if index is not None:
                tensor = tensor.index_select(0, index.to(tensor.device))
            if name not in buffers and dtype is not None:
                tensor = tensor.to(dtype)
        yield from _hf_parts(adapter.hf_names(name, args), tensor).items()
        del tensor


def save_hf_weights(model: nn.Module, path: str | Path, *, spec: ModelSpec, dtype: torch.dtype | None = None,
                    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, extras: HFExportExtras | None = None) -> None:
    """Write ``model``'s weights (sharded or not) as a Hugging Face folder of family ``spec``.

    Collective when the model is sharded. Each rank writes its own shards (in ``dtype``, default
    the parameters' dtype) to ``path/sharded``; rank 0 then joins them into
    ``model-0000i-of-0000n.safetensors`` files of at most ``max_file_bytes`` each, writes
    ``model.safetensors.index.json`` and ``config.json`` and removes ``path/sharded``. Only the
    query/key weights are gathered, one matrix at a time, to apply the RoPE permutation. With
    ``extras``, the folder is complete for ``transformers``: token ids in ``config.json`` and
    ``generation_config.json``, and the tokenizer files (:class:`HFExportExtras`).
    A linear with LoRA adapters is written merged, ``W + (alpha/rank) · B A`` (each rank merges
    its own rows). The caller handles writing to a temporary folder and renaming it.
    """
    with Progress(f"writing the Hugging Face weights to {path}"):
        path = Path(path)
        adapter = _adapter(spec)
        args = model.args
        params = _export_params(model)
        buffers = _persistent_buffers(model)
        export_dtype = dtype if dtype is not None else next(iter(params.values())).dtype
        if not export_dtype.is_floating_point:
            raise ValueError(f"dtype={export_dtype} is not a floating-point dtype")
        to_save: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, param in params.items():
                tensor = param.detach()
                index = adapter.row_permutation(name, args, to_hf=True)
                if index is not None:
                    permuted = torch.empty_like(tensor)
                    _permute_into(permuted, tensor, index)
                    tensor = permuted
                # (Buffers keep their dtype: a router's fp32 bias.)
                to_save.update(
                    _hf_parts(adapter.hf_names(name, args), tensor if name in buffers else tensor.to(export_dtype))
                )
        mapping = _file_index_mapping(adapter.expected_shapes(args), export_dtype.itemsize, max_file_bytes)
        rank = dist.get_rank() if is_distributed() else 0
        if rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        barrier_if_distributed()
        writer = HuggingFaceStorageWriter(str(path), fqn_to_index_mapping=mapping,
                                          save_distributed=True, enable_consolidation=True)
        with quiet_without_process_group():
            dcp.save(to_save, storage_writer=writer)
        del to_save
        # dcp.save returns on every rank after rank 0 consolidated the shards (its finish step).
        if rank == 0:
            shutil.rmtree(path / "sharded", ignore_errors=True)
            config = adapter.config_for(args, export_dtype)
            if extras is not None:
                _write_extras(path, config, extras)
            (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        barrier_if_distributed()
