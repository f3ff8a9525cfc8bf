"""The embedded default sources: this Python's standard library, read at run time (no download).

``python_stdlib`` is the top-level ``.py`` modules but the build's configuration
(``_sysconfigdata_*``), about 4–5 MB of real text on every machine; ``python_stdlib_validation``
a held-out part of the same library (a few of its packages, never part of ``python_stdlib``).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from torchtitan_lite.data import text
from torchtitan_lite.data.windows import Encoder, TokenStream
from torchtitan_lite.errors import ConfigError, DataError

__all__ = ["KINDS", "find_files", "token_stream"]

KINDS = {
    "python_stdlib": "this Python's standard-library modules (embedded default, no path)",
    "python_stdlib_validation": "held-out standard-library packages (no path)",
}
# Packages of the standard library held out from ``python_stdlib`` (present in every CPython 3.x).
_VALIDATION_PACKAGES = ("asyncio", "email", "http", "json", "logging", "urllib")


def find_files(dataset: str, dataset_path: str | None, *, section: str, key: str) -> list[Path]:
    """The standard library's source files of ``dataset``; it reads no path."""
    if dataset_path is not None:
        raise ConfigError(f"{key}={dataset_path!r} is set but {section}.dataset={dataset!r} reads no path; "
                          f"set {section}.dataset to 'text' or 'tokens' to read it")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if dataset == "python_stdlib":
        # Without the build's configuration (_sysconfigdata_*.py: install paths and compiler
        # flags, which differ between builds of one Python version): the corpus is the same
        # wherever this Python version is installed.
        files = sorted(f for f in stdlib.glob("*.py") if not f.name.startswith("_sysconfigdata"))
    else:
        files = sorted(
            f for pkg in _VALIDATION_PACKAGES for f in (stdlib / pkg).rglob("*.py")
            if "test" not in f.relative_to(stdlib).parts[1:]
        )
    if not files:
        raise DataError(f"dataset {dataset!r}: no standard-library sources found under {str(stdlib)!r}")
    return files


def token_stream(files: list[Path], tokenizer: Encoder, *, key: str, where: str) -> TokenStream:
    """The modules tokenized and packed (as text files)."""
    return text.token_stream(files, tokenizer, key=key, where=where)
