"""The start-up lines of a job's log (rank 0): the job, the model and its parallelism, the data,
MFU's reference, checkpointing and compile, the mixture of experts, float8, LoRA."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_lite.config.schema import JobConfig
from torchtitan_lite.data.loader import BatchLoader
from torchtitan_lite.distributed.activation_checkpoint import describe as describe_ac
from torchtitan_lite.distributed.mesh import ParallelMesh
from torchtitan_lite.dtypes import cpu_has_bf16
from torchtitan_lite.job import JobPlan
from torchtitan_lite.models.moe import aux_loss_weight
from torchtitan_lite.training.validate import Validator

if TYPE_CHECKING:
    from torchtitan_lite.memory.auto import AutoReshardPlan

__all__ = ["log_startup"]

logger = logging.getLogger("torchtitan_lite")


def _describe_data(config: JobConfig, loader: BatchLoader, validators: dict[str | None, Validator]) -> str:
    v = config.validation
    text = loader.describe()
    for name, validator in validators.items():
        label = v.dataset_path or v.dataset if name is None else repr(name)
        text += (f"; validation {label}: {validator.num_windows} of {len(validator.windows)} windows every "
                 f"{v.freq} steps")
    return text


def log_startup(config: JobConfig, plan: JobPlan, *, model: nn.Module, mesh: ParallelMesh, loader: BatchLoader,
                validators: dict[str | None, Validator], reshard_plan: AutoReshardPlan | None = None,
                mfu: str = "") -> None:
    """The start-up lines of the log (rank 0): the job, the model and its parallelism, the data,
    MFU's reference, checkpointing and compile, float8, LoRA."""
    if dist.get_rank() != 0:
        return
    t, ac = config.training, config.activation_checkpoint
    logger.info("job: %s", config.job.description)
    for note in plan.notes:
        logger.info("note: %s", note)
    if config.job.print_config:
        logger.info("config:\n%s", json.dumps(config.to_dict(), indent=2))
    n_params = sum(p.numel() for p in model.parameters())
    sharding = "FSDP2" if plan.shard else "not sharded (one process)" + (
        f", autocast to {str(plan.autocast_dtype).removeprefix('torch.')}" if plan.autocast_dtype else "")
    logger.info("model %s %s: %.2fM parameters, vocab %d (%s); mesh %s, %s; global batch %d = %d ranks "
                "× %d × %d accumulation steps; seq_len %d",
                config.model.name, config.model.flavor, n_params / 1e6, plan.model_args.vocab_size,
                type(plan.tokenizer).__name__, mesh.describe(),
                sharding, plan.global_batch_size, plan.dp_size, t.local_batch_size, plan.shape.grad_accum_steps,
                t.seq_len)
    if plan.shape.device_type == "cpu" and torch.bfloat16 in (plan.shape.param_dtype, plan.autocast_dtype) \
            and not cpu_has_bf16():
        logger.warning("bfloat16 on a CPU without bfloat16 instructions (no avx512_bf16, amx_bf16 or bf16 in "
                       "/proc/cpuinfo): its products are emulated, several times slower than float32 here; "
                       "--training.mixed_precision_param float32 is faster")
    logger.info("data: %s", _describe_data(config, loader, validators))
    if mfu:
        logger.info("MFU: %s", mfu)
    added = (f" (auto adds {reshard_plan.recomputed_text()})"
             if reshard_plan is not None and reshard_plan.recomputed else "")
    tiles = plan.shape.mlp_tiles
    memory = [what for on, what in (
        (plan.shape.activation_offload, "checkpointed blocks' inputs offloaded to host memory"),
        (tiles != 1, "feed-forwards in " + ("tiles chosen from the sequence" if tiles == 0 else f"{tiles} tiles")),
        (plan.shape.tiled_loss, "the tiled loss (no whole logits)")) if on]
    logger.info("activation checkpointing: %s%s%s; compile: %s", describe_ac(ac.mode, ac.selective_ac_option),
                added, "".join(f"; {m}" for m in memory),
                ", ".join(config.compile.components) if config.compile.enable else "off")
    if plan.model_args.num_experts:
        logger.info(_describe_moe(config, plan))
    if plan.shape.float8 is not None:
        logger.info(plan.shape.float8.describe(sum(type(m).__name__ == "Float8Linear" for m in model.modules())))
        if plan.model_args.num_experts:
            logger.info("float8: the experts' grouped products stay in %s (torchao's float8 grouped products are "
                        "not applied here); float8 covers the attention and dense linears",
                        str(plan.shape.param_dtype).removeprefix("torch."))
    if plan.shape.lora is not None:
        logger.info(plan.shape.lora.describe(model))


def _describe_moe(config: JobConfig, plan: JobPlan) -> str:
    """The mixture of experts in one line: layers, experts, routing, balancing, active parameters."""
    a, e = plan.model_args, config.moe
    aux = aux_loss_weight(e.aux_loss_coef, a)
    balance = [f"load-balancing loss × {aux:g}" if aux else "", f"z-loss × {e.z_loss_coef:g}" if e.z_loss_coef else "",
               f"bias balancing at {e.bias_update_rate:g} per step" if e.bias_update_rate else ""]
    shared = f", a shared expert of width {a.shared_hidden_dim}" if a.shared_hidden_dim else ""
    return (f"mixture of experts: {a.moe_layers()} of {a.n_layers} layers, {a.num_experts} experts of width "
            f"{a.moe_hidden_dim}{shared}, top-{a.top_k} by {a.score_func}; {a.active_params() / 1e6:.2f}M of "
            f"{a.num_params() / 1e6:.2f}M parameters active per token (MFU counts those); "
            f"{', '.join(b for b in balance if b) or 'no balancing'}")
