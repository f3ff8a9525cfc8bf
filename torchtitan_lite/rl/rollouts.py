"""A step's rollouts as rows: each completion after its prompt (:func:`completion_rows`), scored by
the reward functions (:func:`score_completions`, :func:`weighted_rewards`), sampled with a seed per
batch and rank (:func:`generation_seed`), and held for the steps that train on them
(:class:`Rollouts`, which a checkpoint keeps: :func:`rollouts_state`)."""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchtitan_lite.data.prompts import PromptRow
from torchtitan_lite.data.windows import IGNORE_INDEX
from torchtitan_lite.errors import DataError
from torchtitan_lite.rl.rewards import RewardFunction, call_reward

__all__ = ["Rollouts", "completion_rows", "generation_seed", "rollouts_from_state", "rollouts_state",
           "score_completions", "weighted_rewards"]


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


def _packed(t: torch.Tensor) -> dict[str, Any]:
    """A tensor as JSON: dtype, shape and its bytes in base64."""
    t = t.detach().cpu().contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(t.numpy().tobytes()).decode()}


def _unpacked(packed: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, packed["dtype"])
    flat = torch.frombuffer(bytearray(base64.b64decode(packed["data"])), dtype=dtype)
    return flat.reshape(packed["shape"]).clone()


def rollouts_state(rollouts: Rollouts | None) -> dict[str, Any] | None:
    """Rollouts with steps left on them as JSON (this rank's rows cut to their longest, each tensor
    as base64), for a checkpoint; None when there are none."""
    r = rollouts
    if r is None or r.uses_left <= 0:
        return None
    counted = (r.labels != IGNORE_INDEX).nonzero()[:, 1]  # (and the input after the last label)
    width = min(int(counted.max()) + 2, r.labels.shape[1]) if counted.numel() else 1
    return {"width": width, "metrics": dict(r.metrics), "uses_left": r.uses_left,
            **{name: None if t is None else _packed(t if t.dim() == 1 else t[:, :width])
               for name, t in (("inputs", r.inputs), ("labels", r.labels), ("advantages", r.advantages),
                               ("old", r.old), ("ref", r.ref), ("weight", r.weight))}}


def rollouts_from_state(held: dict[str, Any], *, seq_len: int, pad_id: int) -> Rollouts:
    """:func:`rollouts_state`'s rollouts back, as rows of ``seq_len`` padded with ``pad_id``."""

    def wide(name: str, fill: float) -> torch.Tensor | None:
        packed = held.get(name)
        if packed is None:
            return None
        t = _unpacked(packed)
        if t.dim() == 1:
            return t
        out = torch.full((t.shape[0], seq_len), fill, dtype=t.dtype)
        out[:, : t.shape[1]] = t
        return out

    labels = wide("labels", IGNORE_INDEX)
    inputs, advantages = wide("inputs", pad_id), wide("advantages", 0.0)
    assert labels is not None and inputs is not None and advantages is not None
    weight = held.get("weight")  # (per completion: (rows, 1); per token: cut like the rows)
    if weight is not None:
        weight = _unpacked(weight) if weight["shape"][-1] == 1 else wide("weight", 1.0)
    return Rollouts(inputs, labels, advantages, old=wide("old", 0.0), ref=wide("ref", 0.0), weight=weight,
                    metrics=dict(held["metrics"]), uses_left=int(held["uses_left"]))
