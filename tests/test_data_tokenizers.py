"""Tokenizers (``torchtitan_lite/data/tokenizers.py``): bytes, tokenizer.json. Meta's tiktoken files:
tests/test_data_tiktoken.py."""

from __future__ import annotations

import json

import pytest

from tests.data_helpers import DOCS, train_hf_tokenizer
from torchtitan_lite.data import (
    ByteTokenizer,
    HFTokenizer,
    build_tokenizer,
)
from torchtitan_lite.errors import DataError

# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "héllo"
    (arr,) = tok.encode_batch(["héllo"])
    assert arr.tolist() == ids


def test_hf_tokenizer_from_tokenizer_json(tmp_path):
    path = train_hf_tokenizer(tmp_path / "tok")
    tok = build_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer)
    assert 258 < tok.vocab_size <= 300
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(path)).get_vocab()
    assert tok.bos_id == vocab["<s>"] and tok.eos_id == vocab["</s>"]
    for doc in DOCS:
        (ids,) = tok.encode_batch([doc])
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert int(ids.max()) < tok.vocab_size
        assert tok.decode(ids.tolist()) == doc
    # BPE really merges: fewer tokens than bytes.
    (ids,) = tok.encode_batch([DOCS[0]])
    assert len(ids) - 2 < len(DOCS[0].encode())
    # A folder holding tokenizer.json works too.
    assert build_tokenizer(str(tmp_path / "tok")).vocab_size == tok.vocab_size


def test_hf_tokenizer_special_tokens_from_config(tmp_path):
    path = train_hf_tokenizer(tmp_path, special=("<|start|>", "<|stop|>", "</s>"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|start|>", "eos_token": {"content": "<|stop|>"}})
    )
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(path)).get_vocab()
    tok = HFTokenizer(path)
    assert (tok.bos_id, tok.eos_id) == (vocab["<|start|>"], vocab["<|stop|>"])


def test_hf_tokenizer_single_separator_and_null_bos(tmp_path):
    # GPT-2 style: one <|endoftext|> token; it separates documents once, not twice.
    path = train_hf_tokenizer(tmp_path / "gpt2", special=("<|endoftext|>",))
    tok = HFTokenizer(path)
    assert tok.bos_id is None and tok.eos_id is not None
    (ids,) = tok.encode_batch(["abc"])
    assert ids[-1] == tok.eos_id and (ids == tok.eos_id).sum() == 1
    # A tokenizer_config.json that sets bos_token to null means no BOS (no fallback).
    path = train_hf_tokenizer(tmp_path / "qwen", special=("<s>", "</s>"))
    (tmp_path / "qwen" / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "</s>"}))
    tok = HFTokenizer(path)
    assert tok.bos_id is None and tok.eos_id is not None
    # A configured token the vocabulary lacks is an error, not a silent fallback.
    (tmp_path / "qwen" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(DataError, match=r"names eos_token '<\|im_end\|>'"):
        HFTokenizer(path)


def test_hf_tokenizer_without_bos_or_eos_is_rejected(tmp_path):
    path = train_hf_tokenizer(tmp_path, special=("<pad>",))
    with pytest.raises(DataError, match=r"model.tokenizer_path: .*no BOS or EOS"):
        HFTokenizer(path)


def test_hf_tokenizer_bad_file(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="model.tokenizer_path: .*not a valid tokenizer.json"):
        HFTokenizer(bad)
