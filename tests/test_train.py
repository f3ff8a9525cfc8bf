"""End-to-end tests of the trainer on CPU ranks over gloo.

Every distributed run happens in spawned rank processes (``run_distributed``: each call gets its
own process group, environment and default RNG state, and nothing leaks into pytest itself).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY_ARGS
from tests.dist_utils import read_jsonl, run_distributed
from torchtitan_lite.metrics import RECORD_KEYS

# --------------------------------------------------------------------------------------------
# Rank functions (module level, so that spawned processes can import them)
# --------------------------------------------------------------------------------------------


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every named parameter as a full plain tensor (a collective: call on every rank)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = value.detach().clone()
    return out


def _trainer_run(argv: list[str], train: bool) -> dict[str, Any]:
    """Build a Trainer from ``argv``, gather its initial full parameters, optionally train.

    Returns the full parameters on rank 0 only (they are identical everywhere), the per-step
    history and the batch layout the trainer resolved.
    """
    from torch.distributed.fsdp import FSDPModule

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    try:
        params = _full_params(trainer.model)
        fsdp = isinstance(trainer.model, FSDPModule)
        history = trainer.train() if train else []
        return {
            "rank": trainer.rank,
            "world_size": trainer.world_size,
            "global_batch_size": trainer.plan.global_batch_size,
            "grad_accum_steps": trainer.loader.grad_accum_steps,
            "params": params if trainer.rank == 0 else None,
            "history": history,
            "fsdp": fsdp,
        }
    finally:
        trainer.close()


def _poison(model: torch.nn.Module) -> None:
    """Fill every parameter's local shard and every buffer with NaN, in place."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            local.fill_(float("nan"))
        for buf in model.buffers():
            buf.fill_(float("nan"))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _meta_init_sharded(seed: int) -> dict[str, Any]:
    """Meta → apply_fsdp → to_empty → NaN poison → seeded init_weights, on this rank's shard."""
    import torch.distributed as dist

    from torchtitan_lite.distributed import (
        destroy_distributed,
        fsdp_mesh,
        init_distributed,
    )
    from torchtitan_lite.distributed.fsdp import apply_fsdp
    from torchtitan_lite.models.llama3 import LLAMA3_FLAVORS, LLAMA3_SPEC, Transformer
    from torchtitan_lite.models.llama3.model import precompute_freqs_cis

    device = torch.device("cpu")
    init_distributed(device)
    try:
        mesh = fsdp_mesh(device)
        args = LLAMA3_FLAVORS["tiny"]
        with torch.device("meta"):
            model = Transformer(args)
        apply_fsdp(model, mesh, **LLAMA3_SPEC.fsdp_units(model))
        model.to_empty(device="cpu")
        _poison(model)
        poisoned = all(bool(torch.isnan(_local(p)).all()) for p in model.parameters()) and all(
            bool(torch.isnan(b).all()) for b in model.buffers()
        )
        sharded = {
            name: (tuple(_local(p).shape), tuple(p.shape)) for name, p in model.named_parameters()
        }

        torch.manual_seed(seed)
        model.init_weights(buffer_device="cpu")

        non_finite = [
            name for name, p in model.named_parameters() if not bool(torch.isfinite(_local(p)).all())
        ]
        non_finite += [
            f"buffer {name}" for name, b in model.named_buffers() if not bool(torch.isfinite(b).all())
        ]
        expected_freqs = precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta)
        freqs = model.freqs_cis
        freqs_ok = (
            freqs.dtype == expected_freqs.dtype
            and freqs.device.type == "cpu"
            and torch.equal(freqs, expected_freqs)
        )
        return {
            "rank": dist.get_rank(),
            "poisoned": poisoned,
            "sharded": sharded,
            "non_finite": non_finite,
            "freqs_ok": freqs_ok,
            "params": _full_params(model),
        }
    finally:
        destroy_distributed()


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _tiny(tmp: Path, *extra: str) -> list[str]:
    return [*TINY_ARGS, "--job.dump_folder", str(tmp), *extra]


def _assert_same_params(ref: dict[str, torch.Tensor], other: dict[str, torch.Tensor], what: str) -> None:
    assert list(other) == list(ref), f"{what}: parameter names differ"
    for name, value in ref.items():
        assert other[name].shape == value.shape, f"{what}: {name} shape {other[name].shape} != {value.shape}"
        assert torch.equal(other[name], value), (
            f"{what}: {name} differs, max abs diff {(other[name] - value).abs().max().item():.3e}"
        )


def _losses(result: dict[str, Any]) -> list[float]:
    return [h["loss"] for h in result["history"]]


def _assert_close_losses(ref: list[float], other: list[float], what: str, rtol: float = 1e-5) -> None:
    assert len(other) == len(ref), what
    for step, (a, b) in enumerate(zip(ref, other, strict=True), start=1):
        assert math.isfinite(a) and math.isfinite(b), f"{what}: non-finite loss at step {step}"
        assert abs(a - b) <= rtol * abs(a), (
            f"{what}: step {step} loss {b!r} vs {a!r} (rel diff {abs(a - b) / abs(a):.2e})\n"
            f"reference {ref}\nother     {other}"
        )


# --------------------------------------------------------------------------------------------
# 1. World-size invariance
# --------------------------------------------------------------------------------------------

INVARIANCE_STEPS = 10


@pytest.mark.slow
def test_world_size_invariance(tmp_path: Path) -> None:
    """Same seed and global batch (4 samples) → same initial full weights and same losses (fp32,
    within 1e-5) for 2 ranks × 2, 1 rank × 4, 1 rank × 1 with 4 accumulation steps, 4 ranks × 1
    and 2 ranks × 1 with 2 accumulation steps: one process (the plain model) and FSDP2 alike."""
    steps = ["--training.steps", str(INVARIANCE_STEPS)]
    runs = {
        "2 ranks x local 2": (2, ["--training.local_batch_size", "2"]),
        "1 rank x local 4": (1, ["--training.local_batch_size", "4"]),
        "1 rank x local 1 x accum 4": (
            1, ["--training.local_batch_size", "1", "--training.global_batch_size", "4"]
        ),
        "4 ranks x local 1": (4, ["--training.local_batch_size", "1"]),
        # Sharding and accumulation together: FSDP reduces each micro-batch's gradients.
        "2 ranks x local 1 x accum 2": (
            2, ["--training.local_batch_size", "1", "--training.global_batch_size", "4"]
        ),
    }
    results: dict[str, list[dict[str, Any]]] = {}
    for label, (world, extra) in runs.items():
        argv = _tiny(tmp_path / label.replace(" ", "_"), *steps, *extra)
        results[label] = run_distributed(_trainer_run, world, argv, True)

    expected_accum = {
        "2 ranks x local 2": 1, "1 rank x local 4": 1, "1 rank x local 1 x accum 4": 4,
        "4 ranks x local 1": 1, "2 ranks x local 1 x accum 2": 2,
    }
    for label, per_rank in results.items():
        assert [r["rank"] for r in per_rank] == list(range(len(per_rank)))
        # One process trains the plain model (no FSDP copies); several shard it with FSDP2.
        assert all(r["fsdp"] == (len(per_rank) > 1) for r in per_rank), label
        for r in per_rank:
            assert r["world_size"] == len(per_rank), label
            assert r["global_batch_size"] == 4, label
            assert r["grad_accum_steps"] == expected_accum[label], label
            assert [h["step"] for h in r["history"]] == list(range(1, INVARIANCE_STEPS + 1)), label
        # Every rank reports the same (all-reduced) loss.
        for r in per_rank[1:]:
            assert _losses(r) == _losses(per_rank[0]), f"{label}: ranks disagree on the loss"

    ref_label = "2 ranks x local 2"
    ref = results[ref_label][0]
    ref_params = ref["params"]

    # The initial weights are real (not constant, not all alike) ...
    emb = ref_params["tok_embeddings.weight"]
    assert emb.shape == (258, 64)
    assert 0.9 < emb.std().item() < 1.1
    assert not torch.equal(ref_params["layers.0.attention.wq.weight"], ref_params["layers.1.attention.wq.weight"])
    assert torch.equal(ref_params["norm.weight"], torch.ones(64))
    # ... and the losses move.
    ref_losses = _losses(ref)
    assert ref_losses[-1] < ref_losses[0]
    assert len(set(ref_losses)) == len(ref_losses)

    for label, per_rank in results.items():
        if label == ref_label:
            continue
        _assert_same_params(ref_params, per_rank[0]["params"], f"initial params, {label} vs {ref_label}")
        _assert_close_losses(ref_losses, _losses(per_rank[0]), f"losses, {label} vs {ref_label}")
        # Same LR schedule everywhere.
        assert [h["lr"] for h in per_rank[0]["history"]] == [h["lr"] for h in ref["history"]]
        # Same number of tokens per optimizer step.
        assert [h["tokens_seen"] for h in per_rank[0]["history"]] == [h["tokens_seen"] for h in ref["history"]]


# --------------------------------------------------------------------------------------------
# 2. Meta-device init leaves no garbage and does not depend on sharding
# --------------------------------------------------------------------------------------------


def test_meta_init_is_complete_and_sharding_independent() -> None:
    from torchtitan_lite.models.llama3 import LLAMA3_FLAVORS, Transformer

    seed = 1234
    results = run_distributed(_meta_init_sharded, 2, seed)

    for r in results:
        assert r["poisoned"], f"rank {r['rank']}: the NaN poison did not reach every shard/buffer"
        assert r["non_finite"] == [], f"rank {r['rank']}: left uninitialised: {r['non_finite']}"
        assert r["freqs_ok"], f"rank {r['rank']}: freqs_cis differs from precompute_freqs_cis"
    # The model really was sharded: some parameter holds only part of its rows on a rank.
    assert any(local != full for local, full in results[0]["sharded"].values())
    # Both ranks gathered the same full parameters.
    _assert_same_params(results[0]["params"], results[1]["params"], "full params, rank 1 vs rank 0")

    # A plain, unsharded model built the same way in this process, with the same seed.
    args = LLAMA3_FLAVORS["tiny"]
    with torch.device("meta"):
        plain = Transformer(args)
    plain.to_empty(device="cpu")
    _poison(plain)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        plain.init_weights(buffer_device="cpu")
    expected = {name: p.detach().clone() for name, p in plain.named_parameters()}
    assert all(bool(torch.isfinite(p).all()) for p in expected.values())
    _assert_same_params(expected, results[0]["params"], "2-rank sharded init vs plain init")

    # A different seed gives different weights (the comparison above is not vacuous).
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        plain.init_weights(buffer_device="cpu")
    assert not torch.equal(plain.output.weight.detach(), expected["output.weight"])


# --------------------------------------------------------------------------------------------
# 3 & 4. One short single-process run: the loss falls; metrics.jsonl and TensorBoard agree
# --------------------------------------------------------------------------------------------

CURVE_STEPS = 30
CURVE_LOG_FREQ = 7


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    dump = tmp_path_factory.mktemp("tiny_run")
    argv = _tiny(
        dump,
        "--training.seq_len", "64",
        "--training.steps", str(CURVE_STEPS),
        "--metrics.log_freq", str(CURVE_LOG_FREQ),
        "--metrics.enable_tensorboard",
    )
    (result,) = run_distributed(_trainer_run, 1, argv, True)
    result["dump"] = dump
    return result


def test_loss_falls_on_embedded_corpus(tiny_run: dict[str, Any]) -> None:
    losses = _losses(tiny_run)
    assert len(losses) == CURVE_STEPS
    assert all(math.isfinite(x) for x in losses), losses
    first = losses[0]
    last5 = sum(losses[-5:]) / 5
    # An untrained byte model is near (or above) uniform over 258 tokens.
    assert first > math.log(258) - 0.5, losses
    assert last5 < math.log(258) - 1.0, losses
    assert last5 < first - 1.0, losses


def test_metrics_jsonl_and_tensorboard(tiny_run: dict[str, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dump: Path = tiny_run["dump"]
    history = {h["step"]: h for h in tiny_run["history"]}
    records = read_jsonl(dump / "metrics.jsonl")

    expected_steps = sorted({1, CURVE_STEPS, *range(CURVE_LOG_FREQ, CURVE_STEPS + 1, CURVE_LOG_FREQ)})
    assert [r["step"] for r in records] == expected_steps
    assert len({r["run_id"] for r in records}) == 1
    for r in records:
        for key in ("step", "loss", "grad_norm", "lr", "tps"):
            assert key in r, f"step {r['step']}: missing {key!r} in {sorted(r)}"
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r)
        assert list(r)[: len(RECORD_KEYS)] == list(RECORD_KEYS), f"step {r['step']}: keys {list(r)}"
        assert r["memory_peak_rss_gib"] > 0, r  # on CPU: the process's peak RSS
        assert r["grad_norm"] > 0 and r["tps"] > 0 and r["lr"] >= 0, r
        # The file holds what the trainer computed for that step.
        assert r["loss"] == history[r["step"]]["loss"]
        assert r["lr"] == history[r["step"]]["lr"]
        assert r["grad_norm"] == history[r["step"]]["grad_norm"]

    run_dirs = [d for d in (dump / "tb").iterdir() if d.is_dir()]
    assert len(run_dirs) == 1, run_dirs
    assert list(run_dirs[0].glob("events.out.tfevents.*")), list(run_dirs[0].iterdir())
    acc = EventAccumulator(str(run_dirs[0]))
    acc.Reload()
    scalar_tags = acc.Tags()["scalars"]
    for tag in ("loss", "grad_norm", "lr", "tps"):
        assert tag in scalar_tags, scalar_tags
    tb_loss = acc.Scalars("loss")
    assert [e.step for e in tb_loss] == expected_steps
    for event, record in zip(tb_loss, records, strict=True):
        assert event.value == pytest.approx(record["loss"], rel=1e-6, abs=1e-6), (event, record)


def _fail_on_rank1(dump: str) -> dict:

    from torchtitan_lite import train, trainer

    original = trainer.Trainer.train_step

    def flaky(self):
        if self.rank == 1 and self.step == 2:
            raise RuntimeError("injected failure")
        return original(self)

    trainer.Trainer.train_step = flaky
    try:
        code = train.main([*TINY_ARGS, "--training.steps", "6", "--job.dump_folder", dump])
        outcome = "finished" if code == 0 else f"exit code {code}"
    except Exception as exc:  # the outcome is what the test checks
        outcome = f"{type(exc).__name__}: {exc}"
    return {"outcome": outcome}


@pytest.mark.scenario  # (test_process_group.py's killed rank covers a lost peer in the default selection)
@pytest.mark.slow
def test_failing_rank_does_not_hang_the_job(tmp_path):
    """A rank that fails mid-run leaves at once, and its peer's collective fails instead of
    waiting for the process-group timeout (600 s). The hang bound is run_distributed's timeout
    (200 s, a third of the process-group timeout): a peer still waiting then fails the test."""
    r0, r1 = run_distributed(_fail_on_rank1, 2, str(tmp_path), timeout=200, fresh=True)
    assert "injected failure" in r1["outcome"]
    assert r0["outcome"] != "finished"
