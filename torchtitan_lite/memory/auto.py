"""``reshard_after_forward_mode = "auto"``: per FSDP unit whether to reshard after forward, and per
block how much to recompute in backward, so that the estimated peak fits a memory budget at the
least added step time (:func:`plan_auto_reshard`). The trainer imports this module only for
``auto``."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchtitan_lite.distributed.activation_checkpoint import block_policies
from torchtitan_lite.distributed.fsdp import FSDPUnit, fsdp_units
from torchtitan_lite.distributed.job_shape import JobShape
from torchtitan_lite.distributed.parallel_dims import ParallelDims
from torchtitan_lite.distributed.pipeline_parallel import PipelinePlan, prune_to_stages
from torchtitan_lite.memory.estimate import (
    GIB,
    MemoryEstimate,
    check_arguments,
    estimate_here,
    in_child_process,
    job_estimate_shape,
    modelled,
    size_text,
    where_text,
)
from torchtitan_lite.models.spec import ModelSpec
from torchtitan_lite.progress import Progress

if TYPE_CHECKING:
    from torchtitan_lite.job import JobPlan

__all__ = ["AUTO_DEVICE_FRACTION", "COMM_FLOPS_PER_BYTE", "DEVICE_FLOPS", "HOST_LINK_FLOPS_PER_BYTE",
           "HOST_OPTIMIZER_FLOPS_PER_BYTE", "MEMORY_FLOPS_PER_BYTE", "AutoReshardPlan", "action_costs",
           "auto_budget_bytes", "auto_headroom_bytes", "job_auto_shape", "plan_auto_reshard"]

AUTO_DEVICE_FRACTION = 0.9
"""Share of a CUDA device's memory ``auto`` budgets for tensors when no budget is given; the
rest is for the caching allocator's slack, the CUDA context and communication buffers."""

COMM_FLOPS_PER_BYTE = 2000
"""Cost model (:func:`action_costs`): the FLOPs a device runs in the time one byte is
all-gathered. An H100 SXM does ~989 dense bf16 TFLOP/s and all-gathers at ~450 GB/s per GPU
over NVLink: ~2,200. Across nodes (tens of GB/s per GPU) it is ten times more, which makes
recomputing still cheaper relative to resharding."""

MEMORY_FLOPS_PER_BYTE = 300
"""Cost model: the FLOPs a device runs in the time it reads or writes one byte of its memory
(H100 SXM: 989 TFLOP/s over 3.35 TB/s, ~295), the time of a memory-bound op per byte."""

HOST_LINK_FLOPS_PER_BYTE = 18_000
"""Cost model of CPU offload: the FLOPs a device runs in the time one byte crosses between host
and device memory (PCIe Gen5 x16, ~55 GB/s achieved per direction: 989 TFLOP/s / 55 GB/s)."""

HOST_OPTIMIZER_FLOPS_PER_BYTE = 50_000
"""Cost model of CPU offload: the FLOPs a device runs in the time the host's optimizer step reads
or writes one byte (AdamW on CPU at ~20 GB/s of host memory per rank: 989 TFLOP/s / 20 GB/s)."""

DEVICE_FLOPS = 989e12
"""The device the cost model's FLOPs are counted on (an H100 SXM's dense bf16 FLOP/s): how
``auto``'s log turns its modelled added FLOPs into milliseconds."""


def auto_budget_bytes(budget_gib: float | None, device_bytes: float | None) -> tuple[int, str]:
    """The per-rank budget of ``auto`` in bytes and where it comes from: ``budget_gib`` when
    set, else :data:`AUTO_DEVICE_FRACTION` of the device's ``device_bytes``. Raises
    ``ValueError`` (naming the key) when neither is known."""
    if budget_gib is not None:
        return int(budget_gib * GIB), f"parallelism.memory_budget_gib = {budget_gib:g}"
    if device_bytes is not None:
        return int(device_bytes * AUTO_DEVICE_FRACTION), (
            f"{AUTO_DEVICE_FRACTION:.0%} of the device's {device_bytes / GIB:.3g} GiB; "
            "parallelism.memory_budget_gib unset")
    raise ValueError("parallelism.memory_budget_gib: unset; reshard_after_forward_mode = 'auto' needs a "
                     "per-rank memory budget without a CUDA device (e.g. 16 for 16 GiB; the estimator "
                     "also takes --device_memory_gib)")


@dataclass(frozen=True)
class AutoReshardPlan:
    """What ``reshard_after_forward_mode = "auto"`` chose, and why."""

    units: tuple[str, ...]
    """The FSDP units in forward order."""
    reshard: tuple[bool, ...]
    """``reshard_after_forward`` of each unit: the mode to give ``apply_fsdp``."""
    order: tuple[str, ...]
    """The order in which units are resharded as the budget tightens: the re-gather cheapest to
    hide behind backward compute first."""
    budget: int
    """Per-rank budget in bytes."""
    estimate: MemoryEstimate
    """The estimate of the chosen plan."""
    tried: tuple[tuple[int, int], ...]
    """``(units resharded, estimated peak)`` of every estimate made, in order; the first is
    ``never``'s (with the configured checkpointing)."""
    count_offloaded: bool
    """Whether the budget covers CPU-offloaded state too (a CPU-only job: one memory)."""
    headroom: int
    """Bytes kept free below the budget: one unit's gathered parameters or gradients (see
    :func:`plan_auto_reshard`)."""
    seconds: float
    """Wall time of the search."""
    blocks: tuple[str, ...] = ()
    """The blocks (those units that are blocks), in forward order."""
    ac_policies: tuple[str, ...] = ()
    """The activation checkpointing of each block: ``none``, ``op`` or ``full``, to give
    :func:`~torchtitan_lite.distributed.activation_checkpoint.apply_activation_checkpointing`."""
    configured_ac: tuple[str, ...] = ()
    """Each block's checkpointing as configured: ``auto`` recomputes at least that much."""
    actions: tuple[tuple[str, float, float], ...] = ()
    """``(action, added FLOPs per micro-batch, bytes freed)`` of what was taken, in order:
    ``"reshard layers.3"``, ``"op layers.0"``, ``"full layers.0"``."""
    added_flops: float = 0.0
    """The modelled added step time of the plan per micro-batch, in device FLOPs."""
    offload: tuple[bool, ...] = ()
    """Whether each unit's shards, gradients and optimizer state live on CPU (forward order):
    chosen per unit with ``parallelism.cpu_offload = "auto"``, else the job's setting for all."""
    offload_chosen: bool = False
    """Whether ``auto`` chose the offload per unit (``parallelism.cpu_offload = "auto"``)."""

    def applied_to(self, shape: JobShape) -> JobShape:
        """``shape`` with this plan's per-unit resharding, offload and checkpointing (what the
        model, and a reference copy built like it, are built with)."""
        return shape.replace(reshard_after_forward_mode=self.reshard, cpu_offload=self.offload,
                             ac_policies=self.ac_policies)

    @property
    def offloaded(self) -> tuple[str, ...]:
        """Names of the units whose state lives on CPU."""
        return tuple(name for name, flag in zip(self.units, self.offload, strict=True) if flag)

    def offloaded_text(self) -> str:
        """``"2 of 8 units (tok_embeddings, norm+output)"``, or ``none``."""
        return f"{sum(self.offload)} of {len(self.units)} units ({_ranges(self.offloaded)})" if any(self.offload) \
            else "none"

    @property
    def added_ms(self) -> float:
        """:attr:`added_flops` as milliseconds per micro-batch on the cost model's device."""
        return self.added_flops / DEVICE_FLOPS * 1e3

    @property
    def never_peak(self) -> int:
        """Estimated peak with no unit resharded (``never``)."""
        return self.tried[0][1]

    @property
    def peak(self) -> int:
        """The chosen plan's estimated peak, as compared with the budget."""
        return _compared(self.estimate, self.count_offloaded)[0]

    @property
    def resharded(self) -> tuple[str, ...]:
        """Names of the units that reshard after forward."""
        return tuple(name for name, flag in zip(self.units, self.reshard, strict=True) if flag)

    @property
    def all_gathers_per_step(self) -> int:
        """All-gathers per optimizer step: every unit in each micro-batch's forward, the
        resharded ones again in its backward."""
        return (len(self.units) + sum(self.reshard)) * self.estimate.grad_accum_steps

    def resharded_text(self) -> str:
        """``"3 of 8 units (tok_embeddings, layers.0-1)"``: numbered units in ranges."""
        return f"{sum(self.reshard)} of {len(self.units)} units ({_ranges(self.resharded)})"

    def recomputed_text(self) -> str:
        """``"op on 6 of 6 blocks (layers.0-5)"``: the checkpointing ``auto`` added, or ``none``."""
        return _policies_text(self.ac_policies, self.configured_ac, list(self.blocks))

    @property
    def recomputed(self) -> bool:
        """Whether ``auto`` added activation checkpointing to what was configured."""
        return self.ac_policies != self.configured_ac

    def summary(self) -> str:
        """One log line: budget, the choice and its estimate."""
        est = self.estimate
        per_micro_batch = f" per micro-batch, × {est.grad_accum_steps}" if est.grad_accum_steps > 1 else ""
        where = where_text(*_compared(est, self.count_offloaded)[1:])
        stage = f"pp rank {est.pipeline_rank}'s stages: " if est.pipeline_degree > 1 else ""
        return (f"reshard_after_forward_mode auto: {stage}budget {size_text(self.budget)} per rank, of which "
                f"{size_text(self.headroom)} headroom for a late-freed collective buffer; without "
                f"resharding or added recomputation the estimated peak is {size_text(self.never_peak)}; resharding "
                f"{self.resharded_text()}, activation checkpointing added: {self.recomputed_text()}"
                + (f", CPU offload: {self.offloaded_text()}" if self.offload_chosen else "")
                + " -> estimated peak "
                f"{size_text(self.peak)} in {where}; {self.all_gathers_per_step} all-gathers per step "
                f"({len(self.units)} forward + {sum(self.reshard)} backward{per_micro_batch}); "
                f"modelled added time {self.added_flops / 1e9:.3g} GFLOP per micro-batch "
                f"({self.added_ms:.3g} ms at {DEVICE_FLOPS / 1e12:.0f} TFLOP/s); "
                f"{len(self.tried)} estimates in {self.seconds:.1f} s")


def plan_auto_reshard(
    spec: ModelSpec,
    args: Any,
    shape: JobShape | None = None,
    *,
    budget_bytes: int,
    count_offloaded: bool = False,
    budget_source: str = "",
    timeout_s: float | None = None,
    pipeline_rank: int = 0,
    **fields: Any,
) -> AutoReshardPlan:
    """Choose ``reshard_after_forward`` per FSDP unit and activation checkpointing per block so
    that the estimated peak per rank stays within ``budget_bytes`` at the least added step time.
    The checkpointing configured by ``ac_mode`` and ``selective_ac_option`` is the least each
    block gets: ``auto`` only adds recomputation. Every estimate trains what the job trains
    (``lora``: the adapters only, the base frozen).

    - Nothing is changed when everything fits (``never``: one all-gather per unit and
      micro-batch, nothing recomputed beyond what is configured).
    - Otherwise ``auto`` takes actions one by one, least added time per byte freed first, by
      the cost model of :func:`action_costs` (recomputed FLOPs against re-gathered bytes that
      backward compute cannot hide):

      - reshard unit ``i`` after forward: frees its gathered parameters; costs the part of its
        re-gather in backward that sticks out of the next unit's backward compute (nothing for
        a large model at long sequences, all of it for the last unit);
      - ``op`` on a block: frees the outputs of its cheap ops (measured by one estimate with
        every block at ``op``), costs re-running those memory-bound ops;
      - ``full`` on a block: frees the rest of its activations (one estimate with every block
        at ``full``), costs one more forward of the block.

      Units of equal cost per byte keep this order: larger units first; among the blocks the
      re-gather cheapest to hide first (ties to the earlier unit); then the units gathered at
      the peak of ``never`` whatever their setting (the unit running there and the one FSDP2
      prefetches next: resharding them frees nothing there); the last unit (final norm and
      output) last of all. Checkpointing goes block by block in forward order, a block's
      ``op`` before its ``full``.

    - The smallest number of actions whose estimate fits is found by bisection, the first probe
      guessed from the bytes each action frees; every candidate is a full
      :func:`estimate_memory` of that plan (fake tensors, fake process group).

    A plan fits when its estimated peak plus a headroom of the largest unit's gathered
    parameters or gradients (in the wider of the parameter and reduce dtypes) is within the
    budget: an all-gather or reduce-scatter buffer can be released by the communication
    library's thread a little after FSDP2 lets go of it, and measured peaks of real steps on
    gloo exceed the estimate by one such buffer in some runs and not in others.

    With ``cpu_offload = "auto"`` a third kind of action joins them: offload unit ``i``'s
    sharded parameters, gradients and optimizer state to CPU (frees all of them on the device;
    costs their host↔device copies and the host's optimizer step, see :func:`action_costs`).

    The peak compared is the device's (``device_peak``); with ``count_offloaded`` (a CPU-only
    job, where offloaded state shares the same memory) the total ``peak``, except with
    ``cpu_offload = "auto"``, where the budget is the device's whatever the machine. Raises
    ``ValueError`` naming ``parallelism.memory_budget_gib`` (and ``budget_source``, where the
    budget came from) when even resharding every unit and fully recomputing every block does not
    fit. Runs in a child process when
    this one already holds a process group, for at most ``timeout_s`` seconds (``RuntimeError``
    after that). With a pipeline (``pipeline``), the plan is of pipeline rank ``pipeline_rank``'s
    stages: its units and its estimate (a zero-bubble schedule's plan reshards nothing and only
    adds full checkpointing, which recomputes a block in each of its two backward passes). With
    ``expert_parallel`` above 1 each MoE layer's experts, their own FSDP unit
    over the expert-data ranks, follow their block's reshard and offload setting, and a block's
    gathered parameters (what resharding frees, the headroom, the re-gather's cost) hold
    ``1 / expert_parallel`` of its experts; with ``tensor_parallel`` above 1, ``1 /
    tensor_parallel`` of its other parameters (the data-parallel ranks are the world's over
    ``tensor_parallel``). With online RL (``rollout``) each estimate is of a GRPO step, its
    generation included: resharding a unit also frees it between decode steps, but nothing here
    shrinks the KV cache (``grpo.generation_batch_size`` does).
    """
    shape = modelled((shape or JobShape()).replace(**fields))
    check_arguments(shape.replace(reshard_after_forward_mode="never"), args)
    kwargs: dict[str, Any] = {"budget_bytes": budget_bytes, "count_offloaded": count_offloaded,
                              "budget_source": budget_source, "shape": shape, "pipeline_rank": pipeline_rank}
    if not budget_bytes > 0:
        raise ValueError(f"budget_bytes: invalid value {budget_bytes!r}; expected a number > 0")
    import torch.distributed as dist

    # (Reported from here: a child process's log lines would not reach the job's log.)
    with Progress(f"planning reshard_after_forward_mode 'auto' under {budget_bytes / 2**30:.2f} GiB per rank "
                  "(memory estimates of candidate plans)"):
        if dist.is_available() and dist.is_initialized():
            return in_child_process(plan_here, spec, args, kwargs, timeout_s=timeout_s)
        return plan_here(spec, args, **kwargs)


def job_auto_shape(plan: JobPlan) -> JobShape:
    """The shape :func:`plan_auto_reshard` takes for a job: that of
    :func:`~torchtitan_lite.memory.estimate.job_estimate_shape`, with ``cpu_offload = "auto"``
    when ``parallelism.cpu_offload`` asks ``auto`` to choose it per unit."""
    shape = job_estimate_shape(plan)
    return shape.replace(cpu_offload="auto") if plan.shape.cpu_offload == "auto" else shape


def auto_headroom_bytes(spec: ModelSpec, args: Any, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> int:
    """What ``auto`` keeps free below its budget: the largest FSDP unit's gathered parameters or
    gradients, in the wider of the two dtypes (see :func:`plan_auto_reshard`)."""
    return _headroom(_units(spec, args), param_dtype, reduce_dtype)


def _units(spec: ModelSpec, args: Any, expert_parallel: int = 1, tensor_parallel: int = 1,
           pipeline: PipelinePlan | None = None, pipeline_rank: int = 0) -> list[_PlanUnit]:
    """The FSDP units of the model ``args`` of family ``spec`` (built on the meta device), each
    sized as a rank sees it under expert and tensor parallel (:class:`_PlanUnit`); with a
    ``pipeline``, those of pipeline rank ``pipeline_rank``'s stages."""
    model = spec.meta_model(args)
    if pipeline is not None:
        prune_to_stages(model, pipeline, pipeline_rank)
    units = fsdp_units(model, **spec.fsdp_units(model))
    if expert_parallel == 1 and tensor_parallel == 1:
        return [_PlanUnit(u.name, u.role, u.numel(), u.numel()) for u in units]
    from torchtitan_lite.models.moe import GroupedExperts

    split_ids = set()
    if tensor_parallel > 1:
        from torchtitan_lite.distributed.tensor_parallel import split_modules

        split_ids = {id(p) for module in split_modules(model) for p in module.parameters()}

    def plan_unit(unit: FSDPUnit) -> _PlanUnit:
        params = {id(p): p for m in unit.modules for p in m.parameters()}
        expert_ids = {id(p) for m in unit.modules for sub in m.modules() if isinstance(sub, GroupedExperts)
                      for p in sub.parameters()}
        split = sum(p.numel() for i, p in params.items() if i in split_ids)  # split over tp
        experts = sum(params[i].numel() for i in expert_ids if i in params)
        whole = unit.numel() - split - experts  # whole on every rank
        # Over the dp_shard ranks the unit holds every expert (the experts' mesh is dp_shard / ep).
        return _PlanUnit(unit.name, unit.role, gathered=split // tensor_parallel + whole + experts // expert_parallel,
                         held=split // tensor_parallel + whole + experts)

    return [plan_unit(u) for u in units]


@dataclass(frozen=True)
class _PlanUnit:
    """An FSDP unit as ``auto`` sizes it: the parameters a rank gathers (under expert or tensor
    parallel: its experts, its part of the tensor-parallel split)."""

    name: str
    role: str
    gathered: int
    held: int
    """The parameters the unit's data-parallel shard ranks hold together (each ``1 / dp_shard``)."""

    def numel(self) -> int:
        return self.gathered


def _headroom(units: list[Any], param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> int:
    return max(u.numel() for u in units) * max(param_dtype.itemsize, reduce_dtype.itemsize)


def _compared(est: MemoryEstimate, count_offloaded: bool) -> tuple[int, str, str]:
    """The peak ``auto`` compares with its budget, and its phase and module: the device's, or
    with ``count_offloaded`` the total."""
    if count_offloaded:
        return est.peak, est.peak_phase, est.peak_module
    return est.device_peak, est.device_peak_phase, est.device_peak_module


def _reshard_order(units: list[Any], args: Any, *, seq_len: int, param_bytes: int,
                   reduce_bytes: int, busy: frozenset[int] = frozenset()) -> list[int]:
    """Unit indices in the order ``auto`` reshards them (see :func:`plan_auto_reshard`);
    ``busy`` units, gathered at the peak whatever their setting, come after the others."""

    def backward_flops_per_token(unit: Any) -> float:
        flops = 4 * unit.numel()  # input and weight gradients: twice the forward's 2 per parameter
        if unit.role == "block":
            flops += args.attention_flops_per_token(seq_len) * 2 / 3  # the backward share
        return flops

    def exposure(i: int) -> float:
        # Unit i's re-gather is issued when unit i + 1's backward starts, behind the
        # reduce-scatter unit i + 2 has just issued on the same communicator; both hide behind
        # unit i + 1's backward compute.
        if i + 1 >= len(units):
            return math.inf
        queued = units[i + 2].numel() * reduce_bytes if i + 2 < len(units) else 0
        return (units[i].numel() * param_bytes + queued) / backward_flops_per_token(units[i + 1])

    last = len(units) - 1 if units and units[-1].role == "last" else None
    return sorted(range(len(units)), key=lambda i: (i == last, i in busy, -units[i].numel(), exposure(i), i))


def _busy_units(units: list[Any], phase: str, module: str) -> frozenset[int]:
    """Units whose parameters are gathered at a peak in ``module`` during ``phase`` whatever
    their reshard setting: the unit running there and the one FSDP2 prefetches next (the
    previous unit in backward, the next one in forward)."""
    if phase not in ("forward", "backward"):
        return frozenset()
    for i, unit in enumerate(units):
        if any(module == name or module.startswith(name + ".") for name in unit.name.split("+")):
            prefetched = i - 1 if phase == "backward" else i + 1
            return frozenset(j for j in (i, prefetched) if 0 <= j < len(units))
    return frozenset()


@dataclass(frozen=True)
class _Action:
    """One step ``auto`` can take to lower the peak, with its modelled cost and benefit."""

    kind: str
    """``reshard`` (unit ``index`` reshards after forward), ``op`` or ``full`` (block ``index``
    is checkpointed with that policy)."""
    index: int
    cost: float
    """Added step time per micro-batch, in FLOPs of the device (see :func:`action_costs`)."""
    freed: float
    """Bytes it frees at the peak (estimated)."""

    @property
    def rate(self) -> float:
        """Added time per byte freed: the order ``auto`` takes actions in."""
        return self.cost / self.freed if self.freed > 0 else math.inf


def _policies_text(policies: tuple[str, ...], base: tuple[str, ...], names: list[str]) -> str:
    """``"op on 6 of 6 blocks (layers.0-5), full on 2 (layers.0-1)"``: what ``auto`` added."""
    parts = []
    for policy in ("op", "full"):
        added = [names[j] for j, (p, b) in enumerate(zip(policies, base, strict=True)) if p == policy != b]
        if added:
            parts.append(f"{policy} on {len(added)} of {len(policies)} blocks ({_ranges(added)})")
    return ", ".join(parts) or "none"


def _ranges(names: Any) -> str:
    """``"tok_embeddings, layers.0-1"``: numbered names in ranges."""
    groups: list[list[Any]] = []  # [prefix, first, last] or [name]
    for name in names:
        prefix, _, number = name.rpartition(".")
        if number.isdigit() and groups and len(groups[-1]) == 3 and groups[-1][0] == prefix \
                and groups[-1][2] + 1 == int(number):
            groups[-1][2] = int(number)
        elif number.isdigit():
            groups.append([prefix, int(number), int(number)])
        else:
            groups.append([name])
    return ", ".join(g[0] if len(g) == 1 else f"{g[0]}.{g[1]}" + (f"-{g[2]}" if g[2] > g[1] else "")
                     for g in groups) or "none"


def action_costs(units: list[Any], args: Any, *, tokens: int, seq_len: int, param_bytes: int,
                 reduce_bytes: int, op_bytes_per_block: float, dp_shard: int = 1, grad_accum_steps: int = 1,
                 trainable: bool = True) -> dict[tuple[str, int], float]:
    """The cost model of ``auto``: the step time each action adds, per micro-batch of
    ``tokens`` tokens per rank, in FLOPs of the device (time × its FLOP/s).

    - ``("reshard", i)``: unit ``i``'s parameters are all-gathered again in backward. The
      re-gather is issued when unit ``i + 1``'s backward starts, queued behind the
      reduce-scatter unit ``i + 2`` has just issued, and both hide behind unit ``i + 1``'s
      backward compute; only what sticks out costs time::

          max(0, (gathered bytes of unit i + reduce-scatter bytes of unit i + 2) × COMM_FLOPS_PER_BYTE
                 − backward FLOPs of unit i + 1)

      The last unit (norm and output) has nothing to hide behind: all of it.
    - ``("op", j)``: block ``j`` recomputes its cheap ops (norms, RoPE, activations). Those are
      memory-bound, so they take the time of the bytes they write and read again:
      ``2 × op_bytes_per_block × MEMORY_FLOPS_PER_BYTE``, where ``op_bytes_per_block`` is what
      the estimator found ``op`` frees per block.
    - ``("full", j)``: block ``j`` reruns its whole forward: on top of ``op``'s ops, its
      matmuls and attention, ``2 × parameters + attention forward`` FLOPs per token (the cost
      given is that increment over ``op``).
    - ``("offload", i)``: unit ``i``'s shards (fp32: 4 bytes a parameter, over ``dp_shard``
      ranks) cross to the device before its forward and its backward all-gathers, its gradient
      shard (``reduce_bytes``) back after the reduce-scatter, at
      ``HOST_LINK_FLOPS_PER_BYTE``; and the host runs its optimizer step, 28 bytes a parameter
      read or written (parameter, gradient and AdamW's two moments read; the parameter and the
      moments written) at ``HOST_OPTIMIZER_FLOPS_PER_BYTE``, once per step (so divided over
      ``grad_accum_steps`` micro-batches). Nothing of it is counted as hidden behind compute.
      ``trainable=False`` (LoRA's frozen base): the shards' copies only.

    A unit's backward is ``4 × parameters`` FLOPs per token (input and weight gradients) plus,
    for a block, two thirds of its attention's training FLOPs.
    """
    def backward_flops(unit: Any) -> float:
        flops = 4 * unit.numel()
        if unit.role == "block":
            flops += args.attention_flops_per_token(seq_len) * 2 / 3
        return flops * tokens

    costs: dict[tuple[str, int], float] = {}
    for i, unit in enumerate(units):
        moved = unit.numel() * param_bytes
        if i + 2 < len(units):
            moved += units[i + 2].numel() * reduce_bytes
        hidden = backward_flops(units[i + 1]) if i + 1 < len(units) else 0.0
        costs[("reshard", i)] = max(0.0, moved * COMM_FLOPS_PER_BYTE - hidden)
    op = 2 * op_bytes_per_block * MEMORY_FLOPS_PER_BYTE
    blocks = [u for u in units if u.role == "block"]
    for j, block in enumerate(blocks):
        forward = (2 * block.numel() + args.attention_flops_per_token(seq_len) / 3) * tokens
        costs[("op", j)] = op
        costs[("full", j)] = forward
    for i, unit in enumerate(units):
        # What the unit's shard ranks hold: a plan unit's ``held``; a plain FSDP unit holds its parameters
        shard = getattr(unit, "held", unit.numel()) / dp_shard
        crossing = 2 * 4 * shard + (reduce_bytes * shard if trainable else 0.0)
        host_step = 28 * shard / grad_accum_steps if trainable else 0.0
        costs[("offload", i)] = crossing * HOST_LINK_FLOPS_PER_BYTE + host_step * HOST_OPTIMIZER_FLOPS_PER_BYTE
    return costs


def plan_here(spec: ModelSpec, args: Any, *, budget_bytes: int, count_offloaded: bool, budget_source: str,
              shape: JobShape, pipeline_rank: int = 0) -> AutoReshardPlan:
    """:func:`plan_auto_reshard` in this process (which must hold no process group)."""
    start = time.perf_counter()
    pipeline = shape.pipeline
    units = _units(spec, args, shape.expert_parallel, shape.tensor_parallel, pipeline, pipeline_rank)
    n = len(units)
    block_units = [i for i, u in enumerate(units) if u.role == "block"]
    names = [units[i].name for i in block_units]
    base = tuple(block_policies(shape.ac_mode, shape.selective_ac_option, len(block_units)))
    headroom = _headroom(units, shape.param_dtype, shape.reduce_dtype)
    limit = budget_bytes - headroom
    offload_setting = shape.cpu_offload
    choose_offload = offload_setting == "auto"
    if choose_offload:
        count_offloaded = False  # the budget is the device's: offloading is what frees it
    base_offload = (False,) * n if choose_offload else (bool(offload_setting),) * n
    Choice = tuple[tuple[bool, ...], tuple[str, ...], tuple[bool, ...]]
    estimates: dict[Choice, MemoryEstimate] = {}

    def peak(plan: Choice) -> int:
        if plan not in estimates:
            estimates[plan] = estimate_here(spec, args, shape.replace(reshard_after_forward_mode=plan[0],
                                                                      ac_policies=plan[1], cpu_offload=plan[2]),
                                            pp_rank=pipeline_rank)
        return _compared(estimates[plan], count_offloaded)[0]

    never_plan: Choice = ((False,) * n, base, base_offload)
    never = peak(never_plan)
    _, phase, module = _compared(estimates[never_plan], count_offloaded)
    order = _reshard_order(units, args, seq_len=shape.seq_len, param_bytes=shape.param_dtype.itemsize,
                           reduce_bytes=shape.reduce_dtype.itemsize, busy=_busy_units(units, phase, module))
    actions: list[_Action] = []
    # A zero-bubble schedule runs each backward in two passes: every unit stays gathered (no
    # reshard to choose) and per-op checkpointing, which allows one backward, is not an action.
    splits = pipeline is not None and pipeline.splits_backward
    if never > limit:
        # What each checkpointing step frees, from the estimates of every block at op and at full.
        stronger = {"none": 0, "op": 1, "full": 2}
        raised = {p: tuple(max(b, p, key=stronger.__getitem__) for b in base) for p in ("op", "full")}
        freed = {"none": 0.0, "op": 0.0}
        for policy in ("full",) if splits else ("op", "full"):
            changed = sum(b != p for b, p in zip(base, raised[policy], strict=True))
            freed[policy] = (never - peak(((False,) * n, raised[policy], base_offload))) / changed \
                if changed else 0.0
        resolved = ParallelDims.resolve(
            world_size=shape.world_size,
            dp_replicate=shape.dp_replicate,
            dp_shard=-1,
            tp=shape.tensor_parallel,
            cp=shape.context_parallel,
        )
        dp_shard = resolved.dp_shard * resolved.cp  # the ranks FSDP shards over
        trainable = shape.lora is None
        # (a rank's tokens: its share of each sequence under context parallel)
        costs = action_costs(units, args, tokens=shape.local_batch_size * shape.seq_len // resolved.cp,
                             seq_len=shape.seq_len, param_bytes=shape.param_dtype.itemsize,
                             reduce_bytes=shape.reduce_dtype.itemsize,
                             op_bytes_per_block=max(freed["op"], 0.0), dp_shard=dp_shard,
                             grad_accum_steps=shape.grad_accum_steps, trainable=trainable)
        busy = _busy_units(units, phase, module)
        for i in () if splits else order:
            gathered = 0 if i in busy else units[i].numel() * shape.param_dtype.itemsize
            actions.append(_Action("reshard", i, costs[("reshard", i)], gathered))
        for j, policy in enumerate(base):
            op = _Action("op", j, costs[("op", j)], max(freed["op"], 0.0))
            if policy == "op":
                actions.append(_Action("full", j, costs[("full", j)], max(freed["full"], 0.0)))
            elif policy == "none" and splits:  # (recomputed in both passes of each backward)
                actions.append(_Action("full", j, op.cost + 2 * costs[("full", j)], max(freed["full"], 0.0)))
            elif policy == "none":
                full = _Action("full", j, costs[("full", j)], max(freed["full"] - op.freed, 0.0))
                if full.rate < op.rate:  # full frees more per added time: one step, no op first
                    actions.append(_Action("full", j, op.cost + full.cost, op.freed + full.freed))
                else:
                    actions += [op, full]
        if choose_offload:
            # Freed: the fp32 shards, and for a trained unit its gradients and AdamW's two moments.
            for i in sorted(range(n), key=lambda i: -units[i].numel()):
                state = units[i].held / dp_shard * (16 if trainable else 4)
                actions.append(_Action("offload", i, costs[("offload", i)], state))
        # Least added time per byte freed first (a block's op before its full: its rate is
        # lower, and the sort is stable).
        position = {id(a): k for k, a in enumerate(actions)}
        actions.sort(key=lambda a: (a.rate, position[id(a)]))

    def plan(k: int) -> Choice:
        reshard = [False] * n
        policies = list(base)
        offload = list(base_offload)
        for action in actions[:k]:
            if action.kind == "reshard":
                reshard[action.index] = True
            elif action.kind == "offload":
                offload[action.index] = True
            elif action.kind == "full" or policies[action.index] == "none":
                policies[action.index] = action.kind
        return tuple(reshard), tuple(policies), tuple(offload)

    k = 0
    if never > limit:
        # Bisection on the number of actions taken (fits(lo) is false; fits(hi) is assumed,
        # and checked at the end when nothing smaller fitted); the first probe assumes each
        # action frees what it is expected to, the second checks the neighbour that would
        # settle it.
        total, guess = 0.0, len(actions)
        for count, action in enumerate(actions, start=1):
            total += action.freed
            if never - total <= limit:
                guess = count
                break
        lo, hi = 0, len(actions)

        def probe(mid: int) -> bool:
            """Narrow ``(lo, hi)`` with an estimate at ``mid``; False when ``mid`` is outside."""
            nonlocal lo, hi
            if not lo < mid < hi:
                return False
            lo, hi = (lo, mid) if peak(plan(mid)) <= limit else (mid, hi)
            return True

        if guess == len(actions) and peak(plan(guess)) <= limit:
            probe(guess - 1)  # expected not to fit with less: settle that first
        elif probe(guess):
            probe(guess - 1 if hi == guess else guess + 1)
        while hi - lo > 1 and peak(plan(hi)) <= limit:
            probe((lo + hi) // 2)
        k = hi
        if peak(plan(k)) > limit:  # only when k is every action: nothing fits
            source = f" ({budget_source})" if budget_source else ""
            stages = f"pipeline rank {pipeline_rank}'s stages: " if pipeline is not None else ""
            generating = _compared(estimates[plan(k)], count_offloaded)[1] == "generation"
            raise ValueError(
                f"parallelism.memory_budget_gib: {stages}the estimated peak is {size_text(peak(plan(k)))} per rank "
                + ("in generation (its KV cache), " if generating else "")
                + (f"even with every block fully recomputed ({pipeline.schedule} keeps every unit gathered)"
                   if splits and pipeline is not None else
                   "even with every unit resharded after forward and every block fully recomputed")
                + (" and every unit offloaded to CPU" if choose_offload else "") + ", plus "
                f"{size_text(headroom)} of headroom for a collective buffer: above the budget of "
                f"{size_text(budget_bytes)}{source}; allow more memory, or need less (smaller "
                + ("grpo.generation_batch_size, " if generating else "")
                + "training.local_batch_size or seq_len, bf16 mixed precision, "
                + ("more ranks)" if choose_offload else "parallelism.cpu_offload = 'auto', more ranks)"))
    chosen = plan(k)
    cost = sum(a.cost for a in actions[:k])
    return AutoReshardPlan(
        units=tuple(u.name for u in units), reshard=chosen[0], order=tuple(units[i].name for i in order),
        budget=budget_bytes, estimate=estimates[chosen],
        tried=tuple((sum(p[0]), _compared(e, count_offloaded)[0]) for p, e in estimates.items()),
        count_offloaded=count_offloaded, headroom=headroom, seconds=time.perf_counter() - start,
        blocks=tuple(names), ac_policies=chosen[1], configured_ac=base,
        actions=tuple((f"{a.kind} {names[a.index] if a.kind in ('op', 'full') else units[a.index].name}", a.cost,
                       a.freed) for a in actions[:k]),
        added_flops=cost, offload=chosen[2], offload_chosen=choose_offload,
    )
