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

import base64
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_lite.data.prompts import PromptRow
from torchtitan_lite.data.windows import IGNORE_INDEX
from torchtitan_lite.dpo import as_reference
from torchtitan_lite.errors import DataError
from torchtitan_lite.rl.rewards import RewardFunction, call_reward, metric_names
from torchtitan_lite.training.objectives import StepResult
from torchtitan_lite.training.runner import MicroBatch, MicroBatchRunner

__all__ = ["LOSS_TYPES", "SCALES", "GRPOObjective", "GRPOSetup", "Rollouts", "RowsLoss", "aggregate",
           "completion_rows", "generation_seed", "group_advantages", "policy_backward", "policy_losses",
           "rows_backward", "rows_logps", "sampling_weights", "score_completions", "token_logps", "weighted_rewards"]

logger = logging.getLogger("torchtitan_lite")

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


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
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
        std = (_nanstd(whole) if whole.numel() > 1 else torch.zeros(())).expand_as(rewards)
    else:
        std = _nanstd(grouped, dim=1).repeat_interleave(group) if group > 1 else torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def token_logps(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each label's log-probability under ``logits / temperature`` ``(rows, seq)`` in fp32 (0 where
    the label is ignored), a row at a time; with ``entropy``, each position's entropy (no gradient).
    Logits split over the vocabulary (tensor parallel) are gathered first."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    rows, entropies = [], []
    for r in range(logits.shape[0]):
        logp = torch.log_softmax(logits[r].float() / temperature, dim=-1)
        label = labels[r]
        picked = logp.gather(-1, label.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        rows.append(torch.where(label == IGNORE_INDEX, torch.zeros_like(picked), picked))
        if entropy:
            with torch.no_grad():
                entropies.append(-(logp.exp() * logp).sum(-1))
    return torch.stack(rows), torch.stack(entropies) if entropy else None


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


def _parts(rows: int, local_batch_size: int) -> list[slice]:
    return [slice(i, min(i + local_batch_size, rows)) for i in range(0, rows, local_batch_size)]


def rows_logps(runner: MicroBatchRunner, inputs: torch.Tensor, labels: torch.Tensor, *, local_batch_size: int,
               temperature: float = 1.0, model: nn.Module | None = None) -> torch.Tensor:
    """Each label's log-probability ``(rows, seq)`` (0 where ignored) under ``model`` (default the
    runner's policy; e.g. a reference) at ``temperature``, ``local_batch_size`` rows per forward,
    without gradient; whole rows on every rank (with context parallel, gathered from the ranks'
    shares)."""
    out = []
    with torch.no_grad():
        for part in _parts(inputs.shape[0], local_batch_size):
            placed = runner.place(MicroBatch(inputs[part], labels[part]))
            chunks: dict[int, torch.Tensor] = {}

            def keep(i: int, logits: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None,
                     chunks: dict[int, torch.Tensor] = chunks) -> torch.Tensor:
                logp, _ = token_logps(logits, labels, temperature=temperature)
                chunks[i] = runner.whole(logp.detach())
                return logp.sum()

            runner.rows_forward(placed, keep, model)  # (with a pipeline: on the last stage's ranks)
            rows = torch.cat([chunks[i] for i in sorted(chunks)]) if chunks else torch.zeros(
                part.stop - part.start, inputs.shape[1], device=runner.device)
            out.append(runner.stages_sum(rows))
    return torch.cat(out)


RowsLoss = Callable[[slice, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss_fn(part, logp, entropy, labels)``: rows ``part``'s share of the step's loss (a scalar),
from their label log-probabilities (with gradient), entropies and labels ``(rows, seq)``."""


def rows_backward(runner: MicroBatchRunner, inputs: torch.Tensor, labels: torch.Tensor, loss_fn: RowsLoss, *,
                  local_batch_size: int, ranks: int, temperature: float = 1.0) -> torch.Tensor:
    """Forward and backward of this rank's rows, ``local_batch_size`` at a time: each part's label
    log-probabilities at ``temperature`` go to ``loss_fn``, whose value's gradient accumulates
    (times ``ranks``: FSDP averages over the data-parallel ranks, and the parts of all ranks add
    up to the step's loss). Returns the detached sum of the parts, fp64 ``(1,)``."""
    parts = _parts(inputs.shape[0], local_batch_size)
    total = torch.zeros(1, dtype=torch.float64, device=runner.device)
    for part in parts:
        placed = runner.place(MicroBatch(inputs[part], labels[part]))

        def part_loss(i: int, logits: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None,
                      first: int = part.start) -> torch.Tensor:
            # (rows i·k … of the part, k = the rows the layout runs at once: all, or a pipeline micro-batch's)
            rows = slice(first + i * logits.shape[0], first + (i + 1) * logits.shape[0])
            logp, entropy = token_logps(logits, labels, temperature=temperature, entropy=True)
            assert entropy is not None
            loss = loss_fn(rows, logp, entropy, labels)
            total.add_(loss.detach().double())
            return loss * ranks

        runner.rows_forward_backward(placed, part_loss, accumulation=len(parts), labels=labels[part])
    return runner.stages_sum(total)


def score_completions(functions: list[tuple[str, RewardFunction]], prompts: list[PromptRow],
                      completions: list[list[int]], *, num_generations: int, decode: Callable[[list[int]], str],
                      max_completion_length: int) -> torch.Tensor:
    """Every reward function's reward of each completion, ``(completions, functions)`` fp32 (NaN:
    None), with TRL's arguments (:mod:`torchtitan_lite.rl.rewards`): ``prompts[i]`` answered by
    ``completions[i * num_generations : (i + 1) * num_generations]``, decoded by ``decode``."""
    repeat = [row for row in prompts for _ in range(num_generations)]
    texts = [decode(ids) for ids in completions]
    shown = [[{"role": "assistant", "content": t}] if row.conversational else t
             for row, t in zip(repeat, texts, strict=True)]
    columns = {k: [row.columns.get(k) for row in repeat] for k in sorted({k for row in prompts for k in row.columns})}
    columns.update(completion_ids=completions, max_completion_length=max_completion_length)
    values = [call_reward(name, fn, [row.prompt for row in repeat], shown, columns) for name, fn in functions]
    return torch.tensor(values, dtype=torch.float32).T.reshape(len(repeat), len(values))


def weighted_rewards(per_function: torch.Tensor, weights: Sequence[float] = ()) -> torch.Tensor:
    """Each completion's reward: the ``weights``-weighted sum of its functions' (default 1 each),
    NaN where none scored it (its advantage is then 0)."""
    w = torch.tensor(list(weights) if weights else [1.0] * per_function.shape[1])
    rewards = (per_function * w.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_function).all(dim=1)] = float("nan")
    return rewards


def generation_seed(seed: int, batch: int, dp_rank: int) -> int:
    """The sampling seed of rollout batch ``batch`` (from 0) on data-parallel rank ``dp_rank`` of a
    job seeded ``seed`` (``debug.seed``): every rank of one data-parallel rank (tensor parallel)
    samples alike, the others differently."""
    return (seed * 1_000_003 + batch) * 4099 + dp_rank


def completion_rows(prompts: list[list[int]], completions: list[list[int]], *, seq_len: int, pad_id: int,
                    stop_ids: tuple[int, ...], max_completion_length: int, mask_truncated: bool = False,
                    vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, list[bool], list[int]]:
    """Each completion after its prompt (``prompts[i]`` the prompt of ``completions[i]``) as one
    row of ``seq_len`` inputs and labels, right-padded with ``pad_id``: the inputs are the whole
    sequence (where it fits: its last token has no label, but a mixture of experts routes it, as
    transformers does), the labels the completion's tokens (its first ``max_completion_length``),
    none for a truncated one with ``mask_truncated``. Also whether each is truncated (its last
    token not in ``stop_ids``) and its length. A :class:`DataError` line for a row longer than
    ``seq_len + 1`` tokens or a token beyond ``vocab_size``."""
    n = len(completions)
    inputs = torch.full((n, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long)
    truncated, lengths = [], []
    for i, (prompt, ids) in enumerate(zip(prompts, completions, strict=True)):
        ids = list(ids)[:max_completion_length]
        cut = not ids or ids[-1] not in stop_ids
        truncated.append(cut)
        lengths.append(len(ids))
        sequence = torch.tensor([*prompt, *ids], dtype=torch.long)
        if vocab_size is not None and int(sequence.max()) >= vocab_size:
            raise DataError(f"grpo: completion {i} has token id {int(sequence.max())}, beyond the model's "
                            f"vocabulary of {vocab_size}")
        if len(sequence) - 1 > seq_len:
            raise DataError(f"grpo: a prompt of {len(prompt)} tokens and a completion of {len(ids)} exceed "
                            f"training.seq_len + 1 = {seq_len + 1}")
        width = len(sequence) - 1
        inputs[i, :min(len(sequence), seq_len)] = sequence[:seq_len]  # (its last token too, as transformers routes it)
        if ids and not (cut and mask_truncated):
            start = len(prompt) - 1  # (the position whose next token is the completion's first)
            labels[i, start:width] = sequence[start + 1:]
    return inputs, labels, truncated, lengths


@dataclass
class Rollouts:
    """This rank's rollouts of one batch of prompts, as the policy steps train on them."""

    inputs: torch.Tensor
    """``(completions, seq_len)``: each prompt then its completion, right-padded."""
    labels: torch.Tensor
    """The next token at each position where it is a completion's (and counted), else ignored."""
    advantages: torch.Tensor
    """``(completions,)`` fp32."""
    old: torch.Tensor | None = None
    """The sampling policy's log-probabilities (``num_iterations`` > 1), ``(completions, seq_len)``."""
    ref: torch.Tensor | None = None
    """The reference's log-probabilities (``beta`` > 0)."""
    weight: torch.Tensor | None = None
    """The sampler's importance correction (:func:`sampling_weights`; given log-probabilities)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The rollouts' metrics (rewards, lengths, generation time), the same on every rank."""
    uses_left: int = 0
    """Steps still to take on them (``num_iterations``)."""


def policy_backward(runner: MicroBatchRunner, rollouts: Rollouts, setup: GRPOSetup, *, completions: int,
                    tokens: float, local_batch_size: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One policy step's forward and backward on this rank's ``rollouts`` (the loss of
    :data:`LOSS_TYPES` over a global batch of ``completions`` completions and ``tokens`` counted
    tokens; ``local_batch_size`` rows per micro-batch; ``ranks`` as :func:`rows_backward`'s).
    Returns this rank's loss sum, fp64 ``(1,)``, and its token sums of the KL, entropy, clipped
    low, high, region and the counted tokens, fp64 ``(6,)`` (what the metrics all-reduce)."""
    device = runner.device
    sums = torch.zeros(6, dtype=torch.float64, device=device)

    def mine(t: torch.Tensor | None, part: slice) -> torch.Tensor | None:
        """Rows ``part`` of whole-row values, this rank's share of them (a per-row value whole)."""
        if t is None:
            return None
        return t[part].to(device) if t.shape[-1] == 1 else runner.share(t[part])

    def loss_fn(part: slice, logp: torch.Tensor, entropy: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = (labels != IGNORE_INDEX).float()
        old = logp.detach() if rollouts.old is None else mine(rollouts.old, part)
        loss, stats = policy_losses(logp, old, rollouts.advantages[part].to(device), setup, mine(rollouts.ref, part),
                                    mine(rollouts.weight, part))
        for i, value in enumerate((stats.get("kl"), entropy, stats["clip_low"], stats["clip_high"],
                                   stats["clip_region"])):
            if value is not None:
                sums[i] += (value * mask).sum().double()
        sums[5] += mask.sum().double()
        lengths = (rollouts.labels[part] != IGNORE_INDEX).sum(-1).to(device)  # (whole rows)
        return aggregate(loss, mask, setup, completions=completions, tokens=tokens, lengths=lengths)

    loss_sum = rows_backward(runner, rollouts.inputs, rollouts.labels, loss_fn, local_batch_size=local_batch_size,
                             ranks=ranks, temperature=setup.logit_temperature)
    return loss_sum, runner.stages_sum(sums)  # (with a pipeline: the last stage's sums on every rank)


class GRPOObjective:
    """GRPO's objective (:class:`~torchtitan_lite.training.objectives.Objective`) over prompts.

    Each batch of prompts (this rank's: a list of :class:`~torchtitan_lite.data.prompts.PromptRow`)
    is answered by ``engine`` (a :class:`~torchtitan_lite.rl.rollout.RolloutEngine`) or, with given
    rollouts, by the rows' own completions; scored by ``rewards`` (name, function) pairs unless the
    rows carry rewards; then trained on for ``num_iterations`` steps (:meth:`needs_batch` is false
    in between). ``ranks``: the data-parallel ranks FSDP averages gradients over (``group``);
    ``global_completions``: the step's completions over all ranks; ``local_batch_size``: completion
    rows per micro-batch; ``seq_len``: the width of a row; ``vocab_size``: the model's."""

    def __init__(self, setup: GRPOSetup, *, engine: Any, rewards: list[tuple[str, RewardFunction]],
                 reference: nn.Module | None, ranks: int, group: Any, global_completions: int,
                 local_batch_size: int, seq_len: int, vocab_size: int, pad_id: int, stop_ids: tuple[int, ...],
                 decode: Any, seed: int, dp_rank: int) -> None:
        self.setup, self.engine, self.rewards, self.reference = setup, engine, rewards, reference
        self.ranks, self.group, self.global_completions = ranks, group, global_completions
        self.local_batch_size, self.seq_len, self.pad_id, self.stop_ids = local_batch_size, seq_len, pad_id, stop_ids
        self.vocab_size = vocab_size
        self.decode, self.seed, self.dp_rank = decode, seed, dp_rank
        self.rollouts: Rollouts | None = None
        self.batches_made = 0  # rollout batches made (the generation seed of the next)
        self.alike_batches = 0  # batches in a row whose every group scored its completions alike

    def needs_batch(self) -> bool:
        """Whether the next step takes new prompts (false while rollouts have steps left)."""
        return self.rollouts is None or self.rollouts.uses_left == 0

    # -- rollouts ------------------------------------------------------------------------------

    def _completions(self, prompts: list[PromptRow]) -> tuple[list[list[int]], float]:
        """Each prompt's ``num_generations`` completions (given, or generated), in prompt order, and
        the seconds generation took."""
        s = self.setup
        if s.given:
            for row in prompts:
                if len(row.completion_ids or []) != s.num_generations:
                    raise DataError(f"grpo.rollouts_path: row {row.index} has {len(row.completion_ids or [])} "
                                    f"completions; expected grpo.num_generations = {s.num_generations}")
            return [ids for row in prompts for ids in row.completion_ids or []], 0.0
        from torchtitan_lite.rl.rollout import SamplingParams

        params = SamplingParams(max_new_tokens=s.max_completion_length, temperature=s.temperature, top_p=s.top_p,
                                top_k=s.top_k, stop_token_ids=self.stop_ids, stop_strings=s.stop_strings)
        start = time.perf_counter()
        seed = generation_seed(self.seed, self.batches_made, self.dp_rank)
        completions = self.engine.generate([row.ids.tolist() for row in prompts for _ in range(s.num_generations)],
                                           params, seed=seed)
        return [c.token_ids for c in completions], time.perf_counter() - start

    def _rewards(self, prompts: list[PromptRow], completions: list[list[int]]) -> tuple[torch.Tensor, list[str]]:
        """``(completions, functions)`` fp32 rewards (NaN: none) and the functions' names."""
        s = self.setup
        given = prompts[0].rewards if s.given else None
        if given is not None:
            if isinstance(given, dict):
                names = list(given)
                rows = [[row.rewards[name][i] for name in names] for row in prompts  # type: ignore[index]
                        for i in range(s.num_generations)]
            else:
                names = ["reward"]
                rows = [[row.rewards[i]] for row in prompts for i in range(s.num_generations)]  # type: ignore[index]
            return torch.tensor([[float("nan") if v is None else v for v in r] for r in rows],
                                dtype=torch.float32), names
        return score_completions(self.rewards, prompts, completions, num_generations=s.num_generations,
                                 decode=self.decode, max_completion_length=s.max_completion_length), \
            metric_names(self.rewards)

    def _gather(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``x`` of every data-parallel rank, concatenated in rank order (equal shapes)."""
        if not dist.is_initialized() or self.ranks == 1:
            return x
        parts = [torch.empty_like(x.to(device)) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, x.to(device), group=self.group)
        return torch.cat(parts).cpu()

    def make_rollouts(self, runner: MicroBatchRunner, prompts: list[PromptRow]) -> Rollouts:
        """Answer, score and lay out this rank's ``prompts`` (module's text); the metrics over all ranks."""
        s = self.setup
        completions, generation_s = self._completions(prompts)
        per_function, names = self._rewards(prompts, completions)
        if s.reward_weights and len(s.reward_weights) != len(names):
            raise DataError(f"grpo.reward_weights: invalid value {list(s.reward_weights)}; the rollouts' rewards "
                            f"are of {len(names)} function(s) ({', '.join(names)}): expected one weight each, or none")
        rewards = weighted_rewards(per_function, s.reward_weights)
        device = runner.device
        all_rewards = self._gather(rewards, device)
        advantages, std_zero = group_advantages(rewards, s.num_generations, s.scale_rewards,
                                                batch_rewards=all_rewards)
        inputs, labels, truncated, lengths = self._rows(prompts, completions)
        all_functions = self._gather(per_function, device)
        stats = self._gather(torch.tensor([[float(n), float(t), float(z)] for n, t, z in
                                           zip(lengths, truncated, std_zero.tolist(), strict=True)]), device)
        metrics = {"grpo/reward": float(torch.nanmean(all_rewards)), "grpo/reward_std": float(_nanstd(all_rewards)),
                   "grpo/frac_reward_zero_std": float(stats[:, 2].mean()),
                   "grpo/completion_length/mean": float(stats[:, 0].mean()),
                   "grpo/completion_length/min": float(stats[:, 0].min()),
                   "grpo/completion_length/max": float(stats[:, 0].max()),
                   "grpo/truncated_ratio": float(stats[:, 1].mean())}
        self._warn_when_nothing_is_learnt(metrics["grpo/frac_reward_zero_std"])
        for i, name in enumerate(names):
            metrics[f"grpo/rewards/{name}/mean"] = float(torch.nanmean(all_functions[:, i]))
            metrics[f"grpo/rewards/{name}/std"] = float(_nanstd(all_functions[:, i]))
        if not s.given:
            generated = float(stats[:, 0].sum())
            seconds = torch.tensor([generation_s], dtype=torch.float64, device=device)
            if dist.is_initialized() and self.ranks > 1:
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=self.group)
            metrics["generation_time_s"] = float(seconds.item())
            metrics["generation_tokens_per_s"] = generated / max(float(seconds.item()), 1e-9)
        rollouts = Rollouts(inputs, labels, advantages, metrics=metrics, uses_left=s.num_iterations)
        sampling = self._sampling_logps(prompts, labels) if s.importance_sampling != "none" else None
        with torch.no_grad():
            if s.num_iterations > 1 or sampling is not None:
                rollouts.old = self._logps(runner, rollouts, None)
            if sampling is not None:
                assert rollouts.old is not None
                rollouts.weight = sampling_weights(rollouts.old, sampling, (labels != IGNORE_INDEX).float(),
                                                   mode=s.importance_sampling, cap=s.importance_sampling_max)
            if s.beta:
                with as_reference(runner.model, self.reference) as reference:
                    rollouts.ref = self._logps(runner, rollouts, reference)
        self.batches_made += 1
        return rollouts

    ALIKE_BATCHES = 10
    """Batches in a row whose every group scored alike (advantages all 0) before a warning."""

    def _warn_when_nothing_is_learnt(self, frac_zero_std: float) -> None:
        """One warning (rank 0) when every group of :attr:`ALIKE_BATCHES` batches in a row scored
        its completions alike: the advantages are 0 and the policy gradient is nothing."""
        self.alike_batches = self.alike_batches + 1 if frac_zero_std == 1.0 else 0
        if self.alike_batches == self.ALIKE_BATCHES and self.dp_rank == 0:
            logger.warning("grpo: in each of the last %d batches every prompt's %d completions scored alike "
                           "(grpo/frac_reward_zero_std = 1): their advantages are 0 and the policy does not learn "
                           "from them; check that the reward functions tell completions apart (the rewards' "
                           "columns, e.g. answer) and that sampling varies them (grpo.temperature)",
                           self.ALIKE_BATCHES, self.setup.num_generations)

    def _sampling_logps(self, prompts: list[PromptRow], labels: torch.Tensor) -> torch.Tensor | None:
        """The given rollouts' sampling log-probabilities laid out as ``labels`` (None when a row has none)."""
        if not all(row.logprobs is not None for row in prompts):
            return None
        out = torch.zeros(labels.shape, dtype=torch.float32)
        given = [lp for row in prompts for lp in row.logprobs or []]
        for i, values in enumerate(given):
            positions = (labels[i] != IGNORE_INDEX).nonzero().flatten()
            count = min(len(positions), len(values))
            out[i, positions[:count]] = torch.tensor([float("nan") if v is None else v for v in values[:count]])
        return out

    def _rows(self, prompts: list[PromptRow], completions: list[list[int]]
              ) -> tuple[torch.Tensor, torch.Tensor, list[bool], list[int]]:
        s = self.setup
        return completion_rows([row.ids.tolist() for row in prompts for _ in range(s.num_generations)], completions,
                               seq_len=self.seq_len, pad_id=self.pad_id, stop_ids=self.stop_ids,
                               max_completion_length=s.max_completion_length,
                               mask_truncated=s.mask_truncated_completions, vocab_size=self.vocab_size)

    def _logps(self, runner: MicroBatchRunner, rollouts: Rollouts, model: nn.Module | None) -> torch.Tensor:
        """Every row's label log-probabilities under ``model`` (default the policy), without gradient."""
        return rows_logps(runner, rollouts.inputs, rollouts.labels, local_batch_size=self.local_batch_size,
                          temperature=self.setup.logit_temperature, model=model)

    # -- the step ------------------------------------------------------------------------------

    def forward_backward(self, runner: MicroBatchRunner, batch: list[Any]) -> StepResult:
        """One policy step on the current rollouts (made from ``batch``'s prompts when
        :meth:`needs_batch`): the loss of :data:`LOSS_TYPES` over the global batch, its gradient
        accumulated; the step's metrics over all ranks."""
        s = self.setup
        if self.needs_batch():
            self.rollouts = self.make_rollouts(runner, [row for micro in batch for row in micro])
        rollouts = self.rollouts
        assert rollouts is not None
        device = runner.device
        # (every context-parallel rank holds the whole rows: counted once over the token ranks)
        counted = float((rollouts.labels != IGNORE_INDEX).sum()) / runner.sequence_shards
        totals = torch.tensor([counted], dtype=torch.float64, device=device)
        if dist.is_initialized() and self.ranks > 1:
            dist.all_reduce(totals, group=self.group)
        loss_sum, sums = policy_backward(runner, rollouts, s, completions=self.global_completions,
                                         tokens=max(float(totals.item()), 1.0), local_batch_size=self.local_batch_size,
                                         ranks=self.ranks)
        if dist.is_initialized() and self.ranks > 1:
            dist.all_reduce(sums, group=self.group)
        tokens = max(float(sums[5]), 1.0)
        metrics = dict(rollouts.metrics) if rollouts.uses_left == s.num_iterations else {}
        metrics.update({"grpo/entropy": float(sums[1]) / tokens, "grpo/clip_ratio/low_mean": float(sums[2]) / tokens,
                        "grpo/clip_ratio/high_mean": float(sums[3]) / tokens,
                        "grpo/clip_ratio/region_mean": float(sums[4]) / tokens})
        if s.beta:
            metrics["grpo/kl"] = float(sums[0]) / tokens
        rollouts.uses_left -= 1
        rows = rollouts.inputs.numel() // runner.sequence_shards  # (this rank's tokens)
        return StepResult(loss_sum, 1.0, global_tokens=int(rows * self.ranks), tokens_per_rank=float(rows),
                          metrics=metrics)

    # -- checkpoint ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs: the rollout batches made and, between the steps on one batch, its
        rollouts (this rank's rows cut to their longest, as base64)."""
        r = self.rollouts
        held = None
        if r is not None and r.uses_left > 0:
            counted = (r.labels != IGNORE_INDEX).nonzero()[:, 1]  # (and the input after the last label)
            width = min(int(counted.max()) + 2, r.labels.shape[1]) if counted.numel() else 1
            held = {"width": width, "metrics": dict(r.metrics), "uses_left": r.uses_left,
                    **{name: None if t is None else _packed(t if t.dim() == 1 else t[:, :width])
                       for name, t in (("inputs", r.inputs), ("labels", r.labels), ("advantages", r.advantages),
                                       ("old", r.old), ("ref", r.ref), ("weight", r.weight))}}
        return {"batches_made": self.batches_made, "rollouts": held}

    def load_state_dict(self, state: dict[str, Any], *, same_ranks: bool = True) -> None:
        """A saved :meth:`state_dict`; another world size's rollouts in progress are not this
        rank's, so the next step makes new ones (logged)."""
        self.batches_made = int(state.get("batches_made", 0))
        held = state.get("rollouts")
        self.rollouts = None
        if held is None:
            return
        if not same_ranks:
            logger.warning("grpo: the checkpoint holds rollouts in progress of another world size; the next step "
                           "makes new ones")
            return

        def wide(name: str, fill: float) -> torch.Tensor | None:
            packed = held.get(name)
            if packed is None:
                return None
            t = _unpacked(packed)
            if t.dim() == 1:
                return t
            out = torch.full((t.shape[0], self.seq_len), fill, dtype=t.dtype)
            out[:, : t.shape[1]] = t
            return out

        labels = wide("labels", IGNORE_INDEX)
        inputs, advantages = wide("inputs", self.pad_id), wide("advantages", 0.0)
        assert labels is not None and inputs is not None and advantages is not None
        weight = held.get("weight")  # (per completion: (rows, 1); per token: cut like the rows)
        if weight is not None:
            weight = _unpacked(weight) if weight["shape"][-1] == 1 else wide("weight", 1.0)
        self.rollouts = Rollouts(inputs, labels, advantages, old=wide("old", 0.0), ref=wide("ref", 0.0),
                                 weight=weight,
                                 metrics=dict(held["metrics"]), uses_left=int(held["uses_left"]))


def _packed(t: torch.Tensor) -> dict[str, Any]:
    """A tensor as JSON: dtype, shape and its bytes in base64."""
    t = t.detach().cpu().contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(t.numpy().tobytes()).decode()}


def _unpacked(packed: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, packed["dtype"])
    flat = torch.frombuffer(bytearray(base64.b64decode(packed["data"])), dtype=dtype)
    return flat.reshape(packed["shape"]).clone()
