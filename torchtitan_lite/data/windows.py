"""Token streams and their windows: what every source kind produces, and what validation pads.

A source's documents (tokenized, BOS/EOS around each) are packed back to back into one
:class:`TokenStream` and cut into non-overlapping :class:`TokenWindows` of ``seq_len + 1``
tokens. :class:`WindowReader` gives the loader sample ``n`` of such a source, epoch after
epoch, each epoch in its own seeded order. Imports nothing of the package but
:mod:`torchtitan_lite.errors`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from torchtitan_lite.errors import DataError

__all__ = [
    "IGNORE_INDEX",
    "Documents",
    "PackedWindows",
    "TokenStream",
    "TokenWindows",
    "WindowReader",
    "as_packed",
    "num_batches",
    "pack_texts",
    "padded_batch",
    "token_dtype_for",
    "window_tensors",
]

IGNORE_INDEX = -100  # label of padding rows (validation's last, partial batch)


class Encoder(Protocol):
    """What packing needs from a tokenizer."""

    vocab_size: int

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...


class TokenStream:
    """Several token arrays (in memory or memory-mapped) read as one stream, without copying."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = [p for p in parts if len(p)]
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` as a new ``int64`` array (crossing part boundaries as needed)."""
        out = np.empty(stop - start, dtype=np.int64)
        part = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pos = start
        while pos < stop:
            begin = pos - int(self.offsets[part])
            take = min(stop - pos, len(self.parts[part]) - begin)
            out[pos - start : pos - start + take] = self.parts[part][begin : begin + take]
            pos += take
            part += 1
        return out

    def max_token(self, chunk: int = 1 << 24) -> int:
        """Largest token id (reads every part once, chunk by chunk)."""
        best = -1
        for p in self.parts:
            for i in range(0, len(p), chunk):
                best = max(best, int(p[i : i + chunk].max()))
        return best


def token_dtype_for(vocab_size: int) -> type[np.unsignedinteger]:
    """The smallest token dtype that holds every id of a vocabulary."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def pack_texts(texts: Iterable[str | None], tokenizer: Encoder, *, max_tokens: int | None = None,
               empty: str) -> TokenStream:
    """Texts tokenized 256 at a time and packed back to back, until ``max_tokens`` (None: all);
    empty texts and nulls are left out. ``empty``: the :class:`DataError` line when there is no text."""
    parts: list[np.ndarray] = []
    total = 0
    batch: list[str] = []
    for text in _with_end(texts):
        if text:
            batch.append(text)
        if batch and (len(batch) == 256 or text is None):
            parts.extend(tokenizer.encode_batch(batch))
            total += sum(len(p) for p in parts[-len(batch):])
            batch = []
            if max_tokens is not None and total >= max_tokens:
                break
    if not parts:
        raise DataError(empty)
    tokens = np.concatenate(parts).astype(token_dtype_for(tokenizer.vocab_size))
    return TokenStream([tokens if max_tokens is None else tokens[:max_tokens]])


def _with_end(texts: Iterable[str | None]) -> Iterator[str | None]:
    """The texts with nulls as empty strings, then None (the end)."""
    yield from ("" if t is None else t for t in texts)
    yield None


@dataclass
class TokenWindows:
    """Non-overlapping windows of ``seq_len + 1`` tokens over a token stream."""

    unit = "windows"
    """What a sample of this source is, in log lines."""

    tokens: TokenStream | np.ndarray
    seq_len: int
    seq_len_key: str = "training.seq_len"
    source: str = "the dataset"

    def __post_init__(self) -> None:
        if isinstance(self.tokens, np.ndarray):
            self.tokens = TokenStream([self.tokens])
        if len(self) == 0:
            raise DataError(
                f"{self.seq_len_key}={self.seq_len}: {self.source} has only {len(self.tokens)} "
                "tokens, fewer than one window of seq_len + 1"
            )

    def __len__(self) -> int:
        return len(self.tokens) // (self.seq_len + 1)

    def __getitem__(self, index: int) -> np.ndarray:
        start = index * (self.seq_len + 1)
        assert isinstance(self.tokens, TokenStream)
        return self.tokens.read(start, start + self.seq_len + 1)


class WindowReader:
    """Sample ``n`` of a source whose windows are all known: window ``perm_e[n mod W]`` of epoch
    ``e = n // W``, ``perm_e`` a permutation seeded by ``(seed, *key, e)`` (the identity without
    ``shuffle``). Within an epoch no window is used twice; every window is used once per epoch.
    Its position is the loader's count of the source's samples: it keeps none itself."""

    def __init__(self, windows: TokenWindows | PackedWindows, *, seed: int, shuffle: bool,
                 key: tuple[int, ...] = ()) -> None:
        self.windows = windows
        self.seed, self.shuffle, self.key = seed, shuffle, key
        self.samples_per_epoch: int | None = len(windows)
        self.unit: str = windows.unit
        self.packed = isinstance(windows, PackedWindows)  # windows of (tokens, counted, samples)
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def index(self, n: int) -> int:
        """The window of the source's sample ``n``."""
        w = len(self.windows)
        if not self.shuffle:
            return n % w
        epoch = n // w
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, *self.key, epoch]).permutation(w)
            self._epoch = epoch
        assert self._perm is not None
        return int(self._perm[n % w])

    def window(self, n: int, lane: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of the source's sample ``n`` (``lane`` plays no part)."""
        return self.windows[self.index(n)]

    def positions(self) -> dict[int, list[int]]:
        """Lane positions: none (sample ``n`` alone says which window it is)."""
        return {}

    def seek(self, positions: list[list[int]]) -> None:
        """Nothing to seek (see :meth:`positions`)."""

    def epochs_begun(self) -> int:
        """Not used for these sources: the loader counts their epochs from their samples."""
        return 0

    def identity(self) -> dict[str, Any]:
        """What gives a saved sample count its meaning."""
        return {"num_windows": len(self.windows), "seed": self.seed, "shuffle": self.shuffle}

    def describe(self) -> str:
        if not isinstance(self.windows, TokenWindows):  # packed conversations, preference pairs
            return self.windows.describe()
        return f"{len(self.windows.tokens)} tokens, {len(self.windows)} windows of {self.windows.seq_len + 1}"


Documents = tuple[int | None, int | None]
"""A tokenizer's ``(bos_id, eos_id)``: where packed text documents begin and end, for
block-causal attention over windows of plain tokens."""


class PackedWindows:
    """Windows of whole samples packed back to back (chat conversations): window ``i`` is a
    ``(3, seq_len + 1)`` array of token ids, whether each token is a counted label (1) or not (0),
    and each token's sample number within the window (padding at the end is a sample of its own,
    never counted). Made on access from ``source.sample(j)`` (ids and labels of sample ``j``, e.g.
    memory-mapped), the first ``lengths[j]`` tokens of each: window ``i`` holds the samples
    ``members[starts[i]:starts[i + 1]]`` in that order."""

    unit = "windows"
    """What a sample of this source is, in log lines."""

    def __init__(self, source: Any, members: np.ndarray, starts: np.ndarray, lengths: np.ndarray, *, seq_len: int,
                 what: str, padding: int = 0, counted: int = 0) -> None:
        self.source, self.members, self.starts, self.lengths = source, members, starts, lengths
        self.seq_len, self.samples, self.what = seq_len, len(members), what
        self.padding = padding  # tokens of the windows that belong to no sample
        self.counted = counted  # counted labels over every window

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        index %= len(self)
        size = self.seq_len + 1
        window = np.zeros((3, size), dtype=np.int64)
        used = 0
        members = self.members[self.starts[index]:self.starts[index + 1]]
        for sample, member in enumerate(members):
            n = int(self.lengths[member])
            ids, counted = self.source.sample(int(member))
            window[0, used:used + n] = ids[:n]
            window[1, used:used + n] = counted[:n]
            window[2, used:used + n] = sample
            used += n
        window[2, used:] = len(members)
        return window

    def describe(self) -> str:
        share = self.padding / max(1, len(self) * (self.seq_len + 1))
        return (f"{self.samples} {self.what} packed into {len(self)} windows of {self.seq_len + 1} tokens "
                f"({self.counted} counted labels, {100 * share:.1f}% padding)")


def window_tensors(rows: np.ndarray,
                   documents: Documents | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(inputs, labels, document_ids)`` of windows: ``rows`` is ``(n, seq_len + 1)`` plain tokens
    or ``(n, 3, seq_len + 1)`` packed samples (:class:`PackedWindows`). Packed samples' labels are
    :data:`IGNORE_INDEX` where the token is not counted or belongs to another sample than the one
    predicting it. Document ids come only with ``documents`` (block-causal attention): packed
    samples' are the samples'; plain tokens' start a document at each BOS and after each EOS."""
    data = torch.from_numpy(np.ascontiguousarray(rows)).long()
    if data.dim() == 3:
        tokens, counted, docs = data[:, 0], data[:, 1].bool(), data[:, 2]
        keep = counted[:, 1:] & (docs[:, 1:] == docs[:, :-1])
        labels = torch.where(keep, tokens[:, 1:], torch.full_like(tokens[:, 1:], IGNORE_INDEX))
        return tokens[:, :-1].contiguous(), labels, None if documents is None else docs[:, :-1].contiguous()
    inputs, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    if documents is None:
        return inputs, labels, None
    bos, eos = documents
    starts = torch.zeros_like(inputs, dtype=torch.bool)
    if bos is not None:
        starts |= inputs == bos
    if eos is not None:
        starts[:, 1:] |= inputs[:, :-1] == eos
    return inputs, labels, starts.long().cumsum(dim=1)


def as_packed(window: np.ndarray, documents: Documents | None) -> np.ndarray:
    """A plain window as a packed one (every label counted; samples from BOS/EOS, see
    :func:`window_tensors`), so that it stacks with the windows of packed sources."""
    if window.ndim == 2:
        return window
    _, _, docs = window_tensors(window[None], documents or (None, None))
    ids = np.zeros(len(window), dtype=np.int64)
    ids[:-1] = docs[0].numpy()
    ids[-1] = ids[-2]
    return np.stack([window.astype(np.int64), np.ones(len(window), dtype=np.int64), ids])


def padded_batch(
    windows: TokenWindows | PackedWindows, indices: list[int], batch_size: int, documents: Documents | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(inputs, labels, document_ids)`` for ``indices`` padded to ``batch_size`` rows; padding
    rows are all-zero inputs with :data:`IGNORE_INDEX` labels, so every rank can run the same
    shapes. ``document_ids`` as :func:`window_tensors` gives them (None: plain causal windows)."""
    rows = [windows[index] for index in indices]
    shape = (3, windows.seq_len + 1) if isinstance(windows, PackedWindows) else (windows.seq_len + 1,)
    padding = np.zeros((batch_size - len(rows), *shape), dtype=np.int64)
    inputs, labels, docs = window_tensors(np.concatenate([np.stack(rows), padding]) if rows else padding, documents)
    labels[len(rows):] = IGNORE_INDEX
    return inputs, labels, docs


def num_batches(num_windows: int, global_batch_size: int) -> int:
    """Global batches needed to cover ``num_windows`` once (the last one may be partial)."""
    return math.ceil(num_windows / global_batch_size)
