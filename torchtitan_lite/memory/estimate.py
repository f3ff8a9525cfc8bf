"""Memory per rank before you run: :func:`estimate_memory` (the CLI is :mod:`torchtitan_lite.memory.cli`).

How: the training step itself runs on one process with nothing real behind it. The model is
built on the meta device and parallelized by the same function the trainer uses
(:func:`~torchtitan_lite.distributed.parallelize.parallelize`: the family's steps, FSDP last) over a
*fake* process group of the target world size (``torch.distributed``'s ``fake`` backend:
collectives that move no data), every tensor is a ``FakeTensor`` (shape, dtype, device, no
storage), and PyTorch's ``FSDPMemTracker`` attributes each tensor to a category, as
:func:`torchtitan_lite.memory.measure.measure_step_memory` does for real steps. So the same FSDP2 code
decides which units are gathered when (reshard mode, backward prefetch, all-gather buffers held
until the next all-gather), autograd saves exactly what it saves, and the loss is computed as
the trainer computes it (fp32 cross-entropy summed over the tokens). The figures are rank 0's;
every rank holds the same padded shard sizes. One steady-state step is run: the optimizer
state exists from the start, and the optimizer step runs on the shards' local tensors (see
:class:`~torchtitan_lite.memory.fake_step.LocalOptimizer`). An 8B model at 64 ranks takes a few seconds per mode.

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
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchtitan_lite.config.schema import JobConfig
from torchtitan_lite.config.schema import Optimizer as OptimizerConfig
from torchtitan_lite.distributed.context_parallel import context_parallel_problem
from torchtitan_lite.distributed.expert_parallel import expert_parallel_problem
from torchtitan_lite.distributed.fsdp import (
    ReshardMode,
    gathered_through_step,
    unit_offload,
    validate_reshard_after_forward_mode,
)
from torchtitan_lite.distributed.job_shape import JobShape
from torchtitan_lite.distributed.mesh import build_mesh
from torchtitan_lite.distributed.parallel_dims import ParallelDims
from torchtitan_lite.distributed.parallelize import parallelize
from torchtitan_lite.distributed.pipeline_parallel import (
    SINGLE_SCHEDULES,
    PipelinePlan,
    StagePart,
    rank_actions,
)
from torchtitan_lite.distributed.tensor_parallel import tensor_parallel_problem
from torchtitan_lite.dtypes import dtype_name
from torchtitan_lite.gc_control import GarbageCollection
from torchtitan_lite.loss import token_loss_sum, token_losses
from torchtitan_lite.memory.fake_step import (
    LocalOptimizer,
    OffloadedBytes,
    as_sharded_params,
    fake_world,
    gloo_all_gathers,
    local_part,
    make_tracker,
    nbytes,
)
from torchtitan_lite.memory.measure import CATEGORIES
from torchtitan_lite.models.decoder import kernels_as_on_cuda
from torchtitan_lite.models.nf4 import allocate_constants, is_nf4
from torchtitan_lite.models.spec import ModelSpec
from torchtitan_lite.objectives.reference import as_reference
from torchtitan_lite.optim import build_optimizer

if TYPE_CHECKING:
    from torchtitan_lite.job import JobPlan

__all__ = ["CATEGORY_NAMES", "MemoryEstimate", "estimate_memory", "estimate_stages", "job_estimate_shape",
           "block_mask_bytes", "not_modelled", "size_text", "where_text"]

CATEGORY_NAMES: tuple[str, ...] = tuple(CATEGORIES.values())
"""Categories of an estimate, the same names as :data:`torchtitan_lite.memory.CATEGORIES`."""

GIB = 2**30


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
    """Ranks each parameter is sharded over (data-parallel shard × context parallel)."""
    reshard_after_forward_mode: ReshardMode
    """The reshard mode estimated (a tuple: one bool per unit, as ``auto`` chooses)."""
    param_dtype: str
    """Dtype of gathered parameters and compute."""
    reduce_dtype: str
    """Dtype of gradient reduction."""
    cpu_offload: bool | tuple[bool, ...]
    """Sharded parameters, gradients and optimizer state on CPU: every unit's, or per unit (one
    bool per unit in forward order)."""
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
    and optimizer state; with DPO's frozen reference copy, its shards (``reference_params``; the
    peaks count them among their categories)."""
    seconds: float = 0.0
    """Wall time the estimate took."""
    pipeline_rank: int = 0
    """With pipeline parallel: the pipeline rank (coordinate) whose stages these figures are of."""
    pipeline_degree: int = 1
    """Pipeline ranks (1: no pipeline)."""
    kv_cache: int = 0
    """Online RL: the KV cache of one generation batch (included in the peaks); 0 otherwise."""
    generation_peak: int = 0
    """Online RL: the highest device total while the completions are generated (the KV cache
    included); 0 otherwise."""
    activation_host: int = 0
    """With ``activation_checkpoint.offload``: the most bytes of the checkpointed blocks' inputs
    held in host memory at once (not in the peaks, which are device memory); 0 otherwise."""

    def fits(self, device_bytes: int | float) -> bool:
        """Whether the device peak fits in ``device_bytes`` of accelerator memory (tensor bytes
        only: leave room for the allocator, the CUDA context and communication buffers)."""
        return self.device_peak <= device_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values."""
        return dataclasses.asdict(self)


def estimate_memory(spec: ModelSpec, args: Any, shape: JobShape | None = None, **fields: Any) -> MemoryEstimate:
    """Per-rank memory by category of training the model ``args`` of family ``spec`` with FSDP2.

    Runs one training step of the trainer's kind (``grad_accum_steps`` forward/backward passes
    on ``local_batch_size × seq_len`` tokens with the loss summed in fp32 over the tokens, then
    the optimizer step and ``zero_grad(set_to_none=True)``) on fake tensors over a fake process
    group of ``world_size`` ranks (``dp_replicate × dp_shard``), under ``FSDPMemTracker``. The
    optimizer state exists from the start, so the step is a steady-state one (a real run's
    second step; its first holds less). More than two micro-batches would repeat the second
    one's memory, so at most two are run. With ``lora`` the model gets its adapters and the
    rest is frozen, as in training: gradients and optimizer state for the adapters only.

    Nothing real is allocated and no process group of that size is needed. The current process
    must not already hold a process group; when it does, the estimate runs in a fresh child
    process.

    Raises ``ValueError`` naming the argument when a value is not allowed.
    """
    stages = estimate_stages(spec, args, shape, **fields)
    worst = max(stages, key=lambda estimate: estimate.device_peak)
    return dataclasses.replace(worst, seconds=sum(estimate.seconds for estimate in stages))


def estimate_stages(spec: ModelSpec, args: Any, shape: JobShape | None = None,
                    **fields: Any) -> list[MemoryEstimate]:
    """:func:`estimate_memory` of each pipeline rank, in pipeline-rank order (one estimate
    without a pipeline). A pipeline rank's step is its stages' part of the model, sharded over
    its data-parallel ranks, run through the schedule's order of forwards and backwards
    (:func:`~torchtitan_lite.distributed.pipeline_parallel.rank_actions`): the micro-batches in
    flight hold their activations until their backward, and the schedule's receive buffers (one
    per micro-batch for the activations a stage takes and for the gradients it gets back) are
    there all along."""
    shape = modelled((shape or JobShape()).replace(**fields))
    check_arguments(shape, args)
    import torch.distributed as dist

    ranks = range(shape.pipeline_degree)
    if dist.is_available() and dist.is_initialized():
        # The fake process group has to be the default one: run where there is none yet.
        return in_child_process(_estimates_here, spec, args, {"shape": shape, "ranks": list(ranks)})
    return _estimates_here(spec, args, shape, list(ranks))


def _estimates_here(spec: ModelSpec, args: Any, shape: JobShape, ranks: list[int]) -> list[MemoryEstimate]:
    return [estimate_here(spec, args, shape, pp_rank=rank) for rank in ranks]


_NOT_MODELLED = {"compile_model": False, "compile_backend": "inductor", "float8": None,
                 "async_tensor_parallel": False, "sharded": True}
"""The fields of a job's shape the estimate does not model, as it takes them (see :func:`not_modelled`)."""


def modelled(shape: JobShape) -> JobShape:
    """``shape`` as the estimate models it: FSDP2 on every rank count, eager, without float8 (see
    :func:`not_modelled`)."""
    return shape.replace(**_NOT_MODELLED)


def in_child_process(function: Callable[..., Any], spec: ModelSpec, args: Any, kwargs: dict[str, Any], *,
                     timeout_s: float | None = None) -> Any:
    """``function(spec, args, **kwargs)`` (a module-level function) in a fresh interpreter (the
    family by name, arguments and result pickled through a file in a private temporary folder,
    mode 0700, that it creates), for callers that
    already hold a process group (the fake one has to be the default group); a plain subprocess,
    so that it also works from daemonic processes."""
    package_root = str(Path(__file__).resolve().parent.parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    code = "import sys; from torchtitan_lite.memory.estimate import _child_main; _child_main(sys.argv[1])"
    # The hand-off files are pickles, read back by both sides: they live only in a folder of
    # this process's own that no other user can enter (mkdtemp creates it with mode 0700).
    with tempfile.TemporaryDirectory(prefix="torchtitan_lite_estimate_") as folder:
        if os.stat(folder).st_mode & 0o077:
            raise RuntimeError(f"the memory estimate's temporary folder {folder!r} is open to other users")
        path = Path(folder) / "estimate.pickle"
        payload = pickle.dumps((function, _handed_spec(spec), args, kwargs))
        path.write_bytes(pickle.dumps((_main_path(spec), payload)))
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


def _handed_spec(spec: ModelSpec) -> ModelSpec | str:
    """How the child gets the family: by name when it is one of the package's own, registered
    (a fresh interpreter's registry has it), else the spec itself (a family registered at run
    time, by a script or research code, is not in that registry)."""
    from torchtitan_lite.models import MODEL_SPECS

    own = MODEL_SPECS.get(spec.name) is spec and getattr(spec.model_cls, "__module__", "").startswith(
        "torchtitan_lite.")
    return spec.name if own else spec


def _main_path(spec: ModelSpec) -> str | None:
    """The main script's file when the spec refers to something it defines (a model class of a
    script's own): the child runs it as ``__mp_main__`` first, as multiprocessing's spawn does,
    so that the spec unpickles there (the script's own work stays behind its ``if __name__ ==
    "__main__"`` guard)."""
    if isinstance(_handed_spec(spec), str):
        return None
    refers = any(getattr(getattr(spec, f.name), "__module__", None) == "__main__" for f in dataclasses.fields(spec))
    return getattr(sys.modules.get("__main__"), "__file__", None) if refers else None


def _child_main(path: str) -> None:
    """Body of :func:`in_child_process`'s interpreter: arguments in, result out."""
    import runpy
    import types

    from torchtitan_lite.models import get_model_spec

    main_path, payload = pickle.loads(Path(path).read_bytes())
    if main_path is not None:  # the parent's main script, as __mp_main__ (see _main_path)
        main = types.ModuleType("__mp_main__")
        main.__dict__.update(runpy.run_path(main_path, run_name="__mp_main__"))
        sys.modules["__main__"] = sys.modules["__mp_main__"] = main
    function, handed, args, kwargs = pickle.loads(payload)
    try:
        spec = get_model_spec(handed) if isinstance(handed, str) else handed
        result: tuple[str, Any] = ("ok", function(spec, args, **kwargs))
    except Exception as exc:  # handed to the parent, which raises it
        result = ("error", exc)
    Path(path).write_bytes(pickle.dumps(result))


def check_arguments(shape: JobShape, args: Any) -> None:
    """Raise ``ValueError`` naming the first argument of :func:`estimate_memory` that is not allowed."""
    world_size, dp_replicate, local_batch_size = shape.world_size, shape.dp_replicate, shape.local_batch_size
    seq_len, reshard_after_forward_mode, optimizer = shape.seq_len, shape.reshard_after_forward_mode, shape.optimizer
    optimizer_implementation, grad_accum_steps = shape.optimizer_implementation, shape.grad_accum_steps
    tensor_parallel = shape.tensor_parallel
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
    positive("tensor_parallel", tensor_parallel)
    if world_size % (dp_replicate * tensor_parallel):
        raise ValueError(f"tensor_parallel: invalid value {tensor_parallel}; dp_replicate {dp_replicate} × "
                         f"tensor_parallel must divide world_size {world_size}")
    dims = ParallelDims.resolve(dp_replicate=dp_replicate, dp_shard=-1, world_size=world_size, tp=tensor_parallel,
                                cp=shape.context_parallel, pp=shape.pipeline_degree)
    validate_reshard_after_forward_mode(reshard_after_forward_mode, dims.dp_shard * dims.cp)
    resharded = (any(reshard_after_forward_mode) if isinstance(reshard_after_forward_mode, tuple)
                 else reshard_after_forward_mode != "never")
    if shape.pipeline is not None and shape.pipeline.splits_backward and resharded:
        raise ValueError(f"reshard_after_forward_mode: invalid value {reshard_after_forward_mode!r}; "
                         f"{shape.pipeline.schedule} keeps every unit gathered from its forward to its weight pass: "
                         "expected 'never'")
    # The axes' own rules, as the plan checks them (one place each).
    problems = {
        "tensor_parallel": tensor_parallel_problem(args, tensor_parallel),
        "expert_parallel": expert_parallel_problem(args.num_experts, shape.expert_parallel)
        if args.num_experts else None,
        "context_parallel": context_parallel_problem(
            seq_len=seq_len, degree=shape.context_parallel, method=shape.context_parallel_method,
            n_heads=args.n_heads, kv_heads=args.kv_heads, tensor_parallel=tensor_parallel),
    }
    for name, problem in problems.items():
        if problem is not None:
            raise ValueError(f"{name}: invalid value {getattr(shape, name)!r}; {problem}")
    if optimizer not in ("AdamW", "Adam", "AdamW8bit"):
        raise ValueError(f"optimizer: invalid value {optimizer!r}; expected 'AdamW', 'Adam' or 'AdamW8bit'")
    if optimizer_implementation not in ("foreach", "fused", "for-loop"):
        raise ValueError(f"optimizer_implementation: invalid value {optimizer_implementation!r}; "
                         "expected 'foreach', 'fused' or 'for-loop'")


_CACHE_SIZE = 128
_CACHE: dict[Any, MemoryEstimate] = {}


def estimate_here(spec: ModelSpec, args: Any, shape: JobShape, pp_rank: int = 0) -> MemoryEstimate:
    """:func:`estimate_memory` in this process (which must hold no process group), of pipeline
    rank ``pp_rank``'s stages with a pipeline. An estimate is a pure function of its arguments:
    the last :data:`_CACHE_SIZE` are kept, so that the ``auto`` planner and the CLI, which ask for
    some of the same plans, make each one once."""
    key = (spec.name, repr(args), repr(shape), pp_rank)
    if key not in _CACHE:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = _estimate_uncached(spec, args, shape, pp_rank)
    return dataclasses.replace(_CACHE[key])


def _estimate_uncached(spec: ModelSpec, args: Any, shape: JobShape, pp_rank: int) -> MemoryEstimate:
    pipeline = shape.pipeline
    world_size, dp_replicate, local_batch_size = shape.world_size, shape.dp_replicate, shape.local_batch_size
    seq_len, grad_accum_steps, cpu_offload = shape.seq_len, shape.grad_accum_steps, shape.cpu_offload
    optimizer, optimizer_implementation = shape.optimizer, shape.optimizer_implementation
    expert_parallel, tensor_parallel = shape.expert_parallel, shape.tensor_parallel
    reshard_after_forward_mode, param_dtype, reduce_dtype = (shape.reshard_after_forward_mode, shape.param_dtype,
                                                             shape.reduce_dtype)
    from torch._subclasses.fake_tensor import FakeTensorMode

    start = time.perf_counter()
    dims = ParallelDims.resolve(dp_replicate=dp_replicate, dp_shard=-1, world_size=world_size, ep=expert_parallel,
                                tp=tensor_parallel, cp=shape.context_parallel, pp=shape.pipeline_degree)
    local_len = seq_len // dims.cp  # context parallel: this rank's share of each sequence
    device = torch.device("cpu")
    # (pp is the mesh's outermost dimension: this rank is the first of pipeline rank pp_rank's)
    with fake_world(world_size, rank=pp_rank * (world_size // dims.pp)):
        mesh = build_mesh(device, dims)
        # Sharding meta parameters needs no fake mode (and is much faster without it). The
        # family's own parallelize steps, as the trainer runs them (LoRA: a frozen base, only the
        # adapters get gradients and optimizer state); compile and float8 are not modelled.
        model = spec.meta_model(args)
        built = parallelize(spec, model, mesh, shape, device=device)
        unit_list = built.units
        if shape.device_type == "cpu":
            gloo_all_gathers(model)
        # The objective's rows per sample (a pair in two rows …) and its frozen reference copy,
        # built like the model.
        objective = shape.objective_shape
        rows = local_batch_size * objective.rows_per_sample
        rollout = objective.rollout
        reference = None
        if objective.reference == "copy":
            reference = spec.meta_model(args)
            parallelize(spec, reference, mesh, shape, device=device)
            reference.requires_grad_(False)
        if built.context_parallel is not None:
            # (CUDA's masks are BlockMasks, counted below; a CPU's attention runs in tiles, counted)
            built.context_parallel.shapes_only = shape.device_type == "cuda"
        offload_flags = unit_offload(cpu_offload, unit_list)
        offloaded_ids = {id(param) for unit, flag in zip(unit_list, offload_flags, strict=True) if flag
                         for module in unit.modules for param in module.parameters()}
        offloaded_names = {name for name, param in model.named_parameters() if id(param) in offloaded_ids}
        with FakeTensorMode(allow_non_fake_inputs=True):  # to_empty reads the meta tensors
            model.to_empty(device=device)  # fake tensors: shapes only, nothing to initialise
            allocate_constants(model)  # (QLoRA's 4-bit weights: their scale mean and level table)
            model.train()
            reference_bytes = 0
            if reference is not None:
                reference.to_empty(device=device)
                allocate_constants(reference)
                reference_bytes = sum(nbytes(local_part(p)) for p in reference.parameters())
            opt = build_optimizer(model, OptimizerConfig(name=optimizer, implementation=optimizer_implementation))
            local_opt = LocalOptimizer(opt)
            micro_batches = min(grad_accum_steps, 2)
            tokens_this_rank = rows * local_len * grad_accum_steps
            offloaded = OffloadedBytes([p for name, p in model.named_parameters() if name in offloaded_names],
                                        local_opt) if offloaded_names else None
            tracker = make_tracker(model, local_opt.optimizer, offloaded)
            # No automatic collection inside (as in the trainer); only the young generation is
            # collected first: fake tensors hold no memory, and a full collection before each of
            # auto's estimates was a sixth of their time (the estimates are the same).
            kernels = kernels_as_on_cuda() if shape.device_type == "cuda" else contextlib.nullcontext()
            # QLoRA's 4-bit weights that FSDP leaves plain (on one rank) are not the tracker's
            # parameters: counted from the step's start like the reference copy, reported as sharded.
            plain_nf4 = [inner for param in model.parameters() if is_nf4(param) and local_part(param) is param
                         for inner in (param.quantized_data, param.quantized_scalers, param.quantization_factor)]
            plain_nf4_bytes = sum(nbytes(t) for t in plain_nf4)
            with GarbageCollection(generation=0), tracker, kernels:
                if reference is not None:  # (the tracker counts a tensor from the first op on it: the
                    for param in reference.parameters():  # copy's shards from the step's start)
                        local_part(param).view(-1)
                for inner in plain_nf4:
                    inner.view(-1)
                loss_sum = torch.zeros((), dtype=torch.float64, device=device)
                if pipeline is not None:
                    _pipeline_step(model, pipeline, pp_rank, tracker, batches=micro_batches, rows=rows,
                                   seq_len=local_len, dim=args.dim, dtype=param_dtype, scale=1 / tokens_this_rank,
                                   sequence_shards=dims.tp,
                                   forward_only=_forward_only_models(model, reference, shape),
                                   kept=rollout is not None, row_factor=rows // local_batch_size,
                                   documents=shape.block_causal and shape.device_type != "cuda")
                kv_cache = 0
                if rollout is not None and pipeline is None:  # (with a pipeline: its token step's)
                    assert objective.step is not None, "an objective that generates gives its step's estimate"
                    kv_cache = objective.step(model, reference, objective, tracker, rows=rows, seq_len=seq_len,
                                              micro_batches=micro_batches, grad_accum_steps=grad_accum_steps,
                                              device=device, context_parallel=built.context_parallel)
                # (CUDA: a FlexAttention BlockMask, packed documents' or context parallel's, for each
                # forward: its block tables, held until its backward)
                flex = shape.device_type == "cuda" and (shape.block_causal or dims.cp > 1)
                for _ in range(micro_batches if pipeline is None and rollout is None else 0):
                    tracker.reset_mod_stats()  # module-wise stats are not used; allows re-entry
                    tables = (torch.empty(block_mask_bytes(rows, local_len, seq_len), dtype=torch.uint8, device=device)
                              if flex else None)
                    inputs = torch.zeros(rows, local_len, dtype=torch.long, device=device)
                    labels = torch.zeros(rows, local_len, dtype=torch.long, device=device)
                    # (block-causal off CUDA: the document ids, and the tiles of attention they make)
                    docs = (inputs,) if shape.block_causal and shape.device_type != "cuda" else ()
                    tracker.track_inputs((inputs, labels))
                    tiled = {"labels": labels} if shape.tiled_loss else {}  # (each label's loss, tiled)
                    if objective.reference_forward:  # the reference's forward first, as the objective's step runs it
                        with torch.no_grad(), as_reference(model, reference) as ref:
                            token_loss_sum(ref(inputs, *docs, **tiled), labels)
                    token_loss = token_loss_sum(model(inputs, *docs, **tiled), labels)
                    (token_loss / tokens_this_rank).backward()
                    loss_sum += token_loss.detach().double()
                    del inputs, labels, token_loss, tables
                grads = tracker.categories()["sharded_grads"]
                local_opt.step()
                opt.zero_grad(set_to_none=True)
                current = tracker.categories()
                state = {"sharded_params": current["sharded_params"] + plain_nf4_bytes, "sharded_grads": grads,
                         "optimizer_state": current["optimizer_state"]}
                del loss_sum
            total, phase, module, categories = tracker.total_peak
            device_total, device_phase, device_module, device_categories = tracker.device_peak
            cpu_peak = tracker.cpu_peak if offloaded is not None else 0
            activation_host = 0 if built.activation_offload is None else built.activation_offload.host_peak
            generation_peak = tracker.generation_peak
            if reference_bytes:
                # The tracker counts the copy's shards from its first forward on, among the
                # activations (they are not the tracked model's): reported as sharded parameters.
                state["reference_params"] = reference_bytes
                categories, device_categories = (as_sharded_params(c, reference_bytes)
                                                 for c in (categories, device_categories))
            if plain_nf4_bytes:
                categories, device_categories = (as_sharded_params(c, plain_nf4_bytes)
                                                 for c in (categories, device_categories))
            del tracker, local_opt, opt, model, reference
    return MemoryEstimate(
        world_size=world_size, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard * dims.cp,
        reshard_after_forward_mode=reshard_after_forward_mode, param_dtype=dtype_name(param_dtype),
        reduce_dtype=dtype_name(reduce_dtype), cpu_offload=cpu_offload, local_batch_size=local_batch_size,
        seq_len=seq_len, grad_accum_steps=grad_accum_steps, optimizer=optimizer,
        peak=total, peak_phase=phase, peak_module=module, categories=categories,
        device_peak=device_total, device_peak_phase=device_phase,
        device_peak_module=device_module, device_categories=device_categories,
        cpu_peak=cpu_peak, state=state, seconds=time.perf_counter() - start,
        pipeline_rank=pp_rank, pipeline_degree=dims.pp, kv_cache=kv_cache, generation_peak=generation_peak,
        activation_host=activation_host,
    )


def _forward_only_models(model: torch.nn.Module, reference: torch.nn.Module | None,
                         shape: JobShape) -> list[Callable[[], contextlib.AbstractContextManager[Any]]]:
    """The models an objective's step runs forward only before its training forward (see
    :func:`_pipeline_step`): the reference (``reference``, the frozen copy, or the policy with its
    adapters off), and online RL's sampling policy when its log-probabilities are kept."""
    rollout = shape.objective_shape.rollout
    runs: list[Callable[[], contextlib.AbstractContextManager[Any]]] = []
    if rollout is not None and rollout.old_logps:
        runs.append(lambda: contextlib.nullcontext(model))
    if shape.objective_shape.reference is not None:
        runs.append(lambda: as_reference(model, reference))
    return runs


def _pipeline_step(model: torch.nn.Module, plan: PipelinePlan, pp_rank: int, tracker: Any, *, batches: int,
                   rows: int, seq_len: int, dim: int, dtype: torch.dtype, scale: float,
                   sequence_shards: int = 1,
                   forward_only: Sequence[Callable[[], contextlib.AbstractContextManager[Any]]] = (),
                   kept: bool = False, row_factor: int = 1, documents: bool = False) -> None:
    """One step's forwards and backwards of pipeline rank ``pp_rank``'s stages, in the
    schedule's order, over ``batches`` local batches of ``rows`` rows: each micro-batch's stage
    output (and so its saved activations) lives until its backward. The schedule's receive
    buffers are made first: for each stage but the first, one per micro-batch for its input;
    for each stage but the last, one for the gradient of its output. What a rank sends lives
    until the schedule waits for the send: GPipe waits for its gradient sends once every
    backward has run, the looped schedules for every send at the end of the step, 1F1B at its
    next send. The last stage's loss is the trainer's (fp32 summed over the tokens, times
    ``scale``). ``row_factor``: rows per sample (DPO's pairs: 2).

    ``forward_only``: before each local batch's training schedule, a forward-only schedule of
    each model these give (entered as a context: DPO's and online RL's reference, the frozen
    copy's stages or the policy's with its adapters off; online RL's sampling policy), without
    gradient, with its own receive buffers (kept, as its stages keep them); ``kept``: online RL
    keeps the per-token fp32 log-probabilities of the step's rows, one ``(rows × batches, seq)``
    tensor per forward-only model, held through the step. ``documents``: each micro-batch's
    document ids go to every stage (packed documents, block-causal)."""
    # (a DPO pair's two rows go into one micro-batch: each micro-batch has rows / microbatches)
    microbatches = plan.microbatches(rows // row_factor)
    per_microbatch = rows // microbatches
    mine = {stage.index: stage for stage in plan.rank_stages(pp_rank)}
    shape = (per_microbatch, seq_len, dim)
    # (the hidden states between stages: with tensor parallel, this rank's share of the sequence)
    hidden = (per_microbatch, seq_len // sequence_shards, dim)
    received = {(s, j): torch.empty(hidden, dtype=dtype) for s, st in mine.items() if not st.first
                for j in range(microbatches)}
    returned = {(s, j): torch.empty(hidden, dtype=dtype) for s, st in mine.items() if not st.last
                for j in range(microbatches)}
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    parts = {s: StagePart(model, stage) for s, stage in mine.items()}
    looped = plan.schedule not in SINGLE_SCHEDULES
    forward_received = [{(s, j): torch.empty(hidden, dtype=dtype) for s, st in mine.items() if not st.first
                         for j in range(microbatches)} for _ in forward_only]
    logps = [torch.empty(rows * batches, seq_len, dtype=torch.float32) for _ in forward_only] if kept else []
    with _module_hooks_for_split_backward() if plan.splits_backward else contextlib.nullcontext():
        for _ in range(batches):
            for enter, buffers in zip(forward_only, forward_received, strict=True):
                with torch.no_grad(), enter() as forward_model:
                    for j in range(microbatches):
                        for s in sorted(mine):
                            x = (torch.zeros(shape[:2], dtype=torch.long) if mine[s].first else buffers[(s, j)])
                            out = forward_model(x, *_documents(shape, documents), stage=s)
                            if mine[s].last:
                                token_losses(out, torch.zeros(shape[:2], dtype=torch.long))
                            del x, out
            in_flight: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
            weight_passes: dict[tuple[int, int], Any] = {}  # after an input pass: what its weight pass reads
            sent: list[torch.Tensor] = []  # sends not waited for yet
            # (with FSDP: every unit held gathered through the step, reduced once at its end)
            with gathered_through_step(model) if plan.splits_backward else contextlib.nullcontext():
                for kind, s, j in rank_actions(plan, pp_rank, microbatches):
                    stage = mine[s]
                    if kind == "F":
                        # (module-wise stats are not used: forgetting the root's allows its forward again
                        # while other micro-batches' backwards, which look up their blocks', are to come)
                        if model in tracker.memory_tracking:
                            del tracker.memory_tracking[model]
                        if stage.first:
                            x = torch.zeros(shape[:2], dtype=torch.long)
                            tracker.track_inputs((x,))
                        else:
                            x = received[(s, j)].requires_grad_()
                        out = model(x, *_documents(shape, documents), stage=s)
                        if stage.last:
                            labels = torch.zeros(shape[:2], dtype=torch.long)
                            out = token_loss_sum(out, labels) * scale
                        in_flight[(s, j)] = (out, None if stage.first else x)
                        if looped and not stage.last:
                            sent.append(out)
                        del x, out
                    elif kind == "I" and not stage.first:  # (the first stage's backward is all in its weight pass)
                        # The zero-bubble input pass, as the schedule runs it: the input's gradient, the
                        # graph kept for the weight pass (its intermediates' gradients held)
                        out, x = in_flight.pop((s, j))
                        grad = None if stage.last else [returned[(s, j)]]
                        _, groups = stage_backward_input([out], grad, [x], parts[s].parameters())
                        weight_passes[(s, j)] = groups
                        sent.append(x.grad)
                        x.grad = None
                        del out, x, grad
                    elif kind == "W" and not stage.first:
                        stage_backward_weight(parts[s].parameters(), weight_passes.pop((s, j)))
                    elif kind != "I":  # a full backward, or the first stage's weight pass
                        out, x = in_flight.pop((s, j))
                        out.backward(None if stage.last else returned[(s, j)])
                        if x is not None:  # its gradient, sent to the stage before
                            if plan.schedule == "1F1B":
                                sent.clear()
                            sent.append(x.grad)
                            x.grad = None
                        del out, x
                sent.clear()
    del logps


def _documents(shape: tuple[int, ...], documents: bool) -> tuple[torch.Tensor, ...]:
    """A pipeline micro-batch's document ids, as the stages take them (none: causal)."""
    return (torch.zeros(shape[:2], dtype=torch.long),) if documents else ()


@contextlib.contextmanager
def _module_hooks_for_split_backward() -> Iterator[None]:
    """The tracker's module hooks as a split backward needs them. Its hook on a module's inputs
    waits for all their gradients and holds their autograd nodes until then: a weight pass never
    computes them, so every micro-batch's graph (and the activations it saved for the input
    pass) would stay, a leak of the estimate only. Run on the first input's gradient instead
    (a block's one input), it holds no node."""
    from unittest import mock

    from torch.autograd.graph import register_multi_grad_hook
    from torch.distributed._tools import mod_tracker

    def on_first(tensors: Any, fn: Any, *, mode: str = "any") -> Any:
        return register_multi_grad_hook(tensors, fn, mode="any")

    with mock.patch.object(mod_tracker, "register_multi_grad_hook", on_first):
        yield


def size_text(nbytes: float) -> str:
    """Bytes as GiB from 1 GiB up, else MiB."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def job_estimate_shape(plan: JobPlan) -> JobShape:
    """The job's shape (:attr:`JobPlan.shape`) as :func:`estimate_memory` takes it: the fields
    the estimate models, the reshard mode and per-block checkpointing at their defaults (each
    estimate names its own), the units on the device where ``auto`` is to choose their offload."""
    defaults = JobShape()
    left_out = {"reshard_after_forward_mode", "ac_policies", *_NOT_MODELLED}
    shape = plan.shape.replace(**{name: getattr(defaults, name) for name in left_out})
    return shape.replace(cpu_offload=False) if shape.cpu_offload == "auto" else shape


def not_modelled(config: JobConfig, plan: JobPlan) -> list[str]:
    """What of the job the estimate leaves out, one line each (the memory CLI prints them and
    ``auto`` logs them): an estimate is of the job as :func:`job_estimate_shape` describes it."""
    lines = []
    if not plan.shard:
        lines.append("one process without CPU offload trains the plain model (no FSDP), which is not modelled: "
                     "these figures are FSDP2's on one rank (its unsharded parameter and gradient copies "
                     "included; bf16 through autocast keeps some activations in fp32 instead)")
    if plan.shape.float8 is not None:
        lines.append(f"model.converters = {config.model.converters!r} (float8) is not modelled: the figures are "
                     "of the job without it (float8 keeps its casts of saved activations and, with "
                     "float8.enable_fsdp_float8_all_gather, gathers weights in one byte: measured at debugmodel, "
                     "+3% and -2% against these figures)")
    if config.compile.enable:
        lines.append("compile.enable = true is not modelled: the figures are of the eager job (inductor's fused "
                     "kernels keep fewer temporaries: measured at debugmodel, the compiled peak was 14% lower)")
    return lines


def block_mask_bytes(rows: int, queries: int, keys: int) -> int:
    """A FlexAttention BlockMask's block tables for ``rows`` rows of ``queries`` queries over
    ``keys`` keys: about 32 bytes for each 128 × 128 block (its forward and backward index tables;
    measured on CPU: ``tests/test_decoder.py``). Quadratic in the sequence, at 1/512 of a dense
    mask's bytes."""
    return rows * -(-queries // 128) * -(-keys // 128) * 32


def where_text(phase: str, module: str) -> str:
    """Where in the step a peak falls: ``"backward (layers.3)"``."""
    return f"{phase} ({module})" if module else phase
