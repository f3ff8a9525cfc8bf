"""The CI definitions (.github/workflows/*.yaml, .ci/run) against what they promise: every
workflow parses and has the shape GitHub Actions needs; the CPU workflow's tests job runs the
README's test command verbatim, as .ci/run does; every call of the integration-test runner
passes options its own parser accepts; and the GPU workflow skips itself, with a notice saying
how to make them, while there are no CUDA baselines."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKFLOW_DIR = REPO_ROOT / ".github" / "workflows"
WORKFLOWS = sorted([*WORKFLOW_DIR.glob("*.yaml"), *WORKFLOW_DIR.glob("*.yml")])
RUNNER_SCRIPT = "scripts/integration_tests.py"
#: Workflows that must run on every push and pull request.
ON_PUSH_AND_PR = ("ci.yaml", "integration_tests.yaml")
#: The first words of the README's test command (its install step and the dev extra).
TEST_COMMAND_START = 'pip install torch==2.13.0 && pip install -e ".[dev]"'
CPU_WHEEL_INDEX = "https://download.pytorch.org/whl/cpu"


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _load(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict), f"{path.name}: not a mapping at the top level"
    return doc


def _triggers(doc: dict[str, Any]) -> dict[str, Any]:
    """The ``on:`` triggers as a dict (PyYAML reads the bare key ``on`` as the boolean True)."""
    on = doc.get("on", doc.get(True))
    if isinstance(on, str):
        return {on: None}
    if isinstance(on, list):
        return dict.fromkeys(on)
    assert isinstance(on, dict), f"'on' is {on!r}"
    return on


def _readme_section(title_start: str, page: str = "README.md") -> str:
    text = (REPO_ROOT / page).read_text()
    match = re.search(rf"^## {re.escape(title_start)}.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"{page} has no section '## {title_start}...'"
    return match.group(1)


def _code_lines(section: str) -> list[str]:
    """The lines of a section's fenced code blocks, stripped."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", section, re.M | re.S)
    return [line.strip() for block in blocks for line in block.splitlines()]


def readme_test_command() -> str:
    lines = [line for line in _code_lines(_readme_section("Set-up")) if line.startswith(TEST_COMMAND_START)]
    assert len(lines) == 1, (
        f"README.md's Set-up section: expected one line starting {TEST_COMMAND_START!r}, got {lines}"
    )
    return lines[0]


def readme_generate_baselines_command() -> str:
    lines = [line.split("#")[0].strip() for line in _code_lines(_readme_section("Integration tests", "docs/testing.md"))
             if "--generate_baselines" in line]
    assert len(lines) == 1, (
        f"docs/testing.md's Integration tests section: expected one --generate_baselines line, got {lines}"
    )
    return lines[0]


def shell_lines(script: str) -> list[str]:
    """A ``run:`` script's commands, one per line (backslash continuations joined), stripped."""
    return [line.strip() for line in script.replace("\\\n", " ").splitlines() if line.strip()]


def run_steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [step for step in job["steps"] if "run" in step]


def runner_calls(script: str) -> list[list[str]]:
    """The argument lists of every ``scripts/integration_tests.py`` invocation in a shell script."""
    calls = []
    for line in shell_lines(script):
        if RUNNER_SCRIPT not in line:
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        for i, token in enumerate(tokens):
            if token.endswith(RUNNER_SCRIPT):
                args = []
                for arg in tokens[i + 1:]:
                    if arg and set(arg) <= set("&|;()<>"):
                        break
                    args.append(arg)
                calls.append(args)
    return calls


def _load_runner():
    spec = importlib.util.spec_from_file_location("integration_tests_for_ci_check", REPO_ROOT / RUNNER_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def parse_runner_args(args: list[str], where: str):
    """The runner's own argparse result for ``args``; a test failure naming ``where`` if it refuses them."""
    parser = _load_runner().build_parser()
    try:
        return parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: {RUNNER_SCRIPT} refuses the options {args}")


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _runs_on(job: dict[str, Any]) -> list[str]:
    runs_on = job["runs-on"]
    return [runs_on] if isinstance(runs_on, str) else list(runs_on)


# --------------------------------------------------------------------------------------------
# Every workflow
# --------------------------------------------------------------------------------------------


def test_workflows_exist() -> None:
    assert {p.name for p in WORKFLOWS} >= set(ON_PUSH_AND_PR)


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_structure(path: Path) -> None:
    doc = _load(path)
    assert doc.get("name"), f"{path.name}: no name"
    triggers = _triggers(doc)
    assert triggers, f"{path.name}: no triggers"
    if path.name in ON_PUSH_AND_PR:
        assert {"push", "pull_request"} <= set(triggers), f"{path.name}: triggers {sorted(triggers)}"
    jobs = doc.get("jobs")
    assert isinstance(jobs, dict) and jobs, f"{path.name}: no jobs"
    for name, job in jobs.items():
        where = f"{path.name}: job {name}"
        assert job.get("runs-on"), f"{where}: no runs-on"
        timeout = job.get("timeout-minutes")
        assert isinstance(timeout, int) and 0 < timeout <= 360, f"{where}: timeout-minutes {timeout!r}"
        steps = job.get("steps")
        assert isinstance(steps, list) and steps, f"{where}: no steps"
        ids = []
        for i, step in enumerate(steps, 1):
            assert isinstance(step, dict), f"{where}, step {i}: {step!r}"
            assert ("run" in step) != ("uses" in step), f"{where}, step {i}: needs exactly one of run and uses"
            if "run" in step:
                assert isinstance(step["run"], str) and step["run"].strip(), f"{where}, step {i}: empty run"
            else:
                assert re.fullmatch(r"[\w.-]+/[\w./-]+@[\w.-]+", step["uses"]), \
                    f"{where}, step {i}: uses {step['uses']!r} is not owner/repo@version"
                if step["uses"].startswith("actions/setup-python@"):
                    version = step.get("with", {}).get("python-version")
                    assert isinstance(version, str), \
                        f"{where}, step {i}: python-version {version!r} must be a quoted string (3.10 reads as 3.1)"
            ids.append(step.get("id"))
        # Every steps.<id> and needs.<job>.outputs.<name> reference names something that exists.
        needs = job.get("needs", [])
        needs = [needs] if isinstance(needs, str) else needs
        assert set(needs) <= set(jobs), f"{where}: needs {needs}, jobs are {sorted(jobs)}"
        for text in _strings(job):
            for step_id in re.findall(r"\bsteps\.([\w-]+)\.", text):
                assert step_id in ids, f"{where}: refers to step {step_id!r}; its step ids are {ids}"
            for other, output in re.findall(r"\bneeds\.([\w-]+)\.outputs\.([\w-]+)", text):
                assert other in needs, f"{where}: refers to job {other!r} outside its needs {needs}"
                assert output in jobs[other].get("outputs", {}), f"{where}: job {other!r} has no output {output!r}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_runner_calls_use_options_the_runner_accepts(path: Path) -> None:
    """Every call of scripts/integration_tests.py parses with the runner's own parser, and a kept
    --output_dir is what the job uploads when it fails."""
    for name, job in _load(path)["jobs"].items():
        uploads = [step for step in job["steps"] if step.get("uses", "").startswith("actions/upload-artifact@")]
        for step in run_steps(job):
            for args in runner_calls(step["run"]):
                args_ns = parse_runner_args(args, f"{path.name}: job {name}")
                if args_ns.output_dir is not None:
                    assert any(str(u["with"]["path"]) == str(args_ns.output_dir) and "failure()" in str(u.get("if"))
                               for u in uploads), \
                        f"{path.name}: job {name} keeps {args_ns.output_dir} but does not upload it on failure"


def test_readme_generate_baselines_command_parses() -> None:
    command = readme_generate_baselines_command()
    (args,) = runner_calls(command)
    assert parse_runner_args(args, "README.md").generate_baselines


# --------------------------------------------------------------------------------------------
# The CPU workflow and .ci/run
# --------------------------------------------------------------------------------------------


def test_tests_job_runs_the_readme_test_command_and_ruff() -> None:
    doc = _load(WORKFLOW_DIR / "ci.yaml")
    job = doc["jobs"]["tests"]
    assert not any("self-hosted" in label for label in _runs_on(job))
    command = readme_test_command()
    steps = [step for step in run_steps(job) if command in shell_lines(step["run"])]
    assert len(steps) == 1, f"ci.yaml's tests job does not run the README's test command verbatim: {command}"
    # torch==2.13.0 must come from the CPU wheel index, through pip's environment, not the command.
    env = {**doc.get("env", {}), **job.get("env", {}), **steps[0].get("env", {})}
    indexes = f"{env.get('PIP_INDEX_URL', '')} {env.get('PIP_EXTRA_INDEX_URL', '')}".split()
    assert CPU_WHEEL_INDEX in indexes, f"the test command's pip environment has no {CPU_WHEEL_INDEX}: {env}"
    assert any(line.startswith("ruff check") for step in run_steps(job) for line in shell_lines(step["run"]))


def test_ci_run_runs_the_readme_test_command() -> None:
    command = readme_test_command()
    assert command in shell_lines((REPO_ROOT / ".ci" / "run").read_text())


@pytest.mark.parametrize("marker", ["scenario", "docs"])
def test_both_ci_entry_points_run_the_tiers_the_suite_leaves_out(marker: str) -> None:
    """The suite (the README's command) deselects ``scenario`` and ``docs`` tests (pyproject's
    addopts); .ci/run and the workflow's tests job run them after it, so CI still runs every test."""
    import tomllib

    addopts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert f"not {marker}" in addopts
    tier = f"python -m pytest -q -n 2 --dist loadscope -m {marker}"
    ci_run = shell_lines((REPO_ROOT / ".ci" / "run").read_text())
    assert tier in ci_run and ci_run.index(tier) > ci_run.index(readme_test_command())
    job = _load(WORKFLOW_DIR / "ci.yaml")["jobs"]["tests"]
    assert any(tier in shell_lines(step["run"]) for step in run_steps(job))


def test_integration_job_runs_the_runner_on_cpu_processes() -> None:
    job = _load(WORKFLOW_DIR / "ci.yaml")["jobs"]["integration"]
    assert not any("self-hosted" in label for label in _runs_on(job))
    calls = [args for step in run_steps(job) for args in runner_calls(step["run"])]
    assert len(calls) == 1, calls
    args = parse_runner_args(calls[0], "ci.yaml: job integration")
    assert args.device in ("auto", "cpu") and not args.generate_baselines
    assert args.ngpu is not None and args.ngpu >= 1


# --------------------------------------------------------------------------------------------
# The GPU workflow skips itself without CUDA baselines
# --------------------------------------------------------------------------------------------


def _gpu_job_and_check_step() -> tuple[str, dict[str, Any], str]:
    """The GPU job's ``if`` and the baseline check it depends on: (the output value that lets the
    GPU job run, the check step, the step's output name)."""
    jobs = _load(WORKFLOW_DIR / "integration_tests.yaml")["jobs"]
    (gpu_job,) = [job for job in jobs.values() if "self-hosted" in _runs_on(job)]
    condition = re.fullmatch(r"\s*(?:\$\{\{)?\s*needs\.([\w-]+)\.outputs\.([\w-]+)\s*==\s*'(\w+)'\s*(?:\}\})?\s*",
                             str(gpu_job.get("if", "")))
    assert condition, f"the GPU job's if: {gpu_job.get('if')!r} does not test a needs.<job>.outputs.<name>"
    check_job, output, run_value = condition.groups()
    assert "self-hosted" not in _runs_on(jobs[check_job]), "the baseline check must not wait for a GPU runner"
    step_ref = re.fullmatch(r"\$\{\{\s*steps\.([\w-]+)\.outputs\.([\w-]+)\s*\}\}", jobs[check_job]["outputs"][output])
    assert step_ref, jobs[check_job]["outputs"][output]
    (step,) = [s for s in jobs[check_job]["steps"] if s.get("id") == step_ref.group(1)]
    return run_value, step, step_ref.group(2)


@pytest.mark.parametrize("with_baselines", [False, True], ids=["no_cuda_baselines", "cuda_baselines"])
def test_gpu_workflow_skips_without_cuda_baselines(tmp_path: Path, with_baselines: bool) -> None:
    """The check step, run as GitHub runs it (bash -e) in a checkout with or without a
    cuda_*.jsonl: the GPU job runs only with one; without, a ::notice:: gives the README's command."""
    run_value, step, output = _gpu_job_and_check_step()
    assert step.get("shell", "bash") == "bash"
    losses = tmp_path / "tests" / "assets" / "losses"
    losses.mkdir(parents=True)
    (losses / "cpu_default_reshard.jsonl").write_text("{}\n")
    if with_baselines:
        (losses / "cuda_default_reshard.jsonl").write_text("{}\n")
    script = tmp_path / "step.sh"
    script.write_text(step["run"])
    github_output, summary = tmp_path / "github_output", tmp_path / "summary"
    result = subprocess.run(
        ["bash", "-e", str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "GITHUB_OUTPUT": str(github_output), "GITHUB_STEP_SUMMARY": str(summary)},
    )
    assert result.returncode == 0, result.stderr
    outputs = dict(line.split("=", 1) for line in github_output.read_text().splitlines())
    assert (outputs[output] == run_value) == with_baselines, outputs
    notices = [line for line in result.stdout.splitlines() if line.startswith("::notice")]
    if with_baselines:
        assert not notices, result.stdout
    else:
        assert len(notices) == 1 and readme_generate_baselines_command() in notices[0], result.stdout


def test_ci_run_runs_ruff_with_the_line_length_rule() -> None:
    """.ci/run checks the code as the workflow does: ruff, whose selected rules include E501."""
    import tomllib

    assert any(line.startswith("ruff check") for line in shell_lines((REPO_ROOT / ".ci" / "run").read_text()))
    lint = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert "E" in lint["lint"]["select"] and lint["line-length"] == 120
