"""The trainer: builds a job from its config and plan (data, process group, sharded model,
optimizer, checkpoints, metrics) and runs the loop. ``python -m torchtitan_lite.train`` is
:mod:`torchtitan_lite.train`."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan_lite.arrow_data import STREAMED_DATASETS, ArrowCorpus, StreamingLoader
from torchtitan_lite.checkpoint.hf_storage import HFExportExtras
from torchtitan_lite.checkpoint.manager import CheckpointManager, committed_steps
from torchtitan_lite.config.schema import JobConfig
from torchtitan_lite.data import GlobalBatchLoader, TokenWindows, build_token_stream, hf_tokenizer_json
from torchtitan_lite.distributed import (
    build_mesh,
    choose_device,
    destroy_distributed,
    init_distributed,
    local_world_size_from_env,
    set_collective_timeout,
    world_info_from_env,
)
from torchtitan_lite.distributed.activation_checkpoint import describe as describe_ac
from torchtitan_lite.distributed.compile import compile_loss
from torchtitan_lite.distributed.float8 import float8_unavailable, precompute_float8_scales
from torchtitan_lite.distributed.parallelize import build_sharded_model
from torchtitan_lite.dump_lock import DumpFolderLock
from torchtitan_lite.errors import ConfigError, TrainingError
from torchtitan_lite.gc_control import GarbageCollection
from torchtitan_lite.job import JobPlan, check_initial_load, plan_job, preflight
from torchtitan_lite.loss import token_loss_sum
from torchtitan_lite.metrics import MetricsLogger, device_peak_tflops, memory_stats, reset_peak_memory
from torchtitan_lite.optim import build_lr_scheduler, build_optimizer
from torchtitan_lite.profiling import Profiler
from torchtitan_lite.validate import Validator

if TYPE_CHECKING:
    from torchtitan_lite.memory.auto import AutoReshardPlan

__all__ = ["Trainer", "clip_grad_norm_"]

logger = logging.getLogger("torchtitan_lite")


@torch.no_grad()
def clip_grad_norm_(
    parameters: list[torch.nn.Parameter], max_norm: float, *, foreach: bool | None = None
) -> torch.Tensor:
    """Global L2 gradient norm over sharded (DTensor) or plain gradients; clip when ``max_norm > 0``.

    The norm of DTensor gradients is reduced over the mesh (``full_tensor``), so every rank
    gets the same global norm; with CPU offload that reduction runs on CPU tensors, which is
    why the process group then carries a CPU backend.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=foreach)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=foreach)
    return total


class Trainer:
    """Builds everything a job needs from a :class:`JobConfig` and its :class:`JobPlan`, and runs
    the loop."""

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
        t, p, v = config.training, config.parallelism, config.validation
        self.device = choose_device(local_rank)
        if plan.float8 is not None:  # the device can run it (and torchao imports), before any data is read
            unavailable = float8_unavailable(self.device, emulate=plan.float8["emulate"])
            if unavailable:
                raise ConfigError(f"model.converters: invalid value {config.model.converters!r}; {unavailable}")

        # Data first, before any process group or model: a bad path, an empty dataset or a
        # tokenizer that does not fit fails here, on every rank alike, in seconds.
        self.tokenizer = plan.tokenizer
        self.model_args = plan.model_args
        # Parquet/Arrow datasets are streamed: only their files' metadata is read here.
        train_corpus = (ArrowCorpus(t.dataset, t.dataset_path, text_column=t.dataset_text_column)  # type: ignore[arg-type]
                        if t.dataset in STREAMED_DATASETS else None)
        if train_corpus is not None:  # from the files' metadata, before any process group
            train_corpus.check_global_batch(plan.global_batch_size)
        train_windows = None if train_corpus is not None else TokenWindows(
            build_token_stream(t.dataset, t.dataset_path, self.tokenizer,
                               token_dtype=t.dataset_token_dtype),
            t.seq_len,
            source=f"training dataset {t.dataset_path or t.dataset!r}",
        )
        val_windows = None
        if v.enable:
            val_windows = TokenWindows(
                build_token_stream(v.dataset, v.dataset_path, self.tokenizer, section="validation",
                                   token_dtype=t.dataset_token_dtype, text_column=t.dataset_text_column,
                                   max_tokens=(None if v.steps == -1 else
                                               v.steps * plan.val_global_batch_size * (plan.val_seq_len + 1))),
                plan.val_seq_len,
                seq_len_key="validation.seq_len" if v.seq_len > 0 else "training.seq_len",
                source=f"validation dataset {v.dataset_path or v.dataset!r}",
            )

        if plan.reshard_mode == "auto":
            from torchtitan_lite.memory.auto import auto_budget_bytes

            try:
                device_bytes = (torch.cuda.get_device_properties(self.device).total_memory
                                if self.device.type == "cuda" else None)
                budget, budget_source = auto_budget_bytes(p.memory_budget_gib, device_bytes)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if config.debug.deterministic:
            torch.use_deterministic_algorithms(True)
            if self.device.type == "cuda":
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        init_distributed(
            self.device, cpu_collectives=t.enable_cpu_offload and self.device.type == "cuda",
            timeout_s=config.comm.init_timeout_seconds,
        )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if self.world_size != plan.world_size:
            raise ConfigError(f"the job was planned for {plan.world_size} ranks but the process group has "
                              f"{self.world_size}")
        # One job per dump folder: rank 0 holds the folder's lock for the job's life; every rank
        # learns whether it got it, so a second job ends on all ranks at once.
        self._lock = DumpFolderLock(config.job.dump_folder)
        refused: list[ConfigError | None] = [None]
        if self.rank == 0:
            try:
                self._lock.acquire()
            except ConfigError as exc:
                refused[0] = exc
        dist.broadcast_object_list(refused, src=0)
        if refused[0] is not None:
            raise refused[0]
        self.dims = plan.dims
        self.mesh = build_mesh(self.device, self.dims)
        set_collective_timeout(config.comm.init_timeout_seconds, self.mesh)  # HSDP's subgroups too
        if self.rank == 0:
            logger.info("job: %s", config.job.description)
            if config.job.print_config:
                logger.info("config:\n%s", json.dumps(config.to_dict(), indent=2))

        # Every rank maps the same token stream; each takes its slice of every global batch.
        # The mesh is all data-parallel, so the data-parallel rank is the global rank.
        self.global_batch_size = plan.global_batch_size
        self.loader: GlobalBatchLoader | StreamingLoader
        split = {"global_batch_size": self.global_batch_size, "local_batch_size": t.local_batch_size,
                 "dp_rank": self.rank, "dp_size": self.dims.dp_size}
        if train_corpus is not None:
            self.loader = StreamingLoader(train_corpus, self.tokenizer, seq_len=t.seq_len, **split)
        else:
            assert train_windows is not None
            self.loader = GlobalBatchLoader(train_windows, seed=config.debug.seed, **split)
        self.validator = None
        if val_windows is not None:
            self.validator = Validator(
                val_windows,
                local_batch_size=plan.val_local_batch_size,
                global_batch_size=plan.val_global_batch_size,
                dp_rank=self.rank,
                dp_size=self.dims.dp_size,
                steps=v.steps,
                device=self.device,
            )

        reshard_mode = plan.reshard_mode
        self.reshard_plan: AutoReshardPlan | None = (
            self._plan_auto_reshard(budget, budget_source) if reshard_mode == "auto" else None)
        ac_policies = None
        if self.reshard_plan is not None:  # auto also chose each block's checkpointing
            reshard_mode = self.reshard_plan.reshard
            ac_policies = self.reshard_plan.ac_policies
            if self.rank == 0:
                logger.info("%s (budget: %s)", self.reshard_plan.summary(), budget_source)

        # Model: meta → sharded → allocated → initialised. No rank ever holds the full model.
        model = build_sharded_model(
            plan.spec, self.model_args, self.mesh, device=self.device, seed=config.debug.seed,
            ac_mode=config.activation_checkpoint.mode,
            selective_ac_option=config.activation_checkpoint.selective_ac_option,
            ac_policies=ac_policies,
            compile_model=config.compile.enable and "model" in config.compile.components,
            compile_backend=config.compile.backend,
            float8=plan.float8,
            reshard_after_forward_mode=reshard_mode,
            param_dtype=plan.param_dtype,
            reduce_dtype=plan.reduce_dtype,
            cpu_offload=t.enable_cpu_offload,
        )
        model.train()
        self.model = model
        compile_the_loss = config.compile.enable and "loss" in config.compile.components
        self.loss_fn = (compile_loss(token_loss_sum, backend=config.compile.backend) if compile_the_loss
                        else token_loss_sum)

        schedule_steps = plan.schedule_steps
        if config.lr_scheduler.warmup_steps >= schedule_steps and self.rank == 0:
            logger.warning(
                "lr_scheduler.warmup_steps=%d >= the schedule's %d steps: warmup is cut to %d steps "
                "and the learning rate never decays",
                config.lr_scheduler.warmup_steps, schedule_steps, schedule_steps,
            )
        self.optimizer = build_optimizer(model, config.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.lr_scheduler, total_steps=schedule_steps)
        self.step = 0
        self.tokens_seen = 0
        self._rollbacks = 0
        self.checkpointer: CheckpointManager | None = None
        ck = config.checkpoint
        if ck.enable or ck.create_seed_checkpoint or ck.initial_load_path is not None:
            self.checkpointer = CheckpointManager(
                ck, dump_folder=config.job.dump_folder, model=model, optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler, loader=self.loader, model_spec=plan.spec,
                timeout_s=config.comm.init_timeout_seconds,
                run_config={f"{section}.{key}": value for section, values in config.to_dict().items()
                            for key, value in values.items()},
                hf_extras=HFExportExtras(
                    bos_id=plan.tokenizer.bos_id, eos_id=plan.tokenizer.eos_id,
                    tokenizer_file=hf_tokenizer_json(plan.tokenizer, convert=ck.last_save_in_hf and self.rank == 0)),
            )
            # A seed checkpoint holds the freshly initialised weights: nothing is loaded.
            state = None if ck.create_seed_checkpoint else self.checkpointer.load()
            if state:
                self.step = int(state.get("step", 0))
                self.tokens_seen = int(state.get("tokens_seen", 0))
        self.flops_per_token = self.model_args.flops_per_token(t.seq_len)
        self.peak_tflops, peak_source = device_peak_tflops(
            self.device, config.metrics.peak_tflops, compute_dtype=plan.param_dtype
        )
        self.metrics = MetricsLogger(
            rank=self.rank,
            dump_folder=config.job.dump_folder,
            enable_tensorboard=config.metrics.enable_tensorboard,
            tb_folder=config.metrics.save_tb_folder,
            run_config=config.to_dict(),
            disable_color=config.metrics.disable_color_printing,
        )
        if self.rank == 0:
            n_params = sum(p.numel() for p in model.parameters())
            logger.info(
                "model %s %s: %.2fM parameters, vocab %d (%s); mesh %s; global batch %d = %d ranks "
                "× %d × %d accumulation steps; seq_len %d",
                config.model.name, config.model.flavor, n_params / 1e6, self.model_args.vocab_size,
                type(self.tokenizer).__name__,
                dict(zip(self.mesh.mesh_dim_names or (), self.mesh.shape, strict=False)),
                self.global_batch_size, self.dims.dp_size, t.local_batch_size,
                plan.grad_accum_steps, t.seq_len,
            )
            logger.info(
                "data: %s%s",
                self.loader.describe() if isinstance(self.loader, StreamingLoader) else
                f"{t.dataset_path or t.dataset}, {len(self.loader.windows.tokens)} tokens, {len(self.loader.windows)} "
                f"windows of {t.seq_len + 1} ({t.steps * self.global_batch_size / len(self.loader.windows):.2f} "
                f"epochs in {t.steps} steps)",
                "" if self.validator is None else
                f"; validation: {v.dataset_path or v.dataset}, {self.validator.num_windows} of "
                f"{len(val_windows)} windows every {v.freq} steps",
            )
            logger.info("MFU: %s", f"against {self.peak_tflops} TFLOP/s ({peak_source})"
                        if self.peak_tflops else f"not reported: {peak_source}")
            ac = config.activation_checkpoint
            added = (f" (auto adds {self.reshard_plan.recomputed_text()})"
                     if self.reshard_plan is not None and self.reshard_plan.recomputed else "")
            logger.info("activation checkpointing: %s%s; compile: %s", describe_ac(ac.mode, ac.selective_ac_option),
                        added, ", ".join(config.compile.components) if config.compile.enable else "off")
            if plan.float8 is not None:
                converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
                f8 = plan.float8
                logger.info("float8: %d linears of the blocks (%s%s); all-gather in float8: %s%s", converted,
                            f8["recipe_name"] or "tensorwise", ", emulated" if f8["emulate"] else "",
                            "yes" if f8["enable_fsdp_float8_all_gather"] else "no",
                            ", scales computed after each optimizer step" if plan.precompute_float8_scales else "")

    def _plan_auto_reshard(self, budget: int, budget_source: str) -> AutoReshardPlan:
        """``reshard_after_forward_mode = "auto"``: rank 0 works out the per-unit plan (memory
        estimates on fake tensors, in a child process) and every rank applies that one plan."""
        from torchtitan_lite.memory.auto import plan_auto_reshard
        from torchtitan_lite.memory.estimate import job_estimate_kwargs

        chosen: list[AutoReshardPlan | Exception | None] = [None]
        if self.rank == 0:
            try:
                chosen[0] = plan_auto_reshard(
                    self.plan.spec, self.model_args, budget_bytes=budget,
                    count_offloaded=self.device.type == "cpu", budget_source=budget_source,
                    # The other ranks wait in the broadcast below for at most init_timeout_seconds.
                    timeout_s=max(1, self.config.comm.init_timeout_seconds - 10),
                    **job_estimate_kwargs(self.config, self.plan),
                )
            except ValueError as exc:  # the budget is too small even when resharding everything
                chosen[0] = ConfigError(str(exc))
            except Exception as exc:  # noqa: BLE001 - every rank raises it below instead of waiting
                chosen[0] = RuntimeError(f"reshard_after_forward_mode auto: the memory estimate failed: {exc}")
        dist.broadcast_object_list(chosen, src=0)
        if isinstance(chosen[0], Exception):
            raise chosen[0]
        return chosen[0]  # type: ignore[return-value]

    def train_step(self) -> dict[str, float]:
        """One optimizer step over one global batch; returns its metrics (same on every rank)."""
        t = self.config.training
        data_start = time.perf_counter()
        micro_batches = self.loader.next_batch()
        data_time = time.perf_counter() - data_start

        tokens_this_rank = sum(labels.numel() for _, labels in micro_batches)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for inputs, labels in micro_batches:
            inputs = inputs.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            token_loss = self.loss_fn(self.model(inputs), labels)
            # Normalised by all tokens this rank sees in the step; FSDP averages over ranks,
            # so the gradient is that of the mean loss over every token of the global batch.
            (token_loss / tokens_this_rank).backward()
            loss_sum += token_loss.detach().double()

        grad_norm = clip_grad_norm_(list(self.model.parameters()), t.max_norm)
        lr = self.lr_scheduler.get_last_lr()[0]
        global_tokens = tokens_this_rank * self.dims.dp_size
        dist.all_reduce(loss_sum)
        loss, norm = float(loss_sum.item() / global_tokens), float(grad_norm.item())
        # Both are global (the same on every rank), so every rank decides alike: a non-finite
        # step's update is never applied (training.on_nonfinite says what happens next).
        finite = math.isfinite(loss) and math.isfinite(norm)
        if finite:
            self.optimizer.step()
            if self.plan.precompute_float8_scales:
                precompute_float8_scales(self.model)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += global_tokens
        return {
            "loss": loss,
            "grad_norm": norm,
            "lr": float(lr),
            "data_time_s": data_time,
            "tokens_per_rank": float(tokens_this_rank),
            "skipped": 0.0 if finite else 1.0,
        }

    def _diverged(self, values: dict[str, float]) -> None:
        """A step whose update was not applied: stop, go on, or roll back
        (``training.on_nonfinite``). Raises :class:`TrainingError` to stop."""
        t = self.config.training
        what = f"step {self.step}: the loss ({values['loss']}) or gradient norm ({values['grad_norm']})"
        if t.on_nonfinite == "skip":
            if self.rank == 0:
                logger.warning("%s is not finite: its update was skipped (training.on_nonfinite = 'skip')", what)
            return
        if t.on_nonfinite == "rollback" and self.checkpointer is not None and self._rollbacks < t.max_rollbacks:
            bad = self.loader.step - 1  # the global batch this step read
            state = self.checkpointer.rollback()
            if state is not None:
                self._rollbacks += 1
                self.loader.skipped.add(bad)
                self.step = int(state["step"])
                self.tokens_seen = int(state.get("tokens_seen", 0))
                if self.rank == 0:
                    logger.warning("%s is not finite: rolled back to step %d, leaving out global batch %d "
                                   "(rollback %d of at most %d)", what, self.step, bad, self._rollbacks,
                                   t.max_rollbacks)
                return
            raise TrainingError(f"training diverged at {what} is not finite; the update was not applied; "
                                "training.on_nonfinite = 'rollback' found no checkpoint of this run with its "
                                "optimizer state to go back to (the first is written at checkpoint.interval)")
        folder = None if self.checkpointer is None else self.checkpointer.folder
        kept = committed_steps(folder) if folder is not None and self.config.checkpoint.enable else []
        intact = (f"the checkpoints in {str(folder)!r} (steps {kept}) are from finite steps" if kept
                  else "no checkpoint was written")
        if t.on_nonfinite == "rollback":
            raise TrainingError(f"training diverged at {what} is not finite after {self._rollbacks} rollbacks "
                                f"(training.max_rollbacks = {t.max_rollbacks}); the update was not applied and "
                                f"{intact}; lower optimizer.lr or raise training.max_rollbacks")
        raise TrainingError(f"training diverged at {what} is not finite; the update was not applied and "
                            f"{intact}; lower optimizer.lr, or set training.on_nonfinite = 'skip' or 'rollback'")

    def validate(self) -> dict[str, float]:
        """Validation metrics at the current weights (empty when validation is off)."""
        return {} if self.validator is None else self.validator.run(self.model)

    def train(self) -> list[dict[str, float]]:
        """Run until ``training.steps``; returns every step's metrics (validation included)."""
        cfg = self.config
        history: list[dict[str, float]] = []
        if self.step >= cfg.training.steps and self.rank == 0:
            logger.warning("nothing to train: the run is at step %d and training.steps = %d (raise "
                           "training.steps to train further)", self.step, cfg.training.steps)
        reset_peak_memory(self.device)
        gc_handler = GarbageCollection(cfg.training.gc_freq)
        try:
            with Profiler(cfg.profiling, dump_folder=cfg.job.dump_folder, rank=self.rank,
                          device=self.device, start_step=self.step) as profiler:
                while self.step < cfg.training.steps:
                    history.append(self._timed_step(gc_handler))
                    profiler.step()
                    if len(history) == 1:  # start-up is over: from now on a missing peer is an error soon
                        set_collective_timeout(
                            cfg.comm.train_timeout_seconds, self.mesh,
                            extra_groups=[] if self.checkpointer is None else self.checkpointer.process_groups)
            if self.checkpointer is not None:
                self.checkpointer.wait()  # the last background save is committed before we return
        finally:
            gc_handler.close()
        return history

    def save_seed_checkpoint(self) -> str:
        """Write the initialised weights as ``step-0`` (one process); returns its path."""
        if self.checkpointer is None or not self.config.checkpoint.create_seed_checkpoint:
            raise RuntimeError("save_seed_checkpoint needs checkpoint.create_seed_checkpoint = true")
        return str(self.checkpointer.save(0, {"tokens_seen": 0}))

    def _timed_step(self, gc_handler: GarbageCollection) -> dict[str, float]:
        cfg = self.config
        start = time.perf_counter()
        values = self.train_step()
        logged = bool(values["skipped"])
        if logged:
            step = self.step
            self.metrics.log(step, values)  # the diverged step is on record (loss null in JSON)
            self._diverged(values)
            if self.step != step:  # rolled back: the steps since the checkpoint run again
                return {"step": step, **values}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        tps = values["tokens_per_rank"] / elapsed
        values.update(
            step_time_s=elapsed,
            compute_time_s=elapsed - values["data_time_s"],
            tps=tps,
            tflops=tps * self.flops_per_token / 1e12,
            tokens_seen=float(self.tokens_seen),
        )
        if self.peak_tflops:
            values["mfu_pct"] = 100.0 * values["tflops"] / self.peak_tflops
        last = self.step == cfg.training.steps
        v = cfg.validation
        if self.validator is not None and (self.step % v.freq == 0 or last):
            values.update(self.validate())
        if not logged and (self.step == 1 or self.step % cfg.metrics.log_freq == 0 or last
                           or "validation_loss" in values):
            self.metrics.log(self.step, {**values, **memory_stats(self.device)})
            reset_peak_memory(self.device)
        if self.checkpointer is not None and self.checkpointer.should_save(self.step, last=last):
            if not self._weights_finite():
                raise TrainingError(f"step {self.step}: the weights are not finite (the loss was {values['loss']}); "
                                    "no checkpoint was written from them; lower optimizer.lr")
            self.checkpointer.save(self.step, {"tokens_seen": self.tokens_seen}, last=last)
        gc_handler.run(self.step)
        return {"step": self.step, **values}

    def _weights_finite(self) -> bool:
        """Whether every parameter of every rank is finite (before a save: a checkpoint is never
        written from non-finite weights)."""
        bad = torch.zeros((), device=self.device)
        with torch.no_grad():
            for p in self.model.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                bad += (~torch.isfinite(local)).sum().to(bad.dtype)
        dist.all_reduce(bad)
        return bad.item() == 0

    def close(self, *, clean: bool = True) -> None:
        """Release the metrics files and the process group.

        ``clean=False`` (after an error) skips the closing barrier: the other ranks may be
        blocked in a collective this rank will never join, and waiting for them would only
        hang the job until the process-group timeout.
        """
        self.metrics.close()
        if clean and self.checkpointer is not None:
            self.checkpointer.close()
        self._lock.release()
        destroy_distributed(barrier=clean)
