"""The ``tokens`` source: pre-tokenized token ids as ``numpy`` memmaps, a ``.npy`` file
(``uint16``/``uint32``) or a raw ``.bin`` file (``dataset_token_dtype``), or a folder of them. They
are read lazily, never loaded whole, and are expected to hold their own BOS/EOS separators."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from torchtitan_lite.data.files import suffix_files, unreadable_error
from torchtitan_lite.data.windows import Encoder, TokenStream
from torchtitan_lite.errors import DataError

__all__ = ["KINDS", "find_files", "token_stream"]

KINDS = {"tokens": "pre-tokenized .bin / .npy token files or a folder of them (dataset_path)"}
SUFFIXES = (".bin", ".npy")
_TOKEN_DTYPES = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}


def find_files(dataset: str, dataset_path: str | None, *, section: str, key: str) -> list[Path]:
    """The token files ``dataset_path`` names (cheap checks: existence and suffixes)."""
    return suffix_files(dataset_path, SUFFIXES, key=key, section=section, dataset=dataset, what=KINDS[dataset])


def token_stream(files: list[Path], tokenizer: Encoder, *, key: str, where: str, token_dtype: str) -> TokenStream:
    """The token files mapped as one stream; one line when it is empty or holds ids the
    tokenizer's vocabulary does not have."""
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
