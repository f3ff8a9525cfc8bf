"""A mixture-of-experts feed-forward any family can use: a router, experts held as stacked weights,
tokens sorted by expert and run as grouped matrix products, optional shared experts.

- :class:`TopKRouter`: scores over the experts and the ``top_k`` best per token.
  ``score_func = "softmax"`` is Qwen3-MoE's router (its scores and choices are those of
  ``transformers``' ``Qwen3MoeTopKRouter``; optional renormalisation of the chosen scores).
  ``"sigmoid"`` is DeepSeek-V3's: sigmoid scores, a per-expert bias (``expert_bias``, Hugging Face's
  ``e_score_correction_bias``) added for the choice only, the choice limited to the ``topk_group``
  best of ``n_group`` expert groups (a group's score: the sum of its two best), the chosen scores
  renormalised and multiplied by ``route_scale``.
- :class:`GroupedExperts`: ``num_experts`` SwiGLU experts as three stacked weights in ``nn.Linear``'s
  (out, in) layout: ``w1`` (gate) and ``w3`` (up) ``(experts, hidden, dim)``, ``w2`` (down)
  ``(experts, dim, hidden)``. The tokens routed to the experts arrive sorted by expert with each
  expert's count; ``torch._grouped_mm`` runs every expert's rows in one call where it runs
  (``use_grouped_mm``), a loop over the experts elsewhere, with the same results.
- :class:`MoE`: route, sort, run, weight each expert's output by its score and add the ``top_k``
  contributions of each token back in place; no token is dropped (no capacity limit). Shared
  experts (a dense SwiGLU every token goes through) add their output.

Each forward leaves its :class:`Routing` (router logits, probabilities, choices) on the module as
``last_routing``: what the balancing losses (:func:`load_balancing_loss`,
:func:`torchtitan_lite.loss.router_losses`), the load metrics and bias balancing
(:func:`update_expert_bias`) read after the forward. Nothing is counted inside the forward, so a
forward recomputed by activation checkpointing changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import torchtitan_lite.models.init as init
from torchtitan_lite.models.feed_forward import FeedForward

__all__ = ["SCORE_FUNCS", "GroupedExperts", "MoE", "MoEShape", "Routing", "TopKRouter", "grouped_mm_available",
           "balancing_loss", "expert_counts", "load_balancing_loss", "moe_layers", "router_problem",
           "update_expert_bias"]

SCORE_FUNCS = ("softmax", "sigmoid")
"""The router kinds (``score_func``)."""


_GROUPED_MM: dict[tuple[str, torch.dtype], bool] = {}
"""Whether ``torch._grouped_mm`` runs, per (device type, dtype): probed once, eagerly."""


def grouped_mm_available(device_type: str, dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward on this device type and dtype
    (torch >= 2.9 on CPU; CUDA with its own rules). Probed on first use, outside autograd and any
    dispatch mode (the first call may come inside a checkpointed forward, whose saved tensors must
    not change); under ``torch.compile`` only the probed answer is read (the decoder probes its
    device when it builds its buffers), unprobed is no."""
    key = (device_type, dtype)
    if key in _GROUPED_MM or torch.compiler.is_compiling():
        return _GROUPED_MM.get(key, False)
    from torch.utils._python_dispatch import _disable_current_modes

    available = hasattr(torch, "_grouped_mm")
    if available:
        try:  # the forward and the two products of its backward
            with torch.no_grad(), _disable_current_modes():
                x = torch.ones(8, 16, device=device_type, dtype=dtype)  # (no random draw: the RNG is the init's)
                w = torch.ones(2, 16, 16, device=device_type, dtype=dtype)
                offs = torch.tensor([3, 8], dtype=torch.int32, device=device_type)
                out = torch._grouped_mm(x, w, offs=offs)
                torch._grouped_mm(out, w.transpose(-2, -1), offs=offs)  # the input's gradient
                torch._grouped_mm(x.t(), out, offs=offs)  # the weights' gradient
        except (RuntimeError, NotImplementedError):
            available = False
    _GROUPED_MM[key] = available
    return available


class Routing(NamedTuple):
    """One forward's routing: ``logits`` and ``probs`` ``(tokens, experts)`` in fp32 (``probs``:
    the softmax, or the sigmoid scores normalised per token; what the load-balancing loss
    averages) and the chosen experts ``indices`` ``(tokens, top_k)``."""

    logits: torch.Tensor
    probs: torch.Tensor
    indices: torch.Tensor


def router_problem(num_experts: int, top_k: int, score_func: str, n_group: int, topk_group: int) -> str | None:
    """What is wrong with a router's settings, as a phrase naming the setting, or None."""
    if score_func not in SCORE_FUNCS:
        return f"score_func {score_func!r} is not one of {', '.join(map(repr, SCORE_FUNCS))}"
    if not 1 <= top_k <= num_experts:
        return f"top_k {top_k} must be between 1 and the number of experts {num_experts}"
    if n_group < 1 or num_experts % n_group:
        return f"n_group {n_group} must divide the number of experts {num_experts}"
    if n_group > 1 and num_experts // n_group < 2:
        return f"n_group {n_group} leaves fewer than 2 experts per group (a group's score sums its best two)"
    if not 1 <= topk_group <= n_group:
        return f"topk_group {topk_group} must be between 1 and n_group {n_group}"
    if topk_group * (num_experts // n_group) < top_k:
        return f"top_k {top_k} is more than the {topk_group} chosen group(s) of {num_experts // n_group} experts hold"
    return None


class TopKRouter(nn.Module):
    """``(tokens, dim)`` → the chosen experts' weights ``(tokens, top_k)`` (in ``x``'s dtype) and
    the :class:`Routing` (see the module's docstring for the two kinds)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, *, score_func: str = "softmax",
                 norm_topk_prob: bool = True, route_scale: float = 1.0, n_group: int = 1,
                 topk_group: int = 1) -> None:
        super().__init__()
        problem = router_problem(num_experts, top_k, score_func, n_group, topk_group)
        if problem is not None:
            raise ValueError(problem)
        self.num_experts, self.top_k, self.score_func = num_experts, top_k, score_func
        self.norm_topk_prob, self.route_scale = norm_topk_prob, route_scale
        self.n_group, self.topk_group = n_group, topk_group
        self.gate = nn.Linear(dim, num_experts, bias=False)
        # The sigmoid router's balancing bias (used for the choice only; updated by
        # update_expert_bias, saved with the model).
        self.expert_bias: torch.Tensor | None
        if score_func == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        logits = F.linear(x.float(), self.gate.weight.float())  # in fp32, as transformers' routers
        if self.score_func == "softmax":
            scores = probs = F.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        # (The bias may live on CPU under CPU offload: it is a few numbers.)
        choice = scores if self.expert_bias is None else scores + self.expert_bias.to(scores.device)
        if self.n_group > 1:
            grouped = choice.detach().view(-1, self.n_group, self.num_experts // self.n_group)
            best_groups = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(self.topk_group, dim=-1).indices
            keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, best_groups, True)
            choice = choice.masked_fill(~keep.repeat_interleave(self.num_experts // self.n_group, dim=1),
                                        float("-inf"))
        indices = torch.topk(choice.detach(), self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return weights.to(x.dtype), Routing(logits, probs, indices)

    def init_weights(self, std: float) -> None:
        init.trunc_normal_(self.gate.weight, std=std)
        if self.expert_bias is not None:
            self.expert_bias.zero_()


def _looped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a`` ``(rows, k)`` in groups ending at ``offs``, group ``g`` times ``b[g]`` ``(k, n)``."""
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for group, end in enumerate(offs.tolist()):
        torch.mm(a[start:end], b[group], out=out[start:end])
        start = end
    return out


@torch.library.custom_op("torchtitan_lite::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped products as one operator torch.compile does not look into: what the experts run
    where ``torch._grouped_mm`` cannot be compiled (its compiled form takes bf16 only) or does
    not run."""
    if grouped_mm_available(a.device.type, a.dtype):
        return torch._grouped_mm(a, b, offs=offs)
    return _looped_mm(a, b, offs)


@_grouped_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


@torch.library.custom_op("torchtitan_lite::grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor, groups: int) -> torch.Tensor:
    """``out[g] = a_gᵀ · grad_g`` ``(groups, k, n)``: the gradient of :func:`_grouped_mm_op`'s ``b``."""
    if grouped_mm_available(a.device.type, a.dtype):
        return torch._grouped_mm(a.t(), grad, offs=offs)
    out = a.new_zeros(groups, a.shape[1], grad.shape[1])
    start = 0
    for group, end in enumerate(offs.tolist()):
        torch.mm(a[start:end].t(), grad[start:end], out=out[group])
        start = end
    return out


@_grouped_mm_weight_grad.register_fake
def _(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor, groups: int) -> torch.Tensor:
    return a.new_empty(groups, a.shape[1], grad.shape[1])


def _grouped_mm_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _grouped_mm_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()
    with _cpu_kernel_copies(grad, b):
        grad_a = _grouped_mm_op(grad, b.transpose(-2, -1), offs)
    with _cpu_kernel_copies(a, grad):
        grad_b = _grouped_mm_weight_grad(a, grad, offs, b.shape[0])
    return grad_a, grad_b, None


@contextlib.contextmanager
def _cpu_kernel_copies(*operands: torch.Tensor) -> Iterator[None]:
    """On the memory estimator's fake tensors, the copies of both operands that
    ``torch._grouped_mm``'s CPU kernel makes, alive while the product runs (measured: its extra
    bytes are the operands' own); nothing on real tensors."""
    from torch._subclasses.fake_tensor import is_fake

    estimating = not torch.compiler.is_compiling() and is_fake(operands[0])
    copies = [t.clone() for t in operands] if estimating else []
    yield
    del copies


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` where it runs (eagerly, or compiled or on fake
    tensors in bf16), else the same products as one custom operator (compiled: opaque to
    torch.compile; eagerly: a loop over the groups where ``torch._grouped_mm`` does not run), with
    its own backward."""
    from torch._subclasses.fake_tensor import is_fake

    # (Compiled, torch._grouped_mm takes bf16 only; on the memory estimator's fake tensors the
    # operator, whose backward shows the CPU kernel's copies, stands for it.)
    if torch.compiler.is_compiling():
        if a.dtype == torch.bfloat16 and grouped_mm_available(a.device.type, a.dtype):
            return torch._grouped_mm(a, b, offs=offs)
        return _grouped_mm_op(a, b, offs)
    if not is_fake(a) and grouped_mm_available(a.device.type, a.dtype):
        return torch._grouped_mm(a, b, offs=offs)
    with _cpu_kernel_copies(a, b):
        return _grouped_mm_op(a, b, offs)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU feed-forwards as stacked weights (see the module's docstring)."""

    stacked_weights = ("w1", "w2", "w3")
    """The stacked ``(experts, out, in)`` weights (what LoRA on experts adapts)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, *, use_grouped_mm: bool = True) -> None:
        super().__init__()
        self.num_experts, self.use_grouped_mm = num_experts, use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` ``(rows, dim)``: the routed rows sorted by expert, ``counts[e]`` of them for expert
        ``e``. Returns each row through its expert, ``(rows, dim)``: grouped products
        (:func:`grouped_mm`), or with ``use_grouped_mm`` off a loop over the experts (eagerly;
        compiled, the grouped operator)."""
        w1, w2, w3 = self.expert_weights()
        if self.use_grouped_mm or torch.compiler.is_compiling():
            offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
            gate = grouped_mm(x, w1.transpose(-2, -1), offsets)
            up = grouped_mm(x, w3.transpose(-2, -1), offsets)
            return grouped_mm((F.silu(gate) * up).contiguous(), w2.transpose(-2, -1), offsets)
        out = []
        for expert, rows in enumerate(x.split(counts.tolist())):
            out.append(F.linear(F.silu(F.linear(rows, w1[expert])) * F.linear(rows, w3[expert]), w2[expert]))
        return torch.cat(out) if out else x.new_zeros(0, x.shape[-1])

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weights the experts compute with: ``w1``, ``w2``, ``w3`` (LoRA adds its updates);
        split over expert-parallel ranks (DTensors), this rank's experts."""
        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))  # type: ignore[return-value]

    def init_weights(self, out_std: float) -> None:
        init.trunc_normal_(self.w1, std=0.02)
        init.trunc_normal_(self.w2, std=out_std)
        init.trunc_normal_(self.w3, std=out_std)


class MoE(nn.Module):
    """Routed experts (and optional shared experts) in place of a dense feed-forward:
    ``(bs, seq, dim)`` → ``(bs, seq, dim)``. The router's settings are :class:`TopKRouter`'s."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, *, score_func: str = "softmax",
                 norm_topk_prob: bool = True, route_scale: float = 1.0, n_group: int = 1, topk_group: int = 1,
                 shared_hidden_dim: int = 0, use_grouped_mm: bool = True) -> None:
        super().__init__()
        self.router = TopKRouter(dim, num_experts, top_k, score_func=score_func, norm_topk_prob=norm_topk_prob,
                                 route_scale=route_scale, n_group=n_group, topk_group=topk_group)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, use_grouped_mm=use_grouped_mm)
        self.shared = None
        if shared_hidden_dim:
            self.shared = FeedForward(dim, shared_hidden_dim)
        self.last_routing: Routing | None = None
        # Expert parallel: what moves the routed rows to the ranks holding their experts and back
        # (torchtitan_lite.distributed.expert_parallel); None: every expert is here.
        self.dispatcher: Any = None

    @classmethod
    def from_args(cls, args: object) -> MoE:
        """The MoE layer of a family's args: ``dim``, ``moe_hidden_dim``, ``num_experts``,
        ``top_k``, ``score_func``, ``norm_topk_prob``, ``route_scale``, ``n_group``,
        ``topk_group`` and ``shared_hidden_dim``."""
        a: Any = args
        return cls(a.dim, a.moe_hidden_dim, a.num_experts, a.top_k, score_func=a.score_func,
                   norm_topk_prob=a.norm_topk_prob, route_scale=a.route_scale, n_group=a.n_group,
                   topk_group=a.topk_group, shared_hidden_dim=a.shared_hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, routing = self.router(tokens)
        if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1:
            # (Not from a forward that activation checkpointing recomputes during backward: that
            # routing is read by nobody and would keep the recomputed router's graph alive.)
            self.last_routing = routing
        indices = routing.indices
        top_k = indices.shape[1]
        flat = indices.reshape(-1)
        counts = expert_counts(routing, self.router.num_experts, dtype=torch.int64)
        order = torch.argsort(flat, stable=True)  # each expert's rows together, in token order
        token_of_row = order // top_k
        # (index_select and index_add_: each other's backward, with no sorting or copies inside.)
        rows = tokens.index_select(0, token_of_row)
        if self.dispatcher is None:
            routed = self.experts(rows, counts)
        else:
            local_rows, local_counts, state = self.dispatcher.dispatch(rows, counts)
            routed = self.dispatcher.combine(self.experts(local_rows, local_counts), state)
        routed = routed * weights.reshape(-1, 1).index_select(0, order)
        out = torch.zeros_like(tokens).index_add_(0, token_of_row, routed.to(tokens.dtype))
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.reshape(shape)

    def init_weights(self, out_std: float) -> None:
        self.router.init_weights(std=0.02)
        self.experts.init_weights(out_std)
        if self.shared is not None:
            self.shared.init_weights(out_std)


class MoEShape:
    """Parameter counts of a decoder whose args have MoE layers (mixed into a family's args):
    ``num_params`` counts every expert, ``active_params`` the ``top_k`` routed experts a token
    goes through (what its FLOPs follow)."""

    def _moe_block_params(self, *, active: bool) -> int:
        a = self  # type: ignore[assignment]
        experts = a.top_k if active else a.num_experts  # type: ignore[attr-defined]
        routed = 3 * a.dim * a.moe_hidden_dim * experts  # type: ignore[attr-defined]
        shared = 3 * a.dim * a.shared_hidden_dim  # type: ignore[attr-defined]
        return a.dim * a.num_experts + routed + shared  # type: ignore[attr-defined]

    def moe_layers(self) -> int:
        """How many layers are mixtures of experts."""
        return sum(bool(self.moe_layer(i)) for i in range(self.n_layers))  # type: ignore[attr-defined]

    def _with_moe(self, dense_total: int, *, active: bool) -> int:
        dense_ffn = 3 * self.dim * self.ffn_hidden_dim  # type: ignore[attr-defined]
        return dense_total + self.moe_layers() * (self._moe_block_params(active=active) - dense_ffn)

    def active_params(self, *, include_embedding: bool = True) -> int:
        """Parameters a token's forward uses (the ``top_k`` routed experts of each MoE layer)."""
        return self._with_moe(super().num_params(include_embedding=include_embedding), active=True)  # type: ignore[misc]

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Every parameter, each expert's included."""
        return self._with_moe(super().num_params(include_embedding=include_embedding), active=False)  # type: ignore[misc]

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 × the non-embedding parameters a token uses (the active
        experts only) plus the attention matmuls."""
        return 6 * self.active_params(include_embedding=False) + self.n_layers * self.attention_flops_per_token(seq_len)  # type: ignore[attr-defined]


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """The model's MoE layers by qualified name, in forward order."""
    return {name: module for name, module in model.named_modules() if isinstance(module, MoE)}


def expert_counts(routing: Routing | torch.Tensor, num_experts: int, *,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Tokens routed to each expert in one forward (its ``Routing``, or the routed indices),
    ``(experts,)`` (by ``scatter_add``: a static shape, unlike ``bincount``'s, for torch.compile)."""
    flat = (routing if isinstance(routing, torch.Tensor) else routing.indices).reshape(-1)
    return torch.zeros(num_experts, dtype=dtype, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=dtype))


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
    share of the loss over all of them (:mod:`torchtitan_lite.moe_balance`)."""
    return num_experts * (counts / rows * probs_sum / rows).sum()


def load_balancing_loss(probs: list[torch.Tensor], indices: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """The load-balancing auxiliary loss as ``transformers`` computes it for Qwen3-MoE
    (``load_balancing_loss_func`` without an attention mask) over every MoE layer's tokens at
    once (:func:`balancing_loss`)."""
    all_indices = torch.cat(indices)
    return balancing_loss(expert_counts(all_indices, num_experts), torch.cat(probs).sum(dim=0), all_indices.shape[0],
                          num_experts)
