"""A mixture-of-experts feed-forward any family can use, in parts:

- :mod:`.router`: :class:`TopKRouter` (Qwen3-MoE's softmax router, DeepSeek-V3's sigmoid router
  with a balancing bias and expert groups) and the :class:`Routing` a forward leaves;
- :mod:`.experts`: :class:`GroupedExperts`, SwiGLU experts as stacked weights;
- :mod:`.grouped_mm`: the grouped products the experts run;
- :mod:`.layer`: :class:`MoE`, the layer built from those parts, and its dispatcher (local, or
  expert parallel's all-to-all);
- :mod:`.params`: :class:`MoEParams`, parameter and FLOP counts of a family's args with MoE layers;
- :mod:`.balance`: the load-balancing and z losses, load metrics and bias balancing
  (:class:`RouterBalance`), read from each forward's routing.
"""

from torchtitan_lite.models.moe.balance import (
    RouterBalance,
    aux_loss_weight,
    balancing_loss,
    update_expert_bias,
)
from torchtitan_lite.models.moe.experts import GroupedExperts
from torchtitan_lite.models.moe.grouped_mm import grouped_mm_available
from torchtitan_lite.models.moe.layer import Dispatcher, LocalDispatcher, MoE, moe_layers
from torchtitan_lite.models.moe.params import MoEParams
from torchtitan_lite.models.moe.router import SCORE_FUNCS, Routing, TopKRouter, expert_counts, router_problem

__all__ = ["SCORE_FUNCS", "Dispatcher", "GroupedExperts", "LocalDispatcher", "MoE", "MoEParams", "RouterBalance",
           "Routing", "TopKRouter", "aux_loss_weight", "balancing_loss", "expert_counts",
           "grouped_mm_available", "moe_layers", "router_problem", "update_expert_bias"]
