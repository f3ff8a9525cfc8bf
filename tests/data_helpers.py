"""Helpers of the data tests: documents, a trained tokenizer.json, token streams of a source,
and the one-line errors of the checks before any process group."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from torchtitan_lite.config import load_job_config
from torchtitan_lite.data import SourceSpec, token_stream
from torchtitan_lite.errors import UserError
from torchtitan_lite.job import plan_job, preflight

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé text survives the round trip: ∑ αβγ ✓",
    "A fourth document, a little longer than the others, to make the windows interesting.",
]


def train_hf_tokenizer(folder: Path, *, special: tuple[str, ...] = ("<s>", "</s>"), vocab: int = 300) -> Path:
    """A byte-level BPE ``tokenizer.json`` trained by the ``tokenizers`` library on DOCS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(DOCS * 20, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def expected_stream(tokenizer, docs: list[str]) -> np.ndarray:
    return np.concatenate(tokenizer.encode_batch(docs)).astype(np.int64)


def stream_array(stream) -> np.ndarray:
    return stream.read(0, len(stream))


def build_token_stream(dataset, dataset_path, tokenizer, *, section="training", token_dtype="uint16",
                       max_tokens=None, **kwargs):
    """A source's whole token stream (streamed kinds: up to ``max_tokens``)."""
    return token_stream(SourceSpec(dataset, dataset_path, section=section, token_dtype=token_dtype, **kwargs),
                        tokenizer, max_tokens=max_tokens)


def user_error(argv: list[str], kind: type[UserError]) -> str:
    """The error of the checks before any process group: schema, preflight, plan."""
    with pytest.raises(UserError) as info:
        config = load_job_config(argv)
        preflight(config)
        plan_job(config, world_size=1)
    assert type(info.value) is kind, (argv, info.value)
    message = str(info.value)
    assert "\n" not in message
    return message
