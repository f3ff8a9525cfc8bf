"""Balancing a mixture of experts during training: router losses, load metrics, bias balancing.

After each forward the MoE layers hold their :class:`~torchtitan_lite.models.moe.router.Routing`;
:class:`RouterBalance` reads them:

- **Load-balancing loss** as ``transformers`` computes it (``load_balancing_loss_func``) over the
  global batch: ``E · Σ_e (C_e / N) · (P_e / N)``, with ``C_e`` the choices of expert ``e`` and
  ``P_e`` the summed router probabilities of ``e`` over every MoE layer's tokens of every
  data-parallel rank, ``N`` those tokens. The counts are summed over the ranks (one all-reduce of
  ``E`` numbers per micro-batch); each rank's term ``E · Σ_e (C_e / N) · (P^rank_e / N)`` has the
  gradient of its share, and the terms add up to the loss. Micro-batches are averaged (as a
  gradient-accumulating trainer averages ``transformers``' per-batch loss).
- **Router z-loss** (ST-MoE): the mean over the global batch's tokens of the squared log-sum-exp of
  the router logits, summed over the layers.
- **Load metrics**: each layer's tokens per expert over the step and all ranks, reported as
  max / mean (1 is perfect balance), with the losses (``moe/...`` in every metrics sink).
- **Auxiliary-loss-free balancing** (DeepSeek-V3): after a step, each sigmoid router's bias moves
  by ``bias_update_rate`` toward balance (:func:`update_expert_bias`),
  from the step's counts over all ranks, identically on every rank.

Data-parallel ranks reduce gradients by averaging (FSDP), so each rank's term is scaled by the
number of data-parallel ranks, as the token loss is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_lite.models.moe.layer import MoE, moe_layers
from torchtitan_lite.models.moe.router import TopKRouter, expert_counts

__all__ = ["RouterBalance", "aux_loss_weight", "balancing_loss", "update_expert_bias"]


@torch.no_grad()
def update_expert_bias(router: TopKRouter, counts: torch.Tensor, rate: float) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3): after an optimizer step, raise the bias of
    each expert that got fewer tokens than the mean and lower it for each that got more, by
    ``rate`` (``counts``: the step's tokens per expert over every rank)."""
    if router.expert_bias is None:
        raise ValueError(f"a {router.score_func} router has no expert bias to balance")
    counts = counts.to(router.expert_bias.device, torch.float32)
    router.expert_bias.add_(rate * torch.sign(counts.mean() - counts))


def balancing_loss(counts: torch.Tensor, probs_sum: torch.Tensor, rows: int, num_experts: int) -> torch.Tensor:
    """``num_experts × Σ_e (counts[e] / rows) · (probs_sum[e] / rows)``: transformers'
    ``load_balancing_loss_func`` over ``rows`` router rows (tokens × layers) whose choices count
    ``counts[e]`` for expert e (over every top-k slot) and whose probabilities sum to
    ``probs_sum[e]``. Given the counts of every rank and one rank's probabilities, that rank's
    share of the loss over all of them (:class:`RouterBalance`)."""
    return num_experts * (counts / rows * probs_sum / rows).sum()


def aux_loss_weight(aux_loss_coef: float | None, model_args: Any) -> float:
    """The load-balancing loss's weight: ``moe.aux_loss_coef``, else the model's
    ``router_aux_loss_coef`` (0 where it has none)."""
    return aux_loss_coef if aux_loss_coef is not None else float(getattr(model_args, "router_aux_loss_coef", 0.0))


class RouterBalance:
    """The router losses, load counts and bias updates of one model's MoE layers (see the
    module's docstring). ``group``: the ranks whose tokens make up the global batch (data ×
    context parallel; None: one process); ``dp_size``: its ranks."""

    def __init__(self, model: nn.Module, *, aux_loss_coef: float, z_loss_coef: float = 0.0,
                 bias_update_rate: float = 0.0, group: Any = None, dp_size: int = 1) -> None:
        self.layers: dict[str, MoE] = moe_layers(model)
        if not self.layers:
            raise ValueError("RouterBalance: the model has no MoE layers")
        self.num_experts = next(iter(self.layers.values())).router.num_experts
        self.aux_loss_coef, self.z_loss_coef, self.bias_update_rate = aux_loss_coef, z_loss_coef, bias_update_rate
        self.group, self.dp_size = group, dp_size
        self.start_step()

    def start_step(self) -> None:
        """Forget the counts and losses of the previous step, and any routing a forward outside
        training (validation) left on the layers."""
        self._counts: torch.Tensor | None = None  # (layers, experts), this rank's, summed over micro-batches
        # This rank's share of each micro-batch's losses, averaged over micro-batches (tensors:
        # read once, at the step's end, not between each forward and its backward).
        self._aux: torch.Tensor | float = 0.0
        self._z: torch.Tensor | float = 0.0
        for layer in self.layers.values():
            layer.last_routing = None

    def _routings(self) -> list[Any]:
        routings = [layer.last_routing for layer in self.layers.values()]
        if any(r is None for r in routings):
            raise RuntimeError("RouterBalance: an MoE layer has not run a forward since the last read")
        return routings

    def micro_batch_loss(self, micro_batches: int) -> torch.Tensor | None:
        """Read the routing of the forward that just ran (one of ``micro_batches`` of the step):
        count the tokens per expert, and return this rank's router-loss term to add to its
        loss before backward (already weighted, averaged over the micro-batches and scaled for
        the gradient averaging over the ranks), or None when both losses are off."""
        routings = self._routings()
        for layer in self.layers.values():
            layer.last_routing = None  # (a recomputing backward sets it again; it is read from here only)
        counts = torch.stack([expert_counts(r, self.num_experts) for r in routings])
        self._counts = counts if self._counts is None else self._counts + counts
        loss: torch.Tensor | None = None
        tokens = routings[0].indices.shape[0] * self.dp_size  # every rank's micro-batch has as many tokens
        if self.aux_loss_coef:
            total = counts.sum(dim=0)
            if self.group is not None:
                dist.all_reduce(total, group=self.group)
            rows = tokens * len(routings)  # over the layers, as transformers concatenates them
            probs = torch.stack([r.probs.sum(dim=0) for r in routings]).sum(dim=0)
            aux = balancing_loss(total, probs, rows, self.num_experts)
            self._aux = self._aux + aux.detach() / micro_batches
            loss = self.aux_loss_coef * aux
        if self.z_loss_coef:
            z = sum(torch.logsumexp(r.logits, dim=-1).square().sum() for r in routings) / tokens
            self._z = self._z + z.detach() / micro_batches
            loss = self.z_loss_coef * z if loss is None else loss + self.z_loss_coef * z
        return None if loss is None else loss * (self.dp_size / micro_batches)

    def finish_step(self, *, update_bias: bool) -> dict[str, float]:
        """After the optimizer step: sum the step's counts and losses over the ranks (one
        all-reduce), move the routers' biases when ``bias_update_rate`` is set and
        ``update_bias`` (the step was applied), and return the metrics: ``moe/aux_loss``,
        ``moe/z_loss`` (when on), ``moe/load_max_over_mean`` (the worst layer) and
        ``moe/load_max_over_mean/<layer>``."""
        if self._counts is None:
            return {}
        losses = [torch.as_tensor(v, dtype=torch.float32, device=self._counts.device).reshape(1)
                  for v in (self._aux, self._z)]
        stats = torch.cat([self._counts.flatten(), *losses])
        if self.group is not None:
            dist.all_reduce(stats, group=self.group)
        counts = stats[:-2].view(len(self.layers), self.num_experts)
        ratios = (counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)).tolist()
        values: dict[str, float] = {}
        if self.aux_loss_coef:
            values["moe/aux_loss"] = float(stats[-2])
        if self.z_loss_coef:
            values["moe/z_loss"] = float(stats[-1])
        values["moe/load_max_over_mean"] = max(ratios)
        values.update(
            {f"moe/load_max_over_mean/{name}": ratio for name, ratio in zip(self.layers, ratios, strict=True)}
        )
        if self.bias_update_rate and update_bias:
            for layer, layer_counts in zip(self.layers.values(), counts, strict=True):
                update_expert_bias(layer.router, layer_counts, self.bias_update_rate)
        self.start_step()
        return values
