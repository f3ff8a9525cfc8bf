"""Tiny tokenizer folders in the formats published models ship, built locally with the
``tokenizers`` library (trained on a few texts): what ``tokenizer.json`` holds and what
``tokenizer_config.json`` names, for the tokenizer classes transformers builds its own way.

Styles (each the pipeline of the family's published ``tokenizer.json``):

- ``llama``: SentencePiece BPE as Llama 2 and Mistral ship it: "▁" prepended and spaces replaced
  by the normalizer, no pre-tokenizer, byte fallback (``<0x00>`` … ``<0xFF>``), ``<unk>``, ``<s>``,
  ``</s>``;
- ``gemma``: Gemma's: spaces replaced, split after each, byte fallback, ``<pad>``, ``<eos>``,
  ``<bos>``, ``<unk>``, ``<mask>``, ``<start_of_turn>``, ``<end_of_turn>``;
- ``gpt2``: byte-level BPE, ``<|endoftext|>``;
- ``qwen``: Qwen2's: NFC, its split pattern, byte-level, ``<|endoftext|>``, ``<|im_start|>``,
  ``<|im_end|>``;
- ``t5``: SentencePiece Unigram behind a "▁" Metaspace, ``<pad>``, ``</s>``, ``<unk>``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "STYLES", "sample_texts", "write_tokenizer_folder"]

_QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")

# style: (special tokens in id order, bos, eos)
STYLES: dict[str, tuple[tuple[str, ...], str | None, str]] = {
    "llama": (("<unk>", "<s>", "</s>"), "<s>", "</s>"),
    "gemma": (("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<eos>"),
    "gpt2": (("<|endoftext|>",), None, "<|endoftext|>"),
    "qwen": (("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>"),
    "t5": (("<pad>", "</s>", "<unk>"), None, "</s>"),
}

CHAT_TEMPLATE = ("{% for m in messages %}{{ bos_token if loop.first and bos_token else '' }}"
                 "{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
"""A template that writes the style's BOS and EOS spellings into the rendered text (so the chat
path's ids depend on how each class treats text right after a special token)."""

_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "Hello", "world", "naïve", "café",
          "Straße", "中文", "テキスト", "код", "αβγ", "123", "4567", "3.14", "x=y+1", "def", "return", "(a, b)",
          "don't", "we'll", "I'm", "🙂", "✓", "e-mail", "URL:", "https://example.com/a?b=c"]


def sample_texts(style: str, count: int = 1000, *, seed: int = 0) -> list[str]:
    """``count`` texts of words, unicode, digits and code, with leading and doubled spaces,
    tabs, newlines (single, double, trailing) and the style's special-token spellings inside
    the text and at its edges."""
    rng = random.Random(seed)
    specials = list(STYLES[style][0])
    seps = [" ", " ", " ", "  ", "\n", "\n\n", "\t", " \n", "", "   "]
    texts = []
    for i in range(count):
        parts = []
        for _ in range(rng.randint(1, 14)):
            parts.append(rng.choice(specials) if rng.random() < 0.12 else rng.choice(_WORDS))
            parts.append(rng.choice(seps))
        text = "".join(parts)
        if i % 5 == 0:
            text = " " + text  # a leading space
        if i % 7 == 0:
            text = "\n" + text
        if i % 11 == 0:
            text = rng.choice(specials) + text
        texts.append(text)
    return texts


def _trained(style: str, specials: tuple[str, ...]) -> Any:
    """A tokenizers.Tokenizer of the style's pipeline, trained on the sample texts."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    corpus = [t for s in STYLES for t in sample_texts(s, 300, seed=1)]
    if style == "t5":
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.Replace(Regex(" {2,}"), " ")
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        trainer = trainers.UnigramTrainer(vocab_size=400, special_tokens=list(specials), unk_token="<unk>")
    else:
        tok = Tokenizer(models.BPE())
        if style in ("gpt2", "qwen"):
            if style == "qwen":
                tok.normalizer = normalizers.NFC()
                tok.pre_tokenizer = pre_tokenizers.Sequence([
                    pre_tokenizers.Split(Regex(_QWEN_PATTERN), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            else:
                tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            alphabet = pre_tokenizers.ByteLevel.alphabet()
        else:  # SentencePiece BPE spellings: "▁" for spaces
            if style == "llama":
                tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
            else:
                tok.normalizer = normalizers.Replace(" ", "▁")
                tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
            tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             *([decoders.Strip(" ", 1, 0)] if style == "llama" else [])])
            alphabet = []
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=list(specials), initial_alphabet=alphabet,
                                      **({} if alphabet else {"limit_alphabet": 120}))
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def write_tokenizer_folder(folder: Path, style: str, tokenizer_class: str, **config: Any) -> Path:
    """A tokenizer folder of ``style`` whose tokenizer_config.json names ``tokenizer_class``
    (with BOS/EOS, :data:`CHAT_TEMPLATE` and ``config``'s keys); the folder."""
    specials, bos, eos = STYLES[style]
    data = json.loads(_trained(style, specials).to_str())
    if style in ("llama", "gemma"):  # byte fallback: <0x00>..<0xFF> right after the special tokens
        vocab = data["model"]["vocab"]
        ordered = list(specials) + [f"<0x{b:02X}>" for b in range(256)]
        ordered += [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in specials]
        data["model"].update(vocab={t: i for i, t in enumerate(ordered)}, byte_fallback=True, fuse_unk=True,
                             unk_token="<unk>")
        for added in data["added_tokens"]:
            added["id"] = ordered.index(added["content"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    settings: dict[str, Any] = {"tokenizer_class": tokenizer_class, "eos_token": eos, "chat_template": CHAT_TEMPLATE,
                                "unk_token": "<unk>" if "<unk>" in specials else None}
    if bos is not None:
        settings["bos_token"] = bos
    if "<pad>" in specials:
        settings["pad_token"] = "<pad>"
    settings.update(config)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder
