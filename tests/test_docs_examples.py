"""The docs tier (``-m docs``): every example of ``README.md`` and ``docs/*.md`` runs as written, at a
small size, or names why it cannot run here.

Every fenced block of a page is collected. A block whose language is ``text`` is output or a
diagram; a block without a language is a failure (say ``text`` or the language of the example).
Every other block is an example: ``bash`` blocks give one example per command (``\\``
continuations joined, comments dropped, ``&&`` chains split), ``toml`` and ``python`` blocks one
each. Each example is one test, its id the page and line (``README.md:14``; ``#2`` for the second
command of a chain), and runs in a temporary working copy (``train_configs``, ``scripts``,
``examples``, ``tests``, ``torchtitan_lite`` and ``pyproject.toml`` linked in, ``docs/benchmarks``
empty), so
nothing is written into the repository. What an example needs is said by a hidden marker, an HTML
comment just before its block (other comments may sit between them)::

    <!-- docs-test: skip a GPU -->                       every command of the block
    <!-- docs-test
    pip install => skip installs                         the first line whose text before `=>`
    torchrun => sub =N =2; append --training.steps 2     is part of a command applies to it;
    run                                                  a line without `=>`: the other commands
    -->

Actions, separated by ``;`` (arguments as a shell splits them):

- ``skip REASON``: not run; the reason starts with its kind (``a GPU``, ``a download``, ``many
  nodes``, ``Slurm``, ``minutes``, ``installs``). ``pip install`` and ``huggingface-cli
  download`` commands are skipped (``installs``, ``a download``) unless a line names them.
- ``tested-by PATH``: another test runs this example (the file must name the page). ``same-as
  PAGE``: the block is, word for word, one of PAGE's, whose examples run.
- ``file PATH``: the block is, word for word, the repository's file PATH (a shipped script the page
  shows; checked when the examples are collected, so ``tests/test_docs.py`` checks it too).
- ``run``: as written. ``append ARGS``: arguments added at the end of the command (a ``toml``
  block's job, a ``python`` script). ``sub OLD NEW``: text replaced in the command.
- ``base PATH``: a ``toml`` fragment, merged onto that job file. ``ranks N``: the ``toml`` job or
  ``python`` script runs under torchrun on N processes (else one process).
- ``fragment``: a ``python`` fragment that names the reader's objects: it must parse, its imports
  run, and its calls of our functions bind to their signatures. ``signature DOTTED.NAME``: the
  block is that function's signature (parameters, kinds and defaults).
- ``setup KIND=PATH ...``: files the example reads, made small in the working copy (`_SETUP`).
- ``exit N`` (default 0), ``expect TEXT`` (in stdout or stderr), ``expect-next`` (every line of
  the page's next block, ``(...)`` eliding), ``count REGEX N`` (output lines matching),
  ``jsonl PATH step=S KEY=VALUE ...`` (the record of step S has KEY rounded as VALUE is written),
  ``exists PATH``, ``timeout SECONDS`` (default 240).

``python tests/test_docs_examples.py`` lists every example with what the tier does with it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

try:
    from tests.dist_utils import REPO_ROOT, run_command
except ImportError:  # run as a script: python tests/test_docs_examples.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.dist_utils import REPO_ROOT, run_command

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

# slow too: a -m on the command line (the fast tier's -m "not slow") replaces pyproject's, which leaves docs out
pytestmark = [pytest.mark.docs, pytest.mark.slow]

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[^`\s]*)[^`]*$")
EXAMPLE_LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "toml": "toml", "python": "python",
                     "py": "python"}
NOT_EXAMPLES = {"text"}
ACTIONS = ("skip", "tested-by", "same-as", "file", "run", "append", "sub", "base", "ranks", "fragment", "signature",
           "setup", "exit", "expect", "expect-next", "count", "jsonl", "exists", "timeout")
AUTOMATIC = (("pip install", "skip installs"), ("huggingface-cli download", "skip a download"))
LINKED = ("train_configs", "scripts", "examples", "tests", "torchtitan_lite", "pyproject.toml")
LAUNCHER = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def pages() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


# --------------------------------------------------------------------------------------------
# Collecting: blocks, markers, examples
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    end: int  # of the closing fence
    lang: str
    text: str  # de-indented
    marker: str | None  # the docs-test comment's body
    marker_line: int | None
    next_text: str | None  # the next block of the page (expect-next)


@dataclasses.dataclass
class Directive:
    selector: str | None
    actions: list[tuple[str, list[str]]]  # (keyword, arguments); skip's reason is one argument


@dataclasses.dataclass
class Example:
    block: Block
    line: int
    command: str  # bash: the command as written; toml, python: the block
    segment: int  # 1-based place in an && chain (0: not a chain)
    actions: list[tuple[str, list[str]]]
    problem: str | None = None  # a collection error: the test fails with it

    @property
    def id(self) -> str:
        return f"{self.block.page}:{self.line}" + (f"#{self.segment}" if self.segment > 1 else "")

    def get(self, keyword: str) -> list[list[str]]:
        return [args for kw, args in self.actions if kw == keyword]

    @property
    def skip_reason(self) -> str | None:
        for kw, args in self.actions:
            if kw == "skip":
                return args[0]
            if kw == "tested-by":
                return f"tested by {args[0]}"
            if kw == "same-as":
                return f"the same as {args[0]}'s block, run there"
        return None


def _marker_before(lines: list[str], index: int) -> tuple[str | None, int | None]:
    """The docs-test comment among the HTML comments and blank lines just above line ``index``."""
    i = index - 1
    while i >= 0:
        stripped = lines[i].strip()
        if not stripped:
            i -= 1
            continue
        if not stripped.endswith("-->"):
            return None, None
        end = i
        while i >= 0 and "<!--" not in lines[i]:
            i -= 1
        if i < 0:
            return None, None
        comment = "\n".join(line.strip() for line in lines[i:end + 1])
        if comment.startswith("<!-- docs-test"):
            return comment[len("<!-- docs-test"):-len("-->")].strip().lstrip(":").strip(), i + 1
        i -= 1
    return None, None


def blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence = len(match["indent"]), match["fence"]
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence[0] * len(fence))
                                      and not lines[j].strip().strip(fence[0])):
            j += 1
        body = [line[indent:] if line[:indent].strip() == "" else line.lstrip() for line in lines[i + 1:j]]
        marker, marker_line = _marker_before(lines, i)
        found.append(Block(str(page.relative_to(REPO_ROOT)), i + 1, j + 1, match["lang"].lower(),
                           "\n".join(body) + "\n", marker, marker_line, None))
        i = j + 1
    for block, after in zip(found, found[1:], strict=False):
        block.next_text = after.text
    return found


def _split_outside_quotes(text: str, separator: str) -> list[str]:
    parts, quote, start, i = [], "", 0, 0
    while i < len(text):
        char = text[i]
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif text.startswith(separator, i):
            parts.append(text[start:i])
            start = i = i + len(separator)
            continue
        i += 1
    parts.append(text[start:])
    return parts


def parse_marker(body: str) -> list[Directive]:
    """``[SELECTOR =>] ACTION [ARGS]; ACTION ...`` per line."""
    directives = []
    for line in body.splitlines():
        line = line.strip()
        if not line:
            continue
        selector, _, actions_text = line.partition("=>") if "=>" in line else ("", "", line)
        actions = []
        for part in _split_outside_quotes(actions_text, ";"):
            keyword, _, rest = part.strip().partition(" ")
            if keyword not in ACTIONS:
                raise ValueError(f"unknown docs-test action {keyword!r} in {line!r}; expected one of {ACTIONS}")
            actions.append((keyword, [rest.strip()] if keyword == "skip" else shlex.split(rest)))
        directives.append(Directive(selector.strip() or None, actions))
    return directives


def _commands(text: str) -> list[tuple[int, str]]:
    """(line offset, command) of a bash block: continuations joined, comments dropped."""
    logical: list[tuple[int, str]] = []
    pending, start = "", 0
    for offset, raw in enumerate(text.splitlines()):
        line = _split_outside_quotes(raw, " #")[0] if not raw.lstrip().startswith("#") else ""
        if not pending:
            start = offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = " ".join((pending + line).split())
        pending = ""
        if command:
            logical.append((start, command))
    return logical


def _file_problem(block: Block, files: list[list[str]]) -> str | None:
    """Why a block marked ``file PATH`` is not that file word for word (None: it is)."""
    for args in files:
        if len(args) != 1:
            return f"file takes one repository path, got {args}"
        path = REPO_ROOT / args[0]
        if not path.is_file():
            return f"file {args[0]}: no such file in the repository"
        shipped, shown = path.read_text(encoding="utf-8").splitlines(), block.text.splitlines()
        if shipped != shown:
            line = next((n for n, (a, b) in enumerate(zip(shipped, shown, strict=False), 1) if a != b),
                        min(len(shipped), len(shown)) + 1)
            return f"the block is not {args[0]} word for word (they differ at its line {line}): change both"
    return None


def examples(block: Block) -> list[Example]:
    """The examples of a block (none for ``text``); a block that is not well marked gives one
    example that fails with the problem."""
    lang = EXAMPLE_LANGUAGES.get(block.lang)
    if block.lang in NOT_EXAMPLES:
        return []
    if lang is None:
        what = "no language" if not block.lang else f"language {block.lang!r}"
        return [Example(block, block.line, block.text, 0, [], problem=(
            f"a fenced block with {what}: mark output and diagrams ```text, examples ```bash, ```toml or "
            f"```python ({', '.join(sorted(EXAMPLE_LANGUAGES))})"))]
    try:
        directives = parse_marker(block.marker) if block.marker is not None else []
    except ValueError as exc:
        return [Example(block, block.marker_line or block.line, block.text, 0, [], problem=str(exc))]
    shown = _file_problem(block, [args for d in directives for kw, args in d.actions if kw == "file"])
    if shown:
        return [Example(block, block.marker_line or block.line, block.text, 0, [], problem=shown)]
    if lang != "bash":
        chosen = [d for d in directives if d.selector is None]
        actions = [a for d in chosen for a in d.actions]
        problem = None if actions else f"a {lang} example without a docs-test marker (run it or say why not)"
        return [Example(block, block.line, block.text, 0, actions, problem=problem)]
    found = []
    for offset, logical in _commands(block.text):
        segments = [s.strip() for s in _split_outside_quotes(logical, "&&")]
        for k, command in enumerate(segments, start=1):
            named = next((d for d in directives if d.selector is not None and d.selector in command), None)
            automatic = next((action for prefix, action in AUTOMATIC if command.startswith(prefix)), None)
            every = next((d for d in directives if d.selector is None), None)
            if named is not None:
                actions = named.actions
            elif automatic is not None:
                actions = parse_marker(automatic)[0].actions
            else:
                actions = every.actions if every is not None else []
            problem = None if actions else "a command without a docs-test directive (run it or say why not)"
            found.append(Example(block, block.line + 1 + offset, command, k if len(segments) > 1 else 0, actions,
                                 problem=problem))
    return found


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]


def all_examples() -> list[Example]:
    return [example for block in all_blocks() for example in examples(block)]


def orphan_markers() -> list[str]:
    """docs-test markers (outside fenced blocks) that no block follows."""
    found = all_blocks()
    used = {(b.page, b.marker_line) for b in found if b.marker_line}
    orphans = []
    for page in pages():
        name = str(page.relative_to(REPO_ROOT))
        inside = {n for b in found if b.page == name for n in range(b.line, b.end + 1)}
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip().startswith("<!-- docs-test") and n not in inside and (name, n) not in used:
                orphans.append(f"{name}:{n}")
    return orphans


# --------------------------------------------------------------------------------------------
# Files the examples read, made small
# --------------------------------------------------------------------------------------------

PAIRS = [
    {"prompt": [{"role": "user", "content": "Name a prime."}], "chosen": [{"role": "assistant", "content": "7"}],
     "rejected": [{"role": "assistant", "content": "8"}]},
    {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": [{"role": "assistant", "content": "Five, I believe."}]},
]


def _texts(count: int) -> list[str]:
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly mages".split()
    return [" ".join(words[(i * 7 + k) % len(words)] for k in range(40 + i % 30)) for i in range(count)]


def _hf_llama_chat(path: Path) -> None:
    """A tiny Llama saved by transformers, with a trained tokenizer and Llama 3's chat template:
    a Hugging Face folder as a downloaded Instruct model is (``scripts/make_tiny_hf_model.py``'s)."""
    from scripts.make_tiny_hf_model import make_tiny_hf_model

    make_tiny_hf_model(path, family="llama3")


def _hf_qwen3_chat(path: Path) -> None:
    """The same of Qwen3 (its special tokens and chat template, tied embeddings, per-head norms)."""
    from scripts.make_tiny_hf_model import make_tiny_hf_model

    make_tiny_hf_model(path, family="qwen3")


def _chat(path: Path) -> None:
    from tests.test_data_chat import CONVERSATIONS

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 4))


def _pairs(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in PAIRS * 8))


def _parquet(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": _texts(300)}), str(path / "part-0.parquet"), row_group_size=100)


def _tokens(path: Path) -> None:
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, np.random.default_rng(0).integers(0, 256, size=50_000, dtype=np.uint16))


def _c4(path: Path) -> None:
    """c4's layout: gzipped JSON-lines shards (and a validation one the pattern leaves out)."""
    import gzip

    path.mkdir(parents=True, exist_ok=True)
    for name in ("c4-train.00000-of-00002.json.gz", "c4-train.00001-of-00002.json.gz",
                 "c4-validation.00000-of-00001.json.gz"):
        with gzip.open(path / name, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t, "url": "https://example.com"}) + "\n" for t in _texts(20))


_SETUP: dict[str, Callable[[Path], None]] = {"hf-llama-chat": _hf_llama_chat, "hf-qwen3-chat": _hf_qwen3_chat,
                                             "chat": _chat, "pairs": _pairs, "parquet": _parquet, "tokens": _tokens,
                                             "c4": _c4}


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _toml(config: dict[str, Any]) -> str:
    """A TOML text of a job config (tables of values; arrays of tables)."""
    out: list[str] = []

    def table(name: str, values: dict[str, Any]) -> None:
        plain = {k: v for k, v in values.items() if not isinstance(v, dict)
                 and not (isinstance(v, list) and v and all(isinstance(x, dict) for x in v))}
        out.append(f"[{name}]")
        out.extend(f"{k} = {_toml_value(v)}" for k, v in plain.items())
        for k, v in values.items():
            if isinstance(v, dict):
                table(f"{name}.{k}", v)
            elif k not in plain:
                for item in v:
                    out.append(f"[[{name}.{k}]]")
                    out.extend(f"{ik} = {_toml_value(iv)}" for ik, iv in item.items())

    for name, values in config.items():
        table(name, values)
    return "\n".join(out) + "\n"


def _merged(base: dict[str, Any], fragment: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in fragment.items():
        merged[key] = _merged(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key),
                                                                                          dict) else value
    return merged


def _launch(ranks: list[list[str]]) -> list[str]:
    if not ranks:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks[0][0]}"]


def _command_line(example: Example, work: Path) -> str:
    """The shell command the example runs in the working copy."""
    lang = EXAMPLE_LANGUAGES[example.block.lang]
    appended = [arg for args in example.get("append") for arg in args]
    if lang == "bash":
        command = example.command
        for old, new in example.get("sub"):
            assert old in command, f"{example.id}: sub {old!r}: not in the command {command!r}"
            command = command.replace(old, new)
        return " ".join([command, *map(shlex.quote, appended)])
    name = re.sub(r"\W", "_", f"{Path(example.block.page).stem}_{example.line}")
    if lang == "toml":
        text = example.command
        if example.get("base"):
            base = tomllib.loads((REPO_ROOT / example.get("base")[0][0]).read_text(encoding="utf-8"))
            text = _toml(_merged(base, tomllib.loads(text)))
        (work / f"{name}.toml").write_text(text, encoding="utf-8")
        argv = [*_launch(example.get("ranks")), "-m", "torchtitan_lite.train", "--job.config_file", f"{name}.toml"]
    else:
        (work / f"{name}.py").write_text(example.command, encoding="utf-8")
        argv = [*_launch(example.get("ranks")), f"{name}.py"]
    return " ".join(map(shlex.quote, [*argv, *appended]))


def _working_copy(folder: Path) -> Path:
    work = folder / "work"
    work.mkdir()
    for name in LINKED:
        (work / name).symlink_to(REPO_ROOT / name)
    (work / "docs" / "benchmarks").mkdir(parents=True)
    (folder / "tmp").mkdir()
    return work


def _check_fragment(example: Example) -> None:
    """A python fragment parses, its imports run, and its calls of what it imported (or of
    dotted names under a package it names) bind to their signatures."""
    tree = ast.parse(example.command)
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=imports, type_ignores=[]), example.id, "exec"), namespace)

    def resolve(node: ast.expr) -> Any:
        if isinstance(node, ast.Name):
            if node.id in namespace:
                return namespace[node.id]
            return importlib.import_module(node.id) if node.id == "torchtitan_lite" else None
        if isinstance(node, ast.Attribute):
            owner = resolve(node.value)
            if owner is None:
                return None
            if not hasattr(owner, node.attr) and inspect.ismodule(owner):
                importlib.import_module(f"{owner.__name__}.{node.attr}")
            return getattr(owner, node.attr)
        return None

    checked = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args) \
                or any(k.arg is None for k in node.keywords):
            continue
        target = resolve(node.func)
        try:
            signature = inspect.signature(target) if target is not None else None
        except ValueError:  # no signature to check (a dict subclass, a builtin)
            signature = None
        if signature is None:
            continue
        try:
            signature.bind(*node.args, **{k.arg: k.value for k in node.keywords})
        except TypeError as exc:
            raise AssertionError(f"{example.id}: {ast.unparse(node.func)}(...) does not match its signature: {exc}") \
                from None
        checked += 1
    assert checked, f"{example.id}: the fragment calls nothing of ours that could be checked"


def _check_signature(example: Example, dotted: str) -> None:
    module, _, name = dotted.rpartition(".")
    real = inspect.signature(getattr(importlib.import_module(module), name))
    text = example.command.strip()
    assert text.startswith(f"{name}(") and text.endswith(")"), f"{example.id}: not a signature of {name}: {text!r}"

    def described(signature: inspect.Signature) -> list[tuple[str, str, str]]:
        return [(p.name, p.kind.name, "" if p.default is p.empty else repr(p.default))
                for p in signature.parameters.values()]

    namespace: dict[str, Any] = {}
    exec(f"def f{text[len(name):]}: pass", namespace)
    assert described(inspect.signature(namespace["f"])) == described(real), \
        f"{example.id}: the page's signature of {dotted} is not the code's: {real}"


def _expected_pieces(line: str) -> list[str]:
    return [piece.strip() for piece in re.split(r"\(\.\.\.\)|\.\.\.", line) if piece.strip()]


def _check_output(example: Example, work: Path, output: str) -> None:
    for (text,) in example.get("expect"):
        assert text in output, f"{example.id}: {text!r} not in the output"
    for _ in example.get("expect-next"):
        assert example.block.next_text, f"{example.id}: expect-next, but no block follows"
        for line in filter(None, (line.strip() for line in example.block.next_text.splitlines())):
            position = 0
            for piece in _expected_pieces(line):
                found = output.find(piece, position)
                assert found >= 0, f"{example.id}: the page's output line {line!r} is not what it printed ({piece!r})"
                position = found + len(piece)
    for pattern, count in example.get("count"):
        got = len(re.findall(pattern, output, re.M))
        assert got == int(count), f"{example.id}: {got} lines match {pattern!r}, the page says {count}"
    for path, step, *pairs in example.get("jsonl"):
        records = [json.loads(line) for line in (work / path).read_text().splitlines() if line.strip()]
        at = [r for r in records if r.get("step") == int(step.split("=")[1])]
        assert at, f"{example.id}: no record of {step} in {path}"
        for pair in pairs:
            key, _, quoted = pair.partition("=")
            decimals = len(quoted.partition(".")[2])
            assert f"{at[0][key]:.{decimals}f}" == quoted, \
                f"{example.id}: {path} {step}: {key} = {at[0][key]}, the page says {quoted}"
    for (path,) in example.get("exists"):
        assert (work / path).exists(), f"{example.id}: {path} was not written"


def run_example(example: Example, folder: Path) -> None:
    if example.problem:
        pytest.fail(f"{example.id}: {example.problem}", pytrace=False)
    for (path,) in example.get("tested-by"):
        assert example.block.page.split("/")[-1] in (REPO_ROOT / path).read_text(encoding="utf-8"), \
            f"{example.id}: {path} does not name {example.block.page}"
    for (page,) in example.get("same-as"):
        assert example.block.text in [b.text for b in blocks(REPO_ROOT / page)], \
            f"{example.id}: same-as {page}, but {page} has no block with this text"
    if example.skip_reason:
        pytest.skip(example.skip_reason)
    if example.get("fragment"):
        _check_fragment(example)
        return
    if example.get("signature"):
        _check_signature(example, example.get("signature")[0][0])
        return
    work = _working_copy(folder)
    for args in example.get("setup"):
        for pair in args:
            kind, _, path = pair.partition("=")
            _SETUP[kind](work / path)
    command = _command_line(example, work)
    keep = {k: v for k, v in os.environ.items() if k not in LAUNCHER and not k.startswith("PYTEST_")}
    # A short temporary folder of its own: multiprocessing's sockets live there, and a socket's
    # path has at most 107 characters (one under pytest's deep tmp_path did not fit).
    temporary = tempfile.mkdtemp(prefix="docs-")
    env = {**keep, "TMPDIR": temporary, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    timeout = float(example.get("timeout")[0][0]) if example.get("timeout") else 240.0
    try:
        result = run_command(["bash", "-c", command], cwd=work, timeout=timeout, env=env)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    output = result.stdout + result.stderr
    expected = int(example.get("exit")[0][0]) if example.get("exit") else 0
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    tail = "\n".join([*errors, "...", *output.splitlines()[-30:]])
    assert result.returncode == expected, \
        f"{example.id}: `{command}` exited {result.returncode}, expected {expected}:\n{tail}"
    _check_output(example, work, output)


EXAMPLES = all_examples()


def _by_page() -> dict[str, list[Example]]:
    grouped: dict[str, list[Example]] = {}
    for example in EXAMPLES:
        grouped.setdefault(example.block.page, []).append(example)
    return grouped


def _page_class(page: str, found: list[Example]) -> type:
    """One class per page, so that ``--dist loadscope`` spreads the pages over the workers."""

    @pytest.mark.parametrize("example", found, ids=[e.id for e in found])
    def test_example(self: Any, example: Example, tmp_path: Path) -> None:
        run_example(example, tmp_path)

    name = "TestPage_" + re.sub(r"\W", "_", Path(page).stem)
    return type(name, (), {"test_example": test_example, "__doc__": f"The examples of {page}."})


for _page, _found in _by_page().items():
    _cls = _page_class(_page, _found)
    globals()[_cls.__name__] = _cls


def test_every_marker_precedes_a_block() -> None:
    assert not orphan_markers(), f"docs-test markers with no fenced block after them: {orphan_markers()}"


def test_every_setup_kind_exists() -> None:
    kinds = {pair.partition("=")[0] for e in EXAMPLES for args in e.get("setup") for pair in args}
    assert kinds <= set(_SETUP), kinds - set(_SETUP)


def _inventory() -> str:
    runs = [e for e in EXAMPLES if not e.skip_reason and not e.problem]
    skipped = [e for e in EXAMPLES if e.skip_reason]
    kinds: dict[str, list[str]] = {}
    for e in skipped:
        kinds.setdefault(e.skip_reason.split(":")[0], []).append(e.id)
    lines = [f"{len(EXAMPLES)} examples in {len(all_blocks())} fenced blocks: {len(runs)} run, {len(skipped)} "
             f"skipped, {sum(bool(e.problem) for e in EXAMPLES)} not marked"]
    lines += [f"  run  {e.id}: {e.command.splitlines()[0][:90]}" for e in runs]
    lines += [f"  skip ({kind}, {len(ids)}): {', '.join(ids)}" for kind, ids in sorted(kinds.items())]
    lines += [f"  FAIL {e.id}: {e.problem}" for e in EXAMPLES if e.problem]
    return "\n".join(lines)


if __name__ == "__main__":
    print(_inventory())
