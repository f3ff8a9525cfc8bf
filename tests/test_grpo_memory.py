"""The memory of an online RL step (``torchtitan_lite/objectives/grpo.py``'s ``estimate_step``,
docs/rl.md "Memory"): generation's KV cache, the log-probabilities a step keeps, the reference,
``auto`` and the CLI; and the estimate against the allocator's peak of real GRPO trainer steps."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest

from tests.dist_utils import REPO_ROOT, run_distributed
from tests.test_data_chat import write_chat_tokenizer
from torchtitan_lite.distributed.job_shape import JobShape, ObjectiveShape, RolloutShape
from torchtitan_lite.memory.estimate import estimate_memory
from torchtitan_lite.models import get_model_spec
from torchtitan_lite.objectives.grpo import step_shape

SPEC = get_model_spec("llama3")
TINY = dataclasses.replace(SPEC.model_args("tiny"), vocab_size=512)
# 2 ranks, fp32: 32 completions a rank of 128 tokens (prompts of up to 64), 1 per micro-batch
SHAPE = JobShape(world_size=2, local_batch_size=1, seq_len=128, grad_accum_steps=32, device_type="cpu")
GENERATING = RolloutShape(generation_rows=32, prompt_len=64, new_tokens=64)


def _rl(rollout: RolloutShape, reference: str | None = None) -> JobShape:
    """:data:`SHAPE` as a GRPO step of ``rollout`` with ``reference``."""
    return SHAPE.replace(objective_shape=step_shape(rollout, reference=reference))


def test_the_estimate_of_a_grpo_step_counts_generation_what_it_keeps_and_the_reference() -> None:
    """The tiny Llama at 2 ranks: generating 32 completions at once, the peak is generation's, its
    KV cache exactly the layers' keys and values of 32 rows × 128 positions (2 of 4 heads'
    width), on top of the state a token-loss step of the same rows holds; keeping the sampling
    policy's and the reference's log-probabilities (fp32, every completion's positions) and a
    frozen copy as the reference add at least those tensors and the copy's shards."""
    plain = estimate_memory(SPEC, TINY, SHAPE, reshard_after_forward_mode="default")
    generating = estimate_memory(SPEC, TINY, _rl(GENERATING), reshard_after_forward_mode="default")
    kv_cache = TINY.n_layers * 2 * 32 * (TINY.n_kv_heads * TINY.dim // TINY.n_heads) * 128 * 4
    assert generating.kv_cache == kv_cache
    assert generating.peak_phase == "generation" and generating.peak == generating.generation_peak
    state = sum(plain.state[k] for k in ("sharded_params", "optimizer_state"))
    assert generating.generation_peak >= state + kv_cache, (generating.generation_peak, state, kv_cache)
    assert generating.peak > plain.peak + kv_cache // 2
    assert plain.kv_cache == plain.generation_peak == 0
    with_copy = estimate_memory(SPEC, TINY, _rl(GENERATING, "copy"),
                                reshard_after_forward_mode="default")
    assert with_copy.generation_peak >= generating.generation_peak + with_copy.state["reference_params"] > 0

    given = dataclasses.replace(GENERATING, generation_rows=0)
    nothing_kept = estimate_memory(SPEC, TINY, _rl(given), reshard_after_forward_mode="default")
    kept = estimate_memory(SPEC, TINY, _rl(dataclasses.replace(given, old_logps=True), "copy"),
                           reshard_after_forward_mode="default")
    assert nothing_kept.kv_cache == 0 and nothing_kept.peak_phase != "generation"
    assert kept.state["reference_params"] == nothing_kept.state["sharded_params"]
    logps = 2 * 32 * 128 * 4  # the sampling policy's and the reference's, fp32
    assert kept.peak >= nothing_kept.peak + kept.state["reference_params"] + logps


def test_auto_counts_the_kv_cache_and_says_what_lowers_it() -> None:
    """Under a budget the token-loss step of the same rows fits without any action, a GRPO step
    whose generation does not fit is refused by ``auto`` in one line naming generation's KV cache
    and ``grpo.generation_batch_size``, as nothing ``auto`` does shrinks it; with half the rows
    generated at once, it fits."""
    from torchtitan_lite.memory.auto import plan_auto_reshard

    ample = 2**40
    plain = plan_auto_reshard(SPEC, TINY, SHAPE, budget_bytes=ample)  # (nothing resharded: its never estimate)
    generating = plan_auto_reshard(SPEC, TINY, _rl(GENERATING), budget_bytes=ample)
    assert generating.estimate.peak_phase == "generation"
    budget = (plain.peak + generating.peak) // 2 + plain.headroom
    assert plan_auto_reshard(SPEC, TINY, SHAPE, budget_bytes=budget).resharded == ()
    with pytest.raises(ValueError) as error:
        plan_auto_reshard(SPEC, TINY, _rl(GENERATING), budget_bytes=budget)
    message = str(error.value)
    assert "\n" not in message and "in generation (its KV cache)" in message
    assert "grpo.generation_batch_size" in message
    halved = _rl(dataclasses.replace(GENERATING, generation_rows=16))
    chosen = plan_auto_reshard(SPEC, TINY, halved, budget_bytes=budget)
    assert chosen.estimate.kv_cache == generating.estimate.kv_cache // 2 and chosen.peak + chosen.headroom <= budget


@pytest.mark.scenario  # (the estimates' figures are tested above; this, the CLI's lines: docs/testing.md)
@pytest.mark.slow
def test_the_memory_cli_describes_a_grpo_step_and_its_kv_cache(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m torchtitan_lite.memory`` on the toy task's config says what a step generates,
    keeps and trains, and the KV cache's size and generation's peak, under the table."""
    from torchtitan_lite.memory.cli import main

    assert main(["--world_size", "2", "--job.config_file", str(REPO_ROOT / "train_configs" / "grpo_toy.toml"),
                 "--model.tokenizer_path", str(REPO_ROOT / "tests" / "assets" / "toy_rl"),
                 "--grpo.beta", "0.04", "--grpo.num_iterations", "2"]) == 0
    out = capsys.readouterr().out
    assert ("online RL (GRPO, dapo): 80 completions generated at once per rank on the training model, through a "
            "KV cache of 6 + 2 positions") in out
    assert "the sampling policy's and the reference's log-probabilities of them kept for the step" in out
    assert "the reference is a frozen copy sharded like the model" in out
    assert "online RL: the KV cache of a generation batch is 0.3 MiB per rank; generation peaks at" in out
    assert "not modelled" not in out


def _grpo_step_peak(argv: list[str], warmup: int) -> int:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.memory.measure import trainer_step_peak
    from torchtitan_lite.trainer import Trainer

    peak, trainer = trainer_step_peak(functools.partial(Trainer, load_job_config(argv)), warmup=warmup)
    trainer.metrics.close()
    return peak


_CASES: dict[str, tuple[list[str], int]] = {  # name: (arguments, steps before the measured one)
    # generation's KV cache above the policy step's activations: the peak is generation's
    "generation": (["--training.seq_len", "192", "--grpo.max_completion_length", "128", "--grpo.num_generations",
                    "16", "--training.global_batch_size", "64", "--training.local_batch_size", "1"], 1),
    # a frozen copy as the reference and num_iterations 2 (the measured step generates)
    "frozen copy, num_iterations 2": (["--training.seq_len", "128", "--grpo.max_completion_length", "64",
                                       "--grpo.num_generations", "4", "--training.global_batch_size", "16",
                                       "--training.local_batch_size", "4", "--grpo.beta", "0.04",
                                       "--grpo.num_iterations", "2"], 2),
}


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
@pytest.mark.parametrize("case", list(_CASES))
def test_the_estimate_of_a_grpo_step_is_within_bounds_of_the_allocator(tmp_path: Path, case: str) -> None:
    """The debug model's shape, 2 ranks, fp32, prompts cut to ``seq_len − max_completion_length``
    tokens: the estimate of a GRPO step that generates (its completions sampled by the model, the
    accuracy reward) is within -3% / +10% of the allocator's peak of a real trainer step, where
    generation holds the peak and where the policy step does, with a frozen copy as the reference
    and the sampling policy's log-probabilities kept; and above the estimate of the same rows as a
    token-loss step."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.job import plan_job
    from torchtitan_lite.memory.estimate import job_estimate_shape

    write_chat_tokenizer(tmp_path / "tok", "llama3")
    words = "the quick brown fox jumps over a lazy dog and then runs far away into the deep woods".split()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(words[(i + j) % len(words)] for j in range(300)),
                                           "answer": str(i % 10)}) + "\n" for i in range(64)))
    extra, warmup = _CASES[case]
    argv = ["--model.name", "llama3", "--model.flavor", "debugmodel", "--model.tokenizer_path", str(tmp_path / "tok"),
            "--model.vocab_size", "512", "--training.dataset", "prompts", "--training.dataset_path", str(prompts),
            "--grpo.reward_functions", "accuracy", "--training.mixed_precision_param", "float32",
            "--training.steps", "4", "--validation.no-enable", "--metrics.no-enable_tensorboard",
            "--job.dump_folder", str(tmp_path / "dump"), *extra]
    plan = plan_job(load_job_config(argv), world_size=2)
    shape = job_estimate_shape(plan)
    mode = plan.shape.reshard_after_forward_mode
    estimate = estimate_memory(plan.spec, plan.model_args, shape, reshard_after_forward_mode=mode)
    plain = estimate_memory(plan.spec, plan.model_args, shape, reshard_after_forward_mode=mode,
                           objective_shape=ObjectiveShape())
    measured = max(run_distributed(_grpo_step_peak, 2, argv, warmup, timeout=600))  # (a hang bound, for a loaded host)
    error = (estimate.peak - measured) / measured
    print(f"{case}: estimate {estimate.peak} B ({estimate.peak_phase}), allocator {measured} B, {error:+.2%}")
    assert -0.03 <= error <= 0.10, (case, estimate.peak, measured, error)
    assert estimate.peak > plain.peak, (case, estimate.peak, plain.peak)
    assert (estimate.peak_phase == "generation") == (case == "generation"), estimate
