"""Memory per rank before you run: ``python -m torchtitan_lite.estimate``.

    python -m torchtitan_lite.estimate --job.config_file train_configs/llama3_8b.toml \\
        --world_size 64 --device_memory_gib 80 [--section.key value ...]

prints, for every reshard mode (default, never, always, and the configured integer one or auto), the
memory of one rank by category, its peak and where in the step it falls, and whether it fits
the device; ``--json PATH`` writes every figure. :func:`estimate_memory` is the same as an API.

How: the training step itself runs on one process with nothing real behind it. The model is
built on the meta device and sharded by :func:`~torchtitan_lite.parallelize.apply_fsdp` over a
*fake* process group of the target world size (``torch.distributed``'s ``fake`` backend:
collectives that move no data), every tensor is a ``FakeTensor`` (shape, dtype, device, no
storage), and PyTorch's ``FSDPMemTracker`` attributes each tensor to a category, as
:func:`torchtitan_lite.memory.measure_step_memory` does for real steps. So the same FSDP2 code
decides which units are gathered when (reshard mode, backward prefetch, all-gather buffers held
until the next all-gather), autograd saves exactly what it saves, and the loss is computed as
the trainer computes it (fp32 cross-entropy summed over the tokens). The figures are rank 0's;
every rank holds the same padded shard sizes. One steady-state step is run: the optimizer
state exists from the start, and the optimizer step runs on the shards' local tensors (see
:class:`_LocalOptimizer`). An 8B model at 64 ranks takes a few seconds per mode.

Not modelled: the allocator (caching, fragmentation: real reserved memory is higher), the CUDA
context and NCCL buffers; GPU kernels that save other tensors than the CPU kernels run here
(attention runs PyTorch's fused CPU kernel, whose saved tensors match the CUDA flash kernel's;
where a GPU falls back to the math kernel, possible with fp32 compute and grouped-query
attention, it also holds the batch × heads × seq² scores); gradient clipping (a scalar per parameter); and, with CPU
offload, the short-lived device copies of one unit's shard before its all-gather and of its
gradient shard after its reduce-scatter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchtitan_lite.memory import CATEGORIES, by_category, no_automatic_gc
from torchtitan_lite.models.llama3 import ModelArgs

if TYPE_CHECKING:
    from torchtitan_lite.parallelize import ReshardMode

__all__ = [
    "CATEGORY_NAMES", "OFFLOADED_CATEGORIES", "AutoReshardPlan", "MemoryEstimate", "auto_budget_bytes",
    "auto_headroom_bytes",
    "estimate_memory", "job_estimate_kwargs", "main", "plan_auto_reshard",
]

CATEGORY_NAMES: tuple[str, ...] = tuple(CATEGORIES.values())
"""Categories of an estimate, the same names as :data:`torchtitan_lite.memory.CATEGORIES`."""

OFFLOADED_CATEGORIES: tuple[str, ...] = ("sharded_params", "sharded_grads", "optimizer_state")
"""What FSDP2's CPU offload keeps on CPU (the optimizer step, and so its temporaries, runs there)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated memory of one rank during a steady-state training step, in bytes.

    ``peak``/``categories`` are over every device together (what ``measure_step_memory``
    reports as ``total`` on a CPU run); ``device_peak``/``device_categories`` are the
    accelerator's share: with CPU offload the offloaded categories live on CPU, so the device
    peak excludes them (and may fall at another moment of the step); without offload both are
    the same. ``device_categories`` holds every category at the device's peak moment, the
    offloaded ones included for reference.
    """

    world_size: int
    """Ranks in the job."""
    dp_replicate: int
    """HSDP replicas (1: plain FSDP)."""
    dp_shard: int
    """Ranks each parameter is sharded over."""
    reshard_after_forward_mode: ReshardMode
    """The reshard mode estimated (a tuple: one bool per unit, as ``auto`` chooses)."""
    param_dtype: str
    """Dtype of gathered parameters and compute."""
    reduce_dtype: str
    """Dtype of gradient reduction."""
    cpu_offload: bool
    """Sharded parameters, gradients and optimizer state on CPU."""
    local_batch_size: int
    """Samples per rank per micro-batch."""
    seq_len: int
    """Tokens per sample."""
    grad_accum_steps: int
    """Micro-batches per optimizer step."""
    optimizer: str
    """Optimizer class name."""
    peak: int
    """Highest total over all devices during the step."""
    peak_phase: str
    """Where ``peak`` happened: forward, loss, backward or optimizer."""
    peak_module: str
    """The innermost module running at ``peak`` (``loss`` in the loss's backward; empty outside
    modules otherwise)."""
    categories: dict[str, int]
    """Every category at the moment of ``peak``."""
    device_peak: int
    """Highest accelerator total (``peak`` without offload)."""
    device_peak_phase: str
    """Where ``device_peak`` happened."""
    device_peak_module: str
    """The innermost module running at ``device_peak``."""
    device_categories: dict[str, int]
    """Every category at the moment of ``device_peak``."""
    cpu_peak: int
    """Highest CPU total of the offloaded state (0 without offload)."""
    state: dict[str, int] = field(default_factory=dict)
    """Persistent state between steps: sharded params, sharded grads (before the optimizer step)
    and optimizer state."""
    seconds: float = 0.0
    """Wall time the estimate took."""

    def fits(self, device_bytes: int | float) -> bool:
        """Whether the device peak fits in ``device_bytes`` of accelerator memory (tensor bytes
        only: leave room for the allocator, the CUDA context and communication buffers)."""
        return self.device_peak <= device_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values."""
        return dataclasses.asdict(self)


def estimate_memory(
    args: ModelArgs,
    *,
    world_size: int,
    dp_replicate: int = 1,
    local_batch_size: int,
    seq_len: int,
    reshard_after_forward_mode: ReshardMode,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool,
    optimizer: str = "AdamW",
    optimizer_implementation: str = "foreach",
    grad_accum_steps: int = 1,
) -> MemoryEstimate:
    """Per-rank memory by category of training the Llama model ``args`` with FSDP2.

    Runs one training step of the trainer's kind (``grad_accum_steps`` forward/backward passes
    on ``local_batch_size × seq_len`` tokens with the loss summed in fp32 over the tokens, then
    the optimizer step and ``zero_grad(set_to_none=True)``) on fake tensors over a fake process
    group of ``world_size`` ranks (``dp_replicate × dp_shard``), under ``FSDPMemTracker``. The
    optimizer state exists from the start, so the step is a steady-state one (a real run's
    second step; its first holds less). More than two micro-batches would repeat the second
    one's memory, so at most two are run.

    Nothing real is allocated and no process group of that size is needed. The current process
    must not already hold a process group; when it does, the estimate runs in a fresh child
    process.

    Raises ``ValueError`` naming the argument when a value is not allowed.
    """
    _check_arguments(world_size=world_size, dp_replicate=dp_replicate, local_batch_size=local_batch_size,
                     seq_len=seq_len, args=args, reshard_after_forward_mode=reshard_after_forward_mode,
                     optimizer=optimizer, optimizer_implementation=optimizer_implementation,
                     grad_accum_steps=grad_accum_steps)
    kwargs: dict[str, Any] = {
        "world_size": world_size, "dp_replicate": dp_replicate, "local_batch_size": local_batch_size,
        "seq_len": seq_len, "reshard_after_forward_mode": reshard_after_forward_mode,
        "param_dtype": param_dtype, "reduce_dtype": reduce_dtype, "cpu_offload": cpu_offload,
        "optimizer": optimizer, "optimizer_implementation": optimizer_implementation,
        "grad_accum_steps": grad_accum_steps,
    }
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # The fake process group has to be the default one: run where there is none yet.
        return _in_child_process("_estimate_here", args, kwargs)
    return _estimate_here(args, **kwargs)


def _in_child_process(function: str, args: ModelArgs, kwargs: dict[str, Any], *,
                      timeout_s: float | None = None) -> Any:
    """``function(args, **kwargs)`` of this module in a fresh interpreter (arguments and result
    pickled through a temporary file), for callers that already hold a process group; a plain
    subprocess, so that it also works from daemonic processes."""
    package_root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    code = "import sys; from torchtitan_lite.estimate import _child_main; _child_main(sys.argv[1])"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "estimate.pickle"
        path.write_bytes(pickle.dumps((function, args, kwargs)))
        try:
            done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, env=env,
                                  text=True, check=False, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the memory estimate's child process took more than {timeout_s:.0f} s") from None
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:]
            raise RuntimeError(f"the memory estimate's child process failed (exit {done.returncode}): {tail}")
        status, value = pickle.loads(path.read_bytes())
    if status == "error":
        raise value
    return value


def _child_main(path: str) -> None:
    """Body of :func:`_in_child_process`'s interpreter: arguments in, result out."""
    function, args, kwargs = pickle.loads(Path(path).read_bytes())
    try:
        result: tuple[str, Any] = ("ok", globals()[function](args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - handed to the parent, which raises it
        result = ("error", exc)
    Path(path).write_bytes(pickle.dumps(result))


def _check_arguments(*, world_size: int, dp_replicate: int, local_batch_size: int, seq_len: int,
                     args: ModelArgs, reshard_after_forward_mode: ReshardMode, optimizer: str,
                     optimizer_implementation: str, grad_accum_steps: int) -> None:
    from torchtitan_lite.parallelize import validate_reshard_after_forward_mode

    def positive(name: str, value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: invalid value {value!r}; expected an integer >= 1")

    for name, value in (("world_size", world_size), ("dp_replicate", dp_replicate),
                        ("local_batch_size", local_batch_size), ("seq_len", seq_len),
                        ("grad_accum_steps", grad_accum_steps)):
        positive(name, value)
    if world_size % dp_replicate:
        raise ValueError(f"dp_replicate: invalid value {dp_replicate}; it must divide world_size {world_size}")
    if seq_len > args.max_seq_len:
        raise ValueError(f"seq_len: invalid value {seq_len}; expected at most the model's max_seq_len "
                         f"{args.max_seq_len}")
    validate_reshard_after_forward_mode(reshard_after_forward_mode, world_size // dp_replicate)
    if optimizer not in ("AdamW", "Adam"):
        raise ValueError(f"optimizer: invalid value {optimizer!r}; expected 'AdamW' or 'Adam'")
    if optimizer_implementation not in ("foreach", "fused", "for-loop"):
        raise ValueError(f"optimizer_implementation: invalid value {optimizer_implementation!r}; "
                         "expected 'foreach', 'fused' or 'for-loop'")


@contextlib.contextmanager
def _fake_world(world_size: int) -> Iterator[None]:
    """A default process group of ``world_size`` fake ranks (this process is rank 0)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _make_tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, cpu_offload: bool) -> Any:
    """An ``FSDPMemTracker`` that also records the phase of the peak and, with CPU offload, the
    device peak (total minus the offloaded categories) and the CPU peak separately."""
    from torch.distributed._tools.fsdp2_mem_tracker import _TOTAL_KEY, FSDPMemTracker, _FSDPRefType

    offloaded = [_FSDPRefType(name) for name, ours in CATEGORIES.items()
                 if cpu_offload and ours in OFFLOADED_CATEGORIES]

    class _Tracker(FSDPMemTracker):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(model, optimizer)
            self.total_peak = (-1, "", "", {})  # bytes, phase, module, categories
            self.device_peak = (-1, "", "", {})
            self.cpu_peak = 0

        def where(self) -> tuple[str, str]:
            # Module names are qualified by the root's class name: "Transformer.layers.3.attention".
            active = [name for name in self._mod_tracker.parents if name != "Global"]
            innermost = max(active, key=lambda name: name.count("."), default="")
            module = innermost.partition(".")[2]
            if self._in_opt:
                return "optimizer", ""
            if self._mod_tracker.is_bw:
                # Inside no block and no unit (at most the root): the loss's and logits' backward.
                return "backward", module or "loss"
            return ("forward" if active else "loss"), module or ("model" if active else "")

        def categories(self) -> dict[str, int]:
            return _by_category(self._curr_mem_snap)

        def _update_peak_stats(self, peak_state: Any) -> None:
            # Called after every op: only totals here, the breakdown when a peak is exceeded.
            snapshot = self._curr_mem_snap
            total = sum(per_device[_TOTAL_KEY] for per_device in snapshot.values())
            on_cpu = sum(per_device.get(ref, 0) for per_device in snapshot.values() for ref in offloaded)
            if total > self.total_peak[0]:
                self.total_peak = (total, *self.where(), self.categories())
            if total - on_cpu > self.device_peak[0]:
                self.device_peak = (total - on_cpu, *self.where(), self.categories())
            self.cpu_peak = max(self.cpu_peak, on_cpu)

    return _Tracker()


class _LocalOptimizer:
    """The trainer's optimizer, stepping the shards' local tensors, with its state already made.

    - State: Adam's ``step``, ``exp_avg`` and ``exp_avg_sq`` exist before the tracked step, as
      after a real first step, so the one tracked step is a steady-state one (a real run's
      first step holds less: no optimizer state during its forward and backward).
    - Local tensors: an optimizer step on DTensors dispatches each foreach op to the same op on
      the local shards; the first time, DTensor also works out the op's sharding and output
      shapes over every parameter, which on fake tensors takes seconds and allocates nothing.
      This twin (same class, parameter groups and hyperparameters; parameters and gradients
      alias the DTensors' local storage) runs the local ops directly: the same temporaries.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        groups = []
        for group in optimizer.param_groups:
            params = []
            for param in group["params"]:
                local = _local(param).detach()
                self.pairs.append((param, local))
                params.append(local)
            groups.append({**group, "params": params})
        self.optimizer = type(optimizer)(groups)
        for group in self.optimizer.param_groups:
            on_device = group.get("fused") or group.get("capturable")
            for local in group["params"]:
                self.optimizer.state[local] = {
                    # A literal, as Adam makes it: fake tensors keep its value for ``step.item()``.
                    "step": torch.tensor(0.0, dtype=torch.float32, device=local.device if on_device else "cpu"),
                    "exp_avg": torch.zeros_like(local, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(local, memory_format=torch.preserve_format),
                }

    def step(self) -> None:
        """One step on the gradients the DTensor parameters hold now."""
        for param, local in self.pairs:
            local.grad = None if param.grad is None else _local(param.grad)
        self.optimizer.step()
        for _, local in self.pairs:
            local.grad = None


def _local(tensor: Any) -> Any:
    """A DTensor's local shard (sharing its storage); anything else as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _by_category(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """A tracker snapshot summed over devices, keyed by our category names (no total)."""
    return {k: v for k, v in by_category(snapshot).items() if k != "total"}


def _estimate_here(
    args: ModelArgs,
    *,
    world_size: int,
    dp_replicate: int,
    local_batch_size: int,
    seq_len: int,
    reshard_after_forward_mode: ReshardMode,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool,
    optimizer: str,
    optimizer_implementation: str,
    grad_accum_steps: int,
) -> MemoryEstimate:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtitan_lite.config import Optimizer as OptimizerConfig
    from torchtitan_lite.distributed import ParallelDims, build_mesh
    from torchtitan_lite.models.llama3 import Transformer
    from torchtitan_lite.optim import build_optimizer
    from torchtitan_lite.parallelize import apply_fsdp
    from torchtitan_lite.validate import token_loss_sum

    start = time.perf_counter()
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=world_size // dp_replicate, world_size=world_size)
    device = torch.device("cpu")
    with _fake_world(world_size):
        mesh = build_mesh(device, dims)
        # Sharding meta parameters needs no fake mode (and is much faster without it).
        with torch.device("meta"):
            model = Transformer(args)
        apply_fsdp(model, mesh, reshard_after_forward_mode=reshard_after_forward_mode,
                   param_dtype=param_dtype, reduce_dtype=reduce_dtype, cpu_offload=cpu_offload)
        with FakeTensorMode(allow_non_fake_inputs=True):  # to_empty reads the meta tensors
            model.to_empty(device=device)  # fake tensors: shapes only, nothing to initialise
            model.train()
            opt = build_optimizer(model, OptimizerConfig(name=optimizer, implementation=optimizer_implementation))
            local_opt = _LocalOptimizer(opt)
            micro_batches = min(grad_accum_steps, 2)
            tokens_this_rank = local_batch_size * seq_len * grad_accum_steps
            tracker = _make_tracker(model, local_opt.optimizer, cpu_offload=cpu_offload)
            with no_automatic_gc(), tracker:
                loss_sum = torch.zeros((), dtype=torch.float64, device=device)
                for _ in range(micro_batches):
                    tracker.reset_mod_stats()  # module-wise stats are not used; allows re-entry
                    inputs = torch.zeros(local_batch_size, seq_len, dtype=torch.long, device=device)
                    labels = torch.zeros(local_batch_size, seq_len, dtype=torch.long, device=device)
                    tracker.track_inputs((inputs, labels))
                    token_loss = token_loss_sum(model(inputs), labels)
                    (token_loss / tokens_this_rank).backward()
                    loss_sum += token_loss.detach().double()
                    del inputs, labels, token_loss
                grads = tracker.categories()["sharded_grads"]
                local_opt.step()
                opt.zero_grad(set_to_none=True)
                current = tracker.categories()
                state = {"sharded_params": current["sharded_params"], "sharded_grads": grads,
                         "optimizer_state": current["optimizer_state"]}
                del loss_sum
            total, phase, module, categories = tracker.total_peak
            device_total, device_phase, device_module, device_categories = tracker.device_peak
            cpu_peak = tracker.cpu_peak if cpu_offload else 0
            del tracker, local_opt, opt, model
    return MemoryEstimate(
        world_size=world_size, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard,
        reshard_after_forward_mode=reshard_after_forward_mode, param_dtype=_dtype_name(param_dtype),
        reduce_dtype=_dtype_name(reduce_dtype), cpu_offload=cpu_offload, local_batch_size=local_batch_size,
        seq_len=seq_len, grad_accum_steps=grad_accum_steps, optimizer=optimizer,
        peak=total, peak_phase=phase, peak_module=module, categories=categories,
        device_peak=device_total, device_peak_phase=device_phase,
        device_peak_module=device_module, device_categories=device_categories,
        cpu_peak=cpu_peak, state=state, seconds=time.perf_counter() - start,
    )


def _size(nbytes: float) -> str:
    """Bytes as GiB from 1 GiB up, else MiB."""
    return f"{nbytes / _GIB:.2f} GiB" if nbytes >= _GIB else f"{nbytes / 2**20:.1f} MiB"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def job_estimate_kwargs(config: Any, *, world_size: int, dp_replicate: int, grad_accum_steps: int) -> dict[str, Any]:
    """The keyword arguments of :func:`estimate_memory` (all but the reshard mode) for a job
    config, as the trainer will run it at ``world_size`` ranks."""
    t = config.training
    return {
        "world_size": world_size, "dp_replicate": dp_replicate, "local_batch_size": t.local_batch_size,
        "seq_len": t.seq_len, "param_dtype": _DTYPES[t.mixed_precision_param],
        "reduce_dtype": _DTYPES[t.mixed_precision_reduce], "cpu_offload": t.enable_cpu_offload,
        "optimizer": config.optimizer.name, "optimizer_implementation": config.optimizer.implementation,
        "grad_accum_steps": grad_accum_steps,
    }


# --------------------------------------------------------------------------------------------
# reshard_after_forward_mode = "auto"
# --------------------------------------------------------------------------------------------

AUTO_DEVICE_FRACTION = 0.9
"""Share of a CUDA device's memory ``auto`` budgets for tensors when no budget is given; the
rest is for the caching allocator's slack, the CUDA context and communication buffers."""


def auto_budget_bytes(budget_gib: float | None, device_bytes: float | None) -> tuple[int, str]:
    """The per-rank budget of ``auto`` in bytes and where it comes from: ``budget_gib`` when
    set, else :data:`AUTO_DEVICE_FRACTION` of the device's ``device_bytes``. Raises
    ``ValueError`` (naming the key) when neither is known."""
    if budget_gib is not None:
        return int(budget_gib * _GIB), f"parallelism.memory_budget_gib = {budget_gib:g}"
    if device_bytes is not None:
        return int(device_bytes * AUTO_DEVICE_FRACTION), (
            f"{AUTO_DEVICE_FRACTION:.0%} of the device's {device_bytes / _GIB:.1f} GiB; "
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
        where = _where(*_compared(est, self.count_offloaded)[1:])
        return (f"reshard_after_forward_mode auto: budget {_size(self.budget)} per rank, of which "
                f"{_size(self.headroom)} headroom for a late-freed collective buffer; without "
                f"resharding the estimated peak is {_size(self.never_peak)}; resharding "
                f"{self.resharded_text()} -> estimated peak "
                f"{_size(self.peak)} in {where}; {self.all_gathers_per_step} all-gathers per step "
                f"({len(self.units)} forward + {sum(self.reshard)} backward{per_micro_batch}); "
                f"{len(self.tried)} estimates "
                f"in {self.seconds:.1f} s")


def plan_auto_reshard(
    args: ModelArgs,
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
) -> AutoReshardPlan:
    """Choose ``reshard_after_forward`` per FSDP unit so that the estimated peak per rank stays
    within ``budget_bytes`` with the fewest all-gathers.

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
        "grad_accum_steps": grad_accum_steps,
    }
    _check_arguments(world_size=world_size, dp_replicate=dp_replicate, local_batch_size=local_batch_size,
                     seq_len=seq_len, args=args, reshard_after_forward_mode="never", optimizer=optimizer,
                     optimizer_implementation=optimizer_implementation, grad_accum_steps=grad_accum_steps)
    if not budget_bytes > 0:
        raise ValueError(f"budget_bytes: invalid value {budget_bytes!r}; expected a number > 0")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return _in_child_process("_plan_here", args, kwargs, timeout_s=timeout_s)  # type: ignore[no-any-return]
    return _plan_here(args, **kwargs)


def auto_headroom_bytes(args: ModelArgs, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> int:
    """What ``auto`` keeps free below its budget: the largest FSDP unit's gathered parameters or
    gradients, in the wider of the two dtypes (see :func:`plan_auto_reshard`)."""
    return _headroom(_units(args), param_dtype, reduce_dtype)


def _units(args: ModelArgs) -> list[Any]:
    """The FSDP units of the Llama model ``args`` (built on the meta device)."""
    from torchtitan_lite.models.llama3 import Transformer
    from torchtitan_lite.parallelize import fsdp_units

    with torch.device("meta"):
        return fsdp_units(Transformer(args))


def _headroom(units: list[Any], param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> int:
    return max(u.numel() for u in units) * max(param_dtype.itemsize, reduce_dtype.itemsize)


def _compared(est: MemoryEstimate, count_offloaded: bool) -> tuple[int, str, str]:
    """The peak ``auto`` compares with its budget, and its phase and module: the device's, or
    with ``count_offloaded`` the total."""
    if count_offloaded:
        return est.peak, est.peak_phase, est.peak_module
    return est.device_peak, est.device_peak_phase, est.device_peak_module


def _reshard_order(units: list[Any], args: ModelArgs, *, seq_len: int, param_bytes: int,
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


def _plan_here(args: ModelArgs, *, budget_bytes: int, count_offloaded: bool, budget_source: str,
               **kwargs: Any) -> AutoReshardPlan:
    start = time.perf_counter()
    units = _units(args)
    n = len(units)
    headroom = _headroom(units, kwargs["param_dtype"], kwargs["reduce_dtype"])
    limit = budget_bytes - headroom
    estimates = {0: _estimate_here(args, reshard_after_forward_mode=(False,) * n, **kwargs)}
    never, phase, module = _compared(estimates[0], count_offloaded)
    order = _reshard_order(units, args, seq_len=kwargs["seq_len"], param_bytes=kwargs["param_dtype"].itemsize,
                           reduce_bytes=kwargs["reduce_dtype"].itemsize, busy=_busy_units(units, phase, module))

    def plan(k: int) -> tuple[bool, ...]:
        chosen = set(order[:k])
        return tuple(i in chosen for i in range(n))

    def peak(k: int) -> int:
        if k not in estimates:
            estimates[k] = _estimate_here(args, reshard_after_forward_mode=plan(k), **kwargs)
        return _compared(estimates[k], count_offloaded)[0]

    if never <= limit:
        k = 0
    elif peak(n) > limit:
        source = f" ({budget_source})" if budget_source else ""
        raise ValueError(
            f"parallelism.memory_budget_gib: the estimated peak is {_size(peak(n))} per rank even with "
            f"every unit resharded after forward, plus {_size(headroom)} of headroom for a collective "
            f"buffer: above the budget of {_size(budget_bytes)}{source}; "
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


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

_USAGE = """\
usage: python -m torchtitan_lite.estimate --world_size N [--ranks_per_node M] [--device_memory_gib G]
           [--json PATH] [--job.config_file FILE] [--section.key value ...]

Estimated memory per rank of a training job, by category, for every reshard mode (default,
never, always, and the configured integer one or auto), with the job's mixed precision, CPU offload,
batch, sequence length, optimizer and gradient accumulation. Nothing is allocated: the step runs
on fake tensors over a fake process group of N ranks, so N and the model need not fit here.

  --world_size N          ranks of the job (required)
  --ranks_per_node M      ranks per node, for data_parallel_replicate_degree = 0 (one replica per
                          node); default: $LOCAL_WORLD_SIZE, else all N on one node
  --device_memory_gib G   memory of one device in GiB, to say whether each mode fits; default: this
                          machine's first CUDA device, else no verdict
  --json PATH             also write every figure as JSON
  --section.key value     any option of the trainer (python -m torchtitan_lite.train --help)
"""

_OWN_OPTIONS = ("world_size", "ranks_per_node", "device_memory_gib", "json")

_COLUMNS = (
    ("sharded_params", "sh.param"), ("unsharded_params", "unsh.par"), ("sharded_grads", "sh.grad"),
    ("unsharded_grads", "unsh.grd"), ("optimizer_state", "optim"), ("activations", "activ"),
    ("temporaries", "temp"), ("all_gather_buffers", "all-gath"), ("reduce_scatter_buffers", "red-scat"),
    ("buffers", "buffers"), ("inputs", "inputs"),
)


class _UsageError(ValueError):
    pass


def _split_argv(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Our own options, and the rest for :func:`torchtitan_lite.config.load_job_config`."""
    own: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name.replace("-", "_") in _OWN_OPTIONS:
            key = name.replace("-", "_")
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise _UsageError(f"--{key} expects a value")
                value = argv[i + 1]
                i += 1
            own[key] = value
        else:
            rest.append(arg)
        i += 1
    return own, rest


def _int_option(own: dict[str, str], key: str, *, required: bool = False) -> int | None:
    if key not in own:
        if required:
            raise _UsageError(f"--{key} is required (an integer >= 1)")
        return None
    try:
        value = int(own[key])
    except ValueError:
        value = 0
    if value < 1:
        raise _UsageError(f"--{key}: invalid value {own[key]!r}; expected an integer >= 1")
    return value


def _device_memory(own: dict[str, str]) -> tuple[float | None, str]:
    """Bytes of one device and where the figure comes from (``None``: no verdict)."""
    if "device_memory_gib" in own:
        try:
            gib = float(own["device_memory_gib"])
        except ValueError:
            gib = -1.0
        if not (math.isfinite(gib) and gib > 0):
            raise _UsageError(f"--device_memory_gib: invalid value {own['device_memory_gib']!r}; "
                              "expected a number > 0")
        return gib * _GIB, f"{gib:g} GiB (--device_memory_gib)"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"{props.total_memory / _GIB:.1f} GiB ({props.name})"
    return None, "no CUDA device here and no --device_memory_gib: no verdict"


def _json_path(own: dict[str, str]) -> Path | None:
    """``--json`` as a path whose folder exists (created) and is writable, checked before any work."""
    if "json" not in own:
        return None
    path = Path(own["json"])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _UsageError(f"--json: cannot create the folder of {own['json']!r}: {exc.strerror or exc}") from None
    if path.is_dir() or not os.access(path.parent, os.W_OK):
        raise _UsageError(f"--json: cannot write {own['json']!r}")
    return path


def _load(own: dict[str, str], rest: list[str]) -> tuple[Any, ModelArgs, int, int, int]:
    """Config (validated for the world size), model args, dp_replicate, grad_accum_steps, ranks per node."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.data import build_tokenizer
    from torchtitan_lite.distributed import ParallelDims
    from torchtitan_lite.models import MODEL_REGISTRY
    from torchtitan_lite.train import _vocab_size

    world_size = _int_option(own, "world_size", required=True)
    assert world_size is not None
    ranks_per_node = _int_option(own, "ranks_per_node")
    if ranks_per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE", "")
        ranks_per_node = int(env) if env.isdigit() and int(env) > 0 else world_size
    if world_size % ranks_per_node:
        raise _UsageError(f"--ranks_per_node: invalid value {ranks_per_node}; it must divide "
                          f"--world_size {world_size}")
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)  # what the job's torchrun would set
    try:
        config = load_job_config(rest, world_size=world_size)
    finally:
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    p, t = config.parallelism, config.training
    dims = ParallelDims.resolve(dp_replicate=p.data_parallel_replicate_degree,
                                dp_shard=p.data_parallel_shard_degree, world_size=world_size,
                                local_world_size=ranks_per_node)
    model_args = MODEL_REGISTRY[config.model.name][1][config.model.flavor]
    model_args = dataclasses.replace(
        model_args, vocab_size=_vocab_size(config, build_tokenizer(config.model.tokenizer_path)))
    global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dims.dp_size
    accum = global_batch // (t.local_batch_size * dims.dp_size)
    return config, model_args, dims.dp_replicate, accum, ranks_per_node


def _modes(configured: str | int) -> list[str | int]:
    from torchtitan_lite.parallelize import RESHARD_MODES

    modes: list[str | int] = ["default", "never", "always"]
    assert set(modes) == set(RESHARD_MODES)
    if isinstance(configured, int):
        modes.append(configured)
    return modes


def _where(phase: str, module: str) -> str:
    return f"{phase} ({module})" if module else phase


def _label(mode: ReshardMode) -> str:
    """A mode's name in the table: a per-unit plan is what ``auto`` chose."""
    return "auto" if isinstance(mode, tuple) else str(mode)


def _table(estimates: list[MemoryEstimate], configured: str | int, device_bytes: float | None,
           unit: tuple[str, int]) -> str:
    name, scale = unit
    offload = estimates[0].cpu_offload
    head = (f"{'mode':9} " + " ".join(f"{short:>8}" for _, short in _COLUMNS) + f" {'peak':>8}"
            + (f" {'cpu':>8}" if offload else "") + f"  {'peak in':32} fits")
    lines = [f"estimated memory per rank in {name} (tensor bytes)", head]
    for est in estimates:
        mark = "*" if _label(est.reshard_after_forward_mode) == str(configured) else " "
        where = _where(est.device_peak_phase, est.device_peak_module)
        fits = "-" if device_bytes is None else ("yes" if est.fits(device_bytes) else "NO")
        cells = [est.device_categories[category] for category, _ in _COLUMNS] + [est.device_peak]
        if offload:
            cells.append(est.cpu_peak)
        lines.append(f"{_label(est.reshard_after_forward_mode) + mark:9} "
                     + " ".join(f"{value / scale:8.2f}" for value in cells) + f"  {where[:32]:32} {fits}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point: print the estimate table (exit 0), or one error line (exit 2)."""
    from torchtitan_lite.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        sys.stdout.write(_USAGE)
        return 0
    try:
        own, rest = _split_argv(argv)
        device_bytes, device_source = _device_memory(own)
        json_path = _json_path(own)
        config, model_args, dp_replicate, accum, ranks_per_node = _load(own, rest)
        t, p = config.training, config.parallelism
        world_size = int(own["world_size"])
        kwargs = job_estimate_kwargs(config, world_size=world_size, dp_replicate=dp_replicate,
                                     grad_accum_steps=accum)
        auto = p.reshard_after_forward_mode == "auto"
        budget, budget_source = auto_budget_bytes(p.memory_budget_gib, device_bytes) if auto else (0, "")
        estimates = [estimate_memory(model_args, reshard_after_forward_mode=mode, **kwargs)
                     for mode in _modes(p.reshard_after_forward_mode)]
        seconds = sum(e.seconds for e in estimates)
        plan = None
        if auto:
            plan = plan_auto_reshard(model_args, budget_bytes=budget, budget_source=budget_source, **kwargs)
            seconds += plan.seconds
            estimates.append(plan.estimate)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    first = estimates[0]
    unit = ("GiB", _GIB) if max(e.device_peak for e in estimates) >= _GIB else ("MiB", 2**20)
    print(f"{config.model.name} {config.model.flavor}: {model_args.num_params() / 1e9:.2f}B parameters, "
          f"vocab {model_args.vocab_size}; {world_size} ranks ({ranks_per_node} per node): dp_replicate "
          f"{first.dp_replicate} × dp_shard {first.dp_shard}")
    print(f"local batch {t.local_batch_size} × seq_len {t.seq_len}, {accum} micro-batch"
          f"{'es' if accum > 1 else ''} per step; params {t.mixed_precision_param}, reduce "
          f"{t.mixed_precision_reduce}; CPU offload {'on' if t.enable_cpu_offload else 'off'}; "
          f"{config.optimizer.name} ({config.optimizer.implementation})")
    print(_table(estimates, p.reshard_after_forward_mode, device_bytes, unit))
    notes = ["* = configured mode; categories at the moment of the device peak"]
    if t.enable_cpu_offload:
        notes.append("CPU offload: sharded params, grads and optimizer state live on CPU (cpu column) "
                     "and are not in the device peak")
    notes.append(f"device memory: {device_source}; allocator overhead, CUDA context and "
                 "communication buffers are not included")
    if plan is not None:
        notes.append(f"{plan.summary()} (budget: {budget_source}; the fits column is against the whole device)")
    notes.append(f"estimated in {seconds:.1f} s")
    print("\n".join(notes))
    if json_path is not None:
        record = {
            "world_size": world_size, "ranks_per_node": ranks_per_node, "model": config.model.name,
            "flavor": config.model.flavor, "num_params": model_args.num_params(),
            "vocab_size": model_args.vocab_size, "configured_mode": p.reshard_after_forward_mode,
            "device_memory_bytes": device_bytes,
            "estimates": [{**e.to_dict(), "configured": _label(e.reshard_after_forward_mode)
                           == str(p.reshard_after_forward_mode),
                           "fits": None if device_bytes is None else e.fits(device_bytes)}
                          for e in estimates],
            "auto": None if plan is None else {
                "units": plan.units, "reshard": plan.reshard, "order": plan.order, "budget": plan.budget,
                "peak": plan.peak, "never_peak": plan.never_peak, "tried": plan.tried,
                "all_gathers_per_step": plan.all_gathers_per_step},
        }
        try:
            json_path.write_text(json.dumps(record, indent=1))
        except OSError as exc:
            print(f"error: --json: cannot write {str(json_path)!r}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
