"""TorchTitan's dataset names (its ``datasets/hf_datasets.py``), read from local files.

``c4_test`` is a folder of TorchTitan's repository (JSON lines), read from the working directory
as TorchTitan reads it; ``c4`` and ``c4_validation`` download allenai/c4 there, so here they need
``dataset_path`` = a local copy of its JSON-lines shards (its ``en/`` folder), of which the split's
files are read. Both are read whole and tokenized at start-up, like the ``text`` source. Names
that exist only on the Hugging Face Hub (fineweb) are one line saying what to do instead.
"""

from __future__ import annotations

import os
from pathlib import Path

from torchtitan_lite.data import text
from torchtitan_lite.data.files import files_with_suffix, has_suffix
from torchtitan_lite.data.windows import Encoder, TokenStream
from torchtitan_lite.errors import DataError, DataNotHereError

__all__ = ["HUB_ONLY", "KINDS", "find_files", "token_stream"]

# name -> (TorchTitan's default path, the prefix of the split's files in a local copy of allenai/c4)
_NAMES: dict[str, tuple[str | None, str]] = {
    "c4_test": ("tests/assets/c4_test", ""),
    "c4": (None, "c4-train."),
    "c4_validation": (None, "c4-validation."),
}
KINDS = {
    "c4_test": "TorchTitan's tests/assets/c4_test (JSON lines, from the working directory)",
    "c4": "TorchTitan's allenai/c4 train split (dataset_path = a local copy of its JSON-lines shards)",
    "c4_validation": "TorchTitan's allenai/c4 validation split (dataset_path = a local copy)",
}
# Names of datasets TorchTitan users train on that exist only on the Hugging Face Hub.
HUB_ONLY: dict[str, str] = {"fineweb": "HuggingFaceFW/fineweb", "fineweb_edu": "HuggingFaceFW/fineweb-edu"}
_JSON_LINES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")


def hub_only_error(dataset: str, section: str) -> DataNotHereError:
    """One line for a Hub-only name: nothing here downloads; what to set instead."""
    return DataNotHereError(
        f"{section}.dataset: {dataset!r} is {HUB_ONLY[dataset]} on the Hugging Face Hub, and "
        f"nothing here downloads; download its Parquet files and set {section}.dataset = 'parquet' with "
        f"{section}.dataset_path = their folder (streamed)"
    )


def find_files(dataset: str, dataset_path: str | None, *, section: str, key: str) -> list[Path]:
    """The JSON-lines files a TorchTitan dataset name reads."""
    default, prefix = _NAMES[dataset]
    if dataset_path is None and default is None:
        raise DataNotHereError(
            f"{section}.dataset: {dataset!r} is TorchTitan's allenai/c4 (en) from the Hugging Face Hub, and "
            f"nothing here downloads; set {key} to a local copy of its JSON-lines shards (the "
            f"en/ folder of {prefix}*.json.gz files; read whole at start-up), or convert them once with "
            f"scripts/jsonl_to_parquet.py and set {section}.dataset = 'parquet' (streamed)"
        )
    given = dataset_path or default
    path = Path(given).expanduser()
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
        files = files_with_suffix(path, _JSON_LINES, key)
        split = [f for f in files if prefix and f.name.startswith(prefix)]
        files = split or files
    else:
        files = [path] if has_suffix(path, _JSON_LINES) else []
    if not files:
        raise DataError(f"{key}: {given!r} holds no {' / '.join(_JSON_LINES)} files (JSON lines with a 'text' "
                        f"field, as {dataset!r} needs)")
    return files


def token_stream(files: list[Path], tokenizer: Encoder, *, key: str, where: str) -> TokenStream:
    """The documents tokenized and packed (as text files)."""
    return text.token_stream(files, tokenizer, key=key, where=where)
