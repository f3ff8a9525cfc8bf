"""Generation's state: :class:`KVCache` (each layer's keys and values of a batch being generated,
which slots hold a token, each row's next position) and :class:`CachedAttention` (a layer's
attention through it), which the decoder's attention takes in place of a mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["CachedAttention", "KVCache"]


class KVCache:
    """The state of a batch being generated: each layer's keys and values, which slots hold a
    token, each row's next position.

    ``prompt_mask`` ``(bs, prompt_len)``: the prompts, left-padded (False: padding); ``capacity``:
    the slots of each layer's cache, ``prompt_len`` plus the tokens to generate. A layer's keys
    and values are allocated at its first write, with the heads, width and dtype it writes (this
    rank's heads under tensor parallel; a latent attention's widths).

    The decoder's ``forward`` with ``cache=`` takes the ``(bs, prompt_len)`` prompts first (the
    prefill: positions start at 0 at each row's first real token, padding attends to nothing
    real), then ``(bs, 1)``: one token per row per call, attending to its row's real prompt
    tokens and every generated slot before it (rows that are finished keep running on padding
    tokens; their outputs are the caller's to ignore).
    """

    def __init__(self, prompt_mask: torch.Tensor, capacity: int) -> None:
        bs, prompt_len = prompt_mask.shape
        if capacity < prompt_len:
            raise ValueError(f"KVCache: capacity {capacity} is below the prompts' length {prompt_len}")
        device = prompt_mask.device
        self.capacity = capacity
        self.prompt_len = prompt_len
        self.length = 0
        """Slots written so far (the same for every row: prompts are left-padded)."""
        self.filled = torch.zeros(bs, capacity, dtype=torch.bool, device=device)
        """Which slots hold a real token (the keys a query may attend to)."""
        self.filled[:, :prompt_len] = prompt_mask
        self._prompt_positions = (prompt_mask.long().cumsum(1) - 1).clamp(min=0)
        self._next_position = prompt_mask.long().sum(1)
        self._keys: dict[str, torch.Tensor] = {}
        self._values: dict[str, torch.Tensor] = {}
        self._start = 0
        self.mask: torch.Tensor | None = None
        """The step's attention mask over the slots so far, ``(bs, 1, seq, length)`` (True attends)."""
        self.decoding = False
        """Whether the step being run is a decode step (one token per row), else the prefill."""

    def step(self, seq_len: int) -> torch.Tensor:
        """Begin a forward of ``seq_len`` tokens per row (the prompts, then 1); their positions
        ``(bs, seq_len)``."""
        if self.length == 0:
            if seq_len != self.prompt_len:
                raise ValueError(f"KVCache: the first forward takes the {self.prompt_len} prompt positions, "
                                 f"got {seq_len}")
            n = seq_len
            device = self.filled.device
            causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            # (a padding query attends to itself: no row without a key, whose softmax is NaN)
            diagonal = torch.eye(n, dtype=torch.bool, device=device)
            self.mask = ((causal & self.filled[:, None, :n]) | diagonal)[:, None]
            positions = self._prompt_positions
            self.decoding = False
        else:
            if seq_len != 1:
                raise ValueError(f"KVCache: after the prompts, one token per row per forward, got {seq_len}")
            if self.length >= self.capacity:
                raise ValueError(f"KVCache: all {self.capacity} slots are written")
            self.filled[:, self.length] = True
            self.mask = self.filled[:, None, None, : self.length + 1]
            positions = self._next_position[:, None].clone()
            self._next_position += 1
            self.decoding = True
        self._start = self.length
        self.length += seq_len
        return positions

    @property
    def nbytes(self) -> int:
        """The bytes of every layer's keys and values written so far (each allocated whole at its first write)."""
        return sum(t.numel() * t.element_size() for d in (self._keys, self._values) for t in d.values())

    def layer(self, key: str) -> CachedAttention:
        """What layer ``key``'s attention takes in place of a mask (the decoder's ``attend``)."""
        return CachedAttention(self, key)

    def write(self, key: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer ``key``'s keys and values of this step (``(bs, heads, seq, d)``); its keys
        and values of every slot so far."""
        if key not in self._keys:
            bs, heads, _, _ = k.shape
            self._keys[key] = k.new_zeros(bs, heads, self.capacity, k.shape[-1])
            self._values[key] = v.new_zeros(bs, v.shape[1], self.capacity, v.shape[-1])
        keys, values = self._keys[key], self._values[key]
        keys[:, :, self._start : self.length] = k
        values[:, :, self._start : self.length] = v
        return keys[:, :, : self.length], values[:, :, : self.length]


class CachedAttention:
    """One layer's attention through a :class:`KVCache`: this step's keys and values stored,
    its queries over every slot so far. A decode step's rows arrive as one sequence
    ``(1, heads, bs, d)`` (see the decoder's ``forward``) and are read back out as rows."""

    def __init__(self, cache: KVCache, key: str) -> None:
        self.cache = cache
        self.key = key

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, enable_gqa: bool = False,
               scale: float | None = None) -> torch.Tensor:
        """This step's queries ``q`` over the cached keys and values, ``k`` and ``v`` stored first."""
        cache = self.cache
        if cache.decoding:  # (1, heads, bs, d) → (bs, heads, 1, d)
            q, k, v = (t.transpose(0, 2) for t in (q, k, v))
        keys, values = cache.write(self.key, k, v)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=cache.mask, scale=scale,
                                             enable_gqa=enable_gqa)
        return out.transpose(0, 2) if cache.decoding else out
