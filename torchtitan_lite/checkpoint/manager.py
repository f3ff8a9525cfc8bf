"""When to save, what to resume, and what to do with a damaged checkpoint: the policy half of
checkpointing (the storage half, what a folder holds and how it is read and written, is
:mod:`.storage`; folder commits and retention :mod:`.commit`).

Layout: ``<dump_folder>/<checkpoint.folder>/step-<N>/`` (:mod:`.storage`). Saves are committed
atomically (:mod:`.commit`): a crash mid-save never leaves a half-written ``step-<N>``, and a
``step-<N>`` that is nevertheless damaged is found before resuming (``checkpoint.on_corrupt``),
never a silent fresh start. Model-only checkpoints (the seed checkpoint at step 0,
``last_save_model_only``) hold the weights in ``export_dtype``; ``last_save_in_hf`` writes them as
Hugging Face safetensors. With LoRA (``lora``) the frozen base weights are never saved: a DCP
checkpoint holds the adapters and their optimizer state, and the base comes again from
``initial_load_path`` (loaded on every start, resumes included) or from the seeded
initialisation; ``last_save_in_hf`` then writes a PEFT adapter folder, or with
``lora.merge_on_export`` the merged weights. Loading never runs code from a checkpoint (a
metadata file that tries to stops the job, exit 4, and is not set aside as damage).
"""

from __future__ import annotations

import datetime
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan_lite.checkpoint.commit import PendingSave, SaveFailures, StepFolders, newest_that_verifies, prune
from torchtitan_lite.checkpoint.hf_storage import HFExportExtras
from torchtitan_lite.checkpoint.safe_reading import failure_reason
from torchtitan_lite.checkpoint.storage import (
    CHECKSUMS_FILE,
    TRAIN_STATE_FILE,
    CheckpointStorage,
    SaveFailed,
    check_initial_load_path,
    checkpoint_model_args,
    committed_steps,
    read_train_state,
    rng_state,
    set_rng_state,
    train_state_record,
    weights_only,
    write_json,
)
from torchtitan_lite.config.schema import LOADABLE_PARTS, Checkpoint
from torchtitan_lite.distributed.lora import LoRASetup
from torchtitan_lite.dtypes import DTYPES
from torchtitan_lite.errors import CheckpointError, ConfigError
from torchtitan_lite.models.spec import ModelSpec
from torchtitan_lite.optim import load_lr_scheduler_position

__all__ = ["CHECKSUMS_FILE", "TRAIN_STATE_FILE", "CheckpointManager", "check_initial_load_path",
           "checkpoint_model_args", "committed_steps", "initial_load_used", "resumable_steps"]

logger = logging.getLogger("torchtitan_lite")

# Settings a resumed run must keep (a vocabulary change is caught by the weights' shapes).
_FIXED_ON_RESUME = ("model.name", "model.tokenizer_path", "lora.enable")
# Settings that name places and say nothing about training.
_NOT_SHOWN = ("job.dump_folder", "job.config_file", "checkpoint.load_step")


def resumable_steps(config: Checkpoint, folder: Path) -> list[int]:
    """The committed steps of the job's own checkpoint folder it resumes from (none when
    checkpointing is off)."""
    return committed_steps(folder) if config.enable else []


def initial_load_used(config: Checkpoint, folder: Path, *, lora: bool) -> bool:
    """Whether ``initial_load_path`` is loaded: only while the job's own folder holds no
    checkpoint, or always with LoRA (the frozen base weights are never saved: a resumed run loads
    them again). The one rule, for the preflight's checks and for :meth:`CheckpointManager.load`."""
    return config.initial_load_path is not None and (lora or not resumable_steps(config, folder))


class CheckpointManager:
    """Saves and restores the model, optimizer, LR scheduler, data loader and train state.

    ``config`` is a validated ``[checkpoint]`` section; checkpoints live in
    ``<dump_folder>/<config.folder>``. ``model_spec`` (the model's family) is needed for Hugging
    Face saves and loads. ``timeout_s`` bounds the collectives of background saves. ``lora``: the
    model's LoRA. All ranks call :meth:`load`, :meth:`save`, :meth:`wait` and :meth:`close`
    together (they are collectives).
    """

    def __init__(self, config: Checkpoint, *, dump_folder: str | Path, model: nn.Module,
                 optimizer: torch.optim.Optimizer, lr_scheduler: Any, loader: Any, model_spec: ModelSpec | None = None,
                 timeout_s: float = 1800.0, hf_extras: HFExportExtras | None = None,
                 run_config: dict[str, Any] | None = None, lora: LoRASetup | None = None) -> None:
        self.config, self.lora, self.model_spec = config, lora, model_spec
        self.run_config = run_config  # the job's settings ("section.key": value), saved with each checkpoint
        self.folder = Path(dump_folder) / config.folder
        self.lr_scheduler, self.loader = lr_scheduler, loader
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.storage = CheckpointStorage(model=model, optimizer=optimizer, model_spec=model_spec, lora=lora,
                                         hf_extras=hf_extras)
        self.folders = StepFolders(self.folder, rank=self.rank, keep_latest_k=config.keep_latest_k)
        self._pending: PendingSave | None = None
        self.saved_step = -1  # the step of the last save this manager made (committed or in flight)
        self.last_blocked_s = 0.0  # how long the last save held up training
        self.failures = SaveFailures(self.folder, limit=config.max_failed_saves, rank=self.rank)
        # Background saves talk over their own gloo group: collectives of the training loop on
        # the default group and those of the save thread must never interleave.
        self._async_group = (dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
                             if config.enable and config.async_mode == "async" else None)

    # ----------------------------------------------------------------------------------------
    # Saving
    # ----------------------------------------------------------------------------------------

    def should_save(self, step: int, *, last: bool) -> bool:
        return self.config.enable and (step % self.config.interval == 0 or last)

    def save(self, step: int, train_state: dict[str, Any], *, last: bool = False,
             sync: bool = False) -> Path | None:
        """Write ``step-<step>``; returns its path, or None when the save failed and training
        goes on (see below). Synchronous saves return once it is committed; asynchronous ones
        once the state is copied to CPU memory (the commit follows when the files are written,
        at the latest in :meth:`wait`). ``sync``: synchronous even with ``async_mode = "async"``
        (a save before exiting). Step 0 (the seed checkpoint) and, with
        ``last_save_model_only``, the last step save only the model weights, in
        ``export_dtype``; ``last_save_in_hf`` writes those as Hugging Face safetensors.

        A save that fails (a full disk, an I/O error) is one log line naming the folder and the
        cause; its partial folder is removed and the committed checkpoints stay. Training goes
        on and the next interval saves again, until ``max_failed_saves`` saves in a row have
        failed: then, and for a save that must succeed (the seed, the last step, a save before
        exiting on a signal), it is a :class:`CheckpointError` (exit 4)."""
        self.wait()
        started = time.perf_counter()
        self.saved_step = step
        cfg = self.config
        model_only = step == 0 or (last and cfg.last_save_model_only)
        in_hf = model_only and last and cfg.last_save_in_hf
        in_peft = in_hf and self.lora is not None and not self.lora.merge_on_export
        must_succeed = step == 0 or last or sync
        final = self.folders.final(step)
        rng: list[Any] = [None] * self.world_size
        if step > 0:
            dist.all_gather_object(rng, rng_state())
        if not model_only:
            self.loader.gather_state()  # every rank's data position into the state rank 0 saves
        try:
            local: BaseException | None = None
            staging = self.folders.staging(step)
            try:
                self.folders.begin(step)
                if self.rank == 0:  # (a seed checkpoint is weights only: no data, schedule or RNG position)
                    write_json(staging / TRAIN_STATE_FILE, train_state_record(
                        train_state, step=step, fmt="peft" if in_peft else "hf" if in_hf else "dcp",
                        export_dtype=cfg.export_dtype if model_only else None, world_size=self.world_size,
                        model=self.storage.model, model_spec=self.model_spec, run_config=self.run_config,
                        positions=None if step == 0 else {"dataloader": self.loader.state_dict(),
                                                          "lr_scheduler": _as_numbers(self.lr_scheduler.state_dict()),
                                                          "rng": rng}))
            except Exception as exc:  # agreed below: every rank takes the same path
                local = exc
            _agree(local, self.world_size)  # the barrier before any rank writes
            dtype = DTYPES[cfg.export_dtype] if last else torch.float32  # the seed keeps fp32
            if in_hf:
                self.storage.save_export(staging, peft=in_peft, dtype=dtype,
                                         base_name=cfg.initial_load_path if cfg.initial_load_in_hf else None)
                self._commit(step, started)
                return final
            state = self.storage.dcp_state(model_only=model_only, dtype=dtype)
            if self._async_group is not None and not sync:
                response = dcp.async_save(state, checkpoint_id=str(staging), process_group=self._async_group)
                future = getattr(response, "upload_completion", response)
                pending = self._pending = PendingSave(step, future, started, self.folders, last=must_succeed)
                if self.rank == 0:  # commit from the writing thread once every file is written, not at the
                    future.add_done_callback(pending.commit_when_written)  # next save: a crash in between
                self.last_blocked_s = time.perf_counter() - started         # would lose a complete checkpoint
                if self.rank == 0:
                    logger.info("checkpoint step %d: training blocked %.3f s to stage it; writing in the "
                                "background", step, self.last_blocked_s)
                return final
            # dcp.save returns on every rank only after rank 0 has written the metadata, which it
            # does only after every rank reported its shards written; a rank's failure reaches all.
            dcp.save(state, checkpoint_id=str(staging))
            try:
                self.storage.record_checksums(staging)  # (a collective, then rank 0 writes)
            except SaveFailed:
                raise
            except OSError as exc:  # rank 0's write
                local = exc
            self._commit(step, started, local)
        except (SaveFailed, CheckpointException) as exc:  # failures every rank saw (DCP's is a BaseException)
            self._failed(step, exc, must_succeed=must_succeed)
            return None
        self.last_blocked_s = time.perf_counter() - started
        return final

    def _commit(self, step: int, started: float, local: BaseException | None = None) -> None:
        """Rank 0 renames the staging folder to ``step-<N>`` unless this rank's part already
        failed (``local``); every rank learns the outcome."""
        try:
            if local is None:
                self.folders.commit(step, started)
        except OSError as exc:
            local = exc
        _agree(local, self.world_size)
        self.failures.in_a_row = 0

    def wait(self) -> None:
        """Wait for the background save (if any) to finish and commit it. A failed one is
        handled as :meth:`save` says (a failed last save raises)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.future.result()
            local: BaseException | None = None
            try:
                pending.commit_once()
            except OSError as exc:
                local = exc
            _agree(local, self.world_size)
        except (SaveFailed, CheckpointException) as exc:
            self._failed(pending.step, exc, must_succeed=pending.last)
            return
        self.failures.in_a_row = 0
        # Committed from the writer thread, where no collective can run: its checksums now (until
        # then keep_latest_k keeps the newest checkpoint that has them).
        self.storage.record_checksums(self.folders.final(pending.step), committed=True)
        if self.rank == 0:
            prune(self.folder, self.config.keep_latest_k)

    def _failed(self, step: int, exc: BaseException, *, must_succeed: bool) -> None:
        """A save that failed: its partial folder removed, earlier checkpoints untouched, then
        the policy of :class:`~.commit.SaveFailures` (go on, or a :class:`CheckpointError`)."""
        self.folders.discard(step)
        if self.saved_step == step:
            self.saved_step = -1  # nothing of this step is saved: a save on a signal tries again
        self.failures.failed(step, exc, must_succeed=must_succeed)

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

    # ----------------------------------------------------------------------------------------
    # Loading
    # ----------------------------------------------------------------------------------------

    def load(self) -> dict[str, Any] | None:
        """Restore the job's own checkpoint (``load_step``, else the latest in the folder), or
        else ``initial_load_path``; returns the restored train state ({} for weights only), or
        None when there is nothing to load (a fresh start)."""
        cfg = self.config
        parts = set(LOADABLE_PARTS) - set(cfg.exclude_from_loading)
        steps = resumable_steps(cfg, self.folder)
        if cfg.enable and cfg.load_step >= 0 and cfg.load_step not in steps:
            raise CheckpointError(f"checkpoint.load_step: invalid value {cfg.load_step}; {str(self.folder)!r} "
                                  f"holds committed steps {steps or 'none'}")
        used = initial_load_used(cfg, self.folder, lora=self.lora is not None)
        initial = Path(cfg.initial_load_path) if used else None
        initial_format = "hf" if cfg.initial_load_in_hf else "dcp"
        if self.lora is not None and initial is not None:  # the frozen weights: never in this run's checkpoints
            self.storage.load_weights(initial, initial_format, {"model"}, base=True)
            self._loaded("base weights loaded from %s (LoRA: frozen, never saved)", initial)
        if steps:
            step = newest_that_verifies(self.storage, self.folders, steps, load_step=cfg.load_step,
                                        on_corrupt=cfg.on_corrupt, rank=self.rank)
            start = step if "train_state" in parts else 0
            later = [s for s in committed_steps(self.folder) if s > start]  # damaged ones were set aside
            if later:  # the run would save over them: never without being asked
                raise CheckpointError(f"checkpoint.load_step: resuming at step {start} would overwrite the later "
                                      f"checkpoints {later} in {str(self.folder)!r}; move them out of the folder "
                                      "(or use another checkpoint.folder) to continue from there")
            return self._load_from(self.folders.final(step), parts)
        if initial is None:
            return None
        if self.lora is not None:
            return {}  # loaded above: the base weights (a LoRA run's adapters start at their init)
        if cfg.initial_load_in_hf or cfg.initial_load_model_only:
            self.storage.load_weights(initial, initial_format, {"model"})
            self._loaded("model weights loaded from %s%s", "Hugging Face checkpoint " if cfg.initial_load_in_hf else "",
                         initial)
            return {}
        return self._load_from(initial, parts)

    def _loaded(self, message: str, *args: Any) -> None:
        if self.rank == 0:
            logger.info(message, *args)

    def rollback(self) -> dict[str, Any] | None:
        """Reload everything from the latest committed checkpoint of this run that holds the
        optimizer too (``training.on_nonfinite = "rollback"``); returns its train state, or None
        when there is none. A background save still running is committed first."""
        self.wait()
        full = [s for s in committed_steps(self.folder) if s > 0 and not weights_only(self.folders.final(s))]
        return None if not full else self._load_from(self.folders.final(full[-1]), set(LOADABLE_PARTS))

    def _load_from(self, path: Path, parts: set[str]) -> dict[str, Any]:
        state = read_train_state(path)
        if "train_state" in parts:
            _check_changes(path, state.get("config"), self.run_config, self.rank)  # before any weight is read
        if state.get("model_only") and "optimizer" in parts:
            parts = parts - {"optimizer"}
            if state["step"] > 0 and self.rank == 0:
                logger.warning("checkpoint %s holds model weights only (%s): the optimizer state "
                               "starts fresh", path, state.get("export_dtype"))
        self.storage.load_weights(path, state.get("format", "dcp"), parts)
        if "lr_scheduler" in parts and "lr_scheduler" in state:
            # The schedule's position comes from the checkpoint; its settings (peak lr, and the
            # warmup/decay/steps that shape it) from this run's config, from this step on.
            load_lr_scheduler_position(self.lr_scheduler, self.storage.optimizer, state["lr_scheduler"])
        if "dataloader" in parts and "dataloader" in state:
            self.loader.load_state_dict(state["dataloader"])
        self._loaded("resumed from %s (step %d, saved at world size %s)", path, state["step"], state.get("world_size"))
        if "train_state" not in parts:
            return {}
        saved_rng = state.get("rng")
        if saved_rng:
            # The same world size gets each rank's own generator back; another one gets rank 0's.
            set_rng_state(saved_rng[self.rank] if len(saved_rng) == self.world_size else saved_rng[0])
        return state


def _as_numbers(value: Any) -> Any:
    """``value`` with every one-element tensor as its number (an optimizer that keeps its learning
    rate as a tensor, as torchao's AdamW8bit does, gives the schedule's state tensors: JSON takes
    numbers)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, dict):
        return {k: _as_numbers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_as_numbers(v) for v in value)
    return value


def _agree(local: BaseException | None, world_size: int) -> None:
    """Every rank learns whether any rank's part of a save failed (a collective, also the
    barrier of the step): all raise the first failure, so all take the same next step."""
    reasons: list[Any] = [None] * world_size
    dist.all_gather_object(reasons, None if local is None else failure_reason(local))
    first = next((r for r in reasons if r is not None), None)
    if first is not None:
        raise SaveFailed(failure_reason(local) if local is not None else first)


def _check_changes(path: Path, saved: Any, run_config: dict[str, Any] | None, rank: int) -> None:
    """Compare this run's settings with those the checkpoint was trained with: list the
    changes (rank 0, one log line); refuse the ones a resumed run cannot take."""
    if not isinstance(saved, dict) or run_config is None:
        return
    changed = {k: (saved.get(k), v) for k, v in run_config.items() if k in saved and saved[k] != v}
    for key in _FIXED_ON_RESUME:
        if key in changed:
            before, now = changed[key]
            raise ConfigError(f"{key}: invalid value {now!r}; {str(path)!r} was trained with {before!r}, and a "
                              "resumed run cannot change it (start a new run from it with "
                              "checkpoint.initial_load_path instead)")
    shown = {k: v for k, v in changed.items() if not k.startswith(_NOT_SHOWN)}
    if shown and rank == 0:
        logger.warning("resuming %s with changed settings (they apply from step %s on): %s", path,
                       path.name.removeprefix("step-"),
                       "; ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(shown.items())))
