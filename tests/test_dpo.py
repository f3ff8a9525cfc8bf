"""Preference tuning (DPO): pairs tokenized and batched as TRL's ``DPOTrainer`` does them, and its
losses value for value.

TRL (1.16, the dev extra) is the reference: its own ``_prepare_dataset`` (prompt extraction, the
EOS appended to plain answers, the chat template, the answers starting where prompt and
prompt + answer stop agreeing) and ``DataCollatorForPreference`` (truncation, padding, the
completion mask) run on the same rows and tokenizer folder as ours.
"""

from __future__ import annotations

import math
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.dist_utils import train_history
from tests.test_data_chat import write_chat_tokenizer
from torchtitan_lite.data import HFTokenizer
from torchtitan_lite.data.chat_template import ChatTemplate, RowError
from torchtitan_lite.data.preference import encode_pair, pair_rows
from torchtitan_lite.data.windows import IGNORE_INDEX
from torchtitan_lite.objectives.preference import counted_tokens, dpo_losses, sequence_logps

trl = pytest.importorskip("trl")


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


CONVERSATIONAL = [
    {"prompt": _user("Name a prime."), "chosen": _assistant("7"), "rejected": _assistant("8")},
    {"prompt": [{"role": "system", "content": "You are terse."}, *_user("2+2?")], "chosen": _assistant("4"),
     "rejected": _assistant("Four, I believe, but let me think about it for a while longer.")},
    {"prompt": [*_user("a"), *_assistant("b"), *_user("c")], "chosen": _assistant("d"),
     "rejected": _assistant("Ünïcödé ✓ 漢字 🚀")},
    {"prompt": _user("Long " * 30), "chosen": _assistant("Answer " * 25), "rejected": _assistant("x")},
]
# No prompt: the messages chosen and rejected share are the prompt (TRL's extract_prompt).
CONVERSATIONAL_NO_PROMPT = [
    {"chosen": [*_user("Say hi."), *_assistant("Hi!")], "rejected": [*_user("Say hi."), *_assistant("No.")]},
    {"chosen": [*_user("a"), *_assistant("b"), *_user("c"), *_assistant("d " * 40)],
     "rejected": [*_user("a"), *_assistant("b"), *_user("c"), *_assistant("e")]},
]
PLAIN = [
    {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Lyon."},
    {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5, or maybe six, depending on the day of the week"},
    {"prompt": "", "chosen": "Hello there.", "rejected": "Go away."},
]
PLAIN_NO_PROMPT = [
    {"chosen": "Q: colour of the sky? A: blue", "rejected": "Q: colour of the sky? A: green"},
    {"chosen": "Q: a long answer? A: " + "yes " * 20, "rejected": "Q: a long answer? A: no"},
]


def _trl_batch(rows: list[dict[str, Any]], folder: Path, max_length: int, truncation: str) -> dict[str, Any]:
    """TRL's tokenization (``DPOTrainer._prepare_dataset``, run on its own) and collation."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    hf = AutoTokenizer.from_pretrained(str(folder))
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode=truncation)
    prepared = DPOTrainer._prepare_dataset(types.SimpleNamespace(_tokenizer=hf), Dataset.from_list(rows), hf, args,
                                           "train")
    examples = [{k: prepared[i][k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for i in range(len(rows))]
    return DataCollatorForPreference(pad_token_id=0, max_length=max_length, truncation_mode=truncation)(examples)


@pytest.mark.parametrize("family, rows", [("llama3", CONVERSATIONAL), ("qwen3", CONVERSATIONAL),
                                          ("llama3", CONVERSATIONAL_NO_PROMPT), ("llama3", PLAIN),
                                          ("llama3", PLAIN_NO_PROMPT)],
                         ids=["llama3-conversational", "qwen3-conversational", "no-prompt", "plain", "plain-no-prompt"])
@pytest.mark.parametrize("truncation", ["keep_start", "keep_end"])
def test_pairs_are_tokenized_and_batched_as_trl_does(tmp_path: Path, family: str, rows: list[dict[str, Any]],
                                                     truncation: str) -> None:
    """Chosen rows then rejected rows, prompt tokens not counted, pairs over ``seq_len + 1`` cut
    as TRL's ``max_length`` cuts them (each set has a pair over it)."""
    write_chat_tokenizer(tmp_path / "tok", family)
    tokenizer = HFTokenizer(tmp_path / "tok" / "tokenizer.json")
    template = ChatTemplate(tokenizer)
    pairs = [encode_pair(row, tokenizer, template) for row in rows]
    seq_len = 23 if rows in (PLAIN, PLAIN_NO_PROMPT) else 63
    inputs, labels, cut = pair_rows(pairs, seq_len=seq_len, truncation=truncation)
    theirs = _trl_batch(rows, tmp_path / "tok", seq_len + 1, truncation)
    ids, mask = theirs["input_ids"].numpy(), theirs["completion_mask"].numpy().astype(bool)
    width = ids.shape[1]
    assert width <= seq_len + 1
    assert inputs.shape == labels.shape == (2 * len(rows), seq_len)
    assert np.array_equal(inputs[:, : width - 1], ids[:, :-1] * theirs["attention_mask"].numpy()[:, :-1])
    assert np.array_equal(labels[:, : width - 1], np.where(mask[:, 1:], ids[:, 1:], IGNORE_INDEX))
    assert (labels[:, width - 1:] == IGNORE_INDEX).all()
    longest = [len(p.prompt) + len(a) for p in pairs for a in (p.chosen, p.rejected)]
    assert cut == sum(n > seq_len + 1 for n in longest) > 0
    assert all((row != IGNORE_INDEX).any() for row in labels), "every sequence keeps some answer tokens"


def test_a_plain_answer_gets_the_eos_text_once_and_a_bad_row_is_a_row_error(tmp_path: Path) -> None:
    """Plain answers end with the EOS text once; malformed rows, and a prompt the chat template
    refuses to render, are row errors (one line naming the file and line, or skipped and counted:
    ``training.on_bad_row``)."""
    write_chat_tokenizer(tmp_path / "tok", "llama3")
    tokenizer = HFTokenizer(tmp_path / "tok" / "tokenizer.json")
    eos = tokenizer.eos_id
    pair = encode_pair({"prompt": "Hi", "chosen": " there<|eot_id|>", "rejected": " you"}, tokenizer, None)
    assert pair.chosen[-1] == eos and pair.rejected[-1] == eos
    assert list(pair.chosen).count(eos) == 1
    for bad, message in (({"prompt": "Hi", "chosen": " a"}, "expected 'chosen' and 'rejected'"),
                         ({"prompt": _user("Hi"), "chosen": " a", "rejected": _assistant("b")}, "must both be"),
                         ({"prompt": "Hi", "chosen": _assistant("a"), "rejected": _assistant("b")}, "'prompt' is not"),
                         ({"chosen": _user("same"), "rejected": _user("same")}, "'prompt' is not a non-empty")):
        with pytest.raises(RowError, match=message):
            encode_pair(bad, tokenizer, ChatTemplate(tokenizer))
    # A prompt the template cannot render (Gemma's rule: roles alternate, a user's first) is a row error.
    (tmp_path / "alternate.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "<turn>{{ m['role'] }}\n{{ m['content'] }}</turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<turn>model\n{% endif %}")
    strict = ChatTemplate(tokenizer, template_path=str(tmp_path / "alternate.jinja"))
    with pytest.raises(RowError, match="fails on it: Conversation roles must alternate") as info:
        encode_pair({"prompt": [{"role": "system", "content": "s"}], "chosen": _assistant("a"),
                     "rejected": _assistant("b")}, tokenizer, strict)
    assert info.value.kind == "template"


def test_at_the_first_step_the_sigmoid_loss_is_ln_2_and_every_reward_0() -> None:
    """Policy = reference: every log-ratio is 0, so the sigmoid loss is ln 2 (to 1e-6), hinge 1,
    IPO (1 / 2β)², and every reward 0."""
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11, dtype=torch.float64).float()
    labels = torch.randint(0, 11, (4, 6))
    labels[:, :2] = IGNORE_INDEX  # the prompt
    logps = sequence_logps(logits, labels)
    expected = torch.log_softmax(logits.double(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    assert torch.allclose(logps.double(), (expected * (labels != IGNORE_INDEX)).sum(-1), atol=1e-5)
    chosen, rejected = logps[:2], logps[2:]
    tokens = counted_tokens(labels)
    beta = 0.1
    for loss_type, value in (("sigmoid", math.log(2)), ("hinge", 1.0), ("ipo", (1 / (2 * beta)) ** 2)):
        out = dpo_losses(chosen, rejected, chosen.clone(), rejected.clone(), beta=beta, loss_type=loss_type,
                         chosen_tokens=tokens[:2], rejected_tokens=tokens[2:])
        assert torch.allclose(out.loss.double(), torch.full((2,), value, dtype=torch.float64), atol=1e-6), loss_type
        assert not out.chosen_rewards.any() and not out.rejected_rewards.any()


def test_losses_follow_trls_definitions() -> None:
    """Away from the first step: sigmoid, hinge and the per-token-averaged IPO against the formulas
    of TRL 1.16's DPOTrainer, conservative DPO (label smoothing ε: the preference label flipped with
    probability ε) against its paper's, and rewards β × log-ratio."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    pc, pr, rc, rr = (torch.randn(5, generator=g) * 3 for _ in range(4))
    tc, tr = torch.tensor([3, 1, 7, 2, 5]), torch.tensor([4, 2, 1, 6, 3])
    beta, eps = 0.25, 0.1
    delta = (pc - rc) - (pr - rr)
    cases = {
        ("sigmoid", 0.0): -F.logsigmoid(beta * delta),
        ("sigmoid", eps): -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta),
        ("hinge", 0.0): torch.relu(1 - beta * delta),
        ("ipo", 0.0): ((pc - rc) / tc - (pr - rr) / tr - 1 / (2 * beta)) ** 2,
    }
    for (loss_type, smoothing), expected in cases.items():
        out = dpo_losses(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=smoothing,
                         chosen_tokens=tc, rejected_tokens=tr)
        assert torch.allclose(out.loss, expected, atol=1e-6), (loss_type, smoothing)
        assert torch.allclose(out.chosen_rewards, beta * (pc - rc)) and torch.allclose(out.rejected_rewards,
                                                                                         beta * (pr - rr))
    with pytest.raises(ValueError, match="loss_type: 'kto'"):
        dpo_losses(pc, pr, rc, rr, beta=beta, loss_type="kto")


def test_a_preference_file_becomes_pair_windows_with_bad_rows_and_long_pairs_counted(tmp_path: Path,
                                                                                      caplog) -> None:
    """JSON lines and Parquet hold the same pairs and give the same windows (those of
    :func:`pair_rows`); a malformed row stops the job with one line naming the file and line, or
    with on_bad_row = 'skip' is counted; a pair whose prompt alone fills the window is dropped
    under keep_start (TRL drops it too) and kept, cut, under keep_end."""
    import json
    import logging

    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchtitan_lite.data.preference import pair_windows
    from torchtitan_lite.errors import DataError

    write_chat_tokenizer(tmp_path / "tok", "llama3")
    tokenizer = HFTokenizer(tmp_path / "tok" / "tokenizer.json")
    rows = [*CONVERSATIONAL, {"prompt": _user("p " * 80), "chosen": _assistant("a"), "rejected": _assistant("b")}]
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    common = {"seq_len": 63, "key": "training.dataset_path", "where": "here"}
    template = ChatTemplate(tokenizer)
    pairs = [encode_pair(r, tokenizer, template) for r in rows]
    over = [sum(len(p.prompt) + len(a) > 64 for a in (p.chosen, p.rejected)) for p in pairs]
    assert len(pairs[-1].prompt) >= 64 and sum(over[:-1]) >= 1
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        windows = pair_windows([jsonl], tokenizer, **common)
    assert len(windows) == len(rows) - 1 and windows.dropped == 1 and windows.cut == sum(over[:-1])
    assert f"{sum(over[:-1])} sequence(s) longer than seq_len + 1 = 64 tokens were cut (keep_start)" in caplog.text
    from_parquet = pair_windows([parquet], tokenizer, **common)
    inputs, labels, _ = pair_rows(pairs[:-1], seq_len=63)
    from torchtitan_lite.data.preference import pair_batch

    for source in (windows, from_parquet):
        got_inputs, got_labels = pair_batch(np.stack([source[i] for i in range(len(source))]))
        assert np.array_equal(got_inputs.numpy(), inputs) and np.array_equal(got_labels.numpy(), labels)
    kept = pair_windows([jsonl], tokenizer, **common, truncation="keep_end")
    assert len(kept) == len(rows) and kept.dropped == 0 and kept.cut == sum(over)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"prompt": "x", "chosen": "y"}) + "\n")
    with pytest.raises(DataError) as stop:
        pair_windows([bad], tokenizer, **common)
    assert str(stop.value).startswith(f"training.dataset_path: {str(bad)!r} line 2: expected 'chosen' and 'rejected'")
    assert str(stop.value).endswith("(or set training.on_bad_row = 'skip')") and "\n" not in str(stop.value)
    skipped = pair_windows([bad], tokenizer, **common, on_bad_row="skip")
    assert len(skipped) == 1 and skipped.skipped == 1


def _hf_folder(folder: Path, family: str, seed: int, tokenizer_folder: Path) -> Any:
    """The tiny model of ``family`` from ``seed`` (vocabulary widened to the tokenizer's), saved as
    a Hugging Face folder with the tokenizer beside it; returns our model (fp32, one process)."""
    import dataclasses
    import shutil

    from torchtitan_lite.checkpoint import hf_storage
    from torchtitan_lite.distributed.parallelize import build_sharded_model
    from torchtitan_lite.models import get_model_spec

    spec = get_model_spec(family)
    args = dataclasses.replace(spec.model_args("tiny"), vocab_size=512)
    model = build_sharded_model(spec, args, None, device=torch.device("cpu"), seed=seed, sharded=False)
    hf_storage.save_hf_weights(model, folder, spec=spec)
    for file in tokenizer_folder.iterdir():
        shutil.copy(file, folder / file.name)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_a_dpo_step_equals_trls_dpo_trainer(tmp_path: Path, family: str) -> None:
    """One process, fp32: the policy and the reference are two tiny models (different seeds, so
    rewards are not 0), the pairs those of the conversational set with the family's template.
    TRL's ``DPOTrainer.compute_loss`` and ours (pair rows, summed log-probabilities, the loss's
    mean over the pairs) give the same loss, rewards, log-probabilities and gradient norm within
    1e-5, for sigmoid, IPO and hinge. (TRL 1.16's sigmoid has no label smoothing and its ``robust``
    loss is another one, so conservative DPO is held to its formula above.)"""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    write_chat_tokenizer(tmp_path / "tok", family)
    ours = {name: _hf_folder(tmp_path / name, family, seed, tmp_path / "tok") for name, seed in (("policy", 7),
                                                                                                 ("reference", 8))}
    tokenizer = HFTokenizer(tmp_path / "tok" / "tokenizer.json")
    rows = CONVERSATIONAL
    pairs = [encode_pair(row, tokenizer, ChatTemplate(tokenizer)) for row in rows]
    inputs, labels, _ = pair_rows(pairs, seq_len=63)
    inputs, labels = torch.from_numpy(inputs), torch.from_numpy(labels)
    n = len(pairs)
    with torch.no_grad():
        ref_logps = sequence_logps(ours["reference"](inputs), labels)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "policy"))
    for loss_type in ("sigmoid", "ipo", "hinge"):
        config = DPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=n, beta=0.1,
                           loss_type=[loss_type], max_length=64, report_to=[], use_cpu=True, bf16=False,
                           logging_steps=1)
        policy = AutoModelForCausalLM.from_pretrained(str(tmp_path / "policy"), dtype=torch.float32)
        reference = AutoModelForCausalLM.from_pretrained(str(tmp_path / "reference"), dtype=torch.float32)
        trainer = DPOTrainer(model=policy, ref_model=reference, args=config, train_dataset=Dataset.from_list(rows),
                             processing_class=hf_tokenizer)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(n)])
        theirs = trainer.compute_loss(trainer.model, batch)
        theirs.backward()
        their_norm = torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1e9)
        metrics = {k: v[-1] for k, v in trainer._metrics["eval" if not trainer.model.training else "train"].items()}

        model = ours["policy"]
        model.zero_grad(set_to_none=True)
        logps = sequence_logps(model(inputs), labels)
        tokens = counted_tokens(labels)
        out = dpo_losses(logps[:n], logps[n:], ref_logps[:n], ref_logps[n:], beta=0.1, loss_type=loss_type,
                         chosen_tokens=tokens[:n], rejected_tokens=tokens[n:])
        loss = out.loss.mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        label = loss_type
        assert abs(loss.item() - theirs.item()) <= 1e-5 * max(1.0, abs(theirs.item())), (label, loss, theirs)
        assert abs(norm.item() - their_norm.item()) <= 1e-5 * their_norm.item(), (label, norm, their_norm)
        assert abs(out.chosen_rewards.mean().item() - metrics["rewards/chosen"]) <= 1e-5, label
        assert abs(out.rejected_rewards.mean().item() - metrics["rewards/rejected"]) <= 1e-5, label
        assert abs(logps[:n].mean().item() - metrics["logps/chosen"]) <= 1e-5 * abs(metrics["logps/chosen"]), label
        accuracy = (out.chosen_rewards > out.rejected_rewards).float().mean().item()
        assert accuracy == pytest.approx(metrics["rewards/accuracies"]) and metrics["rewards/chosen"] != 0


def _dpo_rank_logits(argv: list[str], tokens: torch.Tensor) -> tuple[list[dict[str, Any]], torch.Tensor]:
    """Train; the history and the trained model's logits of ``tokens``."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    try:
        history = trainer.train()
        with torch.no_grad():
            logits = trainer.model(tokens)
        from torch.distributed.tensor import DTensor

        return history, (logits.full_tensor() if isinstance(logits, DTensor) else logits).detach().clone()
    finally:
        trainer.close()


def _dpo_argv(tmp_path: Path, family: str, pairs: Path, *extra: str) -> list[str]:
    return ["--model.name", family, "--model.flavor", "tiny", "--model.tokenizer_path", str(tmp_path / "tok"),
            "--model.vocab_size", "512", "--training.dataset", "preference", "--training.dataset_path", str(pairs),
            "--training.seq_len", "63", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
            "--training.steps", "1", "--training.mixed_precision_param", "float32", "--training.no-shuffle",
            "--validation.no-enable", "--metrics.log_freq", "1", "--metrics.no-enable_tensorboard",
            "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", "1", "--debug.deterministic",
            "--checkpoint.initial_load_path", str(tmp_path / "policy"), "--checkpoint.initial_load_in_hf",
            "--job.dump_folder", str(tmp_path / "dump"), *extra]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", pytest.param("qwen3", marks=pytest.mark.scenario)])
def test_two_ranks_first_step_is_ln_2_and_equals_trl(tmp_path: Path, family: str) -> None:
    """2 ranks, fp32, a full fine-tune from a Hugging Face folder with a frozen sharded copy of it
    as the reference: the first step's sigmoid loss is ln 2 (to 1e-6), every reward 0, and for
    sigmoid, IPO and hinge its loss and gradient norm are those of TRL's DPOTrainer on the same 4
    pairs within 1e-5."""
    import json

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from tests.dist_utils import run_distributed

    write_chat_tokenizer(tmp_path / "tok", family)
    _hf_folder(tmp_path / "policy", family, 7, tmp_path / "tok")
    rows = CONVERSATIONAL[:4]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "policy"))
    for loss_type in ("sigmoid", "ipo", "hinge"):
        (first, *_), *_ = run_distributed(train_history, 2, _dpo_argv(tmp_path, family, pairs, "--dpo.loss_type",
                                                                  loss_type, "--job.dump_folder",
                                                                  str(tmp_path / loss_type)))
        if loss_type == "sigmoid":
            assert abs(first["loss"] - math.log(2)) <= 1e-6, first
        assert first["dpo/rewards_chosen"] == first["dpo/rewards_rejected"] == first["dpo/margin"] == 0, first
        models = [AutoModelForCausalLM.from_pretrained(str(tmp_path / "policy"), dtype=torch.float32)
                  for _ in range(2)]
        config = DPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, beta=0.1, max_length=64,
                           loss_type=[loss_type], report_to=[], use_cpu=True, bf16=False)
        trainer = DPOTrainer(model=models[0], ref_model=models[1], args=config, train_dataset=Dataset.from_list(rows),
                             processing_class=hf_tokenizer)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1e9)
        assert abs(first["loss"] - loss.item()) <= 1e-5 * max(1.0, loss.item()), (loss_type, first, loss)
        assert abs(first["grad_norm"] - norm.item()) <= 1e-5 * norm.item(), (loss_type, first, norm)


def _rule_pairs(count: int) -> list[dict[str, Any]]:
    """Pairs whose chosen answer follows a rule the rejected one breaks: the chosen answer repeats
    the prompt's last word, the rejected one says another."""
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]
    return [{"prompt": _user(f"Repeat the last word: {words[i % 8]} {words[(3 * i + 1) % 8]}"),
             "chosen": _assistant(words[(3 * i + 1) % 8]), "rejected": _assistant(words[(3 * i + 4) % 8])}
            for i in range(count)]


@pytest.mark.slow
def test_dpo_learns_resumes_exactly_and_lora_adapters_off_is_a_frozen_copy(tmp_path: Path) -> None:
    """2 ranks, fp32, 40 steps of 8 pairs on 32 pairs that follow a rule: the reward accuracy
    goes from 0.5 or less at the first steps to above 0.9 over the last five and the loss falls; a run
    stopped at step 20 and resumed repeats steps 21-40 within 1e-5. With LoRA, the reference as
    the adapters switched off trains exactly as with a frozen copy of the base (1e-6), and its last
    save, a PEFT adapter folder, loads in PEFT with the trained model's logits (1e-5)."""
    import json

    from tests.dist_utils import run_distributed

    write_chat_tokenizer(tmp_path / "tok", "llama3")
    _hf_folder(tmp_path / "policy", "llama3", 7, tmp_path / "tok")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in _rule_pairs(32)))
    steps = ["--training.steps", "40", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "2",
             "--training.local_batch_size", "4", "--training.global_batch_size", "8", "--training.shuffle",
             "--checkpoint.enable", "--checkpoint.interval", "20"]
    whole = run_distributed(train_history, 2, _dpo_argv(tmp_path, "llama3", pairs, *steps))[0]
    accuracy = [r["dpo/accuracy"] for r in whole]
    assert max(accuracy[:2]) <= 0.5 and sum(accuracy[-5:]) / 5 > 0.9, accuracy
    assert sum(r["loss"] for r in whole[-5:]) < sum(r["loss"] for r in whole[:5]) - 1.0, [r["loss"] for r in whole]

    resumed_dump = tmp_path / "resumed"
    import shutil

    shutil.copytree(tmp_path / "dump" / "checkpoint" / "step-20", resumed_dump / "checkpoint" / "step-20")
    resumed = run_distributed(train_history, 2, [*_dpo_argv(tmp_path, "llama3", pairs, *steps),
                                             "--job.dump_folder", str(resumed_dump)])[0]
    assert [r["step"] for r in resumed] == list(range(21, 41))
    for a, b in zip(resumed, whole[20:], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["dpo/accuracy"] - b["dpo/accuracy"]) <= 1e-6, (a, b)

    lora = ["--lora.enable", "--lora.rank", "4", "--training.steps", "6", "--optimizer.lr", "1e-2"]
    tokens = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(3))
    export = ["--checkpoint.enable", "--checkpoint.interval", "6", "--checkpoint.last_save_model_only",
              "--checkpoint.last_save_in_hf"]
    off, trained = run_distributed(_dpo_rank_logits, 2, _dpo_argv(tmp_path, "llama3", pairs, *lora, *export,
                                                                 "--job.dump_folder", str(tmp_path / "off")),
                                   tokens)[0]
    copy = run_distributed(train_history, 2, _dpo_argv(tmp_path, "llama3", pairs, *lora, "--dpo.reference", "copy",
                                                   "--job.dump_folder", str(tmp_path / "copy")))[0]
    assert off[-1]["dpo/margin"] != 0
    for a, b in zip(off, copy, strict=True):
        for key in ("loss", "grad_norm", "dpo/margin", "dpo/logps_chosen"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(b[key])), (key, a, b)
    # The last save is a PEFT adapter folder: PEFT on transformers' base gives the trained logits.
    import peft
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "off" / "checkpoint" / "step-6"
    assert (folder / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "policy"), dtype=torch.float32)
    with torch.no_grad():
        loaded = peft.PeftModel.from_pretrained(base, str(folder)).eval()(tokens).logits
    assert torch.allclose(loaded, trained, atol=1e-5, rtol=0), float((loaded - trained).abs().max())


@pytest.mark.slow
def _dpo_rank_offline_wandb(argv: list[str], folder: str) -> list[dict[str, Any]]:
    import os

    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=folder)
    return train_history(argv)


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_a_dpo_mixture_validates_as_trl_evaluates_and_exports_a_hugging_face_folder(tmp_path: Path) -> None:
    """2 ranks, fp32, a full fine-tune with a frozen copy loaded from a DCP checkpoint: a mixture of
    two preference sources (3:1) reports each source's pairs and mean pair loss, which make up the
    step's loss; validation on 5 pairs (2 ranks × 2 a pass: padding pairs left out) after step 3
    gives TRL's ``DPOTrainer.evaluate`` on the Hugging Face folder that the last save exported (the
    reference: the starting weights, as a Hugging Face folder), loss and reward metrics within 1e-5.
    Every DPO metric of ``metrics.jsonl`` is in TensorBoard's scalars and W&B's (offline) history."""
    import importlib.util
    import json

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from tests.dist_utils import run_distributed

    wandb = importlib.util.find_spec("wandb") is not None
    write_chat_tokenizer(tmp_path / "tok", "llama3")
    _hf_folder(tmp_path / "policy", "llama3", 7, tmp_path / "tok")
    (tmp_path / "rules.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rule_pairs(24)))
    # The starting weights as a DCP checkpoint of this project's (an SFT run's save, say): one step at lr 1e-30.
    run_distributed(train_history, 2, [*_dpo_argv(tmp_path, "llama3", tmp_path / "rules.jsonl"), "--optimizer.lr",
                                   "1e-30", "--checkpoint.enable", "--job.dump_folder", str(tmp_path / "sft")])
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONAL[:3] * 2))
    val_rows = [*_rule_pairs(27)[24:], *CONVERSATIONAL[:2]]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in val_rows))
    (tmp_path / "job.toml").write_text(
        "".join(f'[[training.datasets]]\nname = "{name}"\ndataset = "preference"\n'
                f'dataset_path = "{tmp_path / (name + ".jsonl")}"\nweight = {weight}\n\n'
                for name, weight in (("rules", 3), ("chat", 1)))
        + f'[validation]\nenable = true\nfreq = 3\nsteps = -1\ndataset = "preference"\n'
          f'dataset_path = "{tmp_path / "val.jsonl"}"\n')
    argv = _dpo_argv(tmp_path, "llama3", tmp_path / "rules.jsonl", "--training.steps", "3")
    at = argv.index("--training.dataset")
    del argv[at:at + 4]  # the TOML's mixture instead
    argv.remove("--validation.no-enable")
    argv.remove("--checkpoint.initial_load_in_hf")
    argv[argv.index("--checkpoint.initial_load_path") + 1] = str(tmp_path / "sft" / "checkpoint" / "step-1")
    argv = ["--job.config_file", str(tmp_path / "job.toml"), *argv, "--checkpoint.enable", "--checkpoint.interval",
            "3", "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf", "--metrics.enable_tensorboard",
            *(["--metrics.enable_wandb", "--metrics.wandb_project", "dpo"] if wandb else [])]
    history = run_distributed(_dpo_rank_offline_wandb, 2, argv, str(tmp_path))[0]
    # Every DPO metric of metrics.jsonl is in TensorBoard's scalars and W&B's history.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.dist_utils import read_jsonl
    from tests.test_callbacks import _wandb_records

    records = read_jsonl(tmp_path / "dump" / "metrics.jsonl")
    keys = [k for k in records[-1] if k.startswith(("dpo/", "validation/dpo/", "pairs/", "loss/"))]
    assert len(keys) == 2 * 6 + 4, keys
    (tb,) = (tmp_path / "dump" / "tb").iterdir()
    scalars = EventAccumulator(str(tb))
    scalars.Reload()
    rows: dict[int, dict[str, Any]] = {}
    if wandb:
        (file,) = (tmp_path / "dump" / "wandb").glob("offline-run-*/run-*.wandb")
        for record in _wandb_records(file):
            if record.WhichOneof("record_type") == "history":
                rows[int(record.history.step.num)] = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                                      for item in record.history.item}
    for r in records:
        for key in keys:
            if r.get(key) is not None:
                logged = [e.value for e in scalars.Scalars(key) if e.step == r["step"]]
                assert logged and abs(logged[0] - r[key]) <= 1e-6 * max(1.0, abs(r[key])), (key, r)
                assert not wandb or rows[r["step"]][key] == r[key], (key, r)
    for i, r in enumerate(history):
        counts = {n: r[f"pairs/{n}"] - (history[i - 1][f"pairs/{n}"] if i else 0) for n in ("rules", "chat")}
        assert sum(counts.values()) == 4 and counts["rules"] >= counts["chat"], counts
        mixed = sum(r[f"loss/{n}"] * c for n, c in counts.items() if c) / 4
        assert abs(mixed - r["loss"]) <= 1e-9, (r, counts)
    assert history[-1]["pairs/rules"] == 9 and history[-1]["pairs/chat"] == 3, history[-1]
    ours = history[-1]
    assert ours["validation_pairs"] == 5 and abs(history[0]["loss"] - math.log(2)) <= 1e-6

    folder = tmp_path / "dump" / "checkpoint" / "step-3"
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "policy"))
    trained = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(str(tmp_path / "policy"), dtype=torch.float32)
    config = DPOConfig(output_dir=str(tmp_path / "out"), per_device_eval_batch_size=len(val_rows), beta=0.1,
                       max_length=64, report_to=[], use_cpu=True, bf16=False)
    theirs = DPOTrainer(model=trained, ref_model=start, args=config, train_dataset=Dataset.from_list(val_rows),
                        eval_dataset=Dataset.from_list(val_rows),
                        processing_class=tokenizer).evaluate()
    names = {"loss": "loss", "dpo/rewards_chosen": "rewards/chosen", "dpo/rewards_rejected": "rewards/rejected",
             "dpo/margin": "rewards/margins", "dpo/accuracy": "rewards/accuracies", "dpo/logps_chosen": "logps/chosen",
             "dpo/logps_rejected": "logps/rejected"}
    for ours_name, their_name in names.items():
        key, their_key = ("validation_loss" if ours_name == "loss" else f"validation/{ours_name}"), f"eval_{their_name}"
        assert abs(ours[key] - theirs[their_key]) <= 1e-5 * max(1.0, abs(theirs[their_key])), (key, ours, theirs)
    assert ours["validation/dpo/margin"] != 0


def test_packed_pairs_fill_windows_whole_and_a_long_pair_is_cut_to_one(tmp_path: Path) -> None:
    """dpo.packing's windows: whole pairs, each its chosen sequence (sample 2k) then its rejected one
    (2k + 1), the tokens and counted labels of a pair's own two windows; a pair longer than a window
    cut to it, the longer sequence first and neither below half; a pair whose prompt fills its half
    dropped (keep_start); greedy keeps the order, bfd leaves less padding."""
    import json

    from torchtitan_lite.data.preference import Pair, packed_sizes, pair_window, pair_windows

    assert packed_sizes(Pair(np.zeros(10), np.zeros(90), np.zeros(5)), 64) == (49, 15)  # (the longer one cut)
    assert packed_sizes(Pair(np.zeros(10), np.zeros(90), np.zeros(60)), 64) == (32, 32)  # (both, to half)
    assert packed_sizes(Pair(np.zeros(10), np.zeros(20), np.zeros(5)), 64) == (30, 15)  # (it fits)
    write_chat_tokenizer(tmp_path / "tok", "llama3")
    tokenizer = HFTokenizer(tmp_path / "tok" / "tokenizer.json")
    rows = [*CONVERSATIONAL, {"prompt": _user("Why?"), "chosen": _assistant("because " * 50),
                              "rejected": _assistant("no " * 50)},
            {"prompt": _user("p " * 40), "chosen": _assistant("a"), "rejected": _assistant("b")}]
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = ChatTemplate(tokenizer)
    pairs = [encode_pair(r, tokenizer, template) for r in rows]
    size = 128
    assert len(pairs[-1].prompt) >= size // 2 and len(pairs[-1].prompt) < size  # (alone it would fit a window)
    greedy = pair_windows([jsonl], tokenizer, seq_len=size - 1, key="k", where="w", packing="greedy")
    assert greedy.pairs == len(rows) - 1 and greedy.dropped == 1
    seen = []
    for window in (greedy[i] for i in range(len(greedy))):
        samples = int(window[2].max())  # (the padding's number, or the last pair's rejected one)
        for k in range(samples // 2 + (samples % 2)):
            chosen, rejected = (window[:2, window[2] == 2 * k + side] for side in (0, 1))
            seen.append((chosen, rejected))
    assert len(seen) == len(rows) - 1
    for index, (chosen, rejected) in enumerate(seen):  # (in order: greedy)
        pair = pairs[index]
        keep = packed_sizes(pair, size)
        alone, _ = pair_window(pair, seq_len=size - 1)
        for side, got in enumerate((chosen, rejected)):
            assert got.shape[1] == keep[side]
            assert (got == alone[side, :2, :keep[side]]).all()  # (tokens and counted labels, cut at the end)
    assert greedy.cut == 2 and packed_sizes(pairs[-2], size) == (64, 64)  # (the long pair: both to half)
    bfd = pair_windows([jsonl], tokenizer, seq_len=size - 1, key="k", where="w", packing="bfd")
    assert len(bfd) <= len(greedy) and bfd.padding <= greedy.padding


def test_packed_pairs_give_the_loss_and_validation_of_unpacked_ones(tmp_path: Path) -> None:
    """One process, fp32, block-causal attention: 5 pairs packed into 2 rows of 256 give the first
    step's loss and gradient norm of the same 5 pairs unpacked (10 padded rows of 128), and after
    that step the validation of all 16 pairs packed (7 rows) equals theirs unpacked: loss, margin,
    accuracy and log-probabilities within 1e-5 (the margins no longer 0)."""
    import json

    from tests.test_dpo_axes import _argv, _dense_folder

    folder = _dense_folder(tmp_path)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONAL * 4))
    common = ["--training.steps", "1", "--model.attention_mask", "block_causal", "--validation.enable",
              "--validation.dataset", "preference", "--validation.dataset_path", str(pairs), "--validation.freq", "1",
              "--validation.steps", "-1"]
    packed = train_history(_argv(folder, pairs, tmp_path / "packed", *common, "--training.seq_len", "255",
                                 "--dpo.packing", "--training.local_batch_size", "2", "--training.global_batch_size",
                                 "2", "--validation.local_batch_size", "4", family="llama3"))[0]
    plain = train_history(_argv(folder, pairs, tmp_path / "plain", *common, "--training.seq_len", "127",
                                "--training.local_batch_size", "5", "--training.global_batch_size", "5",
                                "--validation.local_batch_size", "5", family="llama3"))[0]
    assert packed["dpo/pairs"] == 5 and packed["validation_pairs"] == plain["validation_pairs"] == 16
    assert plain["validation/dpo/margin"] != 0
    for key in ("loss", "grad_norm", "dpo/logps_chosen", "dpo/logps_rejected", "validation_loss",
                "validation/dpo/margin", "validation/dpo/accuracy", "validation/dpo/logps_rejected"):
        assert abs(packed[key] - plain[key]) <= 1e-5 * max(1.0, abs(plain[key])), (key, packed, plain)


@pytest.mark.parametrize("extra, message", [
    (["--training.dataset", "python_stdlib", "--dpo.beta", "0.2"],
     "error: dpo.beta: invalid value 0.2; [dpo] applies to training.dataset = 'preference' (this job's is "
     "'python_stdlib')"),
    (["--validation.enable"], "error: validation.dataset: invalid value ['python_stdlib_validation']; a DPO job "
                              "validates on preference pairs: expected dataset = 'preference'"),
    (["--training.dataset", "python_stdlib", "--validation.enable", "--validation.dataset", "preference",
      "--validation.dataset_path", "PAIRS"], "error: validation.dataset: invalid value ['preference']; preference "
                                             "pairs are validated by a DPO job"),
    (["--dpo.reference", "adapters_off"], "error: dpo.reference: invalid value 'adapters_off'; switching adapters off "
                                          "needs LoRA"),
    (["--dpo.loss_type", "ipo", "--dpo.label_smoothing", "0.1"], "error: dpo.label_smoothing: invalid value 0.1; "
                                                                 "conservative DPO is a sigmoid loss"),
    (["--dpo.beta", "0"], "error: dpo.beta: invalid value 0.0; expected a number > 0"),
    (["--dpo.packing"], "error: dpo.packing: invalid value True; packed pairs attend each to itself only: needs "
                        "model.attention_mask = 'block_causal' (this job's is 'causal')"),
])
def test_bad_dpo_settings_are_one_line_before_any_process_group(tmp_path: Path, capsys, extra: list[str],
                                                                  message: str) -> None:
    import json

    from tests.dist_utils import refused_lines

    write_chat_tokenizer(tmp_path / "tok", "llama3")
    _hf_folder(tmp_path / "policy", "llama3", 7, tmp_path / "tok")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONAL))
    argv = _dpo_argv(tmp_path, "llama3", pairs, *[str(pairs) if e == "PAIRS" else e for e in extra])
    if "python_stdlib" in extra:  # (that dataset reads no path)
        at = argv.index("--training.dataset_path")
        del argv[at:at + 2]
    lines = refused_lines(argv, capsys)
    assert len(lines) == 1 and lines[0].startswith(message), lines


def test_a_dpo_mixture_is_of_preference_sources_only(tmp_path: Path, capsys) -> None:
    import json

    from tests.dist_utils import refused_lines

    write_chat_tokenizer(tmp_path / "tok", "llama3")
    _hf_folder(tmp_path / "policy", "llama3", 7, tmp_path / "tok")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONAL))
    (tmp_path / "job.toml").write_text(
        f'[[training.datasets]]\nname = "pairs"\ndataset = "preference"\ndataset_path = "{pairs}"\n\n'
        '[[training.datasets]]\nname = "code"\ndataset = "python_stdlib"\n')
    argv = _dpo_argv(tmp_path, "llama3", pairs)
    at = argv.index("--training.dataset")
    del argv[at:at + 4]
    lines = refused_lines(["--job.config_file", str(tmp_path / "job.toml"), *argv], capsys)
    assert lines == ["error: training.datasets: invalid value ['preference', 'python_stdlib']; a DPO mixture is of "
                     "preference sources only: expected every dataset = 'preference'"], lines


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_dpo_under_tensor_parallel_hsdp_checkpointing_and_offload_equals_data_parallel(tmp_path: Path) -> None:
    """4 ranks, fp32, 4 steps: data parallel 2 × tensor parallel 2 (logits split over the
    vocabulary), HSDP 2 × 2, full activation checkpointing, CPU offload and the reshard modes
    never, always, 2 and auto give the losses, gradient norms and rewards of FSDP over the 4 ranks
    (reshard default) within 1e-5."""
    import json

    from tests.dist_utils import run_distributed

    write_chat_tokenizer(tmp_path / "tok", "llama3")
    _hf_folder(tmp_path / "policy", "llama3", 7, tmp_path / "tok")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in _rule_pairs(16)))
    common = ["--training.steps", "4", "--training.local_batch_size", "2", "--training.global_batch_size", "8",
              "--optimizer.lr", "1e-2", "--training.seq_len", "64"]
    layouts = {
        "fsdp4": [],
        "dp2xtp2": ["--parallelism.tensor_parallel_degree", "2", "--training.global_batch_size", "4",
                    "--training.local_batch_size", "2"],
        "hsdp2x2": ["--parallelism.data_parallel_replicate_degree", "2"],
        "ac_full": ["--activation_checkpoint.mode", "full"],
        "offload": ["--training.enable_cpu_offload"],
        "never": ["--parallelism.reshard_after_forward_mode", "never"],
        "always": ["--parallelism.reshard_after_forward_mode", "always"],
        "int2": ["--parallelism.reshard_after_forward_mode", "2"],
        # between the estimates of always (5.02 MiB) and never (5.65 MiB): auto checkpoints one block
        "auto": ["--parallelism.reshard_after_forward_mode", "auto", "--parallelism.memory_budget_gib", "0.0052"],
    }
    runs = {name: run_distributed(train_history, 4, _dpo_argv(tmp_path, "llama3", pairs, *common, *extra,
                                                            "--job.dump_folder", str(tmp_path / name)))[0]
            for name, extra in layouts.items() if name != "dp2xtp2"}
    first = runs["fsdp4"]
    assert first[-1]["dpo/margin"] != 0
    for name, run in runs.items():
        for a, b in zip(run, first, strict=True):
            for key in ("loss", "grad_norm", "dpo/margin", "dpo/rewards_chosen"):
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (name, key, a, b)
    # Tensor parallel 2 reads half the pairs a step (data parallel 2): against FSDP over 2 ranks.
    two = run_distributed(train_history, 2, _dpo_argv(tmp_path, "llama3", pairs, *common,
                                                      "--training.global_batch_size", "4",
                                                      "--job.dump_folder", str(tmp_path / "fsdp2")))[0]
    tp = run_distributed(train_history, 4, _dpo_argv(tmp_path, "llama3", pairs, *common, *layouts["dp2xtp2"],
                                                 "--job.dump_folder", str(tmp_path / "dp2xtp2")))[0]
    for a, b in zip(tp, two, strict=True):
        for key in ("loss", "grad_norm", "dpo/margin"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), ("dp2xtp2", key, a, b)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", pytest.param("qwen3", marks=pytest.mark.scenario)])
def test_lora_first_step_with_adapters_off_equals_trl_on_a_peft_model(tmp_path: Path, family: str) -> None:
    """2 ranks, fp32, LoRA (rank 4 on the attention's linears) with the adapters switched off as
    the reference: our first step's loss, rewards and gradient norm equal TRL's DPOTrainer on a PEFT
    model holding the same adapters (PEFT's reference: the adapters disabled) within 1e-5, for
    sigmoid, IPO and hinge. The adapters are ours at their init: a one-step run at learning rate
    1e-30 exports them as a PEFT folder."""
    import json

    import peft
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from tests.dist_utils import run_distributed

    write_chat_tokenizer(tmp_path / "tok", family)
    _hf_folder(tmp_path / "policy", family, 7, tmp_path / "tok")
    rows = _rule_pairs(4)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lora = ["--lora.enable", "--lora.rank", "4", "--lora.alpha", "8", "--optimizer.lr", "1e-30",
            "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.last_save_model_only",
            "--checkpoint.last_save_in_hf", "--training.seq_len", "64"]
    for loss_type in ("sigmoid", "ipo", "hinge"):
        dump = tmp_path / loss_type
        (first, *_), *_ = run_distributed(train_history, 2, _dpo_argv(tmp_path, family, pairs, *lora, "--dpo.loss_type",
                                                                       loss_type, "--job.dump_folder", str(dump)))
        if loss_type == "sigmoid":
            assert abs(first["loss"] - math.log(2)) <= 1e-6 and first["grad_norm"] > 0
        base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "policy"), dtype=torch.float32)
        model = peft.PeftModel.from_pretrained(base, str(dump / "checkpoint" / "step-1"), is_trainable=True)
        config = DPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, beta=0.1, max_length=65,
                           loss_type=[loss_type], report_to=[], use_cpu=True, bf16=False)
        trainer = DPOTrainer(model=model, ref_model=None, args=config, train_dataset=Dataset.from_list(rows),
                             processing_class=AutoTokenizer.from_pretrained(str(tmp_path / "policy")))
        loss = trainer.compute_loss(trainer.model, trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_([p for p in trainer.model.parameters() if p.requires_grad], 1e9)
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        assert abs(first["loss"] - loss.item()) <= 1e-5 * max(1.0, abs(loss.item())), (loss_type, first, loss)
        assert abs(first["grad_norm"] - norm.item()) <= 1e-5 * norm.item(), (loss_type, first["grad_norm"], norm)
        for ours, theirs in (("dpo/rewards_chosen", "rewards/chosen"), ("dpo/rewards_rejected", "rewards/rejected")):
            assert abs(first[ours] - metrics[theirs]) <= 1e-5, (loss_type, ours, first, metrics)


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_dpo_compiled_and_in_bf16(tmp_path: Path) -> None:
    """2 ranks, 3 steps: compiled blocks give the eager fp32 losses and rewards within 1e-5, with a
    frozen copy and with LoRA's adapters switched off (the compiled blocks run both ways); bf16
    (gathers and compute, fp32 shards) stays within 1e-2 of fp32 and its first step is ln 2."""
    import json

    from tests.dist_utils import run_distributed

    write_chat_tokenizer(tmp_path / "tok", "llama3")
    _hf_folder(tmp_path / "policy", "llama3", 7, tmp_path / "tok")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in _rule_pairs(8)))
    common = ["--training.steps", "3", "--training.seq_len", "64", "--optimizer.lr", "1e-2"]
    lora = ["--lora.enable", "--lora.rank", "4"]
    runs = {name: run_distributed(train_history, 2, _dpo_argv(tmp_path, "llama3", pairs, *common, *extra,
                                                            "--job.dump_folder", str(tmp_path / name)))[0]
            for name, extra in {"eager": [], "compiled": ["--compile.enable"], "lora": lora,
                                "lora_compiled": [*lora, "--compile.enable"],
                                "bf16": ["--training.mixed_precision_param", "bfloat16"]}.items()}
    for compiled, eager, tolerance in (("compiled", "eager", 1e-5), ("lora_compiled", "lora", 1e-5),
                                       ("bf16", "eager", 1e-2)):
        assert runs[eager][-1]["dpo/margin"] != 0
        for a, b in zip(runs[compiled], runs[eager], strict=True):
            for key in ("loss", "dpo/margin"):
                assert abs(a[key] - b[key]) <= tolerance * max(1.0, abs(b[key])), (compiled, key, a, b)
    assert abs(runs["bf16"][0]["loss"] - math.log(2)) <= 1e-6


def _dpo_step_peak(argv: list[str]) -> int:
    import functools

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.memory.measure import trainer_step_peak
    from torchtitan_lite.trainer import Trainer

    peak, trainer = trainer_step_peak(functools.partial(Trainer, load_job_config(argv)))
    trainer.metrics.close()
    return peak


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_the_estimate_of_a_dpo_step_is_within_bounds_of_the_allocator(tmp_path: Path) -> None:
    """The debug model's shape, 2 ranks, fp32, 2 pairs (4 rows of 127 tokens) a rank: the memory
    estimate of a DPO step (the pairs' rows, the reference's forward first: a frozen copy, or LoRA's
    adapters off) is within -3% / +10% of the allocator's peak of a real trainer step, with and
    without activation checkpointing, on packed pairs (2 rows of 256 a rank, block-causal), and
    through pipeline 2 (1F1B; each pipeline rank's estimate against its own peak, the
    reference's forward-only schedule and its receive buffers included); and above the estimate
    of the same job as if each row were a sample with no reference."""
    import dataclasses
    import json
    import shutil

    from tests.dist_utils import run_distributed
    from torchtitan_lite.checkpoint import hf_storage
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.distributed.job_shape import ObjectiveShape
    from torchtitan_lite.distributed.parallelize import build_sharded_model
    from torchtitan_lite.job import plan_job
    from torchtitan_lite.memory.estimate import estimate_memory, estimate_stages, job_estimate_shape
    from torchtitan_lite.models import get_model_spec

    write_chat_tokenizer(tmp_path / "tok", "llama3")
    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.model_args("debugmodel"), vocab_size=512)
    model = build_sharded_model(spec, args, None, device=torch.device("cpu"), seed=7, sharded=False)
    hf_storage.save_hf_weights(model, tmp_path / "policy", spec=spec)
    for file in (tmp_path / "tok").iterdir():
        shutil.copy(file, tmp_path / "policy" / file.name)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in _rule_pairs(16) * 8))
    pipeline = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1",
                "--training.global_batch_size", "2"]
    for name, extra in {"copy": [], "copy, full AC": ["--activation_checkpoint.mode", "full"],
                        "LoRA, adapters off": ["--lora.enable"],
                        "packed, copy": ["--model.attention_mask", "block_causal", "--dpo.packing",
                                         "--training.seq_len", "255"],
                        "pp2 1F1B, copy": pipeline}.items():
        argv = _dpo_argv(tmp_path, "llama3", pairs, "--model.flavor", "debugmodel", "--training.seq_len", "127",
                         "--training.steps", "4", *extra, "--job.dump_folder", str(tmp_path / name.replace(" ", "")))
        config = load_job_config(argv)
        plan = plan_job(config, world_size=2)
        shape = job_estimate_shape(plan)
        mode = plan.shape.reshard_after_forward_mode
        measured = run_distributed(_dpo_step_peak, 2, argv)
        if plan.shape.pipeline is not None:
            stages = estimate_stages(plan.spec, plan.model_args, shape=shape, reshard_after_forward_mode=mode)
            for estimate in stages:
                error = (estimate.peak - measured[estimate.pipeline_rank]) / measured[estimate.pipeline_rank]
                print(f"{name} pp rank {estimate.pipeline_rank}: {error:+.2%}")
                assert -0.03 <= error <= 0.10, (name, estimate.pipeline_rank, estimate.peak, measured, error)
            continue
        estimate = estimate_memory(plan.spec, plan.model_args, shape, reshard_after_forward_mode=mode)
        plain = estimate_memory(plan.spec, plan.model_args, shape, reshard_after_forward_mode=mode,
                                objective_shape=ObjectiveShape())  # (the token step: no pair, no reference)
        error = (estimate.peak - max(measured)) / max(measured)
        print(f"{name}: {error:+.2%}")
        assert -0.03 <= error <= 0.10, (name, estimate.peak, measured, error)
        assert estimate.peak > plain.peak, (name, estimate.peak, plain.peak)
