"""Chat conversations rendered and tokenized once: by every local rank in parallel on disjoint
shares of the rows, into memory-mapped files that restarts and other world sizes reuse.

A cache folder ``<cache_dir>/chat-<key>/`` holds one part per share (``part-<r>-of-<n>``: the
token ids, whether each is a counted label, each conversation's start and its row number) and
``manifest.json``. The key is a hash of what the encodings depend on: every file's path, size and
modification time, the chat templates' sources, the tokenizer file's bytes and settings, the
template's variables (special tokens, ``training.chat_template_kwargs``) and ``loss_on``; not
``seq_len``, truncation or packing, which are applied when the windows are made, so a change of
those reuses it. Rows a template refuses are recorded (kind, place, message) so that
``on_bad_row = "stop"`` still names the first one and ``"skip"`` counts them.

Building: the ``LOCAL_WORLD_SIZE`` ranks of a node (torchrun's variables; one process without
them) each encode the rows ``i`` with ``i % n == local rank`` into a staging folder of this
launch, report progress, and wait for each other through the filesystem (no process group
exists yet); the last part written, local rank 0 writes the manifest and renames the folder
into place (a concurrent builder that finds it there drops its own). A rank that meets a bad
row under ``on_bad_row = "stop"`` writes its error there, and every rank stops with it. A cache
that cannot be written (a full or read-only disk) or a share that never comes (no progress for
10 minutes) is one warning, and each rank then encodes every conversation itself. The staging
folders of builds on this host whose launcher has died are removed by the next build.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_lite.errors import DataError
from torchtitan_lite.progress import Progress

__all__ = ["CACHE_VERSION", "EncodedChats", "cache_key", "encoded_chats"]

logger = logging.getLogger("torchtitan_lite")

CACHE_VERSION = 1
"""Bumped whenever what a cache holds, or how a conversation is encoded, changes."""

_WAIT_WITHOUT_PROGRESS_S = 600.0
"""How long a rank waits for a peer's share whose progress file has not moved."""


_ARRAYS = ("tokens", "counted", "offsets", "rows")
"""What a part holds, one ``.npy`` file each."""


@dataclasses.dataclass
class _Part:
    """One share's conversations: all their token ids and labels back to back, each one's start
    (``offsets``, one more than conversations) and row number; what it skipped."""

    tokens: np.ndarray
    counted: np.ndarray
    offsets: np.ndarray
    rows: np.ndarray
    skipped: dict[str, int]
    first_bad: tuple[int, str, str, str] | None


@dataclasses.dataclass
class EncodedChats:
    """The encoded conversations of a source, in row order, from one or more parts (shares):
    part ``p``'s conversation ``j`` has ``tokens[offsets[j]:offsets[j + 1]]`` (and its ``counted``
    labels) and came from row ``rows[j]``. ``skipped``: refused rows by kind; ``first_bad``: (row
    number, where, kind, message) of the first one."""

    parts: list[_Part]
    skipped: dict[str, int]
    first_bad: tuple[int, str, str, str] | None

    def __post_init__(self) -> None:
        order = np.argsort(np.concatenate([part.rows for part in self.parts]), kind="stable")
        self._part = np.concatenate([np.full(len(part.rows), p, dtype=np.int64)
                                     for p, part in enumerate(self.parts)])[order]
        self._index = np.concatenate([np.arange(len(part.rows), dtype=np.int64) for part in self.parts])[order]
        self.lengths = np.concatenate([np.diff(part.offsets) for part in self.parts])[order].astype(np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Conversation ``i`` (in row order): its token ids and counted labels."""
        part, j = self.parts[int(self._part[i])], int(self._index[i])
        lo, hi = int(part.offsets[j]), int(part.offsets[j + 1])
        return part.tokens[lo:hi], part.counted[lo:hi]


# --------------------------------------------------------------------------------------------
# Encoding a share
# --------------------------------------------------------------------------------------------


class _BadRow(Exception):
    def __init__(self, error: DataError) -> None:
        self.error = error


def _encode_share(rows: Iterator[tuple[int, str, Any]], encode: Callable[[Any], tuple[np.ndarray, np.ndarray]],
                  *, stop_on_bad_row: Callable[[int, str, Exception], DataError | None],
                  progress: Progress | None, label: str, alive: Path | None = None) -> _Part:
    """Encode the rows ``(number, where, record)`` given; a bad row is recorded, or raised as
    :class:`_BadRow` when ``stop_on_bad_row`` turns it into an error."""
    from torchtitan_lite.data.chat_template import RowError

    tokens: list[np.ndarray] = []
    counted: list[np.ndarray] = []
    lengths: list[int] = []
    kept: list[int] = []
    skipped: Counter[str] = Counter()
    first_bad: tuple[int, str, str, str] | None = None
    done = 0
    for number, where, record in rows:
        try:
            ids, mask = encode(record)
        except RowError as exc:
            error = stop_on_bad_row(number, where, exc)
            if error is not None:
                raise _BadRow(error) from None
            skipped[exc.kind] += 1
            if first_bad is None:
                first_bad = (number, where, exc.kind, str(exc))
            continue
        tokens.append(np.asarray(ids, dtype=np.uint32))
        counted.append(np.asarray(mask, dtype=np.uint8))
        lengths.append(len(ids))
        kept.append(number)
        done += 1
        if done % 1000 == 0:
            if progress is not None:
                progress.update(f"{done} {label} encoded")
            if alive is not None:
                alive.touch()  # the peers waiting for this share see it move
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return _Part(np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.uint32),
                 np.concatenate(counted) if counted else np.zeros(0, dtype=np.uint8),
                 offsets, np.asarray(kept, dtype=np.int64), dict(skipped), first_bad)


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------


def cache_key(files: list[Path], *, template_sources: dict[str, str], tokenizer_file: Path | None,
              variables: dict[str, Any], loss_on: str) -> str:
    """A hash of everything the encodings depend on (see the module's docstring)."""
    digest = hashlib.sha256()
    stats = []
    for f in files:
        st = f.stat()
        stats.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    tokenizer_hash = None
    if tokenizer_file is not None and tokenizer_file.is_file():
        tokenizer_hash = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
    digest.update(json.dumps({"version": CACHE_VERSION, "files": stats, "templates": template_sources,
                              "tokenizer": tokenizer_hash, "variables": variables, "loss_on": loss_on},
                             sort_keys=True, default=repr).encode())
    return digest.hexdigest()[:24]


def _share() -> tuple[int, int]:
    """This process's share: (local rank, ranks on this node), from torchrun's variables."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return (local_rank, count) if 0 <= local_rank < count else (0, 1)


def _launch_id() -> str:
    """What the ranks of one launch on one node share without talking: the host and the launch."""
    parts = [socket.gethostname(), os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("MASTER_PORT", ""),
             os.environ.get("TORCHELASTIC_RESTART_COUNT", ""), os.environ.get("GROUP_RANK", ""),
             str(os.getppid())]  # the agent (or launcher): one per launch, shared by the local ranks
    if "LOCAL_WORLD_SIZE" not in os.environ:
        parts.append(str(os.getpid()))  # one process alone
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def _save_part(folder: Path, name: str, part: _Part) -> None:
    """The part's arrays and what it skipped, on disk (fsynced: a cache is never renamed into place
    over files a crash could still cut short)."""
    for field in _ARRAYS:
        with open(folder / f"{name}-{field}.npy", "wb") as fh:
            np.save(fh, getattr(part, field))
            fh.flush()
            os.fsync(fh.fileno())
    (folder / f"{name}.json").write_text(json.dumps({"skipped": part.skipped, "first_bad": part.first_bad}))


def _load(folder: Path) -> EncodedChats:
    manifest = json.loads((folder / "manifest.json").read_text())
    parts = [_Part(**{field: np.load(folder / f"{name}-{field}.npy", mmap_mode="r") for field in _ARRAYS},
                   skipped={}, first_bad=None) for name in manifest["parts"]]
    first_bad = manifest["first_bad"]
    return EncodedChats(parts, manifest["skipped"], None if first_bad is None else tuple(first_bad))


def encoded_chats(rows: Callable[[tuple[int, int]], Iterator[tuple[int, str, Any]]],
                  encode: Callable[[Any], tuple[np.ndarray, np.ndarray]], *, key: str | None,
                  cache_dir: Path | None, stop_on_bad_row: Callable[[int, str, Exception], DataError | None],
                  label: str) -> EncodedChats:
    """The encoded conversations of a source: read from ``cache_dir/chat-<key>`` when it is there,
    else built (by this node's ranks on their shares, see the module) and kept there; without a
    ``cache_dir`` (or ``key``), encoded here, every row by this process. ``rows(share)`` yields
    ``(row number, where, record)`` for the rows of ``share = (index, count)``."""
    if cache_dir is None or key is None:
        with Progress(f"encoding the {label}") as progress:
            try:
                part = _encode_share(rows((0, 1)), encode, stop_on_bad_row=stop_on_bad_row, progress=progress,
                                     label=label)
            except _BadRow as bad:
                raise bad.error from None
        return EncodedChats([part], part.skipped, part.first_bad)
    final = cache_dir / f"chat-{key}"
    if (final / "manifest.json").is_file():
        return _load(final)
    try:
        return _build(rows, encode, final=final, key=key, cache_dir=cache_dir, stop_on_bad_row=stop_on_bad_row,
                      label=label)
    except _CacheUnusable as exc:
        logger.warning("chat cache %s not used (%s): encoding every conversation on this rank", final, exc)
        return encoded_chats(rows, encode, key=None, cache_dir=None, stop_on_bad_row=stop_on_bad_row, label=label)


class _CacheUnusable(Exception):
    """The cache folder cannot be written or a peer's share never came: encode without it."""


def _build(rows: Callable[[tuple[int, int]], Iterator[tuple[int, str, Any]]],
           encode: Callable[[Any], tuple[np.ndarray, np.ndarray]], *, final: Path, key: str, cache_dir: Path,
           stop_on_bad_row: Callable[[int, str, Exception], DataError | None], label: str) -> EncodedChats:
    index, count = _share()
    staging = cache_dir / f".chat-{key}.{_launch_id()}.building"
    try:
        staging.mkdir(parents=True, exist_ok=True)
        if index == 0:
            launcher = os.getppid() if "LOCAL_WORLD_SIZE" in os.environ else os.getpid()  # torchrun's agent, or us
            (staging / "owner.json").write_text(json.dumps({"host": socket.gethostname(), "pid": launcher}))
            _remove_abandoned(cache_dir, keep=staging)
    except OSError as exc:
        raise _CacheUnusable(f"{staging}: {exc.strerror or exc}") from None
    name = f"part-{index}-of-{count}"
    started = time.perf_counter()
    with Progress(f"chat cache {final.name}: encoding share {index + 1} of {count} of the {label}") as progress:
        try:
            part = _encode_share(rows((index, count)), encode, stop_on_bad_row=stop_on_bad_row, progress=progress,
                                 label=label, alive=staging / f"{name}.alive")
        except _BadRow as bad:
            (staging / f"{name}.error").write_text(str(bad.error))
            raise bad.error from None
        try:
            _save_part(staging, name, part)
            (staging / f"{name}.done").write_text(json.dumps({"seconds": time.perf_counter() - started}))
        except OSError as exc:
            with contextlib.suppress(OSError):
                (staging / f"{name}.unusable").write_text(str(exc))  # the peers stop waiting for it
            raise _CacheUnusable(f"writing {staging / name}: {exc.strerror or exc}") from None
        progress.update("waiting for the other shares")
        names = [f"part-{i}-of-{count}" for i in range(count)]
        _wait_for(staging, final, names)
    if index == 0 and not (final / "manifest.json").is_file():
        skipped: Counter[str] = Counter()
        firsts = []
        for other in names:
            info = json.loads((staging / f"{other}.json").read_text())
            skipped.update(info["skipped"])
            if info["first_bad"] is not None:
                firsts.append(info["first_bad"])
        (staging / "manifest.json").write_text(json.dumps({
            "version": CACHE_VERSION, "parts": names, "skipped": dict(skipped),
            "first_bad": min(firsts) if firsts else None, "seconds": time.perf_counter() - started}))
        try:
            os.replace(staging, final)
        except OSError as exc:  # another launch put the same cache in place first, or it cannot be renamed
            shutil.rmtree(staging, ignore_errors=True)
            if not (final / "manifest.json").is_file():
                raise _CacheUnusable(f"renaming {staging}: {exc.strerror or exc}") from None
        else:
            logger.info("chat cache %s written (%d shares, %.1f s)", final, count, time.perf_counter() - started)
    waited = time.monotonic()
    while not (final / "manifest.json").is_file():  # the other ranks: until local rank 0 has renamed it
        _check_errors(staging)
        if not staging.is_dir() or time.monotonic() - waited > _WAIT_WITHOUT_PROGRESS_S:
            if not (final / "manifest.json").is_file():
                raise _CacheUnusable("local rank 0 did not put it in place")
        time.sleep(0.05)
    return _load(final)


def _remove_abandoned(cache_dir: Path, *, keep: Path) -> None:
    """Staging folders of builds on this host whose launcher (the ``owner.json`` pid) is gone: a
    crashed or stopped build's leftovers, removed."""
    host = socket.gethostname()
    for folder in cache_dir.glob(".chat-*.building"):
        if folder == keep:
            continue
        try:
            owner = json.loads((folder / "owner.json").read_text())
        except (OSError, ValueError):
            continue
        if owner.get("host") != host or not isinstance(owner.get("pid"), int):
            continue
        try:
            os.kill(owner["pid"], 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            pass  # alive (another user's): not ours to touch


def _check_errors(staging: Path) -> None:
    """A peer's bad row stops this rank with the same error; a peer that could not write its
    share makes the cache unusable here too. The folder may be renamed into place by local rank 0
    at any moment: then there is nothing to check (the caller looks for the manifest next)."""
    try:
        for error in sorted(staging.glob("*.error")):
            raise DataError(error.read_text())
        for unusable in sorted(staging.glob("*.unusable")):
            raise _CacheUnusable(f"a peer could not write its share: {unusable.read_text()}")
    except FileNotFoundError:
        return


def _wait_for(staging: Path, final: Path, names: list[str]) -> None:
    """Until every share's part is written (or the cache is in place), failing with a peer's
    error, or when a peer's staging shows no change for :data:`_WAIT_WITHOUT_PROGRESS_S`."""
    started = time.time()
    while True:
        if (final / "manifest.json").is_file():
            return
        _check_errors(staging)
        done = {n for n in names if (staging / f"{n}.done").is_file()}
        if len(done) == len(names):
            return
        moved = []
        for n in names:
            for f in (staging / f"{n}.alive", staging / f"{n}.done"):
                with contextlib.suppress(FileNotFoundError):
                    moved.append(f.stat().st_mtime)
        if time.time() - max([started, *moved]) > _WAIT_WITHOUT_PROGRESS_S:
            missing = ", ".join(sorted(set(names) - done))
            raise _CacheUnusable(f"the shares {missing} made no progress for {_WAIT_WITHOUT_PROGRESS_S:.0f} s")
        time.sleep(0.05)
