"""Conversations for fine-tuning (``torchtitan_lite/data/chat.py``): rendered with real chat
templates (Llama 3's, Qwen2.5's) on tiny tokenizers built here, equal to transformers'
``apply_chat_template``; the labels count exactly the assistant turns; packing and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from torchtitan_lite.data import HFTokenizer
from torchtitan_lite.data.chat import ChatTemplate, packed_windows
from torchtitan_lite.errors import DataError

TEMPLATES = Path(__file__).resolve().parent / "assets" / "chat_templates"
FAMILIES = {
    # name: (template file, special tokens, bos, eos, the text after an assistant turn's content)
    "llama3": ("llama3.jinja", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "qwen2_5": ("qwen2_5.jinja", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|im_end|>\n"),
}

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"},
     {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "11"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "You sent nothing."}],
    [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "Ünïcödé ✓ 漢字 🚀?"}, {"role": "assistant", "content": "Ja — ∑ αβγ ✓ 漢字 🚀"}],
    [{"role": "system", "content": "Rules:\n- be kind\n- be brief"}, {"role": "user", "content": "Tabs\tand\nnewlines"},
     {"role": "assistant", "content": "  Spaces around  "}],
    [{"role": "user", "content": "def f(x):\n    return x * 2"}, {"role": "assistant", "content": "It doubles x."}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
     {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}, {"role": "assistant", "content": "f"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "Empty system."},
     {"role": "assistant", "content": "Noted."}],
    [{"role": "user", "content": "Quote: \"hi\" and 'there'"}, {"role": "assistant", "content": "{\"json\": [1, 2]}"}],
    [{"role": "user", "content": "Long " * 40}, {"role": "assistant", "content": "Answer " * 30}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}, {"role": "assistant", "content": "A1"},
     {"role": "user", "content": "U2"}, {"role": "assistant", "content": "A2"}],
    [{"role": "user", "content": "<not a tag>"}, {"role": "assistant", "content": "</also not>"}],
    [{"role": "user", "content": "Emoji 😀😀😀"}, {"role": "assistant", "content": "😀"}],
    [{"role": "user", "content": "Numbers 1234567890"}, {"role": "assistant", "content": "0987654321"}],
    [{"role": "user", "content": "Trailing newline\n"}, {"role": "assistant", "content": "Leading newline\nok\n"}],
    [{"role": "system", "content": "Système"}, {"role": "user", "content": "Ça va ?"},
     {"role": "assistant", "content": "Oui, ça va."}],
    [{"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "y" * 100}],
    [{"role": "user", "content": "Last one"}, {"role": "assistant", "content": "Done."},
     {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You're welcome!"}],
]


def write_chat_tokenizer(folder: Path, family: str) -> Path:
    """A byte-level BPE tokenizer.json trained on the conversations' text, with the family's
    special tokens, and a tokenizer_config.json holding its real chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    template, special, bos, eos, _ = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [m["content"] for conv in CONVERSATIONS for m in conv] + ["user assistant system You are Qwen"]
    tok.train_from_iterator(texts * 5, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
        "chat_template": (TEMPLATES / template).read_text()}))
    return folder / "tokenizer.json"


def _hf_ids(hf, messages: list[dict[str, str]]) -> list[int]:
    ids = hf.apply_chat_template(messages, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rendering_equals_transformers_and_labels_cover_the_assistant_turns(tmp_path: Path, family: str) -> None:
    transformers = pytest.importorskip("transformers")
    path = write_chat_tokenizer(tmp_path / family, family)
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent))
    template = ChatTemplate(HFTokenizer(path))
    end_of_turn = FAMILIES[family][4]
    for messages in CONVERSATIONS:
        ids, counted = template.encode(messages, loss_on="assistant")
        assert ids.tolist() == _hf_ids(hf, messages), messages
        assert template.render(messages) == hf.apply_chat_template(messages, tokenize=False)
        # The counted tokens, span by span, are each assistant turn's content and its end of turn.
        edges = np.flatnonzero(np.diff(np.concatenate([[0], counted.astype(int), [0]])))
        spans = [hf.decode(ids[a:b].tolist(), skip_special_tokens=False) for a, b in zip(edges[::2], edges[1::2],
                                                                                      strict=True)]
        strip = family == "llama3"  # its template trims each message's content
        expected = [(m["content"].strip() if strip else m["content"]) + end_of_turn
                    for m in messages if m["role"] == "assistant"]
        assert spans == expected, (family, messages, spans)
        _, every = template.encode(messages, loss_on="all")
        assert every.all()


def test_packing_keeps_conversations_whole_and_cuts_or_drops_long_ones(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    path = write_chat_tokenizer(tmp_path / "tok", "qwen2_5")
    tok = HFTokenizer(path)
    template = ChatTemplate(tok)
    rows = [{"messages": m} for m in CONVERSATIONS] + [{"prompt": "P?", "completion": "C."}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lengths = [len(template.encode(r.get("messages") or [{"role": "user", "content": "P?"},
                                                          {"role": "assistant", "content": "C."}],
                                   loss_on="assistant")[0]) for r in rows]
    seq_len = 127
    windows = packed_windows([data], tok, seq_len=seq_len, loss_on="assistant", truncate="drop", key="k", where="w")
    too_long = sum(n > seq_len + 1 for n in lengths)
    assert too_long and windows.samples == len(rows) - too_long
    got = [windows[i] for i in range(len(windows))]
    # Every kept conversation appears whole and in order, each in one window.
    kept = [r for r, n in zip(rows, lengths, strict=True) if n <= seq_len + 1]
    samples = [w[0][w[2] == s] for w in got for s in np.unique(w[2]) if w[1][w[2] == s].any()]
    assert len(samples) == len(kept)
    for sample, row in zip(samples, kept, strict=True):
        messages = row.get("messages") or [{"role": "user", "content": "P?"}, {"role": "assistant", "content": "C."}]
        assert sample.tolist() == template.encode(messages, loss_on="assistant")[0].tolist()
    cut = packed_windows([data], tok, seq_len=seq_len, loss_on="assistant", truncate="right", key="k", where="w")
    assert cut.samples == len(rows)
    assert f"k: {too_long} conversation(s) longer than seq_len + 1 = 128 tokens were cut at the right" in caplog.text


def test_chat_errors_are_one_line(tmp_path: Path) -> None:
    path = write_chat_tokenizer(tmp_path / "tok", "llama3")
    config = json.loads((path.parent / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "tokenizer.json").write_bytes(path.read_bytes())
    (tmp_path / "plain" / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match=r"has no chat_template; dataset = 'chat' renders conversations"):
        ChatTemplate(HFTokenizer(tmp_path / "plain" / "tokenizer.json"))
    bad = tmp_path / "bad.jsonl"
    for row, message in [({"messages": "hi"}, "'messages' is not a non-empty list of {role, content} tables"),
                         ({"messages": [{"role": "user"}, {"content": "x"}]}, "'messages' is not a non-empty list"),
                         ({"text": "plain"}, "expected a 'messages' list of {role, content} tables, or 'prompt'")]:
        bad.write_text(json.dumps({"messages": [{"role": "user", "content": "ok"}]}) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(DataError) as info:
            packed_windows([bad], HFTokenizer(path), seq_len=64, loss_on="assistant", truncate="right",
                           key="training.dataset_path", where="w")
        assert str(info.value).startswith(f"training.dataset_path: {str(bad)!r} line 2: {message}"), info.value
        assert "\n" not in str(info.value)
