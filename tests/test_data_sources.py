"""Tokenizers, every dataset kind, the loader's slicing, its state, and the data errors."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from torchtitan_lite.config import ConfigError, load_job_config
from torchtitan_lite.data import (
    BatchLoader,
    ByteTokenizer,
    HFTokenizer,
    LoaderSource,
    SourceSpec,
    TokenWindows,
    WindowReader,
    build_tokenizer,
    check_dataset,
    token_stream,
)
from torchtitan_lite.errors import DataError, UserError
from torchtitan_lite.job import plan_job, preflight

# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

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


def _loader(windows, *, global_bs, local_bs, rank, dp, seed=7):
    return BatchLoader([LoaderSource("w", WindowReader(windows, seed=seed, shuffle=True))], seq_len=windows.seq_len,
                       global_batch_size=global_bs, local_batch_size=local_bs, dp_rank=rank, dp_size=dp)


def build_token_stream(dataset, dataset_path, tokenizer, *, section="training", token_dtype="uint16",
                       max_tokens=None, **kwargs):
    """A source's whole token stream (streamed kinds: up to ``max_tokens``)."""
    return token_stream(SourceSpec(dataset, dataset_path, section=section, token_dtype=token_dtype, **kwargs),
                        tokenizer, max_tokens=max_tokens)


def _step_rows(loader):
    return torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in loader.next_batch()])


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


# --------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------


def test_embedded_corpus_is_real_and_large():
    stream = stream_array(build_token_stream("python_stdlib", None, ByteTokenizer()))
    assert len(stream) > 1_000_000  # megabytes of text: not a few memorisable lines
    assert (stream == ByteTokenizer.bos_id).sum() > 50  # many documents
    assert b"def " in bytes(stream[stream < 256].astype(np.uint8)[:100_000])


def test_validation_split_is_held_out():
    train = set(check_dataset("python_stdlib", None))
    held_out = set(check_dataset("python_stdlib_validation", None, section="validation"))
    assert len(held_out) > 20
    assert not train & held_out
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert all(f.parent != stdlib for f in held_out)


@pytest.mark.parametrize("tokenizer_kind", ["byte", "hf"])
def test_text_file_jsonl_file_and_folder(tmp_path, tokenizer_kind):
    tok = ByteTokenizer() if tokenizer_kind == "byte" else HFTokenizer(train_hf_tokenizer(tmp_path / "tok"))
    data = tmp_path / "data"
    (data / "nested").mkdir(parents=True)
    (data / "a.txt").write_text(DOCS[0], encoding="utf-8")
    with (data / "nested" / "b.jsonl").open("w", encoding="utf-8") as fh:
        for doc in DOCS[1:3]:
            fh.write(json.dumps({"text": doc, "meta": 1}) + "\n")
        fh.write("\n")  # blank lines are skipped
    (data / "nested" / "c.txt").write_text(DOCS[3], encoding="utf-8")
    (data / "ignored.md").write_text("not read")

    txt = stream_array(build_token_stream("text", str(data / "a.txt"), tok))
    assert np.array_equal(txt, expected_stream(tok, DOCS[:1]))
    jsonl = stream_array(build_token_stream("text", str(data / "nested" / "b.jsonl"), tok))
    assert np.array_equal(jsonl, expected_stream(tok, DOCS[1:3]))
    # Folder: files in sorted path order (a.txt, nested/b.jsonl, nested/c.txt); .md ignored.
    folder = stream_array(build_token_stream("text", str(data), tok))
    assert np.array_equal(folder, expected_stream(tok, DOCS))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_files_npy_bin_and_folder_are_memory_mapped(tmp_path, dtype):
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 258, size=n).astype(dtype) for n in (1000, 37, 2500)]
    data = tmp_path / "tokens"
    data.mkdir()
    np.save(data / "00.npy", parts[0])
    parts[1].tofile(data / "01.bin")
    np.save(data / "02.npy", parts[2])
    tok = ByteTokenizer()

    single = build_token_stream("tokens", str(data / "00.npy"), tok)
    assert np.array_equal(stream_array(single), parts[0])
    raw = build_token_stream("tokens", str(data / "01.bin"), tok, token_dtype=dtype)
    assert np.array_equal(stream_array(raw), parts[1])

    stream = build_token_stream("tokens", str(data), tok, token_dtype=dtype)
    assert all(isinstance(p, np.memmap) for p in stream.parts)  # never loaded whole
    whole = np.concatenate(parts).astype(np.int64)
    assert np.array_equal(stream_array(stream), whole)
    # Windows crossing file boundaries read the right tokens.
    windows = TokenWindows(stream, seq_len=99)
    assert len(windows) == len(whole) // 100
    for i in range(len(windows)):
        assert np.array_equal(windows[i], whole[i * 100 : (i + 1) * 100])


def test_hf_tokenizer_with_pretokenized_uint32(tmp_path):
    tok = HFTokenizer(train_hf_tokenizer(tmp_path / "tok"))
    ids = expected_stream(tok, DOCS * 10).astype(np.uint32)
    np.save(tmp_path / "docs.npy", ids)
    stream = build_token_stream("tokens", str(tmp_path / "docs.npy"), tok)
    assert np.array_equal(stream_array(stream), ids)


# --------------------------------------------------------------------------------------------
# The loader
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dp, local_bs", [(1, 8), (1, 2), (2, 4), (4, 1), (2, 2)])
def test_global_batch_is_independent_of_world_size(dp, local_bs):
    windows = TokenWindows(np.arange(10_000, dtype=np.uint16) % 258, seq_len=15)
    reference = _loader(windows, global_bs=8, local_bs=8, rank=0, dp=1)
    loaders = [_loader(windows, global_bs=8, local_bs=local_bs, rank=r, dp=dp) for r in range(dp)]
    for _ in range(5):
        expected = _step_rows(reference)
        got = torch.cat([_step_rows(ld) for ld in loaders])
        assert torch.equal(got, expected)
    assert loaders[0].grad_accum_steps == 8 // (local_bs * dp)


def test_inputs_and_labels_are_shifted_by_one():
    windows = TokenWindows(np.arange(1000, dtype=np.uint16), seq_len=9)
    (inputs, labels), = _loader(windows, global_bs=2, local_bs=2, rank=0, dp=1).next_batch()
    assert inputs.shape == labels.shape == (2, 9)
    assert inputs.dtype == labels.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


@pytest.mark.parametrize("num_windows, global_bs", [(100, 10), (103, 8)])
def test_ranks_see_disjoint_windows_covering_each_epoch(num_windows, global_bs):
    """Two data-parallel ranks never read the same window within an epoch, and together read
    every window of it (also when the epoch does not end on a step boundary)."""
    seq = 19
    windows = TokenWindows(np.arange(num_windows * (seq + 1), dtype=np.uint32), seq_len=seq)
    loaders = [_loader(windows, global_bs=global_bs, local_bs=global_bs // 2, rank=r, dp=2) for r in (0, 1)]
    steps = 3 * num_windows // global_bs + 1
    per_rank = [[], []]  # (sample number, window) read by each rank
    for step in range(steps):
        for r, ld in enumerate(loaders):
            rows = _step_rows(ld)
            first = step * global_bs + r * (global_bs // 2)
            per_rank[r] += [(first + i, int(row[0]) // (seq + 1)) for i, row in enumerate(rows)]
    for epoch in range(3):
        seen = [[w for s, w in per_rank[r] if s // num_windows == epoch] for r in (0, 1)]
        assert len(set(seen[0])) == len(seen[0]) and len(set(seen[1])) == len(seen[1])
        assert not set(seen[0]) & set(seen[1]), f"epoch {epoch}: a window read by both ranks"
        assert sorted(seen[0] + seen[1]) == list(range(num_windows)), f"epoch {epoch} not covered"
    # Epochs are shuffled differently.
    order = [w for _, w in sorted(per_rank[0] + per_rank[1])]
    assert order[:num_windows] != order[num_windows : 2 * num_windows]


@pytest.mark.parametrize("stop_after", [1, 5, 13])  # 13 steps of 8 cross the 100-window epoch
def test_state_round_trip_is_bit_identical(stop_after):
    windows = TokenWindows(np.arange(100 * 10, dtype=np.uint16), seq_len=9)
    uninterrupted = [_loader(windows, global_bs=8, local_bs=2, rank=r, dp=2) for r in (0, 1)]
    interrupted = [_loader(windows, global_bs=8, local_bs=2, rank=r, dp=2) for r in (0, 1)]
    for _ in range(stop_after):
        for a, b in zip(uninterrupted, interrupted, strict=True):
            a.next_batch()
            b.next_batch()
    # The state is plain data: it survives JSON (no pickled objects).
    states = [json.loads(json.dumps(ld.state_dict())) for ld in interrupted]
    assert states[0] == states[1]
    restored = [_loader(windows, global_bs=8, local_bs=2, rank=r, dp=2) for r in (0, 1)]
    for ld, state in zip(restored, states, strict=True):
        ld.load_state_dict(state)
    for _ in range(15):
        for a, b in zip(uninterrupted, restored, strict=True):
            for (xa, ya), (xb, yb) in zip(a.next_batch(), b.next_batch(), strict=True):
                assert torch.equal(xa, xb) and torch.equal(ya, yb)

    # The same state continues a run on another world size with the same global batches.
    single = _loader(windows, global_bs=8, local_bs=4, rank=0, dp=1)
    single.load_state_dict(states[0])
    reference = _loader(windows, global_bs=8, local_bs=8, rank=0, dp=1)
    for _ in range(stop_after):
        reference.next_batch()
    assert torch.equal(_step_rows(single), _step_rows(reference))


def test_state_from_another_dataset_or_batch_is_rejected():
    windows = TokenWindows(np.arange(1000, dtype=np.uint16), seq_len=9)
    loader = _loader(windows, global_bs=4, local_bs=2, rank=0, dp=1)
    state = loader.state_dict()
    for name, value in [("global_batch_size", 8), ("seq_len", 7)]:
        with pytest.raises(DataError, match=f"{name}={value!r}"):
            loader.load_state_dict({**state, name: value})
    for name, value in [("seed", 1), ("num_windows", 5), ("shuffle", False)]:
        with pytest.raises(DataError, match=f"{name}={value!r}"):
            loader.load_state_dict({**state, "sources": [{**state["sources"][0], name: value}]})
    with pytest.raises(DataError, match="invalid step"):
        loader.load_state_dict({**state, "step": -1})


# --------------------------------------------------------------------------------------------
# Errors, before training starts
# --------------------------------------------------------------------------------------------


def _user_error(argv: list[str], kind: type[UserError]) -> str:
    """The error of the checks before any process group: schema, preflight, plan."""
    with pytest.raises(UserError) as info:
        config = load_job_config(argv)
        preflight(config)
        plan_job(config, world_size=1)
    assert type(info.value) is kind, (argv, info.value)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_dataset_paths_are_one_line_user_errors(tmp_path):
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "notes.md").write_text("x")
    cases = [
        (["--training.dataset", "text", "--training.dataset_path", str(tmp_path / "missing.txt")],
         DataError, ["training.dataset_path", "missing.txt", "not found"]),
        (["--training.dataset", "text"], ConfigError, ["training.dataset_path", "needs a path"]),
        (["--training.dataset", "text", "--training.dataset_path", str(tmp_path / "empty_folder")],
         DataError, ["training.dataset_path", "empty_folder", ".txt or .jsonl"]),
        (["--training.dataset", "tokens", "--training.dataset_path", str(tmp_path / "notes.md")],
         DataError, ["training.dataset_path", "notes.md", ".bin or .npy"]),
        (["--training.dataset", "texts"], ConfigError, ["training.dataset", "'texts'", "'text'"]),
        (["--training.dataset_path", str(tmp_path / "notes.md")],
         ConfigError, ["training.dataset_path", "reads no path", "'text' or 'tokens'"]),
        (["--validation.enable", "--validation.dataset", "text", "--validation.dataset_path",
          str(tmp_path / "nope")], DataError, ["validation.dataset_path", "nope", "not found"]),
        (["--model.tokenizer_path", str(tmp_path / "none.json")], DataError, ["model.tokenizer_path", "none.json"]),
        (["--model.flavor", "tiny", "--training.seq_len", "4096"],
         ConfigError, ["training.seq_len", "4096", "at most 512"]),
    ]
    for argv, kind, expected in cases:
        message = _user_error(argv, kind)
        for part in expected:
            assert part in message, (argv, message)


def test_empty_and_malformed_datasets(tmp_path):
    tok = ByteTokenizer()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    (tmp_path / "zero.bin").write_bytes(b"")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    np.save(tmp_path / "float.npy", np.zeros(10, dtype=np.float32))
    cases = [
        ("text", "empty.txt", "is empty"),
        ("text", "blank.jsonl", "is empty"),
        ("text", "bad.jsonl", "line 2 is not a JSON object with a string 'text' field"),
        ("tokens", "zero.bin", "is empty"),
        ("tokens", "odd.bin", "not a whole number of uint16 tokens"),
        ("tokens", "float.npy", "float32"),
    ]
    for dataset, name, expected in cases:
        with pytest.raises(DataError, match="training.dataset_path") as info:
            build_token_stream(dataset, str(tmp_path / name), tok)
        assert expected in str(info.value), (name, str(info.value))
        assert name in str(info.value)


def test_tokens_outside_the_vocabulary_are_rejected(tmp_path):
    np.save(tmp_path / "gpt2.npy", np.array([1, 2, 50256], dtype=np.uint16))
    with pytest.raises(DataError, match=r"token id 50256 but the tokenizer's vocabulary has 258 ids"):
        build_token_stream("tokens", str(tmp_path / "gpt2.npy"), ByteTokenizer())


def test_dataset_shorter_than_one_window_names_seq_len(tmp_path):
    (tmp_path / "short.txt").write_text("tiny")
    stream = build_token_stream("text", str(tmp_path / "short.txt"), ByteTokenizer())
    with pytest.raises(DataError, match=r"training.seq_len=64: the dataset has only 6 tokens"):
        TokenWindows(stream, seq_len=64)
    # Through the config: the key the value came from and the file are named.
    short = str(tmp_path / "short.txt")
    argv = ["--validation.enable", "--validation.dataset", "text", "--validation.dataset_path", short,
            "--training.seq_len", "16", "--model.flavor", "tiny", "--job.dump_folder", str(tmp_path / "out")]
    from torchtitan_lite.trainer import Trainer

    with pytest.raises(DataError) as info:
        Trainer(load_job_config(argv))
    assert str(info.value).startswith("training.seq_len=16: validation dataset")
    assert "short.txt" in str(info.value)


class _WideTokenizer(ByteTokenizer):
    vocab_size = 128_256  # a Llama-3-sized vocabulary: ids need uint32


def test_uint32_bin_read_as_uint16_is_rejected(tmp_path):
    np.array([1, 70_000, 128_000], dtype=np.uint32).tofile(tmp_path / "wide.bin")
    with pytest.raises(DataError, match=r"training.dataset_token_dtype: invalid value 'uint16' .* need 'uint32'"):
        build_token_stream("tokens", str(tmp_path / "wide.bin"), _WideTokenizer())
    stream = build_token_stream("tokens", str(tmp_path / "wide.bin"), _WideTokenizer(), token_dtype="uint32")
    assert stream_array(stream).tolist() == [1, 70_000, 128_000]


def _pretokenize(argv: list[str], *, in_process: bool):
    """``python scripts/pretokenize.py ARGV``: as a real process, or through the script's ``main``
    in this process (ending as the interpreter would on its ``SystemExit``: a message is printed
    to stderr and the exit code is 1)."""
    import contextlib
    import importlib.util
    import io
    import subprocess
    import sys

    from tests.dist_utils import REPO_ROOT

    script = REPO_ROOT / "scripts" / "pretokenize.py"
    if not in_process:
        return subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=120)
    spec = importlib.util.spec_from_file_location("pretokenize", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = module.main(argv)
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
    return subprocess.CompletedProcess([str(script), *argv], code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("suffix", [".npy", ".bin"])
def test_pretokenize_script_matches_tokenizing_at_load(tmp_path, suffix):
    """The .npy output is written by real processes of the script (exit codes and stderr as users
    see them), the .bin one by its ``main`` in this process (importing torch once)."""
    in_process = suffix == ".bin"
    tok_path = train_hf_tokenizer(tmp_path / "tok")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(DOCS[0])
    (corpus / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[1:]))
    out = tmp_path / f"corpus{suffix}"
    argv = ["--input", str(corpus), "--output", str(out), "--tokenizer_path", str(tok_path)]
    done = _pretokenize(argv, in_process=in_process)
    assert done.returncode == 0, done.stderr
    assert "4 documents" in done.stdout
    tok = HFTokenizer(tok_path)
    direct = stream_array(build_token_stream("text", str(corpus), tok))
    mapped = stream_array(build_token_stream("tokens", str(out), tok))
    assert np.array_equal(direct, mapped)
    again = _pretokenize(argv, in_process=in_process)
    assert again.returncode != 0 and "exists" in again.stderr  # never overwritten unasked
    (corpus / "c.jsonl").write_text('{"text": "fine"}\nnot json\n')
    broken = _pretokenize([*argv[:-2], "--overwrite"], in_process=in_process)
    assert broken.returncode == 2 and broken.stderr.startswith("error: --input: ")
    assert not list(tmp_path.glob("*.partial"))  # no half-written file left behind


# --------------------------------------------------------------------------------------------
# Files that cannot be read, text that is not UTF-8
# --------------------------------------------------------------------------------------------


def test_unreadable_files_and_folders_are_one_line(tmp_path, monkeypatch):
    """(As root, permissions do not stop reads here: the OS error is injected.)"""
    import errno
    import os


    good = tmp_path / "corpus"
    (good / "sub").mkdir(parents=True)
    (good / "a.txt").write_text("hello " * 100)
    (good / "sub" / "b.txt").write_text("world " * 100)
    (tmp_path / "tokens.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    denied = OSError(errno.EACCES, os.strerror(errno.EACCES))
    real_read, real_open, real_scandir = Path.read_bytes, Path.open, os.scandir

    def read_bytes(self):
        if self.name == "b.txt":
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(DataError) as err:
        build_token_stream("text", str(good), ByteTokenizer())
    assert str(err.value) == (f"training.dataset_path: {str(good / 'sub' / 'b.txt')!r} cannot be read: "
                              "Permission denied (errno 13)")
    monkeypatch.setattr(Path, "read_bytes", real_read)

    def scandir(path="."):
        if str(path).endswith("sub"):
            raise PermissionError(denied.errno, denied.strerror, str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(DataError, match=r"'.*sub' cannot be read: Permission denied \(errno 13\)$"):
        check_dataset("text", str(good))
    monkeypatch.setattr(os, "scandir", real_scandir)

    def open_(self, *args, **kwargs):
        if self.name == "tokens.bin":
            raise PermissionError(denied.errno, denied.strerror, str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)
    with pytest.raises(DataError, match=r"'.*tokens.bin' cannot be read: Permission denied \(errno 13\)$"):
        build_token_stream("tokens", str(tmp_path / "tokens.bin"), ByteTokenizer())


def test_text_that_is_not_utf8_is_counted_and_refused_above_the_threshold(tmp_path, caplog):
    import logging

    from torchtitan_lite.data import MAX_INVALID_UTF8_FRACTION

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(b"plain text " * 1000)  # 11,000 valid bytes
    (corpus / "b.txt").write_bytes("caf\u00e9 ".encode() * 100 + b"\xff")  # one stray byte
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        build_token_stream("text", str(corpus), ByteTokenizer())
    assert "1 of 11601 bytes are not valid UTF-8 (1 of them in" in caplog.text
    (corpus / "c.bin.txt").write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8)))
    with pytest.raises(DataError) as err:
        build_token_stream("text", str(corpus), ByteTokenizer())
    message = str(err.value)
    assert message.startswith("training.dataset_path: ") and "are not valid UTF-8" in message
    assert f"more than {MAX_INVALID_UTF8_FRACTION:.1%} means the files are not UTF-8 text" in message
    assert "c.bin.txt" in message and "\n" not in message
