"""scripts/benchmark.py end to end on a small model: every part it measures is there and the
exact figures (collective counts, sharded state) agree with what the modes imply."""

from __future__ import annotations

import json
import sys

from tests.dist_utils import run_command


def test_benchmark_collectives_and_memory_on_a_tiny_model(tmp_path):
    out = tmp_path / "bench.json"
    result = run_command([sys.executable, "scripts/benchmark.py", "--flavor", "tiny", "--seq_len", "32",
                          "--local_batch_size", "2", "--world_sizes", "1,2", "--skip", "overhead,metainit,startup",
                          "--json", str(out)], timeout=300)
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
    for rank in figures["memory"]["2"]:
        for c in rank["configs"]:
            ref = one[(c["mode"], c["param_dtype"], c["cpu_offload"])]
            for key in ("sharded_params", "sharded_grads", "optimizer_state"):
                assert abs(c["state"][key] - ref["state"][key] / 2) <= 0.05 * ref["state"][key] / 2, key
    # never keeps every unit's parameters unsharded from forward to backward: the most at the peak.
    peaks = {c["mode"]: c["peak"]["unsharded_params"] for c in figures["memory"]["2"][0]["configs"]
             if c["param_dtype"] == "float32" and not c["cpu_offload"]}
    assert peaks["never"] > peaks["default"]
    # auto: the loose budget keeps every unit gathered (never's all-gathers), the tight one
    # reshards some; both stay within their budget, measured.
    auto = figures["auto"]
    assert auto["auto loose"]["all_gather"] == units and auto["auto loose"]["resharded"] == []
    assert units < auto["auto tight"]["all_gather"] < 2 * units and auto["auto tight"]["resharded"]
    for label in ("auto loose", "auto tight"):
        assert auto[label]["measured_peak"] <= auto[label]["budget_gib"] * 2**30, label
    assert auto["never"]["measured_peak"] > auto["auto tight"]["budget_gib"] * 2**30
