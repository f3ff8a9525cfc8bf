"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): save, commit, prune, resume, import.

Layout: ``<dump_folder>/<checkpoint.folder>/step-<N>/`` holds the DCP files (model and optimizer
state, each rank writing only its shards) and ``train_state.json`` (plain data: step, tokens
seen, data loader position, LR scheduler state, every rank's RNG state, the model's shape). A
checkpoint is written under a temporary name (``.step-<N>.partial``) and renamed to
``step-<N>`` by rank 0 only after every rank's data and the metadata are on disk, so a crash
mid-save never leaves a half-written ``step-<N>``: the previous one stays the latest. A
``step-<N>`` folder that is nevertheless incomplete (files deleted by hand) is an error, never
a silent fresh start.

Model-only checkpoints (the seed checkpoint at step 0, ``last_save_model_only``) hold the
weights in ``export_dtype``; ``last_save_in_hf`` writes them as Hugging Face safetensors.

With LoRA (``lora``) the frozen base weights are never saved: a DCP checkpoint holds the
adapters and their optimizer state, and the base comes again from ``initial_load_path`` (loaded
on every start, resumes included) or from the seeded initialisation. ``last_save_in_hf`` then
writes a PEFT adapter folder (:mod:`.peft_storage`), or with ``lora.merge_on_export`` the merged
weights as a Hugging Face folder.

Loading never runs code from a checkpoint: DCP's metadata file is read by the allow-listed
unpickler of :mod:`.safe_reading` (one that names anything else stops the job, exit 4, and is not
set aside as damage), non-tensor values (the optimizer's hyper-parameters) are read with
``torch.load(weights_only=True)``, and everything else lives in JSON.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import json
import logging
import os
import re
import shutil
import threading
import time
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
from torchtitan_lite.config.schema import LOADABLE_PARTS, Checkpoint
from torchtitan_lite.distributed.lora import LoRAPlan
from torchtitan_lite.dtypes import DTYPES
from torchtitan_lite.errors import CheckpointError, ConfigError
from torchtitan_lite.models.spec import ModelSpec
from torchtitan_lite.optim import load_lr_scheduler_position

__all__ = [
    "checkpoint_model_args",
    "CHECKSUMS_FILE",
    "TRAIN_STATE_FILE",
    "CheckpointManager",
    "check_initial_load_path",
    "committed_steps",
]

logger = logging.getLogger("torchtitan_lite")

_STEP_DIR = re.compile(r"^step-(\d+)$")
# Settings a resumed run must keep (a vocabulary change is caught by the weights' shapes).
_FIXED_ON_RESUME = ("model.name", "model.tokenizer_path", "lora.enable")
# Settings that name places and say nothing about training.
_NOT_SHOWN = ("job.dump_folder", "job.config_file", "checkpoint.load_step")
TRAIN_STATE_FILE = "train_state.json"
CHECKSUMS_FILE = "checksums.json"
"""Each file of a committed DCP checkpoint with its size and CRC-32, written at save."""
# --------------------------------------------------------------------------------------------
# Folders
# --------------------------------------------------------------------------------------------


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
    values = _read_train_state(folder).get("model_args")
    if not isinstance(values, dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: its {TRAIN_STATE_FILE} records no model_args "
                              "for model.flavor = 'from_checkpoint'")
    try:
        return spec.args_from_dict(values)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r}: its model_args are not a {spec.name} shape: "
                              f"{exc}") from None


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


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


def _read_train_state(path: Path) -> dict[str, Any]:
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


def _file_crc32(path: Path) -> str:
    """A file's CRC-32 (zlib's, 16 MiB at a time), as 8 hex digits."""
    crc = 0
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _weights_only(path: Path) -> bool:
    try:
        return bool(json.loads((path / TRAIN_STATE_FILE).read_text(encoding="utf-8")).get("model_only"))
    except (OSError, ValueError, AttributeError):
        return False


def _rng_state() -> dict[str, str]:
    """This process's CPU (and current CUDA device's) generator state, base64 for JSON."""
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _set_rng_state(state: dict[str, str]) -> None:
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensor(state["cuda"]))


@dataclasses.dataclass
class _PendingSave:
    step: int
    staging: Path
    final: Path
    future: Any
    started: float
    committed: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class CheckpointManager:
    """Saves and restores the model, optimizer, LR scheduler, data loader and train state.

    ``config`` is a validated ``[checkpoint]`` section; checkpoints live in
    ``<dump_folder>/<config.folder>``. ``model_spec`` (the model's family) is needed for
    Hugging Face saves and loads. ``timeout_s`` bounds the collectives of background saves.
    ``lora``: the model's LoRA (its frozen base is not saved; see the module's notes). All ranks
    call :meth:`load`, :meth:`save`, :meth:`wait` and :meth:`close` together (they are collectives).
    """

    def __init__(
        self,
        config: Checkpoint,
        *,
        dump_folder: str | Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        loader: Any,
        model_spec: ModelSpec | None = None,
        timeout_s: float = 1800.0,
        hf_extras: HFExportExtras | None = None,
        run_config: dict[str, Any] | None = None,
        lora: LoRAPlan | None = None,
    ) -> None:
        self.config = config
        self.lora = lora
        self.run_config = run_config  # the job's settings ("section.key": value), saved with each checkpoint
        self.model_spec = model_spec
        self.hf_extras = hf_extras  # token ids and tokenizer files for a Hugging Face export
        self.folder = Path(dump_folder) / config.folder
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.loader = loader
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._pending: _PendingSave | None = None
        self.saved_step = -1  # the step of the last save this manager made (committed or in flight)
        self.last_blocked_s = 0.0  # how long the last save held up training
        # Background saves talk over their own gloo group: collectives of the training loop on
        # the default group and those of the save thread must never interleave.
        self._async_group = (dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
                             if config.enable and config.async_mode == "async" else None)

    def _spec(self) -> ModelSpec:
        """The model's family, which Hugging Face saves and loads need."""
        if self.model_spec is None:
            raise CheckpointError("Hugging Face checkpoints need the model's family: pass model_spec= "
                                  "to CheckpointManager")
        return self.model_spec

    # ----------------------------------------------------------------------------------------
    # Saving
    # ----------------------------------------------------------------------------------------

    def should_save(self, step: int, *, last: bool) -> bool:
        return self.config.enable and (step % self.config.interval == 0 or last)

    def save(self, step: int, train_state: dict[str, Any], *, last: bool = False, sync: bool = False) -> Path:
        """Write ``step-<step>``; returns its path. Synchronous saves return once it is
        committed; asynchronous ones once the state is copied to CPU memory (the commit
        happens in :meth:`wait`, which the next save and the end of training call).
        ``sync``: synchronous even with ``async_mode = "async"`` (a save before exiting).

        Step 0 (the seed checkpoint) and, with ``last_save_model_only``, the last step save
        only the model weights, in ``export_dtype``; ``last_save_in_hf`` writes those as
        Hugging Face safetensors.
        """
        self.wait()
        started = time.perf_counter()
        self.saved_step = step
        cfg = self.config
        model_only = step == 0 or (last and cfg.last_save_model_only)
        in_hf = model_only and last and cfg.last_save_in_hf
        in_peft = in_hf and self.lora is not None and not self.lora.merge_on_export
        final = self.folder / f"step-{step}"
        staging = self.folder / f".step-{step}.partial"
        rng: list[Any] = [None] * self.world_size
        if step > 0:
            dist.all_gather_object(rng, _rng_state())
        if not model_only:
            self.loader.gather_state()  # every rank's data position into the state rank 0 saves
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging)  # left by an earlier crash; never a committed checkpoint
            staging.mkdir()
            args = getattr(self.model, "args", None)
            state_json = {
                **train_state,
                "step": step,
                "format": "peft" if in_peft else "hf" if in_hf else "dcp",
                "model_only": model_only,
                "export_dtype": cfg.export_dtype if model_only else None,
                "world_size": self.world_size,
                "model_name": None if self.model_spec is None else self.model_spec.name,
                "model_args": dataclasses.asdict(args) if dataclasses.is_dataclass(args) else None,
                "config": self.run_config,
            }
            if step > 0:  # a seed checkpoint is weights only: runs from it choose their own data/schedule
                state_json.update(dataloader=self.loader.state_dict(),
                                  lr_scheduler=self.lr_scheduler.state_dict(), rng=rng)
            _write_json(staging / TRAIN_STATE_FILE, state_json)
        dist.barrier()
        dtype = DTYPES[cfg.export_dtype] if last else torch.float32  # the seed keeps fp32
        if in_hf:
            if in_peft:
                base_name = cfg.initial_load_path if cfg.initial_load_in_hf else None
                save_peft_adapter(self.model, staging, spec=self._spec(), lora=self.lora,  # type: ignore[arg-type]
                                  dtype=dtype, base_model_name_or_path=base_name)
            else:  # LoRA adapters are merged into the weights
                save_hf_weights(self.model, staging, spec=self._spec(), dtype=dtype, extras=self.hf_extras)
            self._commit(step, staging, final, started)
            dist.barrier()
            return final
        model_sd = plain_state(self._model_state())
        if model_only:
            state: dict[str, Any] = {"model": {k: v.to(dtype) for k, v in model_sd.items()}}
        else:
            optim_sd = get_optimizer_state_dict(self.model, self.optimizer)
            state = {"model": model_sd, "optimizer": plain_state(optim_sd)}
        if self._async_group is not None and not sync:
            response = dcp.async_save(state, checkpoint_id=str(staging), process_group=self._async_group)
            future = getattr(response, "upload_completion", response)
            pending = self._pending = _PendingSave(step, staging, final, future, started)
            if self.rank == 0:
                # Rank 0's save finishes after every rank's shards and the metadata are written:
                # commit then, from the writing thread, not at the next save (a crash in between
                # would otherwise lose a complete checkpoint).
                future.add_done_callback(lambda done, pending=pending: self._commit_when_written(done, pending))
            self.last_blocked_s = time.perf_counter() - started
            if self.rank == 0:
                logger.info("checkpoint step %d: training blocked %.3f s to stage it; writing in the "
                            "background", step, self.last_blocked_s)
            return final
        # dcp.save returns on every rank only after rank 0 has written the metadata, which it
        # does only after every rank reported its shards written; a rank's failure reaches all.
        try:
            dcp.save(state, checkpoint_id=str(staging))
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            raise self._failed(step, staging, exc) from None
        self._record_checksums(staging)
        self._commit(step, staging, final, started)
        dist.barrier()
        self.last_blocked_s = time.perf_counter() - started
        return final

    def wait(self) -> None:
        """Wait for the background save (if any) to finish and commit it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.future.result()
        except (Exception, CheckpointException) as exc:
            raise self._failed(pending.step, pending.staging, exc) from None
        self._commit_once(pending)
        # Committed from the writer thread, where no collective can run: its checksums now (until
        # then keep_latest_k keeps the newest checkpoint that has them).
        self._record_checksums(pending.final)
        if self.rank == 0:
            self._prune()

    def _failed(self, step: int, staging: Path, exc: BaseException) -> CheckpointError:
        """The one-line error of a save that failed (its cause: e.g. "No space left on device");
        rank 0 removes the partial folder, so a full disk is not kept full. Earlier checkpoints
        are untouched."""
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        kept = committed_steps(self.folder)
        return CheckpointError(f"saving checkpoint step {step} to {str(self.folder)!r} failed: {failure_reason(exc)}; "
                               f"the partial folder was removed and the checkpoints {kept or 'before it'} are intact")

    def _commit_when_written(self, future: Any, pending: _PendingSave) -> None:
        """Done-callback of a background save (rank 0): commit it if it succeeded. A failure is
        left for :meth:`wait` to report; nothing here may raise into the writer thread."""
        try:
            if future.exception() is None:
                self._commit_once(pending)
        except BaseException:  # noqa: BLE001 - reported by wait(), which commits again or raises
            logger.exception("checkpoint step %d: committing in the background failed", pending.step)

    def _commit_once(self, pending: _PendingSave) -> None:
        with pending.lock:
            if not pending.committed:
                self._commit(pending.step, pending.staging, pending.final, pending.started)
                pending.committed = True

    @property
    def process_groups(self) -> list[Any]:
        """The groups this manager created (the background save's), e.g. for their timeouts."""
        return [] if self._async_group is None else [self._async_group]

    def close(self) -> None:
        """Finish a pending background save and release the save group."""
        self.wait()
        if self._async_group is not None:
            dist.destroy_process_group(self._async_group)
            self._async_group = None

    def _commit(self, step: int, staging: Path, final: Path, started: float) -> None:
        """Rank 0 renames the complete staging folder to ``step-<N>`` (atomic on one
        filesystem), then prunes to ``keep_latest_k``."""
        if self.rank != 0:
            return
        _fsync_dir(staging)
        replaced = self.folder / f".step-{step}.replaced"
        shutil.rmtree(replaced, ignore_errors=True)  # left by a crash inside an earlier commit
        if final.exists():  # only a seed checkpoint can be saved again over itself
            os.replace(final, replaced)
        os.replace(staging, final)
        _fsync_dir(self.folder)
        shutil.rmtree(replaced, ignore_errors=True)
        self._prune()
        logger.info("checkpoint step %d saved to %s (%.2f s)", step, final, time.perf_counter() - started)

    def _record_checksums(self, folder: Path) -> None:
        """Every rank's CRC-32 of the data files it wrote (``__<rank>_*.distcp``), gathered; rank 0
        adds ``.metadata`` and ``train_state.json`` and writes :data:`CHECKSUMS_FILE` (a
        collective)."""
        mine = {p.name: {"size": p.stat().st_size, "crc32": _file_crc32(p)}
                for p in sorted(folder.glob(f"__{self.rank}_*.distcp"))}
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        if self.rank != 0:
            return
        files: dict[str, Any] = {}
        for part in gathered:
            files.update(part)
        for name in (".metadata", TRAIN_STATE_FILE):
            if (folder / name).is_file():
                files[name] = {"size": (folder / name).stat().st_size, "crc32": _file_crc32(folder / name)}
        _write_json(folder / CHECKSUMS_FILE, {"algorithm": "crc32", "files": files})

    def _prune(self) -> None:
        """Rank 0: keep the newest ``keep_latest_k`` checkpoints that are resume points (weights-only
        saves, exports, neither count nor go), and never delete the newest one whose checksums
        were recorded while a newer one has none yet (an async save not yet waited for)."""
        if self.config.keep_latest_k <= 0:
            return
        full = [s for s in committed_steps(self.folder) if not _weights_only(self.folder / f"step-{s}")]
        checked = [s for s in full if (self.folder / f"step-{s}" / CHECKSUMS_FILE).is_file()]
        keep = set(full[-self.config.keep_latest_k:])
        if checked and checked[-1] != full[-1]:
            keep.add(checked[-1])
        for old in full:
            if old not in keep:
                shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)

    # ----------------------------------------------------------------------------------------
    # Loading
    # ----------------------------------------------------------------------------------------

    def load(self) -> dict[str, Any] | None:
        """Restore the job's own checkpoint (``load_step``, else the latest in the folder), or
        else ``initial_load_path``; returns the restored train state ({} for weights only), or
        None when there is nothing to load (a fresh start)."""
        cfg = self.config
        parts = set(LOADABLE_PARTS) - set(cfg.exclude_from_loading)
        steps = committed_steps(self.folder) if cfg.enable else []
        if cfg.enable and cfg.load_step >= 0 and cfg.load_step not in steps:
            raise CheckpointError(
                f"checkpoint.load_step: invalid value {cfg.load_step}; {str(self.folder)!r} "
                f"holds committed steps {steps or 'none'}"
            )
        if self.lora is not None:
            self._load_base()  # the frozen weights: never in this run's own checkpoints
        if steps:
            step = self._newest_that_verifies(steps)
            steps = committed_steps(self.folder)  # damaged ones were set aside
            start = step if "train_state" in parts else 0
            later = [s for s in steps if s > start]
            if later:  # the run would save over them: never without being asked
                raise CheckpointError(
                    f"checkpoint.load_step: resuming at step {start} would overwrite the later "
                    f"checkpoints {later} in {str(self.folder)!r}; move them out of the folder (or "
                    "use another checkpoint.folder) to continue from there"
                )
            return self._load_from(self.folder / f"step-{step}", parts)
        if cfg.initial_load_path is None:
            return None
        if self.lora is not None:
            return {}  # loaded above: the base weights (a LoRA run's adapters start at their init)
        path = Path(cfg.initial_load_path)
        if cfg.initial_load_in_hf:
            load_hf_weights(self.model, path, spec=self._spec())
            if self.rank == 0:
                logger.info("model weights loaded from Hugging Face checkpoint %s", path)
            return {}
        if cfg.initial_load_model_only:
            self._load_dcp(path, {"model"})
            if self.rank == 0:
                logger.info("model weights loaded from %s", path)
            return {}
        return self._load_from(path, parts)

    def _newest_that_verifies(self, steps: list[int]) -> int:
        """The step to resume: ``load_step``, else the newest committed one that verifies
        (:meth:`verify`). A damaged one is logged with the file at fault; with ``on_corrupt =
        "fallback"`` it is renamed ``step-<N>.corrupt`` (kept, out of the way of this run's
        saves) and the one before is tried; with ``"stop"``, or an explicit ``load_step``, or
        none left, it is a :class:`CheckpointError` (exit 4)."""
        cfg = self.config
        candidates = [cfg.load_step] if cfg.load_step >= 0 else list(reversed(steps))
        set_aside: list[int] = []
        newest: str | None = None
        for step in candidates:
            problem = self.verify(self.folder / f"step-{step}")
            if problem is None:
                if set_aside and self.rank == 0:
                    logger.warning("resuming from checkpoint step %d, the newest that verifies (set aside: %s)",
                                   step, ", ".join(f"step-{s}.corrupt" for s in set_aside))
                return step
            newest = newest or problem
            if self.rank == 0:
                logger.warning("checkpoint step %d does not verify: %s", step, problem)
            if cfg.on_corrupt == "stop" or cfg.load_step >= 0:
                how = ("checkpoint.load_step names it" if cfg.load_step >= 0 else "checkpoint.on_corrupt = 'stop'")
                raise CheckpointError(f"{problem}; not resuming ({how}): move the folder away, or set "
                                      "checkpoint.on_corrupt = 'fallback' to resume from the newest earlier "
                                      "checkpoint that verifies")
            if self.rank == 0:
                aside = self.folder / f"step-{step}.corrupt"
                suffix = 1
                while aside.exists():
                    aside, suffix = self.folder / f"step-{step}.corrupt{suffix}", suffix + 1
                os.replace(self.folder / f"step-{step}", aside)
                _fsync_dir(self.folder)
            dist.barrier()
            set_aside.append(step)
        raise CheckpointError(f"{newest}; no checkpoint in {str(self.folder)!r} verifies (steps {steps}, now "
                              "renamed step-<N>.corrupt; each one's reason is logged): not starting afresh over "
                              "them; move the folder away to start from scratch")

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
            state = _read_train_state(path)
            if state.get("format", "dcp") == "dcp":
                try:
                    metadata = SafeFileSystemReader(str(path)).read_metadata()
                except UnsafeCheckpointError:
                    raise  # not damage: never set aside for an earlier checkpoint, the job stops
                except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any unreadable metadata
                    raise CheckpointError(f"checkpoint {str(path)!r}: its .metadata cannot be read "
                                          f"({failure_reason(exc)})") from None
                _check_files(path, metadata.storage_data)
            sums = path / CHECKSUMS_FILE
            if sums.is_file():
                try:
                    files = json.loads(sums.read_text(encoding="utf-8"))["files"]
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    raise CheckpointError(f"checkpoint {str(path)!r}: {CHECKSUMS_FILE} cannot be read ({exc})") from None
                for index, (name, want) in enumerate(sorted(files.items())):
                    if index % self.world_size != self.rank:
                        continue
                    file = path / name
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

    def rollback(self) -> dict[str, Any] | None:
        """Reload everything from the latest committed checkpoint of this run that holds the
        optimizer too (``training.on_nonfinite = "rollback"``); returns its train state, or None
        when there is none. A background save still running is committed first."""
        self.wait()
        full = [s for s in committed_steps(self.folder) if s > 0 and not _weights_only(self.folder / f"step-{s}")]
        if not full:
            return None
        return self._load_from(self.folder / f"step-{full[-1]}", set(LOADABLE_PARTS))

    def _load_from(self, path: Path, parts: set[str]) -> dict[str, Any]:
        state = _read_train_state(path)
        if "train_state" in parts:
            self._check_changes(path, state.get("config"))  # before any weight is read
        if state.get("model_only") and "optimizer" in parts:
            parts = parts - {"optimizer"}
            if state["step"] > 0 and self.rank == 0:
                logger.warning("checkpoint %s holds model weights only (%s): the optimizer state "
                               "starts fresh", path, state.get("export_dtype"))
        if state.get("format", "dcp") == "hf":
            if "model" in parts:
                load_hf_weights(self.model, path, spec=self._spec())
        elif state.get("format") == "peft":
            if "model" in parts:
                load_peft_adapter(self.model, path, spec=self._spec())
        else:
            self._load_dcp(path, parts)
        if "lr_scheduler" in parts and "lr_scheduler" in state:
            # The schedule's position comes from the checkpoint; its settings (peak lr, and the
            # warmup/decay/steps that shape it) from this run's config, from this step on.
            load_lr_scheduler_position(self.lr_scheduler, self.optimizer, state["lr_scheduler"])
        if "dataloader" in parts and "dataloader" in state:
            self.loader.load_state_dict(state["dataloader"])
        if self.rank == 0:
            logger.info("resumed from %s (step %d, saved at world size %s)",
                        path, state["step"], state.get("world_size"))
        if "train_state" not in parts:
            return {}
        saved_rng = state.get("rng")
        if saved_rng:
            # The same world size gets each rank's own generator back; another one gets rank 0's.
            _set_rng_state(saved_rng[self.rank] if len(saved_rng) == self.world_size else saved_rng[0])
        return state

    def _check_changes(self, path: Path, saved: Any) -> None:
        """Compare this run's settings with those the checkpoint was trained with: list the
        changes (rank 0, one log line); refuse the ones a resumed run cannot take."""
        if not isinstance(saved, dict) or self.run_config is None:
            return
        changed = {k: (saved.get(k), v) for k, v in self.run_config.items() if k in saved and saved[k] != v}
        for key in _FIXED_ON_RESUME:
            if key in changed:
                before, now = changed[key]
                raise ConfigError(f"{key}: invalid value {now!r}; {str(path)!r} was trained with {before!r}, and a "
                                  "resumed run cannot change it (start a new run from it with "
                                  "checkpoint.initial_load_path instead)")
        shown = {k: v for k, v in changed.items() if not k.startswith(_NOT_SHOWN)}
        if shown and self.rank == 0:
            logger.warning("resuming %s with changed settings (they apply from step %s on): %s", path,
                           path.name.removeprefix("step-"),
                           "; ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(shown.items())))

    def _model_state(self, *, base: bool = False) -> dict[str, Any]:
        """The model's state that its checkpoints hold: all of it, or with LoRA all but the
        frozen parameters; ``base``: only those (what ``initial_load_path`` gives a LoRA run)."""
        state = get_model_state_dict(self.model)
        if self.lora is None:
            return state
        frozen = {name for name, param in self.model.named_parameters(remove_duplicate=False)
                  if not param.requires_grad}
        return {k: v for k, v in state.items() if (k in frozen) == base}

    def _load_base(self) -> None:
        """A LoRA run's frozen weights from ``initial_load_path`` (Hugging Face or DCP; the adapters
        keep their init); without one they stay as initialised from the seed."""
        cfg = self.config
        if cfg.initial_load_path is None:
            return
        path = Path(cfg.initial_load_path)
        if cfg.initial_load_in_hf:
            load_hf_weights(self.model, path, spec=self._spec())  # every weight but the adapters
        else:
            self._load_dcp(path, {"model"}, base=True)
        if self.rank == 0:
            logger.info("base weights loaded from %s (LoRA: frozen, never saved)", path)

    def _load_dcp(self, path: Path, parts: set[str], *, base: bool = False) -> None:
        """Load the model and/or optimizer from DCP files, each rank reading only its shards
        (``base``: only the frozen weights of a LoRA model)."""
        reader = SafeFileSystemReader(str(path))
        to_load: dict[str, Any] = {}
        if "model" in parts:
            to_load["model"] = model_sd = plain_state(self._model_state(base=base))
        if "optimizer" in parts:
            # Only when it is loaded: building the optimizer's state dict creates its state (a
            # zero-lr step that counts as Adam's first), which a fresh optimizer must not have.
            to_load["optimizer"] = plain_state(get_optimizer_state_dict(self.model, self.optimizer))
        if not to_load:
            return
        try:
            metadata = reader.read_metadata()
            _check_files(path, metadata.storage_data)
            if "model" in to_load:
                _check_model_tensors(path, metadata.state_dict_metadata, model_sd)
            dcp.load(to_load, storage_reader=reader, planner=SafeLoadPlanner())
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded into this model: "
                                  f"{failure_reason(exc)}") from None
        if "model" in to_load:
            set_model_state_dict(self.model, to_load["model"],
                                 options=StateDictOptions(strict=self.lora is None))
        if "optimizer" in to_load:
            set_optimizer_state_dict(self.model, self.optimizer, to_load["optimizer"])


def _check_model_tensors(path: Path, saved: dict[str, Any], model_sd: dict[str, Any]) -> None:
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


def _check_files(path: Path, storage_data: Any) -> None:
    """Every data file the metadata points to exists and is long enough (else one clear error)."""
    needed: dict[str, int] = {}
    for info in (storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: data file {name!r} is missing")
        if file.stat().st_size < size:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: data file {name!r} has "
                                  f"{file.stat().st_size} bytes, its metadata needs at least {size}")
