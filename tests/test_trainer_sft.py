"""Supervised fine-tuning through the trainer: conversations rendered with a chat template,
packed with block-causal attention, the loss over the assistant turns only, equal to
transformers' loss on the same conversations run one at a time."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_data_chat import CONVERSATIONS, write_chat_tokenizer

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


def _first_loss(argv: list[str]) -> float:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    try:
        return trainer.train()[0]["loss"]
    finally:
        trainer.close()


def _transformers_loss(root: Path) -> float:
    """The first global batch's conversations, each run alone by transformers with the labels our
    data counts (the assistant turns): the mean over every counted token."""
    from torchtitan_lite.data import HFTokenizer
    from torchtitan_lite.data.chat import packed_windows

    windows = packed_windows([root / "chat.jsonl"], HFTokenizer(root / "tokenizer" / "tokenizer.json"), seq_len=SEQ,
                             loss_on="assistant", truncate="right", key="k", where="w")
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


def test_sft_first_step_loss_equals_transformers_on_two_ranks_with_and_without_accumulation(
        tmp_path: Path, sft: Path) -> None:
    expected = _transformers_loss(sft)
    for local_bs in (2, 1):  # one micro-batch per rank, then accumulation of 2
        losses = run_distributed(_first_loss, 2, _argv(sft, tmp_path / f"lbs{local_bs}", "--training.local_batch_size",
                                                         str(local_bs)))
        assert losses[0] == losses[1]
        assert abs(losses[0] - expected) <= 1e-5 * expected, (local_bs, losses[0], expected)


@pytest.mark.parametrize("name", ["llama3_sft_lora", "llama3_sft_full"])
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
    assert "assets/hf/Llama-3.2-1B-Instruct" in lines[0] and "data/chat.jsonl" in lines[1]
