"""Hugging Face Llama safetensors import and export for :class:`~torchtitan_lite.models.llama3.Transformer`.

Works on plain models and on FSDP2-sharded ones (``DTensor`` parameters on a 1-D mesh or a 2-D
HSDP mesh) without any rank holding the whole model: DCP's Hugging Face storage reader and
writer move each rank's shard, and only the query/key projections, whose rows must be
permuted, are gathered, one matrix at a time.

Two layouts differ besides the names:

- **RoPE.** Our model (like Meta's reference) rotates interleaved pairs ``(x[2i], x[2i+1])`` of
  each head; Hugging Face's ``LlamaForCausalLM`` rotates halves (``rotate_half``). The query and
  key weights are the same up to a permutation of rows within each head:
  :func:`permute_for_hf` and :func:`unpermute_from_hf`.
- **Files.** A Hugging Face folder holds one or more ``*.safetensors`` files (plus
  ``model.safetensors.index.json``) and ``config.json``. Only safetensors and JSON are read:
  nothing is unpickled.

Loading checks names, shapes and ``config.json`` against the model before reading any weight
and raises :class:`~torchtitan_lite.checkpoint.CheckpointError` with one line naming the folder,
the tensor or field, and the mismatch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import re
import shutil
import struct
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.futures import Future

from torchtitan_lite.checkpoint import CheckpointError, failure_reason
from torchtitan_lite.models.llama3 import LLAMA3_FLAVORS, ModelArgs, precompute_freqs_cis

if TYPE_CHECKING:
    from torchtitan_lite.models.llama3 import Transformer

__all__ = [
    "CONFIG_FILE",
    "check_hf_checkpoint",
    "check_hf_config",
    "expected_hf_shapes",
    "from_hf_name",
    "hf_config",
    "load_hf_weights",
    "model_args_from_hf_config",
    "permute_for_hf",
    "save_hf_weights",
    "state_dict_from_hf",
    "state_dict_to_hf",
    "to_hf_name",
    "unpermute_from_hf",
]

logger = logging.getLogger("torchtitan_lite")

CONFIG_FILE = "config.json"
SAFETENSORS_SUFFIX = ".safetensors"
# Hugging Face's own default shard size for save_pretrained.
DEFAULT_MAX_FILE_BYTES = 5 * 1024**3

# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_LEVEL_FROM_HF = {hf: ours for ours, hf in _TOP_LEVEL.items()}
_PER_LAYER_FROM_HF = {hf: ours for ours, hf in _PER_LAYER.items()}
_OUR_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Tensors some Hugging Face checkpoints carry that the model does not need (recomputed buffers).
_IGNORED_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def to_hf_name(name: str) -> str:
    """Our parameter name → the Hugging Face Llama name (``ValueError`` for an unknown name)."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = _OUR_LAYER.match(name)
    if match and match.group(2) in _PER_LAYER:
        return f"model.layers.{match.group(1)}.{_PER_LAYER[match.group(2)]}"
    raise ValueError(f"{name!r} is not a parameter name of the Llama model")


def from_hf_name(name: str) -> str:
    """Hugging Face Llama name → our parameter name (``ValueError`` for an unknown name)."""
    if name in _TOP_LEVEL_FROM_HF:
        return _TOP_LEVEL_FROM_HF[name]
    match = _HF_LAYER.match(name)
    if match and match.group(2) in _PER_LAYER_FROM_HF:
        return f"layers.{match.group(1)}.{_PER_LAYER_FROM_HF[match.group(2)]}"
    raise ValueError(f"{name!r} is not a Hugging Face Llama parameter name")


def _heads_to_permute(name: str, args: ModelArgs) -> int | None:
    """Number of heads whose rows are permuted for parameter ``name`` (ours), or None."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


# --------------------------------------------------------------------------------------------
# RoPE layout
# --------------------------------------------------------------------------------------------


def _check_rows(w: torch.Tensor, n_heads: int) -> tuple[int, int]:
    if w.dim() != 2 or n_heads <= 0 or w.shape[0] % n_heads or (w.shape[0] // n_heads) % 2:
        raise ValueError(
            f"expected a 2-D weight whose {w.shape[0] if w.dim() else 0} rows split into {n_heads} "
            f"heads of even size, got shape {list(w.shape)}"
        )
    return w.shape[0] // n_heads, w.shape[1]


def permute_for_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a query/key weight from interleaved-pair RoPE (ours) to half-split RoPE (HF).

    Within each head, our row ``2i + p`` (pair ``i``, component ``p``) becomes row
    ``p · head_dim/2 + i``.
    """
    head_dim, dim = _check_rows(w, n_heads)
    return w.view(n_heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(n_heads * head_dim, dim)


def unpermute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`permute_for_hf`: half-split RoPE rows (HF) back to interleaved pairs."""
    head_dim, dim = _check_rows(w, n_heads)
    return w.view(n_heads, 2, head_dim // 2, dim).transpose(1, 2).reshape(n_heads * head_dim, dim)


def _row_permutation(rows: int, n_heads: int, *, to_hf: bool) -> torch.Tensor:
    """Indices ``idx`` with ``permuted = w[idx]`` (``to_hf``: ours → HF, else HF → ours)."""
    index = torch.arange(rows).unsqueeze(1)  # permuting the row numbers gives the gather index
    permuted = permute_for_hf(index, n_heads) if to_hf else unpermute_from_hf(index, n_heads)
    return permuted.squeeze(1)


# --------------------------------------------------------------------------------------------
# Plain state dicts (converter)
# --------------------------------------------------------------------------------------------


def state_dict_to_hf(sd: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our (unsharded) state dict → Hugging Face names and RoPE layout. Tensors not permuted are
    shared, not copied."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        heads = _heads_to_permute(name, args)
        out[to_hf_name(name)] = tensor if heads is None else permute_for_hf(tensor, heads)
    return out


def state_dict_from_hf(
    sd: Mapping[str, torch.Tensor], n_heads: int, n_kv_heads: int
) -> dict[str, torch.Tensor]:
    """Hugging Face state dict → our names and RoPE layout. Recomputed buffers such as
    ``rotary_emb.inv_freq`` are dropped; any other unknown name is a ``ValueError``."""
    out: dict[str, torch.Tensor] = {}
    for hf_name, tensor in sd.items():
        if _IGNORED_HF.search(hf_name):
            continue
        name = from_hf_name(hf_name)
        if name.endswith("attention.wq.weight"):
            tensor = unpermute_from_hf(tensor, n_heads)
        elif name.endswith("attention.wk.weight"):
            tensor = unpermute_from_hf(tensor, n_kv_heads)
        out[name] = tensor
    return out


def expected_hf_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Hugging Face name → shape of every tensor a model with ``args`` needs, in file order."""
    d, h, kv = args.dim, args.ffn_hidden_dim, args.kv_heads * args.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (args.vocab_size, d)}
    per_layer = {
        "self_attn.q_proj.weight": (args.n_heads * args.head_dim, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, args.n_heads * args.head_dim),
        "mlp.gate_proj.weight": (h, d),
        "mlp.down_proj.weight": (d, h),
        "mlp.up_proj.weight": (h, d),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }
    for i in range(args.n_layers):
        for suffix, shape in per_layer.items():
            shapes[f"model.layers.{i}.{suffix}"] = shape
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (args.vocab_size, d)
    return shapes


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """A ``LlamaForCausalLM`` ``config.json`` for a model with ``args`` stored in ``dtype``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "num_hidden_layers": args.n_layers,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(dtype),
    }


def _read_config(path: Path) -> dict[str, Any] | None:
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


def _rope_theta(config: Mapping[str, Any]) -> Any:
    if "rope_theta" in config:
        return config["rope_theta"]
    parameters = config.get("rope_parameters")  # newer transformers releases
    return parameters.get("rope_theta") if isinstance(parameters, dict) else None


def _rope_scaling_type(config: Mapping[str, Any]) -> str | None:
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if isinstance(value, dict):
            kind = value.get("rope_type", value.get("type"))
            if kind not in (None, "default"):
                return f"{key}.rope_type={kind!r}"
    return None


def _config_mismatch(config: Mapping[str, Any], args: ModelArgs) -> str | None:
    """The first field of ``config`` that disagrees with ``args``, as a phrase, or None."""
    expected: list[tuple[str, Any, Any]] = [
        ("hidden_size", config.get("hidden_size"), args.dim),
        ("num_hidden_layers", config.get("num_hidden_layers"), args.n_layers),
        ("num_attention_heads", config.get("num_attention_heads"), args.n_heads),
        ("num_key_value_heads",
         config.get("num_key_value_heads", config.get("num_attention_heads")), args.kv_heads),
        ("intermediate_size", config.get("intermediate_size"), args.ffn_hidden_dim),
        ("vocab_size", config.get("vocab_size"), args.vocab_size),
    ]
    if config.get("head_dim") is not None:
        expected.append(("head_dim", config.get("head_dim"), args.head_dim))
    for field, value, want in expected:
        if value is not None and value != want:
            return f"{CONFIG_FILE} has {field}={value!r} but this model has {field}={want!r}"
    for field, value, want in (("rms_norm_eps", config.get("rms_norm_eps"), args.norm_eps),
                               ("rope_theta", _rope_theta(config), args.rope_theta)):
        if value is None:
            continue
        if not isinstance(value, (int, float)) or not math.isclose(value, want, rel_tol=1e-6):
            return f"{CONFIG_FILE} has {field}={value!r} but this model has {field}={want!r}"
    if config.get("hidden_act", "silu") != "silu":
        return f"{CONFIG_FILE} has hidden_act={config['hidden_act']!r} but this model uses 'silu'"
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field):
            return f"{CONFIG_FILE} has {field}=true but this model has no biases"
    scaling = _rope_scaling_type(config)
    if scaling is not None:
        return f"{CONFIG_FILE} has {scaling} but this model implements only unscaled RoPE"
    return None


def check_hf_config(path: str | Path, args: ModelArgs) -> None:
    """Raise ``CheckpointError`` if the folder's ``config.json`` disagrees with ``args``.

    Compares the fields that decide shapes and numerics (sizes, head counts, ``rms_norm_eps``,
    ``rope_theta``, activation, biases, RoPE scaling). A folder without ``config.json`` passes:
    the tensor shapes are still checked when loading.
    """
    path = Path(path)
    config = _read_config(path)
    if config is None:
        return
    problem = _config_mismatch(config, args)
    if problem is not None:
        raise _error(path, problem)


def model_args_from_hf_config(config: Mapping[str, Any], **overrides: Any) -> ModelArgs:
    """``ModelArgs`` for a Hugging Face Llama ``config.json`` (``ValueError`` if it has no
    Llama shape; ``overrides`` replace fields).

    A flavor of :data:`LLAMA3_FLAVORS` with the same shape is used as the base (vocabulary,
    ``rms_norm_eps``, ``rope_theta`` and ``max_position_embeddings`` from the file); otherwise
    ``intermediate_size`` is expressed through ``multiple_of`` (and ``ffn_dim_multiplier`` where
    needed) so that ``ffn_hidden_dim`` reproduces it exactly."""
    try:
        dim = int(config["hidden_size"])
        n_heads = int(config["num_attention_heads"])
        fields: dict[str, Any] = {
            "dim": dim,
            "n_layers": int(config["num_hidden_layers"]),
            "n_heads": n_heads,
            "n_kv_heads": int(config.get("num_key_value_heads") or n_heads),
            "vocab_size": int(config["vocab_size"]),
            "norm_eps": float(config.get("rms_norm_eps", 1e-5)),
            "rope_theta": float(_rope_theta(config) or 10000.0),
            "max_seq_len": int(config.get("max_position_embeddings", 8192)),
        }
        hidden = int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{CONFIG_FILE} lacks a usable Llama field: {failure_reason(exc)}") from None
    shape = (dim, fields["n_layers"], n_heads, fields["n_kv_heads"], hidden)
    free = {k: fields[k] for k in ("vocab_size", "norm_eps", "rope_theta", "max_seq_len")}
    for flavor in LLAMA3_FLAVORS.values():  # a known flavor's fields where the shape is one
        candidate = dataclasses.replace(flavor, **{**free, **overrides})
        if (candidate.dim, candidate.n_layers, candidate.n_heads, candidate.kv_heads,
                candidate.ffn_hidden_dim) == shape:
            return candidate
    base = int(2 * 4 * dim / 3)
    fields.update(multiple_of=hidden, ffn_dim_multiplier=None if base <= hidden else hidden / base)
    fields.update(overrides)
    args = ModelArgs(**fields)
    if args.ffn_hidden_dim != hidden:
        raise ValueError(f"{CONFIG_FILE} intermediate_size={hidden} cannot be expressed by ModelArgs")
    problem = _config_mismatch(config, args)
    if problem is not None:
        raise ValueError(problem)
    return args


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


def _check_tensors(path: Path, entries: Mapping[str, _TensorEntry], args: ModelArgs,
                   *, tied: bool) -> None:
    """Every tensor the model needs is present with the right shape and a floating dtype; the
    first problem in file order is reported."""
    expected = expected_hf_shapes(args)
    for name, shape in expected.items():
        entry = entries.get(name)
        if entry is None:
            if tied and name == "lm_head.weight":
                continue
            missing = [n for n in expected if n not in entries and not (tied and n == "lm_head.weight")]
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise _error(path, f"tensor {name!r} is missing{more}")
        if entry.shape != shape:
            raise _error(path, f"tensor {name!r} has shape {list(entry.shape)} in {entry.file.name} "
                               f"but this model needs {list(shape)}")
        if entry.dtype not in _FLOATING:
            raise _error(path, f"tensor {name!r} has dtype {entry.dtype}, expected one of "
                               f"{', '.join(_FLOATING)}")
    unused = [n for n in entries if n not in expected and not _IGNORED_HF.search(n)]
    if unused:
        logger.warning("HF checkpoint %s: ignoring %d tensors this model does not use (e.g. %s)",
                       path, len(unused), unused[0])


def check_hf_checkpoint(path: str | Path, args: ModelArgs) -> bool:
    """Check a Hugging Face folder against ``args`` from file headers and ``config.json`` only.

    Raises ``CheckpointError`` (one line naming the folder, the tensor or field and the
    mismatch) for a missing folder, no ``*.safetensors`` file, a missing tensor, a wrong shape
    or dtype, or a ``config.json`` that disagrees. Tensors the model does not use are ignored.
    Returns True when the output projection is tied to the embedding (``tie_word_embeddings``
    and no ``lm_head.weight``), i.e. it is to be loaded from ``model.embed_tokens.weight``.
    """
    path = Path(path)
    entries = _read_safetensors_index(path)
    config = _read_config(path) or {}
    check_hf_config(path, args)
    tied = bool(config.get("tie_word_embeddings")) and "lm_head.weight" not in entries
    _check_tensors(path, entries, args, tied=tied)
    return tied


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


def _named_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters as they are stored: sharded DTensors under FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # a unit left unsharded after forward would expose full tensors
    return dict(model.named_parameters())


def _local_rows(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of a full row index that ``like`` (a DTensor sharded on rows) holds locally."""
    replicated = DTensor.from_local(index, like.device_mesh, [Replicate()] * like.device_mesh.ndim,
                                    run_check=False)
    return replicated.redistribute(like.device_mesh, like.placements).to_local()


def _rows_sharded_only(param: DTensor) -> bool:
    return all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)
               for p in param.placements)


def _permute_into(dest: torch.Tensor, source: torch.Tensor, n_heads: int, *, to_hf: bool) -> None:
    """``dest ← permuted(source)`` for query/key weights, sharded or not; ``dest`` may be
    ``source`` (the permuted values are computed from a copy before ``dest`` is written).

    Sharded: the full matrix is gathered once (the only full weight any rank holds) and each
    rank keeps the permuted rows of its own shard.
    """
    with torch.no_grad():
        if not isinstance(source, DTensor):
            dest.copy_(permute_for_hf(source, n_heads) if to_hf else unpermute_from_hf(source, n_heads))
            return
        assert isinstance(dest, DTensor)
        full = source.full_tensor()
        local = dest.to_local()
        if _rows_sharded_only(dest):
            index = _row_permutation(full.shape[0], n_heads, to_hf=to_hf).to(full.device)
            local.copy_(full.index_select(0, _local_rows(index, dest)))
        else:
            permuted = permute_for_hf(full, n_heads) if to_hf else unpermute_from_hf(full, n_heads)
            replicated = DTensor.from_local(permuted, dest.device_mesh,
                                            [Replicate()] * dest.device_mesh.ndim, run_check=False)
            local.copy_(replicated.redistribute(dest.device_mesh, dest.placements).to_local())
        del full


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def quiet_without_process_group() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process (expected without a process group)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def load_hf_weights(model: Transformer, path: str | Path, *,
                    buffer_device: torch.device | str | None = None) -> None:
    """Fill ``model``'s parameters (sharded or not) from a Hugging Face Llama folder.

    Collective when the model is sharded: every rank calls it and reads only its own rows;
    query/key weights are gathered one matrix at a time to undo the RoPE permutation.
    Parameters keep their dtype (a bf16 file fills fp32 parameters with the upcast values).
    The RoPE buffer is rebuilt on ``buffer_device`` (default: where it is; CPU if on meta), so
    a model that was only ``to_empty``-ed is complete afterwards.

    Raises ``CheckpointError`` before reading any weight if the folder does not fit the model.
    """
    path = Path(path)
    args: ModelArgs = model.args
    tied = check_hf_checkpoint(path, args)
    params = _named_params(model)
    to_load = {to_hf_name(name): param.detach() for name, param in params.items()
               if not (tied and name == "output.weight")}
    with torch.no_grad(), quiet_without_process_group():
        # Each rank reads its own rows of every tensor straight into its shard.
        try:
            dcp.load(to_load, storage_reader=_HFRowReader(str(path)))
            if tied:
                dcp.load({"model.embed_tokens.weight": params["output.weight"].detach()},
                         storage_reader=_HFRowReader(str(path)))
        except (Exception, CheckpointException) as exc:  # DCP's exception is a BaseException
            raise _error(path, f"cannot be read: {failure_reason(exc)}") from None
    # Query/key weights now hold Hugging Face's row order; each is gathered (the only full
    # matrix any rank holds, one at a time) and its shard rewritten in our order.
    for name, param in params.items():
        heads = _heads_to_permute(name, args)
        if heads is not None:
            _permute_into(param.detach(), param.detach(), heads, to_hf=False)
    device = torch.device(buffer_device) if buffer_device is not None else model.freqs_cis.device
    if device.type == "meta":
        device = torch.device("cpu")
    model.freqs_cis = precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta,
                                           device=device)


def _file_index_mapping(args: ModelArgs, itemsize: int, max_file_bytes: int) -> dict[str, int]:
    """HF name → 1-based file number, packing tensors in file order into files of at most
    ``max_file_bytes`` (a single tensor larger than that gets a file of its own)."""
    mapping: dict[str, int] = {}
    index, used = 1, 0
    for name, shape in expected_hf_shapes(args).items():
        size = math.prod(shape) * itemsize
        if used and used + size > max_file_bytes:
            index, used = index + 1, 0
        mapping[name] = index
        used += size
    return mapping


def save_hf_weights(model: Transformer, path: str | Path, *, dtype: torch.dtype | None = None,
                    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> None:
    """Write ``model``'s weights (sharded or not) as a Hugging Face Llama folder at ``path``.

    Collective when the model is sharded. Each rank writes its own shards (in ``dtype``, default
    the parameters' dtype) to ``path/sharded``; rank 0 then joins them into
    ``model-0000i-of-0000n.safetensors`` files of at most ``max_file_bytes`` each, writes
    ``model.safetensors.index.json`` and ``config.json`` and removes ``path/sharded``. Only the
    query/key weights are gathered, one matrix at a time, to apply the RoPE permutation.
    The caller handles writing to a temporary folder and renaming it.
    """
    path = Path(path)
    args: ModelArgs = model.args
    params = _named_params(model)
    export_dtype = dtype if dtype is not None else next(iter(params.values())).dtype
    if not export_dtype.is_floating_point:
        raise ValueError(f"dtype={export_dtype} is not a floating-point dtype")
    to_save: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in params.items():
            tensor = param.detach()
            heads = _heads_to_permute(name, args)
            if heads is not None:
                permuted = torch.empty_like(tensor)
                _permute_into(permuted, tensor, heads, to_hf=True)
                tensor = permuted
            to_save[to_hf_name(name)] = tensor.to(export_dtype)
    mapping = _file_index_mapping(args, export_dtype.itemsize, max_file_bytes)
    rank = dist.get_rank() if _distributed() else 0
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    _barrier()
    writer = HuggingFaceStorageWriter(str(path), fqn_to_index_mapping=mapping,
                                      save_distributed=True, enable_consolidation=True)
    with quiet_without_process_group():
        dcp.save(to_save, storage_writer=writer)
    del to_save
    # dcp.save returns on every rank after rank 0 consolidated the shards (its finish step).
    if rank == 0:
        shutil.rmtree(path / "sharded", ignore_errors=True)
        config = hf_config(args, export_dtype)
        (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    _barrier()
