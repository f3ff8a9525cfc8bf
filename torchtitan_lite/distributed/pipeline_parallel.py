"""Pipeline parallel: the decoder's layers split into stages over the ``pp`` ranks, run by a
schedule of :mod:`torch.distributed.pipelining` (GPipe, 1F1B, the interleaved and zero-bubble ones).

How a model is split (:class:`PipelinePlan`):

- The embedding counts as ``first_stage_less_layers`` layers and the final norm with the output
  projection (and so the loss) as ``last_stage_less_layers``: the first and last stages get that
  many fewer blocks. The blocks, plus those two counts, are spread evenly over the stages; a split
  that is not even is refused in one line (:func:`pipeline_problem`).
- Single-stage schedules (``GPipe``, ``1F1B``) give each pipeline rank one stage; the looped ones
  (``Interleaved1F1B``, ``InterleavedZeroBubble``) ``v`` stages, rank ``r`` holding stages ``r``,
  ``r + p`` …; ``ZBVZeroBubble`` two, in a V (rank ``r`` holds ``r`` and ``2p - 1 - r``).
  ``pipeline_parallel_layers_per_stage`` sets ``v``; without it, looped schedules take 2.
- A rank's model is the whole model's class with only its stages' parts (:func:`prune_to_stages`):
  parameter names stay those of the whole model, so checkpoints move between degrees. Each
  stage is a view (:class:`StagePart`) that runs the rank's model for that stage.
- The weights are the whole model's for the seed (:func:`init_stage_weights`): every parameter's
  initialiser draws from the global generator in the whole model's order, the absent ones too.

The loss is the trainer's: each micro-batch's summed token loss times the step's scale (the mean
over every counted label of the global batch), so that the gradients do not depend on the degree
or the schedule; the last stage's sum goes to every pipeline rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_lite.distributed.fsdp import gathered_through_step
from torchtitan_lite.loss import loss_sums
from torchtitan_lite.models.moe.balance import RouterBalance

__all__ = ["LOOPED_SCHEDULES", "SCHEDULES", "SINGLE_SCHEDULES", "SPLIT_BACKWARD_SCHEDULES", "PipelinePlan",
           "PipelineRunner", "RowsFn", "StagePart", "TiedWeights", "init_stage_weights", "pipeline_plan",
           "pipeline_problem", "prune_to_stages", "rank_actions"]

SINGLE_SCHEDULES = ("GPipe", "1F1B")
LOOPED_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")
V_SCHEDULES = ("ZBVZeroBubble",)
SCHEDULES = (*SINGLE_SCHEDULES, *LOOPED_SCHEDULES, *V_SCHEDULES)
"""The schedules of :mod:`torch.distributed.pipelining` a job may name (TorchTitan's names)."""
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")
"""The zero-bubble schedules: each backward in two passes, the input gradient (sent at once to the
previous stage) and later the weight gradient, which fills what would be bubbles."""


@dataclass(frozen=True)
class StageLayout:
    """One stage: its block names (``layers`` keys), and whether it embeds / ends with the output."""

    index: int
    layers: tuple[str, ...]
    first: bool
    last: bool


@dataclass(frozen=True)
class PipelinePlan:
    """A job's pipeline: its degree, schedule, micro-batch size and the stages' blocks."""

    degree: int
    schedule: str
    microbatch_size: int
    stages: tuple[StageLayout, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def rank_stages(self, pp_rank: int) -> tuple[StageLayout, ...]:
        """The stages pipeline rank ``pp_rank`` holds, in the order the schedule wants them."""
        p, n = self.degree, self.num_stages
        if self.schedule in V_SCHEDULES:
            return (self.stages[pp_rank], self.stages[2 * p - 1 - pp_rank])
        return tuple(self.stages[i] for i in range(pp_rank, n, p))

    def microbatches(self, local_batch_size: int) -> int:
        return local_batch_size // self.microbatch_size

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule splits each backward into an input and a weight pass: FSDP must
        then keep the stages' parameters gathered from the first forward to the last weight pass
        and reduce their gradients once, after the step (:class:`PipelineRunner`)."""
        return self.schedule in SPLIT_BACKWARD_SCHEDULES


def _stages_per_rank(schedule: str, layers_per_stage: int | None, weight: int, degree: int) -> int | str:
    """Stages per rank (``weight``: blocks plus the first and last stages' shares), or a problem."""
    if schedule in SINGLE_SCHEDULES:
        if layers_per_stage is not None and layers_per_stage * degree != weight:
            return (f"parallelism.pipeline_parallel_layers_per_stage: invalid value {layers_per_stage}; {schedule} "
                    f"gives each of the {degree} pipeline ranks one stage of {weight} / {degree} layers (embedding "
                    "and output counted): expected that, or unset")
        return 1
    if schedule in V_SCHEDULES:
        v = 2
        if layers_per_stage is not None and layers_per_stage * degree * v != weight:
            return (f"parallelism.pipeline_parallel_layers_per_stage: invalid value {layers_per_stage}; {schedule} "
                    f"gives each pipeline rank 2 stages: expected {weight} / {2 * degree} layers, or unset")
        return v
    if layers_per_stage is None:
        return 2
    if weight % layers_per_stage or (weight // layers_per_stage) % degree:
        return (f"parallelism.pipeline_parallel_layers_per_stage: invalid value {layers_per_stage}; {weight} layers "
                f"(embedding and output counted) do not split into stages of {layers_per_stage} that the {degree} "
                "pipeline ranks share evenly")
    return weight // layers_per_stage // degree


def pipeline_problem(*, n_layers: int, degree: int, schedule: str, microbatch_size: int, local_batch_size: int,
                     layers_per_stage: int | None = None, first_less: int = 1, last_less: int = 1) -> str | None:
    """Why these settings cannot split the model or feed the schedule (one line naming the key),
    or None."""
    if schedule not in SCHEDULES:
        return (f"parallelism.pipeline_parallel_schedule: invalid value {schedule!r}; expected one of "
                f"{', '.join(SCHEDULES)}")
    if microbatch_size < 1 or local_batch_size % microbatch_size:
        return (f"parallelism.pipeline_parallel_microbatch_size: invalid value {microbatch_size}; expected a "
                f"divisor of training.local_batch_size = {local_batch_size}")
    for key, value in (("first", first_less), ("last", last_less)):
        if value < 0:
            return f"parallelism.pipeline_parallel_{key}_stage_less_layers: invalid value {value}; expected >= 0"
    weight = n_layers + first_less + last_less
    v = _stages_per_rank(schedule, layers_per_stage, weight, degree)
    if isinstance(v, str):
        return v
    stages = degree * v
    if weight % stages:
        return (f"parallelism.pipeline_parallel_degree: invalid value {degree}; {n_layers} blocks + "
                f"{first_less} (embedding) + {last_less} (output) = {weight} layers do not split evenly into "
                f"{stages} stages ({schedule}: {v} per rank); change pipeline_parallel_first_stage_less_layers / "
                "last_stage_less_layers or the degree")
    per_stage = weight // stages
    if per_stage < max(first_less, last_less) or (stages == 1 and per_stage < first_less + last_less):
        return (f"parallelism.pipeline_parallel_degree: invalid value {degree}; {stages} stages of {per_stage} "
                f"layers cannot hold the first stage's {first_less} and the last stage's {last_less} (embedding, "
                "output): lower first/last_stage_less_layers")
    microbatches = local_batch_size // microbatch_size
    if schedule not in ("GPipe",) and microbatches < degree:
        return (f"parallelism.pipeline_parallel_microbatch_size: invalid value {microbatch_size}; {schedule} needs "
                f"at least {degree} micro-batches (the pipeline degree) per local batch, and training.local_batch_size"
                f" = {local_batch_size} gives {microbatches}")
    if schedule in LOOPED_SCHEDULES and microbatches % degree:
        return (f"parallelism.pipeline_parallel_microbatch_size: invalid value {microbatch_size}; {schedule} runs "
                f"micro-batches in rounds of the degree {degree}: training.local_batch_size / microbatch_size = "
                f"{microbatches} must be a multiple of it")
    return None


def pipeline_plan(*, n_layers: int, degree: int, schedule: str, microbatch_size: int, local_batch_size: int,
                  layers_per_stage: int | None = None, first_less: int = 1, last_less: int = 1) -> PipelinePlan:
    """The stages of a model of ``n_layers`` blocks (:func:`pipeline_problem` as a ``ValueError``)."""
    problem = pipeline_problem(n_layers=n_layers, degree=degree, schedule=schedule, microbatch_size=microbatch_size,
                               local_batch_size=local_batch_size, layers_per_stage=layers_per_stage,
                               first_less=first_less, last_less=last_less)
    if problem is not None:
        raise ValueError(problem)
    weight = n_layers + first_less + last_less
    v = _stages_per_rank(schedule, layers_per_stage, weight, degree)
    assert isinstance(v, int)
    stages = degree * v
    per_stage = weight // stages
    layouts, next_layer = [], 0
    for s in range(stages):
        count = per_stage - (first_less if s == 0 else 0) - (last_less if s == stages - 1 else 0)
        layouts.append(StageLayout(index=s, layers=tuple(str(i) for i in range(next_layer, next_layer + count)),
                                   first=s == 0, last=s == stages - 1))
        next_layer += count
    assert next_layer == n_layers
    return PipelinePlan(degree=degree, schedule=schedule, microbatch_size=microbatch_size, stages=tuple(layouts))


def rank_actions(plan: PipelinePlan, pp_rank: int, microbatches: int) -> list[tuple[str, int, int]]:
    """What pipeline rank ``pp_rank`` computes in one run of the schedule over ``microbatches``,
    in order: ``(kind, stage, micro-batch)``, kind ``F`` a forward, ``B`` a full backward, ``I``
    and ``W`` a zero-bubble schedule's input and weight passes. GPipe and 1F1B in the order their
    single-stage schedules run (1F1B: ``degree - rank`` forwards, then a backward before each
    further forward); the others as :mod:`torch.distributed.pipelining` computes their order.
    What the memory estimate replays (the micro-batches in flight)."""
    m, p = microbatches, plan.degree
    if plan.schedule == "GPipe":
        return [("F", pp_rank, j) for j in range(m)] + [("B", pp_rank, j) for j in range(m)]
    if plan.schedule == "1F1B":
        warmup = min(m, p - pp_rank)
        actions = [("F", pp_rank, j) for j in range(warmup)]
        for j in range(m):
            actions.append(("B", pp_rank, j))
            if warmup + j < m:
                actions.append(("F", pp_rank, warmup + j))
        return actions
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import _ComputationType, get_schedule_class

    # (a schedule computes every rank's order in its constructor, from these fields of its stages)
    n = plan.num_stages
    stages = [SimpleNamespace(group_size=p, group_rank=pp_rank, num_stages=n, submod=None, stage_index=layout.index,
                              is_first=layout.first, is_last=layout.last) for layout in plan.rank_stages(pp_rank)]
    order = get_schedule_class(plan.schedule)(stages, n_microbatches=m, loss_fn=_no_loss,
                                              scale_grads=False).pipeline_order[pp_rank]
    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B",
             _ComputationType.BACKWARD_INPUT: "I", _ComputationType.BACKWARD_WEIGHT: "W"}
    return [(kinds[op.computation_type], op.stage_index, op.microbatch_index) for op in order if op is not None]


def _no_loss(output: Any, target: Any) -> Any:
    return output


def prune_to_stages(model: nn.Module, plan: PipelinePlan, pp_rank: int) -> None:
    """Keep only the parts of pipeline rank ``pp_rank``'s stages in ``model`` (a decoder built on
    the meta device): its blocks, the embedding on the first stage's rank, the final norm and output
    projection on the last one's. Parameter names are unchanged (the decoder's ``keep_stages``)."""
    model.keep_stages(plan.rank_stages(pp_rank))


def init_stage_weights(model: nn.Module, whole: nn.Module, *, buffer_device: torch.device) -> None:
    """Initialise a pruned model (:func:`prune_to_stages`) as the whole model would be for the
    same seed: ``whole`` (the whole model on the meta device) gets the pruned model's modules in
    place of its own and runs its ``init_weights``; its meta parameters draw their seeds and are
    left alone (:mod:`torchtitan_lite.models.init`)."""
    whole.adopt_parts(model)
    whole.init_weights(buffer_device=buffer_device)
    model.init_buffers(buffer_device)


class TiedWeights:
    """Tied embeddings under pipeline parallel: the embedding (first stage) and the output
    projection (last stage) are one weight. Where the two stages are on different pipeline ranks
    (every schedule but the V ones), each of the two ranks holds a copy, started alike
    (:func:`init_stage_weights`, a checkpoint), and keeps it alike: after the backward, the copies'
    gradients are summed between the two ranks (:meth:`sum_gradients`; each shard with the same
    shard of the other copy), and both take the same optimizer step. The gradient norm counts the
    weight once: on the first stage's rank (:meth:`counted`). Where one rank holds both stages, or
    without tied embeddings, there is nothing to do (:meth:`build` returns None)."""

    def __init__(self, param: nn.Parameter | None, group: Any, counted_here: bool) -> None:
        self.param, self.group, self.counted_here = param, group, counted_here

    @staticmethod
    def build(model: nn.Module, plan: PipelinePlan | None, *, world: Any, pp_rank: int) -> TiedWeights | None:
        """The tied weight's copies of ``model`` (this rank's pruned decoder) over the ranks of
        ``world`` (the device mesh; ``pp`` its outermost dimension), or None."""
        if plan is None or not model.args.tie_word_embeddings:
            return None
        holders = [next(r for r in range(plan.degree) if any(s.first for s in plan.rank_stages(r))),
                   next(r for r in range(plan.degree) if any(s.last for s in plan.rank_stages(r)))]
        if holders[0] == holders[1]:
            return None
        columns = world.mesh.reshape(plan.degree, -1)  # (each column: one pipeline group's ranks)
        mine = None
        for column in columns.t().tolist():  # (every rank makes every group, in the same order)
            group = dist.new_group([column[holders[0]], column[holders[1]]])
            if dist.get_rank() in (column[holders[0]], column[holders[1]]):
                mine = group
        if pp_rank == holders[0]:
            return TiedWeights(model.tok_embeddings.weight, mine, True)
        if pp_rank == holders[1]:
            return TiedWeights(model.output.weight, mine, False)
        return TiedWeights(None, None, True)

    def sum_gradients(self) -> None:
        """Sum the two copies' gradients (before the gradient norm and the optimizer step)."""
        grad = None if self.param is None else self.param.grad
        if grad is None:
            return
        from torch.distributed.tensor import DTensor

        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.group)

    def counted(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` whose gradients this rank's norm counts: all but the second copy."""
        return params if self.counted_here or self.param is None else [p for p in params if p is not self.param]


class StagePart(nn.Module):
    """One stage of a rank's pruned model, for :class:`torch.distributed.pipelining.PipelineStage`:
    its modules (shared with the model, so ``parameters()`` are the stage's) and a forward that
    runs the model for this stage (through the model's own call, so FSDP's hooks run).

    With a mixture of experts in training (``balance``), a stage's forward also takes and returns
    the micro-batch's routing so far (:meth:`RouterBalance.routing_state`) beside the hidden
    states, its MoE layers' added: the last stage's loss reads every layer's."""

    def __init__(self, model: nn.Module, stage: StageLayout, balance: RouterBalance | None = None) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({f"layer_{key}": model.layers[key] for key in stage.layers})
        if stage.first:
            self.parts["tok_embeddings"] = model.tok_embeddings
        if stage.last:
            self.parts["norm"], self.parts["output"] = model.norm, model.output
        self.index = stage.index
        object.__setattr__(self, "_model", model)  # not a child: its other stages' parameters are not this one's
        # Block-causal attention: each micro-batch's document ids, in the order the stage runs its
        # forwards (every schedule runs a stage's micro-batches in order); set by the runner. And
        # which of each micro-batch's tokens its router losses count (None: all).
        self.documents: list[torch.Tensor] | None = None
        self.tokens: list[torch.Tensor] | None = None
        self.calls = 0
        self.inferring = False  # the schedule's first forward infers shapes on placeholder values
        self.inferred = False  # whether the last forward was that one
        self.balance = balance
        prefixes = tuple(f"layers.{key}." for key in stage.layers)
        self.moe_names = [] if balance is None else [name for name in balance.layers if name.startswith(prefixes)]

    def forward(self, x: torch.Tensor, routing: torch.Tensor | None = None) -> Any:
        self.inferred, self.inferring = self.inferring, False
        index = 0 if self.inferred else self.calls
        self.calls += 0 if self.inferred else 1
        if self.documents is None:
            out = self._model(x, stage=self.index)
        else:
            out = self._model(x, self.documents[index], stage=self.index)
        if self.balance is None:
            return out
        tokens = None if self.tokens is None else self.tokens[index]
        routing = self.balance.routing_state(self.moe_names, routing, device=out.device, record=not self.inferred,
                                             tokens=tokens)
        if torch.is_grad_enabled() and not routing.requires_grad:  # (the schedule sends every output's gradient)
            routing.requires_grad_()
        return out, routing


def _forward_only_v(stages: list[Any], **kwargs: Any) -> Any:
    """Validation's order for stages placed in a V (rank ``r`` holds ``r`` and ``2p - 1 - r``):
    each rank's first stage over every micro-batch, then its second (LoopedBFS assumes the
    looped placement, which would send to the wrong ranks)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
    from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime

    schedule = _PipelineScheduleRuntime(stages, **kwargs)
    p, n, m = schedule.pp_group_size, schedule._num_stages, kwargs["n_microbatches"]
    schedule.stage_index_to_group_rank = generate_stage_to_rank_mapping(p, n, style="v")
    for stage in stages:
        stage.stage_index_to_group_rank = schedule.stage_index_to_group_rank
    # (the runtime checks an order with its backwards; they are dropped once its sends and
    # receives are placed: rank p - 1's two stages would pass a gradient locally)
    schedule.pipeline_order = {rank: [_Action(s, _ComputationType.FORWARD, j) for s in (rank, n - 1 - rank)
                                      for j in range(m)] + [_Action(s, _ComputationType.FULL_BACKWARD, j)
                                                            for s in (n - 1 - rank, rank) for j in reversed(range(m))]
                               for rank in range(p)}
    schedule._prepare_schedule_with_comms(schedule.pipeline_order)
    forward = (_ComputationType.FORWARD, _ComputationType.SEND_F, _ComputationType.RECV_F,
               _ComputationType.UNSHARD, _ComputationType.RESHARD)
    schedule.pipeline_order_with_comms = {
        rank: [a for a in actions if a.computation_type in forward]
        for rank, actions in schedule.pipeline_order_with_comms.items()}
    return schedule


RowsFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``rows_fn(i, logits, labels, documents)``: an objective's loss of the schedule's micro-batch
``i`` (a scalar), given its rows' logits, labels and document ids (None: causal attention)."""


class PipelineRunner:
    """Runs one local batch through the schedule: forward and backward of every micro-batch, the
    loss (each micro-batch's ``loss_fn(logits, labels)`` times the step's scale) on the last stage."""

    def __init__(self, model: nn.Module, plan: PipelinePlan, *, pp_rank: int, group: Any, device: torch.device,
                 local_batch_size: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 forward_only: bool = False, balance: RouterBalance | None = None) -> None:
        """``forward_only``: for validation (:meth:`evaluate`), GPipe's order (looped over the
        rank's stages for several), whatever the training schedule. ``balance``: a mixture of
        experts' router losses (training only), added to each micro-batch's loss on the last
        stage."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        self.plan, self.group, self.loss_fn = plan, group, loss_fn
        self.rows_fn: RowsFn | None = None  # (set for one call: an objective's own loss of each micro-batch)
        self._calls = 0
        self._chunks: list[torch.Tensor] | None = None  # (each micro-batch's document ids)
        self._tokens: list[torch.Tensor] | None = None  # (which of each micro-batch's tokens its router losses count)
        self.scale = 1.0
        self._sums: list[torch.Tensor] = []
        self._sources = 0  # a mixture's sources (their losses follow the sum in each micro-batch's)
        self.balance = None if forward_only else balance
        self._accumulation = 1  # the step's loader micro-batches (each split into the schedule's)
        self.parts = [StagePart(model, layout, self.balance) for layout in plan.rank_stages(pp_rank)]
        self.stages = [PipelineStage(part, part.index, plan.num_stages, device, group=group) for part in self.parts]
        self.first = any(layout.first for layout in plan.rank_stages(pp_rank))
        self.last = any(layout.last for layout in plan.rank_stages(pp_rank))
        self._last_part = next((part for part, layout in zip(self.parts, plan.rank_stages(pp_rank), strict=True)
                                if layout.last), None)
        single = len(self.stages) == 1
        name = ("GPipe" if single else "LoopedBFS") if forward_only else plan.schedule
        self.microbatches = plan.microbatches(local_batch_size)
        kwargs = {"n_microbatches": self.microbatches, "loss_fn": self._loss, "scale_grads": False}
        if forward_only and plan.schedule in V_SCHEDULES:
            self.schedule = _forward_only_v(self.stages, **kwargs)
        else:
            self.schedule = get_schedule_class(name)(self.stages[0] if single else self.stages, **kwargs)
        self.device = device
        # A zero-bubble schedule's weight pass reads the gathered parameters the input pass saw.
        self._held = model if plan.splits_backward and not forward_only else None

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        if self.balance is None:
            return self._token_loss(output, target)
        logits, routing = output
        assert self._last_part is not None  # (only the last stage computes the loss)
        inferred = self._last_part.inferred  # (the loss follows the last stage's forward)
        tokens: int | torch.Tensor = logits.shape[0] * logits.shape[1]
        if self._tokens is not None:  # (an objective's rows: their padding not counted)
            tokens = self._tokens[0 if inferred else self._calls].sum()
        router = self.balance.state_loss(routing, tokens, self.microbatches * self._accumulation,
                                         record=not inferred)
        loss = self._token_loss(logits, target)
        return loss if router is None else loss + router

    def _token_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.rows_fn is not None:
            if self._last_part is not None and self._last_part.inferred:  # (shapes only: placeholder values)
                return logits.float().sum() * 0.0
            self._calls += 1
            i = self._calls - 1
            return self.rows_fn(i, logits, target, None if self._chunks is None else self._chunks[i])
        # A mixture: the target's last column is each row's source (kept for the metrics).
        labels, sources = (target[:, :-1], target[:, -1].tolist()) if self._sources else (target, None)
        loss = self.loss_fn(logits, labels)
        self._sums.append(loss_sums(self.loss_fn, logits, labels, loss, sources, self._sources))
        return loss * self.scale

    def _documents(self, documents: torch.Tensor | None, tokens: torch.Tensor | None = None) -> None:
        """Hand each stage the micro-batches' document ids (None: causal attention) and which of
        their tokens the router losses count (None: all)."""
        chunks = None if documents is None else list(documents.tensor_split(self.microbatches))
        self._chunks = chunks
        self._tokens = None if tokens is None or self.balance is None else list(tokens.tensor_split(self.microbatches))
        initialized = getattr(self.schedule, "_stage_forward_initialized",
                              getattr(self.schedule, "_stages_forward_initialized", True))
        for part in self.parts:
            part.documents, part.tokens, part.calls, part.inferring = chunks, self._tokens, 0, not initialized

    def rows_forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, rows_fn: RowsFn, *,
                              accumulation: int = 1, documents: torch.Tensor | None = None,
                              tokens: torch.Tensor | None = None) -> None:
        """Forward and backward of this local batch with an objective's own loss: on the last
        stage, ``rows_fn(i, logits, labels, documents)`` of each micro-batch ``i`` of the schedule
        (its rows, in order; the value's gradient accumulates). ``documents``: the batch's
        document ids (block-causal attention); ``tokens``: which of its positions the router
        losses count (``(rows, seq)`` bool; None: all)."""
        self.rows_fn, self._calls = rows_fn, 0
        try:
            self.forward_backward(inputs, labels, scale=1.0, accumulation=accumulation, documents=documents,
                                  tokens=tokens)
        finally:
            self.rows_fn = None

    @torch.no_grad()
    def rows_forward(self, inputs: torch.Tensor, labels: torch.Tensor, rows_fn: RowsFn,
                     documents: torch.Tensor | None = None) -> None:
        """Forward only (this runner built ``forward_only``): ``rows_fn(i, logits, labels,
        documents)`` of each micro-batch ``i`` on the last stage (its value unused)."""
        self.rows_fn, self._calls = rows_fn, 0
        try:
            self.evaluate(inputs, labels, documents)
        finally:
            self.rows_fn = None

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, *, scale: float,
                         documents: torch.Tensor | None = None, sources: list[int] | None = None,
                         num_sources: int = 0, accumulation: int = 1,
                         tokens: torch.Tensor | None = None) -> torch.Tensor:
        """This local batch's summed token loss (fp64, detached, shape ``(1,)``), the same on
        every pipeline rank; gradients of ``scale`` × that sum accumulate in the stages'
        parameters. ``documents``: its document ids (block-causal attention), which every
        stage's attention needs. ``sources``: each row's source in a mixture of ``num_sources``
        (rows of one source next to each other): the sum is then followed by each source's.
        ``accumulation``: the step's local batches (router losses average over every micro-batch);
        ``tokens``: which positions the router losses count (None: all)."""
        self.scale, self._sums, self._accumulation = scale, [], accumulation
        self._sources = num_sources if sources is not None else 0
        self._documents(documents, tokens)
        target = labels
        if sources is not None:
            target = torch.cat([labels, torch.tensor(sources, dtype=labels.dtype, device=labels.device)[:, None]], 1)
        args = (inputs,) if self.first else ()
        with gathered_through_step(self._held) if self._held is not None else contextlib.nullcontext():
            self.schedule.step(*args, target=target if self.last else None, return_outputs=False)
        return self._total()

    def _total(self) -> torch.Tensor:
        total = torch.zeros(1 + self._sources, dtype=torch.float64, device=self.device)
        # The last stage's micro-batches, in order (at the first step, the schedule's inference of
        # the gradients' shapes calls the loss once before them, on placeholder values)
        for part in self._sums[len(self._sums) - self.microbatches:] if self.last else ():
            total += part
        dist.all_reduce(total, group=self.group)
        return total

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor,
                 documents: torch.Tensor | None = None) -> torch.Tensor:
        """This local batch's summed token loss, forward only (fp64, every pipeline rank)."""
        self.scale, self._sums, self._sources = 1.0, [], 0
        self._documents(documents)
        args = (inputs,) if self.first else ()
        self.schedule.eval(*args, target=labels if self.last else None)
        return self._total()
