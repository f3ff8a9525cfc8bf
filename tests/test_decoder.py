"""The decoder (``torchtitan_lite/models/decoder.py``) as Llama 3: names, shapes, RoPE and GQA
against plain reference computations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torchtitan_lite.models.llama3 import LLAMA3_FLAVORS, Transformer
from torchtitan_lite.models.llama3.model import apply_rotary_emb, precompute_freqs_cis


def _tiny(seed=0):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(LLAMA3_FLAVORS["tiny"])
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_parameter_names_follow_llama3():
    names = {n for n, _ in _tiny().named_parameters()}
    for expected in ["tok_embeddings.weight", "norm.weight", "output.weight",
                     "layers.0.attention.wq.weight", "layers.0.attention.wk.weight",
                     "layers.0.attention.wv.weight", "layers.0.attention.wo.weight",
                     "layers.1.feed_forward.w1.weight", "layers.1.feed_forward.w2.weight",
                     "layers.1.feed_forward.w3.weight", "layers.1.attention_norm.weight",
                     "layers.1.ffn_norm.weight"]:
        assert expected in names
    assert "freqs_cis" not in _tiny().state_dict()  # non-persistent buffer


@pytest.mark.parametrize("flavor, approx_params", [("debugmodel", 5.2e6), ("1B", 1.5e9), ("8B", 8.03e9)])
def test_flavor_sizes(flavor, approx_params):
    args = LLAMA3_FLAVORS[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == args.num_params()
    assert counted == pytest.approx(approx_params, rel=0.02)
    if flavor == "debugmodel":
        assert (args.dim, args.n_layers, args.n_heads) == (256, 6, 16)
    if flavor == "8B":
        assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.ffn_hidden_dim) == (
            4096, 32, 32, 8, 14336)


def test_rope_rotates_pairs_like_the_complex_reference():
    head_dim, seq = 8, 5
    freqs = precompute_freqs_cis(head_dim, 16, theta=10000.0)
    x = torch.randn(2, seq, 3, head_dim)
    out = apply_rotary_emb(x, freqs)
    for pos in range(seq):
        for i in range(head_dim // 2):
            angle = pos / (10000.0 ** (2 * i / head_dim))
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[..., pos, :, 2 * i], x[..., pos, :, 2 * i + 1]
            torch.testing.assert_close(out[..., pos, :, 2 * i], a * c - b * s, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out[..., pos, :, 2 * i + 1], a * s + b * c, rtol=1e-5, atol=1e-5)


def test_attention_matches_explicit_gqa_reference():
    model = _tiny()
    attn = model.layers["0"].attention
    x = torch.randn(2, 7, 64)
    got = attn(x, model.freqs_cis)
    q = apply_rotary_emb(attn.wq(x).view(2, 7, 4, 16), model.freqs_cis).transpose(1, 2)
    k = apply_rotary_emb(attn.wk(x).view(2, 7, 2, 16), model.freqs_cis).transpose(1, 2)
    v = attn.wv(x).view(2, 7, 2, 16).transpose(1, 2)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(16)
    scores = scores.masked_fill(torch.triu(torch.ones(7, 7, dtype=torch.bool), 1), float("-inf"))
    ref = attn.wo((F.softmax(scores, -1) @ v).transpose(1, 2).reshape(2, 7, 64))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_causal_and_init_depends_only_on_seed():
    a, b, c = _tiny(0), _tiny(0), _tiny(1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    tokens = torch.randint(0, 258, (1, 12))
    changed = tokens.clone()
    changed[0, 8] = (changed[0, 8] + 1) % 258
    with torch.no_grad():
        torch.testing.assert_close(a(tokens)[0, :8], a(changed)[0, :8])


def test_init_statistics():
    model = _tiny()
    std = model.layers["0"].attention.wq.weight.std().item()
    assert std == pytest.approx(0.02 * 0.88, rel=0.15)  # truncated at ±2σ: σ·0.88
    assert model.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.1)
    assert torch.all(model.norm.weight == 1)
    assert model.layers["1"].attention.wo.weight.abs().max() <= 2 * 0.02 / math.sqrt(4) + 1e-6


def test_sequence_longer_than_max_seq_len_is_rejected():
    with pytest.raises(ValueError, match="max_seq_len"):
        _tiny()(torch.zeros(1, 600, dtype=torch.long))


def _packed_and_alone(ranks: int) -> dict[str, float]:
    """Logits of two packed windows (documents of 7 + 9 + 16 and 20 + 12 tokens) with block-causal
    attention against each document run alone, and against causal packing: the largest
    differences relative to the logits' scale. ``ranks > 1``: the model is sharded by FSDP2."""
    from torchtitan_lite.distributed import destroy_distributed, fsdp_mesh, init_distributed
    from torchtitan_lite.distributed.parallelize import build_sharded_model
    from torchtitan_lite.models import get_model_spec

    device = torch.device("cpu")
    spec = get_model_spec("llama3")
    if ranks > 1:
        init_distributed(device)
        model = build_sharded_model(spec, spec.model_args("tiny"), fsdp_mesh(device), device=device, seed=0)
    else:
        model = build_sharded_model(spec, spec.model_args("tiny"), None, device=device, seed=0, sharded=False)
    tokens = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(5))
    lengths = [[7, 9, 16], [20, 12]]
    docs = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])
    out: dict[str, float] = {}
    with torch.no_grad():
        packed = model(tokens, docs)
        causal = model(tokens)
        scale = packed.abs().max().item()
        alone = 0.0
        for b, row in enumerate(lengths):
            start = 0
            for n in row:
                single = model(tokens[b : b + 1, start : start + n])
                alone = max(alone, (packed[b, start : start + n] - single[0]).abs().max().item())
                start += n
        out = {"alone": alone / scale, "causal": (packed - causal).abs().max().item() / scale}
    if ranks > 1:
        destroy_distributed()
    return out


def test_block_causal_logits_equal_each_document_alone_on_one_and_two_ranks() -> None:
    """Packed documents with ``document_ids``: attention stays within each and RoPE restarts, so
    each document's logits are those of it run alone (1e-5 of the logits' scale), unlike plain
    causal packing; the same under FSDP2 on 2 ranks."""
    from tests.dist_utils import run_distributed

    for result in [_packed_and_alone(1), *run_distributed(_packed_and_alone, 2, 2)]:
        assert result["alone"] <= 1e-5, result
        assert result["causal"] > 1e-2, result


@pytest.mark.slow  # (the mask is made by a compiled function: its compile)
def test_block_causal_mask_of_flex_attention_equals_the_dense_one() -> None:
    """The FlexAttention BlockMask (used on CUDA), the tiled attention of packed documents
    (elsewhere) and a dense mask attend alike: FlexAttention run here eagerly on the CPU with the
    decoder's BlockMask."""
    from torch.nn.attention.flex_attention import flex_attention

    from torchtitan_lite.models.decoder import DocumentMask, attend, block_causal_mask

    docs = torch.tensor([[0] * 5 + [1] * 11, [0] * 8 + [1] * 3 + [2] * 5])
    q, k, v = (torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    flex = flex_attention(q, k, v, block_mask=block_causal_mask(docs, flex=True))
    mask = block_causal_mask(docs)
    assert isinstance(mask, DocumentMask)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense())
    assert (flex - dense).abs().max().item() < 1e-5
    assert (attend(q, k, v, mask) - dense).abs().max().item() < 1e-6


@pytest.mark.scenario  # (a compile for each length; the default selection compiles it once, above)
@pytest.mark.slow
def test_the_block_mask_is_made_without_a_dense_mask() -> None:
    """The BlockMask of one packed row (documents of 1,000 tokens) is made block by block: the
    allocator's peak while making it, at 4,096 to 32,768 tokens, is its block tables (about 32 bytes
    per 128 × 128 block: 2 MiB at 32,768), never the dense mask's tokens² bytes (1 GiB there)."""
    from torchtitan_lite.memory.measure import AllocatorPeak
    from torchtitan_lite.models.decoder import block_causal_mask

    for tokens in (4096, 8192, 16384, 32768):
        docs = (torch.arange(tokens) // 1000)[None]
        with AllocatorPeak(torch.device("cpu")) as memory, memory.window():
            mask = block_causal_mask(docs, flex=True)
        blocks = (tokens // 128) ** 2
        # (about 32 bytes a block alone; what else the process allocates meanwhile varies)
        assert memory.peak <= 64 * blocks + 2**17 and memory.peak < tokens**2 / 256, (tokens, memory.peak)
        assert mask.kv_num_blocks.shape[-1] == tokens // 128
