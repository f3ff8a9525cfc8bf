"""The trainer and ``python -m torchtitan_lite.train``.

    torchrun --standalone --nproc_per_node=2 -m torchtitan_lite.train \\
        --job.config_file train_configs/debug_model.toml --training.steps 20
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan_lite.config import ConfigError, JobConfig, format_help, load_job_config
from torchtitan_lite.data import ByteTokenizer, GlobalBatchLoader, TokenWindows, build_token_stream
from torchtitan_lite.distributed import (
    ParallelDims,
    build_mesh,
    choose_device,
    destroy_distributed,
    init_distributed,
    world_info_from_env,
)
from torchtitan_lite.metrics import MetricsLogger, memory_stats
from torchtitan_lite.models import MODEL_REGISTRY
from torchtitan_lite.optim import build_lr_scheduler, build_optimizer
from torchtitan_lite.parallelize import apply_fsdp

__all__ = ["Trainer", "main", "clip_grad_norm_"]

logger = logging.getLogger("torchtitan_lite")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    """Builds everything a job needs from a validated :class:`JobConfig` and runs the loop."""

    def __init__(self, config: JobConfig) -> None:
        self.config = config
        rank, local_rank, world_size = world_info_from_env()
        config.validate(world_size=world_size)
        t, p = config.training, config.parallelism

        self.device = choose_device(local_rank)
        if config.debug.deterministic:
            torch.use_deterministic_algorithms(True)
            if self.device.type == "cuda":
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        init_distributed(
            self.device, cpu_collectives=t.enable_cpu_offload and self.device.type == "cuda"
        )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dims = ParallelDims.resolve(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            world_size=self.world_size,
        )
        self.mesh = build_mesh(self.device, self.dims)
        if self.rank == 0:
            logger.info("job: %s", config.job.description)
            if config.job.print_config:
                logger.info("config:\n%s", json.dumps(config.to_dict(), indent=2))

        # Data. Every rank holds the same token stream; each takes its slice of a global batch.
        self.tokenizer = ByteTokenizer()
        tokens = build_token_stream(t.dataset, t.dataset_path, self.tokenizer)
        self.global_batch_size = (
            t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * self.dims.dp_size
        )
        self.loader = GlobalBatchLoader(
            TokenWindows(tokens, t.seq_len),
            global_batch_size=self.global_batch_size,
            local_batch_size=t.local_batch_size,
            dp_rank=self.rank,
            dp_size=self.dims.dp_size,
            seed=config.debug.seed,
        )

        # Model: meta → sharded → allocated → initialised. No rank ever holds the full model.
        model_cls, flavors = MODEL_REGISTRY[config.model.name]
        self.model_args = dataclasses.replace(
            flavors[config.model.flavor], vocab_size=self.tokenizer.vocab_size
        )
        with torch.device("meta"):
            model = model_cls(self.model_args)
        apply_fsdp(
            model,
            self.mesh,
            reshard_after_forward_mode=p.reshard_after_forward_mode,
            param_dtype=_DTYPES[t.mixed_precision_param],
            reduce_dtype=_DTYPES[t.mixed_precision_reduce],
            cpu_offload=t.enable_cpu_offload,
        )
        init_device = torch.device("cpu") if t.enable_cpu_offload else self.device
        model.to_empty(device=init_device)
        torch.manual_seed(config.debug.seed)  # weights depend on the seed only
        model.init_weights(buffer_device=self.device)
        model.train()
        self.model = model

        if config.lr_scheduler.warmup_steps >= t.steps and self.rank == 0:
            logger.warning(
                "lr_scheduler.warmup_steps=%d >= training.steps=%d: warmup is cut to %d steps "
                "and the learning rate never decays",
                config.lr_scheduler.warmup_steps, t.steps, t.steps,
            )
        self.optimizer = build_optimizer(model, config.optimizer)
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, config.lr_scheduler, total_steps=t.steps
        )
        self.step = 0
        self.tokens_seen = 0
        self.metrics = MetricsLogger(
            rank=self.rank,
            dump_folder=config.job.dump_folder,
            enable_tensorboard=config.metrics.enable_tensorboard,
            tb_folder=config.metrics.save_tb_folder,
            run_config=config.to_dict(),
        )
        if self.rank == 0:
            n_params = sum(p.numel() for p in model.parameters())
            logger.info(
                "model %s %s: %.2fM parameters; mesh %s; global batch %d = %d ranks × %d × %d "
                "accumulation steps; seq_len %d",
                config.model.name, config.model.flavor, n_params / 1e6,
                dict(zip(self.mesh.mesh_dim_names or (), self.mesh.shape, strict=False)),
                self.global_batch_size, self.dims.dp_size, t.local_batch_size,
                self.loader.grad_accum_steps, t.seq_len,
            )

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
            logits = self.model(inputs)
            token_loss = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), reduction="sum"
            )
            # Normalised by all tokens this rank sees in the step; FSDP averages over ranks,
            # so the gradient is that of the mean loss over every token of the global batch.
            (token_loss / tokens_this_rank).backward()
            loss_sum += token_loss.detach().double()

        grad_norm = clip_grad_norm_(list(self.model.parameters()), t.max_norm)
        lr = self.lr_scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

        global_tokens = tokens_this_rank * self.dims.dp_size
        dist.all_reduce(loss_sum)
        self.step += 1
        self.tokens_seen += global_tokens
        return {
            "loss": float(loss_sum.item() / global_tokens),
            "grad_norm": float(grad_norm.item()),
            "lr": float(lr),
            "data_time_s": data_time,
            "tokens_per_rank": float(tokens_this_rank),
        }

    def train(self) -> list[dict[str, float]]:
        """Run ``training.steps`` steps; returns every step's metrics."""
        cfg = self.config
        history: list[dict[str, float]] = []
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        while self.step < cfg.training.steps:
            start = time.perf_counter()
            values = self.train_step()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            elapsed = time.perf_counter() - start
            values["step_time_s"] = elapsed
            values["tps"] = values["tokens_per_rank"] / elapsed
            values["tokens_seen"] = float(self.tokens_seen)
            history.append({"step": self.step, **values})
            if (
                self.step == 1
                or self.step % cfg.metrics.log_freq == 0
                or self.step == cfg.training.steps
            ):
                self.metrics.log(self.step, {**values, **memory_stats(self.device)})
        return history

    def close(self, *, clean: bool = True) -> None:
        """Release the metrics files and the process group.

        ``clean=False`` (after an error) skips the closing barrier: the other ranks may be
        blocked in a collective this rank will never join, and waiting for them would only
        hang the job until the process-group timeout.
        """
        self.metrics.close()
        destroy_distributed(barrier=clean)


def _setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="[%(asctime)s] %(message)s" if rank == 0 else f"[rank {rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse and validate the config (exit 2 on a bad one), then train."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        sys.stdout.write(format_help())
        return 0
    rank, local_rank, world_size = world_info_from_env()
    try:
        config = load_job_config(argv, world_size=world_size)
    except ConfigError as exc:
        if local_rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    _setup_logging(rank)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    trainer = Trainer(config)
    try:
        trainer.train()
    except BaseException:
        trainer.close(clean=False)
        raise
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
