"""Reward functions, with TRL's signature: ``f(prompts, completions, **columns)`` → one float (or
None: the function does not apply to that completion) per completion.

``prompts`` and ``completions`` hold one entry per completion (a prompt repeated for each of its
completions); a conversational prompt's completion is ``[{"role": "assistant", "content": text}]``,
a text prompt's the text. Every other column of the prompt's row is a keyword argument (a list, one
entry per completion), with ``completion_ids`` (each completion's token ids) and
``max_completion_length``; a function should take ``**kwargs`` for what it does not read.

Shipped, by name (``grpo.reward_functions``):

- ``accuracy``: 1.0 when the completion's final answer equals the row's ``answer`` (or
  ``solution``, TRL's name; after trimming spaces, a trailing period and thousands separators),
  else 0.0; with an ``answer_pattern`` column, 1.0 when that regular expression matches the final
  answer. The final answer is the last ``\\boxed{…}``, else what follows the last ``####``, else
  the last ``<answer>…</answer>``, else the last number of the text. A worked solution as the
  row's answer (GSM8K's text ending ``#### 72``, a solution with a ``\\boxed{…}``) counts by its
  final answer. None for a row without any of these columns.
- ``format``: 1.0 when the completion is ``<think>…</think>`` followed by the answer (one think
  block, at the start), else 0.0 (TRL's ``think_format_reward``).
- ``length_penalty``: DAPO's soft overlong punishment: 0 up to ``max_completion_length`` minus a
  buffer of a quarter of it, then falling linearly to −1 at ``max_completion_length``.

Anything else is a dotted path to a function of your own (``package.module.function``).
"""

from __future__ import annotations

import importlib
import inspect
import re
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from torchtitan_lite.errors import ConfigError, UserCodeError

__all__ = ["SHIPPED", "RewardFunction", "accuracy", "call_reward", "final_answer", "format_reward",
           "length_penalty", "resolve_reward_functions"]

RewardFunction = Callable[..., Sequence[float | None]]


def _text(completion: Any) -> str:
    """A completion's text (a conversational one: its last message's content)."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def final_answer(text: str) -> str | None:
    """A completion's final answer (see the module's text), or None when it has none."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else ""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1]
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normal(answer: str) -> str:
    answer = answer.strip().rstrip(".").strip()
    return answer.replace(",", "") if _NUMBER.fullmatch(answer) else answer


def _gold(answer: str) -> str:
    """A row's answer as compared: a worked solution's final answer (its last ``\\boxed{…}``, or
    what follows its last ``####``), else the answer as given."""
    if "\\boxed{" in answer or "####" in answer:
        found = final_answer(answer)
        if found is not None:
            return found
    return answer


def accuracy(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
    """1.0 for a completion whose final answer is the row's ``answer`` or ``solution`` (a worked
    solution: its final answer), or matches its ``answer_pattern``, else 0.0; None for rows with
    none of them."""
    answers = columns.get("answer") or columns.get("solution") or [None] * len(completions)
    patterns = columns.get("answer_pattern") or [None] * len(completions)
    out: list[float | None] = []
    for completion, answer, pattern in zip(completions, answers, patterns, strict=True):
        found = final_answer(_text(completion))
        if pattern is not None:
            out.append(float(found is not None and re.fullmatch(str(pattern), found.strip()) is not None))
        elif answer is not None:
            out.append(float(found is not None and _normal(found) == _normal(_gold(str(answer)))))
        else:
            out.append(None)
    return out


_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL)


def format_reward(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
    """1.0 for ``<think>…</think>`` then the answer (one think block, at the start), else 0.0."""
    return [float(_THINK.match(_text(c)) is not None) for c in completions]


def length_penalty(prompts: list[Any], completions: list[Any], *, completion_ids: list[list[int]],
                   max_completion_length: int, **columns: Any) -> list[float | None]:
    """DAPO's soft overlong punishment over the last quarter of ``max_completion_length``."""
    buffer = max(max_completion_length // 4, 1)
    start = max_completion_length - buffer
    return [0.0 if len(ids) <= start else max((start - len(ids)) / buffer, -1.0) for ids in completion_ids]


SHIPPED: dict[str, RewardFunction] = {"accuracy": accuracy, "format": format_reward,
                                      "length_penalty": length_penalty}
"""The reward functions shipped, by the name ``grpo.reward_functions`` gives them."""


def resolve_reward_functions(names: Sequence[str]) -> list[tuple[str, RewardFunction]]:
    """Each name's function: a shipped one, or a dotted path imported; a :class:`ConfigError` with
    one line naming ``grpo.reward_functions`` for each name that is neither."""
    found, problems = [], []
    for name in names:
        if name in SHIPPED:
            found.append((name, SHIPPED[name]))
            continue
        module_name, _, attribute = name.rpartition(".")
        problem = None
        if not module_name:
            problem = f"not a shipped reward function ({', '.join(SHIPPED)}) nor a dotted path module.function"
        else:
            try:
                function = getattr(importlib.import_module(module_name), attribute, None)
            except ImportError as exc:
                function, problem = None, f"its module {module_name!r} does not import ({exc})"
            if problem is None and not callable(function):
                problem = f"module {module_name!r} has no function {attribute!r}"
        if problem is not None:
            problems.append(f"grpo.reward_functions: invalid value {name!r}; {problem}")
            continue
        found.append((name, function))
    if problems:
        raise ConfigError("\n".join(problems))
    return found


def metric_names(functions: Sequence[tuple[str, RewardFunction]]) -> list[str]:
    """The names the reward functions' metrics go by (``grpo/rewards/NAME/mean``): a shipped one's
    name, and for a dotted path the function's ``__name__``, as TRL names them (``boom`` for
    ``myrewards.boom``); the dotted path where two would be alike or a callable has no name."""
    short = [name if name in SHIPPED else getattr(function, "__name__", name) for name, function in functions]
    return [s if short.count(s) == 1 and s != "<lambda>" else name
            for s, (name, _) in zip(short, functions, strict=True)]


def call_reward(name: str, function: RewardFunction, prompts: list[Any], completions: list[Any],
                columns: dict[str, list[Any]]) -> list[float]:
    """``function``'s rewards of the completions (None as NaN); one :class:`UserCodeError` line
    naming it when it raises (with the file and line where it raised) or returns other than one
    number or None per completion."""
    try:
        values = function(prompts=prompts, completions=completions, **columns)
    except Exception as exc:  # (the user's code: any error is reported as its own)
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        raise UserCodeError(f"grpo.reward_functions: {name!r} raised {type(exc).__name__}: {first} "
                            f"({_raised_at(exc, function)})") from exc
    try:
        values = list(values)
    except TypeError:
        raise UserCodeError(f"grpo.reward_functions: {name!r} returned {type(values).__name__}; expected a list of "
                            f"{len(completions)} numbers or None") from None
    if len(values) != len(completions) or not all(v is None or isinstance(v, (int, float)) for v in values):
        raise UserCodeError(f"grpo.reward_functions: {name!r} returned {len(values)} values; expected one number or "
                            f"None per completion ({len(completions)})")
    return [float("nan") if v is None else float(v) for v in values]


def _raised_at(exc: BaseException, function: Callable[..., Any]) -> str:
    """Where ``exc`` was raised: ``at FILE:LINE in NAME``, the deepest frame of ``function``'s own
    file (the user's line), with the frame that raised added when it lies elsewhere (a library
    the function called)."""
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # (the first is call_reward's own)
    if not frames:
        return "at an unknown place"
    try:
        own = inspect.getsourcefile(inspect.unwrap(function))
    except TypeError:  # (a builtin or a callable object without a source file)
        own = None
    mine = [f for f in frames if own is not None and f.filename == own]
    where = mine[-1] if mine else frames[-1]
    text = f"at {where.filename}:{where.lineno} in {where.name}"
    last = frames[-1]
    if last is not where:
        text += f", raised in {last.filename}:{last.lineno} in {last.name}"
    return text
