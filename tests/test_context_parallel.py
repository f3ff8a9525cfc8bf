"""Context parallel: the sequence split over 2 or 4 ranks gives one process's logits and gradients.

Model level: the same weights on every rank, each rank's share of the tokens (load-balanced
head-tail chunks), causal and block-causal (packed documents) attention, both methods; the
logits gathered back and the gradients summed over the ranks equal one process's on the whole
sequence (fp32, within 1e-5)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist_utils import run_distributed
from torchtitan_lite.distributed.context_parallel import ContextParallel, context_parallel_problem

SEQ = 32


def _model(family: str) -> torch.nn.Module:
    from torchtitan_lite.models import get_model_spec

    spec = get_model_spec(family)
    torch.manual_seed(0)
    model = spec.model_cls(spec.model_args("tiny"))
    model.init_weights()
    return model


def _batch(vocab: int, documents: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (2, SEQ), generator=g)
    labels = torch.randint(0, vocab, (2, SEQ), generator=g)
    # Packed documents of uneven lengths, boundaries inside the chunks of every rank.
    docs = torch.tensor([[0] * 5 + [1] * 14 + [2] * 13, [0] * 21 + [1] * 11]) if documents else None
    return tokens, labels, docs


def _reference(family: str, documents: bool) -> dict[str, Any]:
    model = _model(family)
    tokens, labels, docs = _batch(model.args.vocab_size, documents)
    logits = model(tokens, docs)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    return {"logits": logits.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _sharded(family: str, documents: bool, method: str) -> dict[str, Any]:
    import torch.distributed as dist

    from torchtitan_lite.distributed import init_distributed

    init_distributed(torch.device("cpu"))
    model = _model(family)
    cp = model.context_parallel = ContextParallel(dist.group.WORLD, method=method)
    tokens, labels, docs = _batch(model.args.vocab_size, documents)
    local = model(cp.shard(tokens), None if docs is None else cp.shard(docs))
    loss = torch.nn.functional.cross_entropy(local.flatten(0, 1), cp.shard(labels).flatten(), reduction="sum")
    loss.backward()
    pieces = [torch.empty_like(local) for _ in range(cp.degree)]
    dist.all_gather(pieces, local.detach().contiguous())
    gathered = torch.cat(pieces, dim=1)
    logits = gathered.index_select(1, cp.layout(SEQ, gathered.device).gathered_to_global)
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        grads[name] = p.grad
    return {"logits": logits, "grads": grads}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family, documents, method", [
    ("llama3", False, "allgather"), ("llama3", True, "allgather"),
    ("llama3", False, "ulysses"), ("llama3", True, "ulysses"),
    ("qwen3", True, "allgather"), ("qwen2", False, "ulysses"),
    ("deepseek_v3", True, "allgather"), ("deepseek_v3", False, "ulysses"),
])
def test_sharded_sequence_equals_one_process(world: int, family: str, documents: bool, method: str) -> None:
    reference = _reference(family, documents)
    for rank, got in enumerate(run_distributed(_sharded, world, family, documents, method)):
        torch.testing.assert_close(got["logits"], reference["logits"], atol=1e-5, rtol=1e-5,
                                   msg=lambda m, rank=rank: f"rank {rank} logits: {m}")
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}")


def test_load_balanced_layout() -> None:
    """Head-tail chunks: rank r holds chunks r and 2·degree−1−r; the permutations invert."""

    class Solo(ContextParallel):
        def __init__(self, degree: int, rank: int) -> None:
            self.group, self.method, self.degree, self.rank, self._layouts = None, "allgather", degree, rank, {}

    layout = Solo(4, 1).layout(16, torch.device("cpu"))
    assert layout.owned.tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert torch.equal(layout.global_to_gathered[layout.gathered_to_global], torch.arange(16))
    x = torch.arange(16).view(1, 16)
    assert Solo(4, 1).shard(x).tolist() == [[2, 3, 12, 13]]


def test_problems_are_one_line() -> None:
    assert context_parallel_problem(seq_len=30, degree=2, method="allgather", n_heads=4, kv_heads=2) == (
        "training.seq_len 30 does not split into 2 × context_parallel_degree = 4 equal chunks (the "
        "load-balanced split); expected a multiple of it")
    assert "6 heads do not divide by context_parallel_degree 4" in context_parallel_problem(
        seq_len=32, degree=4, method="ulysses", n_heads=6, kv_heads=2)
    assert context_parallel_problem(seq_len=32, degree=4, method="ulysses", n_heads=8, kv_heads=2) is None
    assert "unknown method 'ring'" in context_parallel_problem(seq_len=32, degree=2, method="ring", n_heads=4,
                                                               kv_heads=4)
