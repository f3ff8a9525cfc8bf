"""A training loop of one's own on torchtitan_lite's parts: config, plan, data, model, optimizer."""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan_lite.config import load_job_config
from torchtitan_lite.distributed import choose_device, destroy_distributed, world_info_from_env
from torchtitan_lite.distributed.clip import clip_grad_norm_
from torchtitan_lite.job import plan_job, preflight
from torchtitan_lite.trainer import build_data, build_model, build_optimizers, setup_distributed

config = load_job_config(["--job.config_file", "train_configs/debug_model.toml", *sys.argv[1:]])
rank, local_rank, world_size = world_info_from_env()
preflight(config)                                   # files and folders, before any process group
plan = plan_job(config, world_size=world_size)      # batch split, model shape, sharding: once
device = choose_device(local_rank)
loader, _ = build_data(config, plan, dp_rank=rank)
mesh, lock = setup_distributed(config, plan, device)
model = build_model(config, plan, mesh=mesh, device=device)
optimizer, lr_schedule = build_optimizers(config, plan, model)

for step in range(1, config.training.steps + 1):
    micro_batches = loader.next_batch()             # this rank's share of one global batch
    cross_entropy = torch.zeros((), device=device)
    for inputs, labels in micro_batches:
        logits = model(inputs.to(device)).float()
        ce = F.cross_entropy(logits.flatten(0, 1), labels.to(device).flatten())
        z_loss = 1e-4 * torch.logsumexp(logits, dim=-1).pow(2).mean()
        ((ce + z_loss) / len(micro_batches)).backward()
        cross_entropy += ce.detach() / len(micro_batches)
    clip_grad_norm_(list(model.parameters()), config.training.max_norm)
    optimizer.step()
    lr_schedule.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(cross_entropy)                  # the mean over the data-parallel ranks
    if rank == 0:
        print(f"step {step} cross-entropy {cross_entropy.item() / plan.dp_size:.4f}", flush=True)

lock.release()
destroy_distributed()
