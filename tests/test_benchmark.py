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
