"""The ``preference`` source: pairs of answers to one prompt, the chosen one preferred over the
rejected one, for preference tuning (DPO, :mod:`torchtitan_lite.objectives.preference`).

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

With ``dpo.packing``, whole pairs are packed into the windows instead (:class:`PackedPairWindows`,
block-causal attention): pair after pair, its chosen sequence then its rejected one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchtitan_lite.data.chat import SUFFIXES, pack, parsed, share_rows
from torchtitan_lite.data.chat_template import BadRows, ChatTemplate, RowError
from torchtitan_lite.data.files import suffix_files
from torchtitan_lite.data.tokenizers import HFTokenizer, Tokenizer, special_tokens
from torchtitan_lite.data.windows import PackedWindows, window_tensors
from torchtitan_lite.errors import DataError

__all__ = ["KINDS", "TRUNCATIONS", "PackedPairWindows", "PackedPairs", "Pair", "PairWindows", "encode_pair",
           "find_files", "packed_sizes", "pair_batch", "pair_rows", "pair_window", "pair_windows", "preference_row"]

logger = logging.getLogger("torchtitan_lite")

KINDS = {"preference": "preference pairs: JSON lines or Parquet rows with prompt, chosen and rejected (lists of "
                       "messages, or strings), TRL's format (dataset_path)"}
TRUNCATIONS = ("keep_start", "keep_end")
"""How a pair longer than ``seq_len + 1`` tokens is cut (TRL's ``truncation_mode``): its start
kept (the end of the answer dropped), or its end."""


def find_files(dataset: str, dataset_path: str | None, *, section: str, key: str) -> list[Path]:
    """The preference files ``dataset_path`` names (cheap checks: existence and suffixes)."""
    return suffix_files(dataset_path, SUFFIXES, key=key, section=section, dataset=dataset, what=KINDS[dataset])


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
    record = parsed(record)
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
        eos = special_tokens(tokenizer.config, ("eos_token",)).get("eos_token")
        if eos is not None:
            chosen = chosen if chosen.endswith(eos) else chosen + eos
            rejected = rejected if rejected.endswith(eos) else rejected + eos
        encode = tokenizer.encode_text
        prompt_ids, with_chosen, with_rejected = encode(prompt), encode(prompt + chosen), encode(prompt + rejected)
    start = min(_common_start(prompt_ids, with_chosen), _common_start(prompt_ids, with_rejected))
    return Pair(np.asarray(prompt_ids[:start], dtype=np.int64), np.asarray(with_chosen[start:], dtype=np.int64),
                np.asarray(with_rejected[start:], dtype=np.int64))


def _sequence(prompt: np.ndarray, answer: np.ndarray, size: int,
              truncation: str) -> tuple[np.ndarray, np.ndarray]:
    """One sequence of a pair (prompt, then answer) as token ids and whether each is counted (the
    answer's), cut to ``size`` tokens (``truncation``: :data:`TRUNCATIONS`)."""
    ids = np.concatenate([prompt, answer])
    counted = np.concatenate([np.zeros(len(prompt), dtype=np.int64), np.ones(len(answer), dtype=np.int64)])
    if len(ids) > size:
        keep = slice(None, size) if truncation == "keep_start" else slice(len(ids) - size, None)
        ids, counted = ids[keep], counted[keep]
    return ids, counted


def packed_sizes(pair: Pair, size: int) -> tuple[int, int]:
    """The tokens a pair's chosen and rejected sequences keep when both go into one window of
    ``size`` tokens (packed pairs): all of them when they fit; else the longer one is cut to what
    the other leaves, and neither below half the window (both cut then)."""
    chosen, rejected = len(pair.prompt) + len(pair.chosen), len(pair.prompt) + len(pair.rejected)
    if chosen + rejected <= size:
        return chosen, rejected
    keep_chosen = min(chosen, max(size // 2, size - rejected))
    return keep_chosen, min(rejected, size - keep_chosen)


def pair_window(pair: Pair, *, seq_len: int, truncation: str = "keep_start", pad_id: int = 0) -> tuple[np.ndarray, int]:
    """A pair as one window ``(2, 3, seq_len + 1)``: its chosen sequence (prompt + chosen answer),
    then its rejected one, each in :class:`~torchtitan_lite.data.windows.PackedWindows`' layout
    (token ids, whether each is counted: the answer's tokens, and the sample number: 0, padding 1),
    cut to ``seq_len + 1`` tokens (``truncation``: :data:`TRUNCATIONS`) and padded with ``pad_id``.
    Returns the window and how many of its two sequences were cut."""
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation: {truncation!r} is not one of {TRUNCATIONS}")
    size = seq_len + 1
    window = np.zeros((2, 3, size), dtype=np.int64)
    window[:, 0] = pad_id
    cut = 0
    for side, answer in enumerate((pair.chosen, pair.rejected)):
        ids, counted = _sequence(pair.prompt, answer, size, truncation)
        cut += len(pair.prompt) + len(answer) > size
        window[side, 0, : len(ids)] = ids
        window[side, 1, : len(ids)] = counted
        window[side, 2, len(ids):] = 1
    return window, cut


def pair_batch(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair windows ``(pairs, 2, 3, seq_len + 1)`` as a micro-batch: ``(inputs, labels)`` of
    ``2 × pairs`` rows, every pair's chosen sequence first, then the rejected ones (a label is
    counted where the token it predicts is an answer's, as in :func:`window_tensors`)."""
    rows = np.concatenate([windows[:, 0], windows[:, 1]])
    inputs, labels, _ = window_tensors(rows, None)
    return inputs, labels


def pair_rows(pairs: list[Pair], *, seq_len: int, pad_id: int = 0,
              truncation: str = "keep_start") -> tuple[np.ndarray, np.ndarray, int]:
    """A micro-batch of ``pairs`` (:func:`pair_window`, :func:`pair_batch`) as arrays: the inputs
    and labels ``(2 × pairs, seq_len)``, and how many sequences were cut."""
    made = [pair_window(pair, seq_len=seq_len, truncation=truncation, pad_id=pad_id) for pair in pairs]
    inputs, labels = pair_batch(np.stack([window for window, _ in made]))
    return inputs.numpy(), labels.numpy(), sum(cut for _, cut in made)


class PairWindows:
    """A source's preference pairs as windows (:func:`pair_window`), made on access: window ``i``
    is pair ``i``."""

    unit = "pairs"
    """What a sample of this source is, in log lines."""

    def __init__(self, pairs: list[Pair], *, seq_len: int, truncation: str, cut: int = 0, dropped: int = 0,
                 skipped: int = 0) -> None:
        self.pairs, self.seq_len, self.truncation = pairs, seq_len, truncation
        self.samples = len(pairs)
        self.cut, self.dropped, self.skipped = cut, dropped, skipped

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> np.ndarray:
        if not -len(self) <= index < len(self):
            raise IndexError(f"pair {index} of {len(self)}")
        return pair_window(self.pairs[index], seq_len=self.seq_len, truncation=self.truncation)[0]

    def describe(self) -> str:
        notes = [f"{self.cut} sequence(s) cut ({self.truncation})"] if self.cut else []
        notes += [f"{self.dropped} dropped (the prompt alone fills the window)"] if self.dropped else []
        notes += [f"{self.skipped} bad row(s) skipped"] if self.skipped else []
        return f"{self.samples} preference pairs of up to {self.seq_len + 1} tokens" + (
            f" ({', '.join(notes)})" if notes else "")


class PackedPairs:
    """Preference pairs as the samples of :class:`PackedPairWindows`: sample ``2k`` is pair
    ``k``'s chosen sequence, ``2k + 1`` its rejected one, each cut to its share of a window
    (:func:`packed_sizes`, ``truncation``)."""

    def __init__(self, pairs: list[Pair], *, size: int, truncation: str) -> None:
        self.pairs, self.size, self.truncation = pairs, size, truncation
        self.sizes = [packed_sizes(pair, size) for pair in pairs]

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        pair = self.pairs[index // 2]
        answer = pair.rejected if index % 2 else pair.chosen
        return _sequence(pair.prompt, answer, self.sizes[index // 2][index % 2], self.truncation)


class PackedPairWindows(PackedWindows):
    """Whole preference pairs packed into windows of ``seq_len + 1`` tokens (``dpo.packing``):
    in each, pair after pair, its chosen sequence then its rejected one, numbered as samples
    ``2k`` and ``2k + 1`` of the window (:class:`PackedWindows`' layout; the padding after them
    is sample ``2·pairs``), for block-causal attention."""

    unit = "windows of pairs"
    """What a sample of this source is, in log lines."""

    def __init__(self, source: PackedPairs, windows: list[list[int]], *, seq_len: int, truncation: str, cut: int,
                 dropped: int, skipped: int) -> None:
        members = np.asarray([s for window in windows for k in window for s in (2 * k, 2 * k + 1)], dtype=np.int64)
        starts = np.cumsum([0] + [2 * len(window) for window in windows])
        lengths = np.asarray([n for sizes in source.sizes for n in sizes], dtype=np.int64)
        size = seq_len + 1
        super().__init__(source, members, starts, lengths, seq_len=seq_len, what="preference pairs' sequences",
                         padding=len(windows) * size - int(lengths.sum()))
        self.pairs, self.truncation = len(source.pairs), truncation
        self.cut, self.dropped, self.skipped = cut, dropped, skipped

    def describe(self) -> str:
        notes = [f"{self.cut} sequence(s) cut ({self.truncation})"] if self.cut else []
        notes += [f"{self.dropped} dropped (the prompt alone fills its share)"] if self.dropped else []
        notes += [f"{self.skipped} bad row(s) skipped"] if self.skipped else []
        share = self.padding / max(1, len(self) * (self.seq_len + 1))
        return (f"{self.pairs} preference pairs packed into {len(self)} windows of {self.seq_len + 1} tokens "
                f"({100 * share:.1f}% padding" + "".join(f", {note}" for note in notes) + ")")


ROW_COLUMNS = ("prompt", "chosen", "rejected", "tools")
"""The columns of a Parquet file that a preference row reads."""


def pair_windows(files: list[Path], tokenizer: Tokenizer, *, seq_len: int, key: str, where: str,
                 chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                 on_bad_row: str = "stop", truncation: str = "keep_start",
                 packing: str | None = None) -> PairWindows | PackedPairWindows:
    """Every row of ``files`` (JSON lines or Parquet, :func:`~torchtitan_lite.data.chat.share_rows`)
    as a pair (:func:`encode_pair`; conversational rows rendered with the tokenizer's chat template,
    or ``chat_template``). A bad row is a :class:`DataError` naming its file and line, or with
    ``on_bad_row = "skip"`` skipped and counted; a pair longer than ``seq_len + 1`` tokens is cut
    (``truncation``) and counted, and with ``keep_start`` one whose prompt alone fills the window
    is dropped (no answer token would be left), as TRL does; both are logged.

    ``packing`` (``"greedy"`` or ``"bfd"``, :func:`~torchtitan_lite.data.chat.pack`): whole pairs
    packed into the windows (:class:`PackedPairWindows`), a pair's two sequences together cut to
    one window (:func:`packed_sizes`); None: a window per pair (:class:`PairWindows`)."""
    if not isinstance(tokenizer, HFTokenizer):
        raise DataError(f"{key}: dataset = 'preference' needs a Hugging Face tokenizer.json (and, for "
                        f"conversational pairs, its chat template); this job's tokenizer is {type(tokenizer).__name__}")
    template: ChatTemplate | None = None
    size = seq_len + 1
    pairs: list[Pair] = []
    bad = BadRows(key, on_bad_row)
    cut = dropped = 0
    for _, row, record in share_rows(files, key, columns=ROW_COLUMNS):
        try:
            if template is None and isinstance(record, dict) and isinstance(record.get("chosen"), list):
                template = ChatTemplate(tokenizer, template_path=chat_template, template_kwargs=template_kwargs)
            pair = encode_pair(record, tokenizer, template)
        except RowError as exc:
            bad.add(row, exc)
            continue
        sizes = (packed_sizes(pair, size) if packing is not None else (size, size))
        if truncation == "keep_start" and len(pair.prompt) >= min(sizes):
            dropped += 1
            continue
        cut += sum(len(pair.prompt) + len(answer) > keep
                   for answer, keep in zip((pair.chosen, pair.rejected), sizes, strict=True))
        pairs.append(pair)
    bad.log()
    if cut or dropped:
        what = (f"were cut so that each pair fits in a window of seq_len + 1 = {size} tokens" if packing is not None
                else f"longer than seq_len + 1 = {size} tokens were cut")
        logger.warning("%s: %d sequence(s) %s (%s)%s", key, cut, what, truncation,
                       f"; {dropped} pair(s) whose prompt alone fills them were dropped" if dropped else "")
    if not pairs:
        raise DataError(f"{key}: {where} holds no preference pair that fits seq_len + 1 = {size} tokens{bad.note()}")
    if packing is not None:
        source = PackedPairs(pairs, size=size, truncation=truncation)
        windows = pack([sum(sizes) for sizes in source.sizes], size, packing=packing)
        return PackedPairWindows(source, windows, seq_len=seq_len, truncation=truncation, cut=cut, dropped=dropped,
                                 skipped=bad.count)
    return PairWindows(pairs, seq_len=seq_len, truncation=truncation, cut=cut, dropped=dropped, skipped=bad.count)
