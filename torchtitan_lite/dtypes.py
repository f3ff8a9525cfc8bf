"""The one table from config dtype names (``"bfloat16"``) to ``torch.dtype`` and back."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "dtype_name"]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}
"""Every dtype a config names: mixed precision (float32, bfloat16) and exports (also float16)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
