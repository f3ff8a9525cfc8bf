"""Conversations for fine-tuning (``torchtitan_lite/data/chat.py``, ``chat_template.py``): rendered
with chat templates on tiny tokenizers built here, equal to transformers' ``apply_chat_template``;
the labels count exactly the assistant turns, found here by each family's own tags, not with the
project's span code; generation markers equal transformers' ``assistant_masks``; template errors;
packing.

``tests/assets/chat_templates``: ``llama3.jinja`` and ``qwen2_5.jinja`` are the published
templates; the others are written here to do what the published templates of their families do
(read in public sources): Llama 3.1 Instruct (tools in the first user turn, one JSON tool call),
Qwen3 (reasoning of earlier turns stripped, a think block on the last, tool calls and merged tool
results), Mistral-7B-Instruct-v0.3 (the system prompt moved into the last user turn and lost when
the assistant ends the conversation, alternation refused, tool ids of 9 characters), Gemma 2 (no
system role), Gemma 3 (the system prompt moved into the first turn), Phi-3.5-mini (the EOS token
after the last turn) and DeepSeek-R1-Distill (reasoning stripped from every turn, a generation
prompt that ends inside a think block, DeepSeek's tool tags)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from torchtitan_lite.data import HFTokenizer
from torchtitan_lite.data.chat import ChatTemplate, pack, packed_windows
from torchtitan_lite.data.chat_template import RowError
from torchtitan_lite.errors import DataError

TEMPLATES = Path(__file__).resolve().parent / "assets" / "chat_templates"
_LLAMA = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
_CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_DEEPSEEK = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁outputs▁end｜>",
]
_MISTRAL = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
_GEMMA = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"]
_PHI = ["<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def _turns(pattern: str) -> Any:
    """The assistant turns of a rendering, each as rendered with its end-of-turn text: the test's
    own reading of a family's tags."""
    compiled = re.compile(pattern, re.DOTALL)
    return lambda text: compiled.findall(text)


# name: (template file, special tokens, bos, eos, the assistant turns of a rendering, what the
# family's template supports beyond plain turns)
FAMILIES: dict[str, tuple[str, list[str], str | None, str, Any, set[str]]] = {
    "llama3": ("llama3.jinja", _LLAMA, "<|begin_of_text|>", "<|eot_id|>",
               _turns(r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(.*?<\|eot_id\|>)"), {"system"}),
    "llama3_1": ("llama3_1.jinja", _LLAMA + ["<|eom_id|>", "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>",
                 _turns(r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(.*?<\|eot_id\|>)"),
                 {"system", "tools"}),
    "qwen2_5": ("qwen2_5.jinja", _CHATML, None, "<|im_end|>", _turns(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>\n)"),
                {"system", "tools"}),
    "qwen3": ("qwen3.jinja", _CHATML + ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                                        "</tool_response>"], None, "<|im_end|>",
              _turns(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>\n)"), {"system", "tools", "reasoning"}),
    "mistral_v0_3": ("mistral_v0_3.jinja", _MISTRAL, "<s>", "</s>",
                     _turns(r"(?:\[/INST\]|\[/TOOL_RESULTS\])(.*?</s>)"), {"system", "tools"}),
    "gemma2": ("gemma2.jinja", _GEMMA, "<bos>", "<eos>", _turns(r"<start_of_turn>model\n(.*?<end_of_turn>\n)"), set()),
    "gemma3": ("gemma3.jinja", _GEMMA, "<bos>", "<eos>", _turns(r"<start_of_turn>model\n(.*?<end_of_turn>\n)"),
               {"system"}),
    "phi3_5": ("phi3_5.jinja", _PHI, "<s>", "<|endoftext|>",
               _turns(r"<\|assistant\|>\n(.*?<\|end\|>\n(?:<\|endoftext\|>\Z)?)"), {"system"}),
    "deepseek_r1": ("deepseek_r1.jinja", _DEEPSEEK + ["<think>", "</think>"], "<｜begin▁of▁sentence｜>",
                    "<｜end▁of▁sentence｜>",
                    _turns(r"(?:<｜Assistant｜>|<｜tool▁outputs▁end｜>)(.*?<｜end▁of▁sentence｜>)"),
                    {"system", "tools", "reasoning"}),
}

CONVERSATIONS: list[list[dict[str, Any]]] = [
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



_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}
_CALL = {"type": "function", "id": "call00001", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
_CLOCK = {"type": "function", "id": "call00003", "function": {"name": "get_time", "arguments": {}}}
_CALL_2 = {"type": "function", "id": "call00002", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
# Rows beyond plain turns, each with what the family's template must support: (needs, row).
EXTRA: list[tuple[str, dict[str, Any]]] = [
    (
        "reasoning",
        {
            "messages": [
                {"role": "user", "content": "OK"},
                {"role": "assistant", "content": "OK"},
                {"role": "user", "content": "Again."},
                {"role": "assistant", "content": "Done."},
            ]
        },
    ),
    (
        "reasoning",
        {
            "messages": [
                {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "<think>\nfirst thought\n</think>\n\nA1"},
                {"role": "user", "content": "Q2"},
                {"role": "assistant", "content": "A2", "reasoning_content": "second thought"},
            ]
        },
    ),
    (
        "reasoning",
        {
            "messages": [
                {"role": "system", "content": "Think."},
                {"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": "5", "reasoning_content": "2 plus 3"},
            ]
        },
    ),
    (
        "reasoning",
        {
            "messages": [
                {"role": "user", "content": "Why?"},
                {"role": "assistant", "content": "Because.", "thinking": "a thought under 'thinking'"},
            ]
        },
    ),
    # Tool results wrapped in a user turn (Qwen3's template then keeps the last real query's index).
    (
        "reasoning",
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "reasoning_content": "need a tool", "tool_calls": [_CALL]},
                {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"},
                {"role": "assistant", "content": "It is sunny.", "reasoning_content": "got it"},
            ]
        },
    ),
    # A tool call whose arguments hold no text, after empty content and reasoning, then a new query.
    (
        "reasoning",
        {
            "messages": [
                {"role": "user", "content": "What time is it?"},
                {"role": "assistant", "content": "", "reasoning_content": "I need the clock.", "tool_calls": [_CLOCK]},
                {"role": "tool", "content": "12:00"},
                {"role": "assistant", "content": "It is noon."},
                {"role": "user", "content": "Thanks"},
                {"role": "assistant", "content": "You're welcome!"},
            ]
        },
    ),
    (
        "tools",
        {
            "tools": [_WEATHER],
            "messages": [
                {"role": "user", "content": "Time?"},
                {"role": "assistant", "tool_calls": [_CLOCK]},
                {"role": "tool", "tool_call_id": "call00003", "content": "12:00"},
                {"role": "assistant", "content": "Noon."},
            ],
        },
    ),
    # The same question twice (a template that compares messages by value, as Mistral's does for tools).
    (
        "tools",
        {
            "tools": [_WEATHER],
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "y"},
            ],
        },
    ),
    (
        "tools",
        {
            "tools": [_WEATHER],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "tool_calls": [_CALL]},
                {"role": "tool", "tool_call_id": "call00001", "content": "sunny"},
                {"role": "assistant", "content": "It is sunny in Paris."},
            ],
        },
    ),
    (
        "tools",
        {
            "tools": [_WEATHER],
            "messages": [
                {"role": "system", "content": "Use tools."},
                {"role": "user", "content": "Paris and Oslo?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [_CALL]},
                {"role": "tool", "tool_call_id": "call00001", "content": "sunny"},
                {"role": "assistant", "content": "Sunny; now Oslo.", "tool_calls": [_CALL_2]},
                {"role": "tool", "tool_call_id": "call00002", "content": "snow"},
                {"role": "assistant", "content": "Paris sunny, Oslo snow."},
            ],
        },
    ),
]


def family_rows(family: str) -> list[dict[str, Any]]:
    """The rows a family's template takes: every plain conversation (those without a system
    message where it has no system role), and the reasoning and tool rows it supports."""
    supports = FAMILIES[family][5]
    rows = [{"messages": m} for m in CONVERSATIONS if "system" in supports or m[0]["role"] != "system"]
    for needs, row in EXTRA:
        calls = sum(bool(m.get("tool_calls")) for m in row["messages"])
        if needs in supports and not (family == "deepseek_r1" and calls > 1):  # its template's call state
            rows.append(_for_family(family, row))                              # spans the conversation
    return rows


def _for_family(family: str, row: dict[str, Any]) -> dict[str, Any]:
    """Llama 3.1 writes one tool call per turn and no content beside it; DeepSeek's template reads
    calls only from a message without content, with arguments as a JSON string, and closes a turn
    of calls only after its second call."""
    if family not in ("llama3_1", "deepseek_r1") or "tools" not in row:
        return row
    messages = []
    for message in row["messages"]:
        if message.get("tool_calls"):
            message = {k: v for k, v in message.items() if k != "content"}
            if family == "deepseek_r1":
                message["tool_calls"] = [{**c, "function": {**c["function"],
                                                            "arguments": json.dumps(c["function"]["arguments"])}}
                                         for c in (_CALL, _CALL_2)]
        messages.append(message)
    return {**row, "messages": messages}


def write_chat_tokenizer(folder: Path, family: str, *, template: str | None = None) -> Path:
    """A byte-level BPE tokenizer.json trained on the conversations' text, with the family's
    special tokens, and a tokenizer_config.json holding its chat template (or ``template``):
    ``scripts/make_tiny_hf_model.py``'s tokenizer, on these texts."""
    from scripts.make_tiny_hf_model import write_chat_tokenizer as write

    template_file, special, bos, eos, _, _ = FAMILIES[family]
    texts = [json.dumps(m) for conv in CONVERSATIONS for m in conv] + [json.dumps(r) for _, r in EXTRA]
    return write(folder, texts=texts * 5, special_tokens=special, bos=bos, eos=eos,
                 chat_template=template if template is not None else (TEMPLATES / template_file).read_text())


def _hf_ids(hf: Any, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> list[int]:
    ids = hf.apply_chat_template(messages, tools=tools, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _counted_runs(hf: Any, ids: np.ndarray, counted: np.ndarray) -> list[str]:
    """The counted tokens, decoded run by run."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], counted.astype(int), [0]])))
    return [hf.decode(ids[a:b].tolist(), skip_special_tokens=False) for a, b in zip(edges[::2], edges[1::2],
                                                                                   strict=True)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rendering_equals_transformers_and_labels_are_the_assistant_turns(tmp_path: Path, family: str) -> None:
    """For each family, at least fifteen conversations (system or not, multi-turn, tool calls and
    reasoning where the family has them, unicode, empty content): the ids equal
    ``apply_chat_template``'s, and the counted tokens decode, run by run, to the assistant turns
    of transformers' rendering, each with its end-of-turn text (found here by the family's tags)."""
    transformers = pytest.importorskip("transformers")
    path = write_chat_tokenizer(tmp_path / family, family)
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent))
    template = ChatTemplate(HFTokenizer(path))
    turns = FAMILIES[family][4]
    rows = family_rows(family)
    assert len(rows) >= 15
    for row in rows:
        messages, tools = row["messages"], row.get("tools")
        ids, counted = template.encode(messages, loss_on="assistant", tools=tools)
        assert ids.tolist() == _hf_ids(hf, messages, tools), row
        rendered = hf.apply_chat_template(messages, tools=tools, tokenize=False)
        assert template.render(messages, tools=tools) == rendered
        expected = turns(rendered)
        assert len(expected) == sum(m["role"] == "assistant" for m in messages) or family == "phi3_5", (
            rendered,
            expected,
        )
        assert _counted_runs(hf, ids, counted) == expected, (family, rendered)
        _, every = template.encode(messages, loss_on="all", tools=tools)
        assert every.all()


def test_generation_markers_equal_transformers_assistant_masks(tmp_path: Path) -> None:
    """A training template with ``{% generation %}`` markers, in a tokenizer folder saved by
    transformers' ``save_pretrained`` (``chat_template.jinja``, not a key of tokenizer_config.json):
    the counted tokens equal ``assistant_masks`` exactly, conversation by conversation."""
    transformers = pytest.importorskip("transformers")
    source = write_chat_tokenizer(tmp_path / "source", "qwen3")
    hf = transformers.AutoTokenizer.from_pretrained(str(source.parent))
    hf.chat_template = (TEMPLATES / "qwen3_training.jinja").read_text()
    hf.save_pretrained(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    template = ChatTemplate(HFTokenizer(tmp_path / "saved" / "tokenizer.json"))
    assert template.marks_generation() and template.where().endswith("chat_template.jinja")
    rows = family_rows("qwen3")
    assert len(rows) >= 15
    for row in rows:
        messages, tools = row["messages"], row.get("tools")
        out = hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        ids, counted = template.encode(messages, loss_on="assistant", tools=tools)
        assert ids.tolist() == list(out["input_ids"])
        assert counted.astype(int).tolist() == list(out["assistant_masks"]), row
        assert counted.any()


def test_where_the_template_comes_from(tmp_path: Path) -> None:
    """As transformers reads a folder: chat_template.jinja over tokenizer_config.json; the list of
    named templates (tool_use for rows with tools); training.chat_template over both."""
    path = write_chat_tokenizer(tmp_path / "tok", "qwen2_5")
    folder = path.parent
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "D{% for m in messages %}{{ m.content }}|{% endfor %}"},
                               {"name": "tool_use", "template": "T{% for m in messages %}{{ m.content }}|{% endfor %}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate(HFTokenizer(path))
    assert template.render(messages) == "DHi|Hello|"
    assert template.render(messages, tools=[_WEATHER]) == "THi|Hello|"
    (folder / "chat_template.jinja").write_text("J{% for m in messages %}{{ m.content }}{% endfor %}")
    assert ChatTemplate(HFTokenizer(path)).render(messages) == "JHiHello"
    override = tmp_path / "mine.jinja"
    override.write_text("O{% for m in messages %}{{ m.role }}{% endfor %}")
    assert ChatTemplate(HFTokenizer(path), template_path=str(override)).render(messages) == "Ouserassistant"
    config["chat_template"] = [{"name": "tool_use", "template": "T"}]
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match=r"named \['tool_use'\] and none is 'default'; set training.chat_template"):
        ChatTemplate(HFTokenizer(path))


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
    with pytest.raises(DataError, match=r"has no chat template \(neither chat_template.jinja nor a chat_template in "
                                        r"tokenizer_config.json\); dataset = 'chat' renders"):
        ChatTemplate(HFTokenizer(tmp_path / "plain" / "tokenizer.json"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(DataError, match=r"chat template 'default' of .*broken.jinja' is not a valid Jinja template"):
        ChatTemplate(HFTokenizer(path), template_path=str(broken))
    bad = tmp_path / "bad.jsonl"
    for row, message in [({"messages": "hi"}, "'messages' is not a non-empty list of {role, content} tables"),
                         ({"messages": [{"role": "user"}, {"content": "x"}]}, "'messages' is not a non-empty list"),
                         ({"messages": [{"role": "user", "content": "x"}], "tools": "t"}, "'tools' is not a list"),
                         ({"text": "plain"}, "expected a 'messages' list of {role, content} tables, or 'prompt'")]:
        bad.write_text(json.dumps({"messages": [{"role": "user", "content": "ok"}]}) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(DataError) as info:
            packed_windows([bad], HFTokenizer(path), seq_len=64, loss_on="assistant", truncate="right",
                           key="training.dataset_path", where="w")
        assert str(info.value).startswith(f"training.dataset_path: {str(bad)!r} line 2: {message}"), info.value
        assert "\n" not in str(info.value)


def _rows_file(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_template_errors_name_the_row_or_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A template's own raise_exception (Gemma 2 refusing a system message, Mistral roles that do
    not alternate) is one line naming the file, the row and the template's message; with
    on_bad_row = "skip" those rows are left out and counted in the log."""
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    system = {"messages": [{"role": "system", "content": "S"}, *good["messages"]]}
    twice = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                          {"role": "assistant", "content": "c"}]}
    for family, row, said in [("gemma2", system, "System role not supported"),
                              ("mistral_v0_3", twice, "conversation roles must alternate user/assistant")]:
        tok = HFTokenizer(write_chat_tokenizer(tmp_path / family, family))
        data = _rows_file(tmp_path / f"{family}.jsonl", [good, good, row, good])
        with pytest.raises(DataError) as info:
            packed_windows([data], tok, seq_len=63, loss_on="assistant", truncate="right", key="k", where="w")
        message = str(info.value)
        assert message.startswith(f"k: {str(data)!r} line 3: the chat template ") and said in message, message
        assert message.endswith("(or set training.on_bad_row = 'skip')") and "\n" not in message
        caplog.clear()
        windows = packed_windows([data], tok, seq_len=63, loss_on="assistant", truncate="right", key="k", where="w",
                                 on_bad_row="skip")
        assert windows.samples == 3
        assert "k: 1 row(s) skipped (training.on_bad_row = 'skip'): 1 refused by the chat template" in caplog.text


def test_turns_that_cannot_be_found_stop_with_the_fix(tmp_path: Path) -> None:
    """A template that does not write the assistant's text cannot be read for labels: one line
    naming the row and the fix (generation markers through training.chat_template), not a guess."""
    tok = HFTokenizer(write_chat_tokenizer(tmp_path / "tok", "qwen2_5", template=(
        "{% for m in messages %}{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
        "{% else %}<|im_start|>assistant\n(hidden)<|im_end|>\n{% endif %}{% endfor %}")))
    data = _rows_file(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "Hi"},
                                                           {"role": "assistant", "content": "Hello"}]}])
    with pytest.raises(DataError) as info:
        packed_windows([data], tok, seq_len=63, loss_on="assistant", truncate="right", key="k", where="w")
    assert str(info.value) == (
        f"k: {str(data)!r} line 1: assistant message 1: the template writes none of its text, so its tokens cannot "
        "be found; mark the assistant's text with {% generation %} ... {% endgeneration %} in a template given by "
        "training.chat_template, or set training.on_bad_row = 'skip'")
    with pytest.raises(RowError):
        ChatTemplate(tok).encode([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                                 loss_on="assistant")


def test_best_fit_decreasing_packs_tighter_and_keeps_every_conversation(tmp_path: Path) -> None:
    """``pack``: every sample exactly once, no window over its size; greedy keeps the order; bfd
    needs no more windows than greedy and is optimal where the lengths pair up exactly."""
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in np.clip(rng.lognormal(4.5, 0.8, size=2000), 8, 1024)]
    size = 1024
    windows = {how: pack(lengths, size, packing=how) for how in ("greedy", "bfd")}
    for how, packed in windows.items():
        assert sorted(i for w in packed for i in w) == list(range(len(lengths))), how
        assert all(sum(lengths[i] for i in w) <= size for w in packed), how
    assert [i for w in windows["greedy"] for i in w] == list(range(len(lengths)))
    assert len(windows["bfd"]) < len(windows["greedy"])
    assert pack([600, 400, 700, 300, 1000], 1000, packing="bfd") == [[4], [2, 3], [0, 1]]
    assert pack([600, 400, 700, 300, 1000], 1000, packing="greedy") == [[0, 1], [2, 3], [4]]
    # Through packed_windows: the same conversations, fewer windows, each conversation whole.
    tok = HFTokenizer(write_chat_tokenizer(tmp_path / "tok", "qwen2_5"))
    data = _rows_file(tmp_path / "d.jsonl", [{"messages": m} for m in CONVERSATIONS])
    greedy, bfd = (packed_windows([data], tok, seq_len=127, loss_on="assistant", truncate="drop", key="k", where="w",
                                  packing=how) for how in ("greedy", "bfd"))
    assert bfd.samples == greedy.samples and len(bfd) <= len(greedy)
    samples = {how: sorted(tuple(w[0][w[2] == s]) for w in (p[i] for i in range(len(p))) for s in np.unique(w[2])
                           if w[1][w[2] == s].any()) for how, p in (("greedy", greedy), ("bfd", bfd))}
    assert samples["greedy"] == samples["bfd"]


def test_a_missing_chat_template_file_is_found_before_any_process_group(tmp_path: Path) -> None:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.data.build import check_sources

    data = _rows_file(tmp_path / "d.jsonl", [{"messages": CONVERSATIONS[0]}])
    config = load_job_config(["--training.dataset", "chat", "--training.dataset_path", str(data),
                              "--training.chat_template", str(tmp_path / "nowhere.jinja")])
    assert [str(p) for p in check_sources(config)] == [
        f"training.chat_template: invalid value {str(tmp_path / 'nowhere.jinja')!r}; no such file (the path of a "
        ".jinja chat template)"]


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them(tmp_path: Path) -> None:
    """``training.chat_template_kwargs``: Llama 3.1's ``date_string`` changes every rendering (its
    system header) and Qwen3's ``enable_thinking = false`` its generation prompt, exactly as
    ``apply_chat_template(..., **kwargs)`` renders them; the packed windows carry the same ids."""
    transformers = pytest.importorskip("transformers")
    messages = CONVERSATIONS[1]
    path = write_chat_tokenizer(tmp_path / "llama3_1", "llama3_1")
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent))
    dated = ChatTemplate(HFTokenizer(path), template_kwargs={"date_string": "01 Jan 2026"})
    ids, _ = dated.encode(messages, loss_on="assistant")
    expected = hf.apply_chat_template(messages, tokenize=True, date_string="01 Jan 2026")
    assert ids.tolist() == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert "Today Date: 01 Jan 2026" in dated.render(messages)
    assert ids.tolist() != ChatTemplate(HFTokenizer(path)).encode(messages, loss_on="assistant")[0].tolist()
    rows = _rows_file(tmp_path / "rows.jsonl", [{"messages": messages}])
    windows = packed_windows([rows], HFTokenizer(path), seq_len=len(ids) - 1, loss_on="assistant", truncate="right",
                             key="training.dataset_path", where="rows", template_kwargs={"date_string": "01 Jan 2026"})
    assert windows[0][0].tolist() == ids.tolist()

    path = write_chat_tokenizer(tmp_path / "qwen3", "qwen3")
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent))
    prompt = [{"role": "user", "content": "2+2?"}]
    quick = ChatTemplate(HFTokenizer(path), template_kwargs={"enable_thinking": False})
    rendered = quick.render(prompt, add_generation_prompt=True)
    assert rendered == hf.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                              enable_thinking=False)
    assert rendered.endswith("<think>\n\n</think>\n\n")


def test_chat_template_kwargs_in_toml_and_on_the_command_line(tmp_path: Path) -> None:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.errors import ConfigError

    toml = tmp_path / "job.toml"
    toml.write_text('[training.chat_template_kwargs]\nenable_thinking = false\ndate_string = "01 Jan 2026"\n')
    config = load_job_config(["--job.config_file", str(toml)])
    assert config.training.chat_template_kwargs == {"enable_thinking": False, "date_string": "01 Jan 2026"}
    cli = load_job_config(["--training.chat_template_kwargs", '{"enable_thinking": false}'])
    assert cli.training.chat_template_kwargs == {"enable_thinking": False}
    for argv, line in [
        (["--training.chat_template_kwargs", "enable_thinking=false"],
         "training.chat_template_kwargs: invalid value 'enable_thinking=false'; expected a table (in TOML) or a "
         "JSON object (on the command line)"),
        (["--training.chat_template_kwargs", '{"messages": []}'],
         "training.chat_template_kwargs: invalid value {'messages': []}; expected a table without messages: the "
         "renderer sets messages, tools, documents, add_generation_prompt itself"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_job_config(argv)
        assert str(err.value) == line


def test_a_chat_cache_that_cannot_be_written_is_one_warning_and_changes_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_chat_tokenizer(tmp_path / "llama3", "llama3")
    rows = _rows_file(tmp_path / "rows.jsonl", [{"messages": m} for m in CONVERSATIONS])
    blocked = tmp_path / "not_a_folder"
    blocked.write_text("a file where the cache folder would be")
    kwargs = {"seq_len": 255, "loss_on": "assistant", "truncate": "right", "key": "training.dataset_path",
              "where": "rows"}
    with caplog.at_level("WARNING", logger="torchtitan_lite"):
        cached = packed_windows([rows], HFTokenizer(path), cache_dir=blocked / "cache", **kwargs)
    plain = packed_windows([rows], HFTokenizer(path), **kwargs)
    warned = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert len(warned) == 1 and "encoding every conversation on this rank" in warned[0], warned
    assert len(cached) == len(plain) and all((cached[i] == plain[i]).all() for i in range(len(plain)))
    assert cached.describe() == plain.describe()
    with pytest.raises(IndexError):
        plain[len(plain)]


def test_a_chat_cache_build_removes_the_leftovers_of_dead_builds(tmp_path: Path) -> None:
    """A staging folder whose launcher is gone (a crashed build) is removed by the next build; one
    whose launcher lives (this process), and a finished cache, are kept."""
    import json as json_

    path = write_chat_tokenizer(tmp_path / "llama3", "llama3")
    rows = _rows_file(tmp_path / "rows.jsonl", [{"messages": m} for m in CONVERSATIONS])
    cache = tmp_path / "cache"
    dead, alive = cache / ".chat-0.dead.building", cache / ".chat-0.alive.building"
    import socket
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for folder, pid in ((dead, int(gone.stdout)), (alive, os.getpid())):
        folder.mkdir(parents=True)
        (folder / "owner.json").write_text(json_.dumps({"host": socket.gethostname(), "pid": pid}))
    packed_windows([rows], HFTokenizer(path), seq_len=255, loss_on="assistant", truncate="right",
                   key="training.dataset_path", where="rows", cache_dir=cache)
    assert not dead.exists() and alive.exists()
    assert len(list(cache.glob("chat-*/manifest.json"))) == 1


def test_a_rank_waiting_for_the_chat_cache_sees_it_renamed_into_place(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that checks the staging folder for its peers' errors while local rank 0 renames it
    into place (the folder there when asked, gone when listed) finds nothing to report: a 2-rank
    QLoRA job once failed there with FileNotFoundError. A peer's bad row in the folder is still
    its error."""
    from torchtitan_lite.data import chat_cache
    from torchtitan_lite.errors import DataError

    staging = tmp_path / ".chat-0.launch.building"
    staging.mkdir()
    (staging / "part-1-of-2.error").write_text("rows.jsonl row 3: no messages")
    with pytest.raises(DataError, match="row 3: no messages"):
        chat_cache._check_errors(staging)
    (staging / "part-1-of-2.error").unlink()
    staging.rename(tmp_path / "chat-0")
    monkeypatch.setattr(Path, "is_dir", lambda self: True)  # (asked just before the rename)
    chat_cache._check_errors(staging)
