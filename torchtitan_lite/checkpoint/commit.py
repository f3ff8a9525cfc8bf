"""The checkpoint folder's ``step-<N>`` directories: written under a temporary name and committed
by one atomic rename, set aside when damaged, pruned to ``keep_latest_k``; a background save's
commit as soon as its files are written."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from torchtitan_lite.checkpoint.safe_reading import failure_reason
from torchtitan_lite.checkpoint.storage import CHECKSUMS_FILE, committed_steps, fsync_dir, weights_only
from torchtitan_lite.errors import CheckpointError

__all__ = ["PendingSave", "SaveFailures", "StepFolders", "newest_that_verifies", "prune"]

logger = logging.getLogger("torchtitan_lite")


class StepFolders:
    """``<folder>/step-<N>``: staged as ``.step-<N>.partial`` and renamed by rank 0 only once every
    rank's files and the metadata are on disk, so a crash mid-save never leaves a half-written
    ``step-<N>``. Only rank 0 touches the filesystem here."""

    def __init__(self, folder: Path, *, rank: int, keep_latest_k: int) -> None:
        self.folder, self.rank, self.keep_latest_k = folder, rank, keep_latest_k

    def final(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def staging(self, step: int) -> Path:
        return self.folder / f".step-{step}.partial"

    def begin(self, step: int) -> Path:
        """A fresh staging folder for ``step`` (rank 0 creates it); returns its path."""
        staging = self.staging(step)
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging)  # left by an earlier crash; never a committed checkpoint
            staging.mkdir()
        return staging

    def discard(self, step: int) -> None:
        """Remove a failed save's staging folder (rank 0), so a full disk is not kept full."""
        if self.rank == 0:
            shutil.rmtree(self.staging(step), ignore_errors=True)

    def commit(self, step: int, started: float) -> None:
        """Rank 0 renames the complete staging folder to ``step-<N>`` (atomic on one filesystem),
        then prunes to ``keep_latest_k``."""
        if self.rank != 0:
            return
        staging, final = self.staging(step), self.final(step)
        fsync_dir(staging)
        replaced = self.folder / f".step-{step}.replaced"
        shutil.rmtree(replaced, ignore_errors=True)  # left by a crash inside an earlier commit
        if final.exists():  # only a seed checkpoint can be saved again over itself
            os.replace(final, replaced)
        os.replace(staging, final)
        fsync_dir(self.folder)
        shutil.rmtree(replaced, ignore_errors=True)
        prune(self.folder, self.keep_latest_k)
        logger.info("checkpoint step %d saved to %s (%.2f s)", step, final, time.perf_counter() - started)

    def set_aside(self, step: int) -> None:
        """Rank 0 renames a damaged ``step-<N>`` to ``step-<N>.corrupt`` (kept, out of the way)."""
        if self.rank != 0:
            return
        aside = self.folder / f"step-{step}.corrupt"
        suffix = 1
        while aside.exists():
            aside, suffix = self.folder / f"step-{step}.corrupt{suffix}", suffix + 1
        os.replace(self.final(step), aside)
        fsync_dir(self.folder)


def prune(folder: Path, keep_latest_k: int) -> None:
    """Keep the newest ``keep_latest_k`` checkpoints that are resume points (weights-only saves,
    exports, neither count nor go), and never delete the newest one whose checksums were recorded
    while a newer one has none yet (an async save not yet waited for). ``0``: keep all."""
    if keep_latest_k <= 0:
        return
    full = [s for s in committed_steps(folder) if not weights_only(folder / f"step-{s}")]
    checked = [s for s in full if (folder / f"step-{s}" / CHECKSUMS_FILE).is_file()]
    keep = set(full[-keep_latest_k:])
    if checked and checked[-1] != full[-1]:
        keep.add(checked[-1])
    for old in full:
        if old not in keep:
            shutil.rmtree(folder / f"step-{old}", ignore_errors=True)


@dataclasses.dataclass
class PendingSave:
    """A background save in flight: committed once, from the writer thread when its files are
    written (rank 0), or at the latest by the next wait."""

    step: int
    future: Any
    started: float
    folders: StepFolders
    last: bool = False  # the run's last save: a failure stops the job
    committed: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def commit_once(self) -> None:
        with self.lock:
            if not self.committed:
                self.folders.commit(self.step, self.started)
                self.committed = True

    def commit_when_written(self, future: Any) -> None:
        """Done-callback of the save (rank 0): commit it if it succeeded. A failure is left for
        the waiter to report; nothing here may raise into the writer thread."""
        try:
            if future.exception() is None:
                self.commit_once()
        except BaseException:  # reported by wait(), which commits again or raises
            logger.exception("checkpoint step %d: committing in the background failed", self.step)


class SaveFailures:
    """What a failed save does (``checkpoint.max_failed_saves``): one log line (rank 0) naming the
    folder, the cause and the checkpoints that stay, and training goes on; a
    :class:`~torchtitan_lite.errors.CheckpointError` (exit 4) for a save that had to succeed (the
    seed, the last step, a save before exiting on a signal) or the ``limit``-th failure in a row."""

    def __init__(self, folder: Path, *, limit: int, rank: int) -> None:
        self.folder, self.limit, self.rank = folder, limit, rank
        self.in_a_row = 0  # saves that failed since the last one committed

    def failed(self, step: int, exc: BaseException, *, must_succeed: bool) -> None:
        self.in_a_row += 1
        kept = committed_steps(self.folder)
        line = (f"saving checkpoint step {step} to {str(self.folder)!r} failed: {failure_reason(exc)}; "
                f"the partial folder was removed and the checkpoints {kept or 'before it'} are intact")
        if must_succeed or self.in_a_row >= self.limit:
            why = ("" if must_succeed or self.limit == 1 else
                   f" ({self.in_a_row} saves in a row failed: checkpoint.max_failed_saves = {self.limit})")
            raise CheckpointError(line + why)
        if self.rank == 0:
            logger.error("%s; training goes on and the next save tries again (%d of "
                         "checkpoint.max_failed_saves = %d failed in a row)", line, self.in_a_row, self.limit)


def newest_that_verifies(storage: Any, folders: StepFolders, steps: list[int], *, load_step: int, on_corrupt: str,
                         rank: int) -> int:
    """The step to resume: ``load_step`` (when >= 0), else the newest of the committed ``steps``
    that verifies (``storage.verify``). A damaged one is logged with the file at fault; with
    ``on_corrupt = "fallback"`` it is renamed ``step-<N>.corrupt`` (kept, out of the way of this
    run's saves) and the one before is tried; with ``"stop"``, or an explicit ``load_step``, or
    none left, it is a :class:`~torchtitan_lite.errors.CheckpointError` (exit 4). Every rank calls it."""
    set_aside: list[int] = []
    newest: str | None = None
    for step in [load_step] if load_step >= 0 else list(reversed(steps)):
        problem = storage.verify(folders.final(step))
        if problem is None:
            if set_aside and rank == 0:
                logger.info("resuming from checkpoint step %d, the newest that verifies (set aside: %s)",
                            step, ", ".join(f"step-{s}.corrupt" for s in set_aside))
            return step
        newest = newest or problem
        if rank == 0:
            logger.warning("checkpoint step %d does not verify: %s", step, problem)
        if on_corrupt == "stop" or load_step >= 0:
            how = "checkpoint.load_step names it" if load_step >= 0 else "checkpoint.on_corrupt = 'stop'"
            raise CheckpointError(f"{problem}; not resuming ({how}): move the folder away, or set "
                                  "checkpoint.on_corrupt = 'fallback' to resume from the newest earlier "
                                  "checkpoint that verifies")
        folders.set_aside(step)
        dist.barrier()
        set_aside.append(step)
    raise CheckpointError(f"{newest}; no checkpoint in {str(folders.folder)!r} verifies (steps {steps}, now "
                          "renamed step-<N>.corrupt; each one's reason is logged): not starting afresh over "
                          "them; move the folder away to start from scratch")

