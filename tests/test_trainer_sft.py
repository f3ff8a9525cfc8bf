"""Supervised fine-tuning through the trainer: conversations rendered with a chat template,
packed with block-causal attention, the loss over the assistant turns only, equal to
transformers' loss on the same conversations run one at a time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.dist_utils import captured_log, one_error_line, run_distributed, run_main
from tests.test_data_chat import CONVERSATIONS, family_rows, write_chat_tokenizer

transformers = pytest.importorskip("transformers")

SEQ, GLOBAL = 127, 4


@pytest.fixture(scope="module")
def sft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A chat tokenizer (Llama 3's template), a random Llama saved by transformers with its
    vocabulary, and the conversations as JSON lines."""
    from tests.test_decoder_hf import hf_llama
    from torchtitan_lite.data import HFTokenizer

    root = tmp_path_factory.mktemp("sft")
    path = write_chat_tokenizer(root / "tokenizer", "llama3")
    hf_llama(root / "base", vocab_size=HFTokenizer(path).vocab_size)
    (root / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    return root


def _argv(root: Path, dump: Path, *extra: str) -> list[str]:
    return ["--model.name", "llama3", "--model.flavor", "from_checkpoint", "--model.tokenizer_path",
            str(root / "tokenizer"), "--model.attention_mask", "block_causal",
            "--checkpoint.initial_load_path", str(root / "base"), "--checkpoint.initial_load_in_hf",
            "--training.dataset", "chat", "--training.dataset_path", str(root / "chat.jsonl"),
            "--training.seq_len", str(SEQ), "--training.global_batch_size", str(GLOBAL), "--training.steps", "1",
            "--training.no-shuffle", "--training.mixed_precision_param", "float32", "--job.dump_folder", str(dump),
            "--metrics.log_freq", "1", "--metrics.no-enable_tensorboard", *extra]


def _losses(argv: list[str]) -> list[float]:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    try:
        return [h["loss"] for h in trainer.train()]
    finally:
        trainer.close()


def _first_loss(argv: list[str]) -> float:
    return _losses(argv)[0]


def _transformers_loss(root: Path, *, seq_len: int = SEQ) -> float:
    """The first global batch's conversations, each run alone by transformers with the labels our
    data counts (the assistant turns): the mean over every counted token."""
    from torchtitan_lite.data import HFTokenizer
    from torchtitan_lite.data.chat import packed_windows

    windows = packed_windows([root / "chat.jsonl"], HFTokenizer(root / "tokenizer" / "tokenizer.json"),
                             seq_len=seq_len, loss_on="assistant", truncate="right", key="k", where="w")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(root / "base"), dtype=torch.float32).eval()
    total, count = 0.0, 0
    for index in range(GLOBAL):
        tokens, counted, samples = windows[index]
        for sample in np.unique(samples):
            keep = samples == sample
            if not counted[keep].any():
                continue  # the padding
            ids = torch.from_numpy(tokens[keep])[None]
            labels = torch.where(torch.from_numpy(counted[keep]).bool()[None], ids, torch.full_like(ids, -100))
            n = int((labels[0, 1:] != -100).sum())
            if n:
                with torch.no_grad():
                    total += float(model(input_ids=ids, labels=labels).loss) * n
                count += n
    return total / count


@pytest.mark.slow
def test_sft_first_step_loss_equals_transformers_on_two_ranks_with_and_without_accumulation(
        tmp_path: Path, sft: Path) -> None:
    expected = _transformers_loss(sft)
    for local_bs in (2, 1):  # one micro-batch per rank, then accumulation of 2
        losses = run_distributed(_first_loss, 2, _argv(sft, tmp_path / f"lbs{local_bs}", "--training.local_batch_size",
                                                         str(local_bs)))
        assert losses[0] == losses[1]
        assert abs(losses[0] - expected) <= 1e-5 * expected, (local_bs, losses[0], expected)


@pytest.mark.slow
def test_qwen3_multi_turn_reasoning_loss_equals_transformers_on_two_ranks(tmp_path: Path) -> None:
    """The Qwen3-style template (earlier reasoning stripped, a think block on the last turn, tool
    calls), multi-turn conversations with reasoning, 2 ranks, fp32: the first-step loss equals
    transformers' cross-entropy over the counted tokens."""
    from tests.test_decoder_hf import hf_qwen3
    from torchtitan_lite.data import HFTokenizer

    path = write_chat_tokenizer(tmp_path / "tokenizer", "qwen3")
    hf_qwen3(tmp_path / "base", vocab_size=HFTokenizer(path).vocab_size)
    rows = [r for r in family_rows("qwen3") if len(r["messages"]) > 2]  # multi-turn, reasoning and tool rows
    assert sum("reasoning_content" in m or "<think>" in (m.get("content") or "") for r in rows for m in r["messages"])
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [
        a if a != "llama3" else "qwen3"
        for a in _argv(tmp_path, tmp_path / "run", "--training.local_batch_size", "2", "--training.seq_len", "255")
    ]
    expected = _transformers_loss(tmp_path, seq_len=255)
    losses = run_distributed(_first_loss, 2, argv)
    assert losses[0] == losses[1]
    assert abs(losses[0] - expected) <= 1e-5 * expected, (losses[0], expected)


@pytest.mark.slow
def test_bfd_packing_resumes_exactly_on_another_world_size(tmp_path: Path, sft: Path) -> None:
    """Best-fit decreasing packing, 4 steps on 2 ranks with a checkpoint at step 2; the checkpoint
    resumed on 1 rank (accumulating 2 micro-batches) gives steps 3 and 4 the losses of the 2-rank
    run."""
    extra = ["--training.packing", "bfd", "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval",
             "2", "--training.local_batch_size", "2", "--training.shuffle", "--lr_scheduler.warmup_steps", "1"]
    two = run_distributed(_losses, 2, _argv(sft, tmp_path / "two", *extra))[0]
    import shutil

    shutil.copytree(tmp_path / "two" / "checkpoint" / "step-2", tmp_path / "one" / "checkpoint" / "step-2")
    (one,) = run_distributed(_losses, 1, _argv(sft, tmp_path / "one", *extra))
    assert len(two) == 4 and len(one) == 2
    for a, b in zip(one, two[2:], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (one, two)


def test_template_errors_stop_the_job_or_are_skipped(tmp_path: Path) -> None:
    """A row the template refuses (a system message for the Gemma 2-style template) ends the job
    with one line naming the file and the row, exit 3; with training.on_bad_row = "skip" the job
    trains and its log counts the row."""
    path = write_chat_tokenizer(tmp_path / "tokenizer", "gemma2")
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    bad = {"messages": [{"role": "system", "content": "S"}, *good["messages"]]}
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [good, good, bad, good, good]))
    argv = ["--model.flavor", "tiny", "--model.tokenizer_path", str(path.parent), "--training.dataset", "chat",
            "--training.dataset_path", str(data), "--training.seq_len", "63", "--training.local_batch_size", "1",
            "--training.steps", "1", "--training.mixed_precision_param", "float32", "--metrics.no-enable_tensorboard",
            "--validation.no-enable"]
    (stopped, (skipped, log)), = run_distributed(_main_and_log, 1, [*argv, "--job.dump_folder", str(tmp_path / "a")],
                                                 [*argv, "--job.dump_folder", str(tmp_path / "b"),
                                                  "--training.on_bad_row", "skip"])
    line = one_error_line(stopped, 3)
    assert line == (f"error: training.dataset_path: {str(data)!r} line 3: the chat template "
                    f"{str(path.parent / 'tokenizer_config.json')!r} fails on it: System role not supported "
                    "(or set training.on_bad_row = 'skip')"), line
    assert skipped.returncode == 0, skipped.stderr
    assert any("1 row(s) skipped (training.on_bad_row = 'skip'): 1 refused by the chat template; the first: "
               f"{str(data)!r} line 3: " in line for line in log), log


def _main_and_log(stopping: list[str], skipping: list[str]) -> tuple[Any, tuple[Any, list[str]]]:
    """Two jobs through ``train.main`` in this rank process: the first's result, the second's with
    what it logged."""
    (stopped,) = run_main([stopping])
    with captured_log() as lines:
        (skipped,) = run_main([skipping])
    return stopped, (skipped, list(lines))


@pytest.mark.parametrize("name", ["llama3_sft_lora", "llama3_sft_full", "qwen3_8b_grpo", "llama3_8b_qlora"])
def test_shipped_fine_tuning_configs_name_what_is_missing(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The fine-tuning configs load; run where their files are not, they stop before any process
    group with one line per missing file (exit 3)."""
    from torchtitan_lite import train

    config = Path(__file__).resolve().parent.parent / "train_configs" / f"{name}.toml"
    monkeypatch.chdir(tmp_path)
    assert train.main(["--job.config_file", str(config)]) == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.split(":")[1].strip() for line in lines] == ["model.tokenizer_path", "training.dataset_path"], lines
    folder, data = {"qwen3_8b_grpo": ("assets/hf/Qwen3-8B", "data/math_prompts.jsonl"),
                    "llama3_8b_qlora": ("assets/hf/Llama-3.1-8B-Instruct", "data/chat.jsonl")}.get(
        name, ("assets/hf/Llama-3.2-1B-Instruct", "data/chat.jsonl"))
    assert folder in lines[0] and data in lines[1]


def _losses_and_log(argv: list[str]) -> tuple[list[float], list[str]]:
    with captured_log() as lines:
        losses = _losses(argv)
    return losses, list(lines)


@pytest.mark.slow
def test_the_chat_cache_is_built_by_every_rank_reused_at_another_world_size_and_changes_no_loss(
        tmp_path: Path, sft: Path) -> None:
    """2 ranks build the cache on disjoint shares (even and odd rows); 2 ranks without a cache
    give the same losses, exactly; 1 process pointed at the cache reads it (builds nothing) and
    gives the same losses (4 micro-batches for the global batch of 4)."""
    extra = ["--training.steps", "3", "--training.local_batch_size", "1", "--lr_scheduler.warmup_steps", "1"]
    (cached, log), _ = run_distributed(_losses_and_log, 2, _argv(sft, tmp_path / "a", *extra))
    (folder,) = (tmp_path / "a" / "chat_cache").glob("chat-*")
    assert sorted(p.name for p in folder.glob("*-rows.npy")) == ["part-0-of-2-rows.npy", "part-1-of-2-rows.npy"]
    rows = [np.load(folder / f"part-{r}-of-2-rows.npy").tolist() for r in (0, 1)]
    assert sorted(rows[0] + rows[1]) == list(range(len(CONVERSATIONS)))
    assert all(n % 2 == 0 for n in rows[0]) and all(n % 2 == 1 for n in rows[1])
    assert any(line.startswith(f"chat cache {folder} written (2 shares") for line in log), log
    plain = run_distributed(_losses, 2, _argv(sft, tmp_path / "b", *extra, "--training.chat_cache_dir", ""))[0]
    assert plain == cached and not (tmp_path / "b" / "chat_cache").exists()
    (one, log), = run_distributed(_losses_and_log, 1, _argv(sft, tmp_path / "c", *extra, "--training.chat_cache_dir",
                                                            str(tmp_path / "a" / "chat_cache")))
    assert not [line for line in log if "chat cache" in line], log
    assert [p.name for p in (tmp_path / "a" / "chat_cache").iterdir()] == [folder.name]
    for a, b in zip(one, cached, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (one, cached)


def test_a_truncated_json_line_stops_the_job_or_is_skipped(tmp_path: Path) -> None:
    """A line cut mid-write (``{"prompt": "copy 4 :", "answer": ``) in a chat file and in a
    prompts file (the GRPO toy's): without ``training.on_bad_row`` the job stops with one line
    naming the file and the line, exit 3; with ``"skip"`` it trains (exit 0) and the start-up log
    counts the line."""
    from tests.dist_utils import REPO_ROOT

    toy = REPO_ROOT / "tests" / "assets" / "toy_rl"
    prompts = tmp_path / "prompts.jsonl"
    rows = (toy / "prompts.jsonl").read_text().splitlines()
    prompts.write_text("\n".join([rows[0], '{"prompt": "copy 4 :", "answer": ', *rows[1:]]) + "\n")
    path = write_chat_tokenizer(tmp_path / "tokenizer", "llama3")
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in [good, good]) + '{"messages": [{"role": "us\n'
                    + json.dumps(good) + "\n")
    common = ["--model.flavor", "tiny", "--training.steps", "1", "--training.mixed_precision_param", "float32",
              "--metrics.no-enable_tensorboard", "--validation.no-enable"]
    sft = [*common, "--model.tokenizer_path", str(path.parent), "--training.dataset", "chat",
           "--training.dataset_path", str(chat), "--training.seq_len", "63", "--training.local_batch_size", "1"]
    grpo = [*common, "--job.config_file", str(REPO_ROOT / "train_configs" / "grpo_toy.toml"),
            "--model.tokenizer_path", str(toy), "--training.dataset_path", str(prompts),
            "--training.global_batch_size", "16", "--training.local_batch_size", "16"]
    skip = ["--training.on_bad_row", "skip"]
    cases = [[*argv, *extra, "--job.dump_folder", str(tmp_path / dump)]
             for argv, extra, dump in ((sft, [], "a"), (sft, skip, "b"), (grpo, [], "c"), (grpo, skip, "d"))]
    ((chat_stopped, (chat_skipped, chat_log)), (grpo_stopped, (grpo_skipped, grpo_log))), = run_distributed(
        _stop_and_skip_pairs, 1, *cases)
    assert one_error_line(chat_stopped, 3) == (f"error: training.dataset_path: {str(chat)!r} line 3: not JSON: "
                                               "'{\"messages\": [{\"role\": \"us' (or set training.on_bad_row = "
                                               "'skip')")
    assert one_error_line(grpo_stopped, 3) == (f"error: training.dataset_path: {str(prompts)!r} line 2: not JSON: "
                                               "'{\"prompt\": \"copy 4 :\", \"answer\":' (or set training.on_bad_row "
                                               "= 'skip')")
    assert chat_skipped.returncode == 0 and grpo_skipped.returncode == 0, (chat_skipped.stderr, grpo_skipped.stderr)
    assert any(f"1 row(s) skipped (training.on_bad_row = 'skip'): 1 not JSON; the first: {str(chat)!r} line 3"
               in line for line in chat_log), chat_log
    assert any(f"1 row(s) skipped (training.on_bad_row = 'skip'): 1 not JSON; the first: {str(prompts)!r} line 2"
               in line for line in grpo_log), grpo_log
    assert any("10 prompts (1 bad row(s) skipped)" in line for line in grpo_log), grpo_log


def _stop_and_skip_pairs(*cases: list[str]) -> list[tuple[Any, tuple[Any, list[str]]]]:
    """:func:`_main_and_log` for each pair of cases (stopping, skipping), in this rank process."""
    return [_main_and_log(cases[i], cases[i + 1]) for i in range(0, len(cases), 2)]
