"""``python -m torchtitan_lite.memory --longest_seq_len``: the longest sequence a job fits in a
per-rank budget (and its nodes' host memory), searched over the estimates of lengths the job
allows."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from torchtitan_lite.config.schema import JobConfig
from torchtitan_lite.errors import ConfigError
from torchtitan_lite.job import JobPlan
from torchtitan_lite.memory.estimate import (
    GIB,
    MemoryEstimate,
    estimate_memory,
    job_estimate_shape,
)
from torchtitan_lite.memory.job_plans import DEVICE_TEXT, UsageError, plan_without_files

__all__ = ["host_bytes", "longest_seq_len", "print_longest"]


def longest_seq_len(config: JobConfig, *, world_size: int, ranks_per_node: int, budget: float, cp: int = 1,
                    tp: int = 1, progress: Callable[[str], Any] = print, host_budget: float | None = None,
                    device_type: str = "cuda") -> tuple[int | None, list[tuple[int, float]]]:
    """The longest ``training.seq_len`` whose configured reshard mode's estimated device peak
    stays within ``budget`` bytes (and, with ``host_budget``, what a node's ranks keep in host
    memory within that), planned for ``device_type``; None when even the shortest length the job
    allows does not fit. Returns it and every ``(seq_len, peak)`` estimated, in order;
    ``progress`` gets one line per estimate.

    Every length tried is a multiple of the unit the job splits a sequence by: ``2 × cp`` (context
    parallel's load-balanced chunks) and ``tp`` (sequence parallel). The search starts at the
    job's length rounded down to a step (1,024 rounded up to a multiple of the unit; at least one
    step) and doubles while it fits; when that does not fit it halves, below the step too, down to
    the shortest length the job allows (one unit, or the shortest the job's own checks take: an
    online RL prompt needs a token before its completion), then bisects between the longest length
    that fits and the shortest that does not: in steps (to 1/32 of the length) from the step up,
    below it to 1/8 of the length (a multiple of the unit times a power of two)."""
    unit = math.lcm(2 * cp if cp > 1 else 1, tp)
    step = unit * -(-1024 // unit)
    tried: list[tuple[int, float]] = []
    planned: dict[int, JobPlan | None] = {}

    def plan_at(seq_len: int) -> JobPlan | None:
        """The job at ``seq_len`` (without validation); None where its checks refuse that length."""
        if seq_len not in planned:
            training = dataclasses.replace(config.training, seq_len=seq_len)
            job = dataclasses.replace(config, training=training,
                                      validation=dataclasses.replace(config.validation, enable=False))
            try:
                planned[seq_len] = plan_without_files(job, world_size=world_size, local_world_size=ranks_per_node,
                                                      device_type=device_type)[0]
            except ConfigError:
                if seq_len >= config.training.seq_len:  # (a longer length than the job's: not the length's fault)
                    raise
                planned[seq_len] = None
        return planned[seq_len]

    def fits(seq_len: int) -> bool:
        plan = plan_at(seq_len)
        assert plan is not None, seq_len  # (the search estimates only lengths the job's checks take)
        mode = plan.shape.reshard_after_forward_mode if plan.shape.reshard_after_forward_mode != "auto" else "default"
        estimate = estimate_memory(plan.spec, plan.model_args, job_estimate_shape(plan),
                                   reshard_after_forward_mode=mode)
        peak, host = estimate.device_peak, host_bytes(estimate) * ranks_per_node
        tried.append((seq_len, peak))
        ok = peak <= budget and (host_budget is None or host <= host_budget)
        held = f"; host {host / GIB:.1f} GiB per node" if host else ""
        progress(f"seq_len {seq_len}: estimated peak {_gib(peak)} GiB per rank{held}, "
                 f"{'fits' if ok else 'does not fit'}")
        return ok

    def shortest_allowed(refused: int, allowed: int) -> int:
        """The shortest multiple of the unit the job's checks take above ``refused`` (refused, or
        0), up to ``allowed`` (taken): planning only, no estimate."""
        while allowed - refused > unit:
            middle = (refused + allowed) // 2 // unit * unit
            if plan_at(middle) is None:
                refused = middle
            else:
                allowed = middle
        return allowed

    def quantum(length: int) -> int:
        """The bisection's grain at ``length``: the step from it up; below, the unit times the
        largest power of two within 1/8 of the length."""
        if length >= step:
            return step
        grain = unit
        while grain * 2 <= length // 8:
            grain *= 2
        return grain

    start = max(step, config.training.seq_len // step * step)
    low, high = 0, start
    if fits(start):
        low, top = start, None
        while top is None and low < 2**24:
            if fits(low * 2):
                low *= 2
            else:
                top = low * 2
        if top is None:
            return low, tried
        high = top
    else:
        while low == 0:
            candidate = high // 2 // quantum(high // 2) * quantum(high // 2)
            if candidate < unit or plan_at(candidate) is None:
                shortest = shortest_allowed(candidate, high)
                if shortest == high:  # nothing shorter than a length that does not fit
                    return None, tried
                candidate = shortest
            if fits(candidate):
                low = candidate
            else:
                high = candidate
    while high - low > max(quantum(low), low // 32):
        middle = (low + high) // 2 // quantum(low) * quantum(low)
        if middle in (low, high):
            break
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, tried


def _gib(nbytes: float) -> str:
    """Bytes in GiB: two decimals, or three significant digits below 0.1 GiB (8.1 MiB: 0.00791)."""
    gib = nbytes / GIB
    if gib >= 0.1 or gib <= 0:
        return f"{gib:.2f}"
    return f"{gib:.{2 - math.floor(math.log10(gib))}f}"


def print_longest(config: JobConfig, plan: JobPlan, *, world_size: int, ranks_per_node: int,
                   device_bytes: float | None, device_source: str, host: tuple[float | None, str] = (None, "")) -> int:
    """``--longest_seq_len``: search and print (exit 0)."""
    from torchtitan_lite.memory.auto import auto_budget_bytes

    device_type = plan.shape.device_type
    if plan.memory_budget_gib is None and device_bytes is None:
        raise UsageError("--longest_seq_len: no budget: set parallelism.memory_budget_gib or --device_memory_gib"
                          + (" (no CUDA device here)" if device_type == "cuda" else ""))
    budget, source = auto_budget_bytes(plan.memory_budget_gib, device_bytes)
    cp = plan.dims.cp
    print(f"{config.model.name} {config.model.flavor} on {world_size} ranks {DEVICE_TEXT[device_type]} (context "
          f"parallel {cp}{', ' + plan.shape.context_parallel_method if cp > 1 else ''}); budget {_gib(budget)} GiB "
          f"per rank ({source}); device {device_source}" + (f"; host {host[1]} per node" if host[0] else ""),
          flush=True)
    start = time.perf_counter()
    host_budget = None if host[0] is None else 0.9 * host[0]
    found, tried = longest_seq_len(config, world_size=world_size, ranks_per_node=ranks_per_node, budget=budget,
                                   cp=cp, tp=plan.dims.tp, progress=lambda line: print(line, flush=True),
                                   host_budget=host_budget, device_type=device_type)
    took = time.perf_counter() - start
    if found is None:
        shortest, peak = tried[-1]
        over = (f"{_gib(peak)} GiB per rank, over the budget of {_gib(budget)} GiB" if peak > budget else
                f"more host memory per node than 90% of {host[1]}")
        print(f"no seq_len fits: even {shortest} token{'s' if shortest > 1 else ''}, the shortest this job allows, "
              f"need{'s' if shortest == 1 else ''} {over} ({len(tried)} estimates in {took:.0f} s)")
    else:
        pair = plan.objective.entry.sequence_text(plan.objective)
        print(f"longest seq_len that fits: {found} tokens{pair} ({found // cp} per rank; {len(tried)} estimates in "
              f"{took:.0f} s)")
    return 0


def host_bytes(estimate: MemoryEstimate) -> int:
    """What one rank keeps in host memory at most: FSDP's CPU-offloaded state and the offloaded
    activations (``activation_checkpoint.offload``)."""
    return estimate.cpu_peak + estimate.activation_host
