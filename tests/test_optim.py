"""LR schedule values against the formulas, and the optimizer built from config."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.dist_utils import run_distributed
from torchtitan_lite.config import LRScheduler, Optimizer
from torchtitan_lite.optim import build_lr_scheduler, build_optimizer, lr_factor


def _factor(step, **kw):
    args = dict(total_steps=100, warmup_steps=10, decay_ratio=None, decay_type="linear",
                min_lr_factor=0.0)
    args.update(kw)
    return lr_factor(step, **args)


# TorchTitan's warmup-stable-decay schedule (v0.1.0 to its last TOML release), written out from
# its definition: warmup W = min(warmup, total) steps at (s + 1) / W; D decay steps
# (round(total · ratio), capped at total - W; total - W without a ratio); a stable phase of
# total + 1 - W - D steps (one "virtual" step past the end, so the run never reaches the
# minimum); in decay, progress (s + 1 - (W + stable)) / D.
def _torchtitan_factor(step, *, total, warmup, decay_ratio, kind, min_lr):
    warmup = min(warmup, total)
    decay = round(total * decay_ratio) if decay_ratio is not None else total - warmup
    if warmup + decay > total:
        decay = total - warmup
    stable = total + 1 - warmup - decay
    if step < warmup:
        return (step + 1) / warmup
    if step < warmup + stable:
        return 1.0
    p = (step + 1 - (warmup + stable)) / decay
    curve = {"linear": 1 - p, "sqrt": 1 - math.sqrt(p), "cosine": 0.5 * (1 + math.cos(math.pi * p))}[kind]
    return min_lr + (1 - min_lr) * curve


def test_warmup_is_linear_and_reaches_peak():
    assert _factor(0) == pytest.approx(1 / 10)
    assert _factor(4) == pytest.approx(5 / 10)
    assert _factor(9) == pytest.approx(1.0)


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
@pytest.mark.parametrize("min_lr", [0.0, 0.1])
def test_decay_curves_match_formulas(decay_type, min_lr):
    curves = {
        "linear": lambda p: 1 - p,
        "sqrt": lambda p: 1 - math.sqrt(p),
        "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    }
    # Warmup 0..9, then one step at the peak (10), then 90 decay steps 11..100 of which the run
    # has 11..99: the last step is one decay step short of the minimum.
    assert _factor(10, decay_type=decay_type, min_lr_factor=min_lr) == 1.0
    for step in (11, 30, 54, 99):
        progress = (step - 10) / 90
        expected = min_lr + (1 - min_lr) * curves[decay_type](progress)
        assert _factor(step, decay_type=decay_type, min_lr_factor=min_lr) == pytest.approx(expected)
    assert _factor(99, decay_type=decay_type, min_lr_factor=min_lr) > min_lr


def test_warmup_stable_decay():
    # decay_ratio 0.2 of 100 steps: warmup 0..9, stable 10..80, decay 81..(100) with 20 steps.
    kw = dict(decay_ratio=0.2, decay_type="cosine", min_lr_factor=0.0)
    assert all(_factor(s, **kw) == 1.0 for s in range(10, 81))
    assert _factor(81, **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi * 1 / 20)))
    assert _factor(90, **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi * 10 / 20)))
    assert _factor(99, **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi * 19 / 20)))


def test_no_warmup():
    # No warmup: step 0 is the stable step, decay over 100 steps from step 1.
    assert _factor(0, warmup_steps=0) == 1.0
    assert _factor(1, warmup_steps=0) == pytest.approx(1 - 1 / 100)
    assert _factor(50, warmup_steps=0) == pytest.approx(0.5)


def test_scheduler_drives_optimizer_lr():
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, Optimizer(lr=1e-2, implementation="for-loop"))
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=4, decay_type="linear"), total_steps=8)
    seen = []
    for _ in range(8):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [1e-2 * _factor(s, total_steps=8, warmup_steps=4) for s in range(8)]
    assert seen == pytest.approx(expected)
    assert seen[3] == pytest.approx(1e-2) and seen[4] == pytest.approx(1e-2)


def test_decay_ratio_rounds_as_torchtitan():
    # round(0.1 * 5) = round(0.5) = 0 (Python rounds half to even): no decay at all, as in TorchTitan.
    kw = dict(total_steps=5, warmup_steps=0, decay_ratio=0.1, min_lr_factor=0.0)
    assert [_factor(s, **kw) for s in range(5)] == pytest.approx([1, 1, 1, 1, 1])
    # round(0.3 * 5) = round(1.5) = 2: decay over steps 4 and (virtual) 5.
    kw["decay_ratio"] = 0.3
    assert [_factor(s, **kw) for s in range(5)] == pytest.approx([1, 1, 1, 1, 0.5])


def test_warmup_longer_than_run_is_cut():
    assert [_factor(s, total_steps=4, warmup_steps=200) for s in range(4)] == pytest.approx(
        [0.25, 0.5, 0.75, 1.0])


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
@pytest.mark.parametrize(
    "total, warmup, decay_ratio, min_lr",
    [(60, 10, None, 0.1), (60, 0, 0.3, 0.0), (60, 10, 0.3, 0.1), (10, 2, 0.8, 0.0), (10, 2, 0.8, 0.25),
     (1000, 200, None, 0.0), (7, 3, 0.5, 0.1), (9, 0, None, 0.0), (5, 5, 0.2, 0.0), (20, 3, 1.0, 0.1),
     (13, 4, 0.25, 0.05), (3, 1, 0.0, 0.0)],
)
def test_lr_of_every_step_equals_torchtitans_formula(decay_type, total, warmup, decay_ratio, min_lr):
    """The LR the optimizer uses at every step equals TorchTitan's schedule for the same
    lr_scheduler keys (warmup_steps, decay_ratio, decay_type, min_lr_factor), configurations of its
    own train_configs (10 steps, warmup 2, decay 0.8; 1000 steps, warmup 200) among them."""
    peak = 2e-3
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, Optimizer(lr=peak, implementation="for-loop"))
    sched = build_lr_scheduler(
        opt, LRScheduler(warmup_steps=warmup, decay_ratio=decay_ratio, decay_type=decay_type,
                         min_lr_factor=min_lr), total_steps=total)
    used = []
    for _ in range(total):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [peak * _torchtitan_factor(s, total=total, warmup=warmup, decay_ratio=decay_ratio,
                                          kind=decay_type, min_lr=min_lr) for s in range(total)]
    assert used == pytest.approx(expected, rel=1e-12, abs=0)


@pytest.mark.parametrize("name, cls", [("AdamW", torch.optim.AdamW), ("Adam", torch.optim.Adam)])
@pytest.mark.parametrize("impl", ["foreach", "for-loop", "fused"])
def test_build_optimizer(name, cls, impl):
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, Optimizer(name=name, lr=1e-3, beta1=0.8, beta2=0.9,
                                           weight_decay=0.05, implementation=impl))
    assert isinstance(opt, cls)
    group = opt.param_groups[0]
    assert group["betas"] == (0.8, 0.9) and group["weight_decay"] == 0.05
    model(torch.randn(2, 4)).sum().backward()
    opt.step()


def test_total_steps_keeps_a_longer_runs_schedule():
    """lr_scheduler.total_steps: a 10-step run on the schedule of a 100-step one (the plan's
    schedule_steps); shorter than the run is refused (the lr would go below the minimum)."""
    from torchtitan_lite.config import ConfigError, load_job_config
    from torchtitan_lite.job import plan_job

    assert plan_job(load_job_config(["--training.steps", "10", "--lr_scheduler.total_steps", "100"]),
                    world_size=1).schedule_steps == 100
    assert plan_job(load_job_config(["--training.steps", "10"]), world_size=1).schedule_steps == 10
    with pytest.raises(ConfigError, match=r"lr_scheduler.total_steps: invalid value 5; expected at least "
                                          r"training.steps = 10"):
        load_job_config(["--training.steps", "10", "--lr_scheduler.total_steps", "5"])
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, Optimizer(lr=1.0, implementation="for-loop"))
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=4), total_steps=100)
    used = []
    for _ in range(10):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert used == pytest.approx([_factor(s, total_steps=100, warmup_steps=4) for s in range(10)])


def test_weight_decay_skips_norms_and_biases_unless_asked():
    from torchtitan_lite.models.llama3 import LLAMA3_FLAVORS, Transformer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), Transformer(LLAMA3_FLAVORS["tiny"]))
    opt = build_optimizer(model, Optimizer(weight_decay=0.1))
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    plain_names = sorted(names[id(p)] for p in plain["params"])
    assert all(p.ndim == 1 for p in plain["params"])
    assert "0.bias" in plain_names and "1.weight" in plain_names and "2.norm.weight" in plain_names
    assert any(n.endswith("attention_norm.weight") for n in plain_names)
    assert {names[id(p)] for p in decayed["params"]} >= {"0.weight", "2.tok_embeddings.weight", "2.output.weight"}
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))

    # The decay really is not applied: with zero gradients AdamW leaves a norm scale alone
    # and shrinks a weight matrix.
    linear, norm = torch.nn.Linear(3, 3, bias=False), torch.nn.LayerNorm(3, bias=False)
    both = torch.nn.Sequential(linear, norm)
    before = [p.detach().clone() for p in both.parameters()]
    opt = build_optimizer(both, Optimizer(lr=0.1, weight_decay=0.5, implementation="for-loop"))
    for p in both.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.allclose(linear.weight, before[0] * (1 - 0.1 * 0.5))
    assert torch.equal(norm.weight, before[1])

    everything = build_optimizer(model, Optimizer(weight_decay=0.1, weight_decay_norms_and_biases=True))
    assert len(everything.param_groups) == 1 and everything.param_groups[0]["weight_decay"] == 0.1


def _local_step_rank() -> dict[str, Any]:
    """Two copies of an FSDP2-sharded stack (one over 2 ranks, rows split unevenly), each
    stepped 3 times by AdamW, AMSGrad-Adam and the fused AdamW: ours (:func:`build_optimizer`)
    against ``torch.optim``'s over DTensors; the foreach ops DTensor had to plan for each."""
    import copy
    from unittest import mock

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from torchtitan_lite.distributed import destroy_distributed, fsdp_mesh, init_distributed

    device = torch.device("cpu")
    init_distributed(device)
    mesh = fsdp_mesh(device)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 3))
    propagator = DTensor._op_dispatcher.sharding_propagator
    results: dict[str, Any] = {}
    cases = (("adamw", "AdamW", {}, "foreach"), ("amsgrad", "Adam", {"amsgrad": True}, "foreach"),
             ("fused", "AdamW", {}, "fused"))
    for label, name, extra, impl in cases:
        ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
        for model in (ours, theirs):
            fully_shard(model, mesh=mesh)
        opt = build_optimizer(ours, Optimizer(name=name, lr=1e-2, weight_decay=0.1, implementation=impl))
        for group in opt.param_groups:
            group.update(extra)
        twin = dict(zip(map(id, ours.parameters()), theirs.parameters(), strict=True))
        ref = getattr(torch.optim, name)([{**{k: v for k, v in g.items() if k != "params"},
                                           "params": [twin[id(p)] for p in g["params"]]} for g in opt.param_groups])
        planned = {"ours": set(), "theirs": set()}
        for step in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            for who, model, optimizer in (("ours", ours, opt), ("theirs", theirs, ref)):
                model(x).square().sum().backward()
                real, seen = propagator.propagate_op_sharding_non_cached, planned[who]
                with mock.patch.object(propagator, "propagate_op_sharding_non_cached",
                                       side_effect=lambda schema, seen=seen, real=real: (
                                           seen.add(str(schema.op)), real(schema))[1]):
                    optimizer.step()
                optimizer.zero_grad()
        pairs = list(zip(ours.parameters(), theirs.parameters(), strict=True))
        same = all(torch.equal(a.to_local(), b.to_local()) for a, b in pairs)
        states = [(type(v).__name__, getattr(v, "placements", None) == p.placements)
                  for p in ours.parameters() for k, v in opt.state[p].items() if k != "step"]
        same_state = all(torch.equal(opt.state[a][k].to_local(), ref.state[b][k].to_local())
                         for a, b in pairs for k in opt.state[a] if k != "step")
        results[label] = {"same": same, "same_state": same_state, "states": states,
                          "planned": {k: sorted(op for op in v if "foreach" in op or "fused" in op)
                                      for k, v in planned.items()}}
    destroy_distributed()
    return results


@pytest.mark.slow
def test_sharded_adam_steps_the_local_shards_bit_for_bit():
    """FSDP2 over 2 ranks: our Adam/AdamW (foreach, AMSGrad, fused) step the shards' local
    tensors: parameters and state bit for bit those of ``torch.optim`` stepping the DTensors, the
    state still DTensors placed like their parameters (what checkpoints save), and not one foreach
    or fused op planned by DTensor (``torch.optim``'s plans several per step)."""
    for rank in run_distributed(_local_step_rank, 2):
        for label, got in rank.items():
            assert got["same"] and got["same_state"], (label, got)
            assert got["states"] and all(kind == "DTensor" and placed for kind, placed in got["states"]), got
            assert got["planned"]["ours"] == [] and got["planned"]["theirs"], (label, got["planned"])


def _eight_bit_run(argv: list[str]) -> int:
    """Train (the allocator's peak measured at the second step); returns the peak."""
    import functools

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.memory.measure import trainer_step_peak
    from torchtitan_lite.trainer import Trainer

    peak, trainer = trainer_step_peak(functools.partial(Trainer, load_job_config(argv)))
    try:
        trainer.train()
    finally:
        trainer.close()
    return peak


@pytest.mark.scenario  # (torchao compiles its 8-bit step for every parameter shape: minutes on a CPU)
@pytest.mark.slow
def test_adamw8bit_trains_like_adamw_resumes_exactly_and_is_estimated(tmp_path) -> None:
    """The debug model's shape (6 blocks of width 256), fp32, 2 ranks (FSDP2), 6 steps:
    ``optimizer.name = "AdamW8bit"`` (torchao's, its moments in 8-bit blocks) gives AdamW's losses
    within 1e-3; a run resumed from its step-3 checkpoint (the 8-bit moments through DCP)
    repeats steps 4-6 exactly; the estimate of a step is within -3% / +10% of the allocator's peak,
    which is below AdamW's."""
    import shutil

    from tests.conftest import TINY_ARGS
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.job import plan_job
    from torchtitan_lite.memory.estimate import estimate_memory, job_estimate_shape

    def argv(name: str, *extra: str) -> list[str]:
        return [*TINY_ARGS, "--model.flavor", "debugmodel", "--training.steps", "6", "--training.seq_len", "256",
                "--job.dump_folder", str(tmp_path / name), "--metrics.no-enable_tensorboard",
                "--validation.no-enable", "--checkpoint.enable", "--checkpoint.interval", "3", *extra]

    from tests.dist_utils import read_jsonl, train_history

    def losses(name: str) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "loss" in r}

    eight = argv("eight", "--optimizer.name", "AdamW8bit")
    ours = max(run_distributed(_eight_bit_run, 2, eight, timeout=900))
    theirs = max(run_distributed(_eight_bit_run, 2, argv("adamw"), timeout=900))
    for step, loss in losses("adamw").items():
        assert abs(losses("eight")[step] - loss) <= 1e-3 * loss, (step, losses("eight"), losses("adamw"))
    (tmp_path / "resumed" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "eight" / "checkpoint" / "step-3", tmp_path / "resumed" / "checkpoint" / "step-3")
    resumed = run_distributed(train_history, 2, argv("resumed", "--optimizer.name", "AdamW8bit"), timeout=900)[0]
    assert {h["step"]: h["loss"] for h in resumed} == {s: losses("eight")[s] for s in (4, 5, 6)}
    plan = plan_job(load_job_config(eight), world_size=2)
    estimate = estimate_memory(plan.spec, plan.model_args, job_estimate_shape(plan),
                               reshard_after_forward_mode=plan.shape.reshard_after_forward_mode)
    error = (estimate.device_peak - ours) / ours
    print(f"AdamW8bit: measured {ours / 2**20:.2f} MiB, estimated {estimate.device_peak / 2**20:.2f} MiB "
          f"({error:+.2%}); AdamW measured {theirs / 2**20:.2f} MiB")
    assert -0.03 <= error <= 0.10
    assert ours < theirs
