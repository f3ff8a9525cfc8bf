"""An objective of one's own: cross-entropy plus a z-loss, weight · logsumexp(logits)² per counted
token, registered under its own name. From the repository's root:
python -m torchtitan_lite.train --job.config_file train_configs/debug_model.toml
--training.objective examples.z_loss_objective.Z_LOSS --training.objective_options '{"weight": 1e-4}'"""

import torch
import torch.distributed as dist

from torchtitan_lite.errors import Problems
from torchtitan_lite.loss import token_loss_sum
from torchtitan_lite.objectives import ObjectiveEntry, ObjectiveParts, ObjectivePlan, PlanContext, register
from torchtitan_lite.objectives.token import TokenObjective


class ZLossObjective(TokenObjective):
    """The token objective whose loss adds ``weight`` × each counted token's logsumexp², and logs
    the z-loss's mean (``z_loss``)."""

    def __init__(self, weight: float, *, tokens_group, **kwargs) -> None:  # (the rest: TokenObjective's)
        super().__init__(self.loss, **kwargs)
        self.weight, self.tokens_group, self.z_sum = weight, tokens_group, None

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        z = (torch.logsumexp(logits.float(), dim=-1).pow(2) * (labels != -100)).sum()
        self.z_sum += z.detach().double()
        return token_loss_sum(logits, labels) + self.weight * z

    def forward_backward(self, runner, batch):
        self.z_sum = torch.zeros((), dtype=torch.float64, device=runner.device)
        result = super().forward_backward(runner, batch)  # (the token objective's step, with this loss)
        if dist.is_initialized():
            dist.all_reduce(self.z_sum, group=self.tokens_group)
        result.metrics["z_loss"] = float(self.z_sum) / result.denominator
        return result


class ZLoss(ObjectiveEntry):
    """The entry: what the plan checks, what the trainer builds, what the console line adds."""

    name = "z_loss"

    def plan(self, config, context: PlanContext) -> ObjectivePlan:
        check = Problems()  # (what the loss cannot run with: one line each, before any process group)
        check.require(context.dims.pp == 1, "parallelism.pipeline_parallel_degree", context.dims.pp,
                      "the z-loss needs the logits, which a pipeline's last stage keeps: expected 1")
        check.require(not config.training.tiled_loss, "training.tiled_loss", True,
                      "the z-loss needs the whole logits: expected false")
        check.raise_all()
        return ObjectivePlan(self, setup=float(config.training.objective_options.get("weight", 1e-4)))

    def build(self, parts: ObjectiveParts) -> ZLossObjective:
        plan = parts.plan
        return ZLossObjective(plan.objective.setup, tokens_group=parts.mesh.tokens, token_ranks=plan.token_ranks,
                              masked=parts.loader.masked, group=parts.mesh.dp_group)

    def console(self, record: dict) -> list[str]:
        return [] if record.get("z_loss") is None else [f"z_loss {record['z_loss']:.2f}"]


Z_LOSS = register(ZLoss())
