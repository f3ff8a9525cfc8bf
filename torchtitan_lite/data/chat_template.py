"""Chat templates as transformers applies them, and which tokens of a rendered conversation the
assistant writes.

**Where the template comes from**, in the order transformers 5 reads a tokenizer folder:
``chat_template.jinja`` beside the tokenizer (what ``save_pretrained`` writes today) and the
named templates of ``additional_chat_templates/*.jinja``; else ``tokenizer_config.json``'s
``chat_template``, a string or a list of ``{name, template}`` tables. A row with ``tools`` uses
the ``tool_use`` template where there is one, every other row ``default``. ``training.chat_template``
(the path of a ``.jinja`` file) replaces them all, e.g. with a training template that marks the
assistant's tokens.

**Rendering**: the sandboxed Jinja environment of ``apply_chat_template`` (``trim_blocks``,
``lstrip_blocks``, loop controls, a ``tojson`` that keeps non-ASCII characters,
``raise_exception``, ``strftime_now``, its ``dict`` and ``namespace``, the ``{% generation %}``
tag), the messages as it passes them (keys whose value is null dropped; ``reasoning_content``,
``thinking`` and ``reasoning`` aliased to each other), the row's ``tools``, and the tokenizer's
special tokens. The ids are those of ``apply_chat_template``.

**Which tokens count** (``training.loss_on = "assistant"``):

- A template with ``{% generation %}`` … ``{% endgeneration %}`` marks them itself: every token
  that overlaps a marked span, exactly transformers' ``return_assistant_tokens_mask``.
- Otherwise, for each assistant message, what the rendering of the *whole* conversation gives
  that turn. It begins where the text stops being what the model is prompted with at that turn
  (the conversation before it rendered with the generation prompt, compared from the end of the
  message before it), so a generation prompt that opens a think block leaves that opening out and
  a template that rewrites earlier turns (reasoning stripped, a system prompt moved) is read as it
  writes them. It ends where the text stops being what the template writes after the message
  when the message is the last one (compared from the end of its text): its end-of-turn text
  (``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ``<|end|>``, ``<｜end▁of▁sentence｜>`` …) and
  whatever else closes the turn, in whole tokens. Where each message's text lies is found by
  rendering the conversation with markers around every string the message holds (content,
  reasoning, tool-call arguments); a template that changes its output around markers is compared
  message by message instead. A turn whose tokens would overlap a user, system or tool message,
  or whose text the template does not write, cannot be found with certainty:
  :class:`RowError` (kind ``"spans"``), never a guess.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_lite.data.tokenizers import SPECIAL_TOKENS, HFTokenizer, Tokenizer, special_tokens
from torchtitan_lite.errors import DataError

__all__ = ["SPECIAL_TOKENS", "TEMPLATE_DIR", "TEMPLATE_FILE", "BadRows", "ChatTemplate", "RowError", "load_templates"]

logger = logging.getLogger("torchtitan_lite")

TEMPLATE_FILE = "chat_template.jinja"
"""The chat template file transformers writes beside a tokenizer (``save_pretrained``)."""
TEMPLATE_DIR = "additional_chat_templates"
"""Named chat templates beside a tokenizer, one ``<name>.jinja`` each."""
_GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")  # transformers' own test for markers
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class RowError(Exception):
    """A conversation that cannot be used: the template refused it (``kind = "template"``: its
    ``raise_exception`` or any other error while rendering), its assistant turns cannot be found
    with certainty (``"spans"``), or the row is not a conversation (``"row"``, raised by the
    reader). The message is one line; the caller names the row."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class BadRows:
    """The rows of a source that could not be used (a :class:`RowError` each): with
    ``on_bad_row = "stop"`` the first is a :class:`~torchtitan_lite.errors.DataError` line naming
    ``key`` and the row; with ``"skip"`` they are counted by kind and logged once (:meth:`log`)."""

    def __init__(self, key: str, on_bad_row: str) -> None:
        self.key, self.on_bad_row = key, on_bad_row
        self.kinds: dict[str, int] = {}
        self.first = ""

    def add(self, row: str, exc: RowError) -> None:
        if self.on_bad_row != "skip":
            raise DataError(f"{self.key}: {row}: {exc} (or set training.on_bad_row = 'skip')") from None
        self.kinds[exc.kind] = self.kinds.get(exc.kind, 0) + 1
        self.first = self.first or f"{row}: {exc}"

    @property
    def count(self) -> int:
        return sum(self.kinds.values())

    def log(self) -> None:
        """One warning with the skipped rows by kind and the first of them (nothing when none)."""
        if self.kinds:
            logger.warning("%s: %d row(s) skipped (training.on_bad_row = 'skip'): %s; the first: %s", self.key,
                           self.count, ", ".join(f"{n} {kind}" for kind, n in sorted(self.kinds.items())), self.first)

    def note(self) -> str:
        """`` (N skipped: training.on_bad_row = 'skip')`` for an error about what is left ("" when none)."""
        return f" ({self.count} skipped: training.on_bad_row = 'skip')" if self.kinds else ""


# --------------------------------------------------------------------------------------------
# Where the template comes from
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Templates:
    """A tokenizer's chat templates by name (``default``, ``tool_use`` …) and the file each came from."""

    sources: dict[str, str]
    files: dict[str, str]

    def name_for(self, tools: list[Any] | None) -> str:
        """The template a row uses, as transformers picks it: ``tool_use`` for a row with tools
        where there is one, else ``default``."""
        return "tool_use" if tools is not None and "tool_use" in self.sources else "default"


def load_templates(tokenizer: HFTokenizer, *, override: str | None = None, key: str = "model.tokenizer_path",
                   override_key: str = "training.chat_template") -> Templates:
    """The chat templates of ``tokenizer`` (see the module's docstring for the order), or the one
    ``.jinja`` file ``override`` names; :class:`DataError` naming the file when there is none."""
    folder = tokenizer.path.parent
    if override is not None:
        path = Path(override).expanduser()
        return _compiled(Templates({"default": _read_template(path, override_key)}, {"default": str(path)}),
                         override_key)
    sources: dict[str, str] = {}
    files: dict[str, str] = {}
    if (folder / TEMPLATE_FILE).is_file():
        sources["default"], files["default"] = _read_template(folder / TEMPLATE_FILE, key), str(folder / TEMPLATE_FILE)
    if (folder / TEMPLATE_DIR).is_dir():
        for file in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
            name = file.name.removesuffix(".jinja")
            sources[name], files[name] = _read_template(file, key), str(file)
    config_file = str(folder / "tokenizer_config.json")
    if not sources:  # the files beside the tokenizer take priority over the config's entry
        value = tokenizer.config.get("chat_template")
        if isinstance(value, str) and value.strip():
            sources["default"] = value
        elif isinstance(value, list):
            sources = {t["name"]: t["template"] for t in value if isinstance(t, dict)
                       and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        files = dict.fromkeys(sources, config_file)
    if not sources:
        raise DataError(f"{key}: {str(folder)!r} has no chat template (neither {TEMPLATE_FILE} nor a chat_template "
                        f"in tokenizer_config.json); dataset = 'chat' renders conversations with the tokenizer's "
                        f"template: save the tokenizer with one, or set {override_key} to a .jinja file")
    if "default" not in sources:
        raise DataError(f"{key}: the chat templates of {str(folder)!r} are named {sorted(sources)} and none is "
                        f"'default'; set {override_key} to the .jinja file of the one to use")
    return _compiled(Templates(sources, files), key)


def _compiled(templates: Templates, key: str) -> Templates:
    """``templates``, each compiled once here so that a syntax error is one line naming its file."""
    for name, source in templates.sources.items():
        try:
            _compile(source)
        except Exception as exc:  # jinja2's TemplateSyntaxError and the like
            raise DataError(f"{key}: the chat template {name!r} of {templates.files[name]!r} is not a valid Jinja "
                            f"template ({_one_line(exc)})") from None
    return templates


def _read_template(path: Path, key: str) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{key}: invalid value {str(path)!r}; the chat template file cannot be read "
                        f"({getattr(exc, 'strerror', None) or exc})") from None
    if not text.strip():
        raise DataError(f"{key}: invalid value {str(path)!r}; the chat template file is empty")
    return text


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


# --------------------------------------------------------------------------------------------
# Rendering, as transformers' apply_chat_template renders
# --------------------------------------------------------------------------------------------

_TRACKING: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("chat_generation", default=None)


@functools.cache
def _compile(source: str) -> Any:
    """``source`` compiled in the environment of transformers' ``apply_chat_template``."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}`` … ``{% endgeneration %}``: the text between is the assistant's;
        while a render tracks it, its span in the output so far is recorded."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation(self, context: Any, caller: Any) -> str:
            text = caller()
            tracking = _TRACKING.get()
            if tracking is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        """``dict(...)`` in a template: builds plain dicts, nothing else of the type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """``namespace(...)`` without underscore-prefixed attributes."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's own signature
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(source)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template: keys whose value is null dropped, and a
    message's reasoning under all three names templates read it by (``reasoning_content``,
    ``thinking``, ``reasoning``)."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@contextmanager
def _tracking() -> Iterator[tuple[list[str], list[tuple[int, int]]]]:
    state: tuple[list[str], list[tuple[int, int]]] = ([], [])
    token = _TRACKING.set(state)
    try:
        yield state
    finally:
        _TRACKING.reset(token)


# --------------------------------------------------------------------------------------------
# Markers: where each message's text lies in a rendering
# --------------------------------------------------------------------------------------------

_MARKS = re.compile("\ue000(\\d+)\ue001|\ue002(\\d+)\ue003")


def _mark(text: str, index: int) -> str:
    """``text`` with message ``index``'s start and end marks inside its leading and trailing
    whitespace (so that a template's ``trim`` or ``strip`` keeps both where the text is)."""
    start, end = f"\ue000{index}\ue001", f"\ue002{index}\ue003"
    core = text.strip()
    if not core:
        return text + start + end
    lead = len(text) - len(text.lstrip())
    return text[:lead] + start + core + end + text[lead + len(core):]


def _marked_message(message: dict[str, Any], index: int, *, empty: bool = True) -> dict[str, Any]:
    """The message with every string it holds marked (its content, reasoning, tool calls' names
    and arguments), except what a template branches on (its role, ids, types); ``empty=False``
    leaves empty strings as they are (a template may test whether a text is empty)."""

    def mark(value: Any) -> Any:
        if isinstance(value, str):
            return _mark(value, index) if empty or value else value
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    out = dict(message)
    content = out.get("content")
    if isinstance(content, str):
        out["content"] = mark(content)
    elif isinstance(content, list):  # content parts: their text
        out["content"] = [{**part, "text": mark(part["text"])}
                          if isinstance(part, dict) and isinstance(part.get("text"), str) else part
                          for part in content]
    for name in _REASONING_FIELDS:
        if isinstance(out.get(name), str):
            out[name] = mark(out[name])
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        marked_calls = []
        for call in calls:
            if isinstance(call, dict):
                call = dict(call)
                function = call.get("function")
                holder = dict(function) if isinstance(function, dict) else call
                for key in ("name", "arguments"):
                    if key in holder:
                        holder[key] = mark(holder[key])
                if isinstance(function, dict):
                    call["function"] = holder
            marked_calls.append(call)
        out["tool_calls"] = marked_calls
    return out


def _strip_marks(text: str) -> tuple[str, dict[int, tuple[int | None, int | None]]]:
    """``text`` without marks, and each marked message's (first start, last end) in it."""
    starts: dict[int, int] = {}
    ends: dict[int, int] = {}
    removed = 0
    for match in _MARKS.finditer(text):
        at = match.start() - removed
        removed += len(match.group(0))
        if match.group(1) is not None:
            index = int(match.group(1))
            starts[index] = min(starts.get(index, at), at)
        else:
            index = int(match.group(2))
            ends[index] = max(ends.get(index, at), at)
    regions = {i: (starts.get(i), ends.get(i)) for i in set(starts) | set(ends)}
    return _MARKS.sub("", text), regions


def _longest(n: int, same: Callable[[int], bool]) -> int:
    """The largest ``k <= n`` with ``same(k)`` (``same`` holds up to some length, then never):
    a binary search on slices, at C speed for long texts."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if same(mid) else (lo, mid - 1)
    return lo


def _common_prefix(a: str, a_at: int, b: str, b_at: int) -> int:
    """How many characters ``a[a_at:]`` and ``b[b_at:]`` share at their start."""
    return _longest(min(len(a) - a_at, len(b) - b_at), lambda k: a[a_at : a_at + k] == b[b_at : b_at + k])


def _common_suffix(a: str, b: str, limit: int) -> int:
    """How many characters (at most ``limit``) ``a`` and ``b`` share at their end."""
    return _longest(min(limit, len(a), len(b)), lambda k: a[len(a) - k :] == b[len(b) - k :])


# --------------------------------------------------------------------------------------------
# The template of a job
# --------------------------------------------------------------------------------------------

Region = tuple[int | None, int | None]
_WAYS = ("marks", "non-empty marks", "verbatim", "changes")
"""How a message's text is located in a rendering, in the order tried."""


class ChatTemplate:
    """A tokenizer's chat templates: renders conversations as ``apply_chat_template`` does and
    tokenizes them with their label mask. ``template_path``: ``training.chat_template``;
    ``template_kwargs``: ``training.chat_template_kwargs``, the template's extra variables (as
    ``apply_chat_template(..., **kwargs)`` passes them: over the special tokens' names)."""

    def __init__(self, tokenizer: Tokenizer, *, template_path: str | None = None,
                 key: str = "model.tokenizer_path", template_kwargs: dict[str, Any] | None = None) -> None:
        if not isinstance(tokenizer, HFTokenizer):
            raise DataError(f"{key}: dataset = 'chat' needs a Hugging Face tokenizer.json and its chat template; "
                            f"this job's tokenizer is {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self.templates = load_templates(tokenizer, override=template_path, key=key)
        values = tokenizer.config
        self.special = {name: value for name, value in special_tokens(values, SPECIAL_TOKENS).items()
                        if value is not None}
        extra = values.get("extra_special_tokens")
        if isinstance(extra, dict):  # model-specific named tokens (transformers 5 passes them too)
            self.special.update({k: v for k, v in special_tokens(extra, tuple(extra)).items() if v is not None})
        self.special.update(template_kwargs or {})

    def where(self, *, tools: list[Any] | None = None) -> str:
        """The file the template a row uses came from (for errors)."""
        return self.templates.files[self.templates.name_for(tools)]

    def marks_generation(self, *, tools: list[Any] | None = None) -> bool:
        """Whether the template a row uses marks the assistant's text with ``{% generation %}``."""
        return bool(_GENERATION_TAG.search(self.templates.sources[self.templates.name_for(tools)]))

    def _render(self, messages: list[dict[str, Any]], tools: list[Any] | None, *, add_generation_prompt: bool = False,
                spans: list[tuple[int, int]] | None = None) -> str:
        compiled = _compile(self.templates.sources[self.templates.name_for(tools)])
        kwargs = {"messages": template_messages(messages), "tools": tools, "documents": None,
                  "add_generation_prompt": add_generation_prompt, **self.special}
        try:
            if spans is None:
                return str(compiled.render(**kwargs))
            with _tracking() as (blocks, found):
                for block in compiled.generate(**kwargs):
                    blocks.append(block)
                spans.extend(found)
                return "".join(blocks)
        except Exception as exc:  # raise_exception, undefined names, type errors ...
            raise RowError(f"the chat template {self.where(tools=tools)!r} fails on it: {_one_line(exc)}",
                           kind="template") from None

    def render(self, messages: list[dict[str, Any]], *, tools: list[Any] | None = None,
               add_generation_prompt: bool = False) -> str:
        """The conversation as the template writes it (:class:`RowError` where it refuses it)."""
        return self._render(messages, tools, add_generation_prompt=add_generation_prompt)

    def encode(self, messages: list[dict[str, Any]], *, loss_on: str,
               tools: list[Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of the conversation (those of ``apply_chat_template``) and whether each is a
        counted label (``loss_on``: "assistant" or "all"); :class:`RowError` for a conversation
        the template refuses or whose assistant turns cannot be found with certainty."""
        generation: list[tuple[int, int]] = []
        marked = loss_on == "assistant" and self.marks_generation(tools=tools)
        text = self._render(messages, tools, spans=generation if marked else None)
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        if loss_on != "assistant":
            return np.asarray(ids, dtype=np.int64), np.ones(len(ids), dtype=bool)
        counted = np.zeros(len(ids), dtype=bool)
        if marked:  # transformers' return_assistant_tokens_mask: every token overlapping a span
            span = 0
            for t, (start, end) in enumerate(offsets):
                while span < len(generation) and start >= generation[span][1]:
                    span += 1
                if span == len(generation):
                    break
                if end > generation[span][0]:
                    counted[t] = True
        else:
            starts = np.array([s for s, _ in offsets], dtype=np.int64)
            ends = np.array([e for _, e in offsets], dtype=np.int64)
            spans, regions = self._assistant_spans(messages, tools, text, ends)
            for lo, hi in spans:
                counted |= (starts < hi) & (ends > lo)
            _check_not_others(messages, regions, counted, starts, ends)
        return np.asarray(ids, dtype=np.int64), counted

    # ---- assistant turns without generation markers ----------------------------------------

    def _regions(self, messages: list[dict[str, Any]], tools: list[Any] | None, indices: list[int], *,
                 plain: str, add_generation_prompt: bool, ways: dict[int, str] | None = None,
                 ) -> tuple[dict[int, Region], dict[int, str]]:
        """Where the text of each message of ``indices`` lies in ``plain`` (the same conversation
        rendered without marks), and how each was found (:data:`_WAYS`): all marked at once where the
        marks change nothing else, else message by message (:meth:`_region_of`). ``ways``: how each
        was found in another rendering of the conversation, to be found the same way here (so that
        positions in the two renderings are of the same text)."""
        if not indices:
            return {}, {}
        if ways is None or all(ways.get(i, _WAYS[0]) == _WAYS[0] for i in indices):
            marked = [_marked_message(m, i) if i in indices else m for i, m in enumerate(messages)]
            text, regions = _strip_marks(self._render(marked, tools, add_generation_prompt=add_generation_prompt))
            if text == plain:
                return regions, dict.fromkeys(regions, _WAYS[0])
        out: dict[int, Region] = {}
        found_by: dict[int, str] = {}
        for i in indices:
            after = max([e for k, (_, e) in out.items() if k < i and e is not None], default=0)
            region, way = self._region_of(messages, tools, i, plain=plain, add_generation_prompt=add_generation_prompt,
                                          after=after, first=(ways or {}).get(i, _WAYS[0]))
            if region is not None:
                out[i], found_by[i] = region, way
        return out, found_by

    def _region_of(self, messages: list[dict[str, Any]], tools: list[Any] | None, i: int, *, plain: str,
                   add_generation_prompt: bool, after: int, first: str = "marks") -> tuple[Region | None, str]:
        """Where message ``i``'s text lies in ``plain`` and how it was found, by the first of
        :data:`_WAYS` from ``first`` on: its marks (every string, then every non-empty one) where
        they change nothing else; its content verbatim (the first occurrence from ``after``, the end
        of the message before it, or the one occurrence); where the rendering changes when it is
        marked. None: the template writes nothing of its text."""
        raw = plain
        for way in _WAYS[_WAYS.index(first):]:
            if way in _WAYS[:2]:
                one = [_marked_message(m, i, empty=way == _WAYS[0]) if j == i else m for j, m in enumerate(messages)]
                raw = self._render(one, tools, add_generation_prompt=add_generation_prompt)
                text, regions = _strip_marks(raw)
                if text == plain:
                    return regions.get(i), way
            elif way == "verbatim":
                content = messages[i].get("content")
                if isinstance(content, str) and content.strip():
                    at = plain.find(content, after)
                    if at < 0 and plain.count(content) == 1:
                        at = plain.index(content)
                    if at >= 0:  # the template tests the text (a prefix, equality with another message)
                        return (at, at + len(content)), way
            else:
                if raw == plain:
                    one = [_marked_message(m, i) if j == i else m for j, m in enumerate(messages)]
                    raw = self._render(one, tools, add_generation_prompt=add_generation_prompt)
                if raw == plain:
                    return None, way
                start = _common_prefix(plain, 0, raw, 0)
                return (start, len(plain) - _common_suffix(plain, raw, min(len(plain), len(raw)) - start)), way
        return None, first

    def _assistant_spans(self, messages: list[dict[str, Any]], tools: list[Any] | None, text: str,
                         token_ends: np.ndarray) -> tuple[list[tuple[int, int]], dict[int, Region]]:
        """Character spans of ``text`` that the assistant turns are (see the module's docstring),
        and where each message's text lies in it."""
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not turns:
            return [], {}
        regions, ways = self._regions(messages, tools, list(range(len(messages))), plain=text,
                                      add_generation_prompt=False)
        spans = []
        for i in turns:
            try:
                spans.append(self._turn_span(messages, tools, text, token_ends, regions, ways, i))
            except RowError as exc:
                if exc.kind == "spans":
                    raise
                raise RowError(f"assistant message {i}: the conversation around it cannot be rendered on its own to "
                               f"find its tokens ({exc})", kind="spans") from None
        return spans, regions

    def _turn_span(self, messages: list[dict[str, Any]], tools: list[Any] | None, text: str, token_ends: np.ndarray,
                   regions: dict[int, Region], ways: dict[int, str], i: int) -> tuple[int, int]:
        """The character span of ``text`` that assistant message ``i``'s turn is. Positions in the
        other renderings (the prompt before it, the conversation up to it) are found the way they
        were found in ``text`` (``ways``), so that they are those of the same text."""
        region = regions.get(i, (None, None))
        if region[1] is None:
            raise RowError(f"assistant message {i}: the template writes none of its text, so its tokens cannot "
                           "be found", kind="spans")
        # Where the turn begins: the end of what the model is prompted with.
        before = [k for k in range(i) if regions.get(k, (None, None))[1] is not None]
        prompt = self._render(messages[:i], tools, add_generation_prompt=True)
        anchor = anchor_in_prompt = 0
        # Every message before it is located in the prompt too, in order, so that a text that
        # stands twice (the same question asked again) is found where it is.
        in_prompt, _ = self._regions(messages[:i], tools, list(range(i)), plain=prompt, add_generation_prompt=True,
                                     ways=ways)
        for k in reversed(before):
            if in_prompt.get(k, (None, None))[1] is not None:
                anchor, anchor_in_prompt = regions[k][1], in_prompt[k][1]
                break
        opens = anchor + _common_prefix(text, anchor, prompt, anchor_in_prompt)
        if region[0] is not None:
            opens = min(opens, region[0])
        # Where it ends: what the template writes after the message when it is the last one.
        if i == len(messages) - 1:
            last, end_in_last = text, region[1]
        else:
            last = self._render(messages[: i + 1], tools)
            in_last, _ = self._regions(messages[: i + 1], tools, list(range(i + 1)), plain=last,
                                       add_generation_prompt=False, ways=ways)
            end_in_last = in_last.get(i, (None, None))[1]
            if end_in_last is None:
                raise RowError(f"assistant message {i}: the template writes none of its text when it is the "
                               "last message, so where its turn ends cannot be found", kind="spans")
        closes = region[1] + _common_prefix(text, region[1], last, end_in_last)
        whole = token_ends[token_ends <= closes]  # in whole tokens: never the start of the next one
        closes = max(int(whole.max()) if len(whole) else 0, region[1])
        if opens > region[1]:
            raise RowError(f"assistant message {i}: its text starts before the end of the prompt that precedes "
                           "it", kind="spans")
        if not token_ends[(token_ends > opens) & (token_ends <= closes)].size and _has_text(messages[i]):
            raise RowError(f"assistant message {i}: no token of its turn could be told apart from the text around "
                           "it", kind="spans")
        return opens, closes


def _has_text(message: dict[str, Any]) -> bool:
    """Whether a message holds any text of its own (content, reasoning or tool calls)."""
    content = message.get("content")
    return bool(message.get("tool_calls")) or any(
        isinstance(message.get(k), str) and message[k].strip() for k in _REASONING_FIELDS) or (
        isinstance(content, str) and bool(content.strip())) or (isinstance(content, list) and bool(content))


def _check_not_others(messages: list[dict[str, Any]], regions: dict[int, Region], counted: np.ndarray,
                      starts: np.ndarray, ends: np.ndarray) -> None:
    """No counted token may hold text of a user, system or tool message."""
    for j, message in enumerate(messages):
        if message.get("role") == "assistant" or j not in regions:
            continue
        lo, hi = regions[j]
        if hi is None:
            continue
        if lo is None:  # its start mark was dropped: from the end of the message before it
            lo = max([e for k, (_, e) in regions.items() if k < j and e is not None], default=0)
        if hi > lo and bool((counted & (starts < hi) & (ends > lo)).any()):
            raise RowError(f"the tokens found for an assistant turn hold text of message {j} "
                           f"({message.get('role')!r})", kind="spans")
