"""scripts/benchmark.py end to end on a small model: every part it measures is there and the
exact figures (collective counts, sharded state) agree with what the modes imply."""

from __future__ import annotations

import json
import sys

import pytest

from tests.dist_utils import run_command


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_benchmark_collectives_and_memory_on_a_tiny_model(tmp_path):
    # Memory and collectives share one 2-rank launch (world size 1: its first rank). The memory
    # part measures the three modes in fp32 without CPU offload, what the checks below compare.
    # (The auto part's trainer runs are what tests/test_memory_auto.py checks on 2 ranks.)
    out = tmp_path / "bench.json"
    result = run_command(
        [
            sys.executable,
            "scripts/benchmark.py",
            "--flavor",
            "tiny",
            "--seq_len",
            "32",
            "--local_batch_size",
            "2",
            "--world_sizes",
            "1,2",
            "--skip",
            "overhead,auto,ac,compile,metainit,startup",
            "--param_dtypes",
            "float32",
            "--cpu_offload",
            "off",
            "--steps",
            "1",
            "--json",
            str(out),
        ],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "collectives per step per rank" in result.stdout and "memory per rank" in result.stdout
    figures = json.loads(out.read_text())
    coll = figures["collectives"]
    units = coll["default"]["units"]
    assert units == 4  # tok_embeddings, 2 blocks, norm + output
    assert coll["always"]["all_gather"] == 2 * units  # forward and backward
    assert coll["default"]["all_gather"] == 2 * units - 1  # norm + output is not resharded
    assert coll["never"]["all_gather"] == units  # forward only
    assert all(c["reduce_scatter"] == units for c in coll.values())
    # Sharded state at 2 ranks is half of 1 rank's, for every configuration measured.
    one = {(c["mode"], c["param_dtype"], c["cpu_offload"]): c for c in figures["memory"]["1"][0]["configs"]}
    assert sorted(one) == sorted((mode, "float32", False) for mode in ("default", "always", "never"))
    assert len(figures["memory"]["1"]) == 1 and len(figures["memory"]["2"]) == 2
    for rank in figures["memory"]["2"]:
        assert len(rank["configs"]) == len(one)
        for c in rank["configs"]:
            ref = one[(c["mode"], c["param_dtype"], c["cpu_offload"])]
            for key in ("sharded_params", "sharded_grads", "optimizer_state"):
                assert abs(c["state"][key] - ref["state"][key] / 2) <= 0.05 * ref["state"][key] / 2, key
    # never keeps every unit's parameters unsharded from forward to backward: the most at the peak.
    peaks = {c["mode"]: c["peak"]["unsharded_params"] for c in figures["memory"]["2"][0]["configs"]
             if c["param_dtype"] == "float32" and not c["cpu_offload"]}
    assert peaks["never"] > peaks["default"]


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc; torchrun's workers, in sessions of their own, too)."""
    import os

    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:

    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
@pytest.mark.parametrize("script", ["benchmark", "compare_torchtitan"])
def test_a_benchmark_stopped_with_sigterm_leaves_no_process_or_folder(tmp_path, script):
    """SIGTERM to a benchmark while its torchrun launch runs (as ``timeout`` sends it): the
    launcher, its workers and the script's temporary folders are gone when the script has ended."""
    import os
    import signal
    import subprocess
    import time

    from tests.dist_utils import REPO_ROOT

    args = {"benchmark": ["--skip", "overhead,memory,collectives,auto,ac,compile,metainit"],  # start-up only
            "compare_torchtitan": ["--rows", "1B_compile_sac", "--only", "ours", "--param_dtype", "float32",
                                   "--corpus_mb", "0.2", "--steps", "3", "--skip_steps", "1"]}[script]
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, f"scripts/{script}.py", *args], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            seen |= _descendants(proc.pid)
            if len(seen) >= 2:  # the launcher and a worker
                break
            time.sleep(0.2)
        assert len(seen) >= 2 and proc.poll() is None, f"no torchrun launch seen: {proc.stderr.read()[-2000:]}"
        time.sleep(1.0)
        seen |= _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        left = sorted(pid for pid in seen if _alive(pid))
        assert code == 128 + signal.SIGTERM, (code, proc.stderr.read()[-2000:])
        assert not left, f"still running after the script ended: {left}"
        assert sorted(p.name for p in temp.iterdir()) == [], "left in TMPDIR"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in seen:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
