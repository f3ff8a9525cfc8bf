"""What a checkpoint folder holds and how it is read and written: the storage half of
checkpointing (the policy, when to save and what to resume, is :mod:`.manager`'s).

A step folder ``step-<N>/`` holds DCP files (model and optimizer state, each rank writing only its
shards), or for an export Hugging Face safetensors (:mod:`.hf_storage`) or a PEFT adapter
(:mod:`.peft_storage`), and ``train_state.json`` (plain data: step, tokens seen, data position,
LR schedule, every rank's RNG state, the model's shape, the run's settings) and, for DCP,
``checksums.json`` (each file's size and CRC-32). Reading never runs code from a checkpoint: DCP's
metadata goes through the allow-list of :mod:`.safe_reading`, non-tensor values through
``torch.load(weights_only=True)``, the rest is JSON or safetensors; a data file the metadata
places outside the folder is refused.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import re
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchtitan_lite.checkpoint.hf_storage import (
    HFExportExtras,
    load_hf_weights,
    read_hf_config,
    save_hf_weights,
)
from torchtitan_lite.checkpoint.peft_storage import load_peft_adapter, save_peft_adapter
from torchtitan_lite.checkpoint.plain import plain_state
from torchtitan_lite.checkpoint.safe_reading import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    failure_reason,
)
from torchtitan_lite.distributed.lora import LoRASetup
from torchtitan_lite.errors import CheckpointError, ConfigError
from torchtitan_lite.models.spec import ModelSpec

logger = logging.getLogger("torchtitan_lite")


class SaveFailed(OSError):
    """A part of a save failed on some rank and every rank knows it (the message is its cause):
    the save is abandoned alike everywhere."""

__all__ = ["CHECKSUMS_FILE", "TRAIN_STATE_FILE", "CheckpointStorage", "SaveFailed", "check_initial_load_path",
           "checkpoint_model_args", "committed_steps", "fsync_dir", "read_train_state", "rng_state",
           "set_rng_state", "train_state_record", "weights_only", "write_json"]

_STEP_DIR = re.compile(r"^step-(\d+)$")
TRAIN_STATE_FILE = "train_state.json"
CHECKSUMS_FILE = "checksums.json"
"""Each file of a committed DCP checkpoint with its size and CRC-32, written at save."""


def committed_steps(folder: str | Path) -> list[int]:
    """Steps with a committed checkpoint: every ``step-N`` folder (only a commit creates one)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for e in folder.iterdir()
                  if (m := _STEP_DIR.match(e.name)) and e.is_dir())


def check_initial_load_path(path: str, *, in_hf: bool) -> None:
    """``checkpoint.initial_load_path`` names a DCP checkpoint folder (or, with ``in_hf``, a
    folder of safetensors files); raises :class:`ConfigError` otherwise."""
    folder = Path(path)
    key = "checkpoint.initial_load_path"
    if not folder.is_dir():
        raise ConfigError(f"{key}: invalid value {path!r}; no such folder")
    if in_hf:
        if not any(folder.glob("*.safetensors")):
            raise ConfigError(f"{key}: invalid value {path!r}; the folder holds no .safetensors files "
                              "(checkpoint.initial_load_in_hf is set)")
    elif not (folder / ".metadata").is_file():
        hint = (" (it holds .safetensors files: set checkpoint.initial_load_in_hf)"
                if any(folder.glob("*.safetensors")) else "")
        raise ConfigError(f"{key}: invalid value {path!r}; not a DCP checkpoint folder (no .metadata "
                          f"file){hint}")


def checkpoint_model_args(path: str | Path, *, in_hf: bool, spec: ModelSpec,
                          key: str = "checkpoint.initial_load_path") -> Any:
    """The model shape a checkpoint was written for (``model.flavor = "from_checkpoint"``): from
    a Hugging Face folder's ``config.json`` through the family's adapter, or from the
    ``model_args`` of one of our step folders. A folder that does not exist is a
    :class:`ConfigError` naming ``key``; one that does not say, or says something the family
    does not implement, a :class:`CheckpointError` naming the folder."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{key}: invalid value {str(path)!r}; no such folder")
    if in_hf:
        if spec.hf is None:
            raise ConfigError(f"model.flavor: invalid value 'from_checkpoint'; model {spec.name!r} has no "
                              "Hugging Face adapter")
        hf_config = read_hf_config(folder)
        if hf_config is None:
            raise CheckpointError(f"HF checkpoint {str(path)!r}: model.flavor = 'from_checkpoint' needs its "
                                  "config.json, and the folder has none")
        try:
            return spec.hf.args_from_config(hf_config)
        except ValueError as exc:
            from torchtitan_lite.models import family_hint

            raise CheckpointError(f"HF checkpoint {str(path)!r}: {exc}{family_hint(hf_config, spec)}") from None
    values = read_train_state(folder).get("model_args")
    if not isinstance(values, dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: its {TRAIN_STATE_FILE} records no model_args "
                              "for model.flavor = 'from_checkpoint'")
    try:
        return spec.args_from_dict(values)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r}: its model_args are not a {spec.name} shape: "
                              f"{exc}") from None


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: Path, data: dict[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


def read_train_state(path: Path) -> dict[str, Any]:
    """``train_state.json`` of a committed checkpoint, checked for completeness."""
    file = path / TRAIN_STATE_FILE
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {TRAIN_STATE_FILE} is missing "
                              "(move the folder away or set checkpoint.load_step)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {str(file)!r} cannot be read: {exc}") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"checkpoint {str(file)!r} is not a train state (no integer 'step')")
    if state.get("format", "dcp") in ("hf", "peft"):
        if not any(path.glob("*.safetensors")):
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: no .safetensors files")
    elif not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: its DCP .metadata file is missing")
    return state


def train_state_record(train_state: dict[str, Any], *, step: int, fmt: str, export_dtype: str | None,
                       world_size: int, model: Any, model_spec: ModelSpec | None, run_config: dict[str, Any] | None,
                       positions: dict[str, Any] | None) -> dict[str, Any]:
    """What a step folder's ``train_state.json`` holds: the trainer's ``train_state`` (tokens
    seen …), the step, the weights' ``format`` (``dcp``, ``hf``, ``peft``), whether it is
    weights only (``export_dtype`` set: the dtype they were written in), the world size, the
    model's family and shape (``model_args``), the run's settings (``config``) and, but for a
    seed checkpoint, the ``positions`` of the data loader, the LR schedule and every rank's RNG."""
    args = getattr(model, "args", None)
    return {**train_state, "step": step, "format": fmt, "model_only": export_dtype is not None,
            "export_dtype": export_dtype, "world_size": world_size,
            "model_name": None if model_spec is None else model_spec.name,
            "model_args": dataclasses.asdict(args) if dataclasses.is_dataclass(args) else None,
            "config": run_config, **(positions or {})}


def _file_crc32(path: Path) -> str:
    """A file's CRC-32 (zlib's, 16 MiB at a time), as 8 hex digits."""
    crc = 0
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def weights_only(path: Path) -> bool:
    try:
        return bool(json.loads((path / TRAIN_STATE_FILE).read_text(encoding="utf-8")).get("model_only"))
    except (OSError, ValueError, AttributeError):
        return False


def rng_state() -> dict[str, str]:
    """This process's CPU (and current CUDA device's) generator state, base64 for JSON."""
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict[str, str]) -> None:
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensor(state["cuda"]))


class CheckpointStorage:
    """The model's (and optimizer's) side of a checkpoint folder: what a save writes and how a
    folder is checked and loaded into them. ``lora``: the model's LoRA (its frozen base is never
    saved); ``model_spec``: the family, which Hugging Face folders need; ``hf_extras``: token ids
    and tokenizer files for a Hugging Face export. Methods marked "a collective" run on every rank."""

    def __init__(self, *, model: nn.Module, optimizer: torch.optim.Optimizer | None, model_spec: ModelSpec | None,
                 lora: LoRASetup | None, hf_extras: HFExportExtras | None) -> None:
        self.model, self.optimizer, self.model_spec = model, optimizer, model_spec
        self.lora, self.hf_extras = lora, hf_extras
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def spec(self) -> ModelSpec:
        """The model's family, which Hugging Face saves and loads need."""
        if self.model_spec is None:
            raise CheckpointError("Hugging Face checkpoints need the model's family: pass model_spec= "
                                  "to CheckpointManager")
        return self.model_spec

    def save_export(self, staging: Path, *, peft: bool, dtype: torch.dtype, base_name: str | None) -> None:
        """The weights as a Hugging Face folder, or with ``peft`` the LoRA adapters as a PEFT one."""
        if peft:
            save_peft_adapter(self.model, staging, spec=self.spec(), lora=self.lora,
                              dtype=dtype, base_model_name_or_path=base_name)
        else:  # LoRA adapters are merged into the weights
            save_hf_weights(self.model, staging, spec=self.spec(), dtype=dtype, extras=self.hf_extras)

    def dcp_state(self, *, model_only: bool, dtype: torch.dtype) -> dict[str, Any]:
        """What DCP saves: the model's state (in ``dtype`` when ``model_only``), else with the
        optimizer's."""
        model_sd = plain_state(self.model_state())
        if model_only:
            return {"model": {k: v.to(dtype) for k, v in model_sd.items()}}
        # Flattened: each parameter's state and group settings under its own name, so that a rank
        # saves (and loads) only its parameters' (pipeline stages hold different ones).
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer,
                                            options=StateDictOptions(flatten_optimizer_state_dict=True))
        return {"model": model_sd, "optimizer": plain_state(optim_sd)}

    def record_checksums(self, folder: Path, *, committed: bool = False) -> None:
        """Every rank's CRC-32 of the data files it wrote (``__<rank>_*.distcp``), gathered; rank 0
        adds ``.metadata`` and ``train_state.json`` and writes :data:`CHECKSUMS_FILE` (a
        collective), whole or not at all. Rank 0's write failing raises :class:`OSError`, or for
        a ``committed`` checkpoint (an async save's, recorded after its commit) is one warning:
        it is then verified without checksums."""
        mine: dict[str, Any] | str
        try:
            mine = {p.name: {"size": p.stat().st_size, "crc32": _file_crc32(p)}
                    for p in sorted(folder.glob(f"__{self.rank}_*.distcp"))}
        except OSError as exc:  # gathered as its reason: every rank learns it
            mine = failure_reason(exc)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        unread = next((part for part in gathered if isinstance(part, str)), None)
        if unread is not None:
            if not committed:
                raise SaveFailed(unread)
            if self.rank == 0:
                logger.warning("checkpoint %s: its checksums could not be recorded (%s); it is verified without "
                               "them", folder, unread)
            return
        if self.rank != 0:
            return
        files: dict[str, Any] = {}
        for part in gathered:
            files.update(part)
        for name in (".metadata", TRAIN_STATE_FILE):
            if (folder / name).is_file():
                files[name] = {"size": (folder / name).stat().st_size, "crc32": _file_crc32(folder / name)}
        partial = folder / f".{CHECKSUMS_FILE}.partial"
        try:
            write_json(partial, {"algorithm": "crc32", "files": files})
            os.replace(partial, folder / CHECKSUMS_FILE)
        except OSError as exc:
            partial.unlink(missing_ok=True)
            if not committed:
                raise
            logger.warning("checkpoint %s: its checksums could not be written (%s); it is verified without them",
                           folder, failure_reason(exc))

    def verify(self, path: Path) -> str | None:
        """Whether the checkpoint ``path`` can be resumed, by every rank alike (a collective):
        ``None``, or one line naming the step's file at fault. Always: ``train_state.json`` and
        DCP's metadata read, and every data file the metadata points to present and long
        enough. With :data:`CHECKSUMS_FILE` (written at save): each file's size and CRC-32, the
        files shared out over the ranks (each reads 1/world of the checkpoint). Metadata that
        names something a checkpoint never holds raises :class:`UnsafeCheckpointError` instead
        (not damage to fall back from: someone wrote it)."""
        problem: str | None = None
        try:
            state = read_train_state(path)
            if state.get("format", "dcp") == "dcp":
                try:
                    metadata = SafeFileSystemReader(str(path)).read_metadata()
                except UnsafeCheckpointError:
                    raise  # not damage: never set aside for an earlier checkpoint, the job stops
                except (Exception, CheckpointException) as exc:  # any unreadable metadata
                    raise CheckpointError(f"checkpoint {str(path)!r}: its .metadata cannot be read "
                                          f"({failure_reason(exc)})") from None
                check_files(path, metadata.storage_data)
            sums = path / CHECKSUMS_FILE
            if sums.is_file():
                try:
                    files = json.loads(sums.read_text(encoding="utf-8"))["files"]
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    raise CheckpointError(
                        f"checkpoint {str(path)!r}: {CHECKSUMS_FILE} cannot be read ({exc})"
                    ) from None
                for index, (name, want) in enumerate(sorted(files.items())):
                    if index % self.world_size != self.rank:
                        continue
                    file = path / name
                    if Path(name).name != name:
                        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: {CHECKSUMS_FILE} names "
                                              f"{name!r}, not a file of the folder")
                    if not file.is_file():
                        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: file {name!r} is missing")
                    if file.stat().st_size != want["size"]:
                        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: file {name!r} has "
                                              f"{file.stat().st_size} bytes, {want['size']} when saved")
                    if _file_crc32(file) != want["crc32"]:
                        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: file {name!r} does not "
                                              "match the checksum recorded when it was saved")
        except UnsafeCheckpointError:
            raise  # every rank reads the same metadata, so every rank stops here alike
        except CheckpointError as exc:
            problem = str(exc)
        if not (dist.is_available() and dist.is_initialized()):
            return problem
        problems: list[Any] = [None] * self.world_size
        dist.all_gather_object(problems, problem)
        return next((p for p in problems if p is not None), None)

    def load_weights(self, path: Path, format: str, parts: set[str], *, base: bool = False) -> None:
        """The model (and optimizer) parts of the checkpoint ``path`` written in ``format``
        (``dcp``, ``hf`` or ``peft``: its train state's). ``base``: only the frozen weights of a
        LoRA model (a Hugging Face folder's load leaves the adapters as they are anyway)."""
        if format == "dcp":
            self.load_dcp(path, parts, base=base)
        elif "model" in parts:
            (load_peft_adapter if format == "peft" else load_hf_weights)(self.model, path, spec=self.spec())

    def model_state(self, *, base: bool = False) -> dict[str, Any]:
        """The model's state that its checkpoints hold: all of it, or with LoRA all but the
        frozen parameters; ``base``: only those (what ``initial_load_path`` gives a LoRA run).
        Persistent buffers (a router's expert bias, which balancing moves in a LoRA run too) are
        in both."""
        state = get_model_state_dict(self.model)
        if self.lora is None:
            return state
        params = dict(self.model.named_parameters(remove_duplicate=False))
        return {k: v for k, v in state.items() if k not in params or params[k].requires_grad != base}

    def load_dcp(self, path: Path, parts: set[str], *, base: bool = False) -> None:
        """Load the model and/or optimizer from DCP files, each rank reading only its shards
        (``base``: only the frozen weights of a LoRA model)."""
        reader = SafeFileSystemReader(str(path))
        to_load: dict[str, Any] = {}
        if "model" in parts:
            to_load["model"] = model_sd = plain_state(self.model_state(base=base))
        if not to_load and "optimizer" not in parts:
            return
        optimizer_options = StateDictOptions(flatten_optimizer_state_dict=True)
        try:
            metadata = reader.read_metadata()
            if "optimizer" in parts:
                # Only when it is loaded: building the optimizer's state dict creates its state (a
                # zero-lr step that counts as Adam's first), which a fresh optimizer must not have.
                # Checkpoints before flattened optimizer states hold its parameter groups as one list.
                nested = any(re.match(r"optimizer\.param_groups\.\d+\.", key) for key in metadata.state_dict_metadata)
                optimizer_options = StateDictOptions(flatten_optimizer_state_dict=not nested)
                to_load["optimizer"] = plain_state(get_optimizer_state_dict(self.model, self.optimizer,
                                                                            options=optimizer_options))
            check_files(path, metadata.storage_data)
            if "model" in to_load:
                check_model_tensors(path, metadata.state_dict_metadata, model_sd)
            aliases = _tied_optimizer_aliases(self.model, to_load.get("optimizer"), metadata.state_dict_metadata)
            dcp.load(to_load, storage_reader=reader, planner=SafeLoadPlanner())
            for saved_key, key in aliases.items():
                to_load["optimizer"][key] = to_load["optimizer"].pop(saved_key)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded into this model: "
                                  f"{failure_reason(exc)}") from None
        if "model" in to_load:
            set_model_state_dict(self.model, to_load["model"],
                                 options=StateDictOptions(strict=self.lora is None))
        if "optimizer" in to_load:
            set_optimizer_state_dict(self.model, self.optimizer, to_load["optimizer"], options=optimizer_options)


def _tied_optimizer_aliases(model: Any, optimizer_sd: dict[str, Any] | None, saved: dict[str, Any]) -> dict[str, str]:
    """A pipeline's last stage holds tied embeddings as its own copy, ``output.weight``, whose
    optimizer state a checkpoint of a layout with the embedding and the output on one rank (one
    process, or a V schedule) keeps under the tied weight's first name only,
    ``tok_embeddings.weight`` (its state and parameter group): those entries of ``optimizer_sd`` are
    renamed to be read from there
    (in place). Returns ``{name read: this rank's name}`` to rename them back after the load."""
    args = getattr(model, "args", None)  # (a model of one's own family may keep no args)
    if optimizer_sd is None or args is None or not args.tie_word_embeddings:
        return {}
    aliases = {}
    for key in list(optimizer_sd):
        part, _, rest = key.partition(".output.weight.")  # (state.… and param_groups.…)
        if part not in ("state", "param_groups") or not rest:
            continue
        other = f"{part}.tok_embeddings.weight.{rest}"
        if f"optimizer.{key}" not in saved and f"optimizer.{other}" in saved and other not in optimizer_sd:
            optimizer_sd[other] = optimizer_sd.pop(key)
            aliases[other] = key
    return aliases


def check_model_tensors(path: Path, saved: dict[str, Any], model_sd: dict[str, Any]) -> None:
    """Every model tensor is in the checkpoint with the same shape (else one clear error)."""
    saved_model = sorted(k[len("model."):] for k in saved if k.startswith("model."))
    for name, tensor in model_sd.items():
        meta = saved.get(f"model.{name}")
        if meta is None:
            held = (f"it holds {len(saved_model)} model tensors, e.g. {saved_model[0]!r}"
                    if saved_model else "it holds no model weights")
            raise CheckpointError(f"checkpoint {str(path)!r} has no model tensor {name!r}: it was "
                                  f"saved from another model ({held})")
        size = getattr(meta, "size", None)
        if size is not None and tuple(size) != tuple(tensor.shape):
            raise CheckpointError(f"checkpoint {str(path)!r}: model tensor {name!r} has shape "
                                  f"{list(size)} there but {list(tensor.shape)} in this model")


def check_files(path: Path, storage_data: Any) -> None:
    """Every data file the metadata points to exists and is long enough (else one clear error)."""
    needed: dict[str, int] = {}
    for info in (storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise UnsafeCheckpointError(f"checkpoint metadata {str(path / '.metadata')!r} places data file {name!r} "
                                        "outside the checkpoint folder: refused (a DCP checkpoint never does)")
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: data file {name!r} is missing")
        if file.stat().st_size < size:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: data file {name!r} has "
                                  f"{file.stat().st_size} bytes, its metadata needs at least {size}")
