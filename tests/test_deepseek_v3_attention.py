"""DeepSeek-V3 multi-head latent attention against transformers' ``DeepseekV3Attention``.

A tiny config (hidden 64, 4 heads, q/kv LoRA ranks 24/16, nope/rope/v head dims 8/8/12), random
weights copied by the name map with no permutation (DeepSeek's interleaved rotary layout is
ours), fp32 on CPU: outputs and gradients agree to 1e-5 without RoPE scaling and with YaRN
(attention factor 1 and not), with and without the query bottleneck, causal and packed.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from torchtitan_lite.models.decoder import (
    block_causal_mask,
    document_positions,
    precompute_freqs_cis,
    rope_bits,
)
from torchtitan_lite.models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepseekV3Args
from torchtitan_lite.models.deepseek_v3.attention import (
    MLA_HF_NAMES,
    MLAttention,
    mla_hf_shapes,
    yarn_get_mscale,
    yarn_parameters,
)

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

SEQ = 16
TOL = dict(atol=1e-5, rtol=1e-5)


def _yarn(mscale: float = 1.0, mscale_all_dim: float = 1.0, **extra: object) -> dict[str, object]:
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
            "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale_all_dim, "rope_theta": 10000.0, **extra}


NO_SCALING = {"rope_type": "default", "rope_theta": 10000.0}
CASES = {
    "plain": (24, NO_SCALING),
    "plain-no-q-lora": (None, NO_SCALING),
    "yarn": (24, _yarn()),
    "yarn-attention-factor": (24, _yarn(mscale=0.7, mscale_all_dim=1.0)),
    "yarn-no-q-lora-untruncated": (None, _yarn(mscale=1.0, mscale_all_dim=0.5, truncate=False)),
    # theta 10, untruncated: pair 1 lies inside YaRN's ramp (neither kept nor divided by the factor)
    "yarn-ramp": (24, {**_yarn(mscale=0.9, mscale_all_dim=0.6, truncate=False), "rope_theta": 10.0}),
}


def _config(q_lora_rank: int | None, rope: dict[str, object], *, rope_dim: int = 8, **kw: object) -> DeepseekV3Config:
    config = DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=rope_dim, v_head_dim=12, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_parameters=dict(rope), **kw,
    )
    config._attn_implementation = "eager"
    return config


def _args(config: DeepseekV3Config) -> DeepseekV3Args:
    """Our args for a transformers config (the mapping a DeepSeek family's converter makes)."""
    rope = config.rope_parameters
    yarn = rope["rope_type"] == "yarn"
    return DeepseekV3Args(
        dim=config.hidden_size, n_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank or 0,
        kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
        # transformers' q_a/kv_a RMSNorms use their default eps 1e-6, not rms_norm_eps
        norm_eps=1e-6, max_seq_len=config.max_position_embeddings, rope_theta=rope["rope_theta"],
        rope_scaling="yarn" if yarn else "none", rope_factor=rope.get("factor", 1.0),
        original_max_seq_len=rope.get("original_max_position_embeddings", config.max_position_embeddings),
        beta_fast=rope.get("beta_fast") or 32.0, beta_slow=rope.get("beta_slow") or 1.0,
        mscale=rope.get("mscale") or 0.0, mscale_all_dim=rope.get("mscale_all_dim") or 0.0,
        rope_truncate=rope.get("truncate", True),
    )


def _freqs_cis(args: DeepseekV3Args) -> torch.Tensor:
    """The RoPE table the decoder builds for MLA's rotary dims (``head_dim`` = ``qk_rope_head_dim``)."""
    return precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta, args=args)


def _pair(config: DeepseekV3Config, seed: int = 0) -> tuple[DeepseekV3Attention, MLAttention, DeepseekV3Args]:
    """transformers' attention with random weights (norm weights near 1) and ours, loaded from it."""
    torch.manual_seed(seed)
    hf = DeepseekV3Attention(config, layer_idx=0)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "layernorm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[1]))
    args = _args(config)
    ours = MLAttention(args)
    hf_state = hf.state_dict()
    ours.load_state_dict({name: hf_state[MLA_HF_NAMES[f"attention.{name}"].removeprefix("self_attn.")]
                          for name in ours.state_dict()})
    return hf, ours, args


def _hf_forward(hf: DeepseekV3Attention, x: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    cos, sin = DeepseekV3RotaryEmbedding(hf.config)(x, position_ids)
    if mask is None:  # the causal mask DeepseekV3Model builds for eager attention (additive)
        mask = create_causal_mask(config=hf.config, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=position_ids)
    return hf(x, position_embeddings=(cos, sin), attention_mask=mask)[0]


def _compare(hf: DeepseekV3Attention, ours: MLAttention, x: torch.Tensor, hf_kwargs: dict[str, object],
             rope: torch.Tensor, mask: torch.Tensor | None = None, *, param_grads: bool = True) -> None:
    x_hf = x.clone().requires_grad_()
    x_ours = x.clone().requires_grad_()
    out_hf = _hf_forward(hf, x_hf, **hf_kwargs)
    out_ours = ours(x_ours, rope, mask)
    torch.testing.assert_close(out_ours, out_hf, **TOL)
    grad = torch.randn_like(out_hf)
    out_hf.backward(grad)
    out_ours.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, **TOL)
    if not param_grads:
        return
    hf_params = dict(hf.named_parameters())
    for name, param in ours.named_parameters():
        hf_param = hf_params[MLA_HF_NAMES[f"attention.{name}"].removeprefix("self_attn.")]
        torch.testing.assert_close(param.grad, hf_param.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_causal_matches_transformers(case: str) -> None:
    q_lora_rank, rope = CASES[case]
    hf, ours, args = _pair(_config(q_lora_rank, rope))
    x = torch.randn(2, SEQ, 64)
    freqs_cis = _freqs_cis(args)
    _compare(hf, ours, x, {"position_ids": torch.arange(SEQ)[None]}, rope_bits(freqs_cis, SEQ))


@pytest.mark.parametrize("case", ["plain", "yarn-attention-factor"])
def test_packed_documents_match_transformers(case: str) -> None:
    """Block-causal dense mask and per-sample positions (the decoder's packed path) against
    transformers given the same positions and the additive form of the mask."""
    q_lora_rank, rope = CASES[case]
    hf, ours, args = _pair(_config(q_lora_rank, rope), seed=1)
    document_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    positions = document_positions(document_ids)
    mask = block_causal_mask(document_ids, flex=False)
    dense = mask.dense()
    additive = torch.zeros(dense.shape).masked_fill(~dense, torch.finfo(torch.float32).min)
    freqs_cis = _freqs_cis(args)
    table = rope_bits(freqs_cis, freqs_cis.shape[0])[positions]  # (bs, seq, rope_dim // 2, 2)
    x = torch.randn(2, SEQ, 64)
    _compare(hf, ours, x, {"position_ids": positions, "mask": additive}, table, mask)


@pytest.mark.parametrize("case", list(CASES))
def test_rope_table_and_scales_match_transformers(case: str) -> None:
    q_lora_rank, rope = CASES[case]
    config = _config(q_lora_rank, rope)
    args = _args(config)
    rotary = DeepseekV3RotaryEmbedding(config)
    hf_attention = DeepseekV3Attention(config, layer_idx=0)
    scales = yarn_parameters(args)
    assert scales.attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert scales.softmax_scale == pytest.approx(hf_attention.scaling, rel=1e-12)
    # frequencies: ours in float64, transformers' in float32
    base = 1.0 / args.rope_theta ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    torch.testing.assert_close(args.scale_rope_frequencies(base).float(), rotary.inv_freq, rtol=1e-6, atol=0)
    # the table: unit rotations by the same angles as transformers' cos/sin (which carry the factor)
    x = torch.zeros(1, 64, 64)
    cos, sin = rotary(x, torch.arange(64)[None])
    table = torch.view_as_real(_freqs_cis(args))
    torch.testing.assert_close(table[..., 0] * scales.attention_factor, cos[0, :, :4], atol=1e-5, rtol=0)
    torch.testing.assert_close(table[..., 1] * scales.attention_factor, sin[0, :, :4], atol=1e-5, rtol=0)
    if case == "yarn-attention-factor":
        assert scales.attention_factor != pytest.approx(1.0)
    if case == "yarn-ramp":  # some pair strictly between kept and divided by the factor
        ratio = base / args.scale_rope_frequencies(base)
        assert ((ratio > 1.01) & (ratio < 3.99)).any()


def test_deepseek_v3_671b_rope_matches_transformers() -> None:
    """The 671B flavor's attention and YaRN settings (DeepSeek-V3's config.json ``rope_scaling``):
    the same frequencies, cos/sin magnitude and softmax scale as transformers."""
    args = DEEPSEEK_V3_FLAVORS["671B"]
    config = DeepseekV3Config(
        max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "rope_theta": 10000.0},
    )
    rotary = DeepseekV3RotaryEmbedding(config)
    base = 1.0 / args.rope_theta ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    torch.testing.assert_close(args.scale_rope_frequencies(base).float(), rotary.inv_freq, rtol=1e-6, atol=0)
    scales = yarn_parameters(args)
    assert scales.attention_factor == rotary.attention_scaling == 1.0
    expected = 192**-0.5 * yarn_get_mscale(40.0, 1.0) ** 2
    assert scales.softmax_scale == pytest.approx(expected, rel=1e-12)


def test_non_interleaved_checkpoints_need_a_permutation() -> None:
    """transformers' ``rope_interleave=True`` (DeepSeek's layout) is ours as is. With
    ``rope_interleave=False`` (rotate_half on contiguous halves) the outputs differ, and match
    once the rotary output rows of the query and shared-key projections are put in interleaved
    order (row ``i`` of each half to ``2i`` / ``2i + 1``)."""
    config = _config(24, CASES["yarn-attention-factor"][1], rope_interleave=False)
    hf, ours, args = _pair(config, seed=2)
    x = torch.randn(2, SEQ, 64)
    rope = rope_bits(_freqs_cis(args), SEQ)
    with torch.no_grad():
        assert not torch.allclose(ours(x, rope), _hf_forward(hf, x, torch.arange(SEQ)[None]), atol=1e-3)
    r, nope = args.qk_rope_head_dim, args.qk_nope_head_dim
    interleave = torch.arange(r).view(2, r // 2).t().reshape(-1)  # [0, r/2, 1, r/2 + 1, ...]
    with torch.no_grad():
        wq_b = ours.wq_b.weight.view(args.n_heads, nope + r, -1)
        wq_b[:, nope:] = wq_b[:, nope:][:, interleave].clone()
        ours.wkv_a.weight[args.kv_lora_rank:] = ours.wkv_a.weight[args.kv_lora_rank:][interleave].clone()
    _compare(hf, ours, x, {"position_ids": torch.arange(SEQ)[None]}, rope, param_grads=False)


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_names_and_shapes_match_transformers(q_lora_rank: int | None) -> None:
    config = _config(q_lora_rank, NO_SCALING)
    hf_shapes = {f"self_attn.{name}": tuple(p.shape)
                 for name, p in DeepseekV3Attention(config, layer_idx=0).named_parameters()}
    args = _args(config)
    assert mla_hf_shapes(args) == hf_shapes
    ours = {f"attention.{name}": tuple(p.shape) for name, p in MLAttention(args).named_parameters()}
    assert {MLA_HF_NAMES[name]: shape for name, shape in ours.items()} == hf_shapes
    assert set(MLA_HF_NAMES.values()) >= set(hf_shapes)


def test_meta_build_and_init_weights() -> None:
    args = replace(DEEPSEEK_V3_FLAVORS["671B"], dim=64, n_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                   qk_rope_head_dim=8, v_head_dim=12, max_seq_len=64, original_max_seq_len=16, rope_factor=4.0)
    with torch.device("meta"):
        module = MLAttention(args)
    module.to_empty(device="cpu")
    torch.manual_seed(0)
    module.init_weights(out_std=0.005)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert torch.equal(module.q_norm.weight, torch.ones(24)) and torch.equal(module.kv_norm.weight, torch.ones(16))
    assert module.wkv_b.weight.std().item() == pytest.approx(0.02, rel=0.15)
    assert module.wo.weight.std().item() == pytest.approx(0.005, rel=0.15)
    out = module(torch.randn(2, SEQ, 64), rope_bits(_freqs_cis(args), SEQ))
    assert out.shape == (2, SEQ, 64)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_block_mask_path_matches_dense_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FlexAttention branch (a BlockMask; ``scale=`` passed, value head dim unlike the query's)
    equals the dense-mask branch. Forward only and uncompiled: FlexAttention has no CPU backward,
    and compiling it would take most of this file's time budget."""
    from torch.nn.attention.flex_attention import flex_attention

    import torchtitan_lite.models.decoder as decoder

    monkeypatch.setattr(decoder, "compiled_flex_attention", lambda: flex_attention)
    args = _args(_config(24, CASES["yarn-attention-factor"][1]))
    torch.manual_seed(3)
    module = MLAttention(args)
    module.init_weights(out_std=0.02)
    document_ids = torch.tensor([[0] * 50 + [1] * 14, [0] * 64])
    table = rope_bits(_freqs_cis(args), args.max_seq_len)[document_positions(document_ids)]
    x = torch.randn(2, 64, 64)
    with torch.no_grad():
        dense = module(x, table, block_causal_mask(document_ids, flex=False))
        flex = module(x, table, block_causal_mask(document_ids, flex=True))
    torch.testing.assert_close(flex, dense, **TOL)


def test_rejects_unknown_rope_scaling() -> None:
    with pytest.raises(ValueError, match="rope_scaling"):
        DeepseekV3Args(rope_scaling="llama3")


def test_kernels_as_on_cuda_pads_narrow_values_and_gives_the_same_result() -> None:
    """The memory estimate of a CUDA job runs latent attention (values narrower than keys) on the
    fused CPU kernel over zero-padded values: the same output and gradients as the math path."""
    import torch

    from torchtitan_lite.models.decoder import attend, kernels_as_on_cuda

    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 16, 24, generator=generator, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 4, 16, 16, generator=generator, requires_grad=True)
    plain = attend(q, k, v, scale=0.3)
    grads = torch.autograd.grad(plain.square().sum(), (q, k, v))
    with kernels_as_on_cuda():
        padded = attend(q, k, v, scale=0.3)
        padded_grads = torch.autograd.grad(padded.square().sum(), (q, k, v))
    assert padded.shape == plain.shape == (2, 4, 16, 16)
    torch.testing.assert_close(padded, plain, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(padded_grads, grads, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
