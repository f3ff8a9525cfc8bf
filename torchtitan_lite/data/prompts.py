"""The ``prompts`` source: prompts for online reinforcement learning (:mod:`torchtitan_lite.rl`).

Rows (JSON lines or Parquet, as the ``chat`` source reads them) are in TRL's prompt-only format:
``prompt`` is a list of ``{role, content}`` messages (rendered with the tokenizer's chat template
and the generation prompt, as TRL's ``GRPOTrainer`` renders them) or a string (tokenized with the
tokenizer's own special tokens: a Llama folder's BOS). Every other column (``answer`` …) is kept
and handed to the reward functions.

A rollouts file (``grpo.rollouts_path``) holds rows made elsewhere, one prompt group each: the
prompt (``prompt``, or its ids as ``prompt_ids``), its completions (``completion_ids``: lists of
token ids, or ``completions``: their text, tokenized without special tokens), optionally their
``rewards`` (a list, one float or null per completion, or a table of such lists by reward
function) and the sampling ``logprobs`` of each completion's tokens.

A prompt is a window for the loader (:class:`PromptWindows`): window ``i`` is row ``i``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_lite.data.chat import SUFFIXES, parsed, share_rows
from torchtitan_lite.data.chat_template import BadRows, ChatTemplate, RowError
from torchtitan_lite.data.files import suffix_files
from torchtitan_lite.data.tokenizers import HFTokenizer, Tokenizer
from torchtitan_lite.errors import DataError

__all__ = ["KINDS", "PromptRow", "PromptWindows", "find_files", "prompt_windows", "read_rollouts"]

logger = logging.getLogger("torchtitan_lite")

KINDS = {"prompts": "prompts for online RL: JSON lines or Parquet rows with prompt (a list of messages, or a "
                    "string) and any columns the reward functions read, TRL's format (dataset_path)"}

ROLLOUT_KEYS = ("prompt", "prompt_ids", "completions", "completion_ids", "rewards", "logprobs")
"""What a row of a rollouts file may hold besides the columns handed to the reward functions."""


def find_files(dataset: str, dataset_path: str | None, *, section: str, key: str) -> list[Path]:
    """The prompt files ``dataset_path`` names (cheap checks: existence and suffixes)."""
    return suffix_files(dataset_path, SUFFIXES, key=key, section=section, dataset=dataset, what=KINDS[dataset])


@dataclass(frozen=True)
class PromptRow:
    """One prompt as the rollouts take it: its token ids, what the reward functions get, and
    (from a rollouts file) the completions, rewards and sampling log-probabilities made elsewhere."""

    index: int
    """The row's number in its source (which window it is)."""
    ids: np.ndarray
    """The prompt's token ids (the generation prompt included)."""
    prompt: Any
    """The prompt as the row gives it (messages or text): the reward functions' ``prompts``."""
    conversational: bool
    """The prompt is messages: completions are handed to the reward functions as assistant messages."""
    columns: dict[str, Any] = field(default_factory=dict)
    """The row's other columns, handed to the reward functions by name."""
    completion_ids: list[list[int]] | None = None
    """Given completions (a rollouts file), as token ids."""
    rewards: list[float | None] | dict[str, list[float | None]] | None = None
    """Given rewards: one per completion, or such lists by reward function."""
    logprobs: list[list[float]] | None = None
    """Given sampling log-probabilities of each completion's tokens."""


def _messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value) and bool(value)


def encode_prompt(record: Any, tokenizer: Tokenizer, template: ChatTemplate | None) -> tuple[list[int], Any, bool]:
    """A row's prompt as token ids (see the module's text), the prompt as given, and whether it is
    messages; :class:`RowError` for a row without a usable prompt."""
    record = parsed(record)
    if not isinstance(record, dict):
        raise RowError(f"expected a JSON object with prompt, got {type(record).__name__}", kind="not an object")
    if "prompt_ids" in record and record["prompt_ids"] is not None:
        ids = record["prompt_ids"]
        if not (isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 0 for i in ids)):
            raise RowError("prompt_ids must be a non-empty list of token ids (integers >= 0)", kind="bad prompt_ids")
        prompt = record.get("prompt")
        return list(ids), prompt, _messages(prompt)
    prompt = record.get("prompt")
    if _messages(prompt):
        if template is None:
            raise RowError("a conversational prompt needs the tokenizer's chat template", kind="template")
        tools = record.get("tools")
        text = template.render(prompt, tools=tools, add_generation_prompt=True)
        return tokenizer.encode_with_offsets(text)[0], prompt, True
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode_text(prompt), prompt, False
    raise RowError("expected prompt: a list of {role, content} messages or a non-empty string", kind="no prompt")


def _given(record: dict[str, Any], tokenizer: Tokenizer) -> tuple[list[list[int]], Any, Any]:
    """A rollouts row's completions (as ids), rewards and sampling log-probabilities, checked."""
    if record.get("completion_ids") is not None:
        completions = record["completion_ids"]
        if not (isinstance(completions, list) and completions and all(
                isinstance(c, list) and all(isinstance(i, int) and i >= 0 for i in c) for c in completions)):
            raise RowError("completion_ids must be a non-empty list of lists of token ids (integers >= 0)",
                           kind="bad completions")
    elif isinstance(record.get("completions"), list) and record["completions"]:
        texts = [c[-1]["content"] if _messages(c) else c for c in record["completions"]]
        if not all(isinstance(t, str) for t in texts):
            raise RowError("completions must be strings or assistant messages", kind="bad completions")
        completions = [tokenizer.encode_with_offsets(t)[0] for t in texts]
    else:
        raise RowError("a rollouts row needs completion_ids or completions", kind="no completions")
    count = len(completions)
    rewards = record.get("rewards")
    lists = list(rewards.values()) if isinstance(rewards, dict) else [rewards] if rewards is not None else []
    for values in lists:
        if not (isinstance(values, list) and len(values) == count
                and all(v is None or isinstance(v, (int, float)) for v in values)):
            raise RowError(f"rewards must hold one number or null per completion ({count})", kind="bad rewards")
    logprobs = record.get("logprobs")
    if logprobs is not None and not (isinstance(logprobs, list) and len(logprobs) == count and all(
            isinstance(lp, list) and len(lp) == len(c) for lp, c in zip(logprobs, completions, strict=True))):
        raise RowError("logprobs must hold one list per completion, one number per token", kind="bad logprobs")
    return completions, rewards, logprobs


class PromptWindows:
    """A source's prompts as windows for the loader: window ``i`` is row ``i`` (a :class:`PromptRow`)."""

    unit = "prompts"
    """What a sample of this source is, in log lines."""

    def __init__(self, rows: list[PromptRow], *, cut: int = 0, skipped: int = 0, rollouts: bool = False) -> None:
        self.rows, self.cut, self.skipped, self.rollouts = rows, cut, skipped, rollouts
        self.samples = len(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRow:
        return self.rows[index]

    def describe(self) -> str:
        notes = [f"{self.cut} cut to their last tokens"] if self.cut else []
        notes += [f"{self.skipped} bad row(s) skipped"] if self.skipped else []
        what = "prompt groups with their completions" if self.rollouts else "prompts"
        return f"{self.samples} {what}" + (f" ({', '.join(notes)})" if notes else "")


def prompt_windows(files: list[Path], tokenizer: Tokenizer, *, max_prompt_length: int, key: str, where: str,
                   chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                   on_bad_row: str = "stop", rollouts: bool = False) -> PromptWindows:
    """Every row of ``files`` as a :class:`PromptRow` (``rollouts``: with its given completions). A
    prompt longer than ``max_prompt_length`` tokens keeps its last ones (counted and logged); a bad
    row is a :class:`DataError` naming its file and line, or with ``on_bad_row = "skip"`` skipped
    and counted."""
    if not isinstance(tokenizer, HFTokenizer):
        raise DataError(f"{key}: dataset = 'prompts' needs a Hugging Face tokenizer.json (and, for conversational "
                        f"prompts, its chat template); this job's tokenizer is {type(tokenizer).__name__}")
    template: ChatTemplate | None = None
    rows: list[PromptRow] = []
    bad = BadRows(key, on_bad_row)
    cut = 0
    for number, row, record in share_rows(files, key, columns=None):
        try:
            if template is None and isinstance(record, dict) and _messages(record.get("prompt")) \
                    and record.get("prompt_ids") is None:
                template = ChatTemplate(tokenizer, template_path=chat_template, template_kwargs=template_kwargs)
            ids, prompt, conversational = encode_prompt(record, tokenizer, template)
            given = _given(record, tokenizer) if rollouts else (None, None, None)
        except RowError as exc:
            bad.add(row, exc)
            continue
        if len(ids) > max_prompt_length:
            cut += 1
            ids = ids[len(ids) - max_prompt_length:]
        columns = {k: v for k, v in record.items() if k not in ROLLOUT_KEYS and k != "tools"}
        rows.append(PromptRow(number, np.asarray(ids, dtype=np.int64), prompt, conversational, columns, *given))
    bad.log()
    if cut:
        logger.warning("%s: %d prompt(s) longer than %d tokens (training.seq_len − grpo.max_completion_length) "
                       "keep their last tokens", key, cut, max_prompt_length)
    if not rows:
        raise DataError(f"{key}: {where} holds no usable prompt{bad.note()}")
    return PromptWindows(rows, cut=cut, skipped=bad.count, rollouts=rollouts)


def read_rollouts(path: Path, tokenizer: Tokenizer, *, max_prompt_length: int, key: str = "grpo.rollouts_path",
                  on_bad_row: str = "stop", chat_template: str | None = None,
                  template_kwargs: dict[str, Any] | None = None) -> PromptWindows:
    """A rollouts file's prompt groups (see the module's text) as windows."""
    files = suffix_files(str(path), SUFFIXES, key=key, section="grpo", dataset="prompts", what=KINDS["prompts"])
    return prompt_windows(files, tokenizer, max_prompt_length=max_prompt_length, key=key, where=repr(str(path)),
                          chat_template=chat_template, template_kwargs=template_kwargs, on_bad_row=on_bad_row,
                          rollouts=True)
