"""The mixture (``torchtitan_lite/data/mixture.py``) and the loader over several sources
(``torchtitan_lite/data/loader.py``), in process: shares, epochs, world sizes, resume, changes."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch

from torchtitan_lite.data import BatchLoader, LoaderSource, TokenWindows, WindowReader
from torchtitan_lite.data.mixture import Schedule
from torchtitan_lite.errors import DataError

SEQ = 7


def _windows(num: int, offset: int) -> TokenWindows:
    """``num`` windows whose tokens tell the source (``offset``) and the window apart."""
    return TokenWindows(np.arange(num * (SEQ + 1), dtype=np.int64) + offset, SEQ)


def _loader(weights: dict[str, float], *, rank: int = 0, dp: int = 1, global_bs: int = 8, local_bs: int | None = None,
            max_epochs: dict[str, int] | None = None, sizes: dict[str, int] | None = None,
            allow_change: bool = False) -> BatchLoader:
    sizes = sizes or {}
    sources = [LoaderSource(name, WindowReader(_windows(sizes.get(name, 50), 10_000 * (i + 1)), seed=3, shuffle=True,
                                               key=(i,)), weight=w, max_epochs=(max_epochs or {}).get(name))
               for i, (name, w) in enumerate(weights.items())]
    return BatchLoader(sources, seq_len=SEQ, global_batch_size=global_bs, local_batch_size=local_bs or global_bs // dp,
                       dp_rank=rank, dp_size=dp, named=True, allow_mixture_change=allow_change)


def _global_batch(loaders: list[BatchLoader]) -> torch.Tensor:
    """The rows of one global batch over the ranks, each row's source first (from its tokens)."""
    rows = [torch.cat([x, y[:, -1:]], dim=1) for ld in loaders for x, y in ld.next_batch()]
    return torch.cat(rows)


def test_a_source_that_restarts_every_step_logs_one_epoch_line_per_ten_steps(caplog: pytest.LogCaptureFixture,
                                                                            ) -> None:
    """80 steps over a source of 8 windows, 8 a step: 80 epochs; a line at the first restart,
    then one at most every ``epoch_log_steps`` (10) steps, each saying which epoch it is."""
    caplog.set_level(logging.INFO, "torchtitan_lite")
    source = LoaderSource("tiny", WindowReader(_windows(8, 0), seed=3, shuffle=True), weight=1.0)
    loader = BatchLoader([source], seq_len=SEQ, global_batch_size=8, local_batch_size=8, dp_rank=0, dp_size=1,
                         epoch_log_steps=10)
    for _ in range(80):
        loader.next_batch()
    lines = [r.getMessage() for r in caplog.records if "starts again" in r.getMessage()]
    assert lines[0] == "training data: source 'tiny' has used all its 8 windows and starts again (epoch 1)"
    assert lines[1] == ("training data: source 'tiny' has used all its 8 windows 10 more times and starts again "
                        "(epoch 11; a line at most every 10 steps)"), lines
    assert len(lines) == 8, lines


def test_every_prefix_is_within_one_sample_of_its_share() -> None:
    rng = random.Random(0)
    for _ in range(150):
        raw = [rng.random() ** 3 + 1e-3 for _ in range(rng.randint(1, 7))]
        weights = [w / sum(raw) for w in raw]
        schedule = Schedule([str(i) for i in range(len(raw))], raw, samples_per_epoch=[None] * len(raw),
                            max_epochs=[None] * len(raw))
        counts = [0] * len(raw)
        for n, (s, k) in enumerate(schedule.take(400), start=1):
            assert k == counts[s]  # each source's own sample numbers, in order
            counts[s] += 1
            assert max(abs(c - w * n) for c, w in zip(counts, weights, strict=True)) < 1, (raw, n, counts)


def test_a_source_reaching_max_epochs_leaves_and_the_others_are_renormalised(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "torchtitan_lite")
    loader = _loader({"small": 0.5, "big": 0.5}, sizes={"small": 6, "big": 1000}, max_epochs={"small": 2})
    seen = {"small": 0, "big": 0}
    for _ in range(10):
        loader.next_batch()
        for name, count in zip(loader.names, loader.batch_counts, strict=True):
            seen[name] += count
    assert seen == {"small": 12, "big": 68}  # 2 epochs of 6 windows, then only "big"
    assert loader.tokens_by_source() == {"small": 12 * SEQ, "big": 68 * SEQ}
    text = caplog.text
    assert "source 'small' has used all its 6 windows and starts again (epoch 1)" in text
    assert (
        "source 'small' has used its 6 windows 2 times (max_epochs = 2) and leaves the mixture; weights now 'big' 1"
        in text
    )
    done = _loader({"a": 1.0}, sizes={"a": 3}, max_epochs={"a": 1})
    with pytest.raises(DataError, match="every source is done: 'a' has used its 3 windows 1 times"):
        done.next_batch()


@pytest.mark.parametrize("dp, local_bs", [(2, 4), (4, 1), (1, 2)])
def test_global_batches_and_state_are_independent_of_world_size(dp: int, local_bs: int) -> None:
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    sizes = {"a": 30, "b": 11, "c": 40}
    reference = _loader(weights, sizes=sizes, local_bs=local_bs)  # one rank, accumulating micro-batches
    whole = _loader(weights, sizes=sizes)  # one micro-batch of 8
    ranks = [_loader(weights, rank=r, dp=dp, local_bs=local_bs, sizes=sizes) for r in range(dp)]
    for _ in range(6):
        expected, got = _global_batch([reference]), _global_batch(ranks)
        assert torch.equal(got, expected)
        # Rows are grouped by source within each micro-batch: the same rows as one micro-batch of 8.
        assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, _global_batch([whole]).tolist()))
    state = json.loads(json.dumps(reference.state_dict()))  # plain data
    assert state["schedule"]["totals"] == [24, 14, 10] and ranks[0].state_dict() == state
    resumed = [_loader(weights, rank=r, dp=dp, local_bs=local_bs, sizes=sizes) for r in range(dp)]
    for ld in resumed:
        ld.load_state_dict(state)
    for _ in range(5):
        assert torch.equal(_global_batch(resumed), _global_batch(ranks))


def test_sources_of_a_micro_batch_are_grouped_and_reported() -> None:
    loader = _loader({"a": 0.5, "b": 0.5}, local_bs=4)
    micro = loader.next_batch()
    for (x, _), sources in zip(micro, loader.batch_sources, strict=True):
        assert sources == sorted(sources)
        assert (x[:, 0] // 10_000 - 1).tolist() == sources  # each row's tokens came from its source
    assert loader.batch_counts == [4, 4]


def test_a_changed_mixture_is_refused_or_applied_from_the_resumed_step(caplog: pytest.LogCaptureFixture) -> None:
    first = _loader({"a": 0.7, "b": 0.3})
    for _ in range(3):
        first.next_batch()
    state = first.state_dict()
    with pytest.raises(DataError) as info:
        _loader({"a": 0.5, "b": 0.3, "c": 0.2}).load_state_dict(state)
    assert str(info.value) == ("data loader state does not match this run: the mixture changed (weight of 'a' 0.7 -> "
                               "0.5; 'c' added); set training.allow_mixture_change = true to apply the new mixture "
                               "from the resumed step")
    caplog.set_level(logging.WARNING, "torchtitan_lite")
    changed = _loader({"a": 0.5, "b": 0.3, "c": 0.2}, allow_change=True)
    changed.load_state_dict(state)
    assert "the mixture changed on resume (weight of 'a' 0.7 -> 0.5; 'c' added)" in caplog.text
    before = changed.tokens_by_source()
    for _ in range(5):
        changed.next_batch()
    after = changed.tokens_by_source()
    added = {k: (after[k] - before[k]) // SEQ for k in after}
    assert added == {"a": 20, "b": 12, "c": 8}  # the new weights over the 40 samples since the resume
    assert before["a"] == first.tokens_by_source()["a"]  # what was read before is kept


def _toml_error(tmp_path, tables: str, *argv: str, training: str = "", expect: type = DataError) -> str:
    """The one line that the checks before any process group give for a job with ``tables``."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.errors import UserError
    from torchtitan_lite.job import plan_job, preflight

    (tmp_path / "job.toml").write_text(f"[training]\nseq_len = 32\nlocal_batch_size = 1\n{training}\n{tables}")
    with pytest.raises(UserError) as info:
        config = load_job_config(["--job.config_file", str(tmp_path / "job.toml"), "--job.dump_folder",
                                  str(tmp_path / "out"), *argv])
        preflight(config)
        from torchtitan_lite.data import build_data

        build_data(config, plan_job(config, world_size=1), dp_rank=0)
    assert type(info.value) is expect, info.value
    assert "\n" not in str(info.value)
    return str(info.value)


def _table(name: str = "web", dataset: str = "tokens", path: str | None = None, **more: object) -> str:
    lines = [f'name = "{name}"', f'dataset = "{dataset}"'] + ([f'dataset_path = "{path}"'] if path else [])
    lines += [f"{k} = {json.dumps(v)}" for k, v in more.items()]
    return "[[training.datasets]]\n" + "\n".join(lines) + "\n"


def test_bad_mixtures_are_one_line_before_any_process_group(tmp_path) -> None:
    from torchtitan_lite.config import ConfigError

    tokens = tmp_path / "t.npy"
    np.save(tokens, np.arange(2000, dtype=np.uint16) % 258)
    ok = _table("a", "tokens", str(tokens))
    assert _toml_error(tmp_path, ok + _table("b", "tokens", str(tokens), weight=0), expect=ConfigError) == \
        "training.datasets[b].weight: invalid value 0.0; expected a finite number > 0"
    assert _toml_error(tmp_path, ok + _table("b", "tokens", str(tokens), weight="lots"), expect=ConfigError) == \
        "training.datasets[b].weight: invalid value 'lots'; expected a number"
    assert _toml_error(tmp_path, ok + ok, expect=ConfigError) == \
        "training.datasets[a].name: duplicate name 'a'; names must be unique"
    assert _toml_error(tmp_path, ok + _table("b", "webtext", str(tokens)), expect=ConfigError).startswith(
        "training.datasets[b].dataset: invalid value 'webtext'; expected one of 'python_stdlib'")
    assert _toml_error(tmp_path, ok + _table("b", "tokens", str(tmp_path / "nope.npy"))) == \
        f"training.datasets[b].dataset_path: path not found: {str(tmp_path / 'nope.npy')!r}"
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    assert _toml_error(tmp_path, ok + _table("b", "parquet", str(tmp_path / "empty.parquet"))) == \
        f"training.datasets[b].dataset_path: {str(tmp_path / 'empty.parquet')!r} is empty (no rows in 1 file(s))"
    assert _toml_error(tmp_path, ok, training='dataset = "text"', expect=ConfigError) == (
        "training.dataset: 'text' is set together with [[training.datasets]]; keep one (the tables, or "
        "training.dataset and training.dataset_path)")
    # The default's own name, as the shipped debug_model.toml writes it, is refused too.
    assert _toml_error(tmp_path, ok, training='dataset = "python_stdlib"', expect=ConfigError) == (
        "training.dataset: 'python_stdlib' is set together with [[training.datasets]]; keep one (the tables, or "
        "training.dataset and training.dataset_path)")
    assert _toml_error(tmp_path, ok, "--training.dataset", "python_stdlib", expect=ConfigError).startswith(
        "training.dataset: 'python_stdlib' is set together with [[training.datasets]]")
    assert _toml_error(tmp_path, ok + _table("b", "tokens", str(tokens), max_epochs=0), expect=ConfigError) == \
        "training.datasets[b].max_epochs: invalid value 0; expected an integer >= 1, or unset"
    assert _toml_error(tmp_path, ok + _table("b", "tokens", str(tokens), colour="red"), expect=ConfigError) == (
        "training.datasets[b]: unknown key 'colour' (keys: name, dataset, dataset_path, weight, max_epochs)")


def test_a_state_of_the_earlier_single_source_loader_is_read() -> None:
    """A checkpoint of the earlier global-batch loader (one source, ``num_windows``) resumes."""
    windows = _windows(50, 0)
    loader = BatchLoader([LoaderSource("python_stdlib", WindowReader(windows, seed=3, shuffle=True))], seq_len=SEQ,
                         global_batch_size=8, local_batch_size=8, dp_rank=0, dp_size=1)
    reference = BatchLoader([LoaderSource("python_stdlib", WindowReader(windows, seed=3, shuffle=True))], seq_len=SEQ,
                            global_batch_size=8, local_batch_size=8, dp_rank=0, dp_size=1)
    for _ in range(9):
        reference.next_batch()
    loader.load_state_dict({"step": 9, "global_batch_size": 8, "seed": 3, "shuffle": True, "num_windows": 50,
                            "seq_len": SEQ, "skipped": []})
    assert torch.equal(_global_batch([loader]), _global_batch([reference]))
