"""The documentation a newcomer reads: a short README that links every page under ``docs/``,
links that resolve, and an architecture page whose file list is the package's."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.dist_utils import REPO_ROOT

DOCS = REPO_ROOT / "docs"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _pages() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_the_readme_is_short_and_links_every_page() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = {(REPO_ROOT / target).resolve() for target in LINK.findall(readme)}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"pages the README does not link: {missing}"


def test_every_relative_link_resolves() -> None:
    broken = [
        f"{page.relative_to(REPO_ROOT)}: {target}"
        for page in _pages()
        for target in LINK.findall(page.read_text())
        if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists()
    ]
    assert not broken, broken


def test_the_architecture_page_lists_every_file_of_the_package() -> None:
    text = (DOCS / "architecture.md").read_text()
    table = re.search(r"<!-- architecture-files:start -->(.*?)<!-- architecture-files:end -->", text, re.S)
    assert table, "docs/architecture.md lost its marked file table"
    listed = re.findall(r"^\| `([^`]+)` \|", table.group(1), re.M)
    package = REPO_ROOT / "torchtitan_lite"
    files = sorted(str(p.relative_to(package)) for p in package.rglob("*.py"))
    assert sorted(listed) == files, {
        "not listed": sorted(set(files) - set(listed)),
        "listed, not there": sorted(set(listed) - set(files)),
    }
    assert len(listed) == len(set(listed))


def test_the_configuration_page_names_every_section_in_order() -> None:
    from torchtitan_lite.config.schema import SECTIONS

    text = (DOCS / "configuration.md").read_text()
    listed = re.search(r"^Sections: (.*?); names follow", text, re.S | re.M)
    assert listed, "docs/configuration.md lost its 'Sections: ...; names follow' sentence"
    assert re.findall(r"`\[(\w+)\]`", listed.group(1)) == list(SECTIONS)


def test_every_example_of_the_docs_is_run_or_skipped_with_a_reason() -> None:
    """The docs tier's collection (tests/test_docs_examples.py, ``-m docs``), without running it:
    every fenced block has a language, and every example a docs-test marker or a reason."""
    from tests.test_docs_examples import all_examples, orphan_markers

    assert not [f"{e.id}: {e.problem}" for e in all_examples() if e.problem]
    assert not orphan_markers()


# The first call of each build step in parallelize (the function is the one source of the order).
_STEP_CALLS = {"pipeline split": "prune_to_stages", "LoRA": "apply", "float8": "apply", "tensor parallel": "split",
               "context parallel": "ContextParallel", "expert parallel": "shard_experts",
               "activation checkpointing": "apply_activation_checkpointing", "compile": "compile_blocks",
               "FSDP2": "apply_fsdp"}


def _build_calls() -> list[str]:
    """The calls of ``parallelize``'s body, in source order (attribute calls by their name)."""
    import ast

    source = (REPO_ROOT / "torchtitan_lite" / "distributed" / "parallelize.py").read_text()
    (function,) = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)
                   and node.name == "parallelize"]
    calls = [node for node in ast.walk(function) if isinstance(node, ast.Call)]
    calls.sort(key=lambda node: (node.lineno, node.col_offset))
    return [c.func.id if isinstance(c.func, ast.Name) else c.func.attr if isinstance(c.func, ast.Attribute) else ""
            for c in calls]


def test_the_build_order_is_written_once_and_the_pages_draw_it() -> None:
    """``BUILD_STEPS`` is the order ``parallelize`` takes its steps in (its calls, read from its
    source), and the marked diagrams of parallelism.md and architecture.md name those steps in
    that order."""
    from torchtitan_lite.distributed.parallelize import BUILD_STEPS

    calls = _build_calls()
    assert list(_STEP_CALLS) == list(BUILD_STEPS)
    positions, start = [], 0
    for step in BUILD_STEPS:
        start = calls.index(_STEP_CALLS[step], start)  # each after the one before
        positions.append(start)
    assert positions == sorted(positions)
    for page in ("parallelism.md", "architecture.md"):
        text = (DOCS / page).read_text()
        block = re.search(r"<!-- build-order:start -->\n```text\n(.*?)```\n<!-- build-order:end -->", text, re.S)
        assert block, f"{page} lost its marked build-order diagram"
        pieces = [part.strip().split("  ")[0].strip() for part in re.split(r"→|\n", block.group(1))]
        drawn = [name for name in pieces if name in BUILD_STEPS]  # (a step renamed or left out fails here)
        assert drawn == list(BUILD_STEPS), (page, drawn)


_PATH = re.compile(r"[A-Za-z0-9_./-]+\.(?:py|toml|md|json|sh|slurm|jsonl|yaml|jinja)")
_GENERATED = ("outputs/", "artifacts/", "data/", "assets/", "my_")  # made by the examples


def _package_classes() -> dict[str, list[type]]:
    """Every class the package defines, by its name (a bare ``Class.method`` of a page is checked
    against the classes of that name)."""
    import importlib
    import inspect

    found: dict[str, list[type]] = {}
    for path in sorted((REPO_ROOT / "torchtitan_lite").rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name:
                found.setdefault(cls.__name__, []).append(cls)
    return found


def _reference_problems() -> list[str]:
    """Every backticked ``section.key`` (ours, or TorchTitan's that we read), ``torchtitan_lite.x.y``
    name and repository path of the README and the pages that does not exist."""
    import importlib

    from torchtitan_lite.config.schema import SECTIONS, field_types
    from torchtitan_lite.config.torchtitan import lookup

    classes = _package_classes()
    problems = []
    for page in _pages():
        for token in re.findall(r"`([^`\n]+)`", page.read_text()):
            token = token.strip()
            key = re.fullmatch(r"([a-z_]+)\.([a-z_0-9]+)(?:\s*=.*)?", token)
            if key and key.group(1) in SECTIONS and not _PATH.fullmatch(token.split()[0]):
                name = f"{key.group(1)}.{key.group(2)}"
                if key.group(2) not in field_types(SECTIONS[key.group(1)]) and lookup(name) is None:
                    problems.append(f"{page.name}: key {name}")
            elif re.fullmatch(r"torchtitan_lite(\.[A-Za-z_]\w*)+", token):
                parts = token.split(".")
                for cut in range(len(parts), 0, -1):
                    try:
                        found: object = importlib.import_module(".".join(parts[:cut]))
                    except ImportError:
                        continue
                    if not all(hasattr(found := getattr(found, a, None), "__class__") and found is not None
                               for a in parts[cut:]):
                        problems.append(f"{page.name}: name {token}")
                    break
            elif (method := re.fullmatch(r"([A-Z]\w*)\.([a-z_]\w*)(?:\(.*\))?", token)) and method.group(1) in classes:
                if not any(hasattr(cls, method.group(2)) for cls in classes[method.group(1)]):
                    problems.append(f"{page.name}: name {method.group(1)}.{method.group(2)}")
            elif _PATH.fullmatch(token) and "/" in token and not token.startswith(("/", "~", ".", *_GENERATED)):
                if not any((REPO_ROOT / base / token).exists() for base in ("", "torchtitan_lite", "docs")):
                    problems.append(f"{page.name}: path {token}")
    return problems


def test_every_key_name_and_path_the_pages_name_exists(tmp_path, monkeypatch) -> None:
    """A renamed key, a moved module or a deleted script shows here, not in a reader's shell."""
    assert _reference_problems() == []
    probe = tmp_path / "probe.md"  # the check itself sees each kind of stale reference
    probe.write_text("`training.stepz` `training.steps` `training.batch_size` `torchtitan_lite.trainer.Nope` "
                     "`torchtitan_lite.trainer.Trainer` `scripts/nope.py` `scripts/benchmark.py` "
                     "`Trainer.forward_backward` `Trainer.train_step` `MicroBatchRunner.rows_logps(inputs, labels)` "
                     "`Path.exists`")
    monkeypatch.setattr(sys.modules[__name__], "_pages", lambda: [probe])
    assert _reference_problems() == ["probe.md: key training.stepz", "probe.md: name torchtitan_lite.trainer.Nope",
                                     "probe.md: path scripts/nope.py", "probe.md: name Trainer.forward_backward"]


# Narration of how the project got here: a page says what is true now, and a figure carries one
# "measured on <machine>, <date>", not a timeline of the runs before it.
_HISTORY = re.compile("|".join((
    r"\bbefore\)",                                          # "50 s (70 s before)"
    r"\b(?:same|next|that|previous) day\b|\bof the day\b|\blater that\b|\bthe day before\b",
    r"\bre-measured\b|\bhas since\b|\bsince that run\b|\bfirst session\b",
    r"\bbefore (?:this|that|the) (?:change|move|fix)\b",
    r"\bearlier (?:series|figures|runs)\b",
    r"^\|[^|]*\b(?:before|after)\b[^|]*\|",                 # a table row "| the suite before | ..."
)), re.I)
_DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
_MAX_DATES = 6  # distinct dates a page may carry; past it, its tables belong in docs/benchmarks/*.json


def _history_problems() -> list[str]:
    problems = []
    for page in _pages():
        lines = page.read_text().splitlines()
        problems += [f"{page.name}:{n}: {line.strip()[:80]}" for n, line in enumerate(lines, 1)
                     if _HISTORY.search(line) or len(set(_DATE.findall(line))) > 1]
        dates = sorted(set(_DATE.findall("\n".join(lines))))
        if len(dates) > _MAX_DATES:
            problems.append(f"{page.name}: {len(dates)} dates {dates}")
    return problems


def test_the_pages_tell_what_is_not_how_it_came_to_be(tmp_path, monkeypatch) -> None:
    """No dated timeline, before/after row or "re-measured" aside: state the current fact once, with
    the command that gives it or one "measured on" line (docs/testing.md's tiers, for one)."""
    assert _history_problems() == []
    probe = tmp_path / "probe.md"  # the check sees each kind of narration, and passes plain facts
    probe.write_text("| the fast tier | 601 | 50 s (70 s before) |\n"
                     "| with DPO's tests (same day, later) | 758 | 325 s |\n"
                     "| the suite after | 729 | 335 s |\n"
                     "timed without the counter (re-measured 2026-11-26)\n"
                     "Measured on 2026-11-28, then again on 2026-11-29.\n"
                     "Measured on 2026-11-28 on a 2-core machine: 340 s. Checkpoints saved before it load.\n"
                     + "".join(f"(measured 2026-11-{day})\n" for day in range(20, 27)))
    monkeypatch.setattr(sys.modules[__name__], "_pages", lambda: [probe])
    found = _history_problems()
    assert [problem.split(": ")[0] for problem in found] == [f"probe.md:{n}" for n in range(1, 6)] + ["probe.md"]
    assert found[-1].startswith("probe.md: 9 dates")
