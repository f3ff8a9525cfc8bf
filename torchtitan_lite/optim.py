"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from torchtitan_lite.config.schema import LRScheduler as LRSchedulerConfig
from torchtitan_lite.config.schema import Optimizer as OptimizerConfig
from torchtitan_lite.dtypes import import_torchao
from torchtitan_lite.errors import ConfigError

__all__ = ["build_optimizer", "build_lr_scheduler", "lr_factor", "load_lr_scheduler_position", "param_groups"]


def param_groups(model: nn.Module, *, weight_decay: float, decay_norms_and_biases: bool) -> list[dict]:
    """Two parameter groups: weight matrices and embeddings (decayed), and 1-D parameters
    (norm scales, biases: decayed only when ``decay_norms_and_biases``). Empty groups are dropped.

    Dimensions are those of the full parameter (a sharded DTensor keeps its global shape).
    """
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 or decay_norms_and_biases else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """Adam, AdamW or torchao's AdamW8bit over ``model``'s parameters (the sharded fp32 ones under
    FSDP)."""
    classes = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}
    impl = {
        "foreach": {"foreach": True, "fused": False},
        "fused": {"foreach": False, "fused": True},
        "for-loop": {"foreach": False, "fused": False},
    }[cfg.implementation]
    groups = param_groups(
        model, weight_decay=cfg.weight_decay, decay_norms_and_biases=cfg.weight_decay_norms_and_biases
    )
    if cfg.name == "AdamW8bit":
        try:
            AdamW8bit = import_torchao("torchao.optim").AdamW8bit
        except ImportError:
            raise ConfigError("optimizer.name: invalid value 'AdamW8bit'; it is torchao's: pip install "
                              "'torchao>=0.16', or 'AdamW'") from None
        # (torchao's step handles DTensor shards itself, one parameter at a time, compiled)
        return AdamW8bit(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if cfg.implementation == "fused":
        supported = _fused_devices()
        devices = {p.device.type for g in groups for p in g["params"]}
        unsupported = sorted(devices - set(supported))
        if unsupported:
            raise ConfigError(
                f"optimizer.implementation: invalid value 'fused' for parameters on "
                f"{', '.join(unsupported)}; fused kernels exist for {', '.join(supported)} "
                "(use 'foreach')"
            )
    return _LOCAL_STEP[classes[cfg.name]](
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **impl,
    )


def _alike(tensors: list[list[Any]]) -> bool:
    """Whether, at every index, the parameter, its gradient and its state tensors are DTensors
    on the parameter's mesh with its placements and local shape, or all plain tensors."""
    from torch.distributed.tensor import DTensor

    params, *others = tensors
    for i, param in enumerate(params):
        row = [other[i] for other in others if i < len(other)]
        if not isinstance(param, DTensor):
            if any(isinstance(t, DTensor) for t in row):
                return False
            continue
        for t in row:
            if not (isinstance(t, DTensor) and t.device_mesh == param.device_mesh
                    and t.placements == param.placements and t._local_tensor.shape == param._local_tensor.shape):
                return False
    return True


class _LocalShardStep:
    """Adam's step on the shards' local tensors.

    Adam is elementwise, so stepping a sharded parameter is stepping its local shard with the
    local shards of its gradient and state, which is what DTensor's dispatch of each foreach op
    ends in. Handing the local tensors to the update directly skips that dispatch: DTensor works
    out the sharding of every foreach op over every parameter of the group (tens of
    milliseconds each, the first step of every run: a third of a short CPU job's time), and
    every later step still hashes each tensor's placement. The state stays the DTensors that
    checkpoints save and reshard: the update writes into their local tensors in place. A group
    where any gradient or state tensor differs from its parameter in mesh, placements or local
    shape (none does under FSDP2, tensor or expert parallel) steps through DTensor as before."""

    def _init_group(self, group: dict[str, Any], *lists: list[Any]) -> Any:
        found: list[list[Any]] = [[] for _ in lists]
        has_complex = super()._init_group(group, *found)  # (creates the state a parameter lacks)
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, _steps = found
        if _alike([params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs]):
            from torch.distributed.tensor import DTensor

            for tensors in found[:5]:
                tensors[:] = [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]
        for out, tensors in zip(lists, found, strict=True):
            out.extend(tensors)
        return has_complex


class _LocalShardAdam(_LocalShardStep, torch.optim.Adam):
    """``torch.optim.Adam`` stepping the local shards (:class:`_LocalShardStep`)."""


class _LocalShardAdamW(_LocalShardStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` stepping the local shards (:class:`_LocalShardStep`)."""


_LOCAL_STEP: dict[type, type] = {torch.optim.Adam: _LocalShardAdam, torch.optim.AdamW: _LocalShardAdamW}


def _fused_devices() -> list[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # pragma: no cover - private helper moved
        return ["cuda", "cpu"]
    return list(_get_fused_kernels_supported_devices())


def lr_factor(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    decay_ratio: float | None,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """Multiplier of the peak LR for 0-based optimizer step ``step``: TorchTitan's
    warmup-stable-decay schedule, value for value.

    Warmup: ``(step + 1) / W`` for the first ``W = min(warmup_steps, total_steps)`` steps. Decay
    spans ``D = round(decay_ratio · total_steps)`` steps (at most ``total_steps - W``; all the
    steps after warmup when ``decay_ratio`` is unset) and ends one step *after* the run, at the
    virtual step ``total_steps``, so that the last step does not run at the minimum: it starts at
    ``s0 = total_steps + 1 - D`` with progress ``p = (step + 1 - s0) / D``; the curve is
    ``linear`` 1 - p, ``sqrt`` 1 - √p or ``cosine`` ½(1 + cos πp), mapped to ``min + (1 - min) ·
    curve``. Between warmup and ``s0`` (at least one step) the factor is 1.
    """
    warmup = min(warmup_steps, total_steps)
    decay_steps = total_steps - warmup if decay_ratio is None else round(total_steps * decay_ratio)
    decay_steps = min(decay_steps, total_steps - warmup)
    decay_start = total_steps + 1 - decay_steps
    if step < warmup:
        return (step + 1) / warmup
    if step < decay_start:
        return 1.0
    progress = (step + 1 - decay_start) / decay_steps
    if decay_type == "linear":
        curve = 1.0 - progress
    elif decay_type == "sqrt":
        curve = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        curve = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr_scheduler.decay_type: unknown value {decay_type!r}")
    return min_lr_factor + (1.0 - min_lr_factor) * curve


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, *, total_steps: int
) -> LambdaLR:
    """``LambdaLR`` following :func:`lr_factor` over ``total_steps`` steps (the job plan's
    ``schedule_steps``); call ``step()`` once after each optimizer step."""
    return LambdaLR(
        optimizer,
        functools.partial(
            lr_factor,
            total_steps=total_steps,
            warmup_steps=cfg.warmup_steps,
            decay_ratio=cfg.decay_ratio,
            decay_type=cfg.decay_type,
            min_lr_factor=cfg.min_lr_factor,
        ),
    )


def load_lr_scheduler_position(scheduler: LambdaLR, optimizer: torch.optim.Optimizer,
                               state: dict[str, Any]) -> None:
    """Resume ``scheduler`` (built from this run's config) at the position saved in ``state``:
    the step count comes from the checkpoint, the peak lr and the schedule's shape from the
    config, and the optimizer's lr is set to the configured schedule's value at that step."""
    configured = list(scheduler.base_lrs)
    scheduler.load_state_dict(state)
    scheduler.base_lrs = configured
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(configured, scheduler.lr_lambdas, strict=True)]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs
