"""DPO on every axis (docs/fine-tuning.md): mixture-of-experts models, tiny Qwen3-MoE and
DeepSeek-V3 made by ``transformers``, against TRL's ``DPOTrainer`` (1.16, the dev extra), the
router's load-balancing loss counted over the pairs' tokens and not their padding, as
transformers' is; expert parallel and LoRA on the experts against one process; context parallel
(each sequence split over the ranks, its log-probabilities summed over them) against one
process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_utils import run_distributed, train_history
from tests.test_data_chat import write_chat_tokenizer
from tests.test_dpo import CONVERSATIONAL, _rule_pairs
from tests.test_trainer_moe import hf_qwen3_moe

trl = pytest.importorskip("trl")

VOCAB = 512  # (above the test tokenizer's ids)


def _folder(tmp_path: Path, family: str, **config: Any) -> Path:
    """A tiny transformers model of ``family`` with the test tokenizer beside it."""
    write_chat_tokenizer(tmp_path / "tok", "qwen3")
    if family == "qwen3_moe":
        folder = hf_qwen3_moe(tmp_path / "hf", vocab_size=VOCAB, **config)
    else:
        from tests.test_deepseek_v3 import _hf_model

        folder = _hf_model(tmp_path / "hf", vocab_size=VOCAB, q_lora_rank=32, **config)
    for file in (tmp_path / "tok").iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def _argv(folder: Path, pairs: Path, dump: Path, *extra: str, family: str = "qwen3_moe") -> list[str]:
    return ["--model.name", family, "--model.flavor", "from_checkpoint", "--checkpoint.initial_load_path",
            str(folder), "--checkpoint.initial_load_in_hf", "--model.tokenizer_path", str(folder),
            "--training.dataset", "preference", "--training.dataset_path", str(pairs), "--training.seq_len", "127",
            "--training.no-shuffle", "--training.mixed_precision_param", "float32", "--optimizer.lr", "1e-3",
            "--lr_scheduler.warmup_steps", "1", "--validation.no-enable", "--metrics.log_freq", "1",
            "--metrics.no-enable_tensorboard", "--debug.deterministic", "--job.dump_folder", str(dump), *extra]


def _trl_step(folder: Path, rows: list[dict[str, Any]], out: Path) -> tuple[float, float]:
    """TRL's DPO loss (the load-balancing term included where its config turns it on) and
    gradient norm of one batch of every row, the reference a copy of the policy."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(output_dir=str(out), per_device_train_batch_size=len(rows), beta=0.1, loss_type=["sigmoid"],
                       max_length=128, report_to=[], use_cpu=True, bf16=False, logging_steps=1)
    policy = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    trainer = DPOTrainer(model=policy, args=config, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(str(folder)))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return float(loss), float(torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1e9))


_TRL_CASES = {  # name: (family, the transformers config's changes, TRL adds its load-balancing loss)
    "qwen3_moe, load-balancing loss on": ("qwen3_moe", {"router_aux_loss_coef": 0.05}, True),
    "qwen3_moe, load-balancing loss off": ("qwen3_moe", {"router_aux_loss_coef": 0.0}, False),
    "deepseek_v3": ("deepseek_v3", {}, False),  # (transformers' DeepSeek-V3 has no auxiliary loss)
}


@pytest.mark.slow
@pytest.mark.parametrize("case", [name if name.startswith("qwen3_moe, load-balancing loss on")
                                  else pytest.param(name, marks=pytest.mark.scenario) for name in _TRL_CASES])
def test_a_dpo_step_of_an_moe_model_equals_trls_dpo_trainer(tmp_path: Path, case: str) -> None:
    """One process, fp32, the four conversational pairs of different lengths in one micro-batch
    (padded to 128 tokens; TRL pads to the longest), a frozen copy of the starting weights as the
    reference: the first step's loss (with the router's load-balancing term weighted by the
    model's ``router_aux_loss_coef``, counted over the pairs' tokens only) and gradient norm equal
    TRL's ``DPOTrainer`` within 1e-5."""
    family, config, aux = _TRL_CASES[case]
    folder = _folder(tmp_path, family, **config)
    theirs, their_norm = _trl_step(folder, CONVERSATIONAL, tmp_path / "trl")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in CONVERSATIONAL))
    n = str(len(CONVERSATIONAL))
    ours = train_history(_argv(folder, pairs, tmp_path / "ours", "--training.steps", "1", "--training.local_batch_size",
                               n, "--training.global_batch_size", n, family=family))[0]
    coef = config.get("router_aux_loss_coef", 0.0)
    assert ("moe/aux_loss" in ours) == aux
    loss = ours["loss"] + coef * ours.get("moe/aux_loss", 0.0)
    assert abs(loss - theirs) <= 1e-5 * max(1.0, abs(theirs)), (case, ours, theirs)
    assert abs(ours["grad_norm"] - their_norm) <= 1e-5 * their_norm, (case, ours["grad_norm"], their_norm)
    if aux:  # (the padding's tokens would have moved the term: it is the pairs' alone)
        assert ours["moe/aux_loss"] > 0 and abs(loss - ours["loss"]) > 1e-4


_LORA = ["--lora.enable", "--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", "q_proj,v_proj,experts"]
_LAYOUTS = {  # name: (ranks, the model's arguments, for one process too)
    "expert parallel 2": (2, []),
    "expert parallel 4": (4, []),
    "LoRA on the experts, adapters off, expert parallel 2": (2, _LORA),
}


@pytest.mark.slow
@pytest.mark.scenario  # (expert parallel's DPO path is SFT's: tests/test_expert_parallel.py in the default selection)
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_dpo_of_an_moe_model_at_expert_parallel_equals_one_process(tmp_path: Path, layout: str) -> None:
    """A tiny Qwen3-MoE (8 experts, top 2, load-balancing loss 0.05) on rule pairs, 4 steps of 4
    pairs (one micro-batch of them over the ranks), the reference a frozen copy (LoRA: the
    adapters switched off): with the experts spread over 2 or 4 ranks the losses, load-balancing
    terms, margins and gradient norms are one process's within 1e-5."""
    ranks, model = _LAYOUTS[layout]
    folder = _folder(tmp_path, "qwen3_moe", router_aux_loss_coef=0.05)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in _rule_pairs(16)))
    common = ["--training.steps", "4", "--training.global_batch_size", "4", *model]
    one = train_history(_argv(folder, pairs, tmp_path / "one", *common, "--training.local_batch_size", "4"))
    many = run_distributed(train_history, ranks, _argv(
        folder, pairs, tmp_path / "many", *common, "--training.local_batch_size", str(4 // ranks),
        "--parallelism.expert_parallel_degree", str(ranks)))[0]
    assert len(one) == len(many) == 4 and one[-1]["dpo/margin"] != 0
    for a, b in zip(many, one, strict=True):
        for key in ("loss", "grad_norm", "moe/aux_loss", "dpo/margin", "dpo/accuracy"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (layout, key, a, b)


def _dense_folder(tmp_path: Path, family: str = "llama3") -> Path:
    from tests.test_dpo import _hf_folder

    write_chat_tokenizer(tmp_path / "tok", family)
    _hf_folder(tmp_path / "hf", family, 7, tmp_path / "tok")
    return tmp_path / "hf"


_CP = {  # name: (ranks, family, arguments for every run, the layout's)
    "cp2 allgather, sigmoid": (2, "llama3", [], ["--parallelism.context_parallel_degree", "2"]),
    "cp4 ulysses, hinge": (4, "llama3", ["--dpo.loss_type", "hinge"],
                           ["--parallelism.context_parallel_degree", "4", "--parallelism.context_parallel_method",
                            "ulysses"]),
    "dp2 x cp2, ipo, LoRA adapters off": (4, "llama3", ["--dpo.loss_type", "ipo", *_LORA[:-2],
                                                       "--lora.target_modules", "q_proj,v_proj"],
                                          ["--parallelism.context_parallel_degree", "2"]),
    "hsdp 2 x cp2": (4, "llama3", [], ["--parallelism.data_parallel_replicate_degree", "2",
                                       "--parallelism.context_parallel_degree", "2"]),
    "qwen3 cp2 ulysses, LoRA adapters off": (2, "qwen3", [*_LORA[:-2], "--lora.target_modules", "q_proj,v_proj"],
                                             ["--parallelism.context_parallel_degree", "2",
                                              "--parallelism.context_parallel_method", "ulysses"]),
    "qwen3_moe cp2, load-balancing loss": (2, "qwen3_moe", [], ["--parallelism.context_parallel_degree", "2"]),
}
_PACKED = ["--model.attention_mask", "block_causal", "--dpo.packing"]
_CP.update({  # the same on packed pairs (block-causal attention, several pairs a row)
    "packed cp2 allgather, sigmoid": (2, "llama3", _PACKED, ["--parallelism.context_parallel_degree", "2"]),
    **{f"packed {name}": (ranks, family, [*_PACKED, *common], layout)
       for name, (ranks, family, common, layout) in _CP.items() if not name.startswith(("cp2 allgather", "qwen3_moe"))},
})


@pytest.mark.slow
@pytest.mark.parametrize("case", [name if name.startswith(("cp2 allgather", "packed cp2 allgather"))
                                  else pytest.param(name, marks=pytest.mark.scenario) for name in _CP])
def test_dpo_at_context_parallel_equals_one_process(tmp_path: Path, case: str) -> None:
    """Pairs of 10 to 110 tokens (the conversational set, 16 pairs) in rows of 128, 4 steps of 4
    pairs, or packed (1 to 3 whole pairs in each row of 256, block-causal), 10 steps of 2 rows; a
    frozen copy as the reference (LoRA: its adapters off): with each sequence split over 2 or 4
    context-parallel ranks (load-balanced chunks; all-gathered keys and values, or Ulysses'
    all-to-all), beside data parallel or HSDP, its log-probabilities (and IPO's token counts)
    summed over the ranks, the losses, margins, reward accuracies and gradient norms are one
    process's within 1e-5; and a Qwen3-MoE's load-balancing term too (its token flags split with
    the sequence)."""
    ranks, family, common, layout = _CP[case]
    if family != "qwen3_moe":
        folder = _dense_folder(tmp_path, family)
    else:
        folder = _folder(tmp_path, "qwen3_moe", router_aux_loss_coef=0.05)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONAL * 4))
    packed = case.startswith("packed")
    steps, batch = (10, 2) if packed else (10, 4)
    args = ["--training.steps", str(steps), "--training.global_batch_size", str(batch), "--training.seq_len",
            "256" if packed else "128", *common]
    dp = 2 if case.removeprefix("packed ").startswith(("dp2", "hsdp")) else 1
    one = train_history(_argv(folder, pairs, tmp_path / "one", *args, "--training.local_batch_size", str(batch),
                              family=family))
    many = run_distributed(train_history, ranks, _argv(folder, pairs, tmp_path / "many", *args, *layout,
                                                       "--training.local_batch_size", str(batch // dp), family=family))
    keys = ["loss", "grad_norm", "dpo/margin", "dpo/accuracy", "dpo/logps_chosen"]
    keys += ["moe/aux_loss"] if family == "qwen3_moe" else []
    keys += ["dpo/pairs"] if packed else []
    assert one[-1]["dpo/margin"] != 0
    assert not packed or all(3 <= r["dpo/pairs"] <= 6 for r in one)  # (whole pairs, several a row)
    for history in many:
        assert len(history) == len(one) == steps
        for a, b in zip(history, one, strict=True):
            for key in keys:
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (case, key, a, b)


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_a_dpo_checkpoint_at_dp2_by_cp2_resumes_at_one_process(tmp_path: Path) -> None:
    """4 steps at data parallel 2 × context parallel 2, saved at step 2 (DCP); the step-2
    checkpoint resumed on one process repeats steps 3 and 4 (loss, margin, gradient norm) within
    1e-5 (the frozen copy rebuilt from the starting weights)."""
    folder = _dense_folder(tmp_path)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONAL * 4))
    args = ["--training.steps", "4", "--training.global_batch_size", "4", "--training.seq_len", "128",
            "--checkpoint.enable", "--checkpoint.interval", "2"]
    whole = run_distributed(train_history, 4, _argv(folder, pairs, tmp_path / "whole", *args,
                                                    "--parallelism.context_parallel_degree", "2",
                                                    "--training.local_batch_size", "2", family="llama3"))[0]
    dump = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
    resumed = train_history(_argv(folder, pairs, dump, *args, "--training.local_batch_size", "4", family="llama3"))
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(resumed, whole[2:], strict=True):
        for key in ("loss", "grad_norm", "dpo/margin"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (key, a, b)


def _four_block_folder(tmp_path: Path) -> Path:
    """The tiny Llama with 6 blocks (two stages a rank for the interleaved and V schedules), from
    seed 7, as a Hugging Face folder with the test tokenizer."""
    import dataclasses

    from torchtitan_lite.checkpoint import hf_storage
    from torchtitan_lite.distributed.parallelize import build_sharded_model
    from torchtitan_lite.models import get_model_spec

    write_chat_tokenizer(tmp_path / "tok", "llama3")
    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.model_args("tiny"), vocab_size=VOCAB, n_layers=6)
    model = build_sharded_model(spec, args, None, device=torch.device("cpu"), seed=7, sharded=False)
    hf_storage.save_hf_weights(model, tmp_path / "hf", spec=spec)
    for file in (tmp_path / "tok").iterdir():
        shutil.copy(file, tmp_path / "hf" / file.name)
    return tmp_path / "hf"


_PP = {  # name: (ranks, arguments for every run, the layout's)
    "pp2 1F1B, sigmoid, frozen copy": (2, [], ["--parallelism.pipeline_parallel_schedule", "1F1B"]),
    "pp2 Interleaved1F1B, ipo, LoRA adapters off": (
        2, ["--dpo.loss_type", "ipo", *_LORA[:-2], "--lora.target_modules", "q_proj,v_proj"],
        ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    "pp2 ZBVZeroBubble, hinge": (2, ["--dpo.loss_type", "hinge"],
                                 ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]),
    "dp2 x pp2 1F1B": (4, [], ["--parallelism.pipeline_parallel_schedule", "1F1B"]),
}
_PP.update({f"packed {name}": (ranks, [*_PACKED, *common], layout) for name, (ranks, common, layout) in _PP.items()
            if "Interleaved" not in name})
_PP["qwen3_moe pp2 1F1B, load-balancing loss"] = (2, [], ["--parallelism.pipeline_parallel_schedule", "1F1B"])
_PP["qwen3_moe dp2 x pp2 1F1B, packed, LoRA on the experts"] = (
    4, [*_PACKED, *_LORA], ["--parallelism.pipeline_parallel_schedule", "1F1B"])


@pytest.mark.slow
@pytest.mark.parametrize("case", [name if name.startswith("pp2 1F1B")
                                  else pytest.param(name, marks=pytest.mark.scenario) for name in _PP])
def test_dpo_through_pipeline_stages_equals_one_process(tmp_path: Path, case: str) -> None:
    """A 6-block tiny Llama, the conversational pairs (16) in rows of 128, 3 steps of 4 pairs in
    pipeline micro-batches of 2 pairs (each pair's rows together), with validation on 4 pairs
    after step 2: the reference's forward through a forward-only schedule of its stages (the
    frozen copy's, or the policy's with the adapters off), then the policy's through the training
    schedule, the pair loss on the last stage. Losses, margins, gradient norms and the validation
    loss are one process's within 1e-5, for 1F1B, Interleaved1F1B and ZBVZeroBubble at pipeline
    2, and data parallel 2 × pipeline 2; and on packed pairs (rows of 256, 4 rows a step,
    pipeline micro-batches of 2 rows: each stage's attention takes its rows' document ids). A
    4-layer Qwen3-MoE (load-balancing loss 0.05, counted over the pairs' tokens, not their
    padding, as without a pipeline) at pipeline 2, and packed with LoRA on the experts at data
    parallel 2 × pipeline 2: also the load-balancing term, against the same micro-batches
    accumulated without a pipeline (the term is one per global micro-batch)."""
    ranks, common, layout = _PP[case]
    packed = case.startswith("packed") or "packed" in case
    family = "qwen3_moe" if case.startswith("qwen3_moe") else "llama3"
    folder = (_folder(tmp_path, family, router_aux_loss_coef=0.05, num_hidden_layers=4) if family == "qwen3_moe"
              else _four_block_folder(tmp_path))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONAL * 4))
    dp = ranks // 2
    args = ["--training.steps", "3", "--training.global_batch_size", "4", "--training.seq_len",
            "256" if packed else "128",
            "--validation.enable", "--validation.dataset", "preference", "--validation.dataset_path", str(pairs),
            "--validation.freq", "2", "--validation.steps", "1", *common]
    if family == "qwen3_moe":  # (the load-balancing loss is one per global micro-batch: the same ones accumulated)
        one = run_distributed(train_history, dp, _argv(folder, pairs, tmp_path / "one", *args,
                                                       "--training.local_batch_size", str(2 // dp),
                                                       "--validation.local_batch_size", str(4 // dp),
                                                       family=family))[0]
    else:
        one = train_history(_argv(folder, pairs, tmp_path / "one", *args, "--training.local_batch_size", "4",
                                  "--validation.local_batch_size", "4", family=family))
    many = run_distributed(train_history, ranks, _argv(
        folder, pairs, tmp_path / "many", *args, *layout, "--training.local_batch_size", str(4 // dp),
        "--validation.local_batch_size", str(4 // dp),
        "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size",
        str(2 // dp), family=family))
    assert one[-1]["dpo/margin"] != 0 and any("validation_loss" in r for r in one)
    keys = ["loss", "grad_norm", "dpo/margin", "validation_loss"] + (["moe/aux_loss"] if family == "qwen3_moe" else [])
    assert family != "qwen3_moe" or one[0]["moe/aux_loss"] > 0
    for history in many:
        assert len(history) == len(one) == 3
        for a, b in zip(history, one, strict=True):
            for key in keys:
                if key in b:
                    assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (case, key, a, b)
