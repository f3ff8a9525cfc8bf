"""Tokenizers, datasets and the stateful global-batch data loader.

Datasets (``[training] dataset`` / ``dataset_path``, and the same keys under ``[validation]``):

- ``python_stdlib``: the embedded default, the top-level ``.py`` modules of the running Python's
  standard library but its build configuration (``_sysconfigdata_*``) (about 4–5 MB of real text on every machine, read at run time, no download);
- ``python_stdlib_validation``: a held-out part of the same library (a few of its packages, never
  part of ``python_stdlib``), the default validation set;
- ``text``: a ``.txt`` file (one document), a ``.jsonl`` file (one document per line, in its
  ``text`` field; ``.jsonl.gz``/``.json.gz`` gzip-compressed, as c4's shards), or a folder searched
  recursively for them; read and tokenized whole at start-up;
- ``tokens``: pre-tokenized token ids as ``numpy`` memmaps, a ``.npy`` file (``uint16``/``uint32``)
  or a raw ``.bin`` file (``[training] dataset_token_dtype``), or a folder of them. They are read
  lazily, never loaded whole, and are expected to hold their own BOS/EOS separators;
- ``parquet`` / ``arrow``: Parquet files, or a Hugging Face ``datasets`` folder (``save_to_disk``)
  or ``.arrow`` files, with a text column (``[training] dataset_text_column``): streamed, read and
  tokenized as windows are needed (:mod:`torchtitan_lite.arrow_data`, whose
  :class:`~torchtitan_lite.arrow_data.StreamingLoader` replaces the global-batch loader for them).

Text is tokenized with BOS/EOS around every document and the documents are packed back to back
into one token stream, cut into non-overlapping windows of ``seq_len + 1`` tokens.

The loader's unit is the *global* batch: the samples of step ``k`` are fixed by the seed alone and
each data-parallel rank takes its own contiguous slice of them, split into micro-batches. So a run
on 1 rank with gradient accumulation and a run on 4 ranks see exactly the same samples at every
step, and the loader state (plain integers) resumes on any world size.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import gzip
import json
import logging
import math
import os
import re
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from torchtitan_lite.arrow_data import (
    STREAMED_DATASETS,
    ArrowCorpus,
    check_batch_split,
    check_streamed_dataset,
    files_under,
    micro_batches,
    unreadable_error,
)
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
    "TOKENIZER_FILES",
    "TiktokenTokenizer",
    "Tokenizer",
    "build_token_stream",
    "build_tokenizer",
    "check_dataset",
    "hf_tokenizer_json",
    "num_batches",
    "padded_batch",
    "read_documents",
    "read_tiktoken_ranks",
    "tiktoken_to_tokenizer_json",
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
        if not _is_hf_json(file):
            raise DataError(f"{key}: {str(file)!r} is not a tokenizer.json file")
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "original/tokenizer.model")
"""What a tokenizer folder is searched for, in this order: a Hugging Face ``tokenizer.json``
(an ``hf_assets_path`` folder, a Hugging Face model folder), Meta's tiktoken ``tokenizer.model``
(Llama 3's original download), or the same under ``original/`` (a Hugging Face Llama 3 folder
without tokenizer.json)."""


def tokenizer_file(path: str | Path, *, key: str = "model.tokenizer_path") -> Path:
    """The tokenizer file ``path`` names: the file itself (a ``tokenizer.json`` or a tiktoken
    ``tokenizer.model``), or the first of :data:`TOKENIZER_FILES` in a folder. The one place that
    decides which file a tokenizer path means; raises :class:`DataError` when there is none."""
    path = Path(path).expanduser()
    if path.is_dir():
        file = next((path / name for name in TOKENIZER_FILES if (path / name).is_file()), None)
        if file is None:
            raise DataError(
                f"{key}: invalid value {str(path)!r}; the folder holds none of "
                f"{', '.join(TOKENIZER_FILES)}"
            )
        return file
    if not path.is_file():
        raise DataError(
            f"{key}: invalid value {str(path)!r}; expected a tokenizer.json or tiktoken tokenizer.model "
            "file, or a folder holding one"
        )
    return path


def _is_hf_json(file: Path) -> bool:
    return file.suffix == ".json"


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


# Meta's Llama 3 tokenizer (llama/tokenizer.py of meta-llama/llama3): the pre-tokenizer pattern
# and the 256 special tokens that follow the base ranks.
TIKTOKEN_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
TIKTOKEN_NUM_RESERVED_SPECIAL_TOKENS = 256
TIKTOKEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>",
    "<|reserved_special_token_3|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",  # end of turn
    *(f"<|reserved_special_token_{i}|>" for i in range(5, TIKTOKEN_NUM_RESERVED_SPECIAL_TOKENS - 5)),
)
# Meta's encode() cuts a text into pieces of at most this many characters, and those into pieces
# with at most _TIKTOKEN_MAX_RUN consecutive whitespace or non-whitespace characters (tiktoken
# issue 195), and encodes each piece on its own; so do we, for the same ids.
_TIKTOKEN_MAX_ENCODE_CHARS = 400_000
_TIKTOKEN_MAX_RUN = 25_000
_LONG_RUN = re.compile(rf"\s{{{_TIKTOKEN_MAX_RUN + 1}}}|\S{{{_TIKTOKEN_MAX_RUN + 1}}}")


def _split_runs(text: str, max_run: int) -> Iterator[str]:
    """Meta's ``_split_whitespaces_or_nonwhitespaces``: pieces of ``text`` with no more than
    ``max_run`` consecutive whitespace or non-whitespace characters."""
    run = 0
    in_space = text[0].isspace() if text else False
    start = 0
    for i, char in enumerate(text):
        space = char.isspace()
        if in_space ^ space:
            run, in_space = 1, space
        else:
            run += 1
            if run > max_run:
                yield text[start:i]
                start, run = i, 1
    yield text[start:]


def read_tiktoken_ranks(file: Path, *, key: str = "model.tokenizer_path") -> dict[bytes, int]:
    """The mergeable ranks of a tiktoken BPE file (one ``<base64 token> <rank>`` line each), read
    directly (``tiktoken.load.load_tiktoken_bpe`` caches files by path name in a temporary
    folder, so a changed file at the same path would not be seen)."""
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise unreadable_error(key, file, exc) from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise DataError(
                f"{key}: {str(file)!r} line {lineno} is not '<base64 token> <rank>': not a tiktoken "
                "tokenizer.model (a SentencePiece tokenizer.model is not supported; "
                "use its tokenizer.json)"
            ) from None
    if not ranks:
        raise DataError(f"{key}: {str(file)!r} is empty; expected a tiktoken tokenizer.model")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"{key}: {str(file)!r} has ranks that are not 0..{len(ranks) - 1}, each once")
    return ranks


class TiktokenTokenizer:
    """Meta's original Llama 3 ``tokenizer.model`` (tiktoken BPE ranks), read with the
    ``tiktoken`` library exactly as Meta's ``llama/tokenizer.py`` builds it: Llama 3's
    pattern, 256 special tokens from id ``len(ranks)`` on, BOS ``<|begin_of_text|>``, EOS
    ``<|end_of_text|>``. Text that spells a special token is encoded as plain text (Meta's
    default, ``disallowed_special=()``), and long texts are cut as Meta's ``encode`` cuts them,
    so the ids are Meta's."""

    def __init__(self, path: str | Path, *, key: str = "model.tokenizer_path") -> None:
        try:
            import tiktoken
        except ImportError:
            raise DataError(
                f"{key}: reading a tiktoken tokenizer.model needs the 'tiktoken' package: "
                "pip install tiktoken (or pip install 'torchtitan_lite[tiktoken]')"
            ) from None
        file = tokenizer_file(path, key=key)
        ranks = read_tiktoken_ranks(file, key=key)
        self.path = file
        self.num_base_tokens = len(ranks)
        self.ranks = ranks
        self.special_tokens = {token: len(ranks) + i for i, token in enumerate(TIKTOKEN_SPECIAL_TOKENS)}
        try:
            self._enc = tiktoken.Encoding(name=file.name, pat_str=TIKTOKEN_PAT_STR, mergeable_ranks=ranks,
                                          special_tokens=self.special_tokens)
        except Exception as exc:  # the library raises its own exception types
            raise DataError(f"{key}: {str(file)!r} is not a usable tiktoken BPE file ({exc})") from None
        self.vocab_size = len(ranks) + len(TIKTOKEN_SPECIAL_TOKENS)
        self.bos_id: int | None = self.special_tokens["<|begin_of_text|>"]
        self.eos_id: int | None = self.special_tokens["<|end_of_text|>"]

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        """Ids of ``text`` (special-token spellings as plain text), with BOS/EOS when asked."""
        (body,) = self._encode_texts([text])
        return ([self.bos_id] if bos else []) + body + ([self.eos_id] if eos else [])  # type: ignore[list-item]

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        simple = [len(t) <= _TIKTOKEN_MAX_ENCODE_CHARS and not _LONG_RUN.search(t) for t in texts]
        batch = self._enc.encode_ordinary_batch([t for t, ok in zip(texts, simple, strict=True) if ok])
        out: list[list[int]] = []
        done = iter(batch)
        for text, ok in zip(texts, simple, strict=True):
            if ok:
                out.append(next(done))
                continue
            ids: list[int] = []
            for i in range(0, len(text), _TIKTOKEN_MAX_ENCODE_CHARS):
                for piece in _split_runs(text[i : i + _TIKTOKEN_MAX_ENCODE_CHARS], _TIKTOKEN_MAX_RUN):
                    ids.extend(self._enc.encode_ordinary(piece))
            out.append(ids)
        return out

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        out = []
        for body in self._encode_texts(texts):
            ids = np.empty(len(body) + 2, dtype=np.uint32)
            ids[0], ids[1:-1], ids[-1] = self.bos_id, body, self.eos_id
            out.append(ids)
        return out

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode([i for i in ids if i < self.num_base_tokens])


def build_tokenizer(tokenizer_path: str | Path | None) -> Tokenizer:
    """The job's tokenizer: the byte tokenizer when no path is given, else the file
    :func:`tokenizer_file` finds at the path (a file, an ``hf_assets_path`` folder, a Hugging
    Face or Meta Llama 3 download): a ``tokenizer.json`` read with ``tokenizers``, a tiktoken
    ``tokenizer.model`` with ``tiktoken``."""
    if tokenizer_path is None:
        return ByteTokenizer()
    file = tokenizer_file(tokenizer_path)
    return HFTokenizer(file) if _is_hf_json(file) else TiktokenTokenizer(file)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: a printable character for each byte (what byte-level BPE
    tokenizer.json files spell tokens with)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tiktoken_to_tokenizer_json(tokenizer: TiktokenTokenizer, path: str | Path) -> Path:
    """Write a tiktoken ``tokenizer.model`` as a Hugging Face ``tokenizer.json``: byte-level BPE
    with the merges its ranks imply, tiktoken's whole-piece lookup first (``ignore_merges``), the
    same pattern and the 256 special tokens at the same ids, as transformers'
    ``TikTokenConverter`` writes it. Plain text gets the same ids; the file matches special-token
    spellings as special tokens (Meta's encode reads them as text) and does not cut texts of over
    400 000 characters."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as _HFTokenizer

    ranks, alphabet = tokenizer.ranks, _bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    merges: list[tuple[bytes, bytes, int]] = []
    for token, rank in ranks.items():
        pairs = [(token[:i], token[i:], rank) for i in range(1, len(token))
                 if token[:i] in ranks and token[i:] in ranks]
        merges.extend(sorted(pairs, key=lambda m: (ranks[m[0]], ranks[m[1]])))
    merges.sort(key=lambda m: m[2])
    bpe = models.BPE({spell(t): r for t, r in ranks.items()}, [(spell(a), spell(b)) for a, b, _ in merges],
                     fuse_unk=False, byte_fallback=False, ignore_merges=True)
    out = _HFTokenizer(bpe)
    out.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(TIKTOKEN_PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    out.decoder = decoders.ByteLevel()
    out.post_processor = processors.ByteLevel(trim_offsets=False)
    out.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TIKTOKEN_SPECIAL_TOKENS])
    path = Path(path)
    out.save(str(path))
    return path


def hf_tokenizer_json(tokenizer: Tokenizer, *, convert: bool = False) -> Path | None:
    """The ``tokenizer.json`` a Hugging Face export copies: an HF tokenizer's own file; with
    ``convert``, a tiktoken ``tokenizer.model`` written as one (:func:`tiktoken_to_tokenizer_json`,
    into a temporary folder removed at exit); None for the byte tokenizer (no such form)."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.path.resolve()
    if isinstance(tokenizer, TiktokenTokenizer) and convert:
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="torchtitan_lite_tokenizer_")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        return tiktoken_to_tokenizer_json(tokenizer, Path(folder) / "tokenizer.json")
    return None


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
    **STREAMED_DATASETS,
}
# TorchTitan's dataset names (its datasets/hf_datasets.py): name -> (its default path, the prefix
# of the split's files in a local copy of allenai/c4). c4_test is a folder of TorchTitan's
# repository (JSON lines), read from the working directory as TorchTitan reads it; c4 and
# c4_validation download allenai/c4 there, so here they need dataset_path = a local copy of its
# JSON-lines shards (its en/ folder), of which the split's files are read. Both are read whole and
# tokenized at start-up, like the text dataset.
TORCHTITAN_DATASETS: dict[str, tuple[str | None, str]] = {
    "c4_test": ("tests/assets/c4_test", ""),
    "c4": (None, "c4-train."),
    "c4_validation": (None, "c4-validation."),
}
# Names of datasets TorchTitan users train on that exist only on the Hugging Face Hub.
HUB_ONLY_DATASETS: dict[str, str] = {"fineweb": "HuggingFaceFW/fineweb", "fineweb_edu": "HuggingFaceFW/fineweb-edu"}
_SUFFIXES = {"text": (".txt", ".jsonl", ".jsonl.gz", ".json.gz"), "tokens": (".bin", ".npy")}
_JSON_LINES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
_TOKEN_DTYPES = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}


def _has_suffix(file: Path, suffixes: tuple[str, ...]) -> bool:
    return file.name.endswith(suffixes)


def _files_under(folder: Path, suffixes: tuple[str, ...], key: str) -> list[Path]:
    """The files under ``folder`` (searched recursively) whose names end in one of ``suffixes``,
    sorted (:func:`~torchtitan_lite.arrow_data.files_under`)."""
    return [f for f in files_under(folder, key) if _has_suffix(f, suffixes)]


def _stdlib_files(dataset: str) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if dataset == "python_stdlib":
        # Without the build's configuration (_sysconfigdata_*.py: install paths and compiler
        # flags, which differ between builds of one Python version): the corpus is the same
        # wherever this Python version is installed.
        files = sorted(f for f in stdlib.glob("*.py") if not f.name.startswith("_sysconfigdata"))
    else:
        files = sorted(
            f for pkg in _STDLIB_VALIDATION_PACKAGES for f in (stdlib / pkg).rglob("*.py")
            if "test" not in f.relative_to(stdlib).parts[1:]
        )
    if not files:
        raise DataError(f"dataset {dataset!r}: no standard-library sources found under {str(stdlib)!r}")
    return files


def check_dataset(
    dataset: str, dataset_path: str | None, *, section: str = "training", key: str | None = None,
    text_column: str = "text",
) -> list[Path]:
    """The files a dataset reads; cheap checks only (names, existence, suffixes; for Parquet and
    Arrow files the schema has ``text_column``).

    Raises :class:`DataError` naming ``<section>.dataset`` / ``<section>.dataset_path`` (or
    ``key`` for the path, for callers with their own option names).
    """
    if dataset in HUB_ONLY_DATASETS:
        raise ConfigError(
            f"{section}.dataset: {dataset!r} is {HUB_ONLY_DATASETS[dataset]} on the Hugging Face Hub, and "
            f"nothing here downloads; download its Parquet files and set {section}.dataset = 'parquet' with "
            f"{section}.dataset_path = their folder (streamed)"
        )
    if dataset in TORCHTITAN_DATASETS:
        return _torchtitan_files(dataset, dataset_path, section, key or f"{section}.dataset_path")
    if dataset not in DATASETS:
        allowed = ", ".join(map(repr, DATASETS))
        raise ConfigError(f"{section}.dataset: invalid value {dataset!r}; expected one of {allowed}")
    if dataset in STREAMED_DATASETS:
        return check_streamed_dataset(dataset, dataset_path, text_column=text_column, section=section, key=key)
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
        files = _files_under(path, suffixes, key)
        if not files:
            raise DataError(
                f"{key}: folder {dataset_path!r} holds no {' or '.join(suffixes)} files "
                f"(needed by {section}.dataset={dataset!r})"
            )
        return files
    if not _has_suffix(path, suffixes):
        raise DataError(
            f"{key}: {dataset_path!r} is not a {' or '.join(suffixes)} file "
            f"(needed by {section}.dataset={dataset!r})"
        )
    return [path]


def _torchtitan_files(dataset: str, dataset_path: str | None, section: str, key: str) -> list[Path]:
    """The JSON-lines files a TorchTitan dataset name reads (see :data:`TORCHTITAN_DATASETS`)."""
    default, prefix = TORCHTITAN_DATASETS[dataset]
    if dataset_path is None and default is None:
        raise ConfigError(
            f"{section}.dataset: {dataset!r} is TorchTitan's allenai/c4 (en) from the Hugging Face Hub, and "
            f"nothing here downloads; set {section}.dataset_path to a local copy of its JSON-lines shards (the "
            f"en/ folder of {prefix}*.json.gz files; read whole at start-up), or convert them once with "
            f"scripts/jsonl_to_parquet.py and set {section}.dataset = 'parquet' (streamed)"
        )
    given = dataset_path or default
    path = Path(given).expanduser()  # type: ignore[arg-type]
    if not path.exists():
        where = ("" if dataset_path is not None else
                 f" (TorchTitan's default for {dataset!r}, relative to the working directory {os.getcwd()!r}: "
                 f"run from a TorchTitan checkout or set {key})")
        raise DataError(f"{key}: path not found: {given!r}{where}")
    if path.is_dir() and prefix and (path / "en").is_dir():
        # The root of a copy of allenai/c4: TorchTitan reads its "en" variant only (not
        # en.noblocklist, en.noclean or realnewslike beside it).
        path = path / "en"
    if path.is_dir():
        files = _files_under(path, _JSON_LINES, key)
        split = [f for f in files if prefix and f.name.startswith(prefix)]
        files = split or files
    else:
        files = [path] if _has_suffix(path, _JSON_LINES) else []
    if not files:
        raise DataError(f"{key}: {given!r} holds no {' / '.join(_JSON_LINES)} files (JSON lines with a 'text' "
                        f"field, as {dataset!r} needs)")
    return files


MAX_INVALID_UTF8_FRACTION = 0.001
"""Text datasets: above this fraction of bytes that are not valid UTF-8 (over all files read),
the data is refused as not text; below it, each invalid byte becomes U+FFFD and the count is
logged."""


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
            raise unreadable_error(key, file, exc) from None
        if file.name.endswith(".gz"):  # JSON lines, gzip-compressed (c4's .json.gz shards)
            try:
                raw = gzip.decompress(raw)
            except (OSError, EOFError, zlib.error) as exc:
                raise DataError(f"{key}: {str(file)!r} is not a readable gzip file ({exc})") from None
        if file.suffix == ".json" and raw.lstrip()[:1] == b"[":  # one JSON array of records
            try:
                records = json.loads(count.decode(raw, file))
            except ValueError:
                records = None
            if not isinstance(records, list) or not all(
                    isinstance(r, dict) and isinstance(r.get("text"), str) for r in records):
                raise DataError(f"{key}: {str(file)!r} is not JSON lines nor a JSON array of objects with a "
                                "string 'text' field")
            yield from (r["text"] for r in records if r["text"])
        elif file.name.endswith((".jsonl", ".json", ".gz")):
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
            raise unreadable_error(key, file, exc) from None
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
        raise unreadable_error(key, file, exc) from None
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
    text_column: str = "text",
    max_tokens: int | None = None,
) -> TokenStream:
    """Every document of a dataset tokenized and packed (text), or the token files mapped (tokens).

    For the streamed datasets (``parquet``, ``arrow``) the rows are read in order and tokenized
    only until ``max_tokens`` tokens are packed (None: all of them): validation reads the first
    windows it needs, not the whole set. Raises :class:`DataError` for a missing path, an empty
    dataset, unreadable files, or token ids the tokenizer's vocabulary does not have.
    """
    key = f"{section}.dataset_path" if dataset_path is not None else f"{section}.dataset"
    where = repr(dataset_path) if dataset_path is not None else repr(dataset)
    if dataset in STREAMED_DATASETS:
        corpus = ArrowCorpus(dataset, dataset_path, text_column=text_column, section=section)  # type: ignore[arg-type]
        return TokenStream([_pack_rows(corpus.texts(0, corpus.num_rows), tokenizer, max_tokens, key, where)])
    files = check_dataset(dataset, dataset_path, section=section)
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


def _pack_rows(texts: Iterator[str | None], tokenizer: Tokenizer, max_tokens: int | None,
               key: str, where: str) -> np.ndarray:
    """Texts tokenized 256 at a time and packed, until ``max_tokens`` (None: all)."""
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
        raise DataError(f"{key}: {where} is empty (no text)")
    tokens = np.concatenate(parts).astype(token_dtype_for(tokenizer.vocab_size))
    return tokens if max_tokens is None else tokens[:max_tokens]


def _with_end(texts: Iterator[str | None]) -> Iterator[str | None]:
    """The texts with nulls as empty strings, then None (the end)."""
    yield from ("" if t is None else t for t in texts)
    yield None


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
        self.grad_accum_steps = check_batch_split(global_batch_size, local_batch_size, dp_size)
        self.windows = windows
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
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
        return micro_batches(torch.from_numpy(rows), self.local_batch_size)

    def gather_state(self) -> None:
        """Nothing to gather: the position is the same on every rank (the checkpoint manager calls
        it before every save, as the streaming loader needs)."""

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
        if "positions" in state:
            raise DataError(f"data loader state does not match this run: it was saved while streaming a "
                            f"{state.get('dataset')!r} dataset, this run reads windows of another kind")
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
