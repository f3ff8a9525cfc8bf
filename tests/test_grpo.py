"""Online RL (``torchtitan_lite/rl/``, docs/rl.md): GRPO and its fixes against TRL's ``GRPOTrainer``
(1.16, the dev extra) on TRL's own rollouts, the prompts source, the reward functions, the toy task,
layouts and resumes, and one-line errors.

TRL generates the completions and scores them; its ``_compute_loss`` on that batch is the
reference. Ours takes the same prompts, completions and rewards (as a ``grpo.rollouts_path`` file
would give them) and must give the same loss and gradient norm within 1e-5.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.dist_utils import one_error_line, refused_lines, run_distributed, train_history
from tests.test_data_chat import write_chat_tokenizer
from tests.test_dpo import _hf_folder
from torchtitan_lite.data.prompts import PromptRow
from torchtitan_lite.objectives.grpo import GRPOObjective
from torchtitan_lite.rl.losses import GRPOSetup, group_advantages
from torchtitan_lite.rl.rewards import accuracy, call_reward, final_answer, format_reward, length_penalty
from torchtitan_lite.training import MicroBatchRunner

trl = pytest.importorskip("trl")

PROMPTS = [{"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}], "answer": str(a + b)}
           for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))]
GENERATIONS, COMPLETION, SEQ_LEN = 4, 8, 63
CASES = [(loss, beta) for loss in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo") for beta in (0.0, 0.04)]


def score(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """A reward with spread (the text's length mod 5, plus 1 for the answer in it)."""
    return [float(len(c[-1]["content"]) % 5) / 4 + float(a in c[-1]["content"]) for c, a in zip(completions, answer,
                                                                                                strict=True)]


def _epsilon_high(loss_type: str) -> float:
    return 5.0 if loss_type == "cispo" else 0.28  # (CISPO's cap of the ratio; DAPO's clip-higher)


def _trl_trainer(folder: Path, *, beta: float, num_iterations: int = 1, steps: int = 1, **extra: Any) -> Any:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    config = GRPOConfig(output_dir=str(folder / "out"), per_device_train_batch_size=len(PROMPTS) * GENERATIONS,
                        num_generations=GENERATIONS, max_completion_length=COMPLETION, learning_rate=1e-3, beta=beta,
                        num_iterations=num_iterations, max_steps=steps, logging_steps=1, report_to=[], use_cpu=True,
                        bf16=False, seed=0, save_strategy="no", **extra)
    return GRPOTrainer(model=model, reward_funcs=score, args=config, train_dataset=Dataset.from_list(PROMPTS),
                       processing_class=AutoTokenizer.from_pretrained(str(folder)))


def _capture_rollouts(trainer: Any) -> dict[str, Any]:
    """What TRL's trainer generates and scores from here on (its prompts' and completions' ids,
    its rewards), kept in the returned dict as it runs."""
    captured: dict[str, Any] = {}
    generate, rewards_of = trainer._generate, trainer._calculate_rewards

    def _generate(prompts: Any) -> Any:
        out = generate(prompts)
        captured["prompt_ids"], captured["completion_ids"] = out[0], out[1]
        return out

    def _calculate_rewards(*args: Any, **kwargs: Any) -> torch.Tensor:
        captured["rewards"] = rewards_of(*args, **kwargs)
        return captured["rewards"]

    trainer._generate, trainer._calculate_rewards = _generate, _calculate_rewards
    return captured


def _rollout_rows(prompt_ids: list[list[int]], completion_ids: list[list[int]], rewards: list[float]) -> list[dict]:
    """TRL's rollouts (one entry per completion, groups consecutive) as rows of a rollouts file."""
    rows = []
    for first in range(0, len(completion_ids), GENERATIONS):
        group = slice(first, first + GENERATIONS)
        rows.append({"prompt_ids": prompt_ids[first], "completion_ids": completion_ids[group],
                     "rewards": rewards[group]})
    return rows


def _as_prompt_rows(rows: list[dict]) -> list[PromptRow]:
    return [PromptRow(i, np.asarray(r["prompt_ids"]), None, True, {}, r["completion_ids"], r["rewards"])
            for i, r in enumerate(rows)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", pytest.param("qwen3", marks=pytest.mark.scenario)])
def test_the_first_step_equals_trls_grpo_trainer_for_every_loss_type(tmp_path: Path, family: str) -> None:
    """One process, fp32, TRL's rollouts of 4 prompts × 4 completions (its own generation and
    rewards, with the reference's and the old policy's log-probabilities): TRL's ``_compute_loss``
    and our objective's step (micro-batches of 4 completions) give the same loss and gradient norm
    within 1e-5 for grpo, dr_grpo, dapo, bnpo and cispo, at beta 0 and 0.04; the advantages are
    TRL's."""
    write_chat_tokenizer(tmp_path / "tok", family)
    ours = _hf_folder(tmp_path / "policy", family, 7, tmp_path / "tok")
    trainer = _trl_trainer(tmp_path / "policy", beta=0.04, num_iterations=2)
    captured = _capture_rollouts(trainer)
    trainer.model.train()
    batch = trainer._generate_and_score_completions([p for p in PROMPTS for _ in range(GENERATIONS)])
    trainer.current_gradient_accumulation_steps = 1
    rewards = captured["rewards"][:, 0].tolist()
    ours_advantages, _ = group_advantages(torch.tensor(rewards), GENERATIONS, "group")
    assert torch.allclose(ours_advantages, batch["advantages"], atol=1e-6)
    rows = _as_prompt_rows(_rollout_rows(captured["prompt_ids"], captured["completion_ids"], rewards))
    reference = copy.deepcopy(ours).requires_grad_(False)
    runner = MicroBatchRunner(ours, device=torch.device("cpu"))
    eos = trainer.processing_class.eos_token_id
    for loss_type, beta in CASES:
        trainer.loss_type, trainer.beta, trainer.epsilon_high = loss_type, beta, _epsilon_high(loss_type)
        trainer.model.zero_grad(set_to_none=True)
        theirs = trainer._compute_loss(trainer.model, batch)
        theirs.backward()
        their_norm = torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1e9).item()
        setup = GRPOSetup(num_generations=GENERATIONS, max_completion_length=COMPLETION, loss_type=loss_type,
                          beta=beta, epsilon_high=_epsilon_high(loss_type), given=True,
                          reference="copy" if beta else None)
        objective = GRPOObjective(setup, engine=None, rewards=[], reference=reference if beta else None, ranks=1,
                                  group=None, global_completions=len(rows) * GENERATIONS, local_batch_size=4,
                                  seq_len=SEQ_LEN, vocab_size=512, pad_id=0, stop_ids=(eos,), decode=None, seed=0,
                                  dp_rank=0)
        ours.zero_grad(set_to_none=True)
        result = objective.forward_backward(runner, [rows])
        norm = torch.nn.utils.clip_grad_norm_(ours.parameters(), 1e9).item()
        loss = float(result.loss_sum[0])
        label = (family, loss_type, beta)
        assert abs(loss - theirs.item()) <= 1e-5 * max(1.0, abs(theirs.item())), (label, loss, theirs)
        assert abs(norm - their_norm) <= 1e-5 * their_norm, (label, norm, their_norm)
        if beta:
            assert result.metrics["grpo/kl"] == pytest.approx(0.0, abs=1e-6), label  # (the policy is the reference)


def _argv(tmp_path: Path, family: str, rollouts: Path, dump: str, *extra: str) -> list[str]:
    return ["--model.name", family, "--model.flavor", "tiny", "--model.tokenizer_path", str(tmp_path / "tok"),
            "--model.vocab_size", "512", "--grpo.rollouts_path", str(rollouts),
            "--grpo.num_generations", str(GENERATIONS), "--grpo.max_completion_length", str(COMPLETION),
            "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", "4", "--training.global_batch_size",
            str(len(PROMPTS) * GENERATIONS), "--training.mixed_precision_param", "float32", "--training.no-shuffle",
            "--validation.no-enable", "--metrics.log_freq", "1", "--metrics.no-enable_tensorboard",
            "--optimizer.lr", "1e-3", "--optimizer.weight_decay", "0.01", "--lr_scheduler.warmup_steps", "1",
            "--debug.deterministic", "--checkpoint.initial_load_path", str(tmp_path / "policy"),
            "--checkpoint.initial_load_in_hf", "--job.dump_folder", str(tmp_path / dump), *extra]


@pytest.mark.scenario  # (TRL's train() and a 2-rank job: the scenario tier; the first step of every loss type
@pytest.mark.slow     # against TRL stays in the default selection)
def test_two_ranks_train_on_given_rollouts_as_trl_does_for_two_iterations(tmp_path: Path) -> None:
    """2 ranks, fp32, a full fine-tune from a Hugging Face folder, dapo with beta 0.04 (a frozen
    sharded copy as the reference) and num_iterations 2: on TRL's rollouts (a rollouts file) both
    steps' losses and gradient norms are those of TRL's ``GRPOTrainer.train`` within 1e-5 (the
    second step reuses the rollouts with importance ratios after one AdamW update), with TRL's
    reward metrics."""
    family = "llama3"
    write_chat_tokenizer(tmp_path / "tok", family)
    _hf_folder(tmp_path / "policy", family, 7, tmp_path / "tok")
    trainer = _trl_trainer(tmp_path / "policy", beta=0.04, num_iterations=2, steps=2, epsilon_high=0.28)
    captured = _capture_rollouts(trainer)
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "grad_norm" in h]
    rows = _rollout_rows(captured["prompt_ids"], captured["completion_ids"], captured["rewards"][:, 0].tolist())
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ranks = run_distributed(train_history, 2, _argv(tmp_path, family, rollouts, "dump", "--training.steps", "2",
                                                    "--grpo.beta", "0.04", "--grpo.num_iterations", "2",
                                                    "--grpo.epsilon_high", "0.28", "--grpo.loss_type", "dapo"))
    for history in ranks:
        assert len(history) == 2
        for ours, their in zip(history, theirs, strict=True):
            assert abs(ours["loss"] - their["loss"]) <= 1e-5 * max(1.0, abs(their["loss"])), (ours, their)
            assert abs(ours["grad_norm"] - their["grad_norm"]) <= 1e-5 * their["grad_norm"], (ours, their)
        first = history[0]
        assert first["grpo/reward"] == pytest.approx(theirs[0]["reward"], abs=1e-6)
        assert first["grpo/reward_std"] == pytest.approx(theirs[0]["reward_std"], abs=1e-6)
        assert first["grpo/frac_reward_zero_std"] == pytest.approx(theirs[0]["frac_reward_zero_std"])
        assert first["grpo/completion_length/mean"] == pytest.approx(theirs[0]["completions/mean_length"])
        assert history[1]["grpo/kl"] == pytest.approx(theirs[1]["kl"], rel=1e-4)


@pytest.mark.scenario  # (the router's token flags are tested against TRL in the default selection by DPO's)
@pytest.mark.slow
def test_a_grpo_step_of_an_moe_model_equals_trls_with_its_load_balancing_loss(tmp_path: Path) -> None:
    """One process, fp32, a tiny Qwen3-MoE made by transformers (8 experts, top 2, its
    load-balancing loss weighted 0.05): on TRL's rollouts of 4 prompts × 4 completions (a
    rollouts file), the first step's loss, the load-balancing term included (counted over the
    prompts' and completions' tokens, not the padding), and its gradient norm equal TRL's
    ``GRPOTrainer.train`` within 1e-5 (dapo)."""
    import shutil

    from tests.test_trainer_moe import hf_qwen3_moe

    write_chat_tokenizer(tmp_path / "tok", "qwen3")
    folder = hf_qwen3_moe(tmp_path / "policy", vocab_size=512, router_aux_loss_coef=0.05)
    for file in (tmp_path / "tok").iterdir():
        shutil.copy(file, folder / file.name)
    trainer = _trl_trainer(folder, beta=0.0, epsilon_high=0.28)
    captured = _capture_rollouts(trainer)
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "grad_norm" in h][0]
    rows = _rollout_rows(captured["prompt_ids"], captured["completion_ids"], captured["rewards"][:, 0].tolist())
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ours = train_history(_argv(tmp_path, "qwen3_moe", rollouts, "dump", "--model.flavor", "from_checkpoint",
                               "--training.steps", "1", "--grpo.epsilon_high", "0.28", "--grpo.loss_type", "dapo",
                               "--training.local_batch_size", str(len(PROMPTS) * GENERATIONS)))[0]
    loss = ours["loss"] + 0.05 * ours["moe/aux_loss"]
    assert abs(loss - theirs["loss"]) <= 1e-5 * max(1.0, abs(theirs["loss"])), (ours, theirs)
    assert abs(ours["grad_norm"] - theirs["grad_norm"]) <= 1e-5 * theirs["grad_norm"], (ours, theirs)
    assert ours["moe/aux_loss"] == pytest.approx(theirs["aux_loss"], rel=1e-5)


def test_advantages_scale_by_group_batch_or_not_and_leave_unscorable_at_zero() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, float("nan")])
    group, zero = group_advantages(rewards, 4, "group")
    assert torch.allclose(group[:4], torch.tensor([0.5, -0.5, 0.5, -0.5]) / (math.sqrt(1 / 3) + 1e-4), atol=1e-6)
    assert group[4:].tolist() == [0.0, 0.0, 0.0, 0.0] and zero.tolist() == [False] * 4 + [True] * 4
    none, _ = group_advantages(rewards, 4, "none")
    assert none[:4].tolist() == [0.5, -0.5, 0.5, -0.5]
    batch, _ = group_advantages(rewards, 4, "batch")
    std = float(torch.tensor([1.0, 0, 1, 0, 2, 2, 2]).std())
    assert batch[0].item() == pytest.approx(0.5 / (std + 1e-4), rel=1e-6)


def test_shipped_rewards_check_answers_format_and_length() -> None:
    completions = ["so \\boxed{1,234.}", "#### 42\nmore", "<answer> 7 </answer>", "the sum is 3 or maybe 5", "none"]
    assert [final_answer(c) for c in completions] == ["1,234.", "42", " 7 ", "5", None]
    assert accuracy(None, completions, answer=["1234", "42", "7", "3", "x"]) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert accuracy(None, completions[:2], answer_pattern=["1,?234\\.?", "4\\d"]) == [1.0, 1.0]
    assert accuracy(None, [[{"role": "assistant", "content": "5"}]], answer=[None]) == [None]
    # what published datasets hold: GSM8K's worked answer ending "#### 72"; TRL's "solution" column,
    # a final answer (DeepMath) or a worked solution with a boxed one (NuminaMath)
    gsm8k = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
    assert accuracy(None, ["She sold 72 clips. #### 72", "#### 24"], answer=[gsm8k] * 2) == [1.0, 0.0]
    assert accuracy(None, ["\\boxed{\\frac{1}{3}}", "\\boxed{3}"], solution=["\\frac{1}{3}"] * 2) == [1.0, 0.0]
    assert accuracy(None, ["so \\boxed{2}", "4"], solution=["Hence $x = 2$: \\boxed{2}."] * 2) == [1.0, 0.0]
    assert format_reward(None, ["<think>a</think> b", "<think>a</think><think>", "b"]) == [1.0, 0.0, 0.0]
    assert length_penalty(None, [""] * 3, completion_ids=[[0] * 6, [0] * 7, [0] * 8],
                          max_completion_length=8) == [0.0, -0.5, -1.0]


def test_reward_metrics_are_named_as_trl_names_them() -> None:
    """``grpo/rewards/NAME/mean``: a shipped function by its name, one's own by its ``__name__``
    (TRL's ``rewards/{__name__}/mean``), the dotted path where two would share a name."""
    from torchtitan_lite.rl.rewards import metric_names, resolve_reward_functions

    assert metric_names(resolve_reward_functions(["accuracy", "format", "json.loads", "json.dumps"])) == [
        "accuracy", "format", "loads", "dumps"]
    assert metric_names(resolve_reward_functions(["json.loads", "pickle.loads"])) == ["json.loads", "pickle.loads"]


def test_a_reward_function_that_raises_or_miscounts_is_one_line() -> None:
    from torchtitan_lite.errors import UserCodeError

    def broken(prompts: Any, completions: Any, **_: Any) -> list[float]:
        raise KeyError("answer")

    line = broken.__code__.co_firstlineno + 1
    with pytest.raises(UserCodeError, match=rf"^grpo.reward_functions: 'broken' raised KeyError: 'answer' \(at "
                                            rf"{re.escape(__file__)}:{line} in broken\)$"):
        call_reward("broken", broken, [None], ["a"], {})
    with pytest.raises(UserCodeError, match=r"^grpo.reward_functions: 'short' returned 0 values; expected one number "
                                            r"or None per completion \(1\)$"):
        call_reward("short", lambda prompts, completions, **_: [], [None], ["a"], {})
    with pytest.raises(UserCodeError, match=rf"raised JSONDecodeError: Expecting value: line 1 column 1 \(char 0\) "
                                            rf"\(at {re.escape(__file__)}:\d+ in (<listcomp>|<lambda>), raised in "
                                            r".*json.*\)$"):
        call_reward("parse", lambda prompts, completions, **_: [json.loads(c) for c in completions], [None], ["a"], {})


def test_a_reward_function_that_raises_ends_the_job_with_its_own_exit_code_and_its_line(tmp_path: Path) -> None:
    """The toy job with a reward function of the user's (a dotted path) that raises at its line 3:
    exit 6 (not 5, "diverged"), one line naming the function, the error, its file and line."""
    from tests.dist_utils import REPO_ROOT

    module = tmp_path / "myrewards_boom.py"
    module.write_text("def boom(prompts, completions, **kwargs):\n    scores = {}\n    return [scores[c] for c in "
                      "completions]\n")
    argv = ["--job.config_file", str(REPO_ROOT / "train_configs" / "grpo_toy.toml"), "--model.tokenizer_path",
            str(REPO_ROOT / "tests" / "assets" / "toy_rl"), "--training.dataset_path",
            str(REPO_ROOT / "tests" / "assets" / "toy_rl" / "prompts.jsonl"), "--training.steps", "1",
            "--training.global_batch_size", "16", "--training.local_batch_size", "16",
            "--grpo.reward_functions", "myrewards_boom.boom", "--metrics.no-enable_tensorboard",
            "--job.dump_folder", str(tmp_path / "dump")]
    (result,) = run_distributed(_main_importing_from, 1, str(tmp_path), argv)
    line = one_error_line(result, 6)
    assert re.fullmatch(rf"error: grpo.reward_functions: 'myrewards_boom.boom' raised KeyError: '.*' \(at "
                        rf"{re.escape(str(module))}:3 in (<listcomp>|boom)\)", line), line


def _main_importing_from(folder: str, argv: list[str]) -> Any:
    """``train.main(argv)`` in this rank process with ``folder`` on the import path (a user's module)."""
    import sys

    from tests.dist_utils import run_main

    sys.path.insert(0, folder)
    try:
        (result,) = run_main([argv])
    finally:
        sys.path.remove(folder)
    return result


@pytest.mark.parametrize("extra, line", [
    (["--grpo.reward_functions", "nope"], "grpo.reward_functions: invalid value 'nope'; not a shipped reward function"),
    (["--grpo.reward_functions", "tests.no_such_module.f"],
     "grpo.reward_functions: invalid value 'tests.no_such_module.f'; its module 'tests.no_such_module' does not "
     "import"),
    (["--grpo.num_generations", "3"], "training.global_batch_size: invalid value 8; it counts completions: expected "
                                      "a multiple of grpo.num_generations = 3"),
    (["--grpo.max_completion_length", "64"], "grpo.max_completion_length: invalid value 64; a prompt and its "
                                             "completion share training.seq_len = 64"),
    (["--grpo.reward_weights", "1,2"], "grpo.reward_weights: invalid value [1.0, 2.0]; expected one weight per reward "
                                       "function (1), or none"),
    (["--validation.enable"], "validation.enable: invalid value True; an online RL job has no validation loss yet "
                              "(its rewards in the metrics measure the policy; a token loss on validation.dataset = "
                              "'python_stdlib_validation' would measure data of another kind through the job's "
                              "tokenizer): expected false"),
    (["--training.dataset", "python_stdlib"],
     "grpo.num_generations: invalid value 4; [grpo] applies to training.dataset = 'prompts' (this job's is "
     "'python_stdlib')"),
])
def test_bad_grpo_settings_are_one_line_before_any_process_group(tmp_path: Path, capsys: Any, extra: list[str],
                                                                  line: str) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    write_chat_tokenizer(tmp_path / "tok", "llama3")
    data = [] if "--training.dataset" in extra else ["--training.dataset", "prompts", "--training.dataset_path",
                                                     str(prompts)]
    argv = ["--model.flavor", "tiny", "--model.tokenizer_path", str(tmp_path / "tok"), *data,
            "--training.seq_len", "64", "--training.global_batch_size", "8", "--training.local_batch_size", "4",
            "--grpo.num_generations", "4",
            "--grpo.max_completion_length", "16", "--grpo.reward_functions", "accuracy",
            "--job.dump_folder", str(tmp_path / "dump"), *extra]
    lines = refused_lines(argv, capsys)
    assert len(lines) == 1 and lines[0].startswith(f"error: {line}"), lines


def test_every_reward_name_that_does_not_resolve_is_a_line_with_the_plans_other_problems(tmp_path: Path,
                                                                                         capsys: Any) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    write_chat_tokenizer(tmp_path / "tok", "llama3")
    argv = ["--model.flavor", "tiny", "--model.tokenizer_path", str(tmp_path / "tok"), "--training.dataset", "prompts",
            "--training.dataset_path", str(prompts), "--training.seq_len", "64", "--training.global_batch_size", "8",
            "--training.local_batch_size", "4", "--grpo.num_generations", "4", "--grpo.max_completion_length", "64",
            "--grpo.reward_functions", "nope,tests.no_such_module.f,json.no_such_function",
            "--job.dump_folder", str(tmp_path / "dump")]
    lines = refused_lines(argv, capsys)
    assert [line.split(";")[0] for line in lines] == [
        "error: grpo.max_completion_length: invalid value 64", "error: grpo.reward_functions: invalid value 'nope'",
        "error: grpo.reward_functions: invalid value 'tests.no_such_module.f'",
        "error: grpo.reward_functions: invalid value 'json.no_such_function'"], lines


def test_a_config_built_in_code_gets_the_ranges_of_its_objective_from_the_plan(tmp_path: Path) -> None:
    """``plan_job`` on a config built in code (no ``load_job_config``, so no schema checks): the
    GRPO plan still refuses a group of one completion, and the DPO plan a beta of 0, in one line."""
    from torchtitan_lite.config import JobConfig
    from torchtitan_lite.errors import ConfigError
    from torchtitan_lite.job import plan_job

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    write_chat_tokenizer(tmp_path / "tok", "llama3")
    config = JobConfig()
    config.model.flavor, config.model.tokenizer_path = "tiny", str(tmp_path / "tok")
    config.training.dataset, config.training.dataset_path = "prompts", str(prompts)
    config.training.seq_len, config.training.local_batch_size = 64, 4
    config.grpo.num_generations, config.grpo.max_completion_length = 1, 16
    with pytest.raises(ConfigError, match=r"^grpo.num_generations: invalid value 1; a group needs at least 2 "):
        plan_job(config, world_size=1)
    from torchtitan_lite.config.schema import GRPO

    config.training.dataset, config.grpo, config.dpo.beta = "preference", GRPO(), 0.0
    with pytest.raises(ConfigError, match=r"^dpo.beta: invalid value 0.0; expected a number > 0"):
        plan_job(config, world_size=1)


def test_generating_under_context_parallel_is_one_line(tmp_path: Path) -> None:
    """Rollouts are generated on the training model, which context parallel splits: at context
    parallel 2 a job on prompts is refused in one line naming the key and what works (given
    rollouts)."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.errors import ConfigError
    from torchtitan_lite.job import plan_job

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    write_chat_tokenizer(tmp_path / "tok", "llama3")
    config = load_job_config(["--model.flavor", "tiny", "--model.tokenizer_path", str(tmp_path / "tok"),
                              "--training.dataset", "prompts", "--training.dataset_path", str(prompts),
                              "--training.seq_len", "64", "--training.global_batch_size", "8",
                              "--grpo.num_generations", "4", "--grpo.max_completion_length", "16",
                              "--grpo.reward_functions", "accuracy", "--parallelism.context_parallel_degree", "2"])
    with pytest.raises(ConfigError) as error:
        plan_job(config, world_size=2)
    assert str(error.value) == ("parallelism.context_parallel_degree: invalid value 2; online RL generates its "
                                "rollouts on the training model, which context parallel splits: expected 1, or "
                                "rollouts made elsewhere (grpo.rollouts_path)")


def _random_rollouts(path: Path, rows: int, *, seed: int = 0) -> Path:
    """A rollouts file of ``rows`` prompt groups: random prompt and completion ids (some ending
    with EOS, 0) and random rewards (one null)."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(rows):
        completions = [rng.integers(3, 400, size=int(rng.integers(1, COMPLETION + 1))).tolist()
                       for _ in range(GENERATIONS)]
        completions[0][-1] = 0
        rewards: list[float | None] = [float(x) for x in rng.random(GENERATIONS).round(3)]
        lines.append({"prompt_ids": rng.integers(3, 400, size=int(rng.integers(4, 20))).tolist(),
                      "completion_ids": completions, "rewards": rewards})
    lines[1]["rewards"][2] = None
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


@pytest.mark.scenario  # (three 2-rank jobs: the scenario tier; the generated rollouts' resume stays in the default)
@pytest.mark.slow
def test_a_resume_between_two_iterations_on_one_batch_repeats_the_run(tmp_path: Path) -> None:
    """2 ranks, fp32, num_iterations 2, beta 0.04, grpo loss, micro-batches of 2: a run of 4
    steps saves at every step; resumed from step 1 (between the two steps on the first batch of
    rollouts, which the checkpoint keeps) and from step 2, steps 2-4 and 3-4 repeat the
    uninterrupted run's losses, gradient norms and rewards within 1e-6."""
    import shutil

    family = "llama3"
    write_chat_tokenizer(tmp_path / "tok", family)
    _hf_folder(tmp_path / "policy", family, 7, tmp_path / "tok")
    rollouts = _random_rollouts(tmp_path / "rollouts.jsonl", 8)
    extra = ["--training.steps", "4", "--grpo.num_iterations", "2", "--grpo.beta", "0.04", "--grpo.loss_type",
             "grpo", "--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.interval", "1"]
    whole = run_distributed(train_history, 2, _argv(tmp_path, family, rollouts, "whole", *extra))[0]
    assert len(whole) == 4 and whole[0]["grpo/reward"] != whole[2]["grpo/reward"]
    for start in (1, 2):
        dump = tmp_path / f"from-{start}"
        shutil.copytree(tmp_path / "whole" / "checkpoint" / f"step-{start}", dump / "checkpoint" / f"step-{start}")
        resumed = run_distributed(train_history, 2, _argv(tmp_path, family, rollouts, dump.name, *extra))[0]
        assert [r["step"] for r in resumed] == list(range(start + 1, 5))
        for ours, theirs in zip(resumed, whole[start:], strict=True):
            for key in ("loss", "grad_norm", "grpo/entropy"):
                assert abs(ours[key] - theirs[key]) <= 1e-6 * max(1.0, abs(theirs[key])), (start, key, ours, theirs)
            assert ours.get("grpo/reward") == theirs.get("grpo/reward"), (start, ours, theirs)


@pytest.mark.slow
def test_the_toy_task_learns_from_the_readme_style_command(tmp_path: Path) -> None:
    """``python -m torchtitan_lite.train --job.config_file train_configs/grpo_toy.toml``: a tiny
    Llama from random weights, generating its own rollouts (16 per prompt, sampled at temperature
    1), rewarded by the shipped accuracy check on "copy D :" prompts: the mean reward of the first
    5 steps is below 0.2 and of the last 10 of its 80 steps above 0.8; the entropy falls; the
    step's time splits into generation's and training's, and tokens/s is training's."""
    import sys

    from tests.dist_utils import REPO_ROOT, read_jsonl, run_command

    result = run_command([sys.executable, "-m", "torchtitan_lite.train", "--job.config_file",
                          "train_configs/grpo_toy.toml", "--metrics.log_freq", "1", "--job.dump_folder",
                          str(tmp_path / "dump")], cwd=REPO_ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # Its 10 prompts are an epoch a step: a line at the first restart, then one per 10 steps at most.
    epochs = [line for line in result.stdout.splitlines() if "starts again" in line]
    assert 1 <= len(epochs) <= 8 and "has used all its 10 prompts and starts again (epoch 1)" in epochs[0], epochs
    records = [r for r in read_jsonl(tmp_path / "dump" / "metrics.jsonl") if "grpo/reward" in r]
    rewards = [r["grpo/reward"] for r in records]
    assert len(rewards) == 80
    assert sum(rewards[:5]) / 5 < 0.2 and sum(rewards[-10:]) / 10 > 0.8, rewards
    assert records[-1]["grpo/entropy"] < records[0]["grpo/entropy"] / 2
    assert records[0]["generation_tokens_per_s"] > 0 and records[0]["grpo/completion_length/mean"] > 0
    for r in records[:3]:  # generation and training timed apart: tps is the training's alone
        assert r["training_time_s"] + r["generation_time_s"] == pytest.approx(r["step_time_s"])
        assert r["tps"] == pytest.approx(r["tokens_per_rank"] / r["training_time_s"])


def test_a_job_that_cannot_learn_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy task sampled greedily (grpo.temperature = 0): the start-up log has a note that the
    16 completions of a prompt will be the same, and after ``ALIKE_BATCHES`` (10; 3 here) batches
    in a row whose every group scored alike a warning says that the policy learns nothing (once)."""
    from tests.dist_utils import captured_log

    monkeypatch.setattr(GRPOObjective, "ALIKE_BATCHES", 3)
    with captured_log() as lines:
        history = train_history(_toy_argv(tmp_path / "dump", "--training.steps", "5", "--grpo.temperature", "0",
                                          "--training.global_batch_size", "16", "--metrics.log_freq", "1"))
    assert all(r["grpo/frac_reward_zero_std"] == 1.0 for r in history)
    assert sum(line.startswith("note: grpo.temperature = 0 samples greedily: the 16 completions of a prompt are "
                               "the same") for line in lines) == 1, lines
    assert sum(line.startswith("grpo: in each of the last 3 batches every prompt's 16 completions scored alike")
               for line in lines) == 1, lines


def _toy_argv(dump: Path, *extra: str) -> list[str]:
    from tests.dist_utils import REPO_ROOT

    return ["--job.config_file", str(REPO_ROOT / "train_configs" / "grpo_toy.toml"), "--model.tokenizer_path",
            str(REPO_ROOT / "tests" / "assets" / "toy_rl"), "--training.dataset_path",
            str(REPO_ROOT / "tests" / "assets" / "toy_rl" / "prompts.jsonl"), "--training.global_batch_size", "64",
            "--training.local_batch_size", "16", "--metrics.log_freq", "1", "--metrics.no-enable_tensorboard",
            "--job.dump_folder", str(dump), *extra]


@pytest.mark.slow
def test_generated_rollouts_resume_exactly_at_two_ranks(tmp_path: Path) -> None:
    """The toy task at 2 ranks, rollouts generated by the model (sampled, a seed per batch and
    rank; in generation batches of 12), stopped at step 5 and resumed: steps 6-10 repeat the
    uninterrupted run's rewards, completion lengths, losses and gradient norms within 1e-6 (the
    data position and the rollout seed come back from the checkpoint)."""
    import shutil

    extra = ["--training.steps", "10", "--checkpoint.enable", "--checkpoint.interval", "5",
             "--grpo.generation_batch_size", "12"]  # (each rank's 32 completions in batches of 12, 12 and 8)
    whole = run_distributed(train_history, 2, _toy_argv(tmp_path / "whole", *extra))[0]
    dump = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-5", dump / "checkpoint" / "step-5")
    resumed = run_distributed(train_history, 2, _toy_argv(dump, *extra))[0]
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert len({round(r["grpo/reward"], 6) for r in whole}) > 2  # (the rollouts differ from step to step)
    for ours, theirs in zip(resumed, whole[5:], strict=True):
        for key in ("loss", "grad_norm", "grpo/reward", "grpo/completion_length/mean", "grpo/entropy"):
            assert abs(ours[key] - theirs[key]) <= 1e-6 * max(1.0, abs(theirs[key])), (key, ours, theirs)


_LAYOUTS = {  # name: (ranks, arguments)
    "tp2": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2-ac-compile": (2, ["--activation_checkpoint.mode", "full", "--compile.enable"]),
    "fsdp2-offload": (2, ["--training.enable_cpu_offload"]),
    "hsdp2x2": (4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                    "2"]),
    "fsdp2-bf16": (2, ["--training.mixed_precision_param", "bfloat16"]),  # (within bf16's rounding: 2e-2)
    # each row split over the context-parallel ranks: log-probabilities gathered whole, row lengths whole
    "cp2": (2, ["--parallelism.context_parallel_degree", "2"]),
    "dp2xcp2-ulysses": (4, ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method",
                            "ulysses"]),
    # through pipeline stages: the kept log-probabilities of a forward-only schedule, the loss on the last stage
    "pp2-1f1b": (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size",
                     "1"]),
    "dp2xpp2-zbv": (4, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                        "ZBVZeroBubble", "--parallelism.pipeline_parallel_microbatch_size", "1"]),
}


def _layout_history(tmp_path: Path, rollouts: Path, name: str, ranks: int, *extra: str) -> list[dict[str, Any]]:
    argv = _argv(tmp_path, "llama3", rollouts, name, "--training.steps", "3", "--grpo.loss_type", "grpo",
                 "--grpo.beta", "0.04", "--grpo.num_iterations", "2", "--training.local_batch_size", "2",
                 "--training.seq_len", "64", *extra)
    return run_distributed(train_history, ranks, argv)[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [pytest.param(name, marks=() if name == "tp2" else pytest.mark.scenario)
                                    for name in _LAYOUTS])
def test_grpo_on_a_layout_equals_one_process(tmp_path: Path, layout: str) -> None:
    """fp32, given rollouts, grpo loss, beta 0.04 (the reference a frozen copy sharded like the
    policy), num_iterations 2, 3 steps: tensor parallel 2 (the logits split over the vocabulary),
    FSDP with full checkpointing and compiled blocks, FSDP with CPU offload, HSDP 2 × 2, context
    parallel 2 (all-gather), data parallel 2 × context parallel 2 (Ulysses), pipeline 2 (1F1B) and
    data parallel 2 × pipeline 2 (ZBVZeroBubble) give one process's losses and gradient norms
    within 1e-5; bf16 mixed precision within 2e-2."""
    family = "llama3"
    write_chat_tokenizer(tmp_path / "tok", family)
    _hf_folder(tmp_path / "policy", family, 7, tmp_path / "tok")
    rollouts = _random_rollouts(tmp_path / "rollouts.jsonl", 8)
    reference = _layout_history(tmp_path, rollouts, "one", 1)
    ranks, extra = _LAYOUTS[layout]
    ours = _layout_history(tmp_path, rollouts, layout, ranks, *extra)
    tolerance = 2e-2 if "bf16" in layout else 1e-5
    for mine, theirs in zip(ours, reference, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(mine[key] - theirs[key]) <= tolerance * max(1.0, abs(theirs[key])), (layout, key, mine, theirs)


@pytest.mark.slow
def test_lora_grpo_with_adapters_off_as_the_reference_exports_a_peft_folder(tmp_path: Path) -> None:
    """LoRA (rank 8 on the attention), beta 0.04 with the adapters switched off as the reference,
    2 ranks: one process's losses within 1e-5, a KL that grows from 0 as the adapters train, and
    the last save a PEFT folder that peft loads onto the Hugging Face base."""
    family = "llama3"
    write_chat_tokenizer(tmp_path / "tok", family)
    _hf_folder(tmp_path / "policy", family, 7, tmp_path / "tok")
    rollouts = _random_rollouts(tmp_path / "rollouts.jsonl", 8)
    lora = ["--lora.enable", "--lora.rank", "8", "--lora.target_modules", "q_proj,v_proj", "--optimizer.lr", "1e-2"]
    one = _layout_history(tmp_path, rollouts, "one", 1, *lora)
    two = _layout_history(tmp_path, rollouts, "two", 2, *lora, "--checkpoint.enable", "--checkpoint.interval", "3",
                          "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf")
    for mine, theirs in zip(two, one, strict=True):
        assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 * max(1.0, abs(theirs["loss"])), (mine, theirs)
    assert two[0]["grpo/kl"] == pytest.approx(0.0, abs=1e-7) and two[2]["grpo/kl"] > 1e-6, two
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "policy"), dtype=torch.float32)
    tuned = PeftModel.from_pretrained(base, str(tmp_path / "two" / "checkpoint" / "step-3"))
    assert any("lora_A" in name for name, _ in tuned.named_parameters())


def test_given_sampling_logprobs_weigh_the_policy_loss_as_trl_corrects_vllm(tmp_path: Path) -> None:
    """Given rollouts with the sampler's log-probabilities: equal to the trainer's, the weights are
    1 and the step is the uncorrected one; 0.08 below them per token, each completion's weight is
    exp(0.08 × its tokens), truncated at 3 (sequence_truncate) or zero above it (sequence_mask),
    and per token exp(0.08) (token_truncate)."""
    import dataclasses

    family = "llama3"
    write_chat_tokenizer(tmp_path / "tok", family)
    model = _hf_folder(tmp_path / "policy", family, 7, tmp_path / "tok")
    runner = MicroBatchRunner(model, device=torch.device("cpu"))
    lines = [json.loads(line) for line in _random_rollouts(tmp_path / "r.jsonl", 2, seed=3).read_text().splitlines()]
    for row in lines:  # long completions (up to 30 tokens), so that some weights pass the cap
        row["completion_ids"] = [ids + [7] * (4 * k) for k, ids in enumerate(row["completion_ids"])]
    base = GRPOSetup(num_generations=GENERATIONS, max_completion_length=40, given=True, importance_sampling="none")

    def objective(setup: GRPOSetup) -> GRPOObjective:
        return GRPOObjective(setup, engine=None, rewards=[], reference=None, ranks=1, group=None,
                             global_completions=2 * GENERATIONS, local_batch_size=4, seq_len=80, vocab_size=512,
                             pad_id=0, stop_ids=(0,), decode=None, seed=0, dp_rank=0)

    plain = objective(base)
    rows = _as_prompt_rows(lines)
    uncorrected = float(plain.forward_backward(runner, [rows]).loss_sum[0])
    made = plain.rollouts
    policy = runner.rows_logps(made.inputs, made.labels, local_batch_size=4)
    counted = made.labels != -100

    def with_logprobs(shift: float) -> list[PromptRow]:
        per_completion = [policy[i][counted[i]].tolist() for i in range(len(policy))]
        out = []
        for g, row in enumerate(rows):
            group = per_completion[g * GENERATIONS:(g + 1) * GENERATIONS]
            out.append(dataclasses.replace(row, logprobs=[[v - shift for v in lp] for lp in group]))
        return out

    same = objective(dataclasses.replace(base, importance_sampling="sequence_truncate"))
    assert float(same.forward_backward(runner, [with_logprobs(0.0)]).loss_sum[0]) == pytest.approx(uncorrected,
                                                                                                    abs=1e-6)
    assert torch.allclose(same.rollouts.weight, torch.ones_like(same.rollouts.weight), atol=1e-5)
    tokens = counted.sum(dim=1, keepdim=True).float()
    expected = torch.exp(0.08 * tokens)
    assert expected.max() > 3 > expected.min()  # (some above the cap, some below)
    for mode, want in (("sequence_truncate", expected.clamp(max=3.0)),
                       ("sequence_mask", expected.masked_fill(expected > 3.0, 0.0)),
                       ("token_truncate", torch.where(counted, torch.exp(torch.tensor(0.08)), torch.ones(())))):
        weighed = objective(dataclasses.replace(base, importance_sampling=mode))
        weighed.forward_backward(runner, [with_logprobs(0.08)])
        assert torch.allclose(weighed.rollouts.weight, want, rtol=1e-4), mode


def test_given_rewards_of_another_number_of_functions_than_the_weights_is_one_line() -> None:
    """A rollouts row's rewards table of 2 functions with 3 grpo.reward_weights: one line naming both."""
    from torchtitan_lite.errors import DataError

    rows = [PromptRow(0, np.asarray([3, 4]), None, False, {}, [[5], [6]], {"a": [1.0, 0.0], "b": [0.0, 1.0]})]
    setup = GRPOSetup(num_generations=2, max_completion_length=4, given=True, reward_weights=(1.0, 1.0, 1.0))
    objective = GRPOObjective(setup, engine=None, rewards=[], reference=None, ranks=1, group=None,
                              global_completions=2, local_batch_size=2, seq_len=8, vocab_size=16, pad_id=0,
                              stop_ids=(0,), decode=None, seed=0, dp_rank=0)
    runner = MicroBatchRunner(torch.nn.Linear(1, 1), device=torch.device("cpu"))
    with pytest.raises(DataError, match=r"^grpo.reward_weights: invalid value \[1.0, 1.0, 1.0\]; the rollouts' "
                                        r"rewards are of 2 function\(s\) \(a, b\): expected one weight each, or none$"):
        objective.make_rollouts(runner, rows)


@pytest.mark.scenario  # (the pipeline's token flags: DPO's pipeline test has them in the scenario tier too)
@pytest.mark.slow
def test_grpo_of_an_moe_model_through_pipeline_stages_equals_one_process(tmp_path: Path) -> None:
    """fp32, given rollouts, a 4-layer Qwen3-MoE made by transformers (load-balancing loss 0.05),
    beta 0.04 (a frozen copy), num_iterations 2, 3 steps: through pipeline 2 (1F1B, pipeline
    micro-batches of 1 completion) the losses, the load-balancing terms (over the completions'
    tokens, not their padding, on the last stage) and the gradient norms are one process's
    accumulating the same micro-batches, within 1e-5."""
    import shutil

    from tests.test_trainer_moe import hf_qwen3_moe

    write_chat_tokenizer(tmp_path / "tok", "qwen3")
    folder = hf_qwen3_moe(tmp_path / "policy", vocab_size=512, router_aux_loss_coef=0.05, num_hidden_layers=4)
    for file in (tmp_path / "tok").iterdir():
        shutil.copy(file, folder / file.name)
    rollouts = _random_rollouts(tmp_path / "rollouts.jsonl", 8)
    common = ["--model.flavor", "from_checkpoint", "--training.steps", "3", "--grpo.loss_type", "grpo",
              "--grpo.beta", "0.04", "--grpo.num_iterations", "2", "--training.seq_len", "64"]
    one = train_history(_argv(tmp_path, "qwen3_moe", rollouts, "one", *common, "--training.local_batch_size", "1"))
    pp = run_distributed(train_history, 2, _argv(
        tmp_path, "qwen3_moe", rollouts, "pp", *common, "--training.local_batch_size", "2",
        "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"))[0]
    assert one[0]["moe/aux_loss"] > 0
    for mine, theirs in zip(pp, one, strict=True):
        for key in ("loss", "grad_norm", "moe/aux_loss"):
            assert abs(mine[key] - theirs[key]) <= 1e-5 * max(1.0, abs(theirs[key])), (key, mine, theirs)
