"""Tensor parallel with sequence parallel for our decoders (Llama 3, Qwen2.5, Qwen3, Qwen3-MoE,
DeepSeek-V3), on the ``tp`` dimension of the job's mesh, applied before FSDP2 shards the rest
over the data-parallel dimensions (2-D: every split parameter a DTensor over ``(data parallel,
tp)``).

Within a block (Megatron's split, TorchTitan's plan):

- attention: ``wq``, ``wk``, ``wv`` split by output features (column-wise: each rank computes
  ``n_heads / tp`` query heads and ``kv_heads / tp`` key-value heads; Qwen2.5's biases split with
  them), ``wo`` by input features (row-wise); Qwen3's per-head ``q_norm`` / ``k_norm`` run on each
  rank's heads with their weights replicated; an attention class names its split
  (``tensor_parallel_columns`` / ``_rows`` / ``_whole``): DeepSeek-V3's latent attention splits
  its heads' up-projections (``wq_b``, ``wkv_b``) and ``wo``, and runs its down-projections and
  their norms whole on every rank (plain parameters, FSDP-sharded over the data-parallel ranks;
  the rotary key all heads share has its gradient summed over the ranks);
- feed-forward: ``w1`` and ``w3`` column-wise, ``w2`` row-wise;
- a mixture of experts: every rank runs the whole layer (router, experts, shared experts,
  weights replicated over ``tp`` and FSDP-sharded over the data-parallel ranks) on the whole
  sequence: its input is gathered and its output cut back to this rank's part of the sequence.

Sequence parallel: between the projections, the residual stream and the norms hold ``seq / tp``
positions per rank (the row-wise outputs are reduce-scattered along the sequence, the
column-wise inputs all-gathered), so norms and residual adds are not repeated and their
activations are split. The token embedding is split by vocabulary rows, the output projection by
vocabulary columns (both by rows of their weights: tied embeddings stay one parameter); with
loss parallel (the default, ``parallelism.disable_loss_parallel = false``) the logits stay split
over the vocabulary and the loss (:mod:`torchtitan_lite.loss`) reduces over ``tp`` without
gathering them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

__all__ = ["apply_decoder_tensor_parallel", "enable_async_tensor_parallel",
           "split_modules", "tensor_parallel_problem"]


def tensor_parallel_problem(args: Any, tp: int) -> str | None:
    """Why a decoder of ``args`` cannot split over ``tp`` ranks (the first dimension that
    ``tp`` does not divide, named), or None."""
    if tp == 1:
        return None
    from torchtitan_lite.models.decoder import is_moe_layer

    sizes = [("attention heads (n_heads)", args.n_heads), ("key-value heads", args.kv_heads)]
    if not all(is_moe_layer(args, i) for i in range(args.n_layers)):  # (a dense feed-forward to split)
        sizes.append(("feed-forward width (ffn_hidden_dim)", args.ffn_hidden_dim))
    for what, size in sizes:
        if size % tp:
            return f"it must divide the model's {size} {what}"
    per_rank = -(-args.vocab_size // tp)  # (DTensor's split: every rank but the last ones this many)
    if per_rank * (tp - 1) >= args.vocab_size:
        return (f"its split of the {args.vocab_size}-token vocabulary ({per_rank} per rank) would leave the last rank "
                "none")
    return None


def split_modules(model: nn.Module) -> list[nn.Module]:
    """The modules :func:`apply_decoder_tensor_parallel` splits over the tensor-parallel ranks
    (embedding, output, each block's head and dense feed-forward projections); everything else
    is whole on every rank (what the memory planner sizes each way)."""
    found = [model.tok_embeddings, model.output]
    for block in model.layers.values():
        attention = block.attention
        found += [getattr(attention, w) for w in (*attention.tensor_parallel_columns, *attention.tensor_parallel_rows)
                  if hasattr(attention, w)]
        if block.moe is None:
            found += [block.feed_forward.w1, block.feed_forward.w2, block.feed_forward.w3]
    return found


def _own_copy(module: nn.Module, inputs: Any, output: Any) -> Any:
    return output.clone()


class _SumGradient(torch.autograd.Function):
    """Identity in forward; in backward the gradient summed over ``group`` (each rank's part of
    a tensor every rank uses whole)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        from torch.distributed._functional_collectives import all_reduce, wait_tensor

        return wait_tensor(all_reduce(grad.contiguous(), "sum", ctx.group)), None


def _sum_gradient(x: torch.Tensor, *, group: Any) -> torch.Tensor:
    return _SumGradient.apply(x, group)


# Where each parameter of a (LoRA-adapted) linear goes: its own weight and bias, and its
# adapters' weights, which follow the base's split: column-wise, ``B`` (out, rank) is split by
# rows with ``W`` and ``A`` replicated; row-wise, ``A`` (rank, in) is split by columns with ``W``
# (``A x`` is then a partial sum, added into ``W x``'s before the reduce-scatter) and ``B``
# replicated.
_COLUMN_WISE = {"": {"weight": (0,), "bias": (0,)}, "lora_A": {"weight": ()}, "lora_B": {"weight": (0,)}}
_ROW_WISE = {"": {"weight": (1,), "bias": ()}, "lora_A": {"weight": (1,)}, "lora_B": {"weight": ()}}


def _split_linear(table: dict[str, dict[str, tuple[int, ...]]], src_data_rank: Any, name: str, module: nn.Module,
                  mesh: Any) -> None:
    """Distribute ``module``'s own parameters (a linear at ``name`` ``""``, its adapters at
    ``lora_A`` / ``lora_B``) by ``table``: ``(dim,)`` split along ``dim``, ``()`` replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for param_name, param in list(module.named_parameters(recurse=False)):
        dims = table[name][param_name]
        placement = Shard(dims[0]) if dims else Replicate()
        module.register_parameter(param_name, nn.Parameter(
            distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)))


def _styles() -> tuple[type, type]:
    """Column- and row-wise styles for linears that may carry LoRA adapters."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    class Colwise(ColwiseParallel):
        def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
            _split_linear(_COLUMN_WISE, self.src_data_rank, name, module, device_mesh)

    class Rowwise(RowwiseParallel):
        def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
            _split_linear(_ROW_WISE, self.src_data_rank, name, module, device_mesh)

    return Colwise, Rowwise


def _linear_style(module: nn.Module, style: type, float8_style: type | None, **kwargs: Any) -> Any:
    """``style(**kwargs)`` for a linear, or torchao's float8 style for a ``Float8Linear`` (its
    input, gathered in high precision by the attention's or feed-forward's input step, cast to
    float8 for its matmul)."""
    if float8_style is not None and type(module).__name__ == "Float8Linear":
        return float8_style(**kwargs)
    return style(**kwargs)


def apply_decoder_tensor_parallel(model: nn.Module, tp_mesh: Any, *, loss_parallel: bool = True) -> None:
    """Split a :class:`~torchtitan_lite.models.decoder.Decoder` built on the meta device over
    ``tp_mesh`` (see the module's docstring) in place. ``loss_parallel``: the logits stay split
    over the vocabulary (a DTensor ``Shard(-1)``), else they are gathered (a plain tensor).
    Which parameters train is kept (a LoRA job's frozen base stays frozen: PyTorch's styles
    register every parameter they distribute as trainable)."""
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    _split_decoder(model, tp_mesh, loss_parallel=loss_parallel)
    model.split_sequence_between_blocks(tp_mesh.size())  # (the hidden states a later pipeline stage takes)
    for name, p in model.named_parameters():
        p.requires_grad_(trainable[name])


def _split_decoder(model: nn.Module, tp_mesh: Any, *, loss_parallel: bool) -> None:
    """:func:`apply_decoder_tensor_parallel`'s plan, applied."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleInputOutput,
        SequenceParallel,
        parallelize_module,
    )

    Colwise, Rowwise = _styles()  # classes
    converted = any(type(m).__name__ == "Float8Linear" for m in model.modules())
    if converted and tp_mesh.device_type == "cuda":
        # float8 linears (tensorwise scales): torchao's styles (their weights' float8 casts
        # split with them). (gloo has no float8 collectives: on CPU the float8 linears are split as any
        # linear, their DTensor inputs gathered in high precision and cast after.)
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel
    else:
        Float8ColwiseParallel = Float8RowwiseParallel = None

    def column(name: str, block: nn.Module, **kwargs: Any) -> Any:
        return _linear_style(block.get_submodule(name), Colwise, Float8ColwiseParallel, **kwargs)

    def row(name: str, block: nn.Module, **kwargs: Any) -> Any:
        return _linear_style(block.get_submodule(name), Rowwise, Float8RowwiseParallel, **kwargs)

    outer = {
        "tok_embeddings": Rowwise(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": Colwise(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                          use_local_output=not loss_parallel),
    }
    # (a pipeline stage may lack the embedding, or the norm and output)
    parallelize_module(model, tp_mesh, {name: style for name, style in outer.items()
                                        if getattr(model, name) is not None})
    # The embedding's output (this rank's positions) is a view into a DTensor's local tensor; a
    # compiled block given such a view as its input returns no gradient for it (AOTAutograd
    # replays the view from its base, which autograd does not connect to the embedding): the
    # residual stream starts from a copy (one activation of seq / tp positions).
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_own_copy)
    if model.args.tie_word_embeddings:
        # Both split the one weight by vocabulary rows (Shard(0)): tie the split copies again.
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        attention = block.attention
        whole = bool(attention.tensor_parallel_whole)
        plan: dict[str, Any] = {
            "attention_norm": SequenceParallel(),
            # The whole sequence: a DTensor, whose gradient the column-wise projections leave
            # partial and one reduce-scatter sums; or, for an attention with parts that run whole
            # on every rank (a latent attention's down-projections, plain parameters), a local
            # tensor (the head projections after them sum their inputs' gradients themselves).
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None), use_local_output=whole),
            **{f"attention.{w}": column(f"attention.{w}", block) for w in attention.tensor_parallel_columns
               if hasattr(attention, w)},
            **{f"attention.{w}": row(f"attention.{w}", block, output_layouts=Shard(1))
               for w in attention.tensor_parallel_rows},
            "ffn_norm": SequenceParallel(),
        }
        if hasattr(attention, "shared_key_grad"):
            attention.shared_key_grad = functools.partial(_sum_gradient, group=tp_mesh.get_group())
        if getattr(attention, "q_norm", None) is not None and "q_norm" not in attention.tensor_parallel_whole:
            # per head, on this rank's heads (dim 2 of (bs, seq, heads, hd))
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if block.moe is not None:
            plan["moe"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
        else:
            plan.update({
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": column("feed_forward.w1", block),
                "feed_forward.w2": row("feed_forward.w2", block, output_layouts=Shard(1)),
                "feed_forward.w3": column("feed_forward.w3", block),
            })
        parallelize_module(block, tp_mesh, plan)


def enable_async_tensor_parallel(tp_mesh: Any) -> None:
    """Asynchronous tensor parallel (CUDA, compiled blocks): inductor splits each all-gather and
    reduce-scatter around the matmuls it feeds into micro-steps over symmetric memory, so that
    communication overlaps compute (``parallelism.enable_async_tensor_parallel``)."""
    import torch
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
