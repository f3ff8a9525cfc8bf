"""Tokenizers, datasets and the stateful global-batch data loader.

Datasets (``[training] dataset`` / ``dataset_path``, and the same keys under ``[validation]``):

- ``python_stdlib``: the embedded default, the top-level ``.py`` modules of the running Python's
  standard library (about 4–5 MB of real text on every machine, read at run time, no download);
- ``python_stdlib_validation``: a held-out part of the same library (a few of its packages, never
  part of ``python_stdlib``), the default validation set;
- ``text``: a ``.txt`` file (one document), a ``.jsonl`` file (one document per line, in its
  ``text`` field), or a folder searched recursively for both;
- ``tokens``: pre-tokenized token ids as ``numpy`` memmaps, a ``.npy`` file (``uint16``/``uint32``)
  or a raw ``.bin`` file (``[training] dataset_token_dtype``), or a folder of them. They are read
  lazily, never loaded whole, and are expected to hold their own BOS/EOS separators.

Text is tokenized with BOS/EOS around every document and the documents are packed back to back
into one token stream, cut into non-overlapping windows of ``seq_len + 1`` tokens.

The loader's unit is the *global* batch: the samples of step ``k`` are fixed by the seed alone and
each data-parallel rank takes its own contiguous slice of them, split into micro-batches. So a run
on 1 rank with gradient accumulation and a run on 4 ranks see exactly the same samples at every
step, and the loader state (plain integers) resumes on any world size.
"""

from __future__ import annotations

import codecs
import json
import logging
import math
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from torchtitan_lite.errors import ConfigError, DataError

logger = logging.getLogger("torchtitan_lite")

__all__ = [
    "ByteTokenizer",
    "DATASETS",
    "GlobalBatchLoader",
    "HFTokenizer",
    "IGNORE_INDEX",
    "TokenStream",
    "TokenWindows",
    "Tokenizer",
    "build_token_stream",
    "build_tokenizer",
    "check_dataset",
    "num_batches",
    "padded_batch",
    "read_documents",
    "tokenizer_file",
    "token_dtype_for",
]


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text with BOS/EOS added, as ``uint32`` arrays."""
        ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0–255, plus BOS (256) and EOS (257). Needs no files."""

    bos_id: int | None = 256
    eos_id: int | None = 257
    vocab_size = 258

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([256] if bos else []) + ids + ([257] if eos else [])

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        out = []
        for text in texts:
            body = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            ids = np.empty(len(body) + 2, dtype=np.uint32)
            ids[0], ids[1:-1], ids[-1] = 256, body, 257
            out.append(ids)
        return out

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


# Special-token spellings tried, in order, when a tokenizer.json comes without a
# tokenizer_config.json that names its BOS/EOS tokens.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` library.

    BOS/EOS come from a ``tokenizer_config.json`` next to the file (``bos_token``/``eos_token``)
    when there is one, otherwise from the usual special-token spellings. A tokenizer with neither
    is rejected: documents could not be told apart once packed.
    """

    def __init__(self, path: str | Path, *, key: str = "model.tokenizer_path") -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as exc:  # pragma: no cover - tokenizers is a dependency
            raise DataError(f"{key}: reading tokenizer.json files needs the 'tokenizers' package") from exc
        file = tokenizer_file(path, key=key)
        try:
            self._tok = _HFTokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own exception types
            raise DataError(f"{key}: {str(file)!r} is not a valid tokenizer.json ({exc})") from None
        self.path = file
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        config = file.parent / "tokenizer_config.json"
        named = _special_tokens_from_config(config)
        self.bos_id = self._find("bos_token", named, _BOS_NAMES, vocab, config, key)
        self.eos_id = self._find("eos_token", named, _EOS_NAMES, vocab, config, key)
        if self.bos_id is not None and self.bos_id == self.eos_id:
            self.bos_id = None  # one token (GPT-2's <|endoftext|>) separates documents once
        if self.bos_id is None and self.eos_id is None:
            raise DataError(
                f"{key}: {str(file)!r} has no BOS or EOS token (looked for "
                f"{', '.join(dict.fromkeys(_BOS_NAMES + _EOS_NAMES))} and tokenizer_config.json); "
                "one is needed to separate packed documents"
            )

    @staticmethod
    def _find(which: str, named: dict[str, str | None], candidates: tuple[str, ...],
              vocab: dict[str, int], config: Path, key: str) -> int | None:
        if which in named:  # tokenizer_config.json decides, null included
            token = named[which]
            if token is None:
                return None
            if token not in vocab:
                raise DataError(
                    f"{key}: {str(config)!r} names {which} {token!r}, which the tokenizer's "
                    "vocabulary does not have"
                )
            return vocab[token]
        return next((vocab[name] for name in candidates if name in vocab), None)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        head = [] if self.bos_id is None else [self.bos_id]
        tail = [] if self.eos_id is None else [self.eos_id]
        return [np.array(head + enc.ids + tail, dtype=np.uint32) for enc in encodings]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def tokenizer_file(path: str | Path, *, key: str = "model.tokenizer_path") -> Path:
    """The ``tokenizer.json`` that ``path`` names: the file itself, or the one in a folder."""
    path = Path(path).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise DataError(
            f"{key}: invalid value {str(path)!r}; expected a tokenizer.json file or a folder holding one"
        )
    return file


def _special_tokens_from_config(path: Path) -> dict[str, str | None]:
    """``bos_token``/``eos_token`` of a tokenizer_config.json: a string, or None where the file
    sets it to null; a key the file does not have is left out."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out: dict[str, str | None] = {}
    for name in ("bos_token", "eos_token"):
        if name not in data:
            continue
        value = data[name]
        if isinstance(value, dict):
            value = value.get("content")
        out[name] = value if isinstance(value, str) else None
    return out


def build_tokenizer(tokenizer_path: str | None) -> Tokenizer:
    """The byte tokenizer when no path is given, else the ``tokenizer.json`` at the path."""
    return ByteTokenizer() if tokenizer_path is None else HFTokenizer(tokenizer_path)


# --------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------

# Packages of the standard library held out from ``python_stdlib`` (present in every CPython 3.x).
_STDLIB_VALIDATION_PACKAGES = ("asyncio", "email", "http", "json", "logging", "urllib")

# name -> what it reads (shown in errors and --help)
DATASETS: dict[str, str] = {
    "python_stdlib": "this Python's standard-library modules (embedded default, no path)",
    "python_stdlib_validation": "held-out standard-library packages (no path)",
    "text": ".txt / .jsonl files or a folder of them (dataset_path)",
    "tokens": "pre-tokenized .bin / .npy token files or a folder of them (dataset_path)",
}
_SUFFIXES = {"text": (".txt", ".jsonl"), "tokens": (".bin", ".npy")}
_TOKEN_DTYPES = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}


def _stdlib_files(dataset: str) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if dataset == "python_stdlib":
        files = sorted(stdlib.glob("*.py"))
    else:
        files = sorted(
            f for pkg in _STDLIB_VALIDATION_PACKAGES for f in (stdlib / pkg).rglob("*.py")
            if "test" not in f.relative_to(stdlib).parts[1:]
        )
    if not files:
        raise DataError(f"dataset {dataset!r}: no standard-library sources found under {str(stdlib)!r}")
    return files


def check_dataset(
    dataset: str, dataset_path: str | None, *, section: str = "training", key: str | None = None
) -> list[Path]:
    """The files a dataset reads; cheap checks only (names, existence, suffixes).

    Raises :class:`DataError` naming ``<section>.dataset`` / ``<section>.dataset_path`` (or
    ``key`` for the path, for callers with their own option names).
    """
    if dataset not in DATASETS:
        allowed = ", ".join(map(repr, DATASETS))
        raise ConfigError(f"{section}.dataset: invalid value {dataset!r}; expected one of {allowed}")
    if dataset in ("python_stdlib", "python_stdlib_validation"):
        if dataset_path is not None:
            raise ConfigError(
                f"{section}.dataset_path={dataset_path!r} is set but {section}.dataset={dataset!r} "
                f"reads no path; set {section}.dataset to 'text' or 'tokens' to read it"
            )
        return _stdlib_files(dataset)
    key = key or f"{section}.dataset_path"
    suffixes = _SUFFIXES[dataset]
    if dataset_path is None:
        raise ConfigError(f"{key}: {section}.dataset={dataset!r} needs a path to {DATASETS[dataset]}")
    path = Path(dataset_path).expanduser()
    if not path.exists():
        raise DataError(f"{key}: path not found: {dataset_path!r}")
    if path.is_dir():
        errors: list[OSError] = []
        found = [Path(root) / name for root, _, names in os.walk(path, onerror=errors.append) for name in names]
        if errors:
            raise _unreadable(key, Path(errors[0].filename or path), errors[0])
        files = sorted(f for f in found if f.is_file() and f.suffix in suffixes)
        if not files:
            raise DataError(
                f"{key}: folder {dataset_path!r} holds no {' or '.join(suffixes)} files "
                f"(needed by {section}.dataset={dataset!r})"
            )
        return files
    if path.suffix not in suffixes:
        raise DataError(
            f"{key}: {dataset_path!r} is not a {' or '.join(suffixes)} file "
            f"(needed by {section}.dataset={dataset!r})"
        )
    return [path]


MAX_INVALID_UTF8_FRACTION = 0.001
"""Text datasets: above this fraction of bytes that are not valid UTF-8 (over all files read),
the data is refused as not text; below it, each invalid byte becomes U+FFFD and the count is
logged."""


def _unreadable(key: str, path: Path, exc: OSError) -> DataError:
    reason = f"{exc.strerror} (errno {exc.errno})" if exc.strerror else str(exc)
    return DataError(f"{key}: {str(path)!r} cannot be read: {reason}")


@dataclass
class _Utf8Count:
    """Bytes read and bytes that were not valid UTF-8, and the file with the most of those."""

    total: int = 0
    invalid: int = 0
    worst: tuple[int, str] = (0, "")

    def decode(self, raw: bytes, file: Path) -> str:
        self.total += len(raw)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            pass
        bad = 0

        def replace_and_count(exc: UnicodeError) -> tuple[str, int]:
            nonlocal bad
            assert isinstance(exc, UnicodeDecodeError)
            bad += exc.end - exc.start
            return "\ufffd", exc.end

        codecs.register_error("torchtitan_lite.count_invalid", replace_and_count)
        text = raw.decode("utf-8", errors="torchtitan_lite.count_invalid")
        self.invalid += bad
        if bad > self.worst[0]:
            self.worst = (bad, str(file))
        return text


def read_documents(files: list[Path], key: str = "training.dataset_path") -> Iterator[str]:
    """The documents of text files: a whole ``.txt`` file, or each ``.jsonl`` line's ``text``.

    A file that cannot be read is one :class:`DataError` line naming it and the cause. Bytes that
    are not valid UTF-8 become U+FFFD and are counted: above :data:`MAX_INVALID_UTF8_FRACTION` of
    all bytes read, a :class:`DataError` (the data is not text: a binary file, another
    encoding); below, a warning with the count."""
    count = _Utf8Count()
    for file in files:
        try:
            raw = file.read_bytes()
        except OSError as exc:
            raise _unreadable(key, file, exc) from None
        if file.suffix == ".jsonl":
            for lineno, line in enumerate(raw.split(b"\n"), start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(count.decode(line, file))
                except ValueError:
                    record = None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise DataError(
                        f"{key}: {str(file)!r} line {lineno} is not a JSON object with a "
                        "string 'text' field"
                    )
                if record["text"]:
                    yield record["text"]
        else:
            text = count.decode(raw, file)
            if text:
                yield text
    if count.invalid:
        fraction = count.invalid / max(count.total, 1)
        where = f"{count.worst[0]} of them in {count.worst[1]!r}"
        if fraction > MAX_INVALID_UTF8_FRACTION:
            raise DataError(f"{key}: {count.invalid} of {count.total} bytes ({fraction:.2%}) are not valid UTF-8 "
                            f"({where}); more than {MAX_INVALID_UTF8_FRACTION:.1%} means the files are not UTF-8 "
                            "text (a binary file, or another encoding: convert it first)")
        logger.warning("%s: %d of %d bytes are not valid UTF-8 (%s) and were read as U+FFFD",
                       key, count.invalid, count.total, where)


def _token_file(file: Path, token_dtype: str, key: str, vocab_size: int) -> np.ndarray:
    if file.suffix == ".npy":
        try:
            array = np.load(file, mmap_mode="r", allow_pickle=False)
        except OSError as exc:
            raise _unreadable(key, file, exc) from None
        except ValueError as exc:
            raise DataError(f"{key}: {str(file)!r} is not a readable .npy array ({exc})") from None
        if array.dtype not in _TOKEN_DTYPES.values() or array.ndim != 1:
            raise DataError(
                f"{key}: {str(file)!r} holds a {array.ndim}-D {array.dtype} array; expected a 1-D "
                "uint16 or uint32 array of token ids"
            )
        return array
    dtype = _TOKEN_DTYPES[token_dtype]
    if dtype.itemsize * 8 < int(vocab_size - 1).bit_length():
        # A uint32 file read as uint16 gives in-range halves of ids: no range check would notice.
        raise DataError(
            f"training.dataset_token_dtype: invalid value {token_dtype!r} for {str(file)!r}; the "
            f"tokenizer has {vocab_size} ids, which need 'uint32'"
        )
    try:
        size = file.stat().st_size
        with file.open("rb"):
            pass
    except OSError as exc:
        raise _unreadable(key, file, exc) from None
    if size % dtype.itemsize:
        raise DataError(
            f"{key}: {str(file)!r} has {size} bytes, not a whole number of {token_dtype} tokens "
            "(see training.dataset_token_dtype)"
        )
    if size == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(file, dtype=dtype, mode="r")


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


def build_token_stream(
    dataset: str,
    dataset_path: str | None,
    tokenizer: Tokenizer,
    *,
    section: str = "training",
    token_dtype: str = "uint16",
) -> TokenStream:
    """Every document of a dataset tokenized and packed (text), or the token files mapped (tokens).

    Raises :class:`DataError` for a missing path, an empty dataset, unreadable files, or token
    ids the tokenizer's vocabulary does not have.
    """
    files = check_dataset(dataset, dataset_path, section=section)
    key = f"{section}.dataset_path" if dataset_path is not None else f"{section}.dataset"
    where = repr(dataset_path) if dataset_path is not None else repr(dataset)
    if dataset == "tokens":
        stream = TokenStream([_token_file(f, token_dtype, key, tokenizer.vocab_size) for f in files])
        if len(stream) == 0:
            raise DataError(f"{key}: {where} is empty (no tokens)")
        top = stream.max_token()
        if top >= tokenizer.vocab_size:
            raise DataError(
                f"{key}: {where} holds token id {top} but the tokenizer's vocabulary has "
                f"{tokenizer.vocab_size} ids (model.tokenizer_path); the tokens were made with "
                "another tokenizer or read with the wrong training.dataset_token_dtype"
            )
        return stream
    parts: list[np.ndarray] = []
    batch: list[str] = []
    for doc in read_documents(files, key):
        batch.append(doc)
        if len(batch) == 256:
            parts.extend(tokenizer.encode_batch(batch))
            batch = []
    if batch:
        parts.extend(tokenizer.encode_batch(batch))
    if not parts:
        raise DataError(f"{key}: {where} is empty (no text in {len(files)} file(s))")
    return TokenStream([np.concatenate(parts).astype(token_dtype_for(tokenizer.vocab_size))])


# --------------------------------------------------------------------------------------------
# Windows and the loader
# --------------------------------------------------------------------------------------------


@dataclass
class TokenWindows:
    """Non-overlapping windows of ``seq_len + 1`` tokens over a token stream."""

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


IGNORE_INDEX = -100  # label of padding rows (validation's last, partial batch)


class GlobalBatchLoader:
    """Yields this rank's micro-batches ``(inputs, labels)`` for each global batch.

    Sample ``j`` of the whole run is window ``perm_e[j mod W]`` of epoch ``e = j // W``, where
    ``perm_e`` is a permutation seeded by ``(seed, e)`` (the identity when ``shuffle`` is false).
    Step ``k`` uses samples ``[k·G, (k+1)·G)``; data-parallel rank ``r`` of ``D`` takes the
    ``G/D`` samples from ``k·G + r·G/D`` in order. Within an epoch no window is used twice, and
    every window is used once per epoch.
    """

    def __init__(
        self,
        windows: TokenWindows,
        *,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        if global_batch_size % (local_batch_size * dp_size):
            raise DataError(
                f"training.global_batch_size={global_batch_size} is not a multiple of "
                f"local_batch_size × dp = {local_batch_size} × {dp_size}"
            )
        self.windows = windows
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.grad_accum_steps = global_batch_size // (local_batch_size * dp_size)
        self.step = 0  # global batches consumed
        self.skipped: set[int] = set()  # global batches never to read (training.on_nonfinite = "rollback")
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def _window_index(self, sample: int) -> int:
        n = len(self.windows)
        if not self.shuffle:
            return sample % n
        epoch = sample // n
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            self._epoch = epoch
        assert self._perm is not None
        return int(self._perm[sample % n])

    def sample_indices(self, step: int) -> list[int]:
        """Window indices this rank reads at global batch ``step`` (0-based), in order."""
        per_rank = self.global_batch_size // self.dp_size
        first = step * self.global_batch_size + self.dp_rank * per_rank
        return [self._window_index(first + i) for i in range(per_rank)]

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The micro-batches of this rank for the next global batch (batches in
        :attr:`skipped` are passed over)."""
        while self.step in self.skipped:
            self.step += 1
        rows = np.stack([self.windows[i] for i in self.sample_indices(self.step)])
        self.step += 1
        data = torch.from_numpy(rows)
        micro = []
        for m in range(self.grad_accum_steps):
            chunk = data[m * self.local_batch_size : (m + 1) * self.local_batch_size]
            micro.append((chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()))
        return micro

    def state_dict(self) -> dict[str, Any]:
        """The exact position as plain data: global batches consumed, plus what gives it meaning."""
        return {
            "step": self.step,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_windows": len(self.windows),
            "seq_len": self.windows.seq_len,
            "skipped": sorted(self.skipped),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; it may come from any world size or micro-batch split."""
        mine = self.state_dict()
        for name in ("global_batch_size", "seed", "shuffle", "num_windows", "seq_len"):
            if name in state and state[name] != mine[name]:
                hint = (f"; to resume at another world size, set training.global_batch_size = "
                        f"{state[name]}" if name == "global_batch_size" else "")
                raise DataError(
                    f"data loader state does not match this run: it was saved with {name}="
                    f"{state[name]!r}, this run has {mine[name]!r}; the saved position would "
                    f"point at other samples{hint}"
                )
        step = state.get("step")
        if not isinstance(step, int) or step < 0:
            raise DataError(f"data loader state: invalid step {step!r}; expected an integer >= 0")
        skipped = state.get("skipped", [])
        if not isinstance(skipped, list) or not all(isinstance(s, int) and s >= 0 for s in skipped):
            raise DataError(f"data loader state: invalid skipped {skipped!r}; expected a list of integers >= 0")
        self.step = step
        self.skipped = set(skipped)


def padded_batch(
    windows: TokenWindows, indices: list[int], batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)`` for ``indices`` padded to ``batch_size`` rows; padding rows are
    all-zero inputs with :data:`IGNORE_INDEX` labels, so every rank can run the same shapes."""
    seq_len = windows.seq_len
    inputs = torch.zeros(batch_size, seq_len, dtype=torch.int64)
    labels = torch.full((batch_size, seq_len), IGNORE_INDEX, dtype=torch.int64)
    for row, index in enumerate(indices):
        window = torch.from_numpy(windows[index])
        inputs[row] = window[:-1]
        labels[row] = window[1:]
    return inputs, labels


def num_batches(num_windows: int, global_batch_size: int) -> int:
    """Global batches needed to cover ``num_windows`` once (the last one may be partial)."""
    return math.ceil(num_windows / global_batch_size)
