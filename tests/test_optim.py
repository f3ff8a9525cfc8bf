"""LR schedule values against the formulas, and the optimizer built from config."""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan_lite.config import LRScheduler, Optimizer
from torchtitan_lite.optim import build_lr_scheduler, build_optimizer, lr_factor


def _factor(step, **kw):
    args = dict(total_steps=100, warmup_steps=10, decay_ratio=None, decay_type="linear",
                min_lr_factor=0.0)
    args.update(kw)
    return lr_factor(step, **args)


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
    # No stable phase: decay spans steps 10..99 (90 steps).
    for step in (10, 30, 54, 99):
        progress = (step - 10 + 1) / 90
        expected = min_lr + (1 - min_lr) * curves[decay_type](progress)
        assert _factor(step, decay_type=decay_type, min_lr_factor=min_lr) == pytest.approx(expected)
    assert _factor(99, decay_type=decay_type, min_lr_factor=min_lr) == pytest.approx(min_lr)


def test_warmup_stable_decay():
    # decay_ratio 0.2 of 100 steps: warmup 0..9, stable 10..79, decay 80..99.
    kw = dict(decay_ratio=0.2, decay_type="cosine", min_lr_factor=0.0)
    assert all(_factor(s, **kw) == 1.0 for s in range(10, 80))
    assert _factor(80, **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi * 1 / 20)))
    assert _factor(89, **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi * 10 / 20)))
    assert _factor(99, **kw) == pytest.approx(0.0)


def test_no_warmup():
    assert _factor(0, warmup_steps=0) == pytest.approx(1 - 1 / 100)
    assert _factor(49, warmup_steps=0) == pytest.approx(0.5)


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
    assert seen[3] == pytest.approx(1e-2)


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


def test_small_decay_ratio_still_decays():
    # 10% of 5 steps rounds to 0; a decay that was asked for keeps at least one step.
    kw = dict(total_steps=5, warmup_steps=0, decay_ratio=0.1, min_lr_factor=0.0)
    assert [_factor(s, **kw) for s in range(5)] == pytest.approx([1, 1, 1, 1, 0])


def test_warmup_longer_than_run_is_cut():
    assert [_factor(s, total_steps=4, warmup_steps=200) for s in range(4)] == pytest.approx(
        [0.25, 0.5, 0.75, 1.0])


# The schedule written out once more, step by step, independently of lr_factor's code.
def _reference_factor(step, *, total, warmup, stable_end, kind, min_lr):
    if step < warmup:
        return (step + 1) / warmup
    if step < stable_end:
        return 1.0
    p = (step - stable_end + 1) / (total - stable_end)
    curve = {"linear": 1 - p, "sqrt": 1 - math.sqrt(p), "cosine": 0.5 * (1 + math.cos(math.pi * p))}[kind]
    return min_lr + (1 - min_lr) * curve


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
@pytest.mark.parametrize("warmup", [0, 10])
@pytest.mark.parametrize("decay_ratio", [None, 0.3])
def test_scheduler_values_at_chosen_steps(decay_type, warmup, decay_ratio):
    """The LR the optimizer actually uses at chosen steps, for every decay type, with and without
    warmup and with and without a stable phase (decay_ratio 0.3 of 60 steps: the last 18)."""
    total, peak, min_lr = 60, 2e-3, 0.1
    stable_end = warmup if decay_ratio is None else total - 18
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
    chosen = sorted({0, 4, 9, 10, 11, 25, 41, 42, 43, 50, 59} | ({warmup - 1} if warmup else set()))
    for step in chosen:
        expected = peak * _reference_factor(step, total=total, warmup=warmup, stable_end=stable_end,
                                            kind=decay_type, min_lr=min_lr)
        assert used[step] == pytest.approx(expected, rel=1e-12), (step, used[step], expected)
    assert used[-1] == pytest.approx(peak * min_lr)
    if warmup:
        assert used[warmup - 1] == pytest.approx(peak)
    if decay_ratio is not None:
        assert all(lr == pytest.approx(peak) for lr in used[warmup:stable_end])


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
