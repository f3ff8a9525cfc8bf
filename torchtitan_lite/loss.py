"""The training loss: next-token cross-entropy summed in fp32 (the trainer, validation and the memory
estimator all compute it here).

Eagerly it runs as :class:`_RowChunkedCrossEntropy`: the log-sum-exp of every row and, in
backward, the gradient ``softmax - one_hot``, a chunk of rows at a time, so that no full
``(tokens, vocab)`` fp32 tensor is made besides the gradient (``F.cross_entropy`` on upcast logits
makes the fp32 copy, the log-probabilities, and in backward a zero-filled gradient and a second
pass). On a CPU a chunk is a few rows (its temporaries stay in cache); on an accelerator an eighth
of the rows (few kernel launches). The memory estimator, which runs on fake CPU tensors, models the
CPU's chunks: for a GPU job it leaves out up to two eighths of the fp32 logits that a GPU chunk's
temporaries hold (about 1 GiB for the 8B at seq 8192 against a 43 GiB peak). At Llama 3's 128,256-row
vocabulary that halves the loss's time on CPU
(0.40 s against 0.68 s for 512 tokens, forward and backward; ``docs/performance.md``). The values
are those of ``F.cross_entropy`` in fp32 (within float rounding). Under ``torch.compile`` the loss
is ``F.cross_entropy``, which inductor fuses itself.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_lite.data.windows import IGNORE_INDEX

__all__ = ["is_token_losses", "linear_token_losses", "loss_sums", "tile_output", "token_logps", "token_loss_sum",
           "token_losses"]

_CHUNK_ELEMENTS = 1 << 20
"""Elements of one chunk of rows on a CPU (4 MiB in fp32): its temporaries stay in cache."""
_DEVICE_CHUNKS = 8
"""Chunks at most on an accelerator (few kernel launches; still no full fp32 copy of the logits)."""
_TILE_ELEMENTS = 1 << 28
"""Elements of one tile's logits at most on an accelerator for the tiled loss (1 GiB in fp32),
whose whole logits are what it avoids."""


def _chunk_starts(logits: torch.Tensor, rows: int) -> range:
    """The first row of every chunk; on the memory estimator's fake tensors only the first chunk's
    (each chunk frees its temporaries before the next, so one chunk gives the same peak, without
    a thousand iterations of fake ops at a large shape)."""
    from torch._subclasses.fake_tensor import is_fake

    starts = range(0, logits.shape[0], rows)
    return starts[:1] if is_fake(logits) else starts


def _chunk_rows(logits: torch.Tensor) -> int:
    """Rows per chunk of ``logits`` (tokens, vocab): :func:`_rows_per_chunk`."""
    return _rows_per_chunk(logits.shape[0], logits.shape[1], logits.device.type)


def _rows_per_chunk(tokens: int, vocab: int, device_type: str, *, most: int | None = None) -> int:
    """Rows per chunk: a CPU's few (the memory estimator's fake CPU tensors too, so that its
    estimate is the CPU run's); on an accelerator at most :data:`_DEVICE_CHUNKS` chunks, and at
    most ``most`` elements a chunk."""
    rows = max(1, _CHUNK_ELEMENTS // max(1, vocab))
    if device_type == "cpu":
        return rows
    rows = max(rows, -(-tokens // _DEVICE_CHUNKS))
    return rows if most is None else max(1, min(rows, most // max(1, vocab)))


class _RowChunkedCrossEntropy(torch.autograd.Function):
    """Each token's cross-entropy ``(tokens,)`` of ``logits`` (tokens, vocab; any float dtype,
    computed in fp32) against ``labels`` (0 where ``IGNORE_INDEX``), a chunk of rows at a time.
    Saves the logits and one fp32 log-sum-exp per row for backward."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        rows = _chunk_rows(logits)
        valid = labels != IGNORE_INDEX
        safe = torch.where(valid, labels, 0)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start in _chunk_starts(logits, rows):
            lse[start:start + rows] = torch.logsumexp(logits[start:start + rows].float(), dim=-1)
        target = logits.gather(1, safe[:, None]).squeeze(1).float()
        ctx.save_for_backward(logits, lse, safe, valid)
        ctx.rows = rows
        return torch.where(valid, lse - target, 0.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, lse, safe, valid = ctx.saved_tensors
        return _softmax_minus_one_hot(logits, lse, safe, valid, grad * valid, ctx.rows), None


def _softmax_minus_one_hot(logits: torch.Tensor, lse: torch.Tensor, safe: torch.Tensor, hit: torch.Tensor,
                           scale: torch.Tensor, rows: int) -> torch.Tensor:
    """The loss's gradient, a chunk of ``rows`` rows at a time: ``(softmax - one_hot) · scale``
    per row (``scale``: the upstream gradient, 0 for ignored rows), the one-hot at column
    ``safe`` where ``hit``; in fp32, then the logits' dtype."""
    scale, minus_one = scale.float(), -hit.float()[:, None]
    out = torch.empty_like(logits)
    for start in _chunk_starts(logits, rows):
        end = start + rows
        chunk = (logits[start:end].float() - lse[start:end, None]).exp_()  # softmax
        chunk.scatter_add_(1, safe[start:end, None], minus_one[start:end])
        out[start:end] = chunk.mul_(scale[start:end, None])
    return out


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """:class:`_RowChunkedCrossEntropy` (per token) of logits split over the vocabulary (tensor parallel's
    loss parallel): each rank holds the columns ``[start, start + local vocab)``; the rows'
    maxima, sums of exponentials and target logits are all-reduced over ``group`` (three vectors
    of one value per row), never the logits. Backward is local: ``softmax - one_hot`` on this
    rank's columns."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, group: Any,
                start: int) -> torch.Tensor:
        import torch.distributed as dist

        rows, vocab = _chunk_rows(logits), logits.shape[1]
        valid = labels != IGNORE_INDEX
        local = valid & (labels >= start) & (labels < start + vocab)
        safe = torch.where(local, labels - start, 0)
        peak = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for begin in _chunk_starts(logits, rows):
            peak[begin:begin + rows] = logits[begin:begin + rows].amax(dim=-1).float()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        total = torch.empty_like(peak)
        for begin in _chunk_starts(logits, rows):
            chunk = logits[begin:begin + rows].float() - peak[begin:begin + rows, None]
            total[begin:begin + rows] = chunk.exp_().sum(dim=-1)
        target = torch.where(local, logits.gather(1, safe[:, None]).squeeze(1).float(), 0.0)
        dist.all_reduce(total, group=group)
        dist.all_reduce(target, group=group)
        lse = total.log_() + peak
        ctx.save_for_backward(logits, lse, safe, valid, local)
        ctx.rows = rows
        return torch.where(valid, lse - target, 0.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, lse, safe, valid, local = ctx.saved_tensors  # (the one-hot: only where the label is ours)
        return _softmax_minus_one_hot(logits, lse, safe, local, grad * valid, ctx.rows), None, None, None


def _vocab_parallel_losses(logits: Any, labels: torch.Tensor) -> torch.Tensor:
    """The token losses ``(tokens,)`` of logits that are a DTensor split over the vocabulary on a
    1-D mesh."""
    from torch.distributed.tensor import Shard

    mesh, vocab = logits.device_mesh, logits.shape[-1]
    if mesh.ndim != 1 or logits.placements != (Shard(logits.dim() - 1),):
        raise ValueError(f"the loss takes logits split over the vocabulary on one mesh dimension, got "
                         f"{logits.placements} on {mesh}")
    local = logits.to_local()
    # (DTensor splits as torch.chunk does: every rank but the last ones ceil(vocab / ranks) columns)
    return _VocabParallelCrossEntropy.apply(local.flatten(0, 1), labels.flatten(), mesh.get_group(),
                                            mesh.get_local_rank() * -(-vocab // mesh.size()))


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each label's next-token cross-entropy (its negative log-probability) in fp32, the shape of
    ``labels`` (0 where ``IGNORE_INDEX``), with :func:`token_loss_sum`'s memory: no full fp32
    copy of the logits is kept for backward. ``logits`` may be a DTensor split over the
    vocabulary (tensor parallel's loss parallel)."""
    from torch.distributed.tensor import DTensor

    if is_token_losses(logits, labels):  # (the output layer's own: training.tiled_loss)
        return logits
    if isinstance(logits, DTensor):
        return _vocab_parallel_losses(logits, labels).view(labels.shape)
    flat_logits, flat_labels = logits.flatten(0, -2), labels.flatten()
    if torch.compiler.is_compiling():
        losses = F.cross_entropy(flat_logits.float(), flat_labels, ignore_index=IGNORE_INDEX, reduction="none")
    else:
        losses = _RowChunkedCrossEntropy.apply(flat_logits, flat_labels)
    return losses.view(labels.shape)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy in fp32; labels equal to ``IGNORE_INDEX`` count nothing.
    ``logits`` may be a DTensor split over the vocabulary (tensor parallel's loss parallel), or
    each label's loss already (:func:`is_token_losses`)."""
    from torch.distributed.tensor import DTensor

    if torch.compiler.is_compiling() and not isinstance(logits, DTensor) and not is_token_losses(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return token_losses(logits, labels).sum()


def loss_sums(loss_fn: Any, logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor,
              sources: list[int] | None, num_sources: int) -> torch.Tensor:
    """The detached sums behind a micro-batch's metrics, fp64 ``(1 + num_sources,)``: ``loss``
    (``loss_fn(logits, labels)``, already computed), then each source's share of it, from
    ``sources`` (each row's source; rows of one source next to each other), by ``loss_fn`` on
    that source's rows without gradient (one source: ``loss`` itself). ``sources`` None: only the
    sum."""
    sums = torch.zeros(1 + (num_sources if sources is not None else 0), dtype=torch.float64, device=loss.device)
    sums[0] = loss.detach().double()
    if sources is None:
        return sums
    groups = [(source, len(list(rows))) for source, rows in itertools.groupby(sources)]
    if len(groups) == 1:
        sums[1 + groups[0][0]] += sums[0]
        return sums
    with torch.no_grad():
        start = 0
        for source, count in groups:
            sums[1 + source] += loss_fn(logits[start:start + count], labels[start:start + count]).double()
            start += count
    return sums


class _LinearCrossEntropy(torch.autograd.Function):
    """Each token's cross-entropy ``(tokens,)`` of the output projection ``hidden @ weight.T``
    against ``labels``, a chunk of rows at a time, without the whole logits: forward keeps each
    row's log-sum-exp; backward computes each chunk's logits again, its ``softmax - one_hot`` and
    from it the chunk's share of both gradients (the weight's accumulated in fp32). The logits of
    a chunk are in the hidden states' dtype, as the output layer makes them, then fp32."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                shape: torch.Size) -> torch.Tensor:
        rows = _rows_per_chunk(hidden.shape[0], weight.shape[0], hidden.device.type, most=_TILE_ELEMENTS)
        valid = labels != IGNORE_INDEX
        safe = torch.where(valid, labels, 0)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        target = torch.empty_like(lse)
        starts = _chunk_starts(hidden, rows)
        for start in starts:
            logits = (hidden[start:start + rows] @ weight.t()).float()
            lse[start:start + rows] = torch.logsumexp(logits, dim=-1)
            target[start:start + rows] = logits.gather(1, safe[start:start + rows, None]).squeeze(1)
            del logits
        ctx.save_for_backward(hidden, weight, lse, safe, valid)
        ctx.rows = rows
        # (a tensor of the labels' shape of its own, not a view: FSDP's hooks take a module's output)
        return torch.where(valid, lse - target, 0.0).reshape(shape).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None, None]:
        hidden, weight, lse, safe, valid = ctx.saved_tensors
        rows = ctx.rows
        scale = (grad.reshape(-1) * valid).float()
        grad_hidden = torch.empty_like(hidden)
        # (a frozen output layer, as LoRA's: no weight gradient, nor its fp32 accumulator)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for start in _chunk_starts(hidden, rows):
            end = start + rows
            chunk = (hidden[start:end] @ weight.t()).float()
            chunk = chunk.sub_(lse[start:end, None]).exp_()  # softmax
            chunk.scatter_add_(1, safe[start:end, None], -valid[start:end, None].float())
            chunk = chunk.mul_(scale[start:end, None]).to(hidden.dtype)
            grad_hidden[start:end] = chunk @ weight
            if grad_weight is not None:
                grad_weight += (chunk.t() @ hidden[start:end]).float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None


def linear_token_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each label's cross-entropy (the shape of ``labels``) of the logits ``hidden @ weight.T``
    (``hidden`` ``(..., dim)``, ``weight`` ``(vocab, dim)``), made a chunk of rows at a time in
    forward and again in backward (:class:`_LinearCrossEntropy`): the whole ``(tokens, vocab)``
    logits never exist, nor their gradient (``training.tiled_loss``)."""
    return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), labels.shape)


def is_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> bool:
    """Whether a model's output is already each label's loss (``training.tiled_loss``: the
    output layer computed them, :func:`linear_token_losses`) rather than logits."""
    return logits.dim() == labels.dim()


@functools.cache
def _tiled_output_class(cls: type[nn.Module]) -> type[nn.Module]:
    def forward(self: nn.Module, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:  # (no labels given: the logits, e.g. for generation)
            return super(subclass, self).forward(x)
        return linear_token_losses(x, self.weight, labels)

    subclass = type(f"Tiled{cls.__name__}", (cls,), {"forward": forward, "__module__": cls.__module__})
    return subclass


def tile_output(model: nn.Module) -> None:
    """``training.tiled_loss``: ``model.output`` (a bias-free linear) returns each label's loss
    (:func:`linear_token_losses`) in place of the logits when it is given the labels as an argument
    (the decoder's ``forward(..., labels=...)`` hands them to it); in place (the class is swapped:
    names, state dict and FSDP's hooks unchanged), before ``fully_shard``."""
    output = getattr(model, "output", None)
    if not isinstance(output, nn.Linear) or output.bias is not None:
        raise ValueError(f"tiled loss: {type(model).__name__}.output is not a bias-free nn.Linear")
    output.__class__ = _tiled_output_class(type(output))


def token_logps(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each label's log-probability under ``logits / temperature`` ``(rows, seq)`` in fp32 (0 where
    the label is ignored), a row at a time; with ``entropy``, each position's entropy (no gradient).
    Logits split over the vocabulary (tensor parallel) are gathered first."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    rows, entropies = [], []
    for r in range(logits.shape[0]):
        logp = torch.log_softmax(logits[r].float() / temperature, dim=-1)
        label = labels[r]
        picked = logp.gather(-1, label.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        rows.append(torch.where(label == IGNORE_INDEX, torch.zeros_like(picked), picked))
        if entropy:
            with torch.no_grad():
                entropies.append(-(logp.exp() * logp).sum(-1))
    return torch.stack(rows), torch.stack(entropies) if entropy else None
