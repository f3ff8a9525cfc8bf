"""Group-relative policy optimisation and its fixes (GRPO, Dr. GRPO, DAPO, BNPO, CISPO), with the
definitions and names of TRL's ``GRPOTrainer`` (1.16).

A step's rollouts: each prompt answered ``num_generations`` times (a group); every completion gets
a reward (the weighted sum of the reward functions', NaN where none applies) and an advantage
``A = (r − mean of its group) / (std + 1e-4)`` (the std of its group, of the global batch, or none:
:data:`SCALES`; NaN rewards left out of both, their advantage 0). Per completion token, with the
log-probability ``logp`` under the policy (logits divided by the sampling temperature), ``old`` under
the policy that sampled it (``logp`` itself, without gradient, on the first of ``num_iterations``
steps) and the importance ratio ``ρ = exp(logp − old)``:

- ``grpo``, ``dr_grpo``, ``dapo``, ``bnpo``: ``−min(ρ·A, clip(ρ, 1 − ε, 1 + ε_high)·A)``;
- ``cispo``: ``−min(ρ, ε_high)·A·logp`` (the weight without gradient);
- with ``beta`` > 0, plus ``beta·(exp(ref − logp) − (ref − logp) − 1)`` (the k3 estimate of the KL
  divergence to the reference, ``ref`` its log-probability), times ``ρ`` with ``kl_bias_correction``
  (TRL's default: the reverse KL's unbiased gradient).

The step's loss averages them (:data:`LOSS_TYPES`): ``grpo`` each completion's token mean, then the
mean over the global batch's completions; ``bnpo`` and ``dapo`` the mean over every completion
token of the global batch; ``dr_grpo`` their sum over ``completions × max_completion_length``. The
averages are over the global batch whatever the ranks and micro-batches (TRL's equal them with one
process and no gradient accumulation; its ``bnpo`` averages each micro-batch on its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LOSS_TYPES", "SCALES", "GRPOSetup", "aggregate", "group_advantages", "nanstd", "policy_losses",
           "sampling_weights"]

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo")
SCALES = ("group", "batch", "none")


@dataclass(frozen=True)
class GRPOSetup:
    """A job's ``[grpo]``, resolved by the plan."""

    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_strings: tuple[str, ...] = ()
    generation_batch_size: int = 0
    """Completions per generation batch on a rank (0: all of a step's at once)."""
    reward_functions: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] = ()
    scale_rewards: str = "group"
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    kl_bias_correction: bool = True
    reference: str | None = None
    """With ``beta`` > 0: ``adapters_off`` or ``copy`` (as DPO's)."""
    num_iterations: int = 1
    mask_truncated_completions: bool = False
    importance_sampling: str = "sequence_mask"
    importance_sampling_max: float = 3.0
    given: bool = False
    """The completions come from ``grpo.rollouts_path`` (nothing is generated)."""

    @property
    def logit_temperature(self) -> float:
        """What the training logits are divided by (the sampling temperature; 1 for greedy)."""
        return self.temperature if self.temperature > 0 else 1.0


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation ignoring NaNs, with Bessel's correction (NaN below 2 values), as TRL's."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = variance.sqrt()
    return std.squeeze(dim) if dim is not None else std.reshape(())


def group_advantages(rewards: torch.Tensor, group: int, scale: str, *,
                     batch_rewards: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage (fp32, 0 where its reward is NaN) from ``rewards`` ``(n,)``, groups
    of ``group`` consecutive completions; ``batch_rewards``: the global batch's (``scale = "batch"``;
    default ``rewards``). Also whether each completion's std is 0 (for the metric)."""
    if scale not in SCALES:
        raise ValueError(f"scale_rewards: {scale!r} is not one of {SCALES}")
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        whole = rewards if batch_rewards is None else batch_rewards
        std = (nanstd(whole) if whole.numel() > 1 else torch.zeros(())).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(group) if group > 1 else torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def policy_losses(logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, setup: GRPOSetup,
                  ref: torch.Tensor | None = None,
                  weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token losses ``(rows, seq)`` of :data:`LOSS_TYPES` (the module's text) and, per token,
    the KL estimate and whether the ratio was clipped low, high or at all (cispo: capped).
    ``weight``: the sampler's importance correction of the policy loss (:func:`sampling_weights`),
    before the KL term is added."""
    ratio = torch.exp(logp - old)
    a = advantages.unsqueeze(1)
    parts: dict[str, torch.Tensor] = {}
    if setup.loss_type == "cispo":
        loss = -torch.clamp(ratio, max=setup.epsilon_high).detach() * a * logp
        parts["clip_high"] = ((ratio > setup.epsilon_high) & (a > 0)).float()
        parts["clip_low"] = torch.zeros_like(ratio)
    else:
        clipped = torch.clamp(ratio, 1 - setup.epsilon, 1 + setup.epsilon_high)
        loss = -torch.min(ratio * a, clipped * a)
        parts["clip_low"] = ((ratio < 1 - setup.epsilon) & (a < 0)).float()
        parts["clip_high"] = ((ratio > 1 + setup.epsilon_high) & (a > 0)).float()
    parts["clip_region"] = ((parts["clip_low"] + parts["clip_high"]) > 0).float()
    if weight is not None:
        loss = loss * weight
    if setup.beta and ref is not None:
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        if setup.kl_bias_correction:
            kl = kl * ratio
        loss = loss + setup.beta * kl
        parts["kl"] = kl.detach()
    return loss, parts


def sampling_weights(policy: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, *, mode: str,
                     cap: float) -> torch.Tensor:
    """The importance correction of rollouts sampled by another engine (TRL's for vLLM): the
    ratio of the trainer's probability (``policy``, the log-probabilities at rollout time) to the
    sampler's (``sampling``), per token, or per completion (``sequence_*``: the product over its
    counted tokens, ``mask``), then truncated at ``cap`` or (``*_mask``) zero where above it;
    ``(rows, seq)`` or ``(rows, 1)``. A token the sampler gave no log-probability (NaN) counts 1."""
    diff = torch.nan_to_num((policy - sampling) * mask, nan=0.0)
    log_ratio = diff.sum(dim=-1, keepdim=True) if mode.startswith("sequence") else diff
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, max=cap)
    return ratio.masked_fill(ratio > cap, 0.0)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, setup: GRPOSetup, *, completions: int,
              tokens: float, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token losses of some rows ``(rows, seq)`` (``mask``: the counted tokens) as their part
    of the step's loss (:data:`LOSS_TYPES`): the global batch has ``completions`` completions and
    ``tokens`` counted tokens over all ranks. ``lengths``: each row's counted tokens (default
    ``mask``'s; with context parallel, of the whole row, ``mask`` being this rank's share)."""
    if setup.loss_type == "grpo":
        counted = mask.sum(-1) if lengths is None else lengths.to(mask.dtype)
        return ((loss * mask).sum(-1) / counted.clamp(min=1.0)).sum() / completions
    if setup.loss_type == "dr_grpo":
        return (loss * mask).sum() / (completions * setup.max_completion_length)
    return (loss * mask).sum() / tokens  # dapo, bnpo, cispo
