"""Streamed Parquet files and Hugging Face ``datasets`` folders (``torchtitan_lite/arrow_data.py``)
in process: the corpus, each sample's own rows, global batches and state at any world size,
validation reads; the one-line errors before training (TorchTitan's dataset names included);
TorchTitan's c4 names on local JSON lines and scripts/jsonl_to_parquet.py; scripts/bench_data.py.
Through the trainer: tests/test_trainer_data.py."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import TINY_ARGS
from tests.data_helpers import build_token_stream
from tests.data_helpers import user_error as _user_error  # the schema → preflight → plan checks, one line
from tests.test_data_tiktoken import _one_line
from torchtitan_lite.config import load_job_config
from torchtitan_lite.data import BatchLoader, ByteTokenizer, LoaderSource
from torchtitan_lite.errors import ConfigError, DataError, DataNotHereError
from torchtitan_lite.job import preflight

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from torchtitan_lite.data.arrow import ArrowCorpus, LaneReader  # noqa: E402


def write_parquet(path: Path, docs: list[str], *, row_group_size: int = 16, column: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(range(len(docs))), column: docs}), path, row_group_size=row_group_size)
    return path


# --------------------------------------------------------------------------------------------
# The streaming source and loader, in process
# --------------------------------------------------------------------------------------------

DOCS = [f"document {i}: " + "lorem ipsum dolor " * (i % 9) for i in range(100)]


def _rows(loader: BatchLoader) -> torch.Tensor:
    """The windows of this rank's next global batch, stacked (inputs plus the last label)."""
    return torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in loader.next_batch()])


def _loader(corpus: ArrowCorpus, *, global_bs: int = 4, local_bs: int = 2, rank: int = 0, dp: int = 1,
            seq_len: int = 16, shuffle: bool = False, buffer: int = 8, seed: int = 0) -> BatchLoader:
    """One streamed source (in file order unless ``shuffle``) as rank ``rank`` of ``dp`` reads it."""
    per_rank = global_bs // dp
    reader = LaneReader(corpus, ByteTokenizer(), seq_len=seq_len, num_lanes=global_bs,
                        lanes=range(rank * per_rank, (rank + 1) * per_rank), seed=seed, shuffle=shuffle,
                        shuffle_buffer=buffer)
    return BatchLoader([LoaderSource("d", reader)], seq_len=seq_len, global_batch_size=global_bs,
                       local_batch_size=local_bs, dp_rank=rank, dp_size=dp)


def _lanes(loader: BatchLoader) -> dict[int, list[int]]:
    return loader.sources[0].reader.positions()


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
        assert epochs >= 1 and loader.state_dict()["lanes"]["d"][p][0] == epochs


@pytest.mark.parametrize("dp,local_bs,global_bs", [(2, 2, 4), (4, 1, 4), (1, 1, 4), (2, 1, 4)])
def test_global_batches_are_independent_of_world_size(tmp_path: Path, dp: int, local_bs: int,
                                                      global_bs: int) -> None:
    corpus = ArrowCorpus("parquet", str(write_parquet(tmp_path / "d.parquet", DOCS)))
    single = _loader(corpus, global_bs=4, local_bs=4)
    ranks = [_loader(corpus, global_bs=global_bs, local_bs=local_bs, rank=r, dp=dp) for r in range(dp)]
    assert ranks[0].grad_accum_steps == global_bs // (local_bs * dp)
    for _ in range(10):
        assert torch.equal(torch.cat([_rows(r) for r in ranks]), _rows(single))


@pytest.mark.parametrize("dp, shuffle", [(1, False), (2, False), (4, False), (1, True), (4, True)])
def test_state_resumes_exactly_on_any_world_size(tmp_path: Path, dp: int, shuffle: bool) -> None:
    """The state after 7 steps (with batch 5 left out, as a rollback does), loaded by the ranks of
    another world size, continues with exactly the global batches of the uninterrupted run (shuffled
    too: the buffer's documents are read again on resume)."""
    corpus = ArrowCorpus("parquet", str(write_parquet(tmp_path / "d.parquet", DOCS, row_group_size=5)))
    full = _loader(corpus, shuffle=shuffle)
    full.skipped = {5}
    expected = [_rows(full) for _ in range(20)]
    first = _loader(corpus, shuffle=shuffle)
    first.skipped = {5}
    for _ in range(7):
        _rows(first)
    state = first.state_dict()
    assert state["step"] == 8 and state["skipped"] == [5] and len(state["lanes"]["d"]) == 4
    assert all(isinstance(v, int) for pos in state["lanes"]["d"] for v in pos)
    resumed = [_loader(corpus, local_bs=4 // dp, rank=r, dp=dp, shuffle=shuffle) for r in range(dp)]
    for loader in resumed:
        loader.load_state_dict(state)
    if dp == 1:
        assert resumed[0].state_dict() == state
    for step in range(7, 20):
        assert torch.equal(torch.cat([_rows(r) for r in resumed]), expected[step]), step
    # The ranks' sample positions together are the uninterrupted loader's (what gather_state saves).
    together = {p: pos for loader in resumed for p, pos in _lanes(loader).items()}
    assert together == _lanes(full)


def _label_counts(loader: BatchLoader, steps: int) -> np.ndarray:
    """Documents of each label (their letter: a-h) begun in the next ``steps`` global batches."""
    counts = np.zeros(8, dtype=np.int64)
    for _ in range(steps):
        rows = _rows(loader)
        starts = (rows[:, :-1] == ByteTokenizer.bos_id).nonzero()
        for r, c in starts.tolist():
            counts[int(rows[r, c + 1]) - ord("a")] += 1
    return counts


def test_shuffled_parquet_sorted_by_label_reads_every_label_early(tmp_path: Path) -> None:
    """A file whose rows are sorted by label (8 labels × 50 rows, row groups of 25): the labels of
    the documents of the first 8 global batches pass a chi-square test against the file's (uniform)
    histogram when shuffled, and fail it in file order (each of the 4 samples then reads its first
    label only). With a buffer smaller than a lane, the shuffle holds at most ``shuffle_buffer``
    documents per lane; every epoch has its own order."""
    docs = [chr(ord("a") + label) * 30 for label in range(8) for _ in range(50)]
    corpus = ArrowCorpus("parquet", str(write_parquet(tmp_path / "sorted.parquet", docs, row_group_size=25)))
    chi2_999 = 24.32  # chi-square, 7 degrees of freedom, p = 0.001

    def chi2(counts: np.ndarray) -> float:
        expected = counts.sum() / 8
        return float(((counts - expected) ** 2 / expected).sum())

    in_order = _label_counts(_loader(corpus, seq_len=64, local_bs=4), 8)
    assert chi2(in_order) > chi2_999 and set(np.nonzero(in_order)[0]) == {0, 2, 4, 6}, in_order
    shuffled = _label_counts(_loader(corpus, seq_len=64, local_bs=4, shuffle=True, buffer=1000), 8)  # the default
    assert chi2(shuffled) < chi2_999, shuffled
    small = _loader(corpus, seq_len=64, local_bs=4, shuffle=True, buffer=20)
    _label_counts(small, 8)
    lanes = small.sources[0].reader._lanes.values()
    assert all(len(lane.texts.held) <= 20 for lane in lanes)
    # Each lane reads each of its rows once per epoch, in another order in the next epoch.
    lane = next(iter(lanes))
    orders = []
    for epoch in (0, 1):
        order = lane._order(epoch)
        orders.append([order.next() for _ in range(lane.hi - lane.lo)])
        assert order.next() is None and sorted(orders[-1]) == list(range(lane.lo, lane.hi))
    assert orders[0] != orders[1]


def test_streamed_source_leaves_the_mixture_after_max_epochs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A streamed source with ``max_epochs = 1`` leaves at the end of the global batch in which one
    of its ranges began its second epoch; the other source then takes every sample."""
    from torchtitan_lite.data import TokenWindows, WindowReader

    caplog.set_level(logging.WARNING, "torchtitan_lite")
    corpus = ArrowCorpus("parquet", str(write_parquet(tmp_path / "d.parquet", DOCS[:8])))
    streamed = LaneReader(corpus, ByteTokenizer(), seq_len=16, num_lanes=4, lanes=range(4), seed=0, shuffle=True,
                          shuffle_buffer=8)
    other = WindowReader(TokenWindows(np.arange(17 * 100) % 250, 16), seed=0, shuffle=False)
    loader = BatchLoader(
        [LoaderSource("web", streamed, weight=0.5, max_epochs=1), LoaderSource("ids", other, weight=0.5)],
        seq_len=16,
        global_batch_size=4,
        local_batch_size=4,
        dp_rank=0,
        dp_size=1,
        named=True,
    )
    counts = []
    for _ in range(30):
        loader.next_batch()
        counts.append(loader.batch_counts[0])
    left = counts.index(0)
    assert left > 2 and set(counts[left:]) == {0} and loader.schedule.active == [False, True]
    assert streamed.epochs_begun() >= 1
    assert (
        "source 'web' has read all its rows 1 times in some lane (max_epochs = 1) and leaves the mixture" in caplog.text
    )


def test_state_from_another_run_is_refused(tmp_path: Path) -> None:
    corpus = ArrowCorpus("parquet", str(write_parquet(tmp_path / "d.parquet", DOCS)))
    state = _loader(corpus).state_dict()
    with pytest.raises(DataError, match="global_batch_size=4.*has 2.*set training.global_batch_size = 4"):
        _loader(corpus, global_bs=2, local_bs=1).load_state_dict(state)
    other = ArrowCorpus("parquet", str(write_parquet(tmp_path / "e" / "d.parquet", DOCS[:50])))
    with pytest.raises(DataError, match="num_rows=100"):
        _loader(other).load_state_dict(state)
    with pytest.raises(DataError, match="another kind of source; this run reads a streamed source"):
        _loader(corpus).load_state_dict({"step": 3, "global_batch_size": 4, "seq_len": 16})
    from torchtitan_lite.data import TokenWindows, WindowReader

    windows = TokenWindows(np.arange(200) % 250, 16)
    text = BatchLoader([LoaderSource("d", WindowReader(windows, seed=0, shuffle=True))], seq_len=16,
                       global_batch_size=4, local_batch_size=2, dp_rank=0, dp_size=1)
    with pytest.raises(DataError, match="another kind of source; this run reads a windowed"):
        text.load_state_dict(state)


def test_validation_reads_only_the_rows_it_needs(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "d.parquet", DOCS)
    tok = ByteTokenizer()
    whole = build_token_stream("parquet", str(path), tok)
    assert np.array_equal(whole.read(0, len(whole)), np.concatenate(tok.encode_batch(DOCS)))
    first = build_token_stream("parquet", str(path), tok, max_tokens=170)
    assert len(first) == 170 and np.array_equal(first.read(0, 170), whole.read(0, 170))


# --------------------------------------------------------------------------------------------
# Errors before training
# --------------------------------------------------------------------------------------------


def test_streamed_dataset_errors_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = write_parquet(tmp_path / "good" / "d.parquet", DOCS)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.parquet").write_bytes(b"this is not a parquet file at all")
    (tmp_path / "empty").mkdir()
    cases = [
        (["--training.dataset", "c4"], DataNotHereError,  # a ConfigError (exit 2) the planner skips
         ["training.dataset", "'c4'", "download", "'parquet'", "training.dataset_path"]),
        (["--training.dataset", "c4_test"], DataError,
         ["training.dataset_path", "'tests/assets/c4_test'", "TorchTitan's default", "working directory"]),
        (["--training.dataset", "fineweb"], DataNotHereError, ["HuggingFaceFW/fineweb", "'parquet'", "dataset_path"]),
        (["--validation.enable", "--validation.dataset", "c4_validation"], DataNotHereError,
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
    assert sorted(f.name for f in out.iterdir()) == [
        "c4-train.00000-of-01024.parquet",
        "c4-train.00001-of-01024.parquet",
    ]
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
    result = bench_data.main(
        [
            "--mb",
            "0.3",
            "--seq_len",
            "64",
            "--batches",
            "3",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--folder",
            str(tmp_path),
        ]
    )
    assert result["tokens"] > 300_000 and result["ratio"] > 0 and result["mixture_ratio"] > 0


def test_every_lane_of_a_streamed_source_is_read_in_a_mixture(tmp_path: Path) -> None:
    """At 1:1 with a global batch of 4 the schedule alternates, so without rotating the positions
    each batch the streamed source would always take positions 0 and 2 and never read lanes 1, 3."""
    from torchtitan_lite.data import TokenWindows, WindowReader

    corpus = ArrowCorpus("parquet", str(write_parquet(tmp_path / "d.parquet", DOCS)))
    streamed = LaneReader(corpus, ByteTokenizer(), seq_len=16, num_lanes=4, lanes=range(4), seed=0, shuffle=False,
                          shuffle_buffer=8)
    other = WindowReader(TokenWindows(np.arange(17 * 100) % 250, 16), seed=0, shuffle=False)
    loader = BatchLoader([LoaderSource("web", streamed, weight=0.5), LoaderSource("ids", other, weight=0.5)],
                         seq_len=16, global_batch_size=4, local_batch_size=4, dp_rank=0, dp_size=1, named=True)
    for _ in range(40):
        loader.next_batch()
    used = {p: pos[1] + 1000 * pos[0] for p, pos in streamed.positions().items()}  # documents read per lane
    assert min(used.values()) > 0 and max(used.values()) <= 2 * min(used.values()) + 2, used


def test_a_lane_saved_at_the_very_end_of_its_epoch_resumes(tmp_path: Path) -> None:
    """Two documents of 40 000 characters fill one tokenization round (64K characters) exactly:
    when a window ends with the second, the lane's position is the next epoch's start (not a
    document past the end), and a resume from it reads what the uninterrupted lane reads."""
    docs = ["a" * 40_000, "b" * 40_000]
    corpus = ArrowCorpus("parquet", str(write_parquet(tmp_path / "d.parquet", docs)))

    def reader() -> LaneReader:
        return LaneReader(corpus, ByteTokenizer(), seq_len=40_001, num_lanes=1, lanes=range(1), seed=0,
                          shuffle=False, shuffle_buffer=1)

    full = reader()
    first = [full.window(0, 0), full.window(1, 0)]  # 2 × 40 002 tokens: both documents, exactly
    assert np.array_equal(np.concatenate(first), np.concatenate(ByteTokenizer().encode_batch(docs)))
    assert full.positions() == {0: [1, 0, 0]} and full.epochs_begun() == 0
    resumed = reader()
    resumed.seek([[1, 0, 0]])
    assert resumed.epochs_begun() == 0  # no token of epoch 1 used yet: as the uninterrupted lane
    assert np.array_equal(resumed.window(2, 0), full.window(2, 0))
