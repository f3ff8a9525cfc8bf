"""What TorchTitan users bring: Meta's tiktoken ``tokenizer.model`` and tokenizer folders, Parquet
files and Hugging Face ``datasets`` folders streamed through the trainer, an exact resume in the
middle of a Parquet dataset (also at another world size), and the one-line errors."""

from __future__ import annotations

import base64
import hashlib
import math
import re
import shutil
import sys
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed
from tests.test_data import _user_error  # the schema → preflight → plan checks, one line
from torchtitan_lite.config import load_job_config
from torchtitan_lite.data import (
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    build_token_stream,
    build_tokenizer,
    hf_tokenizer_json,
    tiktoken_to_tokenizer_json,
    tokenizer_file,
)
from torchtitan_lite.errors import ConfigError, DataError, UserError
from torchtitan_lite.job import preflight

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
tiktoken = pytest.importorskip("tiktoken")

from torchtitan_lite.arrow_data import ArrowCorpus, StreamingLoader  # noqa: E402

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


def write_parquet(path: Path, docs: list[str], *, row_group_size: int = 16, column: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(range(len(docs))), column: docs}), path, row_group_size=row_group_size)
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


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return train_ranks(stdlib_docs(20) + SAMPLES, 150)


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
    from tests.test_data import train_hf_tokenizer

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


# --------------------------------------------------------------------------------------------
# The streaming source and loader, in process
# --------------------------------------------------------------------------------------------

DOCS = [f"document {i}: " + "lorem ipsum dolor " * (i % 9) for i in range(100)]


def _rows(loader: StreamingLoader) -> torch.Tensor:
    """The windows of this rank's next global batch, stacked (inputs plus the last label)."""
    return torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in loader.next_batch()])


def _loader(corpus: ArrowCorpus, *, global_bs: int = 4, local_bs: int = 2, rank: int = 0, dp: int = 1,
            seq_len: int = 16) -> StreamingLoader:
    return StreamingLoader(corpus, ByteTokenizer(), seq_len=seq_len, global_batch_size=global_bs,
                           local_batch_size=local_bs, dp_rank=rank, dp_size=dp)


def test_corpus_reads_rows_across_files_and_row_groups(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", DOCS[:60], row_group_size=16)
    write_parquet(tmp_path / "sub" / "b.parquet", DOCS[60:], row_group_size=7)
    corpus = ArrowCorpus("parquet", str(tmp_path))
    assert (corpus.num_rows, len(corpus.files), len(corpus.pieces)) == (100, 2, 10)
    assert list(corpus.texts(0, 100)) == DOCS
    assert list(corpus.texts(55, 65)) == DOCS[55:65]  # across row groups and files
    assert list(corpus.texts(99, 100)) == DOCS[99:]


def test_each_sample_packs_its_own_rows_epoch_after_epoch(tmp_path: Path) -> None:
    """Sample p of every global batch is the next window of rows [p·N/G, (p+1)·N/G) tokenized
    with BOS/EOS and packed, starting again at the first row when they are used up."""
    corpus = ArrowCorpus("parquet", str(write_parquet(tmp_path / "d.parquet", DOCS)))
    loader = _loader(corpus)
    steps = 300  # each sample's 25 rows are fewer than 2 500 byte tokens: every sample wraps
    got = torch.stack([_rows(loader) for _ in range(steps)])  # [step, sample, seq_len + 1]
    tok = ByteTokenizer()
    for p in range(4):
        rng = np.concatenate(tok.encode_batch(DOCS[p * 25 : (p + 1) * 25])).astype(np.int64)
        epochs = steps * 17 // len(rng)
        stream = np.concatenate([rng] * (epochs + 1))[: steps * 17]
        assert np.array_equal(got[:, p].reshape(-1).numpy(), stream), p
        assert epochs >= 1 and loader.state_dict()["positions"][p][0] == epochs


@pytest.mark.parametrize("dp,local_bs,global_bs", [(2, 2, 4), (4, 1, 4), (1, 1, 4), (2, 1, 4)])
def test_global_batches_are_independent_of_world_size(tmp_path: Path, dp: int, local_bs: int,
                                                      global_bs: int) -> None:
    corpus = ArrowCorpus("parquet", str(write_parquet(tmp_path / "d.parquet", DOCS)))
    single = _loader(corpus, global_bs=4, local_bs=4)
    ranks = [_loader(corpus, global_bs=global_bs, local_bs=local_bs, rank=r, dp=dp) for r in range(dp)]
    assert ranks[0].grad_accum_steps == global_bs // (local_bs * dp)
    for _ in range(10):
        assert torch.equal(torch.cat([_rows(r) for r in ranks]), _rows(single))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_state_resumes_exactly_on_any_world_size(tmp_path: Path, dp: int) -> None:
    """The state after 7 steps (with batch 5 left out, as a rollback does), loaded by the ranks of
    another world size, continues with exactly the global batches of the uninterrupted run."""
    corpus = ArrowCorpus("parquet", str(write_parquet(tmp_path / "d.parquet", DOCS, row_group_size=5)))
    full = _loader(corpus)
    full.skipped = {5}
    expected = [_rows(full) for _ in range(20)]
    first = _loader(corpus)
    first.skipped = {5}
    for _ in range(7):
        _rows(first)
    state = first.state_dict()
    assert state["step"] == 8 and state["skipped"] == [5] and len(state["positions"]) == 4
    assert all(isinstance(v, int) for pos in state["positions"] for v in pos)
    resumed = [_loader(corpus, local_bs=4 // dp, rank=r, dp=dp) for r in range(dp)]
    for loader in resumed:
        loader.load_state_dict(state)
    if dp == 1:
        assert resumed[0].state_dict() == state
    for step in range(7, 20):
        assert torch.equal(torch.cat([_rows(r) for r in resumed]), expected[step]), step
    # The ranks' sample positions together are the uninterrupted loader's (what gather_state saves).
    together = {s.index: s.position() for loader in resumed for s in loader._streams}
    assert together == {s.index: s.position() for s in full._streams}


def test_state_from_another_run_is_refused(tmp_path: Path) -> None:
    corpus = ArrowCorpus("parquet", str(write_parquet(tmp_path / "d.parquet", DOCS)))
    state = _loader(corpus).state_dict()
    with pytest.raises(DataError, match="global_batch_size=4.*has 2.*set training.global_batch_size = 4"):
        _loader(corpus, global_bs=2, local_bs=1).load_state_dict(state)
    other = ArrowCorpus("parquet", str(write_parquet(tmp_path / "e" / "d.parquet", DOCS[:50])))
    with pytest.raises(DataError, match="num_rows=100"):
        _loader(other).load_state_dict(state)
    with pytest.raises(DataError, match="another kind of dataset"):
        _loader(corpus).load_state_dict({"step": 3, "global_batch_size": 4, "seq_len": 16})
    from torchtitan_lite.data import GlobalBatchLoader, TokenWindows

    windows = TokenWindows(np.arange(200) % 250, 16)
    text = GlobalBatchLoader(windows, global_batch_size=4, local_batch_size=2, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(DataError, match="streaming a 'parquet' dataset"):
        text.load_state_dict(state)


def test_validation_reads_only_the_rows_it_needs(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "d.parquet", DOCS)
    tok = ByteTokenizer()
    whole = build_token_stream("parquet", str(path), tok)
    assert np.array_equal(whole.read(0, len(whole)), np.concatenate(tok.encode_batch(DOCS)))
    first = build_token_stream("parquet", str(path), tok, max_tokens=170)
    assert len(first) == 170 and np.array_equal(first.read(0, 170), whole.read(0, 170))


# --------------------------------------------------------------------------------------------
# Through the trainer
# --------------------------------------------------------------------------------------------


def _train(argv: list[str]) -> dict[str, Any]:
    """Train with ``argv``; records a digest of the windows each rank read at each step."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    start = trainer.step
    original = trainer.loader.next_batch
    digests: dict[int, list[str]] = {}  # step -> a digest of each window this rank read, in order

    def recording() -> list[tuple[torch.Tensor, torch.Tensor]]:
        micro = original()
        rows = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in micro])
        digests[trainer.step + 1] = [hashlib.sha1(row.numpy().tobytes()).hexdigest() for row in rows]
        return micro

    trainer.loader.next_batch = recording  # type: ignore[method-assign]
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return {"start": start, "history": history, "digests": digests, "rank": trainer.rank,
            "loader": type(trainer.loader).__name__}


def _losses(result: dict[str, Any], first: int = 1) -> list[float]:
    return [h["loss"] for h in result["history"] if h["step"] >= first]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory, ranks: dict[bytes, int]) -> Path:
    """A tiktoken tokenizer.model and a Parquet folder (two files) of real text."""
    root = tmp_path_factory.mktemp("assets")
    write_tiktoken_model(root / "tokenizer" / "tokenizer.model", ranks)
    docs = stdlib_docs(120)
    write_parquet(root / "parquet" / "part-0.parquet", docs[:70], row_group_size=8)
    write_parquet(root / "parquet" / "part-1.parquet", docs[70:100], row_group_size=8)
    write_parquet(root / "val" / "val.parquet", docs[100:], row_group_size=8)
    return root


def _argv(dump: Path, assets: Path, *extra: str) -> list[str]:
    return [*TINY_ARGS, "--job.dump_folder", str(dump), "--model.tokenizer_path", str(assets / "tokenizer"),
            "--training.dataset", "parquet", "--training.dataset_path", str(assets / "parquet"),
            "--training.global_batch_size", "4", *extra]


def test_tiktoken_and_parquet_train_and_validate(tmp_path: Path, assets: Path) -> None:
    """Meta's tokenizer format and a streamed Parquet dataset through the trainer: the loss starts
    near uniform over the vocabulary and falls; validation on a Parquet set is finite."""
    argv = _argv(tmp_path, assets, "--training.steps", "16", "--training.local_batch_size", "4",
                 "--optimizer.lr", "1e-2", "--validation.enable", "--validation.dataset", "parquet",
                 "--validation.dataset_path", str(assets / "val"), "--validation.freq", "16",
                 "--validation.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "100",
                 "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf")
    (result,) = run_distributed(_train, 1, argv)
    assert result["loader"] == "StreamingLoader"
    losses = _losses(result)
    vocab = build_tokenizer(str(assets / "tokenizer")).vocab_size
    assert all(math.isfinite(x) for x in losses), losses
    assert abs(losses[0] - math.log(vocab)) < 1.0, losses
    assert sum(losses[-4:]) / 4 < losses[0] - 1.0, losses
    validation = [h for h in result["history"] if "validation_loss" in h]
    assert len(validation) == 1 and math.isfinite(validation[0]["validation_loss"])
    assert validation[0]["validation_tokens"] == 2 * 4 * 32  # validation.steps × global batch × seq_len
    # The Hugging Face export holds the tokenizer.model written as a tokenizer.json (what
    # transformers' TikTokenConverter writes), with the same ids for plain text.
    transformers = pytest.importorskip("transformers")
    export = tmp_path / "checkpoint" / "step-16"
    hf = transformers.AutoTokenizer.from_pretrained(str(export))
    tok = build_tokenizer(str(assets / "tokenizer"))
    assert (hf.bos_token, hf.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert (hf.bos_token_id, hf.eos_token_id) == (tok.bos_id, tok.eos_id)
    for text in [s for s in SAMPLES if "<|" not in s] + stdlib_docs(10):
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text, bos=False, eos=False)


def test_resume_mid_parquet_is_exact_on_two_ranks_and_one(tmp_path: Path, assets: Path) -> None:
    """8 steps on 2 ranks with checkpoints at 4 and 8; resumed from step 4 on 2 ranks the losses
    of steps 5-8 are bit-identical and every rank reads the same windows; resumed on 1 rank (the
    same global batch of 4), the global batches are the same and the losses equal to 1e-5."""
    extra = ("--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "4")
    full = run_distributed(_train, 2, _argv(tmp_path / "full", assets, *extra))
    assert _losses(full[0]) == _losses(full[1]) and len(_losses(full[0])) == 8
    for world, more in [(2, ()), (1, ("--training.local_batch_size", "4"))]:
        dump = tmp_path / f"resumed_{world}"
        shutil.copytree(tmp_path / "full" / "checkpoint" / "step-4", dump / "checkpoint" / "step-4")
        resumed = run_distributed(_train, world, _argv(dump, assets, *extra, *more))
        assert all(r["start"] == 4 for r in resumed)
        expected, got = _losses(full[0], 5), _losses(resumed[0], 5)
        assert len(got) == 4
        if world == 2:
            assert got == expected, (got, expected)  # bit-identical
            for rank in range(2):
                assert resumed[rank]["digests"] == {s: full[rank]["digests"][s] for s in range(5, 9)}
        else:  # the one rank reads rank 0's windows, then rank 1's, of each global batch
            assert resumed[0]["digests"] == {s: full[0]["digests"][s] + full[1]["digests"][s] for s in range(5, 9)}
            for g, e in zip(got, expected, strict=True):
                assert abs(g - e) <= 1e-5 * abs(e), (got, expected)


def test_datasets_save_to_disk_folder_trains(tmp_path: Path) -> None:
    """A Hugging Face datasets folder (save_to_disk: Arrow shards, dataset_info.json, state.json)
    with its text in another column trains, and validates on the same folder."""
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    docs = stdlib_docs(40)
    datasets.Dataset.from_dict({"content": docs, "n": list(range(len(docs)))}).save_to_disk(
        str(folder), max_shard_size="20KB")
    assert len(list(folder.glob("*.arrow"))) > 1 and (folder / "state.json").is_file()
    corpus = ArrowCorpus("arrow", str(folder), text_column="content")
    assert list(corpus.texts(0, corpus.num_rows)) == docs
    argv = [*TINY_ARGS, "--job.dump_folder", str(tmp_path / "out"), "--training.dataset", "arrow",
            "--training.dataset_path", str(folder), "--training.dataset_text_column", "content",
            "--validation.enable", "--validation.dataset", "arrow", "--validation.dataset_path", str(folder),
            "--validation.freq", "4", "--validation.steps", "1"]
    (result,) = run_distributed(_train, 1, argv)
    losses = _losses(result)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(258)) < 1.0  # the byte tokenizer
    assert math.isfinite(result["history"][-1]["validation_loss"])


# --------------------------------------------------------------------------------------------
# Errors before training
# --------------------------------------------------------------------------------------------




def test_streamed_dataset_errors_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = write_parquet(tmp_path / "good" / "d.parquet", DOCS)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.parquet").write_bytes(b"this is not a parquet file at all")
    (tmp_path / "empty").mkdir()
    cases = [
        (["--training.dataset", "c4"], ConfigError,
         ["training.dataset", "'c4'", "download", "'parquet'", "training.dataset_path"]),
        (["--training.dataset", "c4_test"], DataError,
         ["training.dataset_path", "'tests/assets/c4_test'", "TorchTitan's default", "working directory"]),
        (["--training.dataset", "fineweb"], ConfigError, ["HuggingFaceFW/fineweb", "'parquet'", "dataset_path"]),
        (["--validation.enable", "--validation.dataset", "c4_validation"], ConfigError,
         ["validation.dataset", "'c4_validation'", "validation.dataset_path"]),
        (["--training.dataset", "parquet", "--training.dataset_path", str(good),
          "--training.dataset_text_column", "body"], DataError,
         ["training.dataset_path", "d.parquet", "no column 'body'", "id, text", "training.dataset_text_column"]),
        (["--training.dataset", "parquet", "--training.dataset_path", str(tmp_path / "bad")], DataError,
         ["training.dataset_path", "x.parquet", "not a readable Parquet file"]),
        (["--training.dataset", "parquet", "--training.dataset_path", str(tmp_path / "empty")], DataError,
         ["training.dataset_path", "holds no .parquet files"]),
        (["--training.dataset", "arrow", "--training.dataset_path", str(tmp_path / "missing")], DataError,
         ["training.dataset_path", "not found"]),
        (["--training.dataset", "parquet"], ConfigError, ["training.dataset_path", "needs a path"]),
    ]
    for argv, kind, expected in cases:
        message = _user_error(argv, kind)
        for part in expected:
            assert part in message, (argv, message)

    # A file that cannot be opened: the OS error, in one line.
    locked = write_parquet(tmp_path / "locked" / "d.parquet", DOCS)

    def denied(path: str, *args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied", path)

    with monkeypatch.context() as patch:
        patch.setattr(pq, "read_schema", denied)
        message = _user_error(["--training.dataset", "parquet", "--training.dataset_path", str(locked)], DataError)
    assert "cannot be read: Permission denied (errno 13)" in message and "d.parquet" in message

    # Fewer rows than samples in a global batch: each sample streams its own rows.
    few = write_parquet(tmp_path / "few" / "d.parquet", DOCS[:3])
    with pytest.raises(DataError) as info:
        _loader(ArrowCorpus("parquet", str(few)))
    assert "has 3 rows, fewer than training.global_batch_size = 4" in _one_line(info)
    # The job finds it from the files' metadata, before its process group exists.
    from torchtitan_lite import train

    def no_group(*args: Any, **kwargs: Any) -> None:
        pytest.fail("the process group was started before the dataset was checked")

    monkeypatch.setattr("torchtitan_lite.trainer.init_distributed", no_group)
    assert train.main([*TINY_ARGS, "--training.dataset", "parquet", "--training.dataset_path", str(few),
                       "--training.local_batch_size", "4", "--validation.no-enable",
                       "--job.dump_folder", str(tmp_path / "few_job")]) == 3

    # pyarrow not installed.
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    message = _user_error(["--training.dataset", "parquet", "--training.dataset_path", str(good)], DataError)
    assert "pip install pyarrow" in message


def test_datasetdict_folder_names_its_splits(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:8]}),
                          "validation": datasets.Dataset.from_dict({"text": DOCS[8:12]})}).save_to_disk(str(folder))
    message = _user_error(["--training.dataset", "arrow", "--training.dataset_path", str(folder)], DataError)
    assert "DatasetDict folder (splits: train, validation)" in message and str(folder / "train") in message
    assert ArrowCorpus("arrow", str(folder / "validation")).num_rows == 4


def test_torchtitan_c4_names_read_local_json_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """c4 / c4_validation with a local copy of allenai/c4's en/ shards read their split's
    .json.gz files; c4_test reads TorchTitan's tests/assets/c4_test (a data.json of JSON lines)
    from the working directory; scripts/jsonl_to_parquet.py turns the shards into Parquet files
    that stream the same documents."""
    import gzip
    import json

    en = tmp_path / "c4" / "en"
    en.mkdir(parents=True)
    for name, docs in [("c4-train.00000-of-01024.json.gz", DOCS[:5]), ("c4-train.00001-of-01024.json.gz", DOCS[5:9]),
                       ("c4-validation.00000-of-00008.json.gz", DOCS[9:12])]:
        lines = "".join(json.dumps({"text": d, "timestamp": "2019-04-25", "url": "u"}) + "\n" for d in docs)
        (en / name).write_bytes(gzip.compress(lines.encode()))
    tok = ByteTokenizer()

    def tokens(dataset: str, path: str | None, section: str = "training") -> np.ndarray:
        stream = build_token_stream(dataset, path, tok, section=section)
        return stream.read(0, len(stream))

    # Other variants of c4 beside en/ are not read (TorchTitan loads the "en" configuration).
    other = tmp_path / "c4" / "en.noblocklist"
    other.mkdir()
    (other / "c4-train.00000-of-01024.json.gz").write_bytes(
        gzip.compress((json.dumps({"text": "not en"}) + "\n").encode()))
    assert np.array_equal(tokens("c4", str(tmp_path / "c4")), np.concatenate(tok.encode_batch(DOCS[:9])))
    assert np.array_equal(tokens("c4_validation", str(en), "validation"),
                          np.concatenate(tok.encode_batch(DOCS[9:12])))

    assets = tmp_path / "torchtitan" / "tests" / "assets" / "c4_test"
    assets.mkdir(parents=True)
    (assets / "data.json").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[20:30]))
    monkeypatch.chdir(tmp_path / "torchtitan")
    assert np.array_equal(tokens("c4_test", None), np.concatenate(tok.encode_batch(DOCS[20:30])))
    config = load_job_config(["--training.dataset", "c4_test"])
    preflight(config)  # found from the working directory, as TorchTitan finds it

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    try:
        import jsonl_to_parquet
    finally:
        sys.path.pop(0)
    out = tmp_path / "parquet"
    assert jsonl_to_parquet.main(["--input", str(en), "--output", str(out), "--pattern", "c4-train.*",
                                  "--rows_per_group", "3"]) == 0
    assert sorted(f.name for f in out.iterdir()) == ["c4-train.00000-of-01024.parquet", "c4-train.00001-of-01024.parquet"]
    assert list(ArrowCorpus("parquet", str(out)).texts(0, 9)) == DOCS[:9]
    # A second run (an interrupted conversion started again) skips the finished files and writes
    # the rest; subfolders are kept, so shards of one name in two variants do not collide.
    first = (out / "c4-train.00000-of-01024.parquet").stat().st_mtime_ns
    (out / "c4-train.00001-of-01024.parquet").unlink()
    assert jsonl_to_parquet.main(["--input", str(tmp_path / "c4"), "--output", str(out / "all"),
                                  "--pattern", "c4-train.*"]) == 0
    assert sorted(str(f.relative_to(out / "all")) for f in (out / "all").rglob("*.parquet")) == [
        "en.noblocklist/c4-train.00000-of-01024.parquet", "en/c4-train.00000-of-01024.parquet",
        "en/c4-train.00001-of-01024.parquet"]
    assert jsonl_to_parquet.main(["--input", str(en), "--output", str(out), "--pattern", "c4-train.*"]) == 0
    assert (out / "c4-train.00000-of-01024.parquet").stat().st_mtime_ns == first
    assert list(ArrowCorpus("parquet", str(out / "c4-train.00001-of-01024.parquet")).texts(0, 4)) == DOCS[5:9]


def test_bench_data_script_runs(tmp_path: Path) -> None:
    """scripts/bench_data.py measures the streamed start-up against tokenizing the file whole (the
    figures are its output, not asserted)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    try:
        import bench_data
    finally:
        sys.path.pop(0)
    result = bench_data.main(["--mb", "0.3", "--seq_len", "64", "--folder", str(tmp_path)])
    assert result["rows"] >= 8 and result["tokens"] > 300_000 and result["ratio"] > 0
