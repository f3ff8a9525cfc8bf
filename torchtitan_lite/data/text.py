"""The ``text`` source: ``.txt`` files (one document each) and JSON lines (one document per line, in
its ``text`` field; ``.jsonl.gz``/``.json.gz`` gzip-compressed, as c4's shards), or a folder searched
recursively for them; read and tokenized whole at start-up."""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from torchtitan_lite.data.files import suffix_files, unreadable_error
from torchtitan_lite.data.windows import Encoder, TokenStream, pack_texts
from torchtitan_lite.errors import DataError

__all__ = ["KINDS", "MAX_INVALID_UTF8_FRACTION", "find_files", "read_documents", "token_stream"]

logger = logging.getLogger("torchtitan_lite")

KINDS = {"text": ".txt / .jsonl files or a folder of them (dataset_path)"}
SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".json.gz")


def find_files(dataset: str, dataset_path: str | None, *, section: str, key: str) -> list[Path]:
    """The text files ``dataset_path`` names (cheap checks: existence and suffixes)."""
    return suffix_files(dataset_path, SUFFIXES, key=key, section=section, dataset=dataset, what=KINDS[dataset])


def token_stream(files: list[Path], tokenizer: Encoder, *, key: str, where: str) -> TokenStream:
    """Every document of ``files`` tokenized and packed."""
    return pack_texts(read_documents(files, key), tokenizer, empty=f"{key}: {where} is empty (no text in "
                                                                      f"{len(files)} file(s))")


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
