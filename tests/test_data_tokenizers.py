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


def test_every_tokenizer_has_the_same_methods_from_text_to_ids(tmp_path):
    """The byte tokenizer, a tokenizer.json (the toy task's, whose post-processor adds BOS) and a
    tiktoken tokenizer.model answer the same calls with the same signatures: ``encode`` is a
    document's ids as ``encode_batch`` gives them (BOS and EOS each as asked), and ``encode_text``
    a plain-text prompt's ids as the prompts source makes them (the post-processor's BOS here)."""
    import base64
    import inspect

    from tests.dist_utils import REPO_ROOT
    from torchtitan_lite.data import TiktokenTokenizer, Tokenizer
    from torchtitan_lite.data.prompts import encode_prompt

    pytest.importorskip("tiktoken")
    toy = REPO_ROOT / "tests" / "assets" / "toy_rl"
    ranks = {bytes([b]): b for b in range(256)} | {b"co": 256, b"py": 257, b"copy": 258, b" a": 259, b"nd": 260}
    model = tmp_path / "tokenizer.model"
    model.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    tokenizers = {"bytes": build_tokenizer(None), "tokenizer.json": build_tokenizer(str(toy)),
                  "tokenizer.model": build_tokenizer(str(model))}
    assert [type(t) for t in tokenizers.values()] == [ByteTokenizer, HFTokenizer, TiktokenTokenizer]
    for method in ("encode", "encode_text", "encode_batch", "decode"):
        wanted = inspect.signature(getattr(Tokenizer, method))
        for name, tok in tokenizers.items():
            assert inspect.signature(getattr(type(tok), method)) == wanted, (name, method)
    text = "copy 3 : and 7"
    for name, tok in tokenizers.items():
        body = tok.encode(text, bos=False, eos=False)
        assert body and tok.decode(body) == text, name
        assert tok.encode(text) == [tok.bos_id, *body, tok.eos_id] == tok.encode_batch([text])[0].tolist(), name
        assert tok.encode(text, eos=False) == [tok.bos_id, *body], name
        assert tok.encode(text, bos=False) == [*body, tok.eos_id], name
        assert tok.encode_text(text) == [tok.bos_id, *body], name  # (each of these adds BOS only)
    toy_tok = tokenizers["tokenizer.json"]
    assert toy_tok.encode_text(text) == encode_prompt({"prompt": text}, toy_tok, None)[0]
    assert len(tokenizers["tokenizer.model"].encode(text, bos=False, eos=False)) < len(text)  # (merged: "copy")


def test_hf_tokenizer_without_bos_encodes_without_it(tmp_path):
    """A tokenizer.json with an EOS and no BOS (Qwen's): ``encode`` leaves BOS out even when asked,
    and ``encode_text`` adds what its post-processor adds (nothing here)."""
    path = train_hf_tokenizer(tmp_path, special=("<|endoftext|>", "<|im_end|>"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|im_end|>"}))
    tok = HFTokenizer(path)
    assert tok.bos_id is None and tok.eos_id is not None
    body = tok.encode("hello there", bos=False, eos=False)
    assert tok.encode("hello there") == [*body, tok.eos_id] == tok.encode_batch(["hello there"])[0].tolist()
    assert tok.encode_text("hello there") == body


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


# --------------------------------------------------------------------------------------------
# Folders whose tokenizer_config.json names a transformers class
# --------------------------------------------------------------------------------------------

# (style of tokenizer.json, tokenizer_class, more tokenizer_config.json keys): the classes of
# decoder-only families that transformers 5 builds its own way, on files in their family's format.
# Before AutoTokenizer's tokenizer was used, the Llama, CodeLlama, Cohere and T5 rows gave other
# ids than transformers on 40-99% of the texts (the file's pipeline read as it is).
REBUILT = [
    ("llama", "LlamaTokenizerFast", {}),  # Llama 2, Mistral
    ("llama", "LlamaTokenizer", {"legacy": False, "add_bos_token": True}),
    ("llama", "LlamaTokenizerFast", {"legacy": True}),
    ("llama", "CodeLlamaTokenizer", {}),
    ("gemma", "GemmaTokenizer", {}),
    ("gemma", "GemmaTokenizerFast", {}),
    ("gpt2", "GPT2TokenizerFast", {}),
    ("gpt2", "GPTNeoXTokenizerFast", {}),
    ("gpt2", "CohereTokenizerFast", {}),
    ("qwen", "Qwen2Tokenizer", {}),
    ("qwen", "Qwen2TokenizerFast", {}),
    ("t5", "T5TokenizerFast", {}),
    ("t5", "XGLMTokenizerFast", {}),
]


def _body(tok: HFTokenizer, ids: object) -> list[int]:
    """A document's ids without the BOS/EOS the data pipeline puts around it."""
    out = [int(i) for i in ids]
    return out[(tok.bos_id is not None):len(out) - (tok.eos_id is not None)]


@pytest.mark.parametrize(("style", "tokenizer_class", "config"), REBUILT,
                         ids=[f"{s}-{c}-{len(k)}" for s, c, k in REBUILT])
def test_tokenizer_classes_transformers_rebuilds_give_autotokenizer_ids(tmp_path, style, tokenizer_class, config):
    """1,000 texts (leading and doubled spaces, tabs, newlines, unicode, the special tokens'
    spellings inside and at the edges): every text's ids equal ``AutoTokenizer``'s; BOS and EOS
    are its own; chat conversations (content with the same) equal ``apply_chat_template``'s ids."""
    transformers = pytest.importorskip("transformers")
    from tests.tokenizer_folders import sample_texts, write_tokenizer_folder
    from torchtitan_lite.data.chat_template import ChatTemplate

    folder = write_tokenizer_folder(tmp_path / "tok", style, tokenizer_class, **config)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = build_tokenizer(str(folder))
    assert isinstance(tok, HFTokenizer) and tok.tokenizer_class == tokenizer_class
    # transformers' BOS/EOS (the class's defaults where the file names none); one separator when they are one token
    assert (tok.bos_id, tok.eos_id) == (None if hf.bos_token_id == hf.eos_token_id else hf.bos_token_id,
                                        hf.eos_token_id)
    texts = sample_texts(style)
    encoded = tok.encode_batch(texts)
    wrong = [t for t, ids in zip(texts, encoded, strict=True)
             if _body(tok, ids) != hf(t, add_special_tokens=False)["input_ids"]]
    assert not wrong, (len(wrong), wrong[:3])
    template = ChatTemplate(tok)
    for i in range(0, 40, 2):
        messages = [{"role": "user", "content": texts[i]}, {"role": "assistant", "content": texts[i + 1]}]
        ids, _ = template.encode(messages, loss_on="assistant")
        assert ids.tolist() == list(hf.apply_chat_template(messages, tokenize=True)["input_ids"]), messages


def test_pretokenized_tokens_of_a_llama_2_folder_are_autotokenizer_ids(tmp_path):
    """scripts/pretokenize.py on a Llama 2 style folder (``LlamaTokenizerFast``): each document
    is BOS, AutoTokenizer's ids, EOS."""
    import numpy as np

    transformers = pytest.importorskip("transformers")
    from tests.test_data_sources import _pretokenize
    from tests.tokenizer_folders import sample_texts, write_tokenizer_folder

    folder = write_tokenizer_folder(tmp_path / "tok", "llama", "LlamaTokenizerFast")
    docs = [t.replace("\n", " ").strip() or "x" for t in sample_texts("llama", 200)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    done = _pretokenize(["--input", str(tmp_path / "corpus.jsonl"), "--output", str(tmp_path / "out.npy"),
                         "--tokenizer_path", str(folder)], in_process=True)
    assert done.returncode == 0, done.stderr
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    want = [i for d in docs for i in [hf.bos_token_id, *hf(d, add_special_tokens=False)["input_ids"], hf.eos_token_id]]
    assert np.load(tmp_path / "out.npy").tolist() == want


def test_a_rebuilt_class_without_transformers_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    import sys

    from tests.tokenizer_folders import write_tokenizer_folder

    folder = write_tokenizer_folder(tmp_path / "tok", "llama", "LlamaTokenizerFast")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(DataError) as info:
        build_tokenizer(str(folder))
    message = str(info.value)
    assert "\n" not in message and "'LlamaTokenizerFast'" in message and "tokenizer_config.json" in message
    assert "pip install transformers" in message and "PreTrainedTokenizerFast" in message
    # the plain class reads tokenizer.json as it is, transformers or not
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    assert build_tokenizer(str(folder)).tokenizer_class is None


def _rebuilt_classes() -> list[tuple[str, str | None]]:
    """Every tokenizer class the installed transformers rebuilds (a ``TokenizersBackend``
    subclass with an ``__init__`` of its own), with its model kind."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    names = {n for v in TOKENIZER_MAPPING_NAMES.values() for n in (v if isinstance(v, (tuple, list)) else [v]) if n}
    found = []
    for name in sorted(names):
        try:
            cls = tokenizer_class_from_name(name)
        except Exception:  # a class whose optional dependency is missing
            continue
        if cls is not None and issubclass(cls, TokenizersBackend) and cls is not TokenizersBackend \
                and "__init__" in cls.__dict__:
            found.append((name, cls.model.__name__ if cls.model else None))
    return found


@pytest.mark.slow
def test_every_class_transformers_rebuilds_gives_its_ids_or_one_line(tmp_path):
    """Each of the installed transformers' rebuilt classes (54 in 5.24) named by a folder of a
    generic file of its model kind (byte-level BPE, or a Unigram one): our ids equal
    ``AutoTokenizer``'s on 1,000 texts, or the folder is refused in one line before any data is
    read, where transformers cannot build the class from it or its tokenizer cannot encode text
    (a vocabulary without the unknown token the class's model needs)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "TokenizersBackend"):
        pytest.skip("transformers before 5 reads tokenizer.json as it is")
    from tests.tokenizer_folders import sample_texts, write_tokenizer_folder

    classes = _rebuilt_classes()
    equal, refused = [], []
    for name, model in classes:
        style = "t5" if model == "Unigram" else "gpt2"
        folder = write_tokenizer_folder(tmp_path / name, style, name)
        try:
            tok = build_tokenizer(str(folder))
        except DataError as exc:
            assert "\n" not in str(exc) and ("cannot encode text" in str(exc) or repr(name) in str(exc)), str(exc)
            refused.append(name)
            continue
        hf = transformers.AutoTokenizer.from_pretrained(str(folder))
        texts = sample_texts(style)
        for text, ids in zip(texts, tok.encode_batch(texts), strict=True):
            try:
                want = hf(text, add_special_tokens=False)["input_ids"]
            except ValueError:  # (a layout tokenizer: its __call__ takes words, not text)
                want = hf.backend_tokenizer.encode(text, add_special_tokens=False).ids
            assert _body(tok, ids) == want, (name, text)
        equal.append(name)
    assert len(equal) + len(refused) == len(classes) >= 40
    assert {"LlamaTokenizer", "Qwen2Tokenizer", "GPT2Tokenizer", "T5Tokenizer"} <= set(equal), equal
