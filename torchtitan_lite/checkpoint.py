"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): save, commit, prune, resume.

Layout: ``<dump_folder>/<checkpoint.folder>/step-<N>/`` holds the DCP files (model and optimizer
state, each rank writing only its shards) and ``train_state.json`` (plain data: step, tokens
seen, data loader position, LR scheduler state). A checkpoint is written under a temporary name
and renamed to ``step-<N>`` by rank 0 only after every rank's data and the metadata are on disk,
so a crash mid-save never leaves a half-written ``step-<N>``: the previous one stays the latest.

Loading never unpickles arbitrary objects: DCP's metadata file is read with an unpickler that
only builds DCP's own metadata classes, and everything that is not a tensor lives in JSON.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from torchtitan_lite.config import ConfigError

__all__ = ["CheckpointError", "CheckpointManager", "SafeFileSystemReader", "committed_steps"]

logger = logging.getLogger("torchtitan_lite")

_STEP_DIR = re.compile(r"^step-(\d+)$")
TRAIN_STATE_FILE = "train_state.json"
LOADABLE_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: missing, incomplete, or made for another model."""


# --------------------------------------------------------------------------------------------
# Safe reading of DCP metadata
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Folders
# --------------------------------------------------------------------------------------------


def committed_steps(folder: str | Path) -> list[int]:
    """Steps with a committed checkpoint (``step-N`` holding DCP metadata and the train state)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    steps = []
    for entry in folder.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / ".metadata").is_file() and (entry / TRAIN_STATE_FILE).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def _fsync_dir(path: Path) -> None:
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


class CheckpointManager:
    """Saves and restores the model, optimizer, LR scheduler, data loader and train state.

    All ranks call :meth:`save` and :meth:`load` together (they are collectives). The
    arguments are those of a validated ``[checkpoint]`` section.
    """

    def __init__(
        self,
        *,
        folder: str | Path,
        interval: int,
        keep_latest_k: int,
        load_step: int,
        exclude_from_loading: list[str],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        loader: Any,
        rank: int,
    ) -> None:
        self.folder = Path(folder)
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.load_step = load_step
        self.exclude = set(exclude_from_loading)
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.loader = loader
        self.rank = rank

    # ----------------------------------------------------------------------------------------

    def should_save(self, step: int, *, last: bool) -> bool:
        return step % self.interval == 0 or last

    def save(self, step: int, train_state: dict[str, Any]) -> Path:
        """Write ``step-<step>`` (all ranks); returns its path once committed."""
        final = self.folder / f"step-{step}"
        staging = self.folder / f".step-{step}.partial"
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging)  # left by an earlier crash; never a committed checkpoint
        dist.barrier()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(staging))
        # dcp.save returns on every rank only after rank 0 has written the metadata, which it
        # does only after every rank reported its shards written.
        if self.rank == 0:
            state = {
                **train_state,
                "step": step,
                "dataloader": self.loader.state_dict(),
                "lr_scheduler": self.lr_scheduler.state_dict(),
                "world_size": dist.get_world_size(),
            }
            path = staging / TRAIN_STATE_FILE
            with path.open("w", encoding="utf-8") as fh:
                json.dump(state, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            _fsync_dir(staging)
            if final.exists():
                shutil.rmtree(final)  # the same step saved again (e.g. a re-run of a finished job)
            os.replace(staging, final)  # the commit: atomic on one filesystem
            _fsync_dir(self.folder)
            self._prune()
            logger.info("checkpoint step %d saved to %s", step, final)
        dist.barrier()
        return final

    def _prune(self) -> None:
        if self.keep_latest_k <= 0:
            return
        for old in committed_steps(self.folder)[: -self.keep_latest_k]:
            shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)

    # ----------------------------------------------------------------------------------------

    def load(self) -> dict[str, Any] | None:
        """Restore the chosen checkpoint (``load_step``, else the latest); returns its train state,
        or None when the folder holds no committed checkpoint (a fresh start)."""
        steps = committed_steps(self.folder)
        if self.load_step >= 0:
            if self.load_step not in steps:
                raise CheckpointError(
                    f"checkpoint.load_step: invalid value {self.load_step}; {str(self.folder)!r} "
                    f"holds committed steps {steps or 'none'}"
                )
            step = self.load_step
        elif not steps:
            return None
        else:
            step = steps[-1]
        path = self.folder / f"step-{step}"
        state = json.loads((path / TRAIN_STATE_FILE).read_text(encoding="utf-8"))
        to_load: dict[str, Any] = {}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if "model" not in self.exclude:
            to_load["model"] = model_sd
        if "optimizer" not in self.exclude:
            to_load["optimizer"] = optim_sd
        if to_load:
            try:
                dcp.load(to_load, storage_reader=SafeFileSystemReader(str(path)))
            except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
                raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded into this model: "
                                      f"{_reason(exc)}") from None
            set_state_dict(
                self.model, self.optimizer,
                model_state_dict=to_load.get("model", {}),
                optim_state_dict=to_load.get("optimizer", {}),
            )
        if "lr_scheduler" not in self.exclude:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if "dataloader" not in self.exclude:
            self.loader.load_state_dict(state["dataloader"])
        if self.rank == 0:
            logger.info("resumed from %s (saved at world size %s)", path, state.get("world_size"))
        return {} if "train_state" in self.exclude else state


def _reason(exc: BaseException) -> str:
    """The first rank failure inside a DCP exception, as one line."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        exc = next(iter(failures.values()))
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
