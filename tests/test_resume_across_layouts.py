"""A checkpoint moves exactly between parallel layouts of the same 4 ranks: expert-parallel
degrees (both MoE families, with CPU offload and auto on the resumed side), tensor-parallel
degrees and the data-parallel shard / replicate split.

Every case runs at a learning rate high enough that a wrong optimizer moment shows in the loss,
and compares the state itself: right after a load at another layout, every parameter and every
optimizer tensor (Adam's moments and step, gathered whole) equals, element by element, what the
saving run held at that step; the uninterrupted runs of every layout hold the same state at that
step (within reduction order); the resumed losses repeat the uninterrupted ones within 1e-6."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.dist_utils import run_distributed

SAVED_STEP, STEPS = 2, 4


def _whole_state(trainer: Any) -> dict[str, Any]:
    """Every parameter and optimizer tensor of ``trainer``, gathered whole, by parameter name (a
    collective; every rank gets it)."""
    import torch
    from torch.distributed.tensor import DTensor

    def whole(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()

    state = {}
    for name, param in trainer.model.named_parameters():
        state[name] = whole(param)
        for key, value in trainer.optimizer.state.get(param, {}).items():
            state[f"{name}:{key}"] = whole(value)
    return state


def _run(argv: list[str], *, resumed: bool) -> dict[str, Any]:
    """Train; the losses, and the state right after the trainer was built (``resumed``: after
    its load) or else the state after step :data:`SAVED_STEP` (rank 0's; None on the other
    ranks)."""
    import torch.distributed as dist

    from torchtitan_lite.callbacks import Callback
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    rank = dist.get_rank()
    captured: dict[str, Any] = {"loaded": _whole_state(trainer)} if resumed else {}

    class AtSavedStep(Callback):
        def after_step(self, trainer: Any, state: Any) -> None:
            if state.step == SAVED_STEP:
                captured["saved"] = _whole_state(trainer)

    if not resumed:
        trainer.callbacks.append(AtSavedStep())
    try:
        losses = [h["loss"] for h in trainer.train()]
    finally:
        trainer.close()
    return {"losses": losses, **captured} if rank == 0 else None


def _relative_distance(a: Any, b: Any) -> float:
    import torch

    if not isinstance(a, torch.Tensor):
        return 0.0 if a == b else float("inf")
    a, b = a.double(), b.double()
    return float((a - b).norm() / max(float(a.norm()), 1e-30))


def _check(layouts: dict[str, list[str]], moves: list[tuple[str, str]], argv: Any, tmp_path: Path,
           *, resumed_extra: dict[tuple[str, str], list[str]] | None = None) -> None:
    """Uninterrupted runs at every layout (saving at :data:`SAVED_STEP`), then every move
    (from, to): the layout ``to`` resumed from the ``from`` run's checkpoint."""
    runs = {}
    for name, extra in layouts.items():
        (runs[name], *_) = run_distributed(functools.partial(_run, resumed=False), 4, argv(tmp_path / name, *extra))
    first = next(iter(runs.values()))
    for name, run in runs.items():  # every layout trains alike
        for a, b in zip(run["losses"], first["losses"], strict=True):
            assert abs(a - b) <= 1e-6 * abs(b), (name, run["losses"], first["losses"])
        far = {k: d for k, v in first["saved"].items() if (d := _relative_distance(v, run["saved"][k])) > 1e-4}
        assert not far, (name, far)  # a gradient scaled wrongly shows in its moments (0.75 when 4×)
    for source, target in moves:
        dump = tmp_path / f"{source}-to-{target}"
        shutil.copytree(tmp_path / source / "checkpoint" / f"step-{SAVED_STEP}",
                        dump / "checkpoint" / f"step-{SAVED_STEP}")
        extra = [*layouts[target], *(resumed_extra or {}).get((source, target), [])]
        (resumed, *_) = run_distributed(functools.partial(_run, resumed=True), 4, argv(dump, *extra))
        saved = runs[source]["saved"]
        assert resumed["loaded"].keys() == saved.keys(), (source, target)
        import torch

        wrong = [
            k
            for k, v in saved.items()
            if not (torch.equal(v, resumed["loaded"][k]) if isinstance(v, torch.Tensor) else v == resumed["loaded"][k])
        ]
        assert not wrong, (source, target, wrong)  # the load: exact, element by element
        uninterrupted = runs[source]["losses"][SAVED_STEP:]
        assert len(resumed["losses"]) == STEPS - SAVED_STEP
        for a, b in zip(resumed["losses"], uninterrupted, strict=True):
            assert abs(a - b) <= 1e-6 * abs(b), (source, target, resumed["losses"], uninterrupted)


def _moe_argv(family: str) -> Any:
    def argv(dump: Path, *extra: str) -> list[str]:
        return ["--model.name", family, "--model.flavor", "tiny", "--training.seq_len", "32",
                "--training.global_batch_size", "8", "--training.local_batch_size", "2",
                "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "1e-2",
                "--training.mixed_precision_param", "float32", "--training.no-shuffle",
                "--checkpoint.enable", "--checkpoint.interval", str(SAVED_STEP),
                "--job.dump_folder", str(dump), "--metrics.log_freq", "1", "--metrics.no-enable_tensorboard",
                "--validation.no-enable", *extra]
    return argv


def _ep(degree: int) -> list[str]:
    return ["--parallelism.expert_parallel_degree", str(degree)]


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_expert_parallel_checkpoints_move_between_degrees_exactly(tmp_path: Path, family: str) -> None:
    """Qwen3-MoE and DeepSeek-V3 (8 experts), 4 ranks, fp32, lr 1e-2: expert parallel 1, 2 and
    4 train alike; Qwen3-MoE's moves 2→4 (resumed with CPU offload) and 4→2 (resumed under auto
    with selective checkpointing), DeepSeek-V3's 1→2 and 4→1, load the saved state exactly and
    repeat the losses. (Expert parallel 4 divided its experts' gradients twice before: 4× too
    small, which Adam nearly hides in uninterrupted losses and a move between degrees shows.)
    Every move of both families: scripts/resume_across_degrees.py."""
    from tests.test_expert_parallel import _AUTO

    layouts = {"ep1": _ep(1), "ep2": _ep(2), "ep4": _ep(4)}
    if family == "qwen3_moe":
        moves = {("ep2", "ep4"): ["--parallelism.cpu_offload", "all"], ("ep4", "ep2"): list(_AUTO)}
    else:
        moves = {("ep1", "ep2"): [], ("ep4", "ep1"): []}
    _check(layouts, list(moves), _moe_argv(family), tmp_path, resumed_extra=moves)


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_checkpoints_move_between_tensor_parallel_degrees_and_shard_replicate_splits_exactly(tmp_path: Path) -> None:
    """Tiny Qwen3 (per-head norms, tied embeddings), 4 ranks, fp32, lr 1e-2: FSDP over 4,
    data parallel 2 × tensor parallel 2, and HSDP 2 replicas × 2 shards train alike; moves
    FSDP → tensor parallel, tensor parallel → HSDP and HSDP → FSDP (each layout saves once and
    loads once) load the saved state exactly and repeat the losses."""
    def argv(dump: Path, *extra: str) -> list[str]:
        return _moe_argv("qwen3")(dump, *extra)

    layouts = {"fsdp4": [], "dp2xtp2": ["--parallelism.tensor_parallel_degree", "2"],
               "hsdp2x2": ["--parallelism.data_parallel_replicate_degree", "2"]}
    _check(layouts, [("fsdp4", "dp2xtp2"), ("dp2xtp2", "hsdp2x2"), ("hsdp2x2", "fsdp4")], argv, tmp_path)
