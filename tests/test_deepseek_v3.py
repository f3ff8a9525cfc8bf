"""The deepseek_v3 family against transformers' ``DeepseekV3ForCausalLM``.

Tiny random models (8 experts in 2 groups, top-2 from 1 group, a shared expert, the first block
dense; weights std 0.1 and a non-zero router bias, so the bias decides choices), fp32 on CPU,
eager attention in transformers: a folder transformers saved loads into our model with logits
within 1e-5, and our export loads back into transformers with the same logits and router bias.
Cases: query bottleneck with default RoPE (and ``rms_norm_eps`` far from the latent norms' 1e-6),
no bottleneck with YaRN, and YaRN with ``rope_interleave: false`` (rotary rows permuted).
Then the one-line refusals, ``config.json`` round trips and the parameter counts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from torchtitan_lite.checkpoint.hf_storage import check_hf_checkpoint, load_hf_weights, save_hf_weights
from torchtitan_lite.errors import CheckpointError
from torchtitan_lite.models import get_model_spec
from torchtitan_lite.models.deepseek_v3 import (
    DEEPSEEK_V3_FLAVORS,
    DEEPSEEK_V3_SPEC,
    DeepseekV3,
    DeepseekV3Args,
)
from torchtitan_lite.models.moe import MoE

transformers = pytest.importorskip("transformers")

SPEC = DEEPSEEK_V3_SPEC
SEQ = 48
TOL = dict(atol=1e-5, rtol=1e-5)

_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
         "beta_slow": 1.0, "mscale": 0.7, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
CASES: dict[str, dict[str, Any]] = {
    "q-lora": {
        "q_lora_rank": 32,
        "rms_norm_eps": 1e-2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
    },
    "no-q-lora-yarn": {"q_lora_rank": None, "rope_parameters": dict(_YARN)},
    "yarn-not-interleaved": {"q_lora_rank": 32, "rope_parameters": {**_YARN, "mscale": 1.0}, "rope_interleave": False},
}


def _hf_config(**overrides: Any) -> Any:
    fields = {
        "vocab_size": 258,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        **overrides,
    }
    return transformers.DeepseekV3Config(**fields)


def _hf_model(folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random ``DeepseekV3ForCausalLM`` saved by transformers."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(_hf_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(std=0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(std=0.1)
    model.save_pretrained(str(folder))
    return folder


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 258, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _hf_logits(folder: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(str(folder), attn_implementation="eager",
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits, model


def _config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def _ours(folder: Path) -> DeepseekV3:
    args = SPEC.hf.args_from_config(_config(folder))
    with torch.device("meta"):
        model = DeepseekV3(args)
    model.to_empty(device="cpu")
    load_hf_weights(model, folder, spec=SPEC)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_checkpoint_loads_and_our_export_loads_back(tmp_path: Path, case: str) -> None:
    folder = _hf_model(tmp_path / "hf", **CASES[case])
    tokens = _tokens()
    theirs, hf_model = _hf_logits(folder, tokens)
    model = _ours(folder)
    assert sum(p.numel() for p in model.parameters()) == model.args.num_params()
    biases = {name: m.router.expert_bias for name, m in model.named_modules() if isinstance(m, MoE)}
    assert len(biases) == 2 and all(b.abs().min() > 0 for b in biases.values())
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(ours, theirs, **TOL)

    save_hf_weights(model, tmp_path / "export", spec=SPEC)
    again, exported = _hf_logits(tmp_path / "export", tokens)
    torch.testing.assert_close(again, ours, **TOL)
    for i in (1, 2):
        torch.testing.assert_close(exported.model.layers[i].mlp.gate.e_score_correction_bias,
                                   hf_model.model.layers[i].mlp.gate.e_score_correction_bias, atol=0, rtol=0)
    written = _config(tmp_path / "export")
    assert written["q_lora_rank"] == CASES[case]["q_lora_rank"]
    assert written["rope_interleave"] == CASES[case].get("rope_interleave", True)
    assert SPEC.hf.args_from_config(written) == model.args


def test_packed_documents_match_separate_forwards(tmp_path: Path) -> None:
    """Block-causal attention with positions restarting per document (the packed path) equals
    each document run alone through transformers."""
    folder = _hf_model(tmp_path / "hf", **CASES["no-q-lora-yarn"])
    model = _ours(folder)
    tokens = _tokens()[:1]
    document_ids = torch.tensor([[0] * 20 + [1] * (SEQ - 20)])
    with torch.no_grad():
        packed = model(tokens, document_ids=document_ids)
    theirs = torch.cat([_hf_logits(folder, tokens[:, :20])[0], _hf_logits(folder, tokens[:, 20:])[0]], dim=1)
    torch.testing.assert_close(packed, theirs, **TOL)


# --- refusals ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DeepseekV3Args]:
    """Our tiny model exported once (config and weights)."""
    folder = tmp_path_factory.mktemp("ds") / "export"
    args = DEEPSEEK_V3_FLAVORS["tiny"]
    torch.manual_seed(0)
    model = DeepseekV3(args)
    model.init_weights()
    save_hf_weights(model, folder, spec=SPEC)
    return folder, args


def _refusal(folder: Path, args: Any, tmp_path: Path, **changes: Any) -> str:
    """The one-line error of ``folder`` with ``changes`` to its config.json (None removes a key)."""
    copy = tmp_path / "changed"
    copy.mkdir()
    for file in folder.iterdir():
        if file.is_file():
            (copy / file.name).write_bytes(file.read_bytes())
    config = {**_config(folder), **changes}
    (copy / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(CheckpointError) as caught:
        check_hf_checkpoint(copy, SPEC, args)
    message = str(caught.value)
    assert "\n" not in message
    with pytest.raises(ValueError) as from_config:
        SPEC.hf.args_from_config(config)
    assert "\n" not in str(from_config.value)
    return message


@pytest.mark.parametrize("changes, phrase", [
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}},
     "quantization_config (quant_method='fp8'): the weights are quantized; dequantize them to bf16 first"),
    ({"topk_method": "greedy"}, "topk_method='greedy' but DeepseekV3ForCausalLM computes only topk_method='noaux_tc'"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"attention_bias": True}, "attention_bias=true but this model has no biases"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 but this model has num_key_value_heads=4"),
    ({"rope_parameters": {**_YARN, "attention_factor": 1.3}, "rope_scaling": None, "max_position_embeddings": 512},
     "rope_parameters.attention_factor=1.3"),
])
def test_config_refusals_are_one_line(saved: tuple[Path, Any], tmp_path: Path, changes: dict[str, Any],
                                      phrase: str) -> None:
    folder, args = saved
    assert phrase in _refusal(folder, args, tmp_path, **changes)


def test_check_accepts_the_export_and_refuses_a_changed_layout(saved: tuple[Path, Any]) -> None:
    folder, args = saved
    check_hf_checkpoint(folder, SPEC, args)
    with pytest.raises(CheckpointError, match="rope_interleave=True but this model has rope_interleave=False"):
        check_hf_checkpoint(folder, SPEC, dataclasses.replace(args, rope_interleave=False))
    with pytest.raises(CheckpointError, match="q_lora_rank=32 but this model has q_lora_rank=0"):
        check_hf_checkpoint(folder, SPEC, dataclasses.replace(args, q_lora_rank=0))


def test_a_qwen3_moe_folder_names_its_family(tmp_path: Path) -> None:
    qwen = get_model_spec("qwen3_moe")
    torch.manual_seed(0)
    model = qwen.model_cls(qwen.flavors["tiny"])
    model.init_weights()
    save_hf_weights(model, tmp_path / "qwen", spec=qwen)
    with pytest.raises(CheckpointError) as caught:
        check_hf_checkpoint(tmp_path / "qwen", SPEC, DEEPSEEK_V3_FLAVORS["tiny"])
    message = str(caught.value)
    assert "\n" not in message
    assert "model_type='qwen3_moe' but this model is 'deepseek_v3' (DeepseekV3ForCausalLM)" in message
    assert "(model.name = 'qwen3_moe' reads it)" in message
    with pytest.raises(ValueError, match="model_type='qwen3_moe' but this model is 'deepseek_v3'"):
        SPEC.hf.args_from_config(_config(tmp_path / "qwen"))


# --- config.json ------------------------------------------------------------------------------

DEEPSEEK_V3_CONFIG = {
    # deepseek-ai/DeepSeek-V3's config.json (its auto_map and token ids left out)
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

MOONLIGHT_CONFIG = {
    # moonshotai/Moonlight-16B-A3B's config.json (its auto_map and token ids left out)
    "architectures": ["DeepseekV3ForCausalLM"], "aux_loss_alpha": 0.001, "ep_size": 1, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11264,
    "kv_lora_rank": 512, "max_position_embeddings": 8192, "model_type": "deepseek_v3", "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 50000.0,
    "routed_scaling_factor": 2.446, "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128,
    "vocab_size": 163840,
}


def test_published_configs_give_the_flavors() -> None:
    with pytest.raises(ValueError, match="quantization_config .* dequantize them to bf16 first"):
        SPEC.hf.args_from_config(DEEPSEEK_V3_CONFIG)
    dequantized = {k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "quantization_config"}
    assert SPEC.hf.args_from_config(dequantized) == DEEPSEEK_V3_FLAVORS["671B"]
    assert SPEC.hf.config_mismatch(dequantized, DEEPSEEK_V3_FLAVORS["671B"]) is None
    assert SPEC.hf.args_from_config(MOONLIGHT_CONFIG) == DEEPSEEK_V3_FLAVORS["16B"]


VARIANTS = {**DEEPSEEK_V3_FLAVORS,
            "yarn-unset-mscales-untruncated": dataclasses.replace(DEEPSEEK_V3_FLAVORS["671B"], mscale=0.0,
                                                                  mscale_all_dim=0.0, rope_truncate=False),
            "halves-no-q-lora": dataclasses.replace(DEEPSEEK_V3_FLAVORS["tiny"], q_lora_rank=0, rope_interleave=False)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_for_reads_back_as_the_args_and_transformers_takes_it(variant: str) -> None:
    args = VARIANTS[variant]
    config = SPEC.hf.config_for(args, torch.bfloat16)
    assert SPEC.hf.args_from_config(config) == args
    theirs = transformers.DeepseekV3Config(**{k: v for k, v in config.items() if k != "torch_dtype"})
    assert (theirs.head_dim, theirs.num_key_value_heads, theirs.q_lora_rank) == (
        args.qk_rope_head_dim, args.n_heads, args.q_lora_rank or None)
    assert theirs.rope_parameters["rope_type"] == ("default" if args.rope_scaling == "none" else "yarn")


# --- shapes and counts ------------------------------------------------------------------------


def test_registered_and_counts_match_the_built_model() -> None:
    assert get_model_spec("deepseek_v3") is SPEC
    for args in (DEEPSEEK_V3_FLAVORS["tiny"], dataclasses.replace(DEEPSEEK_V3_FLAVORS["tiny"], q_lora_rank=0,
                                                                   tie_word_embeddings=True, n_shared_experts=2)):
        model = DeepseekV3(args)
        assert sum(p.numel() for p in model.parameters()) == args.num_params()
        assert [layer.moe is not None for layer in model.layers.values()] == [False, True, True]
        routed = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
        assert args.num_params() - args.active_params() == routed * (1 - args.top_k / args.num_experts)
    for name in ("16B", "671B"):
        with torch.device("meta"):
            model = DeepseekV3(DEEPSEEK_V3_FLAVORS[name])
        assert sum(p.numel() for p in model.parameters()) == DEEPSEEK_V3_FLAVORS[name].num_params()


def test_published_sizes() -> None:
    """DeepSeek-V3: 671B parameters, 37B activated per token (without the MTP module; its "37B"
    lies between our count without the input embedding, 36.6B, and with it, 37.6B). Moonlight:
    16B, 3B activated."""
    big = DEEPSEEK_V3_FLAVORS["671B"]
    assert abs(big.num_params() / 671e9 - 1) < 0.01
    assert big.active_params(include_embedding=False) < 37e9 < big.active_params()
    assert abs(big.active_params() / 37e9 - 1) < 0.02
    moonlight = DEEPSEEK_V3_FLAVORS["16B"]
    assert abs(moonlight.num_params() / 16e9 - 1) < 0.01
    assert abs(moonlight.active_params() / 3e9 - 1) < 0.05
    # 6 x the active non-embedding parameters plus the attention matmuls
    assert (
        big.flops_per_token(4096) == 6 * big.active_params(include_embedding=False) + 61 * 6 * 128 * (192 + 128) * 4096
    )


@pytest.mark.parametrize("changes, phrase", [
    ({"top_k": 9}, "top_k 9 must be between 1 and the number of experts 8"),
    ({"n_group": 3}, "n_group 3 must divide the number of experts 8"),
    ({"score_func": "relu"}, "score_func 'relu' is not one of"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim 7 must be even"),
    ({"rope_scaling": "linear"}, "rope_scaling 'linear' is not 'none' or 'yarn'"),
    ({"q_lora_rank": -1}, "q_lora_rank -1 must be 0 or more"),
])
def test_bad_shapes_are_one_line(changes: dict[str, Any], phrase: str) -> None:
    with pytest.raises(ValueError) as caught:
        dataclasses.replace(DEEPSEEK_V3_FLAVORS["tiny"], **changes)
    assert phrase in str(caught.value) and "\n" not in str(caught.value)
