"""From a loaded config to a job: :func:`preflight` (every check that needs files) and the
:class:`JobPlan` (every value derived from config + world, computed once).

The path of a job: config (schema checks) → :func:`preflight` → :func:`plan_job` → process group →
model → loop. Both run before any process group or model exists, on every rank alike, and never
change the config. The trainer, the memory estimator and the auto planner read the plan instead
of deriving its values again.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchtitan_lite.callbacks.wandb import check_wandb
from torchtitan_lite.checkpoint.hf_storage import check_hf_checkpoint, read_hf_config
from torchtitan_lite.checkpoint.manager import (
    check_initial_load_path,
    checkpoint_model_args,
    committed_steps,
    initial_load_used,
    resumable_steps,
)
from torchtitan_lite.config.schema import JobConfig, MoEConfig
from torchtitan_lite.data.build import check_sources
from torchtitan_lite.data.loader import check_batch_split
from torchtitan_lite.data.tokenizers import Tokenizer, build_tokenizer, tokenizer_file
from torchtitan_lite.distributed.compile import compiles_by_parts
from torchtitan_lite.distributed.context_parallel import context_parallel_problem
from torchtitan_lite.distributed.expert_parallel import expert_parallel_problem
from torchtitan_lite.distributed.float8 import Float8Conversion
from torchtitan_lite.distributed.fsdp import FSDPOptions, ReshardMode, validate_reshard_after_forward_mode
from torchtitan_lite.distributed.job_shape import JobShape
from torchtitan_lite.distributed.lora import LoRASetup
from torchtitan_lite.distributed.parallel_dims import DEGREE_KEYS, ParallelDims
from torchtitan_lite.distributed.pipeline_parallel import PipelinePlan, pipeline_plan
from torchtitan_lite.dtypes import DTYPES, import_torchao
from torchtitan_lite.errors import CheckpointError, ConfigError, DataError, UserError
from torchtitan_lite.models import MODEL_SPECS, family_of, get_model_spec
from torchtitan_lite.models.spec import ModelSpec
from torchtitan_lite.objectives import OBJECTIVES, ObjectivePlan, PlanContext, plan_objective

__all__ = ["FROM_CHECKPOINT", "JobPlan", "check_initial_load", "model_vocab_size", "plan_job", "preflight"]


def preflight(config: JobConfig) -> None:
    """The checks that need the filesystem, once, before any process group: tokenizer file,
    datasets, checkpoint folders and paths, the dump folder. Raises
    :class:`~torchtitan_lite.errors.ConfigError` or :class:`~torchtitan_lite.errors.DataError`
    with one line naming the key; reads the config only. The files a job reads (tokenizer, every
    source) are reported together: one line for each that is missing or unusable."""
    problems: list[UserError] = []
    if config.model.tokenizer_path is not None:
        try:
            tokenizer_file(config.model.tokenizer_path)
        except UserError as exc:
            problems.append(exc)
    problems += check_sources(config)
    try:
        check_wandb(config)
    except UserError as exc:
        problems.append(exc)
    if len(problems) == 1:
        raise problems[0]
    if problems:  # a config error among them is the config's exit code
        kind = ConfigError if any(isinstance(p, ConfigError) for p in problems) else DataError
        raise kind("\n".join(map(str, problems)))
    ck = config.checkpoint
    folder = _own_folder(config)
    own = committed_steps(folder)
    if _initial_load_used(config):
        check_initial_load_path(ck.initial_load_path, in_hf=ck.initial_load_in_hf)
    if ck.create_seed_checkpoint and own:
        raise ConfigError(f"checkpoint.create_seed_checkpoint: invalid value True; {str(folder)!r} already "
                          f"holds checkpoints (steps {own}); a seed checkpoint starts a new run: use an "
                          "empty job.dump_folder or checkpoint.folder")
    _check_writable_folder("job.dump_folder", config.job.dump_folder)
    if ck.enable or ck.create_seed_checkpoint:
        _check_writable_folder("checkpoint.folder", str(folder))
    if config.metrics.enable_tensorboard:
        _check_writable_folder(
            "metrics.save_tb_folder", str(Path(config.job.dump_folder) / config.metrics.save_tb_folder)
        )


def _own_folder(config: JobConfig) -> Path:
    return Path(config.job.dump_folder) / config.checkpoint.folder


def _initial_load_used(config: JobConfig) -> bool:
    return initial_load_used(config.checkpoint, _own_folder(config), lora=config.lora.enable)


def _check_writable_folder(key: str, folder: str) -> None:
    """The folder exists as a writable directory or can be created (nothing is created here)."""
    path = Path(folder).expanduser().absolute()
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{key}: invalid value {folder!r}; {str(probe)!r} exists and is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: invalid value {folder!r}; {str(probe)!r} is not writable")


@dataclass(frozen=True)
class JobPlan:
    """Every value derived from the config and the world, computed once by :func:`plan_job`."""

    dims: ParallelDims
    """Data-parallel degrees (replicate × shard = world size)."""
    spec: ModelSpec
    """The model family."""
    model_args: Any
    """The model's shape: the flavor with the vocabulary of the tokenizer (or ``model.vocab_size``)."""
    tokenizer: Tokenizer
    """The job's tokenizer."""
    global_batch_size: int
    """Samples per optimizer step over all ranks."""
    val_local_batch_size: int
    """Validation windows per rank per forward pass."""
    val_global_batch_size: int
    """Validation windows per batch over all ranks."""
    val_seq_len: int
    """Tokens per validation window."""
    schedule_steps: int
    """Steps the learning-rate schedule spans: ``lr_scheduler.total_steps``, else ``training.steps``."""
    objective: ObjectivePlan = field(default_factory=lambda: ObjectivePlan(OBJECTIVES["token"]))
    """What the steps optimise (``training.objective``; :mod:`torchtitan_lite.objectives`): its entry,
    its resolved settings and its step's shape."""
    memory_budget_gib: float | None = None
    """``parallelism.memory_budget_gib``: ``auto``'s per-rank budget (None: the device's memory)."""
    notes: tuple[str, ...] = ()
    """Lines the start-up log and the memory CLI print about the job (e.g. a sequence longer than
    the model was trained for)."""
    shape: JobShape = JobShape()
    """The job's shape, one object for the model's build, the memory estimate and ``auto``: the
    world and its degrees, batch and accumulation, dtypes, how FSDP shards and offloads (the
    reshard mode, ``"auto"`` until planned), checkpointing, compile, float8, LoRA, loss parallel,
    the optimizer. The plan does not say any of it again."""

    @property
    def offloads(self) -> bool:
        """Whether any unit may be offloaded to CPU (every unit, or ``auto``, which may choose to)."""
        return self.shape.cpu_offload is not False

    @property
    def shard(self) -> bool:
        """Whether the model is sharded with FSDP2: more than one rank, or CPU offload (which FSDP2
        does). One process without offload trains the plain model: no unsharded copies, mixed
        precision through autocast (:mod:`~torchtitan_lite.distributed.autocast`)."""
        return self.shape.sharded

    def fsdp_options(self, reshard_mode: ReshardMode | None = None,
                     offload: tuple[bool, ...] | None = None) -> FSDPOptions | None:
        """How the model is sharded (None: it is not, see :attr:`shard`); ``reshard_mode`` and
        ``offload`` are the per-unit plans ``auto`` chose (default: the shape's)."""
        if offload is None and self.shape.cpu_offload == "auto":
            raise ValueError("fsdp_options: parallelism.cpu_offload = 'auto' needs the per-unit plan auto chose")
        chosen = {k: v for k, v in (("reshard_after_forward_mode", reshard_mode), ("cpu_offload", offload))
                  if v is not None}
        return self.shape.replace(**chosen).fsdp_options()

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The compute dtype of an unsharded model's autocast (None: sharded, or fp32)."""
        return self.shape.autocast_dtype

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many different batches one step reads."""
        return self.dims.dp_size

    @property
    def rollout_group(self) -> int:
        """Samples a step makes of each item the loader reads (online RL: completions per prompt; else
        1): a step reads ``global_batch_size / rollout_group`` of them."""
        return self.objective.group

    @property
    def token_ranks(self) -> int:
        """The ranks whose tokens make up one global batch (data parallel × context parallel):
        what FSDP averages gradients over, and what losses and token counts are summed over."""
        return self.dims.dp_size * self.dims.cp


def model_vocab_size(config: JobConfig, tokenizer: Tokenizer) -> int:
    """The model's vocabulary: the tokenizer's, or ``model.vocab_size`` when that pads it."""
    wanted = config.model.vocab_size
    if wanted == -1:
        return tokenizer.vocab_size
    if wanted < tokenizer.vocab_size:
        source = config.model.tokenizer_path or "the byte tokenizer"
        raise ConfigError(
            f"model.vocab_size: invalid value {wanted}; the tokenizer ({source}) has "
            f"{tokenizer.vocab_size} ids, so the model needs at least that many (or -1 to follow it)"
        )
    return wanted


FROM_CHECKPOINT = "from_checkpoint"
"""``model.flavor`` that takes the shape from ``checkpoint.initial_load_path``."""


def _checkpoint_shape(config: JobConfig, spec: ModelSpec) -> Any:
    """The shape for ``from_checkpoint``: of the step a resumed job loads (its own folder's
    ``load_step`` or latest), else of ``initial_load_path``."""
    ck = config.checkpoint
    own = resumable_steps(config.checkpoint, _own_folder(config))
    if own:
        step = ck.load_step if ck.load_step != -1 else own[-1]
        return checkpoint_model_args(_own_folder(config) / f"step-{step}", in_hf=False, spec=spec,
                                     key="checkpoint.load_step")
    if ck.initial_load_path is None:
        raise ConfigError("model.flavor: invalid value 'from_checkpoint'; it takes the model's shape from "
                          "checkpoint.initial_load_path, which is unset")
    return checkpoint_model_args(ck.initial_load_path, in_hf=ck.initial_load_in_hf, spec=spec)


def check_initial_load(config: JobConfig, plan: JobPlan) -> None:
    """A Hugging Face ``initial_load_path`` that the job will load (its own folder holds no
    checkpoint) checked against the planned model from its ``config.json`` and tensor headers:
    another family or shape, or a tensor no parameter uses, is one
    :class:`~torchtitan_lite.errors.CheckpointError` line before any process group. (Not part of
    :func:`plan_job`: the memory estimator plans jobs whose files need not be on this machine.)"""
    ck = config.checkpoint
    if ck.initial_load_in_hf and _initial_load_used(config):
        try:
            check_hf_checkpoint(ck.initial_load_path, plan.spec, plan.model_args)
        except CheckpointError as exc:
            hf_config = read_hf_config(Path(ck.initial_load_path))
            if config.model.flavor == FROM_CHECKPOINT or family_of(hf_config) not in (None, plan.spec.name):
                raise
            # The same family in another shape: the flavor named a shape the checkpoint is not.
            raise CheckpointError(f"{exc} (model.flavor = {config.model.flavor!r} sets the shape; "
                                  f"model.flavor = {FROM_CHECKPOINT!r} takes it from the checkpoint)") from None


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: invalid value {value!r}; {allowed}")


_DIM_NAMES = {"tp": "tensor parallel", "cp": "context parallel", "ep": "expert parallel", "pp": "pipeline"}


def plan_job(config: JobConfig, *, world_size: int, local_world_size: int | None = None,
             device_type: str | None = None) -> JobPlan:
    """Resolve the job for ``world_size`` ranks (``local_world_size`` per node; None: one node)
    on ``device_type`` machines (None: this machine's, CUDA when it has it, else the CPU; the
    memory CLI plans CUDA jobs anywhere).

    Checks what needs the world size or the model family (flavor, sequence lengths against the
    model, parallel degrees, integer reshard mode, batch sizes, seed checkpoint on one process)
    and raises :class:`~torchtitan_lite.errors.ConfigError` naming the key. Builds the tokenizer
    (the model's vocabulary follows it).
    """
    m, t, v, p = config.model, config.training, config.validation, config.parallelism
    spec = _family(config)
    checkpoint_args = _checkpoint_shape(config, spec) if m.flavor == FROM_CHECKPOINT else None
    # The rotary table follows the job's longest sequence (as TorchTitan's does), the model's RoPE
    # scaling kept; beyond the context the model was trained for, a note says so.
    trained_for = (checkpoint_args or spec.flavors[m.flavor]).max_seq_len
    longest = max(t.seq_len, v.seq_len if v.enable else 0)
    notes = () if longest <= trained_for else (
        f"the job's sequences ({longest} tokens) pass the {trained_for} that {m.name} {m.flavor} was trained for "
        "(its max_seq_len): the rotary table follows the job, with the model's RoPE scaling kept",)
    dims, reshard_mode = _parallel_dims(config, spec, world_size, local_world_size)
    global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dims.dp_size
    grad_accum_steps = check_batch_split(global_batch, t.local_batch_size, dims.dp_size)
    if config.compile.enable:
        import torch._dynamo

        usual = [*torch._dynamo.list_backends(), "aot_eager", "eager"]
        _require(config.compile.backend in torch._dynamo.list_backends(exclude_tags=()), "compile.backend",
                 config.compile.backend, f"expected a registered torch.compile backend, e.g. {', '.join(usual)}")
    if config.checkpoint.create_seed_checkpoint:
        _require(world_size == 1, "checkpoint.create_seed_checkpoint", True,
                 f"expected one process (this job has {world_size}): the seed checkpoint is written by "
                 "`python -m torchtitan_lite.train ...` or --nproc_per_node=1")
    tokenizer = build_tokenizer(m.tokenizer_path)
    model_args = _model_args(config, spec, tokenizer, checkpoint_args, longest)
    model_args = _moe_settings(config, spec, model_args, dims)
    device_type = device_type or _device_type()
    _tensor_parallel_settings(config, spec, dims, model_args, device_type)
    _context_parallel_settings(config, dims, model_args)
    f8 = config.float8
    all_gather = f8.enable_fsdp_float8_all_gather and dims.dp_shard > 1
    float8 = None if not m.converters else Float8Conversion(
        enable_fsdp_float8_all_gather=all_gather,
        force_recompute_fp8_weight_in_bwd=f8.force_recompute_fp8_weight_in_bwd,
        recipe_name=f8.recipe_name, filter_fqns=tuple(f8.filter_fqns), emulate=f8.emulate,
        precompute_scales=all_gather and f8.precompute_float8_dynamic_scale_for_fsdp)
    offload = "all" if t.enable_cpu_offload else p.cpu_offload
    sharded = world_size > 1 or offload != "none"  # (FSDP shards the model; else the plain model)
    lora = _lora_plan(config, spec, model_args, dims, sharded=sharded, reshard_mode=reshard_mode)
    objective = plan_objective(config, PlanContext(dims=dims, lora=lora, global_batch=global_batch))
    notes += objective.notes
    pipeline = _pipeline_plan(config, dims, model_args, lora=lora)
    if pipeline is not None and pipeline.splits_backward:
        reshard_mode = _zero_bubble_settings(config, pipeline, reshard_mode)
    ac, compile_ = config.activation_checkpoint, config.compile
    _activation_offload_settings(config, dims)
    shape = JobShape(
        world_size=world_size, dp_replicate=dims.dp_replicate, tensor_parallel=dims.tp, expert_parallel=dims.ep,
        context_parallel=dims.cp, context_parallel_method=p.context_parallel_method,
        device_type=device_type,
        local_batch_size=t.local_batch_size, seq_len=t.seq_len, grad_accum_steps=grad_accum_steps,
        param_dtype=DTYPES[t.mixed_precision_param], reduce_dtype=DTYPES[t.mixed_precision_reduce],
        reshard_after_forward_mode=reshard_mode, cpu_offload={"none": False, "all": True}.get(offload, offload),
        ac_mode=ac.mode, selective_ac_option=ac.selective_ac_option, lora=lora,
        activation_offload=ac.offload, mlp_tiles=ac.mlp_tiles, tiled_loss=t.tiled_loss,
        loss_parallel=not p.disable_loss_parallel, optimizer=config.optimizer.name,
        optimizer_implementation=config.optimizer.implementation,
        compile_model=_compiles_model(config), compile_backend=compile_.backend,
        float8=float8, async_tensor_parallel=p.enable_async_tensor_parallel,
        sharded=sharded, block_causal=config.model.attention_mask == "block_causal", objective_shape=objective.shape,
        pipeline=pipeline)
    val_local = v.local_batch_size if v.local_batch_size > 0 else t.local_batch_size
    return JobPlan(
        dims=dims, spec=spec, shape=shape, model_args=model_args, tokenizer=tokenizer,
        global_batch_size=global_batch, val_local_batch_size=val_local,
        val_global_batch_size=v.global_batch_size if v.global_batch_size > 0 else val_local * dims.dp_size,
        val_seq_len=v.seq_len if v.seq_len > 0 else t.seq_len,
        schedule_steps=config.lr_scheduler.total_steps or t.steps, objective=objective,
        memory_budget_gib=p.memory_budget_gib, notes=notes,
    )


def _family(config: JobConfig) -> ModelSpec:
    """The family of ``model.name``, its ``model.flavor`` checked (a flavor of another family named)."""
    m = config.model
    spec = get_model_spec(m.name)
    elsewhere = [name for name, other in MODEL_SPECS.items() if m.flavor in other.flavors and name != m.name]
    hint = f" (model.name = {elsewhere[0]!r} has a flavor of that name)" if elsewhere else ""
    _require(m.flavor in spec.flavors or m.flavor == FROM_CHECKPOINT, "model.flavor", m.flavor,
             f"expected one of {', '.join(map(repr, [*spec.flavors, FROM_CHECKPOINT]))}{hint}")
    return spec


def _parallel_dims(config: JobConfig, spec: ModelSpec, world_size: int,
                   local_world_size: int | None) -> tuple[ParallelDims, ReshardMode | str]:
    """The job's degrees over ``world_size`` ranks (each above 1 one the family splits over) and
    its reshard mode checked against the FSDP group."""
    p, name = config.parallelism, config.model.name
    degrees = {"tp": p.tensor_parallel_degree, "cp": p.context_parallel_degree, "ep": p.expert_parallel_degree,
               "pp": p.pipeline_parallel_degree}
    for dim, degree in degrees.items():
        _require(degree == 1 or dim in spec.parallel_dims, DEGREE_KEYS[dim], degree,
                 f"model {name!r} does not split over {_DIM_NAMES[dim]} ranks (its parallelize handles "
                 f"{', '.join(_DIM_NAMES[d] for d in sorted(spec.parallel_dims)) or 'data parallel only'}); expected 1")
    try:
        dims = ParallelDims.resolve(dp_replicate=p.data_parallel_replicate_degree,
                                    dp_shard=p.data_parallel_shard_degree, world_size=world_size,
                                    local_world_size=local_world_size, **degrees)
        if (problem := dims.unsupported()) is not None:
            raise ValueError(problem)
        mode = p.reshard_after_forward_mode
        # (FSDP shards over dp_shard × cp: an integer mode's groups are of those ranks)
        return dims, mode if mode == "auto" else validate_reshard_after_forward_mode(mode, dims.dp_shard * dims.cp)
    except ValueError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith("parallelism.") else f"parallelism.{message}") from None


def _model_args(config: JobConfig, spec: ModelSpec, tokenizer: Any, checkpoint_args: Any, longest: int) -> Any:
    """The model's args: the flavor's with the tokenizer's vocabulary, or the checkpoint's (its
    vocabulary checked against ``model.vocab_size`` and the tokenizer); ``max_seq_len`` at least
    the job's ``longest`` sequence."""
    m = config.model
    if checkpoint_args is None:
        model_args = spec.model_args(m.flavor, vocab_size=model_vocab_size(config, tokenizer))
    else:
        model_args = checkpoint_args
        vocab = checkpoint_args.vocab_size
        _require(m.vocab_size in (-1, vocab), "model.vocab_size", m.vocab_size,
                 f"expected -1 or {vocab}: model.flavor = 'from_checkpoint' takes the checkpoint's vocabulary")
        _require(tokenizer.vocab_size <= vocab, "model.tokenizer_path", m.tokenizer_path,
                 f"its {tokenizer.vocab_size} ids do not fit the checkpoint's vocabulary of {vocab}")
    return model_args if longest <= model_args.max_seq_len else dataclasses.replace(model_args, max_seq_len=longest)


def _activation_offload_settings(config: JobConfig, dims: ParallelDims) -> None:
    """Refuse, one line each, what activation offload, tiled feed-forwards and the tiled loss
    cannot run with (yet; what an objective cannot run with is its plan's)."""
    ac = config.activation_checkpoint
    _require(not ac.offload or ac.mode != "none", "activation_checkpoint.offload", ac.offload,
             "it moves what checkpointed blocks keep to host memory, and none are checkpointed: expected "
             "activation_checkpoint.mode 'full' or 'selective', or offload = false")
    _require(ac.mlp_tiles >= 0, "activation_checkpoint.mlp_tiles", ac.mlp_tiles,
             "expected 1 (off), 0 (chosen from the sequence) or a number of tiles N >= 2")
    _require(ac.mlp_tiles == 1 or dims.tp == 1, "activation_checkpoint.mlp_tiles", ac.mlp_tiles,
             f"tensor parallel ({dims.tp}) splits the feed-forward over ranks already, and tiling its sequence "
             "beside that is not available yet: expected 1")
    t = config.training
    for ok, why in ((dims.tp == 1, f"tensor parallel ({dims.tp}) splits the output layer over the vocabulary"),
                    (dims.pp == 1, f"pipeline parallel ({dims.pp}) computes the loss in its last stage's schedule")):
        _require(not t.tiled_loss or ok, "training.tiled_loss", t.tiled_loss, f"{why}, which the tiled loss does "
                 "not take yet: expected false")


def _zero_bubble_settings(config: JobConfig, pipeline: PipelinePlan, reshard_mode: ReshardMode | str) -> str:
    """A schedule that splits the backward (its weight pass reads the input pass's gathered
    weights): the reshard mode it runs with ('never', or 'auto' that then reshards none), and
    the checkpointing it takes."""
    _require(reshard_mode in ("default", "never", "auto"), "parallelism.reshard_after_forward_mode",
             reshard_mode, f"{pipeline.schedule} keeps each stage's parameters gathered from its first forward to "
             "its last weight-gradient pass: expected 'default', 'never' or 'auto' (which then reshards none)")
    ac = config.activation_checkpoint
    _require(ac.mode != "selective" or str(ac.selective_ac_option).isdigit(),
             "activation_checkpoint.selective_ac_option", ac.selective_ac_option,
             f"per-op checkpointing lets each region run one backward, and {pipeline.schedule} runs two (the input "
             "gradient, then the weight gradient): expected an integer N (every N-th block in full), or "
             "activation_checkpoint.mode 'full' or 'none'")
    return "auto" if reshard_mode == "auto" else "never"


def _pipeline_plan(config: JobConfig, dims: ParallelDims, model_args: Any, *, lora: Any) -> PipelinePlan | None:
    """The job's pipeline stages (None without ``parallelism.pipeline_parallel_degree`` > 1); one
    :class:`ConfigError` line for a split or a combination it cannot run."""
    p, t = config.parallelism, config.training
    if dims.pp == 1:
        return None
    key = "parallelism.pipeline_parallel_degree"
    try:  # (its ValueError: one line naming the key)
        plan = pipeline_plan(n_layers=model_args.n_layers, degree=dims.pp, schedule=p.pipeline_parallel_schedule,
                             microbatch_size=p.pipeline_parallel_microbatch_size, local_batch_size=t.local_batch_size,
                             layers_per_stage=p.pipeline_parallel_layers_per_stage,
                             first_less=p.pipeline_parallel_first_stage_less_layers,
                             last_less=p.pipeline_parallel_last_stage_less_layers)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    v = config.validation
    val_local = v.local_batch_size if v.local_batch_size > 0 else t.local_batch_size
    _require(not v.enable or val_local % p.pipeline_parallel_microbatch_size == 0, "validation.local_batch_size",
             val_local, f"validation runs through the stages in micro-batches of "
             f"parallelism.pipeline_parallel_microbatch_size = {p.pipeline_parallel_microbatch_size}: expected a "
             "multiple of it")
    _require(lora is None or all(stage.layers for stage in plan.stages), key, dims.pp, "with LoRA every stage "
             "needs a block to adapt (a stage of only the embedding or the output would train nothing): lower "
             "pipeline_parallel_first/last_stage_less_layers or the degree")
    return plan


def _context_parallel_settings(config: JobConfig, dims: ParallelDims, model_args: Any) -> None:
    """Refuse, one line, sequences the context-parallel ranks cannot split with the method asked
    (training's, and validation's when it runs)."""
    p = config.parallelism
    if dims.cp == 1:
        return
    lengths = [("training.seq_len", config.training.seq_len)]
    if config.validation.enable and config.validation.seq_len > 0:
        lengths.append(("validation.seq_len", config.validation.seq_len))
    for key, seq_len in lengths:
        problem = context_parallel_problem(seq_len=seq_len, degree=dims.cp, method=p.context_parallel_method,
                                           n_heads=model_args.n_heads, kv_heads=model_args.kv_heads,
                                           tensor_parallel=dims.tp)
        if problem is not None:
            problem = problem.replace("training.seq_len", key)
            raise ConfigError(f"parallelism.context_parallel_degree: invalid value {dims.cp}; {problem}")


def _tensor_parallel_settings(config: JobConfig, spec: ModelSpec, dims: ParallelDims, model_args: Any,
                              device_type: str) -> None:
    """Refuse, one line each, what tensor parallel cannot split or run with (yet). A family with
    its own plan (``ModelSpec.tensor_parallel``) checks its model itself when it splits it."""
    from torchtitan_lite.distributed.tensor_parallel import tensor_parallel_problem

    p, tp = config.parallelism, dims.tp
    key = "parallelism.tensor_parallel_degree"
    if spec.tensor_parallel is None:
        problem = tensor_parallel_problem(model_args, tp)
        _require(problem is None, key, tp, f"{problem}; expected a degree that does")
    elif tp > 1:
        auto = [k for k, value in (("parallelism.reshard_after_forward_mode", p.reshard_after_forward_mode),
                                   ("parallelism.cpu_offload", p.cpu_offload)) if value == "auto"]
        _require(not auto, auto[0] if auto else key, "auto", f"model {spec.name!r} splits over tensor parallel by its "
                 "own plan (ModelSpec.tensor_parallel), which the memory planner does not size: expected a fixed "
                 "setting with tensor parallel")
    if tp > 1:
        seq_lens = [("training.seq_len", config.training.seq_len)]
        if config.validation.enable and config.validation.seq_len > 0:
            seq_lens.append(("validation.seq_len", config.validation.seq_len))
        for seq_key, seq_len in seq_lens:
            _require(seq_len % tp == 0, seq_key, seq_len, f"tensor parallel {tp} splits each sequence over its ranks "
                     f"between the blocks (sequence parallel): expected a multiple of {tp}")
        rowwise = config.model.converters and config.float8.recipe_name not in (None, "tensorwise")
        _require(not rowwise, key, tp, f"tensor parallel is not combined with float8's {config.float8.recipe_name!r} "
                 "recipe (float8.recipe_name; torchao's tensor-parallel styles take tensorwise scales) yet; expected 1 "
                 "with it")
    if p.enable_async_tensor_parallel:
        _require(tp > 1, "parallelism.enable_async_tensor_parallel", True,
                 "it overlaps tensor-parallel collectives: expected false without tensor parallel")
        _require(config.compile.enable, "parallelism.enable_async_tensor_parallel", True,
                 "asynchronous tensor parallel is inductor's rewrite of the compiled blocks: expected "
                 "compile.enable = true with it")
        _require(device_type == "cuda", "parallelism.enable_async_tensor_parallel", True,
                 "asynchronous tensor parallel runs on CUDA (symmetric memory between the GPUs of a node) and this "
                 "machine has none; expected false")


def _device_type() -> str:
    """Where this job runs: CUDA when this machine has it, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _compiles_model(config: JobConfig) -> bool:
    """Whether the job compiles the model's blocks (``compile.enable`` with ``"model"`` in its
    components)."""
    return config.compile.enable and "model" in config.compile.components


MOE_DEFAULTS = MoEConfig()
"""``[moe]`` as it is when unset (a dense model takes nothing else)."""


def _moe_settings(config: JobConfig, spec: ModelSpec, model_args: Any, dims: ParallelDims) -> Any:
    """The model's shape with the ``[moe]`` router overrides (``top_k``, ``score_func``);
    :class:`ConfigError`, one line, for an ``[moe]`` setting on a dense model, a top-k the
    experts cannot give, or bias balancing without a router bias."""
    e = config.moe
    if not model_args.num_experts:
        for f in dataclasses.fields(e):
            value, default = getattr(e, f.name), getattr(MOE_DEFAULTS, f.name)
            _require(value == default, f"moe.{f.name}", value,
                     f"model {spec.name!r} ({config.model.flavor}) has no mixture-of-experts layers; expected "
                     f"the default ({default!r})")
        return model_args
    overrides = {k: v for k, v in (("top_k", e.top_k), ("score_func", e.score_func)) if v}
    if config.checkpoint.last_save_in_hf and spec.hf is not None:
        _require(overrides.get("score_func", model_args.score_func) == model_args.score_func, "moe.score_func",
                 e.score_func, f"{spec.hf.architectures[0]} routes with {model_args.score_func!r}, so a Hugging Face "
                 f"export (checkpoint.last_save_in_hf) of another router would compute differently there; expected "
                 f"unset or {model_args.score_func!r}")
    try:
        model_args = dataclasses.replace(model_args, **overrides)
    except ValueError as exc:
        key = "moe.top_k" if "top_k" in str(exc) else "moe.score_func"
        raise ConfigError(f"{key}: invalid value {overrides.get(key[4:])!r}; {exc}") from None
    ep = dims.ep
    if ep > 1:
        problem = expert_parallel_problem(model_args.num_experts, ep)
        _require(problem is None, "parallelism.expert_parallel_degree", ep, f"{problem} of model {spec.name!r}")
        ac = config.activation_checkpoint
        selective_op = ac.mode == "selective" and str(ac.selective_ac_option) == "op"
        by_parts = compiles_by_parts(compile_model=_compiles_model(config), expert_parallel=ep)
        _require(not (by_parts and selective_op), "activation_checkpoint.mode", ac.mode,
                 "selective (op) checkpointing of blocks compiled by their parts (expert parallel with "
                 "compile.enable) is not available yet; expected 'full' or 'none', or selective_ac_option = N")
        mode = config.parallelism.reshard_after_forward_mode
        _require(not (by_parts and mode == "auto"), "parallelism.reshard_after_forward_mode", mode,
                 "auto may choose selective (op) checkpointing, which blocks compiled by their parts (expert "
                 "parallel with compile.enable) do not take yet; expected a fixed mode")
    _require(e.bias_update_rate == 0 or model_args.score_func == "sigmoid", "moe.bias_update_rate",
             e.bias_update_rate, f"the {model_args.score_func} router of model {spec.name!r} has no expert bias to "
             "balance; expected 0, or moe.score_func = 'sigmoid'")
    return model_args


def _qlora_settings(config: JobConfig, model: torch.nn.Module, dims: ParallelDims, *,
                    sharded: bool, reshard_mode: ReshardMode | str) -> torch.dtype | None:
    """The dtype a 4-bit base of ``model`` (built on the meta device) computes in (None: no 4-bit
    base); what it cannot run with is a :class:`ConfigError` of one line."""
    lo = config.lora
    if lo.quantize_base == "none":
        return None
    key, value = "lora.quantize_base", lo.quantize_base
    try:
        import_torchao("torchao.quantization")
    except ImportError:
        raise ConfigError(f"{key}: invalid value {value!r}; NF4 is torchao's: pip install 'torchao>=0.16' "
                          "(pip install -e '.[qlora]'), or 'none'") from None
    from torchtitan_lite.models.nf4 import nf4_problem

    _require(dims.tp == 1, key, value, f"tensor parallel ({dims.tp}) splits the linears by rows and columns "
             "as DTensors, whose NF4 parts torchao does not gather; expected parallelism.tensor_parallel_degree "
             "= 1, or 'none'")
    _require(not lo.merge_on_export, key, value, "a merged export would hold the dequantized 4-bit base, not "
             "the original weights; expected lora.merge_on_export = false (the PEFT adapter folder applies to "
             "the original base), or 'none'")
    _require(not config.model.converters, key, value, f"model.converters {list(config.model.converters)!r} "
             "would convert the same linears; expected no converters, or 'none'")
    _require(not isinstance(reshard_mode, int), key, value, "FSDP2 reshards a parameter to a group of ranks "
             f"after forward (parallelism.reshard_after_forward_mode = {reshard_mode}) only when it gathers as one "
             "tensor, and a 4-bit weight gathers as three (codes, block scales, factors); expected 'default', "
             "'never', 'always' or 'auto', or 'none'")
    ck = config.checkpoint
    _require(ck.initial_load_path is None or ck.initial_load_in_hf, key, value, "a 4-bit base is quantized as "
             "its weights load from a Hugging Face folder, and checkpoint.initial_load_path is a DCP folder; "
             "expected checkpoint.initial_load_in_hf = true (or the seeded init), or 'none'")
    problem = nf4_problem(model, shards=dims.dp_shard * dims.cp if sharded else 1)
    _require(problem is None, key, value, str(problem))
    return DTYPES[config.training.mixed_precision_param]


def _lora_plan(config: JobConfig, spec: ModelSpec, model_args: Any, dims: ParallelDims, *,
               sharded: bool, reshard_mode: ReshardMode | str) -> LoRASetup | None:
    """The job's LoRA (None when ``lora.enable`` is off): the linears its targets name, found
    by their Hugging Face (PEFT) names on the model built on the meta device. A target the
    model lacks is a :class:`ConfigError`; so is a 4-bit base (``lora.quantize_base``) that
    cannot be built (``sharded``: FSDP shards the model)."""
    lo = config.lora
    _require(lo.enable or lo.quantize_base == "none", "lora.quantize_base", lo.quantize_base,
             "a 4-bit base is for LoRA's adapters to train on: expected lora.enable = true, or 'none'")
    if not lo.enable:
        return None
    ck = config.checkpoint
    mlp = sorted({"gate_proj", "up_proj", "down_proj"} & set(lo.target_modules))
    if model_args.num_experts and mlp and ck.last_save_in_hf and not lo.merge_on_export:
        raise ConfigError(
            f"lora.target_modules: invalid value {list(lo.target_modules)!r}; on a mixture-of-experts "
            f"model PEFT reads {', '.join(map(repr, mlp))} as the experts' parameters, so adapters on the "
            "dense feed-forward linears cannot be exported as a PEFT folder (checkpoint.last_save_in_hf); "
            "expected 'experts' for the experts, or lora.merge_on_export = true"
        )
    model = spec.meta_model(model_args)
    quantize_dtype = _qlora_settings(config, model, dims, sharded=sharded, reshard_mode=reshard_mode)
    try:
        return LoRASetup.for_model(model, rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout,
                                  target_modules=lo.target_modules, merge_on_export=lo.merge_on_export,
                                  hf_name=None if spec.hf is None else spec.hf.to_hf_name,
                                  quantize_dtype=quantize_dtype)
    except ValueError as exc:
        message = str(exc)
        if not message.startswith("lora."):  # a target the model lacks (the settings name their key)
            message = (f"lora.target_modules: invalid value {list(lo.target_modules)!r}; "
                       f"{message.replace('the model', f'model {spec.name!r}', 1)}")
        raise ConfigError(message) from None
