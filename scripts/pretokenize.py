"""Tokenize a text dataset once into a token file the `tokens` dataset memory-maps.

    python scripts/pretokenize.py --input corpus/ --output corpus.npy \\
        [--tokenizer_path tokenizer.json]

``--input`` is what ``training.dataset = "text"`` reads (``.txt``/``.jsonl`` files or a folder of
them). Documents get the same BOS/EOS as at training time and are streamed to the output in
batches, so the corpus never has to fit in memory. The output is ``.npy`` (dtype recorded in the
file) or raw ``.bin``; the dtype is uint16 when the vocabulary fits, else uint32. Train on it with
``--training.dataset tokens --training.dataset_path corpus.npy`` and the same tokenizer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from torchtitan_lite.data import build_tokenizer, check_dataset, read_documents, token_dtype_for
from torchtitan_lite.progress import Progress, log_to_stderr


def pretokenize(input_path: str, output: str, *, tokenizer_path: str | None = None,
                batch_documents: int = 1024, overwrite: bool = False) -> tuple[int, int, str]:
    """Write the token file; returns (documents, tokens, dtype name)."""
    out = Path(output)
    if out.suffix not in (".npy", ".bin"):
        raise SystemExit(f"error: --output: {output!r} must end in .npy or .bin")
    if out.exists() and not overwrite:
        raise SystemExit(f"error: --output: {output!r} exists; pass --overwrite to replace it")
    files = check_dataset("text", input_path, key="--input")
    tokenizer = build_tokenizer(tokenizer_path)
    dtype = np.dtype(token_dtype_for(tokenizer.vocab_size))
    raw = out.with_name(out.name + ".partial")
    documents = tokens = 0
    try:
        with raw.open("wb") as fh:
            batch: list[str] = []
            for doc in read_documents(files, "--input"):
                batch.append(doc)
                if len(batch) == batch_documents:
                    tokens += _write(fh, tokenizer.encode_batch(batch), dtype)
                    documents, batch = documents + len(batch), []
            if batch:
                tokens += _write(fh, tokenizer.encode_batch(batch), dtype)
                documents += len(batch)
        if tokens == 0:
            raise SystemExit(f"error: --input: {input_path!r} holds no text")
        if out.suffix == ".bin":
            raw.replace(out)
        else:  # wrap the raw stream in an .npy header without loading it
            array = np.lib.format.open_memmap(out, mode="w+", dtype=dtype, shape=(tokens,))
            array[:] = np.memmap(raw, dtype=dtype, mode="r")
            array.flush()
            del array
    finally:
        raw.unlink(missing_ok=True)
    return documents, tokens, dtype.name


def _write(fh, arrays: list[np.ndarray], dtype: np.dtype) -> int:
    data = np.concatenate(arrays).astype(dtype)
    data.tofile(fh)
    return len(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help=".txt/.jsonl file or folder")
    parser.add_argument("--output", required=True, help="output .npy or .bin file")
    parser.add_argument("--tokenizer_path", default=None, help="tokenizer.json; default: byte tokenizer")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    args = parser.parse_args(argv)
    log_to_stderr()
    try:
        with Progress(f"pretokenizing {args.input} -> {args.output}"):
            documents, tokens, dtype = pretokenize(args.input, args.output, tokenizer_path=args.tokenizer_path,
                                                   overwrite=args.overwrite)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{documents} documents, {tokens} tokens ({dtype}) -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
