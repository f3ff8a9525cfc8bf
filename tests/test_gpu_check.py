"""scripts/gpu_check.sh, the one command a session with a lent GPU runs: checked without a GPU
through its --dry-run (every step's command line built, the scripts it calls present and
compiling) and its one-line refusals."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.sh"
STEPS = ("env", "gpu", "runner", "compare", "profile", "peak", "flex", "moe", "float8")


def _run(*args: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(out), "PYTHON": _python()})


def _python() -> str:
    import sys

    return sys.executable


def test_dry_run_builds_every_step_and_finds_its_scripts(tmp_path: Path) -> None:
    done = _run("--dry-run", out=tmp_path)
    lines = done.stdout.splitlines()
    # Every step in priority order, each with its limit and its command.
    steps = [line.split("]")[0].lstrip("[") for line in lines if line.startswith("[")]
    assert steps == list(STEPS), done.stdout
    assert "scripts/compare_torchtitan.py --rows 1B,1B_compile" in done.stdout
    assert "--baseline_dir" in done.stdout and "--generate_baselines" in done.stdout
    # Nothing the steps call is missing or broken; only the carried wheels may be absent here
    # (a clean clone has no .whl/: scripts/gpu_wheels.sh makes it).
    problems = [line for line in lines if line.startswith("  ")]
    assert all(line.startswith("  missing wheel: ") for line in problems), problems
    assert (done.returncode == 0) == (not problems), done.stdout
    assert not list(tmp_path.iterdir())  # a dry run writes nothing to $OUT


def test_bad_arguments_are_one_line(tmp_path: Path) -> None:
    for args, expected in ((["--only", "gpu,nope"], "--only: unknown step nope; steps: env gpu"),
                           (["--fast"], "unknown argument --fast; expected --dry-run")):
        done = _run(*args, out=tmp_path)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert expected in done.stderr
