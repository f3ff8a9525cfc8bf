"""The ``chat`` source: conversations for supervised fine-tuning, rendered with the tokenizer's
own chat template and packed whole into windows.

Rows (JSON lines, or Parquet files; a file or a folder searched recursively) hold either a
``messages`` list of ``{role, content}`` tables (with ``tool_calls``, ``reasoning_content`` /
``thinking``, ``name``, ``tool_call_id`` … as the template reads them) and optionally a ``tools``
list, or ``prompt`` / ``completion`` strings (a user turn and an assistant turn). Each
conversation is rendered and tokenized as transformers' ``apply_chat_template`` does
(:mod:`.chat_template`: where the template comes from, and which tokens are the assistant's).
The labels count the assistant turns only (``loss_on = "assistant"``) or every token
(``"all"``). A row the template refuses, whose assistant turns cannot be found with certainty, or
that is malformed stops the job with one line naming the file and the row, or with
``training.on_bad_row = "skip"`` is skipped and counted in the log. A conversation longer than
``seq_len + 1`` tokens is cut at the right or dropped (``truncate``), counted and logged.
Conversations are packed whole into windows of ``seq_len + 1`` tokens
(:class:`~torchtitan_lite.data.windows.PackedWindows`): ``packing = "greedy"`` in order, each
one that does not fit in what is left of a window starting the next; ``"bfd"`` best-fit
decreasing (longest first, each into the window it fills most tightly: less padding). What is
left of a window is padding that counts nothing. With ``model.attention_mask = "block_causal"``
no conversation sees another.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_lite.data import chat_cache
from torchtitan_lite.data.chat_template import ChatTemplate, RowError
from torchtitan_lite.data.files import suffix_files, unreadable_error
from torchtitan_lite.data.tokenizers import Tokenizer
from torchtitan_lite.data.windows import PackedWindows
from torchtitan_lite.errors import DataError

__all__ = ["KINDS", "ChatTemplate", "NotJSON", "conversation", "find_files", "pack", "packed_windows", "parsed",
           "read_rows", "share_rows"]

logger = logging.getLogger("torchtitan_lite")

KINDS = {"chat": "conversations: JSON lines or Parquet rows with a messages list of {role, content} (and "
                 "optionally tools), or prompt / completion (dataset_path)"}
SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
PACKINGS = ("greedy", "bfd")
_SPANS_FIX = ("mark the assistant's text with {% generation %} ... {% endgeneration %} in a template given by "
              "training.chat_template, or set training.on_bad_row = 'skip'")


def find_files(dataset: str, dataset_path: str | None, *, section: str, key: str) -> list[Path]:
    """The conversation files ``dataset_path`` names (cheap checks: existence and suffixes)."""
    return suffix_files(dataset_path, SUFFIXES, key=key, section=section, dataset=dataset, what=KINDS[dataset])


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


def _content_ok(content: Any) -> bool:
    """A message's content: text, null, or a list of content parts (tables)."""
    return content is None or isinstance(content, str) or (
        isinstance(content, list) and all(isinstance(part, dict) for part in content))


class NotJSON:
    """A line of a JSON-lines file that does not parse (a truncated write, a stray line): what
    :func:`share_rows` yields in its record's place, so that the reader's ``training.on_bad_row``
    decides about it as about any other bad row (:func:`parsed`)."""

    def __init__(self, line: str) -> None:
        self.line = line


def parsed(record: Any) -> Any:
    """``record`` itself; :class:`RowError` (kind ``"not JSON"``) for a :class:`NotJSON` line."""
    if isinstance(record, NotJSON):
        text = record.line.strip()
        raise RowError(f"not JSON: {text[:80]!r}{'...' if len(text) > 80 else ''}", kind="not JSON")
    return record


def conversation(record: Any) -> tuple[list[dict[str, Any]], list[Any] | None]:
    """A row's messages and tools (None: the row has none): its ``messages`` (and ``tools``), or its
    ``prompt`` and ``completion`` as two turns; :class:`RowError` (kind ``"row"``) for anything else."""
    record = parsed(record)
    if isinstance(record, dict) and record.get("messages") is not None:
        messages = record["messages"]
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and _content_ok(m.get("content"))
                for m in messages)):
            raise RowError(f"'messages' is not a non-empty list of {{role, content}} tables (role a string, content "
                           f"a string or a list of parts): {str(messages)[:80]!r}", kind="row")
        tools = record.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise RowError(f"'tools' is not a list of tables (JSON schemas): {str(tools)[:80]!r}", kind="row")
        return [dict(m) for m in messages], tools  # [] is not None, as transformers passes it
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["completion"]},
        ], None
    raise RowError(f"expected a 'messages' list of {{role, content}} tables, or 'prompt' and 'completion' strings; "
                   f"got {str(record)[:80]!r}", kind="row")


ROW_COLUMNS = ("messages", "tools", "prompt", "completion")
"""The columns of a Parquet file that a conversation row reads."""


def share_rows(files: list[Path], key: str, share: tuple[int, int] = (0, 1), *,
               columns: tuple[str, ...] | None = ROW_COLUMNS) -> Iterator[tuple[int, str, Any]]:
    """The rows ``(number, where, record)`` of the files whose number (counted over the files, in
    order) is ``index`` modulo ``count`` for ``share = (index, count)``; other rows are only
    counted (a JSON line not parsed, a Parquet batch's other rows not converted). Parquet rows
    hold the ``columns`` the file has (None: all of its columns). A line that is not JSON is
    yielded as :class:`NotJSON`: the reader's ``on_bad_row`` stops on it or skips it."""
    index, count = share
    number = 0
    for file in files:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                reader = pq.ParquetFile(str(file))
                names = reader.schema_arrow.names
                present = names if columns is None else [c for c in columns if c in names]
                row = 0
                for batch in reader.iter_batches(columns=present, batch_size=4096):
                    mine = [i for i in range(batch.num_rows) if (number + i) % count == index]
                    records = batch.take(mine).to_pylist() if mine else []
                    for i, record in zip(mine, records, strict=True):
                        yield number + i, f"{str(file)!r} row {row + i}", record
                    number, row = number + batch.num_rows, row + batch.num_rows
            except OSError as exc:
                raise unreadable_error(key, file, exc) from None
            continue
        try:
            raw = file.read_bytes()
            if file.name.endswith(".gz"):
                raw = gzip.decompress(raw)
        except OSError as exc:
            raise unreadable_error(key, file, exc) from None
        for lineno, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), start=1):
            if not line.strip():
                continue
            if number % count == index:
                try:
                    record = json.loads(line)
                except ValueError:
                    record = NotJSON(line)
                yield number, f"{str(file)!r} line {lineno}", record
            number += 1


def read_rows(files: list[Path], key: str) -> Iterator[tuple[str, Any]]:
    """Every row of the files, in order, with where it is (``'f.jsonl' line 3``, ``'f.parquet' row
    2``). A file that cannot be read, or a line that is not JSON, is a :class:`DataError` naming
    the file and the line."""
    for _, where, record in share_rows(files, key):
        if isinstance(record, NotJSON):
            raise DataError(f"{key}: {where} is not JSON")
        yield where, record


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------


class _Capacities:
    """Open windows by the room left in each (0 … ``size``): the one with the least room that
    still holds ``n`` tokens, in O(log size) (a segment tree of counts over the room)."""

    def __init__(self, size: int) -> None:
        self.leaves = 1 << max(size, 1).bit_length()
        self.counts = [0] * (2 * self.leaves)
        self.windows: list[list[int]] = [[] for _ in range(size + 1)]

    def _update(self, room: int, delta: int) -> None:
        node = room + self.leaves
        while node:
            self.counts[node] += delta
            node //= 2

    def add(self, room: int, window: int) -> None:
        self.windows[room].append(window)
        self._update(room, 1)

    def take_tightest(self, need: int) -> tuple[int, int] | None:
        """(room, window) of the open window with the least room ≥ ``need``, removed; None if none."""
        node = need + self.leaves
        if self.counts[node] == 0:
            while node > 1:
                if node % 2 == 0 and self.counts[node + 1] > 0:
                    node += 1
                    while node < self.leaves:  # down to its leftmost non-empty leaf
                        node = 2 * node if self.counts[2 * node] > 0 else 2 * node + 1
                    break
                node //= 2
            else:
                return None
        room = node - self.leaves
        self._update(room, -1)
        return room, self.windows[room].pop()


def pack(lengths: list[int], size: int, *, packing: str) -> list[list[int]]:
    """Which samples (by index) go into each window of ``size`` tokens, in the order they sit
    there: ``"greedy"`` in order, a sample that does not fit in what is left of the current window
    starting the next; ``"bfd"`` best-fit decreasing (longest first, ties in order, each into the
    open window with the least room that holds it, else a new one). Every length is ≤ ``size``."""
    windows: list[list[int]] = []
    if packing == "greedy":
        used = size
        for index, n in enumerate(lengths):
            if used + n > size:
                windows.append([])
                used = 0
            windows[-1].append(index)
            used += n
        return windows
    if packing != "bfd":
        raise ValueError(f"packing: {packing!r} is not one of {PACKINGS}")
    open_windows = _Capacities(size)
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[index]
        found = open_windows.take_tightest(n)
        if found is None:
            room, window = size, len(windows)
            windows.append([])
        else:
            room, window = found
        windows[window].append(index)
        open_windows.add(room - n, window)
    return windows


def packed_windows(files: list[Path], tokenizer: Tokenizer, *, seq_len: int, loss_on: str, truncate: str, key: str,
                   where: str, chat_template: str | None = None, on_bad_row: str = "stop",
                   packing: str = "greedy", template_kwargs: dict[str, Any] | None = None,
                   cache_dir: Path | None = None) -> PackedWindows:
    """Every conversation rendered, tokenized with its label mask, and packed whole into windows
    of ``seq_len + 1`` tokens (``packing``). A bad row is a :class:`DataError` naming it, or
    (``on_bad_row = "skip"``) skipped and counted in the log. With ``cache_dir`` the encodings are
    made once, by this node's ranks on their shares, and kept there (:mod:`.chat_cache`)."""
    template = ChatTemplate(tokenizer, template_path=chat_template, template_kwargs=template_kwargs)
    size = seq_len + 1

    def encode(record: Any) -> tuple[np.ndarray, np.ndarray]:
        messages, tools = conversation(record)
        return template.encode(messages, loss_on=loss_on, tools=tools)

    def bad_row_error(row: str, exc: Any) -> DataError:
        fix = f"; {_SPANS_FIX}" if exc.kind == "spans" else " (or set training.on_bad_row = 'skip')"
        return DataError(f"{key}: {row}: {exc}{fix}")

    def stop_on(number: int, row: str, exc: Any) -> DataError | None:
        return None if on_bad_row == "skip" else bad_row_error(row, exc)

    cache_key = None
    if cache_dir is not None:
        tokenizer_file = getattr(tokenizer, "path", None)
        cache_key = chat_cache.cache_key(files, template_sources=dict(template.templates.sources),
                                         tokenizer_file=None if tokenizer_file is None else Path(tokenizer_file),
                                         variables={k: v for k, v in template.special.items()}, loss_on=loss_on)
    chats = chat_cache.encoded_chats(lambda share: share_rows(files, key, share), encode, key=cache_key,
                                     cache_dir=cache_dir, stop_on_bad_row=stop_on, label="conversations")
    if chats.first_bad is not None and on_bad_row != "skip":  # found by a build that skipped it
        _, row, kind, message = chats.first_bad
        raise bad_row_error(row, RowError(message, kind=kind))
    if chats.skipped:
        kinds = {"row": "malformed", "not JSON": "not JSON", "template": "refused by the chat template",
                 "spans": "with assistant turns that cannot be found"}
        first = "" if chats.first_bad is None else f"{chats.first_bad[1]}: {chats.first_bad[3]}"
        logger.warning("%s: %d row(s) skipped (training.on_bad_row = 'skip'): %s; the first: %s", key,
                       sum(chats.skipped.values()),
                       ", ".join(f"{n} {kinds[k]}" for k, n in sorted(chats.skipped.items())), first)
    lengths = chats.lengths
    over = lengths > size
    cut = dropped = 0
    keep = np.arange(len(lengths))
    if over.any():
        if truncate == "drop":
            dropped = int(over.sum())
            keep = np.flatnonzero(~over)
        else:
            cut = int(over.sum())
        logger.warning("%s: %d conversation(s) longer than seq_len + 1 = %d tokens were %s (training.truncate)",
                       key, cut or dropped, size, "cut at the right" if cut else "dropped")
    if not len(keep):
        why = [f"{dropped} dropped: training.truncate = 'drop'"] if dropped else []
        why += [f"{sum(chats.skipped.values())} skipped: training.on_bad_row = 'skip'"] if chats.skipped else []
        raise DataError(f"{key}: {where} holds no conversation that fits seq_len + 1 = {size} tokens"
                        + (f" ({'; '.join(why)})" if why else ""))
    used = np.minimum(lengths, size)
    windows = pack(used[keep].tolist(), size, packing=packing)
    members = keep[np.fromiter((i for w in windows for i in w), dtype=np.int64, count=len(keep))]
    starts = np.zeros(len(windows) + 1, dtype=np.int64)
    np.cumsum([len(w) for w in windows], out=starts[1:])
    counted = _counted_labels(chats, keep, used)
    if counted == 0:
        raise DataError(f"{key}: {where} has no token the loss counts (training.loss_on = {loss_on!r}: no "
                        "assistant turn?)")
    padding = len(windows) * size - int(used[keep].sum())
    return PackedWindows(chats, members, starts, used, seq_len=seq_len, what="conversations", padding=padding,
                         counted=counted)


def _counted_labels(chats: chat_cache.EncodedChats, keep: np.ndarray, used: np.ndarray) -> int:
    """The counted labels of the kept conversations, each within its first ``used`` tokens."""
    total = sum(int(np.count_nonzero(part.counted)) for part in chats.parts)
    kept = np.zeros(len(chats), dtype=bool)
    kept[keep] = True
    for i in np.flatnonzero((chats.lengths > used) | ~kept):  # cut or dropped: recount or take out
        ids, counted = chats.sample(int(i))
        total -= int(np.asarray(counted, dtype=np.int64).sum())
        if kept[i]:
            total += int(np.asarray(counted[: used[i]], dtype=np.int64).sum())
    return total
