"""One job per dump folder and per checkpoint folder: exclusive locks held for the job's life.

Global rank 0 takes an ``flock`` on ``<dump_folder>/.lock`` and writes who holds it (host,
process id, start time); the operating system releases the lock when the process ends, however
it ends, so a crashed job never leaves a stale lock. A second job into the same folder is
refused with one line naming the holder, before it trains or writes anything. The lock is
advisory and local to what ``flock`` covers: processes on one machine, or a shared file system
that implements it (NFSv4, Lustre with ``flock`` mounts).

A checkpointing job's checkpoint folder (``<dump_folder>/<checkpoint.folder>``; an absolute
``checkpoint.folder`` is a folder of its own) is locked the same way, with a ``.lock`` file in
it, when it lies outside the dump folder: two jobs with different dump folders and one absolute
``checkpoint.folder`` would otherwise both write ``step-<N>`` into it. A checkpoint folder inside
the dump folder is covered by the dump folder's lock (no file is added among the step folders);
a second job naming that folder by an absolute path is not refused (it locks only the folder
itself).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import IO

from torchtitan_lite.errors import ConfigError

__all__ = ["LOCK_FILE", "DumpFolderLock"]

LOCK_FILE = ".lock"


class DumpFolderLock:
    """The locks of one job: its dump folder's and, given ``checkpoint_folder`` (relative to
    ``folder``, as ``checkpoint.folder`` is; an absolute path stands alone), its checkpoint
    folder's where that lies outside ``folder``. :meth:`acquire` once, :meth:`release` (or
    process exit) to let the next job in."""

    def __init__(self, folder: str | Path, *, checkpoint_folder: str | Path | None = None) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        # (key, folder as shown, lock file): the dump folder first.
        self._locks: list[tuple[str, Path, Path]] = [("job.dump_folder", self.folder, self.path)]
        if checkpoint_folder is not None:
            resolved = (self.folder / checkpoint_folder).resolve()
            if not resolved.is_relative_to(self.folder.resolve()):
                self._locks.append(("checkpoint.folder", resolved, resolved / LOCK_FILE))
        self._files: list[IO[str]] = []

    @property
    def lock_files(self) -> list[Path]:
        """The lock files :meth:`acquire` takes: the dump folder's, then the checkpoint folder's
        where it has one of its own."""
        return [path for _, _, path in self._locks]

    def acquire(self) -> None:
        """Take every lock, or raise :class:`ConfigError` naming the key, the folder and the job
        that holds it (then none is held)."""
        try:
            for key, folder, path in self._locks:
                self._files.append(_lock(key, folder, path, dump_folder=self.folder))
        except ConfigError:
            self.release()
            raise

    def release(self) -> None:
        """Let the next job in (the lock files stay; only the locks on them are dropped)."""
        while self._files:
            handle = self._files.pop()
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
            handle.close()


def _lock(key: str, folder: Path, path: Path, *, dump_folder: Path) -> IO[str]:
    """The open, ``flock``-ed lock file ``path`` (its holder recorded in it), or
    :class:`ConfigError` naming ``key``, ``folder`` and the holder. The file of a job that holds
    it is only read."""
    folder.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+", encoding="utf-8")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip()
        handle.close()
        try:
            info = json.loads(holder)
            who = f"pid {info['pid']} on {info['host']}, started {info['started']}"
        except (ValueError, KeyError, TypeError):
            who = "a job that has not recorded itself yet"
        raise ConfigError(f"{key}: invalid value {str(folder)!r}; another job is using it "
                          f"({who}; lock {str(path)!r}); wait for it to end or use another "
                          f"{key}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "started": datetime.datetime.now().isoformat(timespec="seconds"),
                             "dump_folder": str(dump_folder.absolute())}) + "\n")
    handle.flush()
    return handle
