"""The trainer: builds a job's parts from its config and plan, then runs the loop.

Each part has a builder that research code can call on its own, in this order (each needs only
the config, the :class:`~torchtitan_lite.job.JobPlan` and the parts before it):

- :func:`~torchtitan_lite.data.build_data`: the training loader and the validation sets (files
  read before any process group), and :func:`build_validators` over those sets;
- :func:`setup_distributed`: the process group, the dump folder's lock and the device mesh;
- :func:`agree_auto_reshard`: ``reshard_after_forward_mode = "auto"`` made a per-unit plan (rank 0's, every rank's;
  with a pipeline, each pipeline rank's first rank's, every rank of that pipeline rank's);
- :func:`build_model`: spec → meta → the build order of
  :data:`~torchtitan_lite.distributed.parallelize.BUILD_STEPS` (pipeline split → LoRA → float8
  → tensor, context and expert parallel → activation checkpointing → compile → FSDP2; one
  process: the plain model under autocast) → allocated → initialised;
- :func:`build_loss`, :func:`build_runner` (the runner of a micro-batch), :func:`build_objective`
  (the plan's objective, :mod:`torchtitan_lite.objectives`), :func:`build_optimizers` (optimizer
  and LR schedule), :func:`build_checkpointer` (which also loads what the job resumes from),
  :func:`log_startup`.

A step is :meth:`Trainer.train_step`: data → the objective's ``forward_backward`` through the
runner → :meth:`Trainer.finish_step` (:meth:`Trainer.optimizer_step`: clip, step, schedule; the
runner's end of step; the counters), which a caller's own loop (the engine) ends its steps with too.
``python -m torchtitan_lite.train`` is :mod:`torchtitan_lite.train`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_lite.callbacks import Callback, StepState, default_callbacks
from torchtitan_lite.checkpoint.divergence import Divergence
from torchtitan_lite.checkpoint.hf_storage import HFExportExtras
from torchtitan_lite.checkpoint.manager import CheckpointManager
from torchtitan_lite.config.schema import JobConfig
from torchtitan_lite.data import (
    BatchLoader,
    PackedWindows,
    TokenWindows,
    build_data,
    document_bounds,
    hf_tokenizer_json,
)
from torchtitan_lite.distributed import (
    ParallelMesh,
    build_mesh,
    choose_device,
    destroy_distributed,
    init_distributed,
    local_world_size_from_env,
    set_collective_timeout,
    world_info_from_env,
)
from torchtitan_lite.distributed.clip import clip_grad_norm_
from torchtitan_lite.distributed.compile import compile_loss
from torchtitan_lite.distributed.float8 import float8_unavailable, precompute_float8_scales
from torchtitan_lite.distributed.parallelize import Parallelized, build_parallelized
from torchtitan_lite.distributed.pipeline_parallel import PipelineRunner, TiedWeights
from torchtitan_lite.errors import PREEMPTED_EXIT_CODE, ConfigError
from torchtitan_lite.job import JobPlan, check_initial_load, plan_job, preflight
from torchtitan_lite.loss import token_loss_sum
from torchtitan_lite.metrics import MetricsLogger, device_peak_tflops
from torchtitan_lite.models.moe import RouterBalance, aux_loss_weight, moe_layers
from torchtitan_lite.objectives import Objective, ObjectiveParts, StatefulObjective
from torchtitan_lite.optim import build_lr_scheduler, build_optimizer
from torchtitan_lite.run.dump_lock import DumpFolderLock
from torchtitan_lite.run.stop_signals import StopSignals
from torchtitan_lite.startup_log import log_startup
from torchtitan_lite.training import LossFn, MicroBatch, MicroBatchRunner
from torchtitan_lite.training.validate import Validator

if TYPE_CHECKING:
    from torchtitan_lite.memory.auto import AutoReshardPlan

__all__ = [
    "Trainer",
    "auto_budget",
    "build_checkpointer",
    "build_data",
    "build_loss",
    "build_router_balance",
    "build_model",
    "build_objective",
    "build_optimizers",
    "build_parallel_model",
    "build_pipeline",
    "objective_parts",
    "build_runner",
    "build_validators",
    "log_startup",
    "agree_auto_reshard",
    "setup_distributed",
]

logger = logging.getLogger("torchtitan_lite")



def build_validators(config: JobConfig, plan: JobPlan, sets: dict[str | None, TokenWindows | PackedWindows], *,
                     dp_rank: int, runner: MicroBatchRunner, group: Any = None,
                     pairs: Any = None) -> dict[str | None, Validator]:
    """A validator for each validation set of :func:`~torchtitan_lite.data.build_data` (by name;
    None: the one ``validation.dataset``), running its micro-batches through ``runner`` (with a
    pipeline: one built by :func:`build_runner` with ``forward_only``) and reducing over
    ``group`` (the mesh's ``tokens``); sets of pairs are scored by ``pairs`` (the objective's
    :meth:`~torchtitan_lite.objectives.ObjectiveEntry.pair_scorer`)."""
    docs = document_bounds(config, plan.tokenizer)
    return {name: Validator(windows, runner=runner, local_batch_size=plan.val_local_batch_size,
                            global_batch_size=plan.val_global_batch_size, dp_rank=dp_rank, dp_size=plan.dp_size,
                            steps=config.validation.steps, documents=docs, group=group, pairs=pairs)
            for name, windows in sets.items()}


def auto_budget(config: JobConfig, plan: JobPlan, device: torch.device) -> tuple[int, str] | None:
    """``auto``'s per-rank memory budget in bytes and where it comes from (None for another
    reshard mode); a missing budget is a :class:`ConfigError`, before any process group."""
    if plan.shape.reshard_after_forward_mode != "auto":
        return None
    from torchtitan_lite.memory.auto import auto_budget_bytes

    device_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    try:
        return auto_budget_bytes(plan.memory_budget_gib, device_bytes)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def setup_distributed(config: JobConfig, plan: JobPlan, device: torch.device) -> tuple[ParallelMesh, DumpFolderLock]:
    """Start the process group (torchrun's, or one process of its own; a torchrun worker then
    exits when its launcher dies, :func:`~torchtitan_lite.distributed.process_group.exit_with_launcher`),
    take the job's locks (global rank 0 holds them for the job's life: the dump folder's and,
    when the job writes checkpoints, the checkpoint folder's where that lies outside the dump
    folder; a second job into either ends on every rank with one :class:`ConfigError` line
    naming the key and the holder) and build the job's mesh (:class:`ParallelMesh`: its named
    dimensions, FSDP submesh and data-parallel group)."""
    init_distributed(device, cpu_collectives=plan.offloads and device.type == "cuda",
                     timeout_s=config.comm.init_timeout_seconds)
    if dist.get_world_size() != plan.shape.world_size:
        raise ConfigError(f"the job was planned for {plan.shape.world_size} ranks but the process group has "
                          f"{dist.get_world_size()}")
    ck = config.checkpoint
    lock = DumpFolderLock(config.job.dump_folder,
                          checkpoint_folder=ck.folder if ck.enable or ck.create_seed_checkpoint else None)
    refused: list[ConfigError | None] = [None]
    if dist.get_rank() == 0:
        try:
            lock.acquire()
        except ConfigError as exc:
            refused[0] = exc
    dist.broadcast_object_list(refused, src=0, group=dist.group.WORLD)  # every rank stops alike
    if refused[0] is not None:
        raise refused[0]
    mesh = build_mesh(device, plan.dims)
    set_collective_timeout(config.comm.init_timeout_seconds, mesh.groups())
    return mesh, lock


def agree_auto_reshard(config: JobConfig, plan: JobPlan, device: torch.device,
                       budget: tuple[int, str]) -> AutoReshardPlan:
    """``reshard_after_forward_mode = "auto"``: rank 0 works out the per-unit plan (memory
    estimates on fake tensors, in a child process) and every rank applies that one plan. With
    a pipeline, the first rank of each pipeline rank plans that rank's stages (its own units,
    its schedule's micro-batches in flight), the planners side by side, and each rank applies
    its pipeline rank's plan."""
    from torchtitan_lite.memory.auto import job_auto_shape
    from torchtitan_lite.memory.auto import plan_auto_reshard as plan_units
    from torchtitan_lite.memory.estimate import not_modelled

    rank, world = dist.get_rank(), dist.get_world_size()
    pp_rank = plan.dims.pp_rank(rank)
    per = world // plan.dims.pp  # the global ranks of one pipeline rank, consecutive (pp is outermost)
    mine: AutoReshardPlan | Exception | None = None
    if rank % per == 0:
        try:
            mine = plan_units(
                plan.spec, plan.model_args, job_auto_shape(plan), budget_bytes=budget[0], budget_source=budget[1],
                count_offloaded=device.type == "cpu", pipeline_rank=pp_rank,
                # The other ranks wait in the gather below for at most init_timeout_seconds.
                timeout_s=max(1, config.comm.init_timeout_seconds - 10),
            )
        except ValueError as exc:  # the budget is too small even when resharding everything
            mine = ConfigError(str(exc))
        except Exception as exc:  # every rank raises it below instead of waiting
            mine = RuntimeError(f"reshard_after_forward_mode auto: the memory estimate failed: {exc}")
    gathered: list[AutoReshardPlan | Exception | None] = [None] * world
    dist.all_gather_object(gathered, mine, group=dist.group.WORLD)
    plans = gathered[::per]  # one per pipeline rank: every rank of it applies that one
    failed = next((p for p in plans if isinstance(p, Exception)), None)
    if failed is not None:
        raise failed
    if rank == 0:
        for chosen in plans:
            logger.info("%s (budget: %s)", chosen.summary(), budget[1])
        for line in not_modelled(config, plan):  # what the plan's estimates leave out
            logger.warning("auto: %s", line)
    return plans[pp_rank]


def build_model(config: JobConfig, plan: JobPlan, *, mesh: ParallelMesh | None, device: torch.device,
                reshard_plan: AutoReshardPlan | None = None) -> nn.Module:
    """The job's model, initialised from ``debug.seed`` and in training mode: built on the meta
    device, adapted (LoRA: the rest frozen), converted (float8), checkpointed, compiled and
    parallelized over ``mesh`` by the family's steps as the plan says (on one process without CPU offload: not sharded,
    under autocast for bf16), then allocated.
    ``reshard_plan``: what ``auto`` chose (its per-unit resharding and checkpointing)."""
    return build_parallel_model(config, plan, mesh=mesh, device=device, reshard_plan=reshard_plan).model


def build_parallel_model(config: JobConfig, plan: JobPlan, *, mesh: ParallelMesh | None, device: torch.device,
                         reshard_plan: AutoReshardPlan | None = None) -> Parallelized:
    """:func:`build_model`'s model with what was built around it (its FSDP units, its
    context-parallel share): what :func:`build_runner` runs."""
    shape = plan.shape if reshard_plan is None else reshard_plan.applied_to(plan.shape)
    built = build_parallelized(plan.spec, plan.model_args, mesh, device=device, seed=config.debug.seed, shape=shape)
    built.model.train()
    return built


def build_loss(config: JobConfig, plan: JobPlan) -> LossFn:
    """The summed token loss (:func:`~torchtitan_lite.loss.token_loss_sum`), compiled when
    ``compile.components`` names ``loss`` (but for logits split over tensor-parallel ranks: that
    loss runs its own chunks and all-reduces eagerly)."""
    split_logits = plan.dims.tp > 1 and plan.shape.loss_parallel
    if config.compile.enable and "loss" in config.compile.components and not split_logits:
        return compile_loss(token_loss_sum, backend=config.compile.backend)
    return token_loss_sum


def objective_parts(config: JobConfig, plan: JobPlan, model: nn.Module, *, mesh: ParallelMesh,
                    device: torch.device, loader: BatchLoader, loss_fn: LossFn,
                    reshard_plan: AutoReshardPlan | None = None,
                    rollout_engine: Callable[[], Any] | None = None) -> ObjectiveParts:
    """The parts an objective is built from (:class:`~torchtitan_lite.objectives.ObjectiveParts`):
    these, and with a pipeline the maker of forward-only schedules over a model's stages.
    ``rollout_engine``: what gives the job's rollout engine (default: one made on ``model``, its
    layout's, on first use)."""
    forward = None if plan.shape.pipeline is None else functools.partial(_forward_schedule, config, plan,
                                                                         mesh=mesh, device=device)
    if rollout_engine is None:
        rollout_engine = functools.partial(_rollout_engine, plan, model, device)
    return ObjectiveParts(config=config, plan=plan, model=model, mesh=mesh, device=device, loader=loader,
                          loss_fn=loss_fn, reshard_plan=reshard_plan, rollout_engine=rollout_engine,
                          forward_schedule=forward)


def build_objective(config: JobConfig, plan: JobPlan, model: nn.Module, *, mesh: ParallelMesh,
                    device: torch.device, loader: BatchLoader, loss_fn: LossFn,
                    reshard_plan: AutoReshardPlan | None = None,
                    rollout_engine: Callable[[], Any] | None = None) -> Objective:
    """What the job's steps optimise: the plan's objective (``training.objective``;
    :mod:`torchtitan_lite.objectives`) built from these parts (its reference, reward functions …);
    ``rollout_engine``: the job's rollout engine, for an objective that generates."""
    return plan.objective.entry.build(objective_parts(config, plan, model, mesh=mesh, device=device, loader=loader,
                                                      loss_fn=loss_fn, reshard_plan=reshard_plan,
                                                      rollout_engine=rollout_engine))


def _rollout_engine(plan: JobPlan, model: nn.Module, device: torch.device) -> Any:
    """A rollout engine on ``model`` (:class:`~torchtitan_lite.rl.rollout.DecoderRollouts`)."""
    from torchtitan_lite.rl.rollout import DecoderRollouts

    tokenizer = plan.tokenizer
    return DecoderRollouts(model, device=device, pad_id=tokenizer.eos_id if tokenizer.eos_id is not None else 0,
                           decode=tokenizer.decode, max_batch=plan.objective.generation_batch_size or None)


def _forward_schedule(config: JobConfig, plan: JobPlan, stages: nn.Module, local_batch_size: int, *,
                      mesh: ParallelMesh, device: torch.device) -> PipelineRunner | None:
    """A forward-only schedule over ``stages`` (the policy's, a reference copy's) for ``local_batch_size`` rows."""
    return build_pipeline(config, plan, stages, mesh=mesh, device=device, loss_fn=token_loss_sum, forward_only=True,
                          local_batch_size=local_batch_size)


def build_runner(config: JobConfig, plan: JobPlan, built: Parallelized, *, mesh: ParallelMesh, device: torch.device,
                 loss_fn: LossFn, balance: RouterBalance | None = None, num_sources: int = 0,
                 forward_only: bool = False) -> MicroBatchRunner:
    """The runner of the job's micro-batches over ``built`` (:func:`build_parallel_model`): its
    context-parallel share, and with a pipeline the schedule over this rank's stages (training's
    with ``loss_fn`` and the router losses of ``balance``, or with ``forward_only`` validation's).
    ``num_sources``: a mixture's sources, for the per-source losses."""
    pipeline = build_pipeline(config, plan, built.model, mesh=mesh, device=device,
                              loss_fn=token_loss_sum if forward_only else loss_fn, forward_only=forward_only,
                              balance=None if forward_only else balance)
    return MicroBatchRunner(built.model, device=device, context_parallel=built.context_parallel,
                            pipeline=None if forward_only else pipeline, evaluation=pipeline if forward_only else None,
                            router_balance=None if forward_only else balance, num_sources=num_sources,
                            tiled_loss=plan.shape.tiled_loss)


def build_pipeline(config: JobConfig, plan: JobPlan, model: nn.Module, *, mesh: ParallelMesh, device: torch.device,
                   loss_fn: LossFn, forward_only: bool = False, balance: RouterBalance | None = None,
                   local_batch_size: int | None = None) -> PipelineRunner | None:
    """The schedule that runs this rank's pipeline stages (None without a pipeline): training's,
    or with ``forward_only`` validation's (its local batch; ``local_batch_size``: another's).
    ``balance``: a mixture of experts' router losses (:func:`build_router_balance`), which
    training's last stage adds."""
    pipeline = plan.shape.pipeline
    if pipeline is None:
        return None
    local = plan.val_local_batch_size if forward_only else config.training.local_batch_size
    local = local if local_batch_size is None else local_batch_size
    return PipelineRunner(model, pipeline, pp_rank=mesh.pp_rank, group=mesh.pp_group, device=device,
                          local_batch_size=local, loss_fn=loss_fn, forward_only=forward_only, balance=balance)


def build_router_balance(config: JobConfig, plan: JobPlan, model: nn.Module,
                         mesh: ParallelMesh) -> RouterBalance | None:
    """The router losses, load metrics and bias balancing of a mixture-of-experts model
    (``[moe]``; the load-balancing loss's weight defaults to the model's
    ``router_aux_loss_coef``); None for a dense model. With pipeline parallel, over the MoE
    layers of every stage (this rank's run here)."""
    if not plan.model_args.num_experts:
        return None
    e = config.moe
    names = None if plan.shape.pipeline is None else list(moe_layers(plan.spec.meta_model(plan.model_args)))
    return RouterBalance(
        model,
        aux_loss_coef=aux_loss_weight(e.aux_loss_coef, plan.model_args),
        z_loss_coef=e.z_loss_coef,
        bias_update_rate=e.bias_update_rate,
        group=mesh.tokens,
        dp_size=plan.token_ranks,
        names=names,
        pipeline_group=mesh.pp_group,
        num_experts=plan.model_args.num_experts,
    )


def build_optimizers(config: JobConfig, plan: JobPlan,
                     model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The optimizer over ``model``'s trainable parameters (``requires_grad``: with LoRA the
    adapters only, so the frozen base has no optimizer state) and its learning-rate schedule
    over the plan's ``schedule_steps``."""
    if config.lr_scheduler.warmup_steps >= plan.schedule_steps and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("lr_scheduler.warmup_steps=%d >= the schedule's %d steps: warmup is cut to %d steps "
                       "and the learning rate never decays",
                       config.lr_scheduler.warmup_steps, plan.schedule_steps, plan.schedule_steps)
    optimizer = build_optimizer(model, config.optimizer)
    return optimizer, build_lr_scheduler(optimizer, config.lr_scheduler, total_steps=plan.schedule_steps)


def build_checkpointer(
    config: JobConfig, plan: JobPlan, *, model: nn.Module, optimizer: torch.optim.Optimizer,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler, loader: BatchLoader,
) -> CheckpointManager | None:
    """The checkpoint manager (None when the job neither saves nor loads checkpoints). Call its
    ``load()`` to resume (or load ``initial_load_path``): it fills the model, optimizer, schedule
    and loader and returns the saved train state."""
    ck = config.checkpoint
    if not (ck.enable or ck.create_seed_checkpoint or ck.initial_load_path is not None):
        return None
    convert = ck.last_save_in_hf and dist.get_rank() == 0
    return CheckpointManager(
        ck, dump_folder=config.job.dump_folder, model=model, optimizer=optimizer,
        lr_scheduler=lr_scheduler, loader=loader, model_spec=plan.spec, lora=plan.shape.lora,
        timeout_s=config.comm.init_timeout_seconds,
        run_config={f"{section}.{key}": value for section, values in config.to_dict().items()
                    for key, value in values.items()},
        hf_extras=HFExportExtras(bos_id=plan.tokenizer.bos_id, eos_id=plan.tokenizer.eos_id,
                                 tokenizer_file=hf_tokenizer_json(plan.tokenizer, convert=convert)),
    )


def _end_training(callback: Callback, trainer: Any, kind: Any, error: BaseException | None, tb: Any) -> None:
    """An ``ExitStack`` exit: the callback's ``on_train_end`` (the error, if any, goes on)."""
    callback.on_train_end(trainer, error)


class Trainer:
    """A job's parts, built by the builders above from a :class:`JobConfig` and its
    :class:`JobPlan`, and the loop that runs them."""

    def __init__(self, config: JobConfig, plan: JobPlan | None = None) -> None:
        """``plan``: the job resolved by :func:`~torchtitan_lite.job.plan_job` (``main`` passes
        it); without one, the trainer runs :func:`~torchtitan_lite.job.preflight` and plans the
        job for torchrun's world itself. The config is only read."""
        self.config = config
        rank, local_rank, world_size = world_info_from_env()
        if plan is None:
            preflight(config)
            plan = plan_job(config, world_size=world_size, local_world_size=local_world_size_from_env())
        check_initial_load(config, plan)
        self.plan = plan
        self.device = choose_device(local_rank)
        if plan.shape.float8 is not None:  # the device can run it (and torchao imports), before any data is read
            unavailable = float8_unavailable(self.device, emulate=plan.shape.float8.emulate)
            if unavailable:
                raise ConfigError(f"model.converters: invalid value {config.model.converters!r}; {unavailable}")
        # Data first, before any process group or model: the data-parallel rank follows from the
        # global rank and the degrees (the mesh's layout).
        dp_rank = plan.dims.dp_rank(rank)
        self.loader, validation_sets = build_data(config, plan, dp_rank=dp_rank)
        budget = auto_budget(config, plan, self.device)
        if config.debug.deterministic:
            torch.use_deterministic_algorithms(True)
            if self.device.type == "cuda":
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self.mesh, self._lock = setup_distributed(config, plan, self.device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.loader.group = self.mesh.dp_group  # the data's collectives: among the data-parallel ranks
        self.reshard_plan = None if budget is None else agree_auto_reshard(config, plan, self.device, budget)
        built = build_parallel_model(config, plan, mesh=self.mesh, device=self.device, reshard_plan=self.reshard_plan)
        self.model = built.model
        self.activation_offload = built.activation_offload
        """With ``activation_checkpoint.offload``: what keeps the checkpointed blocks' inputs in host
        memory (``host_peak``: the most the last step held there)."""
        self.tied = TiedWeights.build(self.model, plan.shape.pipeline, world=self.mesh.world, pp_rank=self.mesh.pp_rank)
        self.loss_fn = build_loss(config, plan)
        # The micro-batches' runners (context parallel's share, the pipeline's schedules), the
        # objective, and validation on a forward-only runner when the stages need a schedule of their own.
        sources = len(self.loader.sources) if self.loader.named else 0
        runner = functools.partial(build_runner, config, plan, built, mesh=self.mesh, device=self.device,
                                   loss_fn=self.loss_fn, num_sources=sources)
        self.runner = runner(balance=build_router_balance(config, plan, self.model, self.mesh))
        evaluation = runner(forward_only=True) if plan.shape.pipeline is not None and validation_sets else self.runner
        self._rollout_engine: Any = None
        parts = objective_parts(config, plan, self.model, mesh=self.mesh, device=self.device, loader=self.loader,
                                loss_fn=self.loss_fn, reshard_plan=self.reshard_plan,
                                rollout_engine=lambda: self.rollout_engine)
        entry = plan.objective.entry
        self.objective = entry.build(parts)
        entry.add_forward_schedules(self.objective, self.runner, parts,
                                    local_batch_size=config.training.local_batch_size)
        if evaluation is not self.runner:  # (validation's own runner: its local batch)
            entry.add_forward_schedules(self.objective, evaluation, parts, local_batch_size=plan.val_local_batch_size)
        self.validators = build_validators(config, plan, validation_sets, dp_rank=dp_rank, runner=evaluation,
                                           group=self.mesh.tokens, pairs=entry.pair_scorer(self.objective))
        self.optimizer, self.lr_scheduler = build_optimizers(config, plan, self.model)
        self.checkpointer = build_checkpointer(config, plan, model=self.model, optimizer=self.optimizer,
                                               lr_scheduler=self.lr_scheduler, loader=self.loader)
        self.step, self.tokens_seen = 0, 0
        self.divergence = Divergence(config.training, checkpointer=self.checkpointer,
                                     folder_enabled=config.checkpoint.enable, loader=self.loader, rank=self.rank)
        self.stopped_by: str | None = None  # the signal that stopped train() early (checkpoint.save_on_signals)
        if not config.checkpoint.create_seed_checkpoint:  # (a seed checkpoint holds the fresh weights)
            self.load_checkpoint()
        self.flops_per_token = plan.model_args.flops_per_token(config.training.seq_len)
        self.peak_tflops, peak_source = device_peak_tflops(self.device, config.metrics.peak_tflops,
                                                           compute_dtype=plan.shape.param_dtype)
        self.metrics = MetricsLogger(rank=self.rank, dump_folder=config.job.dump_folder,
                                     enable_tensorboard=config.metrics.enable_tensorboard,
                                     tb_folder=config.metrics.save_tb_folder, run_config=config.to_dict(),
                                     disable_color=config.metrics.disable_color_printing,
                                     objective=plan.objective.entry)
        # What runs around each step, in order (torchtitan_lite.callbacks); append your own.
        self.callbacks: list[Callback] = default_callbacks(config)
        log_startup(config, plan, model=self.model, mesh=self.mesh, loader=self.loader, validators=self.validators,
                    reshard_plan=self.reshard_plan,
                    mfu=f"against {self.peak_tflops} TFLOP/s ({peak_source})" if self.peak_tflops
                    else f"not reported: {peak_source}")

    def optimizer_step(self, loss_sum: torch.Tensor, global_tokens: int) -> dict[str, float]:
        """Clip, step (only when the global loss and gradient norm are finite: every rank decides
        alike), advance the schedule, clear the gradients. ``loss_sum``: this rank's summed token
        loss (or the objective's ``StepResult.loss_sum`` vector, whose first entry it is), reduced here over
        the ranks in place. Returns ``loss``, ``grad_norm``, ``lr``, ``skipped``."""
        params = list(self.model.parameters())
        if self.tied is not None:  # (tied embeddings on two pipeline ranks: one gradient, counted once)
            self.tied.sum_gradients()
        grad_norm = clip_grad_norm_(params, self.config.training.max_norm, pipeline_group=self.mesh.pp_group,
                                    counted=None if self.tied is None else self.tied.counted(params))
        lr = self.lr_scheduler.get_last_lr()[0]
        dist.all_reduce(loss_sum, group=self.mesh.tokens)
        loss, norm = float(loss_sum.reshape(-1)[0].item() / global_tokens), float(grad_norm.item())
        finite = math.isfinite(loss) and math.isfinite(norm)
        if finite:
            self.optimizer.step()
            if self.plan.shape.float8 is not None and self.plan.shape.float8.precompute_scales:
                precompute_float8_scales(self.model)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss, "grad_norm": norm, "lr": float(lr), "skipped": 0.0 if finite else 1.0}

    def next_batch(self) -> list[MicroBatch]:
        """This rank's micro-batches of the next global batch, with their document ids and each
        row's source (a mixture) where the loader gives them (prompts: their rows)."""
        return self.loader.next_micro_batches()

    @property
    def rollout_engine(self) -> Any:
        """The job's rollout engine (:class:`~torchtitan_lite.rl.rollout.DecoderRollouts`): the model
        the runner runs generates on its own layout; built once, on first use."""
        if self._rollout_engine is None:
            self._rollout_engine = _rollout_engine(self.plan, self.runner.model, self.device)
        return self._rollout_engine

    def train_step(self) -> dict[str, float]:
        """One optimizer step over one global batch: data → the objective's forward and backward
        (:attr:`objective` through :attr:`runner`) → :meth:`finish_step`; returns its metrics
        (same on every rank)."""
        data_start = time.perf_counter()
        self.runner.start_step()
        batch = self.next_batch() if self.objective.needs_batch() else []
        data_time = time.perf_counter() - data_start
        if self.activation_offload is not None:
            self.activation_offload.start_step()
        result = self.objective.forward_backward(self.runner, batch)
        values = self.finish_step(result.loss_sum, result.denominator, global_tokens=result.global_tokens)
        values.update(result.metrics)
        if self.activation_offload is not None:  # (this rank's; the same shapes on every rank)
            values["activation_offload_gib"] = self.activation_offload.host_peak / 2**30
        if result.source_denominators:  # per source: its progress, and this step's mean loss
            values.update(result.source_metrics)
            values.update(result.source_losses(self.loader.names))
        return {**values, "data_time_s": data_time, "tokens_per_rank": result.tokens_per_rank}

    def finish_step(self, loss_sum: torch.Tensor, denominator: float, *, global_tokens: int) -> dict[str, float]:
        """The end of every step, the built-in loop's and a caller's own
        (:class:`~torchtitan_lite.engine.TrainingEngine`): :meth:`optimizer_step` (``loss_sum /
        denominator`` is the logged loss), the runner's end of step (router bias, load metrics),
        then the counters: one more step, ``global_tokens`` more tokens seen. Returns the step's
        metrics."""
        values = self.optimizer_step(loss_sum, denominator)
        values.update(self.runner.finish_step(update_bias=not values["skipped"]))
        self.step += 1
        self.tokens_seen += global_tokens
        return values

    def validate(self) -> dict[str, float]:
        """Validation metrics at the current weights (empty when validation is off): the one
        validation set's ``validation_loss`` …, or ``validation/NAME/loss``,
        ``validation/NAME/perplexity`` … of each named set."""
        values: dict[str, float] = {}
        for name, validator in self.validators.items():
            result = validator.run()
            if name is None:
                values.update(result)
                continue
            for key, value in result.items():  # validation_loss → validation/NAME/loss, validation/dpo/… too
                if key == "validation_time_s":
                    values[key] = values.get(key, 0.0) + value
                elif key.startswith("validation_"):
                    values[f"validation/{name}/{key[len('validation_'):]}"] = value
                else:
                    values[f"validation/{name}/{key[len('validation/'):]}"] = value
        return values

    def train(self) -> list[dict[str, float]]:
        """Run until ``training.steps``; returns every step's metrics (validation included).

        Each step is :meth:`train_step`, then every callback of :attr:`callbacks` in order
        (:mod:`torchtitan_lite.callbacks`: validation, the metrics record and its sinks, the
        checkpoint, gc, the profiler, the training timeout, preemption). A signal of
        ``checkpoint.save_on_signals`` (preemption) ends the run after the step in progress on
        every rank: one checkpoint is saved (synchronously, after any background save in flight)
        and :attr:`stopped_by` names the signal; ``python -m torchtitan_lite.train`` then exits with
        :data:`~torchtitan_lite.errors.PREEMPTED_EXIT_CODE`."""
        cfg = self.config
        history: list[dict[str, float]] = []
        if self.step >= cfg.training.steps and self.rank == 0:
            logger.warning("nothing to train: the run is at step %d and training.steps = %d (raise "
                           "training.steps to train further)", self.step, cfg.training.steps)
        with contextlib.ExitStack() as stack:
            for callback in self.callbacks:
                callback.on_train_start(self)
                stack.push(functools.partial(_end_training, callback, self))
            while self.step < cfg.training.steps:
                state = self._timed_step()
                for callback in self.callbacks:
                    callback.after_step(self, state)
                history.append({"step": state.step, **state.values})
                if state.stop:
                    break
        return history

    def log_metrics(self, step: int, values: dict[str, Any]) -> None:
        """Write the metrics record of ``step`` (``metrics.jsonl``, TensorBoard, the console; rank
        0) and hand it to every callback's ``on_metrics`` (W&B …)."""
        record = self.metrics.log(step, values)
        if record is not None:
            for callback in self.callbacks:
                callback.on_metrics(self, step, record)

    def stop_on_signal(self, received: object, signals: StopSignals) -> None:
        """Save one checkpoint now (unless this step's is saved already) and mark the run stopped."""
        name = getattr(received, "name", str(received))
        self.stopped_by = name
        if self.checkpointer is None:
            if self.rank == 0:
                logger.warning("%s received: stopping after step %d with no checkpoint (checkpoint.enable is "
                               "false)", name, self.step)
            return
        started = time.perf_counter()
        self.checkpointer.wait()  # a background save in flight is completed (and committed) first
        if self.checkpointer.saved_step != self.step:
            self.checkpointer.save(self.step, self.train_state(), sync=True)
        if self.rank == 0:
            again = f"; {signals.repeats} more signal(s) during the save were ignored" if signals.repeats else ""
            logger.warning("%s received: checkpoint step %d saved in %.2f s (size the grace period before "
                           "SIGKILL above this)%s; stopping (exit code %d: run the job again to resume)",
                           name, self.step, time.perf_counter() - started, again, PREEMPTED_EXIT_CODE)

    def train_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the run besides weights, optimizer, schedule and data: the
        tokens seen, and an objective's own state (online RL's rollouts in progress), every
        rank's (a collective)."""
        state: dict[str, Any] = {"tokens_seen": self.tokens_seen}
        if isinstance(self.objective, StatefulObjective):
            ranks: list[Any] = [None] * self.world_size
            dist.all_gather_object(ranks, self.objective.state_dict(), group=dist.group.WORLD)  # (by global rank)
            state["objective"] = ranks
        return state

    def load_checkpoint(self) -> int:
        """Resume from the newest checkpoint of ``checkpoint.folder`` (or load
        ``checkpoint.initial_load_path``): weights, optimizer, schedule, data position and the
        train state; returns the step it is at (unchanged when there is nothing to load)."""
        state = None if self.checkpointer is None else self.checkpointer.load()
        if state:
            self.step, self.tokens_seen = int(state.get("step", 0)), int(state.get("tokens_seen", 0))
            self._load_objective_state(state.get("objective"))
        return self.step

    def _load_objective_state(self, ranks: list[Any] | None) -> None:
        """Each rank's objective state back (another world size: rank 0's, without what is per rank)."""
        if ranks and isinstance(self.objective, StatefulObjective):
            same = len(ranks) == self.world_size
            self.objective.load_state_dict(ranks[self.rank] if same else ranks[0], same_ranks=same)

    def save_seed_checkpoint(self) -> str:
        """Write the initialised weights as ``step-0`` (one process); returns its path."""
        if self.checkpointer is None or not self.config.checkpoint.create_seed_checkpoint:
            raise RuntimeError("save_seed_checkpoint needs checkpoint.create_seed_checkpoint = true")
        return str(self.checkpointer.save(0, {"tokens_seen": 0}, sync=True))

    def _timed_step(self) -> StepState:
        """One step, timed; a step whose update was not applied is logged at once and handled by
        ``training.on_nonfinite`` (stop, go on, or roll back: then the state says so)."""
        start = time.perf_counter()
        values = self.train_step()
        if values["skipped"]:
            step = self.step
            self.log_metrics(step, values)  # the diverged step is on record (loss null in JSON)
            resumed = self.divergence(step, values)
            if resumed is not None:  # rolled back: the steps since the checkpoint run again
                self.step, self.tokens_seen = resumed.step, resumed.tokens_seen
                return StepState(step=step, values=values, rolled_back=True, logged=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        # (online RL: generating the rollouts is timed apart; the training figures leave it out)
        generation = float(values.get("generation_time_s") or 0.0)
        if generation:
            values["training_time_s"] = elapsed - generation
        tps = values["tokens_per_rank"] / max(elapsed - generation, 1e-9)
        values.update(step_time_s=elapsed, compute_time_s=elapsed - values["data_time_s"] - generation, tps=tps,
                      tflops=tps * self.flops_per_token / 1e12, tokens_seen=float(self.tokens_seen))
        if self.peak_tflops:
            values["mfu_pct"] = 100.0 * values["tflops"] / self.peak_tflops
        return StepState(step=self.step, values=values, last=self.step == self.config.training.steps,
                         logged=bool(values["skipped"]))

    def weights_finite(self) -> bool:
        """Whether every trained parameter of every rank is finite (before a save: a checkpoint is
        never written from non-finite weights; frozen ones, such as a 4-bit base, never change)."""
        bad = torch.zeros((), device=self.device)
        with torch.no_grad():
            for p in (p for p in self.model.parameters() if p.requires_grad):
                local = p.to_local() if isinstance(p, DTensor) else p
                bad += (~torch.isfinite(local)).sum().to(bad.dtype)
        dist.all_reduce(bad, group=dist.group.WORLD)  # every rank saves or stops alike
        return bad.item() == 0

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        """``with Trainer(config) as trainer:`` closes it on leaving, without the closing
        barrier when an exception leaves the block."""
        self.close(clean=exc_type is None)

    def close(self, *, clean: bool = True) -> None:
        """Release the metrics files and the process group.

        ``clean=False`` (after an error) skips the closing barrier: the other ranks may be
        blocked in a collective this rank will never join, and waiting for them would only
        hang the job until the process-group timeout.
        """
        for callback in self.callbacks:
            callback.close(self)
        self.metrics.close()
        if clean and self.checkpointer is not None:
            self.checkpointer.close()
        self._lock.release()
        destroy_distributed(barrier=clean)
