"""Pipeline parallel: the stages a model splits into, the refusals, and losses equal to one
process's for every schedule and layout, checkpoints moving between pipeline degrees."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed, train_history
from torchtitan_lite.distributed.pipeline_parallel import pipeline_plan, pipeline_problem, rank_actions


def _layers(plan: Any) -> list[tuple[tuple[str, ...], bool, bool]]:
    return [(s.layers, s.first, s.last) for s in plan.stages]


def test_a_model_splits_into_even_stages_with_the_embedding_and_output_counted() -> None:
    one = pipeline_plan(n_layers=6, degree=4, schedule="1F1B", microbatch_size=1, local_batch_size=4)
    assert _layers(one) == [(("0",), True, False), (("1", "2"), False, False), (("3", "4"), False, False),
                            (("5",), False, True)]
    assert [s.index for s in one.rank_stages(2)] == [2]
    looped = pipeline_plan(n_layers=6, degree=2, schedule="Interleaved1F1B", microbatch_size=1, local_batch_size=4)
    assert [[s.index for s in looped.rank_stages(r)] for r in range(2)] == [[0, 2], [1, 3]]
    assert [len(s.layers) for s in looped.stages] == [1, 2, 2, 1]
    v = pipeline_plan(n_layers=6, degree=2, schedule="ZBVZeroBubble", microbatch_size=1, local_batch_size=4)
    assert [[s.index for s in v.rank_stages(r)] for r in range(2)] == [[0, 3], [1, 2]]
    flat = pipeline_plan(n_layers=4, degree=2, schedule="GPipe", microbatch_size=2, local_batch_size=2,
                         first_less=0, last_less=0)
    assert _layers(flat) == [(("0", "1"), True, False), (("2", "3"), False, True)] and flat.microbatches(2) == 1
    # A stage may hold only the embedding, or only the norm and output.
    thin = pipeline_plan(n_layers=6, degree=4, schedule="Interleaved1F1B", microbatch_size=1, local_batch_size=4)
    assert _layers(thin)[0] == ((), True, False) and _layers(thin)[-1] == ((), False, True)
    three = pipeline_plan(n_layers=10, degree=2, schedule="Interleaved1F1B", microbatch_size=1, local_batch_size=4,
                          layers_per_stage=2)
    assert len(three.stages) == 6 and [[s.index for s in three.rank_stages(r)] for r in range(2)] == [[0, 2, 4],
                                                                                                       [1, 3, 5]]


def test_zero_bubble_orders_split_each_backward_and_keep_fsdp_gathered() -> None:
    """The orders the memory estimate replays are torch's: a zero-bubble rank runs each stage's
    micro-batch once forward, once through the input pass and once through the weight pass, the
    weight pass after the input pass; the job keeps FSDP's units gathered for it (reshard
    ``never`` in place of ``default``), and the estimate refuses another mode in one line."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.job import plan_job

    for schedule in ("ZBVZeroBubble", "InterleavedZeroBubble"):
        plan = pipeline_plan(n_layers=6, degree=2, schedule=schedule, microbatch_size=1, local_batch_size=4)
        assert plan.splits_backward
        for rank in range(2):
            actions = rank_actions(plan, rank, 4)
            stages = [s.index for s in plan.rank_stages(rank)]
            assert sorted(actions) == sorted((kind, s, j) for kind in "FIW" for s in stages for j in range(4))
            for s in stages:
                for j in range(4):
                    assert actions.index(("F", s, j)) < actions.index(("I", s, j)) < actions.index(("W", s, j))
    assert rank_actions(pipeline_plan(n_layers=6, degree=2, schedule="ZBVZeroBubble", microbatch_size=1,
                                      local_batch_size=4), 0, 4)[:4] == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2),
                                                                          ("F", 3, 0)]
    assert not pipeline_plan(n_layers=6, degree=2, schedule="Interleaved1F1B", microbatch_size=1,
                             local_batch_size=4).splits_backward
    config = load_job_config([*TINY_ARGS, "--parallelism.pipeline_parallel_degree", "2",
                              "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"])
    job = plan_job(config, world_size=4)
    assert job.shape.reshard_after_forward_mode == "never"
    from torchtitan_lite.memory.estimate import estimate_memory, job_estimate_shape

    with pytest.raises(ValueError, match="^reshard_after_forward_mode: invalid value 'default'; ZBVZeroBubble keeps "
                                         "every unit gathered"):
        estimate_memory(job.spec, job.model_args, reshard_after_forward_mode="default",
                        shape=job_estimate_shape(job))


@pytest.mark.parametrize("settings, message", [
    ({"schedule": "DualPipe"}, "parallelism.pipeline_parallel_schedule: invalid value 'DualPipe'; expected one of "
                               "GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble"),
    ({"microbatch_size": 3}, "parallelism.pipeline_parallel_microbatch_size: invalid value 3; expected a divisor of "
                             "training.local_batch_size = 4"),
    ({"n_layers": 5}, "parallelism.pipeline_parallel_degree: invalid value 2; 5 blocks + 1 (embedding) + 1 (output) "
                      "= 7 layers do not split evenly into 2 stages"),
    ({"degree": 4, "n_layers": 3, "first_less": 2, "last_less": 3}, "parallelism.pipeline_parallel_degree: invalid "
                                                                     "value 4; 4 stages of 2 layers cannot hold the "
                                                                     "first stage's 2 and the last stage's 3"),
    ({"microbatch_size": 4}, "parallelism.pipeline_parallel_microbatch_size: invalid value 4; 1F1B needs at least "
                             "2 micro-batches"),
    ({"schedule": "Interleaved1F1B", "layers_per_stage": 3}, "parallelism.pipeline_parallel_layers_per_stage: "
                                                             "invalid value 3; 8 layers"),
])
def test_a_split_the_model_or_schedule_cannot_take_is_one_line(settings: dict[str, Any], message: str) -> None:
    args = {"n_layers": 6, "degree": 2, "schedule": "1F1B", "microbatch_size": 1, "local_batch_size": 4, **settings}
    problem = pipeline_problem(**args)
    assert problem is not None and problem.startswith(message) and "\n" not in problem, problem


@pytest.mark.parametrize("extra, message", [
    (["--parallelism.pipeline_parallel_degree", "3"], "parallelism.pipeline_parallel_degree=3 does not divide "
                                                      "the world size 4"),
    (["--parallelism.pipeline_parallel_schedule", "1f1b"], "parallelism.pipeline_parallel_schedule: invalid value "
                                                           "'1f1b'; expected one of"),
    (["--validation.enable", "--parallelism.pipeline_parallel_microbatch_size", "2", "--training.local_batch_size",
      "4", "--validation.local_batch_size", "3"],
     "validation.local_batch_size: invalid value 3; validation runs through the stages in micro-batches"),
    (["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--parallelism.reshard_after_forward_mode",
      "always"], "parallelism.reshard_after_forward_mode: invalid value 'always'; ZBVZeroBubble keeps each stage's "
                 "parameters gathered"),
    (["--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble", "--activation_checkpoint.mode",
      "selective"], "activation_checkpoint.selective_ac_option: invalid value 'op'; per-op checkpointing lets each "
                    "region run one backward, and InterleavedZeroBubble runs two"),
])
def test_the_plan_refuses_what_a_pipeline_cannot_run_in_one_line(extra: list[str], message: str) -> None:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.errors import ConfigError
    from torchtitan_lite.job import plan_job

    config = load_job_config([*TINY_ARGS, "--parallelism.pipeline_parallel_degree", "2", *extra])
    with pytest.raises(ConfigError) as info:
        plan_job(config, world_size=4)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def _losses(argv: list[str]) -> list[tuple[float, float]]:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    try:
        return [(r["loss"], r["grad_norm"]) for r in trainer.train()]
    finally:
        trainer.close()


def _trained_params(argv: list[str]) -> dict[str, Any]:
    """Train; this rank's parameters, whole (each stage's gathered over its data-parallel ranks)."""
    from torch.distributed.tensor import DTensor

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    try:
        trainer.train()
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for name, p in trainer.model.named_parameters()}
    finally:
        trainer.close()


def _close(run: list[tuple[float, float]], reference: list[tuple[float, float]], label: str) -> None:
    """Losses within 1e-5; gradient norms within 1e-4 of their size (summed in another order, they
    drift first: 1.1e-5 at step 9 of data parallel 2 × pipeline 2, its loss within 7e-7)."""
    assert len(run) == len(reference), label
    for (loss, norm), (ref_loss, ref_norm) in zip(run, reference, strict=True):
        assert abs(loss - ref_loss) <= 1e-5 and abs(norm - ref_norm) <= 1e-4 * max(1.0, ref_norm), (label, run,
                                                                                                       reference)


_PP = "--parallelism.pipeline_parallel_degree"
_SCHEDULE = "--parallelism.pipeline_parallel_schedule"


@pytest.mark.slow
def test_two_stages_train_and_validate_as_one_process_does(tmp_path: Path) -> None:
    """fp32, 6 steps of the tiny Llama: pipeline 2 with 1F1B (2 ranks) gives one process's losses
    within 1e-5, and its validation (a forward-only schedule over the stages, 3 rows a pass) one
    process's validation loss at steps 3 and 6."""
    from tests.dist_utils import run_distributed

    common = [*TINY_ARGS, "--training.steps", "6", "--metrics.no-enable_tensorboard", "--validation.enable",
              "--validation.freq", "3", "--validation.steps", "2", "--validation.local_batch_size", "3"]
    reference = run_distributed(train_history, 1, [*common, "--job.dump_folder", str(tmp_path / "one")])[0]
    runs = run_distributed(train_history, 2, [*common, _PP, "2", "--job.dump_folder", str(tmp_path / "pp2")])
    assert [r["loss"] for r in runs[0]] == [r["loss"] for r in runs[1]]  # every pipeline rank reports the loss
    _close([(r["loss"], r["grad_norm"]) for r in runs[0]], [(r["loss"], r["grad_norm"]) for r in reference], "pp2")
    validated = [(r["step"], r["validation_loss"]) for r in runs[0] if r.get("validation_loss") is not None]
    expected = [(r["step"], r["validation_loss"]) for r in reference if r.get("validation_loss") is not None]
    assert [s for s, _ in validated] == [s for s, _ in expected] == [3, 6], (validated, expected)
    for (_, ours), (_, theirs) in zip(validated, expected, strict=True):
        assert abs(ours - theirs) <= 1e-5, (validated, expected)


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_every_schedule_and_layout_trains_as_one_process_and_checkpoints_move_between_degrees(
        tmp_path: Path) -> None:
    """fp32, 10 steps of Llama 3's 6-block debug model: pipeline 4 with 1F1B, pipeline 2
    with GPipe and with Interleaved1F1B (2 stages a rank), data parallel 2 × pipeline 2 (FSDP over
    each stage's ranks) give one process's losses within 1e-5 (gradient norms: 1e-4). A checkpoint
    saved at step 5 by pipeline 2 resumes at pipeline 1 (4 ranks of FSDP) and at pipeline 4 with
    the later losses of the run that never stopped, within 1e-5; its last save, a Hugging Face
    folder, gives transformers one process's logits within 1e-5."""
    from tests.dist_utils import run_distributed

    common = [*TINY_ARGS, "--model.flavor", "debugmodel", "--training.steps", "10",
              "--training.local_batch_size", "4", "--training.global_batch_size", "8",
              "--metrics.no-enable_tensorboard"]
    export = ["--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.last_save_model_only",
              "--checkpoint.last_save_in_hf"]
    reference = run_distributed(_losses, 1, [*common, *export, "--job.dump_folder", str(tmp_path / "one")])[0]
    layouts = {
        "pp4 1F1B": (4, [_PP, "4", "--training.local_batch_size", "8"]),
        "pp2 GPipe": (2, [_PP, "2", _SCHEDULE, "GPipe", "--training.local_batch_size", "8"]),
        "pp2 Interleaved1F1B": (2, [_PP, "2", _SCHEDULE, "Interleaved1F1B", "--training.local_batch_size", "8"]),
        "dp2 x pp2 1F1B": (4, [_PP, "2"]),
        "pp2 x tp2 1F1B": (4, [_PP, "2", "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size",
                               "8"]),
    }
    for label, (ranks, extra) in layouts.items():
        dump = tmp_path / label.replace(" ", "_")
        run = run_distributed(_losses, ranks, [*common, *extra, *export, "--job.dump_folder", str(dump)])[0]
        _close(run, reference, label)
    # The last save of data parallel 2 × pipeline 2, a Hugging Face folder written by both stages,
    # gives transformers the logits of the weights it trained (gathered from the stages).
    import torch
    from transformers import AutoModelForCausalLM

    from torchtitan_lite.distributed.parallelize import build_sharded_model
    from torchtitan_lite.models import get_model_spec

    params: dict[str, torch.Tensor] = {}
    for part in run_distributed(_trained_params, 4, [*common, *layouts["dp2 x pp2 1F1B"][1], *export,
                                                     "--job.dump_folder", str(tmp_path / "gathered")]):
        params.update(part)
    spec = get_model_spec("llama3")
    ours = build_sharded_model(spec, spec.model_args("debugmodel"), None, device=torch.device("cpu"), seed=0,
                               sharded=False)
    ours.load_state_dict(params)
    tokens = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(0))
    folder = tmp_path / "gathered" / "checkpoint" / "step-10"
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)(tokens).logits
        expected = ours(tokens)
    assert torch.allclose(theirs, expected, atol=1e-5, rtol=0), float((theirs - expected).abs().max())
    saved = tmp_path / "dp2_x_pp2_1F1B" / "checkpoint" / "step-5"
    for label, (ranks, extra) in {"pp1 (FSDP 4)": (4, ["--training.local_batch_size", "2"]),
                                  "pp4": (4, layouts["pp4 1F1B"][1])}.items():
        dump = tmp_path / ("resumed " + label).replace(" ", "_")
        shutil.copytree(saved, dump / "checkpoint" / "step-5")
        run = run_distributed(_losses, ranks, [*common, *extra, "--checkpoint.enable", "--checkpoint.interval", "5",
                                               "--job.dump_folder", str(dump)])[0]
        _close(run, reference[5:], "resumed at " + label)


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_data_2_x_pipeline_2_x_tensor_2_on_8_ranks_trains_as_one_process(tmp_path: Path) -> None:
    """fp32, 10 steps of Llama 3's debug model on 8 ranks: data parallel 2 × pipeline 2 (1F1B) ×
    tensor parallel 2 (sequence parallel between the blocks, the logits split over the
    vocabulary for the loss) gives one process's losses within 1e-5 (gradient norms 1e-4)."""
    from tests.dist_utils import run_distributed

    common = [*TINY_ARGS, "--model.flavor", "debugmodel", "--training.steps", "10", "--training.global_batch_size",
              "8", "--metrics.no-enable_tensorboard"]
    reference = run_distributed(_losses, 1, [*common, "--training.local_batch_size", "8", "--job.dump_folder",
                                             str(tmp_path / "one")])[0]
    run = run_distributed(_losses, 8, [*common, "--training.local_batch_size", "4", _PP, "2",
                                       "--parallelism.tensor_parallel_degree", "2", "--job.dump_folder",
                                       str(tmp_path / "dp2_pp2_tp2")], timeout=600)[0]
    _close(run, reference, "dp2 x pp2 x tp2")


@pytest.mark.slow
@pytest.mark.parametrize("mask", ["block_causal", pytest.param("causal", marks=pytest.mark.scenario)])
def test_chat_sft_with_masked_labels_at_pipeline_2_equals_one_process(tmp_path: Path, mask: str) -> None:
    """Chat SFT (Llama 3's template, the loss over the assistant turns only, from a Hugging Face
    folder), fp32, 3 steps: pipeline 2 at 2 ranks gives one process's losses within 1e-5, the
    loss's scale (the global batch's counted labels) applied in every stage's micro-batches, with
    the packed conversations' document ids reaching every stage (block-causal) or not (causal)."""
    import json

    from tests.dist_utils import run_distributed
    from tests.test_data_chat import CONVERSATIONS, write_chat_tokenizer
    from tests.test_decoder_hf import hf_llama
    from tests.test_trainer_sft import _argv
    from torchtitan_lite.data import HFTokenizer

    path = write_chat_tokenizer(tmp_path / "tokenizer", "llama3")
    hf_llama(tmp_path / "base", vocab_size=HFTokenizer(path).vocab_size)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    common = ["--model.attention_mask", mask, "--training.steps", "3", "--training.local_batch_size", "2"]
    reference = run_distributed(_losses, 1, _argv(tmp_path, tmp_path / "one", *common))[0]
    staged = run_distributed(_losses, 2, _argv(tmp_path, tmp_path / "pp2", *common, _PP, "2"))[0]
    _close(staged, reference, "chat SFT at pp2")


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_pipeline_composes_with_checkpointing_offload_reshard_modes_compile_lora_and_hsdp(tmp_path: Path) -> None:
    """fp32, 5 steps of the tiny Llama at pipeline 2: full activation checkpointing, CPU offload,
    reshard never and always, compiled blocks, LoRA (against one process with LoRA) and HSDP 2 ×
    pipeline 2 (4 ranks) each give one process's losses within 1e-5; float8 at data parallel 2 ×
    pipeline 2 (the float8 all-gather) those of data parallel 2 over the same micro-batches."""
    from tests.dist_utils import run_distributed

    common = [*TINY_ARGS, "--training.steps", "5", "--training.global_batch_size", "4",
              "--metrics.no-enable_tensorboard"]
    reference = run_distributed(_losses, 1, [*common, "--job.dump_folder", str(tmp_path / "one")])[0]
    lora = ["--lora.enable", "--lora.rank", "4"]
    with_lora = run_distributed(_losses, 1, [*common, *lora, "--job.dump_folder", str(tmp_path / "one_lora")])[0]
    cases = {
        "full AC": (2, ["--activation_checkpoint.mode", "full"], reference),
        "CPU offload": (2, ["--training.enable_cpu_offload"], reference),
        "reshard never": (2, ["--parallelism.reshard_after_forward_mode", "never"], reference),
        "reshard always": (2, ["--parallelism.reshard_after_forward_mode", "always"], reference),
        "compiled blocks": (2, ["--compile.enable"], reference),
        "LoRA": (2, lora, with_lora),
        "HSDP 2 x pp2": (4, ["--parallelism.data_parallel_replicate_degree", "2"], reference),
    }
    # float8 (emulated) scales each micro-batch's activations by its own amax: the reference
    # accumulates the same micro-batches (1 row); the weights are all-gathered in float8.
    float8 = ["--model.converters", "float8", "--float8.emulate", "--float8.enable_fsdp_float8_all_gather",
              "--float8.precompute_float8_dynamic_scale_for_fsdp"]
    cases["float8, dp2 x pp2"] = (4, float8, run_distributed(_losses, 2, [
        *common, *float8, "--training.local_batch_size", "1", "--job.dump_folder", str(tmp_path / "f8_dp2")])[0])
    for label, (ranks, extra, expected) in cases.items():
        run = run_distributed(_losses, ranks, [*common, _PP, "2", *extra, "--job.dump_folder",
                                               str(tmp_path / label.replace(" ", "_"))])[0]
        _close(run, expected, label)


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_zero_bubble_schedules_train_and_validate_as_one_process(tmp_path: Path) -> None:
    """fp32, 10 steps of Llama 3's 6-block debug model (global batch 16, so each step
    accumulates several runs of the schedule), validated at steps 5 and 10: the two zero-bubble
    schedules (each backward split into an input and a weight pass) give one process's losses
    within 1e-5 and its validation losses: ZBVZeroBubble at pipeline 2 (its
    stages in a V: validation needs its own forward order), compiled; InterleavedZeroBubble
    at pipeline 2; data parallel 2 × pipeline 2 with each (FSDP's units gathered from the first
    forward to the last weight pass, every gradient reduced once after the step), the
    interleaved one with full checkpointing. Tiny Qwen3-MoE at data parallel 2 × pipeline 2
    with expert parallel 2 and ZBVZeroBubble: data parallel 2's losses, router losses and loads."""
    from tests.dist_utils import run_distributed

    # (global batch 16: every layout accumulates two or more runs of the schedule a step)
    common = [*TINY_ARGS, "--model.flavor", "debugmodel", "--training.steps", "10",
              "--training.local_batch_size", "4", "--training.global_batch_size", "16",
              "--metrics.no-enable_tensorboard", "--validation.enable", "--validation.freq", "5",
              "--validation.steps", "2", "--validation.local_batch_size", "2"]
    reference = run_distributed(train_history, 1, [*common, "--job.dump_folder", str(tmp_path / "one")])[0]
    zbv, izb = [_SCHEDULE, "ZBVZeroBubble"], [_SCHEDULE, "InterleavedZeroBubble"]
    cases = {
        "pp2 ZBVZeroBubble, compiled": (2, [_PP, "2", *zbv, "--training.local_batch_size", "8", "--compile.enable"]),
        "pp2 InterleavedZeroBubble": (2, [_PP, "2", *izb, "--training.local_batch_size", "8"]),
        # (validation's global batch stays 2 rows: 1 on each data-parallel rank)
        "dp2 x pp2 ZBVZeroBubble": (4, [_PP, "2", *zbv, "--validation.local_batch_size", "1"]),
        "dp2 x pp2 InterleavedZeroBubble, full AC": (4, [_PP, "2", *izb, "--activation_checkpoint.mode", "full",
                                                         "--validation.local_batch_size", "1"]),
    }
    for label, (ranks, extra) in cases.items():
        runs = run_distributed(train_history, ranks, [*common, *extra, "--job.dump_folder",
                                                      str(tmp_path / label.replace(" ", "_").replace(",", ""))])
        assert all([r["loss"] for r in run] == [r["loss"] for r in runs[0]] for run in runs), label
        _close([(r["loss"], r["grad_norm"]) for r in runs[0]], [(r["loss"], r["grad_norm"]) for r in reference],
               label)
        validated = [(r["step"], r["validation_loss"]) for r in runs[0] if r.get("validation_loss") is not None]
        expected = [(r["step"], r["validation_loss"]) for r in reference if r.get("validation_loss") is not None]
        assert [step for step, _ in validated] == [step for step, _ in expected] == [5, 10], (label, validated)
        for (_, ours), (_, theirs) in zip(validated, expected, strict=True):
            assert abs(ours - theirs) <= 1e-5, (label, validated, expected)
    qwen = ["--moe.z_loss_coef", "0.01"]
    data_parallel = run_distributed(train_history, 2, _moe_argv("qwen3_moe", tmp_path / "qdp2", 2, *qwen))[0]
    run = run_distributed(train_history, 4, _moe_argv("qwen3_moe", tmp_path / "qzbv", 4, *qwen, _PP, "2", *zbv,
                                                      "--parallelism.pipeline_parallel_microbatch_size", "2",
                                                      "--parallelism.expert_parallel_degree", "2"))[0]
    _same_moe_history(run, data_parallel, "Qwen3-MoE dp2 x pp2 ZBVZeroBubble, expert parallel 2")


def _auto_pipeline_rank(jobs: dict[str, list[str]], dump: str) -> dict[str, Any]:
    """Each job's three steps on this rank: its losses, the allocator's peak of the second step,
    and what ``auto`` chose for this rank and what FSDP and the blocks were told."""
    import torch

    from tests.fsdp_probes import reshard_kind
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.distributed.activation_checkpoint import checkpoint_policy_of
    from torchtitan_lite.memory.measure import AllocatorPeak
    from torchtitan_lite.trainer import Trainer

    results = {}
    for label, argv in jobs.items():
        with AllocatorPeak(torch.device("cpu")) as memory:
            trainer = Trainer(load_job_config([*argv, "--job.dump_folder", f"{dump}/{label}"]))
            losses = [trainer.train_step()["loss"]]
            with memory.window():
                losses.append(trainer.train_step()["loss"])
            losses.append(trainer.train_step()["loss"])
        plan = trainer.reshard_plan
        blocks = dict(trainer.model.layers.items())
        units = {name: trainer.model.get_submodule(name.split("+")[0]) for name in (plan.units if plan else ())}
        results[label] = {
            "losses": losses, "peak": memory.peak, "pp_rank": trainer.mesh.pp_rank,
            "plan": None if plan is None else {"units": plan.units, "reshard": plan.reshard,
                                               "policies": plan.ac_policies, "peak": plan.peak},
            "told": {name: reshard_kind(module) for name, module in units.items()},
            "policies": tuple(checkpoint_policy_of(block) for block in blocks.values()),
        }
        trainer.metrics.close()  # the process group stays: the next trainer uses it
    return results


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_auto_plans_each_pipeline_ranks_own_stages_under_the_budget(tmp_path: Path) -> None:
    """``reshard_after_forward_mode = "auto"`` at data parallel 2 × pipeline 2 (debug model, seq
    512, fp32): each pipeline rank plans its own stages (its units, its micro-batches in flight)
    under one per-rank budget set between the two ranks' peaks without resharding. The first
    pipeline rank (the embedding and three blocks) must act, the second must not; each rank's
    FSDP units and blocks get its rank's plan, the losses are those of ``never``, and the
    allocator's peak of a real step on every rank is within the budget."""
    from tests.dist_utils import run_distributed
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.job import plan_job
    from torchtitan_lite.memory.estimate import estimate_stages, job_estimate_shape

    job = [*TINY_ARGS, "--model.flavor", "debugmodel", "--training.seq_len", "512", "--training.local_batch_size",
           "4", "--validation.no-enable", "--metrics.no-enable_tensorboard", _PP, "2"]
    never = [*job, "--parallelism.reshard_after_forward_mode", "never"]
    config = load_job_config([*never, "--job.dump_folder", "/nonexistent/estimate"])
    plan = plan_job(config, world_size=4)
    peaks = [e.peak for e in estimate_stages(plan.spec, plan.model_args, reshard_after_forward_mode="never",
                                             shape=job_estimate_shape(plan))]
    assert peaks[0] > peaks[1] * 1.2, peaks  # (the first rank holds the embedding's and more activations)
    budget = (peaks[0] + peaks[1]) / 2 / 2**30
    auto = [*job, "--parallelism.reshard_after_forward_mode", "auto", "--parallelism.memory_budget_gib", repr(budget)]
    ranks = run_distributed(_auto_pipeline_rank, 4, {"never": never, "auto": auto}, str(tmp_path), timeout=600)
    print(f"\nestimated peaks without resharding {[round(p / 2**20, 2) for p in peaks]} MiB, budget "
          f"{budget * 1024:.2f} MiB")
    for rank in ranks:
        chosen, pp_rank = rank["auto"]["plan"], rank["auto"]["pp_rank"]
        told = {u: "full" if r else "none" for u, r in zip(chosen["units"], chosen["reshard"], strict=True)}
        print(f"rank of pp rank {pp_rank}: resharded {[u for u, kind in told.items() if kind == 'full']}, "
              f"checkpointing {chosen['policies']}, estimated {chosen['peak'] / 2**20:.2f} MiB, measured "
              f"{rank['auto']['peak'] / 2**20:.2f} MiB (never measured {rank['never']['peak'] / 2**20:.2f} MiB)")
        # this rank's own stages: the first pipeline rank's units begin with the embedding
        assert (chosen["units"][0] == "tok_embeddings") == (pp_rank == 0), chosen["units"]
        assert (chosen["units"][-1] == "norm+output") == (pp_rank == 1), chosen["units"]
        acted = any(chosen["reshard"]) or set(chosen["policies"]) != {"none"}
        assert acted == (pp_rank == 0), chosen
        assert rank["auto"]["told"] == told
        assert rank["auto"]["policies"] == chosen["policies"]
        assert rank["auto"]["peak"] <= budget * 2**30, (pp_rank, rank["auto"]["peak"], budget)
        assert rank["auto"]["losses"] == pytest.approx(rank["never"]["losses"], rel=1e-6)
    assert any(rank["never"]["peak"] > budget * 2**30 for rank in ranks)  # the budget binds


def _moe_argv(model: str, dump: Path, local_batch_size: int, *extra: str) -> list[str]:
    return ["--model.name", model, "--model.flavor", "tiny", "--training.seq_len", "32", "--training.steps", "10",
            "--training.global_batch_size", "8", "--training.local_batch_size", str(local_batch_size),
            "--training.no-shuffle", "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps",
            "2", "--metrics.log_freq", "1", "--metrics.no-enable_tensorboard", "--validation.no-enable",
            "--moe.aux_loss_coef", "0.1", "--job.dump_folder", str(dump), *extra]


def _same_moe_history(run: list[dict[str, Any]], reference: list[dict[str, Any]], label: str) -> None:
    """Losses, router losses and every layer's load within 1e-5; gradient norms within 1e-4."""
    _close([(r["loss"], r["grad_norm"]) for r in run], [(r["loss"], r["grad_norm"]) for r in reference], label)
    for ours, theirs in zip(run, reference, strict=True):
        keys = {key for key in theirs if key.startswith("moe/")}
        assert keys == {key for key in ours if key.startswith("moe/")} and "moe/aux_loss" in keys, (label, keys)
        for key in keys:
            assert abs(ours[key] - theirs[key]) <= 1e-5 * max(1.0, abs(theirs[key])), (label, key, ours, theirs)


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_mixtures_of_experts_train_through_the_stages_as_one_process(tmp_path: Path) -> None:
    """fp32, 10 steps, global batch 8 in micro-batches of 2 rows (the load-balancing loss is one
    over each global micro-batch, so the reference accumulates the same micro-batches).

    Tiny Qwen3-MoE (2 MoE blocks, softmax router, aux 0.1, z-loss 0.01): pipeline 4 with 1F1B,
    pipeline 2 with Interleaved1F1B and full checkpointing, with GPipe, and pipeline 2 × tensor
    parallel 2 give one process's losses, aux and z losses and every layer's load within 1e-5;
    data parallel 2 × pipeline 2, also with expert parallel 2 (each stage's experts split over
    its two data-parallel ranks), those of data parallel 2. Tiny DeepSeek-V3 (a dense block, then
    2 MoE blocks of a sigmoid router with bias balancing 0.01, aux 0.1): pipeline 4 with 1F1B,
    whose first and last stages hold no MoE layer, pipeline 2 with Interleaved1F1B (4 stages of
    one layer), and pipeline 2 with GPipe, whose checkpoint at step 5 (each stage's router
    biases) resumes in one process with the later steps of the run that never stopped."""
    from tests.dist_utils import run_distributed

    qwen = ["--moe.z_loss_coef", "0.01"]
    reference = run_distributed(train_history, 1, _moe_argv("qwen3_moe", tmp_path / "q1", 2, *qwen))[0]
    data_parallel = run_distributed(train_history, 2, _moe_argv("qwen3_moe", tmp_path / "qdp2", 2, *qwen))[0]
    stages = [_PP, "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
    cases = {
        "Qwen3-MoE pp4 1F1B": (4, _moe_argv("qwen3_moe", tmp_path / "q4", 8, *qwen, _PP, "4",
                                            "--parallelism.pipeline_parallel_microbatch_size", "2"), reference),
        "Qwen3-MoE pp2 Interleaved1F1B, full AC": (2, _moe_argv("qwen3_moe", tmp_path / "qi", 8, *qwen, *stages,
                                                                _SCHEDULE, "Interleaved1F1B",
                                                                "--activation_checkpoint.mode", "full"), reference),
        "Qwen3-MoE dp2 x pp2": (4, _moe_argv("qwen3_moe", tmp_path / "qdp2pp2", 4, *qwen, *stages), data_parallel),
        "Qwen3-MoE pp2 GPipe": (2, _moe_argv("qwen3_moe", tmp_path / "qg", 8, *qwen, *stages, _SCHEDULE, "GPipe"),
                                reference),
        "Qwen3-MoE pp2 x tp2": (4, _moe_argv("qwen3_moe", tmp_path / "qtp2", 8, *qwen, *stages,
                                             "--parallelism.tensor_parallel_degree", "2"), reference),
        "Qwen3-MoE dp2 x pp2, expert parallel 2": (4, _moe_argv("qwen3_moe", tmp_path / "qep2", 4, *qwen, *stages,
                                                               "--parallelism.expert_parallel_degree", "2"),
                                                   data_parallel),
    }
    for label, (ranks, argv, expected) in cases.items():
        runs = run_distributed(train_history, ranks, argv)
        assert all([r["loss"] for r in run] == [r["loss"] for r in runs[0]] for run in runs), label
        _same_moe_history(runs[0], expected, label)

    deepseek = ["--moe.bias_update_rate", "0.01", "--parallelism.pipeline_parallel_first_stage_less_layers", "0"]
    reference = run_distributed(train_history, 1, _moe_argv("deepseek_v3", tmp_path / "d1", 2, *deepseek))[0]
    four = run_distributed(train_history, 4, _moe_argv("deepseek_v3", tmp_path / "d4", 8, *deepseek, _PP, "4",
                                                       "--parallelism.pipeline_parallel_microbatch_size", "2"))[0]
    _same_moe_history(four, reference, "DeepSeek-V3 pp4 1F1B")
    looped = run_distributed(train_history, 2, _moe_argv("deepseek_v3", tmp_path / "di", 8, *deepseek, *stages,
                                                         _SCHEDULE, "Interleaved1F1B"))[0]
    _same_moe_history(looped, reference, "DeepSeek-V3 pp2 Interleaved1F1B")
    saved = ["--checkpoint.enable", "--checkpoint.interval", "5"]
    two = run_distributed(train_history, 2, _moe_argv("deepseek_v3", tmp_path / "d2", 8, *deepseek, *stages,
                                                      _SCHEDULE, "GPipe", *saved))[0]
    _same_moe_history(two, reference, "DeepSeek-V3 pp2 GPipe")
    shutil.copytree(tmp_path / "d2" / "checkpoint" / "step-5", tmp_path / "resumed" / "checkpoint" / "step-5")
    resumed = run_distributed(train_history, 1, _moe_argv("deepseek_v3", tmp_path / "resumed", 2, *deepseek,
                                                          *saved))[0]
    _same_moe_history(resumed, reference[5:], "DeepSeek-V3 pp2 resumed in one process")


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_lora_at_pipeline_2_exports_the_adapters_of_both_stages_as_peft_loads_them(tmp_path: Path) -> None:
    """LoRA on every linear of the tiny Llama from a Hugging Face base, 5 steps at pipeline 2 (one
    block a stage): the last save is one PEFT adapter folder holding both stages' adapters, the
    same keys and values (within 1e-5) as one process's, and PEFT on transformers' base model
    gives the logits of one process's trained model within 1e-5."""
    peft = pytest.importorskip("peft")
    import torch
    from safetensors.torch import load_file

    from tests.dist_utils import run_distributed
    from tests.test_lora import _hf_model, _lora_args, _save_base

    base = _save_base(tmp_path / "base")
    common = ["--training.global_batch_size", "4", "--training.local_batch_size", "4"]
    one = run_distributed(_losses, 1, _lora_args(tmp_path / "one", base, *common))[0]
    staged = run_distributed(_losses, 2, _lora_args(tmp_path / "pp2", base, *common, _PP, "2",
                                                    "--parallelism.pipeline_parallel_first_stage_less_layers", "0",
                                                    "--parallelism.pipeline_parallel_last_stage_less_layers", "0"))[0]
    _close(staged, one, "LoRA at pp2")
    ours, theirs = (load_file(str(tmp_path / run / "checkpoint" / "step-5" / "adapter_model.safetensors"))
                    for run in ("pp2", "one"))
    assert sorted(ours) == sorted(theirs) and any(".layers.0." in k for k in ours) and any(
        ".layers.1." in k for k in ours), sorted(ours)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, atol=1e-5, rtol=1e-5)
    tokens = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        staged_logits = peft.PeftModel.from_pretrained(_hf_model(base), str(tmp_path / "pp2" / "checkpoint" /
                                                                          "step-5"))(tokens).logits
        one_logits = peft.PeftModel.from_pretrained(_hf_model(base), str(tmp_path / "one" / "checkpoint" /
                                                                       "step-5"))(tokens).logits
    torch.testing.assert_close(staged_logits, one_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_mixture_at_pipeline_2_reports_each_sources_loss_as_one_process(tmp_path: Path) -> None:
    """A mixture of two sources (3:1), fp32, 4 steps at pipeline 2 (2 ranks): the loss and each
    source's loss (``loss/NAME``, from the last stage's micro-batches) equal one process's within
    1e-5."""
    from tests.dist_utils import run_distributed

    (tmp_path / "job.toml").write_text(
        '[[training.datasets]]\nname = "code"\ndataset = "python_stdlib"\nweight = 3\n\n'
        '[[training.datasets]]\nname = "held_out"\ndataset = "python_stdlib_validation"\nweight = 1\n')
    common = ["--job.config_file", str(tmp_path / "job.toml"), *TINY_ARGS, "--training.global_batch_size", "4",
              "--training.local_batch_size", "4", "--metrics.no-enable_tensorboard"]
    reference = run_distributed(train_history, 1, [*common, "--job.dump_folder", str(tmp_path / "one")])[0]
    staged = run_distributed(train_history, 2, [*common, _PP, "2", "--job.dump_folder", str(tmp_path / "pp2")])[0]
    for ours, theirs in zip(staged, reference, strict=True):
        for key in ("loss", "loss/code", "loss/held_out"):
            if theirs[key] is None:
                assert ours[key] is None, (key, ours, theirs)
                continue
            assert abs(ours[key] - theirs[key]) <= 1e-5, (key, ours, theirs)
    assert any(r["loss/held_out"] is not None for r in reference)


def test_lora_with_a_blockless_stage_is_refused_in_one_line() -> None:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.errors import ConfigError
    from torchtitan_lite.job import plan_job

    config = load_job_config([*TINY_ARGS, _PP, "4", "--training.local_batch_size", "4", "--lora.enable",
                              "--parallelism.pipeline_parallel_first_stage_less_layers", "1"])
    with pytest.raises(ConfigError, match="with LoRA every stage needs a block to adapt"):
        plan_job(config, world_size=4)


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
def test_the_memory_cli_prints_each_pipeline_ranks_stages_and_estimate(tmp_path: Path, capsys: Any) -> None:
    """Pipeline 2 × data parallel 2 of the debug model, Interleaved1F1B: the CLI names each rank's
    stages and prints one row per pipeline rank; the first rank (the embedding, and the most
    micro-batches in flight) holds more activations than the second; the JSON has both."""
    import json

    from torchtitan_lite.memory.cli import main as memory_main

    out = tmp_path / "plan.json"
    assert memory_main(["--model.flavor", "debugmodel", "--training.local_batch_size", "4", "--training.seq_len",
                        "128", _PP, "2", _SCHEDULE, "Interleaved1F1B", "--world_size", "4", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "pipeline 2: Interleaved1F1B, 4 micro-batches of 1 row per local batch, 4 stages" in lines, lines
    assert "  pp rank 0: stage 0 (embedding, block 0); stage 2 (blocks 3-4)" in lines, lines
    assert "  pp rank 1: stage 1 (blocks 1-2); stage 3 (block 5, norm, output)" in lines, lines
    table = lines.index("per pipeline rank, reshard_after_forward_mode 'default', in MiB")
    assert [line.split()[0] for line in lines[table + 2:table + 4]] == ["0", "1"], lines[table:]
    ranks = json.loads(out.read_text())["pipeline_ranks"]
    assert [r["pipeline_rank"] for r in ranks] == [0, 1] and all(r["pipeline_degree"] == 2 for r in ranks)
    assert ranks[0]["device_categories"]["activations"] > ranks[1]["device_categories"]["activations"]


def test_checkpoints_saved_before_the_flattened_optimizer_state_still_load(tmp_path: Path) -> None:
    """A DCP checkpoint whose optimizer state is nested (its parameter groups a list, as saves
    before this version wrote it) loads into a fresh model and optimizer with every moment equal."""
    from tests.dist_utils import run_distributed

    assert run_distributed(_nested_roundtrip, 1, str(tmp_path))[0] == "ok"


def _nested_roundtrip(folder: str) -> str:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from torchtitan_lite.checkpoint.storage import CheckpointStorage

    torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{folder}/pg")
    try:
        def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
            return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

        model, optimizer = build()
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=f"{folder}/ckpt")
        fresh, fresh_optimizer = build()
        storage = CheckpointStorage(model=fresh, optimizer=fresh_optimizer, model_spec=None, lora=None, hf_extras=None)
        storage.load_dcp(Path(f"{folder}/ckpt"), {"model", "optimizer"})
        for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(optimizer.state[p][key], fresh_optimizer.state[q][key]), key
        return "ok"
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble", "Interleaved1F1B"])
def test_tied_embeddings_through_pipeline_stages_equal_one_process(tmp_path: Path, schedule: str) -> None:
    """Qwen3's tied embeddings (the tiny flavor, one weight for the embedding and the output
    projection), fp32, 10 steps at pipeline 2: 1F1B and Interleaved1F1B put the two on two ranks,
    each with a copy whose gradients are summed between them and counted once in the gradient
    norm; ZBVZeroBubble puts both on rank 0. Losses, gradient norms and the validation loss are
    one process's within 1e-5, and the two copies end equal."""
    argv = [*TINY_ARGS, "--model.name", "qwen3", "--training.steps", "10", "--training.local_batch_size", "4",
            "--training.global_batch_size", "4", "--optimizer.lr", "1e-2", "--validation.enable",
            "--validation.steps", "1", "--validation.freq", "5", "--validation.local_batch_size", "4",
            "--metrics.no-enable_tensorboard"]
    one = train_history([*argv, "--job.dump_folder", str(tmp_path / "one")])
    many = run_distributed(_tied_history, 2, [*argv, "--job.dump_folder", str(tmp_path / "pp"),
                                              "--parallelism.pipeline_parallel_degree", "2",
                                              "--parallelism.pipeline_parallel_schedule", schedule,
                                              "--parallelism.pipeline_parallel_microbatch_size", "1"])
    assert len(one) == 10 and any("validation_loss" in r for r in one)
    for history, _ in many:
        for a, b in zip(history, one, strict=True):
            for key in ("loss", "grad_norm", "validation_loss"):
                if key in b:
                    assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (schedule, key, a, b)
    copies = [weight for _, weight in many if weight is not None]
    assert copies and all(torch.equal(copies[0], w) for w in copies)


def _tied_history(argv: list[str]) -> tuple[list[dict[str, Any]], torch.Tensor | None]:
    """Train; the history and this rank's copy of the tied weight, whole (None: it holds none)."""
    from torch.distributed.tensor import DTensor

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    try:
        history = trainer.train()
        module = trainer.model.tok_embeddings or trainer.model.output
        weight = None if module is None else module.weight
        if isinstance(weight, DTensor):
            weight = weight.full_tensor()
        return history, None if weight is None else weight.detach().clone()
    finally:
        trainer.close()


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_tied_embeddings_load_and_export_through_pipeline_stages(tmp_path: Path) -> None:
    """A tied Qwen3 from a Hugging Face folder at pipeline 2 (1F1B): the last stage's copy reads
    the embedding's tensor (the folder has no lm_head), 3 steps give one process's losses within
    1e-5, and the last save's Hugging Face export (the weight written once, by the first stage's
    rank) equals one process's within 1e-5."""
    from safetensors.torch import load_file

    from tests.test_data_chat import write_chat_tokenizer
    from tests.test_dpo import _hf_folder

    write_chat_tokenizer(tmp_path / "tok", "qwen3")
    _hf_folder(tmp_path / "hf", "qwen3", 7, tmp_path / "tok")
    argv = [*TINY_ARGS, "--model.name", "qwen3", "--model.flavor", "from_checkpoint",
            "--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf",
            "--model.tokenizer_path", str(tmp_path / "hf"), "--training.steps", "3", "--training.local_batch_size",
            "4", "--training.global_batch_size", "4", "--metrics.no-enable_tensorboard", "--checkpoint.enable",
            "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only"]
    one = train_history([*argv, "--job.dump_folder", str(tmp_path / "one")])
    pp = run_distributed(train_history, 2, [*argv, "--job.dump_folder", str(tmp_path / "pp"),
                                            "--parallelism.pipeline_parallel_degree", "2",
                                            "--parallelism.pipeline_parallel_microbatch_size", "1"])[0]
    for a, b in zip(pp, one, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (a, b)
    exports = []
    for run in ("one", "pp"):
        tensors: dict[str, torch.Tensor] = {}
        for file in (tmp_path / run / "checkpoint" / "step-3").glob("*.safetensors"):
            tensors.update(load_file(file))
        exports.append(tensors)
    assert sorted(exports[0]) == sorted(exports[1]) and "lm_head.weight" not in exports[1]
    for name, tensor in exports[0].items():
        assert torch.allclose(tensor, exports[1][name], atol=1e-5), name


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_a_tied_checkpoint_moves_between_pipeline_stages_and_one_process(tmp_path: Path) -> None:
    """A tied Qwen3 (tiny), fp32, 6 steps saved at step 3: pipeline 2 (1F1B: the output's copy on
    the last stage's rank, its optimizer state saved under its own name) resumed on one process,
    and one process (the weight and its state under the embedding's name only) resumed at
    pipeline 2 (the copy's state read from the embedding's), repeat steps 4-6 of the run that
    never stopped within 1e-5."""
    import shutil

    argv = [*TINY_ARGS, "--model.name", "qwen3", "--training.steps", "6", "--training.local_batch_size", "4",
            "--training.global_batch_size", "4", "--optimizer.lr", "1e-2", "--metrics.no-enable_tensorboard",
            "--checkpoint.enable", "--checkpoint.interval", "3"]
    stages = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"]
    piped = run_distributed(train_history, 2, [*argv, "--job.dump_folder", str(tmp_path / "pp"), *stages])[0]
    whole = train_history([*argv, "--job.dump_folder", str(tmp_path / "one")])
    runs = {}
    for name, source, layout in (("pp to one", "pp", []), ("one to pp", "one", stages)):
        dump = tmp_path / name.replace(" ", "_")
        shutil.copytree(tmp_path / source / "checkpoint" / "step-3", dump / "checkpoint" / "step-3")
        argv_resumed = [*argv, "--job.dump_folder", str(dump), *layout]
        runs[name] = (run_distributed(train_history, 2, argv_resumed)[0] if layout else train_history(argv_resumed),
                      piped if source == "pp" else whole)
    for name, (resumed, uninterrupted) in runs.items():
        assert [r["step"] for r in resumed] == [4, 5, 6], name
        for a, b in zip(resumed, uninterrupted[3:], strict=True):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (name, key, a, b)
