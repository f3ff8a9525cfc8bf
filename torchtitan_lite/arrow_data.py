"""Streamed datasets: Parquet files and Hugging Face ``datasets`` folders (``save_to_disk``,
Arrow) with a text column, read with ``pyarrow`` record batch by record batch and tokenized only
as windows are needed.

Sharding (independent of the world size): the rows (documents) of all files, in order, are cut
into ``G`` contiguous ranges, ``G`` the global batch size; sample ``p`` of every global batch comes
from range ``p``, whose documents are tokenized (BOS/EOS around each) and packed back to back
into windows of ``seq_len + 1`` tokens, one window per step. Data-parallel rank ``r`` of ``D``
serves samples ``r·G/D … (r+1)·G/D − 1``, as with :class:`~torchtitan_lite.data.GlobalBatchLoader`:
it reads and tokenizes only its own ranges, and a run on 1 rank with gradient accumulation sees
the same samples at every step as a run on 4 ranks. When a range is used up it starts again at
its first row (its next epoch; logged).

The position (per range: epoch, row, tokens of that row already used) is plain integers; saved
in a checkpoint it resumes exactly, on any world size with the same global batch size. This
module imports nothing of the package but :mod:`torchtitan_lite.errors`.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from torchtitan_lite.errors import DataError

__all__ = [
    "STREAMED_DATASETS",
    "ArrowCorpus",
    "StreamingLoader",
    "check_streamed_dataset",
    "unreadable_error",
]

logger = logging.getLogger("torchtitan_lite")

STREAMED_DATASETS: dict[str, str] = {
    "parquet": ".parquet files or a folder of them (searched recursively), streamed (dataset_path)",
    "arrow": "a Hugging Face datasets folder (Dataset.save_to_disk) or .arrow files, streamed (dataset_path)",
}
_SUFFIX = {"parquet": ".parquet", "arrow": ".arrow"}
_READ_ROWS = 256  # Parquet rows decoded at a time per range (bounds the memory of a reader) ...
_PY_ROWS = 16  # ... of which this many become Python strings at a time
_TOKENIZE_ROWS = 256  # at most this many documents tokenized at a time per range ...
_TOKENIZE_CHARS = 1 << 16  # ... or about this many characters


def unreadable_error(key: str, path: Path, exc: OSError) -> DataError:
    """One line naming a file that cannot be read and the operating system's reason."""
    reason = f"{exc.strerror} (errno {exc.errno})" if exc.strerror else str(exc)
    return DataError(f"{key}: {str(path)!r} cannot be read: {reason}")


def files_under(folder: Path, key: str) -> list[Path]:
    """The regular files under ``folder`` (searched recursively), sorted; an unreadable folder is
    one line naming it (``key``) and the operating system's reason."""
    errors: list[OSError] = []
    found = [Path(root) / name for root, _, names in os.walk(folder, onerror=errors.append) for name in names]
    if errors:
        raise unreadable_error(key, Path(errors[0].filename or folder), errors[0])
    return sorted(f for f in found if f.is_file())


def _pyarrow(dataset: str, section: str) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError(f"{section}.dataset={dataset!r} reads files with the 'pyarrow' package: pip install pyarrow "
                        "(or pip install 'torchtitan_lite[data]')") from None
    return pyarrow


# --------------------------------------------------------------------------------------------
# Files and schema (the preflight's cheap checks)
# --------------------------------------------------------------------------------------------


def _arrow_folder_files(folder: Path, key: str) -> list[Path] | None:
    """The files of a ``save_to_disk`` folder in its own order (``state.json``), or None when the
    folder is not one."""
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if (p / "state.json").is_file())
        raise DataError(f"{key}: {str(folder)!r} is a DatasetDict folder (splits: {', '.join(splits) or 'none'}); "
                        f"point at one split's folder, e.g. {str(folder / (splits[0] if splits else 'train'))!r}")
    state = folder / "state.json"
    if not state.is_file():
        return None
    try:
        data = json.loads(state.read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in data["_data_files"]]
    except OSError as exc:
        raise unreadable_error(key, state, exc) from None
    except (ValueError, KeyError, TypeError):
        raise DataError(f"{key}: {str(state)!r} is not a datasets state.json (no _data_files list)") from None
    return [folder / name for name in names]


def _find_files(dataset: str, path: Path, key: str, section: str) -> list[Path]:
    suffix = _SUFFIX[dataset]
    if not path.is_dir():
        if path.suffix != suffix:
            raise DataError(f"{key}: {str(path)!r} is not a {suffix} file (needed by {section}.dataset={dataset!r})")
        return [path]
    if dataset == "arrow" and (listed := _arrow_folder_files(path, key)) is not None:
        return listed
    files = [f for f in files_under(path, key) if f.suffix == suffix]
    if not files:
        raise DataError(f"{key}: folder {str(path)!r} holds no {suffix} files (needed by {section}.dataset={dataset!r})")
    return files


def _open_arrow(file: Path, key: str) -> Any:
    """A reader over an Arrow IPC file, memory-mapped (``datasets`` writes the stream format;
    the file format is read too)."""
    import pyarrow as pa

    try:
        source = pa.memory_map(str(file), "r")
    except OSError as exc:
        raise unreadable_error(key, file, exc) from None
    try:
        return pa.ipc.open_stream(source)
    except (pa.ArrowInvalid, OSError):
        pass
    try:
        return pa.ipc.open_file(source)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{key}: {str(file)!r} is not a readable Arrow file ({exc})") from None


def _schema(dataset: str, file: Path, key: str) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if dataset == "arrow":
        return _open_arrow(file, key).schema
    try:
        return pq.read_schema(str(file))
    except OSError as exc:
        if isinstance(exc, pa.ArrowException) or exc.errno is None:
            raise DataError(f"{key}: {str(file)!r} is not a readable Parquet file ({exc})") from None
        raise unreadable_error(key, file, exc) from None
    except pa.ArrowException as exc:
        raise DataError(f"{key}: {str(file)!r} is not a readable Parquet file ({exc})") from None


def check_streamed_dataset(
    dataset: str, dataset_path: str | None, *, text_column: str, section: str = "training", key: str | None = None
) -> list[Path]:
    """The files of a streamed dataset, checked cheaply: the path exists, files are found, each
    file's schema (its footer or first message; no data) has ``text_column`` as a string column.
    Raises :class:`DataError` with one line naming the key and the file."""
    key = key or f"{section}.dataset_path"
    if dataset_path is None:
        from torchtitan_lite.errors import ConfigError

        raise ConfigError(f"{key}: {section}.dataset={dataset!r} needs a path to {STREAMED_DATASETS[dataset]}")
    pa = _pyarrow(dataset, section)
    path = Path(dataset_path).expanduser()
    if not path.exists():
        raise DataError(f"{key}: path not found: {dataset_path!r}")
    files = _find_files(dataset, path, key, section)
    for file in files:
        if not file.is_file():
            raise DataError(f"{key}: {str(file)!r} (listed in its folder's state.json) not found")
        schema = _schema(dataset, file, key)
        if text_column not in schema.names:
            raise DataError(f"{key}: {str(file)!r} has no column {text_column!r} (columns: "
                            f"{', '.join(schema.names)}); set training.dataset_text_column")
        kind = schema.field(text_column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
            raise DataError(f"{key}: {str(file)!r} column {text_column!r} holds {kind}, not text (string); "
                            "set training.dataset_text_column")
    return files


# --------------------------------------------------------------------------------------------
# The corpus: rows of the text column over all files, read in record batches
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    """A unit read at once: a Parquet row group or an Arrow record batch."""

    file: int
    unit: int
    rows: int


class ArrowCorpus:
    """The text column's rows over all files of a streamed dataset, in order, indexed from the
    files' metadata only (Parquet footers, Arrow message headers): nothing is decoded until read.
    """

    def __init__(self, dataset: str, dataset_path: str, *, text_column: str = "text",
                 section: str = "training") -> None:
        self.dataset = dataset
        self.text_column = text_column
        self.key = f"{section}.dataset_path"
        self.files = check_streamed_dataset(dataset, dataset_path, text_column=text_column, section=section)
        self.source = dataset_path
        self._batches: dict[int, list[Any]] = {}  # arrow: file → its record batches (memory-mapped)
        pieces: list[_Piece] = []
        for f, file in enumerate(self.files):
            pieces.extend(_Piece(f, u, rows) for u, rows in enumerate(self._unit_rows(f, file)) if rows)
        self.pieces = pieces
        self.starts = np.cumsum([0] + [p.rows for p in pieces])
        self.num_rows = int(self.starts[-1])
        if self.num_rows == 0:
            raise DataError(f"{self.key}: {dataset_path!r} is empty (no rows in {len(self.files)} file(s))")

    def check_global_batch(self, global_batch_size: int) -> None:
        """One :class:`DataError` line when there are fewer rows than samples in a global batch
        (every sample streams its own range of the rows)."""
        if self.num_rows < global_batch_size:
            raise DataError(
                f"{self.key}: {self.source!r} has {self.num_rows} rows, fewer than "
                f"training.global_batch_size = {global_batch_size}; every sample of a global batch streams "
                "its own share of the rows"
            )

    def _read_error(self, file: Path, exc: Exception) -> DataError:
        """One line for a file that cannot be read: the OS error (permissions, a missing file), or
        pyarrow's reason it is not a file of this dataset's kind."""
        import pyarrow as pa

        if isinstance(exc, OSError) and not isinstance(exc, pa.ArrowException) and exc.errno is not None:
            return unreadable_error(self.key, file, exc)
        return DataError(f"{self.key}: {str(file)!r} is not a readable {self.dataset} file ({exc})")

    def _unit_rows(self, f: int, file: Path) -> list[int]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            if self.dataset == "parquet":
                meta = pq.read_metadata(str(file))
                return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            reader = _open_arrow(file, self.key)
            if hasattr(reader, "num_record_batches"):  # the file format
                batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            else:
                batches = list(reader)
        except (OSError, pa.ArrowException) as exc:
            raise self._read_error(file, exc) from None
        column = batches[0].schema.get_field_index(self.text_column) if batches else -1
        self._batches[f] = [b.column(column) for b in batches]
        return [len(b) for b in batches]

    def _chunks(self, piece: _Piece, skip: int) -> Iterator[list[str | None]]:
        """The piece's texts from row ``skip`` on, a few at a time (Parquet decoded
        ``_READ_ROWS`` rows at a time; Python strings made only for the rows read)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        file = self.files[piece.file]
        try:
            if self.dataset == "arrow":
                columns = iter([self._batches[piece.file][piece.unit].slice(skip)])
            else:
                reader = pq.ParquetFile(str(file), pre_buffer=False, buffer_size=1 << 20)  # page by page
                batches = reader.iter_batches(batch_size=_READ_ROWS, row_groups=[piece.unit],
                                              columns=[self.text_column], use_threads=False)
                columns = _skip_rows((batch.column(0) for batch in batches), skip)
            for column in columns:
                for start in range(0, len(column), _PY_ROWS):
                    yield column.slice(start, _PY_ROWS).to_pylist()
        except (OSError, pa.ArrowException) as exc:
            raise self._read_error(file, exc) from None

    def texts(self, start: int, stop: int) -> Iterator[str | None]:
        """The texts of rows ``[start, stop)`` in order (None for a null), read lazily."""
        if start >= stop:
            return
        index = int(np.searchsorted(self.starts, start, side="right")) - 1
        row = start
        while row < stop:
            piece = self.pieces[index]
            for chunk in self._chunks(piece, row - int(self.starts[index])):
                for text in chunk[: stop - row]:
                    yield text
                    row += 1
                if row >= stop:
                    return
            index += 1


def _skip_rows(columns: Iterator[Any], skip: int) -> Iterator[Any]:
    """Arrow arrays from row ``skip`` of their concatenation on."""
    for column in columns:
        if skip >= len(column):
            skip -= len(column)
            continue
        yield column.slice(skip) if skip else column
        skip = 0


# --------------------------------------------------------------------------------------------
# One range of rows packed into windows, and the loader
# --------------------------------------------------------------------------------------------


class _Encoder(Protocol):
    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...


class _Stream:
    """Rows ``[lo, hi)`` tokenized as needed and packed back to back, forever (epoch after
    epoch). Its position is the first row not yet fully used and how many of its tokens were."""

    def __init__(self, corpus: ArrowCorpus, tokenizer: _Encoder, lo: int, hi: int, index: int,
                 wrapped: set[int]) -> None:
        self.corpus, self.tokenizer, self.lo, self.hi, self.index = corpus, tokenizer, lo, hi, index
        self.wrapped = wrapped  # epochs some sample of this rank has begun (shared by its samples)
        self.pending: deque[tuple[int, int, np.ndarray]] = deque()  # (epoch, row, tokens)
        self.used = 0  # tokens of pending[0] already in windows
        self.seek(0, lo, 0)

    def seek(self, epoch: int, row: int, used: int) -> None:
        if not self.lo <= row < self.hi:
            raise DataError(f"data loader state: row {row} is outside sample {self.index}'s rows "
                            f"[{self.lo}, {self.hi}) of the dataset")
        self.epoch, self.next_row, self.used_epoch = epoch, row, epoch
        self.pending.clear()
        self.used = 0
        self._texts = self.corpus.texts(row, self.hi)
        if used:
            self._fetch()
            if not self.pending or self.pending[0][1] != row or used >= len(self.pending[0][2]):
                raise DataError(f"data loader state: row {row} of the dataset has no token {used}: the "
                                "dataset or the tokenizer is not the one the checkpoint was saved with")
            self.used = used

    def position(self) -> list[int]:
        if self.pending:
            epoch, row, _ = self.pending[0]
            return [epoch, row, self.used]
        return [self.epoch, self.next_row, 0]

    def _fetch(self) -> None:
        """Tokenize the next rows (wrapping to ``lo`` after ``hi``) until some tokens are pending."""
        empty = 0
        while not self.pending:
            rows: list[tuple[int, int, str]] = []
            chars = 0
            while len(rows) < _TOKENIZE_ROWS:
                text = next(self._texts, None) if self.next_row < self.hi else None
                row = self.next_row
                self.next_row += 1
                if text:
                    rows.append((self.epoch, row, text))
                    chars += len(text)
                else:
                    empty += 1
                if self.next_row >= self.hi:
                    self.epoch += 1
                    self.next_row = self.lo
                    self._texts = self.corpus.texts(self.lo, self.hi)
                    break
                if chars >= _TOKENIZE_CHARS:
                    break
            if rows:
                encoded = self.tokenizer.encode_batch([text for _, _, text in rows])
                self.pending.extend((e, r, ids) for (e, r, _), ids in zip(rows, encoded, strict=True) if len(ids))
            elif empty >= self.hi - self.lo:
                raise DataError(f"{self.corpus.key}: rows {self.lo}..{self.hi - 1} of {self.corpus.source!r} hold "
                                "no text (empty or null); every sample of a global batch reads its own rows")

    def take(self, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.int64)
        filled = 0
        while filled < n:
            if not self.pending:
                self._fetch()
                continue
            epoch, _, ids = self.pending[0]
            if epoch > self.used_epoch:
                self.used_epoch = epoch
                if epoch not in self.wrapped:  # the first of this rank's samples to read its rows again
                    self.wrapped.add(epoch)
                    logger.warning("training data: sample %d has used all %d of its rows (%d..%d) and reads them "
                                   "again (epoch %d); this rank's other samples follow as theirs run out",
                                   self.index, self.hi - self.lo, self.lo, self.hi - 1, epoch)
            k = min(n - filled, len(ids) - self.used)
            out[filled : filled + k] = ids[self.used : self.used + k]
            filled += k
            self.used += k
            if self.used == len(ids):
                self.pending.popleft()
                self.used = 0
        return out


def check_batch_split(global_batch_size: int, local_batch_size: int, dp_size: int) -> int:
    """Micro-batches per rank per global batch; one :class:`DataError` line when the global batch
    does not split into ``local_batch_size`` rows on each of ``dp_size`` ranks (both loaders)."""
    if global_batch_size % (local_batch_size * dp_size):
        raise DataError(
            f"training.global_batch_size={global_batch_size} is not a multiple of "
            f"local_batch_size × dp = {local_batch_size} × {dp_size}"
        )
    return global_batch_size // (local_batch_size * dp_size)


def micro_batches(rows: torch.Tensor, local_batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's ``rows`` (windows of ``seq_len + 1`` tokens) as ``(inputs, labels)`` micro-batches
    of ``local_batch_size`` rows, in order (both loaders)."""
    return [(chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()) for chunk in rows.split(local_batch_size)]


class StreamingLoader:
    """Yields this rank's micro-batches ``(inputs, labels)`` for each global batch of a streamed
    dataset; a drop-in for :class:`~torchtitan_lite.data.GlobalBatchLoader` (``next_batch``,
    ``state_dict``/``load_state_dict``, ``step``, ``skipped``, ``grad_accum_steps``).

    Sample ``p`` of every global batch is the next window of range ``p`` of the rows (see the
    module's docstring). A position known on one rank is only its own samples': before
    :meth:`state_dict` on a run of several ranks, every rank calls :meth:`gather_state` (a
    collective), so that the state holds every sample's position.
    """

    def __init__(
        self,
        corpus: ArrowCorpus,
        tokenizer: _Encoder,
        *,
        seq_len: int,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        self.grad_accum_steps = check_batch_split(global_batch_size, local_batch_size, dp_size)
        corpus.check_global_batch(global_batch_size)
        self.corpus = corpus
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.step = 0  # global batches consumed
        self.skipped: set[int] = set()  # global batches never to read (training.on_nonfinite = "rollback")
        per_rank = global_batch_size // dp_size
        bounds = [p * corpus.num_rows // global_batch_size for p in range(global_batch_size + 1)]
        self.bounds = bounds
        self._mine = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        wrapped: set[int] = set()
        self._streams = [_Stream(corpus, tokenizer, bounds[p], bounds[p + 1], p, wrapped) for p in self._mine]
        self._all: list[list[int]] | None = None  # every sample's position at step _all_step
        self._all_step = -1

    def _advance(self) -> np.ndarray:
        return np.stack([s.take(self.seq_len + 1) for s in self._streams])

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The micro-batches of this rank for the next global batch (batches in :attr:`skipped`
        are read and left out)."""
        while self.step in self.skipped:
            self._advance()
            self.step += 1
        data = torch.from_numpy(self._advance())
        self.step += 1
        return micro_batches(data, self.local_batch_size)

    def gather_state(self) -> None:
        """Every rank's sample positions to every rank (a collective over the default group, whose
        ranks are the data-parallel ranks); call on every rank before a checkpoint is saved."""
        mine = {s.index: s.position() for s in self._streams}
        if self.dp_size > 1:
            import torch.distributed as dist

            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (self.step, mine))
            if {step for step, _ in gathered} != {self.step}:
                raise RuntimeError(f"data loader: ranks are at different steps {[s for s, _ in gathered]}")
            for _, part in gathered:
                mine.update(part)
        self._all = [mine[p] for p in range(self.global_batch_size)]
        self._all_step = self.step

    def state_dict(self) -> dict[str, Any]:
        """The exact position as plain data: global batches consumed, every sample's position
        (epoch, row, tokens of that row used), and what gives them meaning."""
        if self._all_step != self.step:
            if self.dp_size > 1:
                raise RuntimeError("StreamingLoader.state_dict: call gather_state() on every rank first")
            self.gather_state()
        return {
            "step": self.step,
            "global_batch_size": self.global_batch_size,
            "seq_len": self.seq_len,
            "dataset": self.corpus.dataset,
            "text_column": self.corpus.text_column,
            "num_rows": self.corpus.num_rows,
            "positions": [list(p) for p in self._all or []],
            "skipped": sorted(self.skipped),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (saved at any world size with the same global batch size)."""
        mine = {"global_batch_size": self.global_batch_size, "seq_len": self.seq_len,
                "dataset": self.corpus.dataset, "text_column": self.corpus.text_column,
                "num_rows": self.corpus.num_rows}
        if "positions" not in state:
            raise DataError(f"data loader state does not match this run: it was saved from another kind of "
                            f"dataset, this run streams {self.corpus.dataset!r}")
        for name, value in mine.items():
            if state.get(name) != value:
                hint = (f"; to resume at another world size, set training.global_batch_size = {state.get(name)}"
                        if name == "global_batch_size" else "")
                raise DataError(f"data loader state does not match this run: it was saved with {name}="
                                f"{state.get(name)!r}, this run has {value!r}; the saved position would point "
                                f"at other samples{hint}")
        step, positions, skipped = state.get("step"), state["positions"], state.get("skipped", [])
        if not isinstance(step, int) or step < 0:
            raise DataError(f"data loader state: invalid step {step!r}; expected an integer >= 0")
        if (not isinstance(positions, list) or len(positions) != self.global_batch_size
                or not all(isinstance(p, list) and len(p) == 3 and all(isinstance(v, int) and v >= 0 for v in p)
                           for p in positions)):
            raise DataError(f"data loader state: invalid positions; expected {self.global_batch_size} "
                            "[epoch, row, tokens] lists of integers >= 0")
        if not isinstance(skipped, list) or not all(isinstance(s, int) and s >= 0 for s in skipped):
            raise DataError(f"data loader state: invalid skipped {skipped!r}; expected a list of integers >= 0")
        for stream in self._streams:
            stream.seek(*positions[stream.index])
        self.step = step
        self.skipped = set(skipped)
        self._all = [list(p) for p in positions]
        self._all_step = step

    def describe(self) -> str:
        """One line for the start-up log."""
        return (f"{self.corpus.source} ({self.corpus.dataset}, column {self.corpus.text_column!r}): "
                f"{self.corpus.num_rows} rows in {len(self.corpus.files)} files, streamed; each of the "
                f"{self.global_batch_size} samples of a global batch packs its own {self.corpus.num_rows // self.global_batch_size}"
                f"+ rows into windows of {self.seq_len + 1}")
