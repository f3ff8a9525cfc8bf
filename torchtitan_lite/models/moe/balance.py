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
from torchtitan_lite.models.moe.router import Routing, TopKRouter, expert_counts

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
    context parallel; None: one process); ``dp_size``: its ranks.

    Pipeline parallel: ``model`` holds only this rank's stages; ``names`` are the MoE layers of
    the whole model (in forward order), ``pipeline_group`` its pipeline ranks and
    ``num_experts`` the experts per layer (a rank without MoE layers cannot read them). Each stage adds
    its layers' routing to a :meth:`routing_state` that travels with the hidden states, and the
    last stage turns the whole model's into the micro-batch's loss (:meth:`state_loss`): the
    load-balancing loss's counts are those of every layer, and its gradient reaches every stage's
    routers through the pipeline's backward."""

    def __init__(self, model: nn.Module, *, aux_loss_coef: float, z_loss_coef: float = 0.0,
                 bias_update_rate: float = 0.0, group: Any = None, dp_size: int = 1,
                 names: list[str] | None = None, pipeline_group: Any = None,
                 num_experts: int | None = None) -> None:
        self.layers: dict[str, MoE] = moe_layers(model)
        self.names = list(self.layers) if names is None else list(names)
        if not self.names:
            raise ValueError("RouterBalance: the model has no MoE layers")
        if any(name not in self.names for name in self.layers):
            raise ValueError(f"RouterBalance: MoE layers {sorted(set(self.layers) - set(self.names))} are not "
                             "among the model's")
        held = next(iter(self.layers.values())).router.num_experts if self.layers else None
        if held is not None and num_experts is not None and held != num_experts:
            raise ValueError(f"RouterBalance: the layers have {held} experts, not {num_experts}")
        if held is None and num_experts is None:
            raise ValueError("RouterBalance: a pipeline rank without MoE layers needs num_experts")
        self.num_experts: int = held if held is not None else num_experts  # type: ignore[assignment]
        self.aux_loss_coef, self.z_loss_coef, self.bias_update_rate = aux_loss_coef, z_loss_coef, bias_update_rate
        self.group, self.dp_size, self.pipeline_group = group, dp_size, pipeline_group
        self.start_step()

    def start_step(self) -> None:
        """Forget the counts and losses of the previous step, and any routing a forward outside
        training (validation) left on the layers."""
        # (every MoE layer of the model, experts): this rank's, summed over micro-batches; the
        # rows of layers on other pipeline ranks stay 0
        self._counts: torch.Tensor | None = None
        # This rank's share of each micro-batch's losses, averaged over micro-batches (tensors:
        # read once, at the step's end, not between each forward and its backward).
        self._aux: torch.Tensor | float = 0.0
        self._z: torch.Tensor | float = 0.0
        for layer in self.layers.values():
            layer.last_routing = None

    def routing_state(self, names: list[str], state: torch.Tensor | None, *, device: torch.device,
                      record: bool = True, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Read the routing of the forward of layers ``names`` that just ran and add it to
        ``state`` (None: zeros), a vector of ``2 × experts + 1``: each expert's summed router
        probabilities (with their gradient), its choices (counts) and the summed squared
        log-sum-exp of the router logits (z-loss), over the tokens of the micro-batch and the
        layers so far. ``record``: count the choices in the step's load (not for a forward that
        only infers shapes). ``tokens``: which of the routed tokens count (bool, one per token in
        the micro-batch's order, ``rows × seq`` flattened; None: all), e.g. not a preference
        pair's padding, as ``transformers`` leaves out the positions its attention mask does."""
        e = self.num_experts
        routings = [self.layers[name].last_routing for name in names]
        if any(r is None for r in routings):
            raise RuntimeError("RouterBalance: an MoE layer has not run a forward since the last read")
        for name in names:
            self.layers[name].last_routing = None  # (a recomputing backward sets it again; read from here only)
        if not routings:
            return torch.zeros(2 * e + 1, device=device) if state is None else state
        if tokens is not None:
            counted = tokens.reshape(-1).to(routings[0].probs.device, torch.float32)
            if counted.numel() != routings[0].probs.shape[0]:
                raise ValueError(f"RouterBalance: {counted.numel()} token flags for {routings[0].probs.shape[0]} "
                                 "routed tokens")
            routings = [Routing(r.logits, r.probs * counted[:, None], r.indices) for r in routings]
            weights = counted.repeat_interleave(routings[0].indices.shape[1])
            counts = torch.stack([expert_counts(r, e, weights=weights) for r in routings])
        else:
            counted = None
            counts = torch.stack([expert_counts(r, e) for r in routings])
        if record:
            if self._counts is None:
                self._counts = torch.zeros(len(self.names), e, device=counts.device)
            rows = torch.tensor([self.names.index(name) for name in names], device=counts.device)
            self._counts.index_add_(0, rows, counts)
        probs = torch.stack([r.probs.sum(dim=0) for r in routings]).sum(dim=0)
        if self.z_loss_coef:
            z = sum((torch.logsumexp(r.logits, dim=-1).square() * (1.0 if counted is None else counted)).sum()
                    for r in routings).reshape(1)
        else:
            z = probs.new_zeros(1)
        added = torch.cat([probs, counts.sum(dim=0).to(probs.dtype), z])
        return added if state is None else state + added

    def state_loss(self, state: torch.Tensor, tokens: int | torch.Tensor, micro_batches: int, *,
                   record: bool = True) -> torch.Tensor | None:
        """This rank's router-loss term of one micro-batch of ``tokens`` tokens (on this rank; a
        tensor: a count that differs between ranks, summed over them here) from its
        :meth:`routing_state` over every MoE layer, to add to its loss before backward (already
        weighted, averaged over the step's ``micro_batches`` and scaled for the gradient
        averaging over the ranks), or None when both losses are off. ``record``: keep the
        losses for the step's metrics."""
        e = self.num_experts
        loss: torch.Tensor | None = None
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().to(state.device, torch.float32).reshape(1).clone()
            if self.group is not None and (self.aux_loss_coef or self.z_loss_coef):
                dist.all_reduce(tokens, group=self.group)
            tokens = tokens.clamp(min=1.0)[0]
        else:
            tokens *= self.dp_size  # every rank's micro-batch has as many tokens
        if self.aux_loss_coef:
            total = state[e:2 * e].detach().clone()
            if self.group is not None:
                dist.all_reduce(total, group=self.group)
            rows = tokens * len(self.names)  # over the layers, as transformers concatenates them
            aux = balancing_loss(total, state[:e], rows, e)
            if record:
                self._aux = self._aux + aux.detach() / micro_batches
            loss = self.aux_loss_coef * aux
        if self.z_loss_coef:
            z = state[2 * e] / tokens
            if record:
                self._z = self._z + z.detach() / micro_batches
            loss = self.z_loss_coef * z if loss is None else loss + self.z_loss_coef * z
        return None if loss is None else loss * (self.dp_size / micro_batches)

    def micro_batch_loss(self, micro_batches: int, tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Read the routing of the forward that just ran (one of ``micro_batches`` of the step):
        count the tokens per expert, and return this rank's router-loss term to add to its
        loss before backward (:meth:`state_loss`). ``tokens``: which tokens count
        (:meth:`routing_state`; None: all)."""
        first = self.layers[self.names[0]].last_routing
        if first is None:
            raise RuntimeError("RouterBalance: an MoE layer has not run a forward since the last read")
        state = self.routing_state(self.names, None, device=first.probs.device, tokens=tokens)
        count = first.indices.shape[0] if tokens is None else tokens.sum()
        return self.state_loss(state, count, micro_batches)

    def finish_step(self, *, update_bias: bool, device: torch.device | None = None) -> dict[str, float]:
        """After the optimizer step: sum the step's counts and losses over the ranks (one
        all-reduce, and one over the pipeline ranks), move the routers' biases when
        ``bias_update_rate`` is set and ``update_bias`` (the step was applied), and return the
        metrics: ``moe/aux_loss``, ``moe/z_loss`` (when on), ``moe/load_max_over_mean`` (the
        worst layer) and ``moe/load_max_over_mean/<layer>``. ``device``: where a pipeline rank
        without MoE layers counts (its zeros)."""
        if self._counts is None:
            if self.pipeline_group is None:
                return {}
            self._counts = torch.zeros(len(self.names), self.num_experts, device=device)
        losses = [torch.as_tensor(v, dtype=torch.float32, device=self._counts.device).reshape(1)
                  for v in (self._aux, self._z)]
        stats = torch.cat([self._counts.flatten(), *losses])
        for group in (self.group, self.pipeline_group):
            if group is not None:
                dist.all_reduce(stats, group=group)
        counts = stats[:-2].view(len(self.names), self.num_experts)
        ratios = (counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)).tolist()
        values: dict[str, float] = {}
        if self.aux_loss_coef:
            values["moe/aux_loss"] = float(stats[-2])
        if self.z_loss_coef:
            values["moe/z_loss"] = float(stats[-1])
        values["moe/load_max_over_mean"] = max(ratios)
        values.update(
            {f"moe/load_max_over_mean/{name}": ratio for name, ratio in zip(self.names, ratios, strict=True)}
        )
        if self.bias_update_rate and update_bias:
            for name, layer in self.layers.items():
                update_expert_bias(layer.router, counts[self.names.index(name)], self.bias_update_rate)
        self.start_step()
        return values
