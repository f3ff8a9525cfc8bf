"""``reshard_after_forward_mode = "auto"``: per FSDP unit, the fewest reshards whose estimated peak
fits a memory budget (:func:`plan_auto_reshard`). The trainer imports this module only for
``auto``."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_lite.distributed.fsdp import FSDPUnit, fsdp_units
from torchtitan_lite.memory.estimate import (
    GIB,
    MemoryEstimate,
    check_arguments,
    estimate_here,
    in_child_process,
    size_text,
    where_text,
)
from torchtitan_lite.models.spec import ModelSpec

__all__ = ["AUTO_DEVICE_FRACTION", "AutoReshardPlan", "auto_budget_bytes", "auto_headroom_bytes",
           "plan_auto_reshard"]

AUTO_DEVICE_FRACTION = 0.9
"""Share of a CUDA device's memory ``auto`` budgets for tensors when no budget is given; the
rest is for the caching allocator's slack, the CUDA context and communication buffers."""


def auto_budget_bytes(budget_gib: float | None, device_bytes: float | None) -> tuple[int, str]:
    """The per-rank budget of ``auto`` in bytes and where it comes from: ``budget_gib`` when
    set, else :data:`AUTO_DEVICE_FRACTION` of the device's ``device_bytes``. Raises
    ``ValueError`` (naming the key) when neither is known."""
    if budget_gib is not None:
        return int(budget_gib * GIB), f"parallelism.memory_budget_gib = {budget_gib:g}"
    if device_bytes is not None:
        return int(device_bytes * AUTO_DEVICE_FRACTION), (
            f"{AUTO_DEVICE_FRACTION:.0%} of the device's {device_bytes / GIB:.1f} GiB; "
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
    ``never``'s."""
    count_offloaded: bool
    """Whether the budget covers CPU-offloaded state too (a CPU-only job: one memory)."""
    headroom: int
    """Bytes kept free below the budget: one unit's gathered parameters or gradients (see
    :func:`plan_auto_reshard`)."""
    seconds: float
    """Wall time of the search."""

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
        groups: list[list[Any]] = []  # [prefix, first, last] or [name]
        for name in self.resharded:
            prefix, _, number = name.rpartition(".")
            if number.isdigit() and groups and len(groups[-1]) == 3 and groups[-1][0] == prefix \
                    and groups[-1][2] + 1 == int(number):
                groups[-1][2] = int(number)
            elif number.isdigit():
                groups.append([prefix, int(number), int(number)])
            else:
                groups.append([name])
        names = ", ".join(g[0] if len(g) == 1 else f"{g[0]}.{g[1]}" + (f"-{g[2]}" if g[2] > g[1] else "")
                          for g in groups)
        return f"{sum(self.reshard)} of {len(self.units)} units ({names or 'none'})"

    def summary(self) -> str:
        """One log line: budget, the choice and its estimate."""
        est = self.estimate
        per_micro_batch = f" per micro-batch, × {est.grad_accum_steps}" if est.grad_accum_steps > 1 else ""
        where = where_text(*_compared(est, self.count_offloaded)[1:])
        return (f"reshard_after_forward_mode auto: budget {size_text(self.budget)} per rank, of which "
                f"{size_text(self.headroom)} headroom for a late-freed collective buffer; without "
                f"resharding the estimated peak is {size_text(self.never_peak)}; resharding "
                f"{self.resharded_text()} -> estimated peak "
                f"{size_text(self.peak)} in {where}; {self.all_gathers_per_step} all-gathers per step "
                f"({len(self.units)} forward + {sum(self.reshard)} backward{per_micro_batch}); "
                f"{len(self.tried)} estimates "
                f"in {self.seconds:.1f} s")


def plan_auto_reshard(
    spec: ModelSpec,
    args: Any,
    *,
    budget_bytes: int,
    count_offloaded: bool = False,
    budget_source: str = "",
    timeout_s: float | None = None,
    world_size: int,
    dp_replicate: int = 1,
    local_batch_size: int,
    seq_len: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool,
    optimizer: str = "AdamW",
    optimizer_implementation: str = "foreach",
    grad_accum_steps: int = 1,
    ac_mode: str = "none",
    selective_ac_option: str | int = "op",
) -> AutoReshardPlan:
    """Choose ``reshard_after_forward`` per FSDP unit so that the estimated peak per rank stays
    within ``budget_bytes`` with the fewest all-gathers, for the model checkpointed by
    ``ac_mode`` and ``selective_ac_option`` (as configured; every estimate includes it).

    - Nothing is resharded when everything fits (``never``: one all-gather per unit and
      micro-batch).
    - Otherwise units are resharded one by one in this order:

      - larger units first: each reshard costs one all-gather in backward, and a larger unit
        frees more memory for it;
      - among units of one size (the blocks), the re-gather cheapest to hide first. FSDP2
        issues unit ``i``'s re-gather when unit ``i + 1``'s backward starts, queued behind the
        reduce-scatter unit ``i + 2`` has just issued, so the cost is those bytes over unit
        ``i + 1``'s backward FLOPs; ties go to the earlier unit, which holds its parameters
        longest;
      - after all of those, the units gathered at the peak of ``never`` whatever their
        setting (the unit running there and the one FSDP2 prefetches next): resharding them
        frees nothing there;
      - the last unit (final norm + output) last of all: backward needs it first, with nothing
        to hide its re-gather behind, and it is gathered again at the start of backward, where
        the peak usually is.

    - The smallest number of resharded units whose estimate fits is found by bisection, the
      first probe guessed from the bytes each unit frees; every candidate is a full
      :func:`estimate_memory` of that plan (fake tensors, fake process group).

    A plan fits when its estimated peak plus a headroom of the largest unit's gathered
    parameters or gradients (in the wider of the parameter and reduce dtypes) is within the
    budget: an all-gather or reduce-scatter buffer can be released by the communication
    library's thread a little after FSDP2 lets go of it, and measured peaks of real steps on
    gloo exceed the estimate by one such buffer in some runs and not in others.

    The peak compared is the device's (``device_peak``); with ``count_offloaded`` (a CPU-only
    job, where offloaded state shares the same memory) the total ``peak``. Raises
    ``ValueError`` naming ``parallelism.memory_budget_gib`` (and ``budget_source``, where the
    budget came from) when even resharding every unit does not fit. Runs in a child process when
    this one already holds a process group, for at most ``timeout_s`` seconds (``RuntimeError``
    after that).
    """
    kwargs: dict[str, Any] = {
        "budget_bytes": budget_bytes, "count_offloaded": count_offloaded, "budget_source": budget_source,
        "world_size": world_size,
        "dp_replicate": dp_replicate, "local_batch_size": local_batch_size, "seq_len": seq_len,
        "param_dtype": param_dtype, "reduce_dtype": reduce_dtype, "cpu_offload": cpu_offload,
        "optimizer": optimizer, "optimizer_implementation": optimizer_implementation,
        "grad_accum_steps": grad_accum_steps, "ac_mode": ac_mode, "selective_ac_option": selective_ac_option,
    }
    check_arguments(world_size=world_size, dp_replicate=dp_replicate, local_batch_size=local_batch_size,
                     seq_len=seq_len, args=args, reshard_after_forward_mode="never", optimizer=optimizer,
                     optimizer_implementation=optimizer_implementation, grad_accum_steps=grad_accum_steps)
    if not budget_bytes > 0:
        raise ValueError(f"budget_bytes: invalid value {budget_bytes!r}; expected a number > 0")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return in_child_process("torchtitan_lite.memory.auto:plan_here", spec, args, kwargs,  # type: ignore[no-any-return]
                                timeout_s=timeout_s)
    return plan_here(spec, args, **kwargs)


def auto_headroom_bytes(spec: ModelSpec, args: Any, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> int:
    """What ``auto`` keeps free below its budget: the largest FSDP unit's gathered parameters or
    gradients, in the wider of the two dtypes (see :func:`plan_auto_reshard`)."""
    return _headroom(_units(spec, args), param_dtype, reduce_dtype)


def _units(spec: ModelSpec, args: Any) -> list[FSDPUnit]:
    """The FSDP units of the model ``args`` of family ``spec`` (built on the meta device)."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    return fsdp_units(model, **spec.fsdp_units(model))


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


def plan_here(spec: ModelSpec, args: Any, *, budget_bytes: int, count_offloaded: bool, budget_source: str,
              **kwargs: Any) -> AutoReshardPlan:
    """:func:`plan_auto_reshard` in this process (which must hold no process group)."""
    start = time.perf_counter()
    units = _units(spec, args)
    n = len(units)
    headroom = _headroom(units, kwargs["param_dtype"], kwargs["reduce_dtype"])
    limit = budget_bytes - headroom
    estimates = {0: estimate_here(spec, args, reshard_after_forward_mode=(False,) * n, **kwargs)}
    never, phase, module = _compared(estimates[0], count_offloaded)
    order = _reshard_order(units, args, seq_len=kwargs["seq_len"], param_bytes=kwargs["param_dtype"].itemsize,
                           reduce_bytes=kwargs["reduce_dtype"].itemsize, busy=_busy_units(units, phase, module))

    def plan(k: int) -> tuple[bool, ...]:
        chosen = set(order[:k])
        return tuple(i in chosen for i in range(n))

    def peak(k: int) -> int:
        if k not in estimates:
            estimates[k] = estimate_here(spec, args, reshard_after_forward_mode=plan(k), **kwargs)
        return _compared(estimates[k], count_offloaded)[0]

    if never <= limit:
        k = 0
    elif peak(n) > limit:
        source = f" ({budget_source})" if budget_source else ""
        raise ValueError(
            f"parallelism.memory_budget_gib: the estimated peak is {size_text(peak(n))} per rank even with "
            f"every unit resharded after forward, plus {size_text(headroom)} of headroom for a collective "
            f"buffer: above the budget of {size_text(budget_bytes)}{source}; "
            "allow more memory, or need less (smaller training.local_batch_size or seq_len, bf16 "
            "mixed precision, CPU offload, more ranks)")
    else:
        # Bisection on the number of resharded units (fits(lo) is false, fits(hi) true); the
        # first probe assumes each resharded unit frees its gathered parameters at the peak,
        # the second checks the neighbour that would settle it.
        freed, guess = 0, n
        for k, i in enumerate(order, start=1):
            freed += units[i].numel() * kwargs["param_dtype"].itemsize
            if never - freed <= limit:
                guess = k
                break
        lo, hi = 0, n

        def probe(mid: int) -> bool:
            """Narrow ``(lo, hi)`` with an estimate at ``mid``; False when ``mid`` is outside."""
            nonlocal lo, hi
            if not lo < mid < hi:
                return False
            lo, hi = (lo, mid) if peak(mid) <= limit else (mid, hi)
            return True

        if probe(guess):
            probe(guess - 1 if hi == guess else guess + 1)
        while hi - lo > 1:
            probe((lo + hi) // 2)
        k = hi
    return AutoReshardPlan(
        units=tuple(u.name for u in units), reshard=plan(k), order=tuple(units[i].name for i in order),
        budget=budget_bytes, estimate=estimates[k],
        tried=tuple((j, _compared(e, count_offloaded)[0]) for j, e in estimates.items()),
        count_offloaded=count_offloaded, headroom=headroom, seconds=time.perf_counter() - start,
    )
