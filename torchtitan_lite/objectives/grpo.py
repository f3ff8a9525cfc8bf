"""The GRPO family's objective (GRPO, Dr. GRPO, DAPO, BNPO, CISPO; :mod:`torchtitan_lite.rl.losses`
has the definitions): each batch of prompts answered by the rollout engine (or given), scored,
laid out as rows (:mod:`torchtitan_lite.rl.rollouts`), then trained on for ``num_iterations``
policy steps, each through the runner's rows with the policy loss."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_lite.config.schema import JobConfig, objective_ranges
from torchtitan_lite.data.prompts import PromptRow
from torchtitan_lite.data.windows import IGNORE_INDEX
from torchtitan_lite.distributed.job_shape import ObjectiveShape, RolloutShape
from torchtitan_lite.errors import ConfigError, DataError, Problems
from torchtitan_lite.objectives.base import StepResult
from torchtitan_lite.objectives.reference import add_reference_schedules, as_reference, build_reference, reference_kind
from torchtitan_lite.objectives.registry import ObjectiveEntry, ObjectiveParts, ObjectivePlan, PlanContext, register
from torchtitan_lite.rl.losses import GRPOSetup, aggregate, group_advantages, nanstd, policy_losses, sampling_weights
from torchtitan_lite.rl.rewards import RewardFunction, metric_names, resolve_reward_functions
from torchtitan_lite.rl.rollouts import (
    Rollouts,
    completion_rows,
    generation_seed,
    rollouts_from_state,
    rollouts_state,
    score_completions,
    weighted_rewards,
)
from torchtitan_lite.training.runner import MicroBatchRunner

__all__ = ["GRPO", "GRPOEntry", "GRPOObjective", "estimate_step", "policy_backward", "step_shape"]

logger = logging.getLogger("torchtitan_lite")


def policy_backward(runner: MicroBatchRunner, rollouts: Rollouts, setup: GRPOSetup, *, completions: int,
                    tokens: float, local_batch_size: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One policy step's forward and backward on this rank's ``rollouts`` (the loss of
    :data:`LOSS_TYPES` over a global batch of ``completions`` completions and ``tokens`` counted
    tokens; ``local_batch_size`` rows per micro-batch; ``ranks`` as the runner's ``rows_backward``).
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

    loss_sum = runner.rows_backward(rollouts.inputs, rollouts.labels, loss_fn, local_batch_size=local_batch_size,
                             ranks=ranks, temperature=setup.logit_temperature)
    return loss_sum, runner.stages_sum(sums)  # (with a pipeline: the last stage's sums on every rank)


class GRPOObjective:
    """GRPO's objective (:class:`~torchtitan_lite.objectives.base.Objective`) over prompts.

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
        self.reward_names = metric_names(rewards)  # (their metrics' names, TRL's)
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
            self.reward_names

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
        metrics = {"grpo/reward": float(torch.nanmean(all_rewards)), "grpo/reward_std": float(nanstd(all_rewards)),
                   "grpo/frac_reward_zero_std": float(stats[:, 2].mean()),
                   "grpo/completion_length/mean": float(stats[:, 0].mean()),
                   "grpo/completion_length/min": float(stats[:, 0].min()),
                   "grpo/completion_length/max": float(stats[:, 0].max()),
                   "grpo/truncated_ratio": float(stats[:, 1].mean())}
        self._warn_when_nothing_is_learnt(metrics["grpo/frac_reward_zero_std"])
        for i, name in enumerate(names):
            metrics[f"grpo/rewards/{name}/mean"] = float(torch.nanmean(all_functions[:, i]))
            metrics[f"grpo/rewards/{name}/std"] = float(nanstd(all_functions[:, i]))
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
        return runner.rows_logps(rollouts.inputs, rollouts.labels, local_batch_size=self.local_batch_size,
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
        rollouts (:func:`~torchtitan_lite.rl.rollouts.rollouts_state`)."""
        return {"batches_made": self.batches_made, "rollouts": rollouts_state(self.rollouts)}

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
        self.rollouts = rollouts_from_state(held, seq_len=self.seq_len, pad_id=self.pad_id)


def estimate_step(model: nn.Module, reference: nn.Module | None, objective: ObjectiveShape, tracker: Any, *,
                  rows: int, seq_len: int, micro_batches: int, grad_accum_steps: int, device: torch.device,
                  context_parallel: Any = None) -> int:
    """The memory estimate's step of this objective (``ObjectiveShape.step``; called by
    :mod:`torchtitan_lite.memory.estimate` under its tracker): the forwards and backwards of a
    :class:`GRPOObjective` step generating its completions on fake tensors, through the functions
    the step runs:

    - the last batch's rollouts (its rows and kept log-probabilities) are held until the new ones
      replace them;
    - generation (:class:`~torchtitan_lite.rl.rollout.DecoderRollouts`): the prefill of
      ``generation_rows`` prompts of ``prompt_len`` tokens into a KV cache with room for
      ``new_tokens`` more, a draw of the next tokens, one decode step (every later step holds the
      same: the cache is allocated whole at its first write);
    - without gradients, the sampling policy's and the reference's log-probabilities of the
      completions (the runner's ``rows_logps``), kept for the step;
    - the policy step (:func:`policy_backward`): per micro-batch of
      ``rows`` completions, the per-row log-softmax of the logits at the sampling temperature,
      the clipped objective and its backward.

    At most ``micro_batches`` (two) of the ``grad_accum_steps`` micro-batches run; the rollouts
    held are the whole step's. Returns the KV cache's bytes."""
    from torchtitan_lite.rl.rollout import DecoderRollouts, SamplingParams, generation_mode, sample_tokens

    rollout = objective.rollout
    assert rollout is not None
    completions, run = rows * grad_accum_steps, rows * micro_batches
    setup = GRPOSetup(max_completion_length=rollout.new_tokens, temperature=rollout.temperature, top_p=rollout.top_p,
                      top_k=rollout.top_k, beta=0.04 if objective.reference else 0.0, reference=objective.reference)
    runner = MicroBatchRunner(model, device=device, context_parallel=context_parallel)

    def held(old: torch.Tensor | None = None, ref: torch.Tensor | None = None) -> Rollouts:
        tokens = torch.zeros(completions, seq_len, dtype=torch.long, device=device)
        return Rollouts(tokens, torch.zeros_like(tokens), torch.zeros(completions, device=device), old, ref)

    def logps(model_: torch.nn.Module | None, rollouts: Rollouts) -> torch.Tensor:
        part = runner.rows_logps(rollouts.inputs[:run], rollouts.labels[:run], local_batch_size=rows,
                                 temperature=setup.logit_temperature, model=model_)
        return torch.cat([part, part.new_zeros(completions - run, seq_len)])

    kept = (completions, seq_len)
    previous = held(torch.zeros(kept, device=device) if rollout.old_logps else None,
                    torch.zeros(kept, device=device) if objective.reference else None)
    kv_cache = 0
    if rollout.generation_rows:
        params = SamplingParams(max_new_tokens=rollout.new_tokens, temperature=rollout.temperature,
                                top_p=rollout.top_p, top_k=rollout.top_k)
        engine = DecoderRollouts(model, device=device, pad_id=0)
        tracker.generating = True
        with generation_mode(model):
            logits, cache = engine.prefill([[0] * rollout.prompt_len] * rollout.generation_rows, rollout.new_tokens)
            tokens, _ = sample_tokens(logits, params, None)
            engine.next_logits(tokens[:, None], cache)
            kv_cache = cache.nbytes
            del logits, cache, tokens
        tracker.generating = False
    rollouts = held()
    with torch.no_grad():
        if rollout.old_logps:
            rollouts.old = logps(None, rollouts)
        if objective.reference:
            with as_reference(model, reference) as ref:
                rollouts.ref = logps(ref, rollouts)
    del previous
    part = Rollouts(*(t if t is None else t[:run] for t in (rollouts.inputs, rollouts.labels, rollouts.advantages,
                                                            rollouts.old, rollouts.ref)))
    policy_backward(runner, part, setup, completions=completions, tokens=float(run * seq_len), local_batch_size=rows,
                    ranks=1)
    del part, rollouts
    return kv_cache


def step_shape(rollout: RolloutShape, *, reference: str | None = None) -> ObjectiveShape:
    """What a step of this objective holds for the memory estimate: ``rollout``'s rows and what is
    kept of them, ``reference`` (``copy``, ``adapters_off`` or None), its step (:func:`estimate_step`)."""
    return ObjectiveShape(reference=reference, rollout=rollout, step=estimate_step)


class GRPOEntry(ObjectiveEntry):
    """The GRPO family's entry: on prompts (``[grpo]``), or on rollouts made elsewhere
    (``grpo.rollouts_path``)."""

    name = "grpo"
    section = "grpo"
    data_kinds = frozenset({"prompts"})

    def selected(self, config: JobConfig) -> bool:
        return super().selected(config) or config.grpo.rollouts_path is not None

    def plan(self, config: JobConfig, context: PlanContext) -> ObjectivePlan:
        g, t, v = config.grpo, config.training, config.validation
        dims, global_batch = context.dims, context.global_batch
        kinds = [s.dataset for s in t.datasets] or [t.dataset]
        check = Problems()
        objective_ranges(config, check.require, sections=("grpo",))  # (a config built in code: checked here)
        check.raise_all()  # (the checks below divide by num_generations)
        check.require(set(kinds) == {"prompts"} or g.rollouts_path is not None,
                      "training.datasets" if t.datasets else "training.dataset", kinds if t.datasets else t.dataset,
                      "an online RL mixture is of prompt sources only: expected every dataset = 'prompts'"
                      if t.datasets else "online RL reads prompts: expected 'prompts', or grpo.rollouts_path")
        val_kinds = [s.dataset for s in v.datasets] or [v.dataset]
        check.require(not v.enable, "validation.enable", True,
                      f"an online RL job has no validation loss yet (its rewards in the metrics measure the policy; a "
                      f"token loss on {'validation.datasets' if v.datasets else 'validation.dataset'} = "
                      f"{', '.join(map(repr, val_kinds))} would measure data of another kind through the job's "
                      "tokenizer): expected false")
        prompts = global_batch // g.num_generations
        if check.require(global_batch % g.num_generations == 0, "training.global_batch_size", global_batch,
                         f"it counts completions: expected a multiple of grpo.num_generations = {g.num_generations}"):
            check.require(prompts % dims.dp_size == 0, "training.global_batch_size", global_batch,
                          f"its {prompts} prompts (global_batch_size / grpo.num_generations) are split over the "
                          f"{dims.dp_size} data-parallel ranks: expected a multiple of "
                          f"{g.num_generations * dims.dp_size}")
        check.require(0 < g.max_completion_length < t.seq_len, "grpo.max_completion_length", g.max_completion_length,
                      f"a prompt and its completion share training.seq_len = {t.seq_len}: expected 1 to "
                      f"{t.seq_len - 1}")
        check.require(bool(g.reward_functions) or g.rollouts_path is not None, "grpo.reward_functions", [],
                      "expected at least one (a shipped name: accuracy, format, length_penalty, or a dotted path)")
        try:
            resolve_reward_functions(g.reward_functions)
        except ConfigError as exc:
            check.add(exc)
        for key, degree, how in (("pipeline_parallel_degree", dims.pp, "pipeline stages split"),
                                 ("context_parallel_degree", dims.cp, "context parallel splits")):
            check.require(degree == 1 or g.rollouts_path is not None, f"parallelism.{key}", degree,
                          f"online RL generates its rollouts on the training model, which {how}: expected 1, or "
                          "rollouts made elsewhere (grpo.rollouts_path)")
        reference = None
        if g.beta > 0:
            try:
                reference = reference_kind(g.reference, lora=context.lora is not None, key="grpo.reference")
            except ConfigError as exc:
                check.add(exc)
        check.require(not t.tiled_loss, "training.tiled_loss", t.tiled_loss,
                      "online RL reads the logits themselves (temperature, entropy), which the tiled loss does not "
                      "take yet: expected false")
        check.raise_all()
        setup = GRPOSetup(
            num_generations=g.num_generations, max_completion_length=g.max_completion_length,
            temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, stop_strings=tuple(g.stop_strings),
            generation_batch_size=g.generation_batch_size, reward_functions=tuple(g.reward_functions),
            reward_weights=tuple(g.reward_weights), scale_rewards=g.scale_rewards, loss_type=g.loss_type,
            epsilon=g.epsilon, epsilon_high=g.epsilon if g.epsilon_high is None else g.epsilon_high, beta=g.beta,
            kl_bias_correction=g.kl_bias_correction, importance_sampling=g.importance_sampling,
            importance_sampling_max=g.importance_sampling_max, reference=reference,
            num_iterations=g.num_iterations, mask_truncated_completions=g.mask_truncated_completions,
            given=g.rollouts_path is not None)
        completions = global_batch // dims.dp_size  # (a rank's)
        rollout = RolloutShape(
            generation_rows=0 if setup.given else min(g.generation_batch_size or completions, completions),
            prompt_len=t.seq_len - g.max_completion_length, new_tokens=g.max_completion_length,
            temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
            old_logps=g.num_iterations > 1 or (setup.given and g.importance_sampling != "none"))
        notes = ()
        if not setup.given and (g.temperature == 0 or g.top_k == 1):
            notes = (f"grpo.{'temperature = 0' if g.temperature == 0 else 'top_k = 1'} samples greedily: the "
                     f"{g.num_generations} completions of a prompt are the same, score the same, and their "
                     "advantages are 0, so the policy does not learn; sample (grpo.temperature > 0, e.g. 1.0)",)
        return ObjectivePlan(self, setup, step_shape(rollout, reference=reference), notes=notes,
                             generation_batch_size=g.generation_batch_size, group=g.num_generations)

    def build(self, parts: ObjectiveParts) -> GRPOObjective:
        """Rollouts on the model itself (the trainer's rollout engine; none with given rollouts), the
        reward functions, the reference with ``beta`` > 0."""
        plan, config = parts.plan, parts.config
        setup: GRPOSetup = plan.objective.setup
        tokenizer = plan.tokenizer
        if not setup.given and parts.rollout_engine is None:
            raise ValueError("GRPOEntry.build: the job generates its rollouts; give parts.rollout_engine")
        engine = None if setup.given or parts.rollout_engine is None else parts.rollout_engine()
        reference = build_reference(config, plan, setup.reference, mesh=parts.mesh, device=parts.device,
                                    reshard_plan=parts.reshard_plan)
        return GRPOObjective(setup, engine=engine, rewards=resolve_reward_functions(setup.reward_functions),
                             reference=reference, ranks=plan.token_ranks, group=parts.mesh.tokens,
                             global_completions=plan.global_batch_size,
                             local_batch_size=config.training.local_batch_size, seq_len=config.training.seq_len,
                             vocab_size=plan.model_args.vocab_size,
                             pad_id=tokenizer.eos_id if tokenizer.eos_id is not None else 0,
                             stop_ids=tuple(i for i in (tokenizer.eos_id,) if i is not None),
                             decode=tokenizer.decode, seed=config.debug.seed, dp_rank=parts.mesh.dp_rank)

    def add_forward_schedules(self, objective: Any, runner: MicroBatchRunner, parts: ObjectiveParts, *,
                              local_batch_size: int) -> None:
        add_reference_schedules(objective.reference, runner, parts, local_batch_size=local_batch_size)

    def batch_text(self, plan: ObjectivePlan, local_batch_size: int) -> str:
        return f"{local_batch_size} completions"

    def step_lines(self, plan: ObjectivePlan) -> list[str]:
        g, r, reference = plan.setup, plan.shape.rollout, plan.shape.reference
        assert r is not None
        made = ("its completions given (grpo.rollouts_path: nothing generated)" if not r.generation_rows else
                f"{r.generation_rows} completions generated at once per rank on the training model, through a KV "
                f"cache of {r.prompt_len} + {r.new_tokens} positions (the longest prompt: training.seq_len − "
                "grpo.max_completion_length)")
        kept = [name for name, on in (("the sampling policy's", r.old_logps), ("the reference's", bool(reference)))
                if on]
        references = {"copy": "; the reference is a frozen copy sharded like the model (its shards counted as "
                               "sharded params)", "adapters_off": "; the reference is the policy with its LoRA "
                                                                  "adapters off"}
        return [f"online RL (GRPO, {g.loss_type}): {made}"
                + (f"; {' and '.join(kept)} log-probabilities of them kept for the step" if kept else "")
                + references.get(reference or "", "")
                + "; then the policy step, each row's log-softmax at the sampling temperature"]

    def console(self, record: dict[str, Any]) -> list[str]:
        """The rollouts' reward, length and generation's speed; the policy's entropy and KL."""
        parts = []
        if record.get("grpo/reward") is not None:
            gen = record.get("generation_tokens_per_s")
            std = record.get("grpo/reward_std")
            parts.append(f"reward {record['grpo/reward']:.4f} ± {'-' if std is None else format(std, '.4f')}  len "
                         f"{record['grpo/completion_length/mean']:.1f}"
                         + ("" if gen is None else f"  gen_tps {gen:,.0f}"))
        if record.get("grpo/entropy") is not None:
            parts.append(f"entropy {record['grpo/entropy']:.3f}" + ("" if record.get("grpo/kl") is None
                                                                       else f"  kl {record['grpo/kl']:.4f}"))
        return parts


GRPO = register(GRPOEntry())
