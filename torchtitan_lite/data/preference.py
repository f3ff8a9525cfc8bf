"""The ``preference`` source: pairs of answers to one prompt, the chosen one preferred over the
rejected one, for preference tuning (DPO, :mod:`torchtitan_lite.dpo`).

Rows (JSON lines or Parquet, as the ``chat`` source reads them) are in TRL's preference format:

- conversational: ``prompt`` a list of ``{role, content}`` messages, ``chosen`` and ``rejected``
  lists of the assistant's messages (optionally ``tools``); rendered with the tokenizer's chat
  template (:class:`~torchtitan_lite.data.chat_template.ChatTemplate`), the prompt with the
  generation prompt added;
- plain text: ``prompt``, ``chosen`` and ``rejected`` strings, tokenized with the tokenizer's own
  special tokens (a Llama folder's BOS), the EOS text appended to each answer that lacks it;
- without ``prompt``: what ``chosen`` and ``rejected`` share from their start is the prompt (its
  messages, or its text, a space before the first difference going with the answers), as TRL's
  ``extract_prompt`` does.

Each pair is tokenized as TRL's ``DPOTrainer`` does: the prompt alone, the prompt with the chosen
answer and the prompt with the rejected one; the answers start where the three stop agreeing
(a template may render the prompt alone differently, or tokens may merge across the boundary).
Only the answers' tokens are counted (:func:`pair_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from torchtitan_lite.data.chat_template import ChatTemplate, RowError
from torchtitan_lite.data.tokenizers import Tokenizer
from torchtitan_lite.data.windows import IGNORE_INDEX

__all__ = ["KINDS", "TRUNCATIONS", "Pair", "encode_pair", "pair_rows", "preference_row"]

KINDS = {"preference": "preference pairs: JSON lines or Parquet rows with prompt, chosen and rejected (lists of "
                       "messages, or strings), TRL's format (dataset_path)"}
TRUNCATIONS = ("keep_start", "keep_end")
"""How a pair longer than ``seq_len + 1`` tokens is cut (TRL's ``truncation_mode``): its start
kept (the end of the answer dropped), or its end."""


@dataclass(frozen=True)
class Pair:
    """One preference pair as token ids: the prompt, and each answer after it."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray

    @property
    def longest(self) -> int:
        """Tokens of the longer of prompt + chosen and prompt + rejected."""
        return len(self.prompt) + max(len(self.chosen), len(self.rejected))


def _messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)


def _common_start(a: Any, b: Any) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _prompt_end(chosen: Any, rejected: Any) -> int:
    """Where TRL's ``extract_prompt`` ends the prompt both answers share: at their first difference,
    a space before it going with the answers (where one is the other's start, before the last
    element of the shorter one, as its loop ends there)."""
    end = 0
    for end in range(min(len(chosen), len(rejected))):
        if chosen[end] != rejected[end]:
            if chosen[end - 1] == " ":
                end -= 1
            break
    return end


def preference_row(record: Any) -> tuple[bool, Any, Any, Any, list[Any] | None]:
    """``(conversational, prompt, chosen, rejected, tools)`` of a row; :class:`RowError` (kind
    ``"row"``) for anything that is not TRL's preference format."""
    if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
        raise RowError(f"expected 'chosen' and 'rejected' (and 'prompt'); got {str(record)[:80]!r}", kind="row")
    chosen, rejected, prompt = record["chosen"], record["rejected"], record.get("prompt")
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RowError(f"'tools' is not a list of tables (JSON schemas): {str(tools)[:80]!r}", kind="row")
    if _messages(chosen) and _messages(rejected):
        if prompt is None:  # the messages the two share are the prompt
            n = _prompt_end(chosen, rejected)
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        if not _messages(prompt):
            raise RowError(f"'prompt' is not a non-empty list of {{role, content}} messages: {str(prompt)[:80]!r}",
                           kind="row")
        if not chosen or not rejected:
            raise RowError("'chosen' or 'rejected' has no message after the prompt", kind="row")
        return True, [dict(m) for m in prompt], [dict(m) for m in chosen], [dict(m) for m in rejected], tools
    if isinstance(chosen, str) and isinstance(rejected, str):
        if prompt is None:
            n = _prompt_end(chosen, rejected)
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        if not isinstance(prompt, str):
            raise RowError(f"'prompt' is not a string like 'chosen' and 'rejected': {str(prompt)[:80]!r}", kind="row")
        return False, prompt, chosen, rejected, None
    raise RowError("'chosen' and 'rejected' must both be lists of {role, content} messages or both strings; got "
                   f"{type(chosen).__name__} and {type(rejected).__name__}", kind="row")


def encode_pair(record: Any, tokenizer: Tokenizer, template: ChatTemplate | None) -> Pair:
    """A row's pair as token ids, as TRL's ``DPOTrainer`` tokenizes it (see the module's text);
    :class:`RowError` for a malformed row or one the chat template refuses."""
    conversational, prompt, chosen, rejected, tools = preference_row(record)
    if conversational:
        if template is None:
            raise RowError("a conversational pair needs the tokenizer's chat template", kind="template")

        def ids(messages: list[dict[str, Any]], generation: bool = False) -> list[int]:
            return tokenizer.encode_with_offsets(template.render(messages, tools=tools,
                                                                 add_generation_prompt=generation))[0]

        prompt_ids, with_chosen, with_rejected = ids(prompt, True), ids(prompt + chosen), ids(prompt + rejected)
    else:
        eos = tokenizer.config.get("eos_token") if hasattr(tokenizer, "config") else None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            chosen = chosen if chosen.endswith(eos) else chosen + eos
            rejected = rejected if rejected.endswith(eos) else rejected + eos
        encode = tokenizer.encode_text
        prompt_ids, with_chosen, with_rejected = encode(prompt), encode(prompt + chosen), encode(prompt + rejected)
    start = min(_common_start(prompt_ids, with_chosen), _common_start(prompt_ids, with_rejected))
    return Pair(np.asarray(prompt_ids[:start], dtype=np.int64), np.asarray(with_chosen[start:], dtype=np.int64),
                np.asarray(with_rejected[start:], dtype=np.int64))


def pair_rows(pairs: list[Pair], *, seq_len: int, pad_id: int = 0,
              truncation: str = "keep_start") -> tuple[np.ndarray, np.ndarray, int]:
    """A micro-batch of pairs as rows of ``seq_len`` inputs and labels: the chosen sequences
    (prompt + chosen answer) first, then the rejected ones, each cut to ``seq_len + 1`` tokens
    (``truncation``: :data:`TRUNCATIONS`) and padded with ``pad_id``; a label is counted
    (not :data:`IGNORE_INDEX`) where the token it predicts is an answer's. Returns the inputs, the
    labels (both ``(2 × pairs, seq_len)``) and how many sequences were cut."""
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation: {truncation!r} is not one of {TRUNCATIONS}")
    size = seq_len + 1
    tokens = np.full((2 * len(pairs), size), pad_id, dtype=np.int64)
    counted = np.zeros((2 * len(pairs), size), dtype=bool)
    cut = 0
    for side in range(2):
        for i, pair in enumerate(pairs):
            answer = pair.chosen if side == 0 else pair.rejected
            ids = np.concatenate([pair.prompt, answer])
            mask = np.concatenate([np.zeros(len(pair.prompt), dtype=bool), np.ones(len(answer), dtype=bool)])
            if len(ids) > size:
                cut += 1
                keep = slice(None, size) if truncation == "keep_start" else slice(len(ids) - size, None)
                ids, mask = ids[keep], mask[keep]
            row = side * len(pairs) + i
            tokens[row, : len(ids)] = ids
            counted[row, : len(ids)] = mask
    labels = np.where(counted[:, 1:], tokens[:, 1:], IGNORE_INDEX)
    return tokens[:, :-1], labels, cut
