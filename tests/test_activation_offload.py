"""Activation offload and tiled feed-forwards (docs/long-context.md): training is what it is
without them, what moves to host memory is what the checkpointed blocks keep, and the device
memory they save is the one the estimate says."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_ARGS
from tests.dist_utils import captured_log, run_distributed, train_history

OFFLOAD = ["--activation_checkpoint.offload"]
TILES = ["--activation_checkpoint.mlp_tiles", "4"]
FULL = ["--activation_checkpoint.mode", "full"]
TILED_LOSS = ["--training.tiled_loss"]


def _argv(dump: Path, *extra: str, steps: int = 10, seq_len: int = 256) -> list[str]:
    return [*TINY_ARGS, "--training.steps", str(steps), "--training.seq_len", str(seq_len),
            "--training.global_batch_size", "4",
            "--metrics.no-enable_tensorboard", "--validation.no-enable", "--job.dump_folder", str(dump), *extra]


def _same(runs: dict[str, list[dict[str, Any]]], reference: list[dict[str, Any]], tolerance: float = 1e-6) -> None:
    for name, history in runs.items():
        assert len(history) == len(reference), name
        for ours, theirs in zip(history, reference, strict=True):
            for key in ("loss", "grad_norm"):
                assert abs(ours[key] - theirs[key]) <= tolerance * max(1.0, abs(theirs[key])), (name, key, ours,
                                                                                                 theirs)


@pytest.mark.slow
@pytest.mark.parametrize("mask", ["causal", pytest.param("block_causal", marks=pytest.mark.scenario)])
def test_offload_and_tiles_train_as_without_and_move_the_blocks_inputs(tmp_path: Path, mask: str) -> None:
    """One process, fp32, the tiny Llama (2 blocks of width 64), 10 steps of 2 × 256 tokens of
    packed documents (block-causal attention): full checkpointing with the blocks' inputs
    offloaded, with the feed-forwards in 4 tiles too, tiles chosen from the sequence without
    checkpointing, selective checkpointing with offload, and all of it with the tiled loss (the
    output projection and the loss over row tiles) give the plain run's losses and gradient
    norms within 1e-6; each step moves exactly the blocks' inputs to host memory (2 blocks × 2 ×
    256 × 64 fp32 values), nothing else (the RoPE table and the mask are shared by the blocks and
    stay). Causal (the default selection): the selective and the all-of-it cases."""
    common = ["--model.attention_mask", mask]
    plain = train_history(_argv(tmp_path / "plain", *common))
    cases = {
        "full, offload": [*FULL, *OFFLOAD],
        "full, offload, 4 tiles": [*FULL, *OFFLOAD, *TILES],
        "tiles from the sequence": ["--activation_checkpoint.mlp_tiles", "0"],
        "selective op, offload": ["--activation_checkpoint.mode", "selective", *OFFLOAD],
        "full, offload, 4 tiles, tiled loss": [*FULL, *OFFLOAD, *TILES, *TILED_LOSS],
    }
    if mask == "causal":  # (the default selection's share; the scenario tier runs every case on packed rows)
        cases = {name: cases[name] for name in ("selective op, offload", "full, offload, 4 tiles, tiled loss")}
    with captured_log() as lines:
        runs = {name: train_history(_argv(tmp_path / name.replace(" ", "_"), *common, *extra))
                for name, extra in cases.items()}
    _same(runs, plain)
    # the start-up log says what each job keeps out of device memory
    assert "activation checkpointing: full; checkpointed blocks' inputs offloaded to host memory; feed-forwards in " \
           "4 tiles; the tiled loss (no whole logits); compile: off" in lines, lines
    inputs = 2 * 2 * 256 * 64 * 4 / 2**30
    for name, history in runs.items():
        if "offload" in name:
            assert all(r["activation_offload_gib"] == pytest.approx(inputs, rel=1e-9) for r in history), name
        else:
            assert "activation_offload_gib" not in history[0]


_LAYOUTS = {  # name: (ranks, arguments of the model and layout, for the plain run too; the layout's)
    "qwen3_moe": (1, ["--model.name", "qwen3_moe"], []),
    "deepseek_v3": (1, ["--model.name", "deepseek_v3"], []),
    "dp2 x cp2 allgather, packed": (4, ["--model.attention_mask", "block_causal"],
                                    ["--parallelism.context_parallel_degree", "2"]),
    "dp2 x cp2 ulysses": (4, [], ["--parallelism.context_parallel_degree", "2",
                                  "--parallelism.context_parallel_method", "ulysses"]),
    "FSDP CPU offload": (2, [], ["--training.enable_cpu_offload"]),
    "tensor parallel 2 (offload only)": (2, [], ["--parallelism.tensor_parallel_degree", "2"]),
    "qwen3_moe expert parallel 2": (2, ["--model.name", "qwen3_moe"], ["--parallelism.expert_parallel_degree", "2"]),
    "pipeline 2 (no tiled loss)": (2, [], ["--parallelism.pipeline_parallel_degree", "2"]),
}


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_offload_and_tiles_train_as_without_on_every_layout(tmp_path: Path, layout: str) -> None:
    """10 steps, fp32: full checkpointing with the blocks' inputs offloaded, the dense
    feed-forwards in 4 tiles and the tiled loss (tensor parallel: offload only; pipeline parallel:
    no tiled loss) give the plain run's losses and gradient norms within 1e-6, for Qwen3-MoE and
    DeepSeek-V3 (their mixtures of experts untiled) at one process and Qwen3-MoE at expert
    parallel 2, data parallel 2 × context parallel 2 (all-gather on packed documents, and
    Ulysses), FSDP with CPU offload, tensor parallel 2 (each rank's share of the sequence moved,
    rebuilt as the same DTensor) and pipeline parallel 2 (1F1B)."""
    ranks, model, layout_args = _LAYOUTS[layout]
    plain = train_history(_argv(tmp_path / "plain", *model, "--training.local_batch_size", "4"))
    ours = [*FULL, *OFFLOAD, *([] if "tensor" in layout else TILES),
            *([] if "tensor" in layout or "pipeline" in layout else TILED_LOSS)]
    dp = 2 if layout.startswith("dp2") else (1 if "tensor" in layout or "pipeline" in layout else ranks)
    argv = _argv(tmp_path / "ours", *model, *layout_args, *ours, "--training.local_batch_size", str(4 // dp))
    history = (train_history(argv) if ranks == 1 else run_distributed(train_history, ranks, argv)[0])
    _same({layout: history}, plain)
    assert history[0]["activation_offload_gib"] > 0


@pytest.mark.scenario  # (two compiled runs; left out of the default selection)
@pytest.mark.slow
def test_compiled_blocks_offload_their_inputs_and_train_as_without(tmp_path: Path) -> None:
    """Compiled blocks (inductor) with full checkpointing: with the blocks' inputs offloaded and
    the feed-forwards in 4 tiles, 4 steps give the losses and gradient norms of the compiled run
    without them within 1e-6, and each step moves exactly the blocks' inputs (the hooks are set
    around the compiled call; what the compiled graph saves goes through them)."""
    compiled = ["--compile.enable", *FULL]
    plain = train_history(_argv(tmp_path / "plain", *compiled, steps=4))
    ours = train_history(_argv(tmp_path / "ours", *compiled, *OFFLOAD, *TILES, steps=4))
    _same({"compiled, offload, tiles": ours}, plain)
    inputs = 2 * 2 * 256 * 64 * 4 / 2**30
    assert all(r["activation_offload_gib"] == pytest.approx(inputs, rel=1e-9) for r in ours)


def _step_memory(argv: list[str]) -> dict[str, float]:
    """The allocator's peak of one steady-state step (device side: the host buffers are numpy's,
    which it does not count) and what the step held in host memory."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.memory.measure import trainer_step_peak
    from torchtitan_lite.trainer import Trainer

    peak, trainer = trainer_step_peak(functools.partial(Trainer, load_job_config(argv)))
    offload = trainer.activation_offload
    trainer.metrics.close()
    return {"peak": peak, "host": 0 if offload is None else offload.host_peak}


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_device_memory_falls_as_estimated_and_the_host_holds_the_rest(tmp_path: Path) -> None:
    """2 ranks, fp32, the debug model's shape (6 blocks of width 256, feed-forward 768), one sequence
    of 4,096 tokens a rank, full checkpointing: the allocator's peak of a step with the blocks'
    inputs offloaded, and with the feed-forwards in tiles too (16, from the sequence), each within
    -3% / +10% of the estimate and each lower than the one before; the host memory the step used
    equals the estimate's (6 × 4,096 × 256 × 4 bytes). With a vocabulary padded to 16,384, the
    tiled loss (no whole logits, nor their gradient) takes a quarter or more off the peak, within
    the same bounds of its estimate."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.job import plan_job
    from torchtitan_lite.memory.estimate import estimate_memory, job_estimate_shape

    shape = ["--model.flavor", "debugmodel", "--training.local_batch_size", "1", "--training.global_batch_size", "2",
             *FULL]
    tiles = [*OFFLOAD, "--activation_checkpoint.mlp_tiles", "0"]
    wide = ["--model.vocab_size", "16384"]  # (logits of 4,096 × 16,384: the tiled loss's part)
    jobs = {"full": [], "offload": OFFLOAD, "offload, tiles": tiles, "offload, tiles, 16K vocabulary": [*tiles, *wide],
            "offload, tiles, 16K vocabulary, tiled loss": [*tiles, *wide, *TILED_LOSS]}
    measured: dict[str, dict[str, float]] = {}
    estimated = {}
    for name, extra in jobs.items():
        argv = _argv(tmp_path / name.replace(", ", "_"), *shape, *extra, steps=2, seq_len=4096)
        plan = plan_job(load_job_config(argv), world_size=2)
        estimated[name] = estimate_memory(plan.spec, plan.model_args, job_estimate_shape(plan),
                                          reshard_after_forward_mode=plan.shape.reshard_after_forward_mode)
        measured[name] = max(run_distributed(_step_memory, 2, argv), key=lambda r: r["peak"])
    for name in jobs:
        error = (estimated[name].device_peak - measured[name]["peak"]) / measured[name]["peak"]
        print(f"{name}: measured {measured[name]['peak'] / 2**20:.2f} MiB, estimated "
              f"{estimated[name].device_peak / 2**20:.2f} MiB ({error:+.2%}); host {measured[name]['host'] / 2**20:.2f}"
              f" MiB, estimated {estimated[name].activation_host / 2**20:.2f} MiB")
        assert -0.03 <= error <= 0.10, (name, error)
        assert measured[name]["host"] == estimated[name].activation_host
    assert measured["full"]["peak"] > measured["offload"]["peak"] > measured["offload, tiles"]["peak"]
    wide_peaks = [measured[name]["peak"] for name in ("offload, tiles, 16K vocabulary",
                                                      "offload, tiles, 16K vocabulary, tiled loss")]
    assert wide_peaks[1] < 0.75 * wide_peaks[0], wide_peaks
    assert measured["offload"]["host"] == 6 * 4096 * 256 * 4


@pytest.mark.slow
def test_dpo_with_the_tiled_loss_equals_without(tmp_path: Path) -> None:
    """One process, fp32, DPO on the conversational pairs (4 steps of 4 pairs, a frozen copy): with
    the tiled loss (each sequence's log-probabilities from the output layer's per-label losses,
    the reference's too) the losses, margins and gradient norms are the untiled run's within 1e-6."""
    import json

    from tests.test_dpo import CONVERSATIONAL
    from tests.test_dpo_axes import _argv as dpo_argv
    from tests.test_dpo_axes import _dense_folder

    folder = _dense_folder(tmp_path)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONAL * 4))
    common = ["--training.steps", "4", "--training.global_batch_size", "4", "--training.local_batch_size", "4"]
    plain = train_history(dpo_argv(folder, pairs, tmp_path / "plain", *common, family="llama3"))
    tiled = train_history(dpo_argv(folder, pairs, tmp_path / "tiled", *common, *TILED_LOSS, family="llama3"))
    assert plain[-1]["dpo/margin"] != 0
    for ours, theirs in zip(tiled, plain, strict=True):
        for key in ("loss", "grad_norm", "dpo/margin", "dpo/logps_chosen"):
            assert abs(ours[key] - theirs[key]) <= 1e-6 * max(1.0, abs(theirs[key])), (key, ours, theirs)


@pytest.mark.parametrize("extra, message", [
    (OFFLOAD, "error: activation_checkpoint.offload: invalid value True; it moves what checkpointed blocks keep to "
              "host memory, and none are checkpointed"),
    (["--activation_checkpoint.mlp_tiles", "-1"], "error: activation_checkpoint.mlp_tiles: invalid value -1; "
                                                  "expected 1 (off), 0"),
    (["--activation_checkpoint.mlp_tiles", "4", "--parallelism.tensor_parallel_degree", "2"],
     "error: activation_checkpoint.mlp_tiles: invalid value 4; tensor parallel (2) splits the feed-forward"),
    ([*TILED_LOSS, "--parallelism.tensor_parallel_degree", "2"], "error: training.tiled_loss: invalid value True; "
                                                                "tensor parallel (2) splits the output layer"),
    ([*TILED_LOSS, "--parallelism.pipeline_parallel_degree", "2"], "error: training.tiled_loss: invalid value True; "
                                                                  "pipeline parallel (2) computes the loss"),
])
def test_what_they_cannot_run_with_is_one_line(tmp_path: Path, extra: list[str], message: str) -> None:
    """Offload without checkpointing, tiles under tensor parallel, the tiled
    loss under tensor or pipeline parallel: one line each, from the plan (before any process)."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.errors import ConfigError
    from torchtitan_lite.job import plan_job

    with pytest.raises(ConfigError) as info:
        plan_job(load_job_config(_argv(tmp_path, *extra)), world_size=2)
    assert f"error: {info.value}".startswith(message) and "\n" not in str(info.value), str(info.value)
