"""The ``chat`` source: conversations for supervised fine-tuning, rendered with the tokenizer's
own chat template and packed whole into windows.

Rows (JSON lines, or Parquet files; a file or a folder searched recursively) hold either a
``messages`` list of ``{role, content}`` tables or ``prompt`` / ``completion`` strings (a user turn
and an assistant turn). Each conversation is rendered by the ``chat_template`` of the tokenizer's
``tokenizer_config.json`` exactly as transformers' ``apply_chat_template`` renders it (a sandboxed
Jinja environment with the same options, filters and globals, and the tokenizer's special tokens)
and tokenized as it tokenizes it, so the ids are transformers'. The labels count the assistant
turns only (``loss_on = "assistant"``: each assistant message from where the template's
generation prompt ends to the end of the turn, its end-of-turn token included) or every token
(``"all"``). A conversation longer than ``seq_len + 1`` tokens is cut at the right or dropped
(``truncate``), counted and logged. Conversations are packed whole, in order, into windows of
``seq_len + 1`` tokens (:class:`~torchtitan_lite.data.windows.PackedWindows`); what is left of a
window is padding that counts nothing. With ``model.attention_mask = "block_causal"`` no
conversation sees another.
"""

from __future__ import annotations

import functools
import gzip
import json
import logging
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_lite.data.files import suffix_files, unreadable_error
from torchtitan_lite.data.tokenizers import HFTokenizer, Tokenizer, special_tokens
from torchtitan_lite.data.windows import PackedWindows
from torchtitan_lite.errors import DataError

__all__ = ["KINDS", "ChatTemplate", "find_files", "packed_windows", "read_conversations"]

logger = logging.getLogger("torchtitan_lite")

KINDS = {"chat": "conversations: JSON lines or Parquet rows with a messages list of {role, content}, or "
                 "prompt / completion (dataset_path)"}
SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def find_files(dataset: str, dataset_path: str | None, *, section: str, key: str) -> list[Path]:
    """The conversation files ``dataset_path`` names (cheap checks: existence and suffixes)."""
    return suffix_files(dataset_path, SUFFIXES, key=key, section=section, dataset=dataset, what=KINDS[dataset])


# --------------------------------------------------------------------------------------------
# The chat template, rendered as transformers renders it
# --------------------------------------------------------------------------------------------


@functools.cache
def _compile(template: str) -> Any:
    """``template`` compiled in the environment transformers' ``apply_chat_template`` uses: a
    sandbox, ``trim_blocks`` and ``lstrip_blocks``, loop controls, a ``tojson`` that keeps
    non-ASCII characters, ``raise_exception`` and ``strftime_now``."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(template)


class ChatTemplate:
    """A tokenizer's chat template: renders conversations and tokenizes them with their label
    mask. ``key`` names the option errors point at."""

    def __init__(self, tokenizer: Tokenizer, *, key: str = "model.tokenizer_path") -> None:
        if not isinstance(tokenizer, HFTokenizer):
            raise DataError(f"{key}: dataset = 'chat' needs a Hugging Face tokenizer.json with a chat_template in "
                            f"its tokenizer_config.json; this job's tokenizer is {type(tokenizer).__name__}")
        values = tokenizer.config
        template = values.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        if not isinstance(template, str) or not template.strip():
            raise DataError(f"{key}: {str(tokenizer.path.parent / 'tokenizer_config.json')!r} has no chat_template; "
                            "dataset = 'chat' renders conversations with the tokenizer's own template")
        self.tokenizer, self.template = tokenizer, template
        self.special = {name: value for name, value in special_tokens(values, _SPECIAL).items() if value is not None}
        try:
            self._compiled = _compile(template)
        except Exception as exc:  # jinja2's TemplateSyntaxError
            raise DataError(f"{key}: the chat_template of {str(tokenizer.path.parent / 'tokenizer_config.json')!r} "
                            f"is not a valid Jinja template ({exc})") from None
        self._prefix_warned = False

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False) -> str:
        """The conversation as the template writes it."""
        return str(self._compiled.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special))

    def assistant_spans(self, messages: list[dict[str, Any]], text: str) -> list[tuple[int, int]]:
        """Character spans of ``text`` (the whole conversation rendered) that the assistant
        writes: for assistant message ``i``, from the end of the first ``i`` messages rendered
        with the generation prompt to the end of the first ``i + 1`` rendered. A template that
        does not render conversations as prefixes of each other (one that rewrites earlier
        turns) falls back to the message's content where it appears in ``text``."""
        spans, start = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1])
            if through.startswith(before) and text.startswith(through):
                spans.append((len(before), len(through)))
                start = len(through)
                continue
            if not self._prefix_warned:
                self._prefix_warned = True
                logger.warning("chat: the template does not render a conversation's first turns as a prefix of "
                               "the whole; assistant turns are found by their content (the end-of-turn token is "
                               "then not counted)")
            content = str(message.get("content") or "")
            found = text.find(content, start) if content else -1
            if found >= 0:
                spans.append((found, found + len(content)))
                start = found + len(content)
        return spans

    def encode(self, messages: list[dict[str, Any]], *, loss_on: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of the conversation (those of ``apply_chat_template``) and whether each is a
        counted label (``loss_on``: "assistant" or "all")."""
        text = self.render(messages)
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        counted = np.ones(len(ids), dtype=bool)
        if loss_on == "assistant":
            counted[:] = False
            starts = np.array([start for start, _ in offsets], dtype=np.int64)
            for lo, hi in self.assistant_spans(messages, text):
                counted |= (starts >= lo) & (starts < hi)
        return np.asarray(ids, dtype=np.int64), counted


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


def _messages(record: Any, where: str) -> list[dict[str, Any]]:
    """A row's conversation: its ``messages``, or its ``prompt`` and ``completion`` as two turns."""
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
        if (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content", ""), str | None)
                for m in messages)):
            return [{**m, "content": m.get("content") or ""} for m in messages]
        raise DataError(f"{where}: 'messages' is not a non-empty list of {{role, content}} tables "
                        f"(role a string, content a string): {str(messages)[:80]!r}")
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
    raise DataError(f"{where}: expected a 'messages' list of {{role, content}} tables, or 'prompt' and "
                    f"'completion' strings; got {str(record)[:80]!r}")


def read_conversations(files: list[Path], key: str) -> Iterator[list[dict[str, Any]]]:
    """Every conversation of the files, in order; a malformed row is one :class:`DataError` line
    naming the file and the row."""
    for file in files:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                table = pq.read_table(str(file))
            except OSError as exc:
                raise unreadable_error(key, file, exc) from None
            columns = [c for c in ("messages", "prompt", "completion") if c in table.column_names]
            for row, record in enumerate(table.select(columns).to_pylist()):
                yield _messages(record, f"{key}: {str(file)!r} row {row}")
            continue
        try:
            raw = file.read_bytes()
            if file.name.endswith(".gz"):
                raw = gzip.decompress(raw)
        except OSError as exc:
            raise unreadable_error(key, file, exc) from None
        for lineno, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise DataError(f"{key}: {str(file)!r} line {lineno} is not JSON") from None
            yield _messages(record, f"{key}: {str(file)!r} line {lineno}")


def packed_windows(files: list[Path], tokenizer: Tokenizer, *, seq_len: int, loss_on: str, truncate: str,
                   key: str, where: str) -> PackedWindows:
    """Every conversation rendered, tokenized with its label mask, and packed whole, in order,
    into windows of ``seq_len + 1`` tokens (a conversation that does not fit in what is left of
    a window starts the next)."""
    template = ChatTemplate(tokenizer)
    size = seq_len + 1
    windows: list[np.ndarray] = []
    current = np.zeros((3, size), dtype=np.int64)
    used = samples = cut = dropped = 0

    def close() -> None:
        nonlocal current, used
        if used:
            current[2, used:] = current[2, used - 1] + 1  # padding: a sample of its own, never counted
            windows.append(current)
        current, used = np.zeros((3, size), dtype=np.int64), 0

    for messages in read_conversations(files, key):
        ids, counted = template.encode(messages, loss_on=loss_on)
        if len(ids) > size:
            if truncate == "drop":
                dropped += 1
                continue
            ids, counted, cut = ids[:size], counted[:size], cut + 1
        if used + len(ids) > size:
            close()
        sample = current[2, used - 1] + 1 if used else 0
        current[0, used : used + len(ids)] = ids
        current[1, used : used + len(ids)] = counted
        current[2, used : used + len(ids)] = sample
        used += len(ids)
        samples += 1
    close()
    if cut or dropped:
        logger.warning("%s: %d conversation(s) longer than seq_len + 1 = %d tokens were %s (training.truncate)",
                       key, cut or dropped, size, "cut at the right" if cut else "dropped")
    if not windows:
        raise DataError(f"{key}: {where} holds no conversation that fits seq_len + 1 = {size} tokens"
                        + (f" ({dropped} dropped: training.truncate = 'drop')" if dropped else ""))
    rows = np.stack(windows)
    if not rows[:, 1].any():
        raise DataError(f"{key}: {where} has no token the loss counts (training.loss_on = {loss_on!r}: no "
                        "assistant turn?)")
    return PackedWindows(rows, seq_len=seq_len, samples=samples, what="conversations")
