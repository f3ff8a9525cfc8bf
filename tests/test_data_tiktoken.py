"""Meta's tiktoken ``tokenizer.model`` (``TiktokenTokenizer`` of ``torchtitan_lite/data.py``): the
ids of Meta's reference tokenizer and of transformers' conversion, TorchTitan's, Meta's and
Hugging Face's tokenizer folders, and the one-line tokenizer errors."""

from __future__ import annotations

import base64
import re
import sys
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from torchtitan_lite.data import (
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    build_tokenizer,
    hf_tokenizer_json,
    tiktoken_to_tokenizer_json,
    tokenizer_file,
)
from torchtitan_lite.errors import DataError, UserError

tiktoken = pytest.importorskip("tiktoken")

# --------------------------------------------------------------------------------------------
# Files the tests make
# --------------------------------------------------------------------------------------------

SAMPLES = [
    "The quick brown fox jumps over the lazy dog. It's 2024; we'll see.",
    "Ünïcödé text survives: ∑ αβγ ✓ 日本語のテキスト 🙂 and\ttabs\r\nand CRLF",
    "def add(a, b):\n    return a + b  # 12345 67890\n\n\n",
    "Special spellings are plain text here: <|begin_of_text|> <|eot_id|> <|reserved_special_token_7|>",
    "   leading and trailing spaces   ",
    "",
]


def stdlib_docs(n: int = 120, chars: int = 1500) -> list[str]:
    """Real text: the first characters of ``n`` standard-library modules."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:n]
    return [f.read_text(encoding="utf-8", errors="replace")[:chars] for f in files]


def train_ranks(texts: list[str], merges: int) -> dict[bytes, int]:
    """A small tiktoken rank table: the 256 bytes, then the most frequent adjacent pairs merged
    within space-led words, as byte-level BPE training does."""
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(tuple(bytes([b]) for b in w.encode()) for t in texts for w in re.findall(r" ?\S+|\s+", t))
    for _ in range(merges):
        counts: Counter[tuple[bytes, bytes]] = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:], strict=False):
                if pair[0] + pair[1] not in ranks:
                    counts[pair] += n
        if not counts:
            break
        (a, b), _ = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        merged: Counter[tuple[bytes, ...]] = Counter()
        for word, n in words.items():
            merged[tuple(_merge(list(word), a, b))] += n
        words = merged
    return ranks


def _merge(word: list[bytes], a: bytes, b: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def write_tiktoken_model(path: Path, ranks: dict[bytes, int]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path


# --------------------------------------------------------------------------------------------
# Meta's reference, written out from meta-llama/llama3 llama/tokenizer.py
# --------------------------------------------------------------------------------------------

META_PAT_STR = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501


def meta_encoding(ranks: dict[bytes, int]) -> Any:
    num_reserved_special_tokens = 256
    special_tokens = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",  # end of turn
    ] + [f"<|reserved_special_token_{i}|>" for i in range(5, num_reserved_special_tokens - 5)]
    return tiktoken.Encoding(name="tokenizer.model", pat_str=META_PAT_STR, mergeable_ranks=ranks,
                             special_tokens={t: len(ranks) + i for i, t in enumerate(special_tokens)})


def meta_encode(model: Any, s: str, *, bos: bool, eos: bool) -> list[int]:
    """Meta's Tokenizer.encode with its defaults (allowed_special=set(), disallowed_special=())."""
    def split(s: str, max_len: int):
        current_len, is_space, start = 0, s[0].isspace() if s else False, 0
        for i in range(len(s)):
            now = s[i].isspace()
            if is_space ^ now:
                current_len, is_space = 1, now
            else:
                current_len += 1
                if current_len > max_len:
                    yield s[start:i]
                    start, current_len = i, 1
        yield s[start:]

    t: list[int] = []
    for i in range(0, len(s), 400_000):
        for sub in split(s[i : i + 400_000], 25_000):
            t.extend(model.encode(sub, allowed_special=set(), disallowed_special=()))
    bos_id, eos_id = model.encode_single_token("<|begin_of_text|>"), model.encode_single_token("<|end_of_text|>")
    return ([bos_id] if bos else []) + t + ([eos_id] if eos else [])


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


def small_ranks() -> dict[bytes, int]:
    """The rank table of these tests and of tests/test_trainer_data.py: 150 merges learnt on
    real text and the samples."""
    return train_ranks(stdlib_docs(20) + SAMPLES, 150)


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return small_ranks()


def test_tiktoken_model_gives_meta_ids(tmp_path: Path, ranks: dict[bytes, int]) -> None:
    """A tiktoken tokenizer.model gives the ids of Meta's reference Tokenizer (the same ranks,
    pattern and special tokens): text with special-token spellings, non-ASCII, CRLF, long runs
    of one character (cut at 25 000) and a text past 400 000 characters (cut there)."""
    model = write_tiktoken_model(tmp_path / "tokenizer.model", ranks)
    tok = build_tokenizer(str(model))
    assert isinstance(tok, TiktokenTokenizer)
    ref = meta_encoding(ranks)
    n = len(ranks)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (n + 256, n, n + 1) == (ref.n_vocab, n, n + 1)
    assert tok.special_tokens == ref._special_tokens
    texts = [*SAMPLES, "x" * 30_000 + " tail", " " * 26_000 + "y", ("word " * 90_001)[:450_003]]
    for text, ids in zip(texts, tok.encode_batch(texts), strict=True):
        expected = meta_encode(ref, text, bos=True, eos=True)
        assert ids.tolist() == expected, text[:60]
        assert tok.encode(text) == expected
        assert tok.decode(expected) == text
    # The 400 000-character cut changes ids where it falls (Meta's encode cuts there too).
    long = texts[-1]
    assert tok.encode(long, bos=False, eos=False) != ref.encode_ordinary(long)


def test_tiktoken_model_matches_transformers_conversion(tmp_path: Path, ranks: dict[bytes, int]) -> None:
    """transformers' TikTokenConverter turns the same file into a tokenizer.json with the same ids
    for plain text (it matches special-token spellings as special tokens, Meta's encode does not);
    ours (for Hugging Face exports) is the same file."""
    import json

    from tokenizers import Tokenizer

    converter = pytest.importorskip("transformers.convert_slow_tokenizer").TikTokenConverter
    model = write_tiktoken_model(tmp_path / "tokenizer.model", ranks)
    tok = TiktokenTokenizer(model)
    hf = converter(vocab_file=str(model), pattern=META_PAT_STR,
                   extra_special_tokens=list(meta_encoding(ranks)._special_tokens)).converted()
    ours = Tokenizer.from_file(str(tiktoken_to_tokenizer_json(tok, tmp_path / "tokenizer.json")))
    assert json.loads(ours.to_str()) == json.loads(hf.to_str())
    for text in [s for s in SAMPLES if "<|" not in s] + stdlib_docs(30):
        assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text, bos=False, eos=False), text[:40]


def test_tokenizer_folders(tmp_path: Path, ranks: dict[bytes, int]) -> None:
    """TorchTitan's hf_assets_path folder (tokenizer.json, tokenizer_config.json, config.json,
    weights) reads its tokenizer.json; a Meta download's tokenizer.model and a Hugging Face
    folder's original/tokenizer.model are found; tokenizer.json wins when both are there."""
    from tests.data_helpers import train_hf_tokenizer

    assets = tmp_path / "assets"
    train_hf_tokenizer(assets, special=("<|begin_of_text|>", "<|end_of_text|>"))
    (assets / "tokenizer_config.json").write_text('{"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}')
    (assets / "config.json").write_text('{"model_type": "llama"}')
    (assets / "model.safetensors").write_bytes(b"\0" * 16)
    write_tiktoken_model(assets / "original" / "tokenizer.model", ranks)
    tok = build_tokenizer(str(assets))
    assert isinstance(tok, HFTokenizer) and tokenizer_file(assets) == assets / "tokenizer.json"
    assert (tok.bos_id, tok.eos_id) == (0, 1)

    meta = tmp_path / "Meta-Llama-3-8B"
    write_tiktoken_model(meta / "tokenizer.model", ranks)
    (meta / "params.json").write_text("{}")
    assert isinstance(build_tokenizer(str(meta)), TiktokenTokenizer)

    hf_without_json = tmp_path / "hf"
    write_tiktoken_model(hf_without_json / "original" / "tokenizer.model", ranks)
    assert tokenizer_file(hf_without_json) == hf_without_json / "original" / "tokenizer.model"
    assert build_tokenizer(str(hf_without_json)).vocab_size == len(ranks) + 256
    # A Hugging Face export copies a tokenizer.json; a tokenizer.model is converted when asked.
    assert hf_tokenizer_json(tok) == (assets / "tokenizer.json").resolve()
    assert hf_tokenizer_json(build_tokenizer(str(meta))) is None
    converted = hf_tokenizer_json(build_tokenizer(str(meta)), convert=True)
    assert converted is not None and converted.name == "tokenizer.json" and converted.is_file()
    assert hf_tokenizer_json(ByteTokenizer(), convert=True) is None


def _one_line(exc: pytest.ExceptionInfo[UserError]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_tokenizer_errors_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       ranks: dict[bytes, int]) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError) as info:
        build_tokenizer(str(tmp_path / "empty"))
    assert all(p in _one_line(info) for p in ("tokenizer.json", "tokenizer.model", "original/tokenizer.model"))
    sentencepiece = tmp_path / "sp" / "tokenizer.model"
    sentencepiece.parent.mkdir()
    sentencepiece.write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02\xff\xfe")
    with pytest.raises(DataError) as info:
        build_tokenizer(str(sentencepiece))
    assert "not a tiktoken tokenizer.model" in _one_line(info) and "SentencePiece" in _one_line(info)
    model = write_tiktoken_model(tmp_path / "tokenizer.model", ranks)
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # as if it were not installed
    with pytest.raises(DataError) as info:
        build_tokenizer(str(model))
    assert "pip install tiktoken" in _one_line(info) and "model.tokenizer_path" in _one_line(info)
