"""The mixture-of-experts feed-forward (``torchtitan_lite/models/moe/``): the same outputs and
gradients as ``transformers``' Qwen3-MoE block, grouped matrix products equal to the loop, no
token dropped, and the load-balancing loss as ``transformers`` computes it."""

from __future__ import annotations

import pytest
import torch

from torchtitan_lite.models.moe import MoE, balancing_loss, expert_counts, grouped_mm_available

transformers = pytest.importorskip("transformers")

DIM, HIDDEN, EXPERTS, TOP_K = 32, 48, 6, 2


def _pair(seed: int = 0, norm_topk_prob: bool = True) -> tuple[MoE, torch.nn.Module]:
    """Our MoE and transformers' Qwen3MoeSparseMoeBlock with the same random weights."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(hidden_size=DIM, moe_intermediate_size=HIDDEN, num_experts=EXPERTS,
                                         num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk_prob)
    torch.manual_seed(seed)
    theirs = Qwen3MoeSparseMoeBlock(config)
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.1)
    ours = MoE.build(DIM, HIDDEN, EXPERTS, TOP_K, norm_topk_prob=norm_topk_prob)
    with torch.no_grad():
        ours.router.gate.weight.copy_(theirs.gate.weight)
        ours.experts.w1.copy_(theirs.experts.gate_up_proj[:, :HIDDEN])
        ours.experts.w3.copy_(theirs.experts.gate_up_proj[:, HIDDEN:])
        ours.experts.w2.copy_(theirs.experts.down_proj)
    return ours, theirs


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_outputs_and_gradients_equal_transformers(norm_topk_prob: bool) -> None:
    ours, theirs = _pair(norm_topk_prob=norm_topk_prob)
    x = torch.randn(3, 7, DIM)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = ours(x1)
    ref = theirs(x2)
    ref = ref[0] if isinstance(ref, tuple) else ref
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours.router.gate.weight.grad, theirs.gate.weight.grad, atol=1e-6, rtol=1e-5)
    theirs_w1 = theirs.experts.gate_up_proj.grad[:, :HIDDEN]
    torch.testing.assert_close(ours.experts.w1.grad, theirs_w1, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours.experts.w2.grad, theirs.experts.down_proj.grad, atol=1e-6, rtol=1e-5)
    # Every token went to top_k experts: nothing dropped.
    assert float(expert_counts(ours.last_routing, EXPERTS).sum()) == 3 * 7 * TOP_K


@pytest.mark.skipif(not grouped_mm_available("cpu"), reason="torch._grouped_mm does not run on this CPU build")
def test_grouped_experts_equal_the_loop() -> None:
    """Grouped matrix products against the loop over experts: outputs and gradients within 1e-6,
    also with an expert that gets no token."""
    ours, _ = _pair(seed=1)
    looped, _ = _pair(seed=1)
    looped.experts.use_grouped_mm = False
    x = torch.randn(4, 9, DIM)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_a, out_b = ours(a), looped(b)
    torch.testing.assert_close(out_a, out_b, atol=1e-6, rtol=1e-6)
    grad = torch.randn_like(out_a)
    out_a.backward(grad)
    out_b.backward(grad)
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-6)
    for name in ("w1", "w2", "w3"):
        torch.testing.assert_close(getattr(ours.experts, name).grad, getattr(looped.experts, name).grad, atol=1e-6,
                                   rtol=1e-6)
    # Experts that get no row (the first and the fourth) at the grouped products' edges.
    counts = torch.tensor([0, 5, 3, 0, 4, 2])
    rows = torch.randn(int(counts.sum()), DIM)
    torch.testing.assert_close(ours.experts(rows, counts), looped.experts(rows, counts), atol=1e-6, rtol=1e-6)


def test_load_balancing_loss_equals_transformers() -> None:
    """Over two MoE layers' router outputs: the auxiliary loss of ``load_balancing_loss_func``."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    layers = [_pair(seed=s)[0] for s in (2, 3)]
    x = torch.randn(2, 5, DIM)
    logits = []
    for layer in layers:
        layer(x)
        logits.append(layer.router.gate(x.reshape(-1, DIM)))
    # Every layer's router rows at once: their choices counted, their probabilities summed.
    indices = torch.cat([layer.last_routing.indices for layer in layers])
    probs = torch.cat([layer.last_routing.probs for layer in layers])
    ours = balancing_loss(expert_counts(indices, EXPERTS), probs.sum(dim=0), indices.shape[0], EXPERTS)
    theirs = load_balancing_loss_func(tuple(logits), EXPERTS, TOP_K)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


def test_top_k_larger_than_the_experts_is_refused() -> None:
    with pytest.raises(ValueError, match="top_k 5 must be between 1 and the number of experts 4"):
        MoE.build(DIM, HIDDEN, 4, 5)


def test_grouped_operator_equals_torch_grouped_mm() -> None:
    """The custom grouped operator (what compiled fp32 experts run; a loop where
    ``torch._grouped_mm`` does not run), here its loop, against each group's plain product:
    outputs and both gradients within 1e-6, with an empty group."""
    import torchtitan_lite.models.moe.grouped_mm as moe

    a = torch.randn(12, 16, requires_grad=True)
    b = torch.randn(4, 16, 8, requires_grad=True)
    offs = torch.tensor([3, 3, 9, 12], dtype=torch.int32)
    grad = torch.randn(12, 8)
    looped = dict(moe._GROUPED_MM)
    try:
        moe._GROUPED_MM[("cpu", torch.float32)] = False  # the loop inside the operator
        out = moe._grouped_mm_op(a, b, offs)
        ga, gb = torch.autograd.grad(out, (a, b), grad)
    finally:
        moe._GROUPED_MM.clear()
        moe._GROUPED_MM.update(looped)
    ref = torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip([0, 3, 3, 9], [3, 3, 9, 12], strict=True))])
    ra, rb = torch.autograd.grad(ref, (a, b), grad)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ga, ra, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gb, rb, atol=1e-6, rtol=1e-6)


def test_router_balance_losses_counts_and_bias_update_in_one_process() -> None:
    """RouterBalance on two MoE layers, one process, two micro-batches: the z-loss is the mean over
    the tokens of the squared log-sum-exp of each layer's router logits, summed over the layers,
    and the load-balancing loss transformers' over both layers' tokens, each averaged over the
    micro-batches; the load metric is each layer's max / mean count over the step; the bias moves
    by the rate against each expert's load error."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from torchtitan_lite.models.moe import RouterBalance

    layers = torch.nn.ModuleDict({str(s): _pair(seed=s)[0] for s in (2, 3)})
    balance = RouterBalance(layers, aux_loss_coef=0.5, z_loss_coef=0.25)
    expected_z, expected_aux, counts = 0.0, 0.0, torch.zeros(2, EXPERTS)
    for _ in range(2):
        x = torch.randn(2, 5, DIM)
        logits = []
        for i, layer in enumerate(layers.values()):
            layer(x)
            logits.append(layer.router.gate(x.reshape(-1, DIM)))
            counts[i] += expert_counts(layer.last_routing, EXPERTS)
        z = sum(float(torch.logsumexp(lg, dim=-1).square().mean()) for lg in logits)
        aux = float(load_balancing_loss_func(tuple(logits), EXPERTS, TOP_K))
        expected_z += z / 2
        expected_aux += aux / 2
        loss = balance.micro_batch_loss(2)
        assert loss is not None
        assert abs(float(loss) - (0.5 * aux + 0.25 * z) / 2) <= 1e-5 * float(loss)
    metrics = balance.finish_step(update_bias=True)
    assert metrics["moe/z_loss"] == pytest.approx(expected_z, rel=1e-5)
    assert metrics["moe/aux_loss"] == pytest.approx(expected_aux, rel=1e-5)
    ratios = (counts.max(dim=1).values / counts.mean(dim=1)).tolist()
    assert metrics["moe/load_max_over_mean/2"] == pytest.approx(ratios[0])
    assert metrics["moe/load_max_over_mean"] == pytest.approx(max(ratios))


def test_bias_update_moves_toward_balance() -> None:
    from torchtitan_lite.models.moe import TopKRouter, update_expert_bias

    router = TopKRouter(DIM, 4, 2, score_func="sigmoid")
    router.expert_bias.zero_()
    update_expert_bias(router, torch.tensor([10.0, 2.0, 4.0, 4.0]), 0.1)
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))  # mean 5
    with pytest.raises(ValueError, match="a softmax router has no expert bias"):
        update_expert_bias(TopKRouter(DIM, 4, 2), torch.ones(4), 0.1)


def test_stacked_weights_shard_along_the_experts_or_evenly_along_the_next_dimension() -> None:
    """FSDP's placement of a stacked expert weight: along the experts while they are at least the
    shard ranks, else along the next dimension when the ranks divide it (FSDP2 shards a later
    dimension only evenly), else along the experts anyway (some ranks then hold none)."""
    from torch.distributed.tensor import Shard

    from torchtitan_lite.distributed.fsdp import stacked_shard_placement

    assert stacked_shard_placement(torch.nn.Parameter(torch.empty(8, 32, 64)), shard_degree=4) is None
    assert stacked_shard_placement(torch.nn.Parameter(torch.empty(2, 32, 64)), shard_degree=4) == Shard(1)
    assert stacked_shard_placement(torch.nn.Parameter(torch.empty(2, 8, 64)), shard_degree=16) is None
    assert stacked_shard_placement(torch.nn.Parameter(torch.empty(64, 32)), shard_degree=128) is None
