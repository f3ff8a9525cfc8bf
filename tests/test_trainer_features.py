"""Trainer features on CPU ranks over gloo: validation, profiling traces, MFU, gc handling, and
training on Hugging Face tokenizers, local text and pre-tokenized files."""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import TINY_ARGS
from tests.data_helpers import DOCS, train_hf_tokenizer
from tests.dist_utils import read_jsonl, run_distributed
from torchtitan_lite.metrics import RECORD_KEYS, device_peak_tflops

# --------------------------------------------------------------------------------------------
# Rank function
# --------------------------------------------------------------------------------------------


def _run(argv: list[str]) -> dict[str, Any]:
    """Train with ``argv``; report the history, the vocabulary the model got and gc's state."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    gc_during: list[bool] = []
    trainer = Trainer(load_job_config(argv))
    original = trainer.train_step

    def spy() -> dict[str, float]:
        gc_during.append(gc.isenabled())
        return original()

    trainer.train_step = spy
    try:
        history = trainer.train()
        return {
            "rank": trainer.rank,
            "history": history,
            "vocab_size": trainer.plan.model_args.vocab_size,
            "tokenizer_vocab": trainer.plan.tokenizer.vocab_size,
            "embedding_rows": trainer.model.tok_embeddings.weight.shape[0],
            "flops_per_token": trainer.flops_per_token,
            "gc_during": gc_during,
            "gc_after": gc.isenabled(),
        }
    finally:
        trainer.close()


def _tiny(dump: Path, *extra: str) -> list[str]:
    return [*TINY_ARGS, "--job.dump_folder", str(dump), *extra]


# --------------------------------------------------------------------------------------------
# Validation (and, in the same run, profiling and the record layout)
# --------------------------------------------------------------------------------------------

VAL_STEPS = 5
VAL_FREQ = 2
VAL_SEQ = 32


def _validation_text(folder: Path) -> tuple[Path, int]:
    """A validation file whose window count is not a multiple of any batch used here."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "val.txt"
    path.write_text(("Held-out text for validation. " * 40)[:1000], encoding="utf-8")
    windows = (1000 + 2) // (VAL_SEQ + 1)  # bytes + BOS/EOS, windows of seq_len + 1
    return path, windows


@pytest.fixture(scope="module")
def validation_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("validation")
    val_path, windows = _validation_text(root)
    # 2 batches of 10 windows: 20 of the 30, in 3 forward passes of 2 × 4 on 2 ranks (the
    # last one padded) and 5 of 4 on 1 rank.
    val_args = [
        "--validation.enable", "--validation.freq", str(VAL_FREQ), "--validation.steps", "2",
        "--validation.global_batch_size", "10",
        "--validation.dataset", "text", "--validation.dataset_path", str(val_path),
        "--validation.local_batch_size", "4",
    ]
    common = ["--training.steps", str(VAL_STEPS), "--training.global_batch_size", "4",
              "--metrics.log_freq", "4"]
    two = run_distributed(_run, 2, _tiny(
        root / "two", *common, *val_args, "--metrics.enable_tensorboard",
        "--profiling.enable_profiling", "--profiling.profile_freq", "2",
        "--profiling.profiler_warmup", "0", "--profiling.profiler_active", "1",
    ))
    (one,) = run_distributed(_run, 1, _tiny(root / "one", *common, *val_args,
                                             "--metrics.peak_tflops", "0.001"))
    (off,) = run_distributed(_run, 1, _tiny(root / "off", *common))
    return {"root": root, "windows": windows, "two": two, "one": one, "off": off}


@pytest.mark.slow
def test_validation_runs_at_its_frequency_and_reaches_both_sinks(validation_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = validation_runs["root"]
    records = read_jsonl(root / "two" / "metrics.jsonl")
    validated = [2, 4, 5]  # every freq steps, and the last step
    assert [r["step"] for r in records] == [1, 2, 4, 5]  # log_freq 4, plus validation steps
    for r in records:
        if r["step"] in validated:
            assert math.isfinite(r["validation_loss"]) and r["validation_loss"] > 0, r
            assert r["validation_perplexity"] == pytest.approx(math.exp(r["validation_loss"]))
            # 2 batches of 10 windows, each window once, padding not counted.
            assert r["validation_tokens"] == 20 * VAL_SEQ, r
        else:
            assert r["validation_loss"] is None, r
    val_losses = [r["validation_loss"] for r in records if r["step"] in validated]
    assert val_losses[-1] < val_losses[0]  # the model learns this text (it repeats)

    (run_dir,) = [d for d in (root / "two" / "tb").iterdir() if d.is_dir()]
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    events = acc.Scalars("validation_loss")
    assert [e.step for e in events] == validated
    assert [e.value for e in events] == pytest.approx(val_losses, rel=1e-6)

    # The same windows, so the same validation loss, on 1 rank ...
    two_hist = {h["step"]: h for h in validation_runs["two"][0]["history"]}
    one_hist = {h["step"]: h for h in validation_runs["one"]["history"]}
    for step in validated:
        assert one_hist[step]["validation_loss"] == pytest.approx(two_hist[step]["validation_loss"], rel=1e-5)
        assert one_hist[step]["validation_tokens"] == two_hist[step]["validation_tokens"]
    # ... and validating does not change training: same losses as the run without it.
    off = [h["loss"] for h in validation_runs["off"]["history"]]
    assert [one_hist[s]["loss"] for s in sorted(one_hist)] == off


@pytest.mark.slow
def test_records_have_stable_keys_and_consistent_values(validation_runs):
    records = read_jsonl(validation_runs["root"] / "two" / "metrics.jsonl")
    flops_per_token = validation_runs["two"][0]["flops_per_token"]
    for r in records:
        assert list(r)[: len(RECORD_KEYS)] == list(RECORD_KEYS), list(r)
        assert r["tps"] > 0 and r["tokens_per_rank"] == 2 * VAL_SEQ  # global 4 over 2 ranks
        assert r["tflops"] == pytest.approx(r["tps"] * flops_per_token / 1e12)
        assert r["mfu_pct"] is None  # CPU, no peak given: no made-up number
        assert r["data_time_s"] + r["compute_time_s"] == pytest.approx(r["step_time_s"])
        assert 0 < r["data_time_s"] < r["step_time_s"]
        assert r["memory_peak_rss_gib"] > 0.05
        assert r["memory_max_active_gib"] is None and r["memory_max_reserved_gib"] is None
        assert r["tokens_seen"] == r["step"] * 4 * VAL_SEQ

    # With a configured peak, MFU is tflops / peak.
    for h in validation_runs["one"]["history"]:
        assert h["mfu_pct"] == pytest.approx(100 * h["tflops"] / 0.001)


@pytest.mark.slow
def test_profiler_writes_a_trace_per_rank_per_window(validation_runs):
    traces = validation_runs["root"] / "two" / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_2", "iteration_4"]
    for folder in traces.iterdir():
        assert sorted(p.name for p in folder.iterdir()) == ["rank0_trace.json", "rank1_trace.json"]
        trace = json.loads((folder / "rank1_trace.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any(n.startswith("aten::") for n in names), sorted(names)[:20]
        assert any(n.startswith("ProfilerStep#") for n in names)


@pytest.mark.slow
def test_gc_is_off_during_training_and_restored_after(validation_runs):
    for result in (*validation_runs["two"], validation_runs["one"]):
        assert result["gc_during"] == [False] * VAL_STEPS
        assert result["gc_after"] is True


def test_garbage_collection_every_gc_freq_steps(monkeypatch):
    from torchtitan_lite.gc_control import GarbageCollection

    calls: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    handler = GarbageCollection(3)
    try:
        assert not gc.isenabled()
        for step in range(1, 10):
            handler.run(step)
    finally:
        handler.close()
    assert gc.isenabled()
    assert calls == [1, 1, 1, 1]  # at start, then steps 3, 6, 9


def test_peak_tflops_table(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert device_peak_tflops(cuda)[0] == pytest.approx(989.4)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert device_peak_tflops(cuda)[0] == pytest.approx(756.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert device_peak_tflops(cuda)[0] == pytest.approx(312.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40")
    assert device_peak_tflops(cuda)[0] == pytest.approx(181.05)
    # The table holds bf16 peaks: with fp32 compute there is no MFU unless a peak is given.
    assert device_peak_tflops(cuda, compute_dtype=torch.float32)[0] is None
    assert device_peak_tflops(cuda, 50.0, compute_dtype=torch.float32)[0] == 50.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery Accelerator")
    assert device_peak_tflops(cuda)[0] is None
    assert device_peak_tflops(cuda, 123.0) == (123.0, "metrics.peak_tflops")
    assert device_peak_tflops(torch.device("cpu"))[0] is None


# --------------------------------------------------------------------------------------------
# Other tokenizers and datasets, end to end
# --------------------------------------------------------------------------------------------


def test_hf_tokenizer_on_jsonl_folder_two_ranks(tmp_path):
    tok_path = train_hf_tokenizer(tmp_path / "tok")
    data = tmp_path / "corpus"
    (data / "part").mkdir(parents=True)
    with (data / "a.jsonl").open("w") as fh:
        for i in range(200):
            fh.write(json.dumps({"text": f"{DOCS[i % 4]} (record {i})"}) + "\n")
    (data / "part" / "b.txt").write_text("\n".join(DOCS) * 30)
    results = run_distributed(_run, 2, _tiny(
        tmp_path / "out", "--model.tokenizer_path", str(tok_path),
        "--training.dataset", "text", "--training.dataset_path", str(data), "--training.steps", "12",
        "--optimizer.lr", "1e-2",
    ))
    for r in results:
        assert r["vocab_size"] == r["tokenizer_vocab"] == r["embedding_rows"]
        assert 258 < r["vocab_size"] <= 300
    losses = [h["loss"] for h in results[0]["history"]]
    assert losses[0] == pytest.approx(math.log(results[0]["vocab_size"]), abs=0.5)
    assert losses[-1] < losses[0] - 0.5, losses


def test_pretokenized_memmap_with_padded_vocab(tmp_path):
    tok_path = train_hf_tokenizer(tmp_path / "tok")
    from torchtitan_lite.data import HFTokenizer

    ids = np.concatenate(HFTokenizer(tok_path).encode_batch(DOCS * 50)).astype(np.uint16)
    ids[: len(ids) // 2].tofile(tmp_path / "shard0.bin")
    np.save(tmp_path / "shard1.npy", ids[len(ids) // 2 :])
    (result,) = run_distributed(_run, 1, _tiny(
        tmp_path / "out", "--model.tokenizer_path", str(tok_path), "--model.vocab_size", "320",
        "--training.dataset", "tokens", "--training.dataset_path", str(tmp_path), "--training.steps", "8",
        "--optimizer.lr", "1e-2",
    ))
    assert result["vocab_size"] == result["embedding_rows"] == 320 > result["tokenizer_vocab"]
    losses = [h["loss"] for h in result["history"]]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


def test_console_line_is_coloured_only_on_a_terminal(tmp_path, monkeypatch, caplog):
    import io
    import logging

    from torchtitan_lite import metrics

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    values = {"loss": 2.5, "grad_norm": 0.7, "lr": 1e-3, "tps": 1234.0, "tflops": 0.1,
              "step_time_s": 0.5, "data_time_s": 0.01, "memory_peak_rss_gib": 1.0}
    lines = {}
    for name, stream in (("pipe", io.StringIO()), ("tty", Terminal())):
        monkeypatch.setattr(metrics.sys, "stdout", stream)
        monkeypatch.delenv("NO_COLOR", raising=False)
        logger = metrics.MetricsLogger(rank=0, dump_folder=tmp_path / name, enable_tensorboard=False,
                                       tb_folder="tb")
        with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
            caplog.clear()
            logger.log(12, values)
        logger.close()
        lines[name] = caplog.records[-1].getMessage()
    assert "\033[" not in lines["pipe"] and "\033[" in lines["tty"]
    assert lines["pipe"].startswith("step     12  loss   2.5000  grad_norm   0.7000")
    assert "data  2.0%" in lines["pipe"] and "mem   1.00GiB" in lines["pipe"]


def test_whole_validation_set_matches_a_direct_computation(tmp_path):
    """``steps = -1`` visits every window exactly once; the loss is the plain mean over them."""
    from tests.data_helpers import build_token_stream
    from torchtitan_lite.data import ByteTokenizer, TokenWindows
    from torchtitan_lite.models.llama3 import LLAMA3_FLAVORS, Transformer
    from torchtitan_lite.training import MicroBatchRunner
    from torchtitan_lite.training.validate import Validator

    val_path, windows_expected = _validation_text(tmp_path)
    windows = TokenWindows(build_token_stream("text", str(val_path), ByteTokenizer()), VAL_SEQ)
    assert len(windows) == windows_expected == 30
    torch.manual_seed(0)
    model = Transformer(LLAMA3_FLAVORS["tiny"])
    model.init_weights()
    validator = Validator(windows, runner=MicroBatchRunner(model, device=torch.device("cpu")), local_batch_size=4,
                          global_batch_size=4, dp_rank=0, dp_size=1, steps=-1)
    assert validator.num_windows == 30 and validator.passes == 8  # the last pass holds 2 + 2 padding
    result = validator.run()
    rows = torch.stack([torch.from_numpy(windows[i]) for i in range(30)])
    with torch.no_grad():
        logits = model(rows[:, :-1])
        direct = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
    assert result["validation_tokens"] == 30 * VAL_SEQ
    assert result["validation_loss"] == pytest.approx(direct.item(), rel=1e-5)
    assert model.training  # put back in training mode


def _matmuls(n: int) -> None:
    a = torch.randn(32, 32)
    for _ in range(n):
        a = torch.tanh(a @ a)


@pytest.mark.parametrize("start, warmup, active, expected", [
    (0, 0, 2, [2, 4, 6]),   # no wait steps: the window after the last one must not overwrite it
    (0, 1, 1, [2, 4, 6]),
    (1, 0, 1, [2, 4, 6]),   # resumed at step 1: the window ending at 2 still fits
    (3, 1, 1, [6]),         # resumed at 3: only step 4 is left before 4, too few for warmup + active
    (4, 1, 1, [6]),
])
def test_profiler_windows_end_at_multiples_of_freq(tmp_path, start, warmup, active, expected):
    from torchtitan_lite.callbacks.profiler import Profiler
    from torchtitan_lite.config import Profiling

    cfg = Profiling(enable_profiling=True, profile_freq=2, profiler_warmup=warmup, profiler_active=active)
    with Profiler(cfg, dump_folder=tmp_path, rank=0, device=torch.device("cpu"), start_step=start) as prof:
        for _ in range(start, 7):
            _matmuls(3)
            prof.step()
    folders = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "profile_traces").iterdir())
    assert folders == expected
    assert len(prof.trace_files) == len(expected)
    for step in expected:
        trace = json.loads((tmp_path / "profile_traces" / f"iteration_{step}" / "rank0_trace.json").read_text())
        assert any(e.get("name", "").startswith("aten::mm") for e in trace["traceEvents"]), step
