"""The one table from config dtype names (``"bfloat16"``) to ``torch.dtype`` and back."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

__all__ = ["DTYPES", "cpu_has_bf16", "dtype_name"]

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
