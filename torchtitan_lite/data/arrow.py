"""The streamed sources: Parquet files and Hugging Face ``datasets`` folders (``save_to_disk``,
Arrow) with a text column, read with ``pyarrow`` record batch by record batch and tokenized only
as windows are needed.

Lanes (independent of the world size): the rows (documents) of all files, in order, are cut into
``L`` contiguous ranges, ``L`` the global batch size; lane ``p`` packs its own rows (tokenized,
BOS/EOS around each) back to back into windows of ``seq_len + 1`` tokens, and the loader asks
lane ``p`` for the window of sample ``p`` of a global batch. A rank reads and tokenizes only its
own samples' lanes. When a lane is used up it starts again (its next epoch; logged).

Shuffled (``shuffle``), each epoch of a lane reads its Parquet row groups / Arrow record batches
(clipped to the lane) in an order seeded by ``(seed, key, lane, epoch)``, through a buffer of
``shuffle_buffer`` documents from which the next is drawn by a seeded counter: memory stays
bounded by the buffer, and the order is a function of the files' metadata alone. A lane's
position is three integers (epoch, documents of the epoch's order before the current one, tokens
of the current one used): saved in a checkpoint it resumes exactly, on any world size with the
same global batch size.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_lite.data.files import existing_path, files_under, unreadable_error
from torchtitan_lite.data.windows import Encoder, TokenStream, pack_texts
from torchtitan_lite.errors import DataError

__all__ = ["KINDS", "ArrowCorpus", "LaneReader", "check_streamed_dataset", "find_files", "token_stream"]

logger = logging.getLogger("torchtitan_lite")

KINDS: dict[str, str] = {
    "parquet": ".parquet files or a folder of them (searched recursively), streamed (dataset_path)",
    "arrow": "a Hugging Face datasets folder (Dataset.save_to_disk) or .arrow files, streamed (dataset_path)",
}
_SUFFIX = {"parquet": ".parquet", "arrow": ".arrow"}
_READ_ROWS = 256  # Parquet rows decoded at a time per lane (bounds the memory of a reader) ...
_PY_ROWS = 16  # ... of which this many become Python strings at a time
_TOKENIZE_ROWS = 256  # at most this many documents tokenized at a time per lane ...
_TOKENIZE_CHARS = 1 << 16  # ... or about this many characters


def _pyarrow(dataset: str, section: str) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
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
        raise DataError(
            f"{key}: folder {str(path)!r} holds no {suffix} files (needed by {section}.dataset={dataset!r})"
        )
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
    path = existing_path(dataset_path, key=key, section=section, dataset=dataset, what=KINDS[dataset])
    pa = _pyarrow(dataset, section)
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

    def spans(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Rows ``[lo, hi)`` cut at the pieces' (row groups', record batches') bounds, in order."""
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        out = []
        for index in range(first, len(self.pieces)):
            start, stop = int(self.starts[index]), int(self.starts[index + 1])
            if start >= hi:
                break
            out.append((max(start, lo), min(stop, hi)))
        return out

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


def find_files(dataset: str, dataset_path: str | None, *, section: str, key: str,
               text_column: str = "text") -> list[Path]:
    """The files of a streamed source (see :func:`check_streamed_dataset`)."""
    return check_streamed_dataset(dataset, dataset_path, text_column=text_column, section=section, key=key)


def token_stream(dataset: str, dataset_path: str, tokenizer: Encoder, *, section: str, where: str,
                 text_column: str, max_tokens: int | None) -> TokenStream:
    """The rows read in order and tokenized until ``max_tokens`` tokens are packed (None: all of
    them): validation reads the first windows it needs, not the whole set."""
    corpus = ArrowCorpus(dataset, dataset_path, text_column=text_column, section=section)
    return pack_texts(corpus.texts(0, corpus.num_rows), tokenizer, max_tokens=max_tokens,
                      empty=f"{corpus.key}: {where} is empty (no text)")


# --------------------------------------------------------------------------------------------
# Lanes: one range of rows each, in a (shuffled) order, packed into windows
# --------------------------------------------------------------------------------------------

_MASK = (1 << 64) - 1


def _draw(key: int, n: int) -> int:
    """The ``n``-th pseudo-random 64-bit number of stream ``key`` (splitmix64 of a counter: no
    state to save but ``n``)."""
    z = (key + (n + 1) * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class _EpochOrder:
    """The rows of one epoch of a lane, as row numbers, in the order they are read: its spans in
    the given order (the reading order) taken in one by one into a buffer of ``size`` rows, from
    which each next row is drawn by counter ``n`` of stream ``key`` (size 1: the reading order)."""

    def __init__(self, spans: list[tuple[int, int]], size: int, key: int) -> None:
        self.spans, self.size, self.key = spans, max(1, size), key
        self.buffer: list[int] = []
        self.taken = 0  # rows of the reading order taken in so far
        self.draws = 0
        self._span, self._row = 0, spans[0][0] if spans else 0

    def _take_in(self) -> bool:
        while self._span < len(self.spans) and self._row >= self.spans[self._span][1]:
            self._span += 1
            self._row = self.spans[self._span][0] if self._span < len(self.spans) else 0
        if self._span >= len(self.spans):
            return False
        self.buffer.append(self._row)
        self._row += 1
        self.taken += 1
        return True

    def next(self) -> int | None:
        """The next row of the epoch, or None at its end."""
        while len(self.buffer) < self.size and self._take_in():
            pass
        if not self.buffer:
            return None
        j = 0 if len(self.buffer) == 1 else _draw(self.key, self.draws) % len(self.buffer)
        self.draws += 1
        row = self.buffer[j]
        self.buffer[j] = self.buffer[-1]
        self.buffer.pop()
        return row

    def reading_order(self, start: int) -> Iterator[tuple[int, int]]:
        """``(first, stop)`` rows of the reading order from its ``start``-th row on."""
        for lo, hi in self.spans:
            if start < hi - lo:
                yield lo + start, hi
                start = 0
            else:
                start -= hi - lo


class _EpochTexts:
    """The texts of the rows an :class:`_EpochOrder` gives, read in its reading order (as the
    order takes them in) and kept until given: at most its buffer's rows are held."""

    def __init__(self, corpus: ArrowCorpus, order: _EpochOrder) -> None:
        self.corpus = corpus
        self.held: dict[int, str | None] = {}
        wanted = set(order.buffer)  # rows taken in before a seek: read again, each piece once
        pieces: dict[int, list[int]] = {}
        for row in order.buffer:
            pieces.setdefault(int(np.searchsorted(corpus.starts, row, side="right")) - 1, []).append(row)
        for rows in pieces.values():
            lo, hi = min(rows), max(rows) + 1
            self.held.update((row, text) for row, text in zip(range(lo, hi), corpus.texts(lo, hi), strict=True)
                             if row in wanted)
        self._rows = self._read(order.reading_order(order.taken))

    def _read(self, ranges: Iterator[tuple[int, int]]) -> Iterator[tuple[int, str | None]]:
        for lo, hi in ranges:
            yield from zip(range(lo, hi), self.corpus.texts(lo, hi), strict=True)

    def take(self, row: int) -> str | None:
        while row not in self.held:
            got, text = next(self._rows)
            self.held[got] = text
        return self.held.pop(row)


class _Lane:
    """Rows ``[lo, hi)`` tokenized as needed and packed back to back, forever (epoch after epoch),
    each epoch in its :class:`_EpochOrder`. Its position: the epoch, the documents of the epoch's
    order before the first one not yet fully used, and how many tokens of that one were used."""

    def __init__(self, reader: LaneReader, lo: int, hi: int, index: int) -> None:
        self.reader, self.corpus, self.lo, self.hi, self.index = reader, reader.corpus, lo, hi, index
        self.spans = reader.corpus.spans(lo, hi)
        self.pending: deque[tuple[int, int, np.ndarray]] = deque()  # (epoch, document, tokens)
        self.used = 0  # tokens of pending[0] already in windows
        self.seek(0, 0, 0)

    def _order(self, epoch: int) -> _EpochOrder:
        r = self.reader
        if not r.shuffle:
            return _EpochOrder(self.spans, 1, 0)
        seed = [r.seed, *r.key, self.index, epoch]
        spans = [self.spans[i] for i in np.random.default_rng(seed).permutation(len(self.spans))]
        key = int(np.random.SeedSequence(seed).generate_state(1, np.uint64)[0])
        return _EpochOrder(spans, r.shuffle_buffer, key)

    def _start_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch, self.next_doc = epoch, skip
        self.order = self._order(epoch)
        for _ in range(skip):
            self.order.next()
        self.texts = _EpochTexts(self.corpus, self.order)

    def seek(self, epoch: int, doc: int, used: int) -> None:
        if not 0 <= doc < self.hi - self.lo:
            raise DataError(f"data loader state: document {doc} is outside lane {self.index}'s "
                            f"{self.hi - self.lo} rows of the dataset")
        self._start_epoch(epoch, doc)
        # The epoch of the last token used: at an epoch's very start, the one before.
        self.used_epoch = epoch if doc or used else max(epoch - 1, 0)
        self.pending.clear()
        self.used = 0
        if used:
            self._fetch()
            if self.pending[0][:2] != (epoch, doc) or used >= len(self.pending[0][2]):
                raise DataError(f"data loader state: document {doc} of lane {self.index} has no token {used}: the "
                                "dataset or the tokenizer is not the one the checkpoint was saved with")
            self.used = used

    def position(self) -> list[int]:
        if self.pending:
            epoch, doc, _ = self.pending[0]
            return [epoch, doc, self.used]
        if self.next_doc >= self.hi - self.lo:  # every document of the epoch given: the next one's start
            return [self.epoch + 1, 0, 0]
        return [self.epoch, self.next_doc, 0]

    def _fetch(self) -> None:
        """Tokenize the next documents (the next epoch's after the last) until some tokens are pending."""
        empty = 0
        while not self.pending:
            docs: list[tuple[int, int, str]] = []
            chars = 0
            while len(docs) < _TOKENIZE_ROWS and chars < _TOKENIZE_CHARS:
                row = self.order.next()
                if row is None:
                    self._start_epoch(self.epoch + 1)
                    break
                text = self.texts.take(row)
                if text:
                    docs.append((self.epoch, self.next_doc, text))
                    chars += len(text)
                else:
                    empty += 1
                self.next_doc += 1
            if docs:
                encoded = self.reader.tokenizer.encode_batch([text for _, _, text in docs])
                self.pending.extend((e, d, ids) for (e, d, _), ids in zip(docs, encoded, strict=True) if len(ids))
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
                self.reader.began(epoch, self)
            k = min(n - filled, len(ids) - self.used)
            out[filled : filled + k] = ids[self.used : self.used + k]
            filled += k
            self.used += k
            if self.used == len(ids):
                self.pending.popleft()
                self.used = 0
        return out


class LaneReader:
    """The windows of a streamed source for the loader: lane ``p`` serves sample ``p`` of each
    global batch (see the module's docstring). This rank builds only ``lanes``; the positions of
    all ``num_lanes`` come back through :meth:`positions` / :meth:`seek` (the loader gathers them)."""

    unit = "windows"
    """What a sample of this source is, in log lines."""

    samples_per_epoch: int | None = None  # epochs are per lane, not known before reading
    packed = False  # plain token windows

    def __init__(self, corpus: ArrowCorpus, tokenizer: Encoder, *, seq_len: int, num_lanes: int, lanes: range,
                 seed: int, shuffle: bool, shuffle_buffer: int, key: tuple[int, ...] = (),
                 label: str = "training data") -> None:
        corpus.check_global_batch(num_lanes)
        self.corpus, self.tokenizer, self.seq_len, self.num_lanes = corpus, tokenizer, seq_len, num_lanes
        self.seed, self.shuffle, self.shuffle_buffer, self.key, self.label = seed, shuffle, shuffle_buffer, key, label
        self.bounds = [p * corpus.num_rows // num_lanes for p in range(num_lanes + 1)]
        self._wrapped: set[int] = set()  # epochs some lane of this rank has begun
        self._lanes = {p: _Lane(self, self.bounds[p], self.bounds[p + 1], p) for p in lanes}

    def began(self, epoch: int, lane: _Lane) -> None:
        """A lane started reading its rows again: logged once per epoch (the first of this rank's lanes)."""
        if epoch not in self._wrapped:
            self._wrapped.add(epoch)
            logger.warning("%s: sample %d has used all %d of its rows (%d..%d) and reads them again (epoch %d); "
                           "this rank's other samples follow as theirs run out", self.label, lane.index,
                           lane.hi - lane.lo, lane.lo, lane.hi - 1, epoch)

    def window(self, n: int, lane: int) -> np.ndarray:
        """The next ``seq_len + 1`` tokens of lane ``lane`` (``n`` plays no part)."""
        return self._lanes[lane].take(self.seq_len + 1)

    def positions(self) -> dict[int, list[int]]:
        """This rank's lanes' positions."""
        return {p: lane.position() for p, lane in self._lanes.items()}

    def seek(self, positions: list[list[int]]) -> None:
        """Continue every lane of this rank from ``positions`` (one per lane of all ranks)."""
        for p, lane in self._lanes.items():
            lane.seek(*positions[p])

    def epochs_begun(self) -> int:
        """The latest epoch any of this rank's lanes has begun (0 while all read their first)."""
        return max((lane.used_epoch for lane in self._lanes.values()), default=0)

    def identity(self) -> dict[str, Any]:
        """What gives saved lane positions their meaning."""
        return {"dataset": self.corpus.dataset, "text_column": self.corpus.text_column,
                "num_rows": self.corpus.num_rows, "seed": self.seed if self.shuffle else None,
                "shuffle": self.shuffle, "shuffle_buffer": self.shuffle_buffer if self.shuffle else 0}

    def describe(self) -> str:
        c = self.corpus
        order = (f"shuffled (row groups per epoch, buffer of {self.shuffle_buffer} documents)" if self.shuffle
                 else "in file order")
        return (f"{c.num_rows} rows in {len(c.files)} files (column {c.text_column!r}), streamed {order}; each of "
                f"the {self.num_lanes} samples of a global batch packs its own {c.num_rows // self.num_lanes}+ rows")
