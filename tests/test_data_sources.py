"""The source kinds (``torchtitan_lite/data/{stdlib,text,c4,tokens,sources}.py``): every kind read, and
the data errors before training. Streamed kinds: tests/test_data_arrow.py."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from tests.data_helpers import (
    DOCS,
    build_token_stream,
    expected_stream,
    stream_array,
    train_hf_tokenizer,
    user_error,
)
from torchtitan_lite.config import ConfigError, load_job_config
from torchtitan_lite.data import (
    ByteTokenizer,
    HFTokenizer,
    TokenWindows,
    check_dataset,
)
from torchtitan_lite.errors import DataError

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
# Errors, before training starts
# --------------------------------------------------------------------------------------------



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
    ]
    for argv, kind, expected in cases:
        message = user_error(argv, kind)
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


@pytest.mark.slow
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
