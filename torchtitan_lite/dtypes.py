"""The one table from config dtype names (``"bfloat16"``) to ``torch.dtype`` and back; where the
low-precision formats come from (torchao, imported quietly)."""

from __future__ import annotations

import functools
import importlib
import logging
import platform
import warnings
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["DTYPES", "cpu_has_bf16", "dtype_name", "import_torchao"]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}
"""Every dtype a config names: mixed precision (float32, bfloat16) and exports (also float16)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86's two instruction sets; aarch64's BF16 feature


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bfloat16 products in hardware (x86 ``avx512_bf16`` / ``amx_bf16``,
    Arm's ``bf16``), read from ``cpuinfo`` (default: ``/proc/cpuinfo``). Where that cannot be
    told (not Linux, unreadable), True: nothing is said about a CPU one knows nothing of."""
    if cpuinfo is None:
        if platform.system() != "Linux":
            return True
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return True
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return bool(_BF16_FLAGS & set(value.split()))
    return True


@functools.cache
def import_torchao(module: str = "torchao") -> ModuleType:
    """``importlib.import_module(module)`` of torchao's (NF4, float8, 8-bit AdamW) without the lines
    its first import writes: a "Failed to load" for each CUDA extension built for another
    machine, a deprecation of torch's ``register_constant``, a missing Triton. Noise on a CPU
    machine and nothing these formats use; a newcomer reads them as a broken install. Raises what
    the import raises (ImportError when torchao is missing)."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    try:
        for log in quiet:
            log.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
