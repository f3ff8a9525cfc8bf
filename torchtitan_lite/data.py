"""Tokenizer, datasets and the global-batch data loader.

The loader's unit is the *global* batch: the samples of step ``k`` are fixed by the seed alone,
and each data-parallel rank takes its own contiguous slice of them, split into micro-batches.
So a run on 1 rank with gradient accumulation and a run on 4 ranks see exactly the same samples
at every step, which is what makes them comparable and resumable across world sizes.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "ByteTokenizer",
    "DATASETS",
    "GlobalBatchLoader",
    "TokenWindows",
    "build_token_stream",
    "python_stdlib_documents",
]


class ByteTokenizer:
    """UTF-8 bytes as tokens 0–255, plus BOS (256) and EOS (257). Needs no files."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_array(self, text: str) -> np.ndarray:
        body = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
        return np.concatenate(
            [np.array([self.bos_id], np.uint16), body, np.array([self.eos_id], np.uint16)]
        )

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def python_stdlib_documents(path: str | None = None) -> Iterator[str]:
    """The embedded default corpus: the top-level ``.py`` files of this Python's standard
    library (about 4–5 MB of real text on every machine, read at run time, no download)."""
    del path
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no standard-library sources found under {stdlib}")
    for file in files:
        yield file.read_text(encoding="utf-8", errors="replace")


# name -> function(dataset_path) yielding documents
DATASETS: dict[str, Callable[[str | None], Iterator[str]]] = {
    "python_stdlib": python_stdlib_documents,
}


def build_token_stream(dataset: str, dataset_path: str | None, tokenizer: ByteTokenizer) -> np.ndarray:
    """Tokenize every document (with BOS/EOS) and concatenate them into one stream."""
    if dataset not in DATASETS:
        raise ValueError(
            f"training.dataset: unknown dataset {dataset!r}; expected one of {', '.join(DATASETS)}"
        )
    parts = [tokenizer.encode_array(doc) for doc in DATASETS[dataset](dataset_path)]
    return np.concatenate(parts)


@dataclass
class TokenWindows:
    """Non-overlapping windows of ``seq_len + 1`` tokens over a token stream."""

    tokens: np.ndarray
    seq_len: int

    def __post_init__(self) -> None:
        if len(self) == 0:
            raise ValueError(
                f"training.seq_len={self.seq_len}: the dataset has only {len(self.tokens)} tokens, "
                f"fewer than one window of seq_len + 1"
            )

    def __len__(self) -> int:
        return len(self.tokens) // (self.seq_len + 1)

    def __getitem__(self, index: int) -> np.ndarray:
        start = index * (self.seq_len + 1)
        return self.tokens[start : start + self.seq_len + 1]


class GlobalBatchLoader:
    """Yields this rank's micro-batches ``(inputs, labels)`` for each global batch.

    Sample ``j`` of the whole run is window ``perm_e[j mod W]`` of epoch ``e = j // W``, where
    ``perm_e`` is a permutation seeded by ``(seed, e)``. Step ``k`` uses samples
    ``[k·G, (k+1)·G)``; data-parallel rank ``r`` of ``D`` takes ``G/D`` of them in order.
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
    ) -> None:
        if global_batch_size % (local_batch_size * dp_size):
            raise ValueError(
                f"training.global_batch_size={global_batch_size} is not a multiple of "
                f"local_batch_size × dp = {local_batch_size} × {dp_size}"
            )
        self.windows = windows
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.grad_accum_steps = global_batch_size // (local_batch_size * dp_size)
        self.step = 0  # global batches consumed
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def _window_index(self, sample: int) -> int:
        n = len(self.windows)
        epoch = sample // n
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            self._epoch = epoch
        assert self._perm is not None
        return int(self._perm[sample % n])

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The micro-batches of this rank for the next global batch."""
        per_rank = self.global_batch_size // self.dp_size
        first = self.step * self.global_batch_size + self.dp_rank * per_rank
        rows = np.stack(
            [self.windows[self._window_index(first + i)] for i in range(per_rank)]
        ).astype(np.int64)
        self.step += 1
        data = torch.from_numpy(rows)
        micro = []
        for m in range(self.grad_accum_steps):
            chunk = data[m * self.local_batch_size : (m + 1) * self.local_batch_size]
            micro.append((chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()))
        return micro

    def state_dict(self) -> dict[str, int]:
        """Plain-data position: global batches consumed and the sampling parameters."""
        return {"step": self.step, "global_batch_size": self.global_batch_size, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["global_batch_size"] != self.global_batch_size or state["seed"] != self.seed:
            raise ValueError(
                "data loader state was saved with a different global_batch_size or seed: "
                f"{state} vs global_batch_size={self.global_batch_size} seed={self.seed}"
            )
        self.step = int(state["step"])
