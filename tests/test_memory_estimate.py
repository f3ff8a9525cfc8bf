"""Memory estimates (fake tensors, fake process group) against an independent measurement.

The measured figure is the allocator's own: :class:`~torchtitan_lite.memory.measure.AllocatorPeak`
(the CPU allocator's running total of live bytes over every thread, reported to torch.profiler)
over one real ``Trainer.train_step`` (loss, backward, clipping, optimizer step) after a warm-up
step, on gloo ranks. The estimate is the memory CLI's for the same job config
(:func:`~torchtitan_lite.job.plan_job`, :func:`~torchtitan_lite.memory.estimate.job_estimate_shape`).
It must be within -3% / +10% of the measured peak (issue 27's bound: never more than 3% low).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY_ARGS
from tests.dist_utils import REPO_ROOT, run_distributed
from torchtitan_lite.config import ConfigError, load_job_config
from torchtitan_lite.job import plan_job
from torchtitan_lite.memory.cli import main
from torchtitan_lite.memory.estimate import (
    CATEGORY_NAMES,
    MemoryEstimate,
    estimate_memory,
    estimate_stages,
    job_estimate_shape,
)
from torchtitan_lite.memory.measure import CATEGORIES
from torchtitan_lite.models import get_model_spec
from torchtitan_lite.models.llama3 import LLAMA3_FLAVORS, ModelArgs

SPEC = get_model_spec("llama3")

# Small, but with a realistic vocabulary so that logits and the loss's buffers matter.
SMALL = ModelArgs(dim=128, n_layers=3, n_heads=8, n_kv_heads=4, vocab_size=8192, multiple_of=64,
                  max_seq_len=512)
DEBUG = LLAMA3_FLAVORS["debugmodel"]

LOW, HIGH = -0.03, 0.10
"""The estimate's allowed error against the measured peak."""

AC = {
    "none": ["--activation_checkpoint.mode", "none"],
    "full": ["--activation_checkpoint.mode", "full"],
    "selective op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "selective 2": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
}


def _job(batch: int, seq: int, dtype: str = "float32", *extra: str) -> list[str]:
    """debugmodel on the embedded corpus, no validation, as the trainer runs it."""
    return [*TINY_ARGS, "--model.flavor", "debugmodel", "--training.local_batch_size", str(batch),
            "--training.seq_len", str(seq), "--training.mixed_precision_param", dtype, "--validation.no-enable",
            "--metrics.no-enable_tensorboard", *extra]


def _grid(batch: int, seq: int, dtype: str, modes: tuple[str, ...], acs: tuple[str, ...]) -> dict[str, list[str]]:
    return {f"{dtype} {batch}x{seq} {mode} / {ac}": _job(batch, seq, dtype, "--parallelism.reshard_after_forward_mode",
                                                         mode, *AC[ac]) for mode in modes for ac in acs}


# The whole grid of reshard modes × AC modes in fp32 and bf16 (24 jobs, about 4 minutes here) is a
# benchmark: ``python scripts/benchmark.py --skip overhead,memory,collectives,auto,ac,compile,metainit,startup
# --parts peak`` (figures in docs/performance.md, "Memory estimate against the allocator"). The
# suite keeps its two most different corners.
JOBS: dict[int, dict[str, list[str]]] = {
    2: {
        # Nothing resharded or recomputed, fp32: the largest peak, in backward.
        **_grid(2, 128, "float32", ("never",), ("none",)),
        # Everything resharded and recomputed, bf16 (FSDP2 mixed precision: bf16 gathers and
        # compute, fp32 shards and reduction): the smallest.
        **_grid(2, 128, "bfloat16", ("always",), ("full",)),
        # The default mode with selective (op) checkpointing: the shipped configs'.
        **_grid(2, 128, "float32", ("default",), ("selective op",)),
    },
    4: {
        "reshard to 2": _job(2, 128, "float32", "--parallelism.reshard_after_forward_mode", "2"),
        "HSDP 2 x 2": _job(2, 128, "float32", "--parallelism.data_parallel_replicate_degree", "2"),
        # Data parallel 2 × tensor parallel 2 with selective checkpointing (the sequence's
        # all-gathers recomputed, the reduce-scatters kept; the logits split over the vocabulary).
        "TP 2 x DP 2, selective": _job(1, 128, "float32", "--parallelism.tensor_parallel_degree", "2",
                                       "--training.global_batch_size", "2", *AC["selective op"]),
        # Context parallel 2 × data parallel 2: half of each sequence per rank, the gathered keys
        # and values and the mask over the whole sequence.
        "CP 2 x DP 2": _job(2, 256, "float32", "--parallelism.context_parallel_degree", "2"),
    },
}


# More jobs at 2 ranks, in the scenario tier.
MORE_AT_TWO: dict[str, list[str]] = {
    # Small batches: the peak is the optimizer step's.
    "float32 1x16 default / none": _job(1, 16),
    "CPU offload, never": _job(2, 128, "float32", "--training.enable_cpu_offload",
                               "--parallelism.reshard_after_forward_mode", "never"),
    "2 micro-batches, for-loop AdamW": _job(2, 128, "float32", "--training.global_batch_size", "8",
                                            "--optimizer.implementation", "for-loop"),
}


def _measure(jobs: dict[str, list[str]], dump: str, estimate_in_group: bool = True) -> dict[str, Any]:
    """The allocator's peak of one ``train_step`` of each job on this rank (after a warm-up step:
    the optimizer state exists), the trainer built inside the measurement; and (``estimate_in_group``)
    rank 0's estimate of the first job made inside this process group (``estimate_memory`` runs it
    in a child)."""
    import functools

    import torch.distributed as dist

    from torchtitan_lite.memory.measure import trainer_step_peak
    from torchtitan_lite.trainer import Trainer

    peaks, shards = {}, {}
    for index, (label, argv) in enumerate(jobs.items()):
        peaks[label], trainer = trainer_step_peak(functools.partial(
            Trainer, load_job_config([*argv, "--job.dump_folder", f"{dump}/{index}"])))
        shards[label] = sum(p.to_local().numel() * p.element_size() for p in trainer.model.parameters())
        trainer.metrics.close()  # the process group stays: the next trainer uses it
        del trainer
    in_group = None
    if estimate_in_group and dist.get_rank() == 0 and dist.get_world_size() == 2:  # (once is enough)
        first = next(iter(jobs.values()))
        in_group = _estimate(first, dist.get_world_size())
    dist.barrier()
    return {"peaks": peaks, "shards": shards, "estimate_in_group": in_group}


def _estimate(argv: list[str], world_size: int) -> MemoryEstimate:
    config = load_job_config([*argv, "--job.dump_folder", "/nonexistent/estimate"])
    plan = plan_job(config, world_size=world_size)
    return estimate_memory(plan.spec, plan.model_args, reshard_after_forward_mode=plan.shape.reshard_after_forward_mode,
                           shape=job_estimate_shape(plan))


def _cli_estimates(jobs: dict[str, list[str]], world_size: int, folder: Path,
                   device_type: str = "cpu") -> dict[str, dict[str, Any]]:
    """The memory CLI's figures (``--json``) of each job's configured mode, asked for a job of
    ``device_type`` (``--device_type``)."""
    out = {}
    for index, (label, argv) in enumerate(jobs.items()):
        path = folder / f"cli-{device_type}-{index}.json"
        assert main([*argv, "--world_size", str(world_size), "--device_type", device_type, "--json", str(path)]) == 0
        record = json.loads(path.read_text())
        assert record["device_type"] == device_type
        out[label] = next(e for e in record["estimates"] if e["configured"])
    return out


def _compare(world_size: int, tmp_path: Path, jobs: dict[str, list[str]] | None = None, *,
             cli: tuple[str, ...] = ()) -> None:
    """Each job's estimate (and, for the jobs ``cli`` names, the memory CLI's asked for a CPU job:
    the same figure) within -3% / +10% of the allocator's peak of a real trainer step."""
    jobs = JOBS[world_size] if jobs is None else jobs
    estimates = {label: _estimate(argv, world_size) for label, argv in jobs.items()}
    for label, record in _cli_estimates({label: jobs[label] for label in cli}, world_size, tmp_path).items():
        assert record["peak"] == estimates[label].peak, (label, record["peak"], estimates[label].peak)
    ranks = run_distributed(_measure, world_size, jobs, str(tmp_path), timeout=600)
    if ranks[0]["estimate_in_group"] is not None:
        assert ranks[0]["estimate_in_group"].categories == next(iter(estimates.values())).categories
    print(f"\n{'ranks':>5} {'job':36} {'measured MiB':>12} {'estimated MiB':>13} {'error':>8}  peak in")
    failures = []
    for label, estimate in estimates.items():
        measured = max(rank["peaks"][label] for rank in ranks)
        error = (estimate.peak - measured) / measured
        where = f"{estimate.peak_phase} ({estimate.peak_module})" if estimate.peak_module else estimate.peak_phase
        print(
            f"{world_size:>5} {label:36} {measured / 2**20:12.2f} {estimate.peak / 2**20:13.2f} {error:+8.2%}  {where}"
        )
        if not LOW <= error <= HIGH:
            failures.append(f"{label}: estimated {estimate.peak} vs measured {measured} ({error:+.1%})")
        for rank in ranks:  # the estimate's sharded parameters are the trainer's (padding aside)
            shards = rank["shards"][label]
            if abs(estimate.state["sharded_params"] - shards) > 0.02 * shards:
                failures.append(f"{label}: sharded params {estimate.state['sharded_params']} vs {shards}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_estimate_within_bounds_of_the_allocator_at_two_ranks(tmp_path) -> None:
    """-3% / +10% of the allocator's peak of a real trainer step at 2 ranks: the grid's corners
    (never / none in fp32, always / full in bf16) and the default with selective checkpointing;
    and an estimate made inside a process group (in a child process) equal to one made outside;
    the memory CLI asked for a CPU job (``--device_type cpu``) gives the same figure for the fp32
    corner (asked for a CUDA job, 3.4% lower: CUDA's fused norm; six jobs of
    train_configs/debug_model.toml in the scenario test below). The whole grid:
    scripts/benchmark.py --parts peak."""
    _compare(2, tmp_path, cli=("float32 2x128 never / none",))


DEBUG_TOML = str(REPO_ROOT / "train_configs" / "debug_model.toml")


def _debug_toml(*extra: str) -> list[str]:
    """train_configs/debug_model.toml (a batch of 4 × 256 tokens) without validation or TensorBoard."""
    return ["--job.config_file", DEBUG_TOML, "--validation.no-enable", "--metrics.no-enable_tensorboard", *extra]


CPU_JOBS: dict[str, list[str]] = {
    "default": _debug_toml(),
    "reshard never": _debug_toml("--parallelism.reshard_after_forward_mode", "never"),
    "full AC": _debug_toml(*AC["full"]),
    "selective op": _debug_toml(*AC["selective op"]),
    "bf16": _debug_toml("--training.mixed_precision_param", "bfloat16"),
    "small (batch 1)": _debug_toml("--training.local_batch_size", "1"),
}
"""The debug model's job at 2 ranks, as the memory CLI is asked about a job of CPU processes."""


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_memory_cli_asked_for_a_cpu_job_is_within_bounds_of_the_cpu_allocator(tmp_path: Path) -> None:
    """``python -m torchtitan_lite.memory --device_type cpu`` for train_configs/debug_model.toml at
    2 ranks (seq 256): -3% / +10% of the CPU allocator's peak of a real trainer step for the
    default, reshard never, full and selective (op) checkpointing, bf16 and a batch of 1. Asked for
    a CUDA job (the default) it is lower (CUDA's fused RMSNorm keeps no fp32 copies: it was 0.80 to
    0.99 of the CPU allocator's peak)."""
    cpu = _cli_estimates(CPU_JOBS, 2, tmp_path, "cpu")
    cuda = _cli_estimates({"default": CPU_JOBS["default"]}, 2, tmp_path, "cuda")
    ranks = run_distributed(_measure, 2, CPU_JOBS, str(tmp_path), False, timeout=600)
    print(f"\n{'job':18} {'measured MiB':>12} {'CLI cpu MiB':>12} {'ratio':>7}  peak in")
    failures = []
    for label, record in cpu.items():
        measured = max(rank["peaks"][label] for rank in ranks)
        ratio = record["peak"] / measured
        print(f"{label:18} {measured / 2**20:12.2f} {record['peak'] / 2**20:12.2f} {ratio:7.3f}  "
              f"{record['device_peak_phase']} ({record['device_peak_module']})")
        if not 1 + LOW <= ratio <= 1 + HIGH:
            failures.append(f"{label}: the CLI (cpu) estimated {record['peak']} vs measured {measured} ({ratio:.3f})")
    assert not failures, "\n".join(failures)
    assert cuda["default"]["peak"] < cpu["default"]["peak"]


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_estimate_within_bounds_of_the_allocator_at_two_ranks_for_small_batches_offload_and_accumulation(
        tmp_path) -> None:
    """The same at 2 ranks for small batches (a peak in the optimizer step), CPU offload, and
    gradient accumulation with the for-loop AdamW."""
    _compare(2, tmp_path, MORE_AT_TWO)


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_estimate_within_bounds_of_the_allocator_at_four_ranks(tmp_path) -> None:
    """The same at 4 ranks with an integer reshard mode, HSDP (2 replicas × 2 shards), tensor
    parallel 2 × data parallel 2 and context parallel 2 × data parallel 2."""
    _compare(4, tmp_path)


_PP = "--parallelism.pipeline_parallel_degree"
_SCHEDULE = "--parallelism.pipeline_parallel_schedule"
PIPELINE_JOBS: dict[int, dict[str, list[str]]] = {
    2: {
        "pp2 1F1B fp32": _job(8, 128, "float32", _PP, "2"),
        "pp2 GPipe bf16": _job(8, 128, "bfloat16", _PP, "2", _SCHEDULE, "GPipe"),
        "pp2 Interleaved1F1B fp32": _job(8, 128, "float32", _PP, "2", _SCHEDULE, "Interleaved1F1B"),
        "pp2 ZBVZeroBubble fp32": _job(8, 128, "float32", _PP, "2", _SCHEDULE, "ZBVZeroBubble"),
    },
    4: {
        "pp4 1F1B bf16 full AC": _job(8, 128, "bfloat16", _PP, "4", *AC["full"]),
        "dp2 x pp2 1F1B fp32": _job(4, 128, "float32", _PP, "2"),
        "dp2 x pp2 Interleaved1F1B fp32": _job(4, 128, "float32", _PP, "2", _SCHEDULE, "Interleaved1F1B"),
        "dp2 x pp2 InterleavedZeroBubble bf16 full AC": _job(4, 128, "bfloat16", _PP, "2", _SCHEDULE,
                                                             "InterleavedZeroBubble", *AC["full"]),
        "pp2 x tp2 GPipe bf16 selective": _job(8, 128, "bfloat16", _PP, "2", "--parallelism.tensor_parallel_degree",
                                               "2", _SCHEDULE, "GPipe", *AC["selective op"]),
    },
}


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_each_pipeline_ranks_estimate_within_bounds_of_its_allocator_peak(tmp_path: Path, world_size: int) -> None:
    """Each pipeline rank's estimate (its stages, the schedule's micro-batches in flight and
    receive buffers) within -3% / +10% of the allocator's peak of a real trainer step on that
    rank: pipeline 2 with 1F1B, GPipe, Interleaved1F1B and ZBVZeroBubble at 2 ranks; pipeline 4
    with full checkpointing, data parallel 2 × pipeline 2 (1F1B, interleaved, and
    InterleavedZeroBubble in bf16 with full checkpointing) and pipeline 2 × tensor parallel 2
    (GPipe, selective checkpointing) at 4 ranks. With data
    parallel the measured figure is the lower of a stage's two ranks: gloo's worker thread frees
    its all-gather buffer after the wait has returned, sometimes after the next allocation (one
    rank of the pair 2.6 MiB, 5%, higher in 3 of 7 runs)."""
    jobs = PIPELINE_JOBS[world_size]
    estimates = {}
    for label, argv in jobs.items():
        config = load_job_config([*argv, "--job.dump_folder", "/nonexistent/estimate"])
        plan = plan_job(config, world_size=world_size)
        estimates[label] = estimate_stages(plan.spec, plan.model_args,
                                           reshard_after_forward_mode=plan.shape.reshard_after_forward_mode,
                                           shape=job_estimate_shape(plan))
    ranks = run_distributed(_measure, world_size, jobs, str(tmp_path), timeout=600)
    print(f"\n{'job':44} {'pp rank':>7} {'measured MiB':>12} {'estimated MiB':>13} {'error':>8}  peak in")
    failures = []
    for label, stages in estimates.items():
        per = world_size // len(stages)
        assert [e.pipeline_rank for e in stages] == list(range(len(stages))) and len(stages) > 1, label
        for estimate in stages:
            mine = ranks[estimate.pipeline_rank * per:(estimate.pipeline_rank + 1) * per]
            measured = min(rank["peaks"][label] for rank in mine)
            error = (estimate.peak - measured) / measured
            print(f"{label:44} {estimate.pipeline_rank:>7} {measured / 2**20:12.2f} {estimate.peak / 2**20:13.2f} "
                  f"{error:+8.2%}  {estimate.peak_phase} ({estimate.peak_module})")
            if not LOW <= error <= HIGH:
                failures.append(f"{label} pp rank {estimate.pipeline_rank}: estimated {estimate.peak} vs measured "
                                f"{measured} ({error:+.1%})")
            for rank in mine:  # the rank's stages' shards
                if abs(estimate.state["sharded_params"] - rank["shards"][label]) > 0.02 * rank["shards"][label]:
                    failures.append(f"{label}: sharded params {estimate.state['sharded_params']} vs "
                                    f"{rank['shards'][label]}")
    assert not failures, "\n".join(failures)


def _moe_job(dtype: str, *extra: str) -> list[str]:
    """The tiny Qwen3-MoE (8 experts, top-2, every layer MoE) as the trainer runs it, with its
    load-balancing loss."""
    return [*TINY_ARGS, "--model.name", "qwen3_moe", "--model.flavor", "tiny", "--training.local_batch_size", "2",
            "--training.seq_len", "128", "--training.mixed_precision_param", dtype, "--validation.no-enable",
            "--metrics.no-enable_tensorboard", *extra]


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_moe_estimate_within_bounds_of_the_allocator_at_two_ranks(tmp_path) -> None:
    """A mixture of experts (routing, dispatch buffers, grouped expert products and the CPU
    kernels' operand copies, the router losses): -3% / +10% of the allocator's peak of a real
    trainer step at 2 ranks, everything resharded and recomputed in bf16, and the shipped
    selective checkpointing (peaks in an MoE layer's backward). (Nothing resharded or recomputed,
    fp32: +0.25%, in docs/performance.md; left out for the suite's time.)"""
    _compare(2, tmp_path, {
        "moe bf16 always / full": _moe_job("bfloat16", "--parallelism.reshard_after_forward_mode", "always",
                                           *AC["full"]),
        "moe fp32 default / selective op": _moe_job("float32", *AC["selective op"]),
    })


@pytest.mark.slow
def test_moe_estimate_at_expert_parallel_2_within_bounds_at_four_ranks(tmp_path) -> None:
    """Expert parallel 2 on 4 ranks (each rank holding 4 of the 8 experts' weights, FSDP-sharded
    over 2 ranks; the token exchange's buffers): -3% / +10% of the allocator's peak of a real
    trainer step (the estimate assumes each rank receives as many rows as it sends). (bf16,
    always / full: -0.18%, in the README; left out for the suite's time.)"""
    _compare(4, tmp_path, {
        "moe ep 2 fp32 default / none": _moe_job("float32", "--parallelism.expert_parallel_degree", "2",
                                                 "--training.local_batch_size", "1"),
    })


@pytest.mark.slow
def test_estimate_api() -> None:
    """Categories are memory.measure.CATEGORIES's; device/CPU split under offload; fits(); errors."""
    assert set(CATEGORY_NAMES) == set(CATEGORIES.values())
    common = {"world_size": 8, "local_batch_size": 2, "seq_len": 64, "reshard_after_forward_mode": "default",
              "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    plain = estimate_memory(SPEC, DEBUG, cpu_offload=False, **common)
    offload = estimate_memory(SPEC, DEBUG, cpu_offload=True, **common)
    assert set(plain.categories) == set(CATEGORY_NAMES)
    assert plain.peak == sum(plain.categories.values()) == plain.device_peak and plain.cpu_peak == 0
    assert plain.peak_phase in ("forward", "loss", "backward", "optimizer")
    # Sharded state: 1/8 of the fp32 parameters (padded), AdamW's two moments beside it.
    params = DEBUG.num_params() * 4 / 8
    assert abs(plain.state["sharded_params"] - params) <= 0.01 * params
    assert abs(plain.state["optimizer_state"] - 2 * params) <= 0.01 * 2 * params
    # Offload moves the sharded state to CPU: the device peak excludes it.
    state = sum(offload.state.values())
    assert offload.cpu_peak >= state
    assert offload.device_peak <= offload.peak - offload.state["sharded_params"]
    assert plain.fits(plain.device_peak) and not plain.fits(plain.device_peak - 1)
    assert json.loads(json.dumps(plain.to_dict()))["peak"] == plain.peak
    with pytest.raises(ValueError, match="reshard_after_forward_mode=3"):
        estimate_memory(SPEC, DEBUG, cpu_offload=False, **{**common, "reshard_after_forward_mode": 3})
    with pytest.raises(ValueError, match="world_size"):
        estimate_memory(SPEC, DEBUG, cpu_offload=False, **{**common, "world_size": 0})


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_8b_fits_8_ranks_with_margin_only_with_the_shipped_checkpointing() -> None:
    """The 8B flavor (Llama-3 vocabulary, seq 8192) at 8 ranks of 80 GiB: with
    train_configs/llama3_8b.toml's selective activation checkpointing its configured mode fits with
    a margin (under 70% of the device); without checkpointing even ``always``, the lowest of the
    reshard modes, is over that margin (each block keeps its activations; the norms are CUDA's fused
    kernel, which keeps only their inputs). (The CLI's table for every mode is checked on a small
    model below.)"""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.memory.cli import plan_without_files
    from torchtitan_lite.memory.estimate import job_estimate_shape

    estimates = {}
    for label, extra in (("shipped", []), ("none", ["--activation_checkpoint.mode", "none",
                                                    "--parallelism.reshard_after_forward_mode", "always"])):
        config = load_job_config(["--job.config_file", "train_configs/llama3_8b.toml", *extra])
        plan, _ = plan_without_files(config, world_size=8)  # the tokenizer need not be here: the flavor's vocabulary
        mode = plan.shape.reshard_after_forward_mode
        estimates[label] = estimate_memory(plan.spec, plan.model_args, reshard_after_forward_mode=mode,
                                           shape=job_estimate_shape(plan))
        if label == "shipped":
            assert config.activation_checkpoint.mode == "selective" and mode == "default"
            # fp32 sharded params: 1/8 of the model; AdamW's state twice that.
            params = plan.model_args.num_params()
            assert abs(params - 8.03e9) <= 0.005 * 8.03e9
            expected = params * 4 / 8
            assert abs(estimates[label].state["sharded_params"] - expected) <= 0.01 * expected
            assert abs(estimates[label].state["optimizer_state"] - 2 * expected) <= 0.01 * 2 * expected
    shipped, without = estimates["shipped"], estimates["none"]
    print(f"\n8B at 8 ranks: shipped (selective op, default) {shipped.device_peak / 2**30:.2f} GiB, "
          f"no checkpointing, always {without.device_peak / 2**30:.2f} GiB")
    assert shipped.fits(80 * 2**30) and shipped.device_peak < 0.7 * 80 * 2**30
    assert without.device_peak > 0.7 * 80 * 2**30
    activations = {"shipped": shipped.device_categories["activations"],
                   "none": without.device_categories["activations"]}
    # (selective keeps the matmuls' and attention's outputs; without checkpointing every block also
    # keeps its SwiGLU and elementwise intermediates: two thirds with CUDA's fused norm)
    assert activations["shipped"] < 0.7 * activations["none"], activations



@pytest.mark.parametrize("argv, message", [
    (["--world_size", "8", "--training.seq_len", "abc"], "training.seq_len: invalid value 'abc'"),
    (["--training.seq_len", "64"], "--world_size: missing; expected the ranks of the job"),
    (["--world_size", "two"], "--world_size: invalid value 'two'"),
    (["--world_size", "3", "--parallelism.reshard_after_forward_mode", "2"], "proper divisor"),
    (["--world_size", "8", "--device_memory_gib", "-1"], "--device_memory_gib: invalid value"),
])
def test_cli_bad_values_exit_2_with_one_line(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


@pytest.mark.slow
def test_tied_embeddings_count_once_in_the_estimate() -> None:
    """A tied embedding is one parameter: the estimate's sharded parameters (and gradients and
    optimizer state) shrink by exactly the output projection's share."""
    import dataclasses

    def estimate(args: ModelArgs) -> MemoryEstimate:
        return estimate_memory(SPEC, args, world_size=2, local_batch_size=1, seq_len=32,
                               reshard_after_forward_mode="default", param_dtype=torch.float32,
                               reduce_dtype=torch.float32, cpu_offload=False)

    untied, tied = estimate(SMALL), estimate(dataclasses.replace(SMALL, tie_word_embeddings=True))
    share = SMALL.vocab_size * SMALL.dim * 4 // 2
    assert untied.state["sharded_params"] - tied.state["sharded_params"] == share
    # AdamW's two moments, plus one parameter's step counter fewer.
    assert 0 <= untied.state["optimizer_state"] - tied.state["optimizer_state"] - 2 * share <= 8


def _stub_estimates(monkeypatch: pytest.MonkeyPatch, before: Any = None) -> list[ModelArgs]:
    """The CLI's estimates replaced by empty ones (``before()`` called first), and no auto plan:
    what a test of the CLI's plan checks is the models it estimates (returned, as they come)."""
    import torchtitan_lite.memory.auto as auto
    import torchtitan_lite.memory.cli as cli

    planned: list[ModelArgs] = []

    def stub_estimate(spec: Any, args: ModelArgs, shape: Any, *, reshard_after_forward_mode: Any,
                      **fields: Any) -> MemoryEstimate:
        if before is not None:
            before()
        planned.append(args)
        zeros = dict.fromkeys(CATEGORY_NAMES, 0)
        s = shape.replace(**fields)
        return MemoryEstimate(
            world_size=s.world_size, dp_replicate=s.dp_replicate, dp_shard=s.world_size // s.dp_replicate,
            reshard_after_forward_mode=reshard_after_forward_mode, param_dtype=str(s.param_dtype),
            reduce_dtype=str(s.reduce_dtype), cpu_offload=s.cpu_offload, local_batch_size=s.local_batch_size,
            seq_len=s.seq_len, grad_accum_steps=s.grad_accum_steps, optimizer=s.optimizer, peak=0,
            peak_phase="forward", peak_module="", categories=zeros, device_peak=0, device_peak_phase="forward",
            device_peak_module="", device_categories=zeros, cpu_peak=0)

    def no_auto_plan(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("not planned in this test")

    monkeypatch.setattr(cli, "estimate_memory", stub_estimate)
    # What auto would choose (printed given a device size) is not these tests': no real 8B search.
    monkeypatch.setattr(auto, "plan_auto_reshard", no_auto_plan)
    return planned


def test_cli_plans_torchtitans_8b_job_at_tensor_parallel_2_without_its_dataset(tmp_path, monkeypatch,
                                                                               capsys) -> None:
    """TorchTitan's own llama3_8b.toml (dataset 'c4' from the Hub, a tokenizer under ./assets)
    with tensor_parallel_degree = 2 and asynchronous tensor parallel, on a machine with neither
    data nor a GPU: planned as the CUDA job it is, one line for each missing file (training it
    here is refused: asynchronous tensor parallel needs CUDA)."""
    config = tmp_path / "llama3_8b.toml"
    config.write_text((REPO_ROOT / "tests" / "assets" / "torchtitan" / "2026-02" / "llama3_8b.toml").read_text()
                      .replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 2"))
    async_tp = ["--parallelism.enable_async_tensor_parallel", "--compile.enable"]
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="asynchronous tensor parallel runs on CUDA"):
            plan_job(load_job_config(["--parallelism.tensor_parallel_degree", "2", *async_tp]), world_size=2)
    planned = _stub_estimates(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert main(["--job.config_file", str(config), "--world_size", "8", "--device_memory_gib", "80", *async_tp]) == 0
    out = capsys.readouterr().out
    assert {(args.dim, args.n_layers, args.vocab_size) for args in planned} == {(4096, 32, 128256)}
    assert "× tensor parallel 2 (" in out.splitlines()[0], out
    assert "training.dataset: not on this machine (no local copy set); the estimate reads no data" in out, out


def test_cli_reports_progress_while_it_estimates(tmp_path, monkeypatch, capsys) -> None:
    """The 8B job on one 80 GiB device: a progress line (on stderr) comes while the first
    estimate is still running: the stubbed estimate returns only once it has seen one."""
    import threading

    seen = threading.Event()

    def wait_for_a_progress_line() -> None:
        assert seen.wait(120), "no progress line while estimating"

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "planning the memory of llama3 8B on 1 rank: estimate 1 of" in record.getMessage():
                seen.set()

    planned = _stub_estimates(monkeypatch, before=wait_for_a_progress_line)
    log = logging.getLogger("torchtitan_lite")
    handler, level = Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        monkeypatch.chdir(tmp_path)
        assert main(["--job.config_file", str(REPO_ROOT / "train_configs" / "llama3_8b.toml"),
                     "--world_size", "1", "--device_memory_gib", "80"]) == 0
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert seen.is_set() and planned


def test_cli_job_whose_tokenizer_and_dataset_are_not_here(tmp_path, monkeypatch, capsys) -> None:
    """The shipped Llama 3.1 8B job (train_configs/llama3_8b.toml) planned on a machine without its
    files: the tokenizer folder and the Parquet mixture do not exist. The model takes the 8B
    flavor's own vocabulary (128256: 8.03B parameters) and one line says so. (The estimate itself
    is stubbed to stay cheap: what is checked is the plan the CLI estimates and reports.)"""

    shipped = Path(__file__).resolve().parent.parent / "train_configs" / "llama3_8b.toml"

    missing = tmp_path / "not-downloaded"
    config = tmp_path / "llama3_8b_remote.toml"
    config.write_text(f"""
[model]
name = "llama3"
flavor = "8B"
tokenizer_path = "{missing / 'Llama-3.1-8B' / 'original'}"

[training]
dataset = "parquet"
dataset_path = "{missing / 'fineweb-edu'}"
seq_len = 8192
local_batch_size = 1

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
""")
    planned = _stub_estimates(monkeypatch)
    monkeypatch.chdir(tmp_path)  # the shipped job's relative paths: nothing there
    assert main(["--job.config_file", str(shipped), "--world_size", "8", "--device_memory_gib", "80"]) == 0
    out = capsys.readouterr().out
    assert planned and {args.vocab_size for args in planned} == {128256}
    assert {(args.dim, args.n_layers) for args in planned} == {(4096, 32)}
    assert out.startswith("llama3 8B: 8.03B parameters, vocab 128256; 8 ranks"), out
    notes = [line for line in out.splitlines() if line.startswith("model.tokenizer_path")]
    assert notes == ["model.tokenizer_path './assets/hf/Llama-3.1-8B' does not exist on this machine: the "
                     "estimate uses llama3 8B's own vocabulary, 128256 ids"], out
    planned.clear()
    assert main(["--job.config_file", str(config), "--world_size", "8", "--device_memory_gib", "80"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("model.tokenizer_path")]
    assert notes == [f"model.tokenizer_path {str(missing / 'Llama-3.1-8B' / 'original')!r} does not exist on "
                     "this machine: the estimate uses llama3 8B's own vocabulary, 128256 ids"]

    # A vocabulary the user set is kept; the byte tokenizer (no tokenizer_path) prints no note.
    planned.clear()
    assert main(["--job.config_file", str(config), "--world_size", "8", "--model.vocab_size", "128512"]) == 0
    out = capsys.readouterr().out
    assert {args.vocab_size for args in planned} == {128512}
    assert "the estimate uses model.vocab_size, 128512 ids" in out
    assert main(["--world_size", "2", "--model.flavor", "8B"]) == 0
    out = capsys.readouterr().out
    assert "vocab 258;" in out and "model.tokenizer_path" not in out

    # A dataset named by where it is published (nothing downloads it) is planned all the same,
    # with one line; the config checks that need no files still run: every problem at once.
    assert main(["--job.config_file", str(config), "--world_size", "8", "--training.dataset", "fineweb"]) == 0
    assert "training.dataset: not on this machine (no local copy set); the estimate reads no data" in \
        capsys.readouterr().out
    assert main(["--job.config_file", str(config), "--world_size", "8", "--training.dataset", "fineweb",
                 "--validation.enable", "--validation.dataset", "text", "--parallelism.tensor_parallel_degree",
                 "3"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("error: validation.dataset_path: validation.dataset='text' needs a "
                                               "path"), err
    assert err[1].startswith("error: parallelism.context_parallel_degree=1 × parallelism.tensor_parallel_degree=3"), err


@pytest.mark.slow
def test_cli_says_what_it_does_not_model(capsys) -> None:
    """float8 and compile are not in the estimate: the CLI says so, one line each (a job without
    them gets none of these lines). Packed documents (block-causal), with or without pipeline
    stages, leave nothing out."""
    small = ["--model.flavor", "tiny", "--world_size", "2", "--training.seq_len", "32",
             "--training.local_batch_size", "1"]
    assert main([*small, "--model.converters", "float8", "--float8.emulate", "--compile.enable",
                 "--model.attention_mask", "block_causal", "--parallelism.pipeline_parallel_degree", "2",
                 "--training.local_batch_size", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "is not modelled" in line]
    assert [line.split(" ")[0] for line in lines] == ["model.converters", "compile.enable"]
    assert main(small) == 0
    assert "is not modelled" not in capsys.readouterr().out
    for extra in ([], ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "2"]):
        assert main([*small, "--model.attention_mask", "block_causal", *extra]) == 0
        assert "is not modelled" not in capsys.readouterr().out


def test_cli_bad_key_exits_2_with_one_line(monkeypatch, capsys) -> None:
    """``python -m torchtitan_lite.memory`` (its ``__main__``, run as the interpreter runs it)."""
    import runpy

    argv = ["--world_size", "8", "--job.config_file", "train_configs/debug_model.toml", "--training.stepz", "3"]
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(sys, "argv", ["torchtitan_lite.memory", *argv])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("torchtitan_lite.memory", run_name="__main__")
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.strip().count("\n") == 0, err
    assert err.startswith("error: unknown key 'training.stepz'"), err
