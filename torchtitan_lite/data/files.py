"""Finding a dataset's files: listing folders, suffixes, and the one-line errors for paths.

The base of :mod:`torchtitan_lite.data`: it imports nothing of the package but
:mod:`torchtitan_lite.errors`.
"""

from __future__ import annotations

import os
from pathlib import Path

from torchtitan_lite.errors import ConfigError, DataError

__all__ = ["existing_path", "files_under", "files_with_suffix", "has_suffix", "suffix_files", "unreadable_error"]


def unreadable_error(key: str, path: Path, exc: OSError) -> DataError:
    """One line naming a file that cannot be read and the operating system's reason."""
    reason = f"{exc.strerror} (errno {exc.errno})" if exc.strerror else str(exc)
    return DataError(f"{key}: {str(path)!r} cannot be read: {reason}")


def files_under(folder: Path, key: str) -> list[Path]:
    """The regular files under ``folder`` (searched recursively), sorted; an unreadable folder is
    one line naming it (``key``) and the operating system's reason."""
    errors: list[OSError] = []
    found = [Path(root) / name for root, _, names in os.walk(folder, onerror=errors.append) for name in names]
    if errors:
        raise unreadable_error(key, Path(errors[0].filename or folder), errors[0])
    return sorted(f for f in found if f.is_file())


def has_suffix(file: Path, suffixes: tuple[str, ...]) -> bool:
    """Whether the file's name ends in one of ``suffixes`` (``.jsonl.gz`` included)."""
    return file.name.endswith(suffixes)


def files_with_suffix(folder: Path, suffixes: tuple[str, ...], key: str) -> list[Path]:
    """The files under ``folder`` (searched recursively) whose names end in one of ``suffixes``, sorted."""
    return [f for f in files_under(folder, key) if has_suffix(f, suffixes)]


def existing_path(dataset_path: str | None, *, key: str, section: str, dataset: str, what: str) -> Path:
    """The path a source reads, which must be given (``what`` says what it should be) and exist."""
    if dataset_path is None:
        raise ConfigError(f"{key}: {section}.dataset={dataset!r} needs a path to {what}")
    path = Path(dataset_path).expanduser()
    if not path.exists():
        raise DataError(f"{key}: path not found: {dataset_path!r}")
    return path


def suffix_files(dataset_path: str | None, suffixes: tuple[str, ...], *, key: str, section: str, dataset: str,
                 what: str) -> list[Path]:
    """The files a path names: the file itself, or the files under a folder, ending in one of
    ``suffixes``; one line when there is no path, it does not exist, or it holds no such file."""
    path = existing_path(dataset_path, key=key, section=section, dataset=dataset, what=what)
    if path.is_dir():
        files = files_with_suffix(path, suffixes, key)
        if not files:
            raise DataError(f"{key}: folder {dataset_path!r} holds no {' or '.join(suffixes)} files "
                            f"(needed by {section}.dataset={dataset!r})")
        return files
    if not has_suffix(path, suffixes):
        raise DataError(f"{key}: {dataset_path!r} is not a {' or '.join(suffixes)} file "
                        f"(needed by {section}.dataset={dataset!r})")
    return [path]
