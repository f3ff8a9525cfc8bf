"""Hugging Face Llama safetensors import/export (``torchtitan_lite.checkpoint.hf_storage``).

The RoPE permutation is proved against an independent Hugging Face style forward written here
(half-split ``rotate_half`` RoPE on Hugging Face names), and against ``transformers`` when it is
installed. Sharded loading and saving run on spawned gloo ranks (FSDP2 on a 1-D mesh, with a
shard boundary inside a head, and HSDP on a 2x2 mesh); the assertions are made in the parent.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.dist_utils import run_distributed
from torchtitan_lite.checkpoint import hf_storage
from torchtitan_lite.errors import CheckpointError
from torchtitan_lite.models.decoder_hf import permute_for_hf, unpermute_from_hf
from torchtitan_lite.models.llama3 import LLAMA3_FLAVORS, LLAMA3_SPEC, ModelArgs, Transformer
from torchtitan_lite.models.llama3.hf import ADAPTER as llama_hf

TINY = LLAMA3_FLAVORS["tiny"]
# Three heads of 16 rows: on two ranks the 24-row shard boundary of wq cuts through head 1,
# and wk's single kv head is split in two.
ODD = ModelArgs(dim=48, n_layers=2, n_heads=3, n_kv_heads=1, vocab_size=101, multiple_of=16,
                rope_theta=10000.0, max_seq_len=64)
# ~88M parameters (352 MB in fp32) for the memory measurement.
MEASURED = ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=8192,
                     multiple_of=256, rope_theta=10000.0, max_seq_len=64)


def _model(args: ModelArgs, seed: int = 0) -> Transformer:
    """A seeded model whose query/key weights are scaled up so that attention is sharp: with the
    default init the scores are near zero and a wrong RoPE layout would barely show."""
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attention.wq.weight.mul_(10)
            layer.attention.wk.weight.mul_(10)
    return model


def _tokens(args: ModelArgs) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(7))


def _logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)


def _write_hf(model: Transformer, folder: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A Hugging Face folder written with plain safetensors (no DCP) from ``model``."""
    folder.mkdir(parents=True, exist_ok=True)
    hf_sd = hf_storage.state_dict_to_hf(model.state_dict(), LLAMA3_SPEC, model.args)
    save_file({k: v.to(dtype).contiguous().clone() for k, v in hf_sd.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(llama_hf.config_for(model.args, dtype)))
    return folder


# --------------------------------------------------------------------------------------------
# Names and permutation
# --------------------------------------------------------------------------------------------


def test_name_map_round_trips_and_rejects_unknown_names():
    names = list(Transformer(TINY).state_dict())
    hf_names = [llama_hf.to_hf_name(n) for n in names]
    assert [llama_hf.from_hf_name(n) for n in hf_names] == names
    assert set(hf_names) == set(llama_hf.expected_shapes(TINY))
    assert llama_hf.to_hf_name("layers.1.feed_forward.w1.weight") == "model.layers.1.mlp.gate_proj.weight"
    assert llama_hf.to_hf_name("layers.0.feed_forward.w2.weight") == "model.layers.0.mlp.down_proj.weight"
    assert llama_hf.to_hf_name("layers.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert llama_hf.to_hf_name("output.weight") == "lm_head.weight"
    for bad in ("layers.0.attention.wz.weight", "freqs_cis", "model.tok_embeddings.weight"):
        with pytest.raises(ValueError, match="not a parameter name"):
            llama_hf.to_hf_name(bad)
    with pytest.raises(ValueError, match="not a Hugging Face Llama parameter name"):
        llama_hf.from_hf_name("model.layers.0.self_attn.rotary_emb.inv_freq")


def test_permutation_round_trips_and_moves_pairs_to_halves():
    head_dim, dim = 16, 64
    for n_heads in (4, 2, 1):  # wq with n_heads, wk with n_kv_heads (GQA)
        w = torch.randn(n_heads * head_dim, dim)
        permuted = permute_for_hf(w, n_heads)
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute_from_hf(permuted, n_heads), w)
        assert torch.equal(permute_for_hf(unpermute_from_hf(w, n_heads), n_heads), w)
        # Our row 2i+p of head h (pair i, component p) is HF row p*head_dim/2 + i of head h.
        for h, i, p in ((0, 0, 1), (n_heads - 1, 5, 0), (n_heads - 1, 7, 1)):
            assert torch.equal(permuted[h * head_dim + p * head_dim // 2 + i], w[h * head_dim + 2 * i + p])
    with pytest.raises(ValueError, match="heads of even size"):
        permute_for_hf(torch.randn(30, 8), 4)
    sd = _model(TINY).state_dict()
    back = hf_storage.state_dict_from_hf(hf_storage.state_dict_to_hf(sd, LLAMA3_SPEC, TINY), LLAMA3_SPEC, TINY)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


# --------------------------------------------------------------------------------------------
# Independent Hugging Face style reference
# --------------------------------------------------------------------------------------------


def _hf_reference_logits(sd: dict[str, torch.Tensor], config: dict[str, Any],
                         tokens: torch.Tensor) -> torch.Tensor:
    """LlamaForCausalLM's forward written from its definition: HF names, rotate_half RoPE."""
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    n_kv, eps = config["num_key_value_heads"], config["rms_norm_eps"]
    head_dim = dim // n_heads
    bs, seq = tokens.shape

    def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([-x[..., head_dim // 2:], x[..., : head_dim // 2]], dim=-1)

    inv_freq = 1.0 / config["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()  # (seq, head_dim), broadcast over heads

    def rope(x: torch.Tensor) -> torch.Tensor:  # x: (bs, heads, seq, head_dim)
        return x * cos + rotate_half(x) * sin

    causal = torch.full((seq, seq), float("-inf")).triu(1)
    h = sd["model.embed_tokens.weight"][tokens]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms_norm(h, sd[p + "input_layernorm.weight"])
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(bs, seq, n_heads, head_dim).transpose(1, 2)
        k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(bs, seq, n_kv, head_dim).transpose(1, 2)
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(bs, seq, n_kv, head_dim).transpose(1, 2)
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(n_heads // n_kv, dim=1)  # query head j uses kv head j // n_rep
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim) + causal
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(bs, seq, n_heads * head_dim)
        h = h + attn @ sd[p + "self_attn.o_proj.weight"].T
        x = rms_norm(h, sd[p + "post_attention_layernorm.weight"])
        gate, up = x @ sd[p + "mlp.gate_proj.weight"].T, x @ sd[p + "mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return rms_norm(h, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("args", [TINY, ODD], ids=["tiny", "odd-heads"])
def test_exported_weights_match_an_independent_hf_reference(tmp_path, args):
    model = _model(args)
    tokens = _tokens(args)
    folder = _write_hf(model, tmp_path / "hf")
    sd = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    ours = _logits(model, tokens)
    reference = _hf_reference_logits(sd, config, tokens)
    torch.testing.assert_close(reference, ours, rtol=0, atol=1e-5)
    # The permutation matters: without it the reference disagrees.
    raw = {llama_hf.to_hf_name(k): v for k, v in model.state_dict().items()}
    assert (_hf_reference_logits(raw, config, tokens) - ours).abs().max() > 1e-2
    # And importing the file gives back the same model.
    loaded = Transformer(args)
    hf_storage.load_hf_weights(loaded, folder, spec=LLAMA3_SPEC)
    assert torch.equal(_logits(loaded, tokens), ours)


def test_transformers_llama_loads_our_export(tmp_path):
    """Cross-check against ``transformers`` itself (skipped when it is not installed)."""
    transformers = pytest.importorskip("transformers")
    model = _model(TINY)
    tokens = _tokens(TINY)
    hf_storage.save_hf_weights(model, tmp_path / "hf", spec=LLAMA3_SPEC)  # single process: DCP writer + consolidation
    reference = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        theirs = reference(tokens).logits
    torch.testing.assert_close(theirs, _logits(model, tokens), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Single-process save/load details
# --------------------------------------------------------------------------------------------


def test_save_splits_files_and_loads_back_in_one_process(tmp_path):
    model = _model(TINY)
    tokens = _tokens(TINY)
    folder = tmp_path / "hf"
    hf_storage.save_hf_weights(model, folder, max_file_bytes=100_000, spec=LLAMA3_SPEC)
    files = sorted(p.name for p in folder.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and "sharded" not in files and "config.json" in files
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(llama_hf.expected_shapes(TINY))
    assert set(index["weight_map"].values()) == set(shards)
    loaded = Transformer(TINY)
    hf_storage.load_hf_weights(loaded, folder, spec=LLAMA3_SPEC)
    assert torch.equal(_logits(loaded, tokens), _logits(model, tokens))


def test_tied_embeddings_stay_one_parameter_and_stray_tensors_are_refused(tmp_path):
    import dataclasses

    tied_args = dataclasses.replace(TINY, tie_word_embeddings=True)
    model = _model(tied_args)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == tied_args.num_params()
    folder = tmp_path / "hf"
    hf_storage.save_hf_weights(model, folder, spec=LLAMA3_SPEC)
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]
    loaded = Transformer(tied_args)
    hf_storage.load_hf_weights(loaded, folder, spec=LLAMA3_SPEC)
    assert loaded.output.weight is loaded.tok_embeddings.weight
    assert torch.equal(_logits(loaded, _tokens(TINY)), _logits(model, _tokens(TINY)))
    # Files that repeat the tied weight as lm_head.weight, or carry RoPE's inv_freq, load too.
    plain = _write_hf(model, tmp_path / "plain")
    sd = load_file(str(plain / "model.safetensors"))
    assert "lm_head.weight" not in sd  # a tied model writes its output projection once
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(sd, str(plain / "model.safetensors"))
    again = Transformer(tied_args)
    hf_storage.load_hf_weights(again, plain, spec=LLAMA3_SPEC)
    assert torch.equal(_logits(again, _tokens(TINY)), _logits(model, _tokens(TINY)))
    # An untied model refuses the tied file (no silent untying), naming the field.
    with pytest.raises(CheckpointError, match=r"config.json has tie_word_embeddings=True but this model has "
                                              r"tie_word_embeddings=False$"):
        hf_storage.load_hf_weights(Transformer(TINY), folder, spec=LLAMA3_SPEC)
    # A tensor no parameter uses (here a q bias) is one clear error, not a log line.
    sd["model.layers.1.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(sd, str(plain / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.1.self_attn.q_proj.bias' belong to no "
                                              r"parameter of this model"):
        hf_storage.load_hf_weights(Transformer(tied_args), plain, spec=LLAMA3_SPEC)


# --------------------------------------------------------------------------------------------
# Sharded load and save on spawned ranks
# --------------------------------------------------------------------------------------------


def _sharded_model(args: ModelArgs, mesh: Any) -> Transformer:
    from torchtitan_lite.distributed.fsdp import apply_fsdp

    with torch.device("meta"):
        model = Transformer(args)
    apply_fsdp(model, mesh, **LLAMA3_SPEC.fsdp_units(model))
    model.to_empty(device="cpu")
    return model


def _placements(model: Transformer) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    return {name: (type(p).__name__, tuple(repr(x) for x in p.placements) if isinstance(p, DTensor) else None,
                   str(p.dtype)) for name, p in model.named_parameters()}


def _rank_sharded_io(cases: list[dict[str, Any]], replicate: int, shard: int) -> dict[str, Any]:
    """Per case: load the HF folder into a sharded model, run forward, save it back."""
    import torch.distributed as dist

    from torchtitan_lite.distributed import ParallelDims, build_mesh, init_distributed

    init_distributed(torch.device("cpu"))
    dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, world_size=dist.get_world_size())
    mesh = build_mesh(torch.device("cpu"), dims).fsdp
    out: dict[str, Any] = {}
    for case in cases:
        args = case["args"]
        model = _sharded_model(args, mesh)
        hf_storage.load_hf_weights(model, case["load"], spec=LLAMA3_SPEC)
        result: dict[str, Any] = {"placements": _placements(model)}
        if case.get("full_params"):
            result["params"] = {n: p.full_tensor() for n, p in model.named_parameters()}
        result["logits"] = _logits(model, _tokens(args))
        # Saved after a forward: the last unit and the root are left unsharded by it.
        for folder, dtype in case.get("save", []):
            hf_storage.save_hf_weights(model, folder, dtype=dtype, spec=LLAMA3_SPEC)
        out[case["name"]] = result
    return out


@pytest.fixture(scope="module")
def two_rank_io(tmp_path_factory) -> dict[str, Any]:
    """One 2-rank job: tiny and odd-head models loaded from fp32 files (and saved back, fp32
    and bf16), and tiny loaded from a bf16 file."""
    root = tmp_path_factory.mktemp("hf2")
    tiny, odd = _model(TINY), _model(ODD, seed=1)
    cases = [
        {"name": "tiny", "args": TINY, "load": str(_write_hf(tiny, root / "tiny")),
         "save": [(str(root / "saved"), None), (str(root / "saved_bf16"), torch.bfloat16)]},
        {"name": "odd", "args": ODD, "load": str(_write_hf(odd, root / "odd"))},
        {"name": "bf16", "args": TINY, "load": str(_write_hf(tiny, root / "bf16", torch.bfloat16)),
         "full_params": True},
    ]
    ranks = run_distributed(_rank_sharded_io, 2, cases, 1, 2)
    return {"ranks": ranks, "root": root, "models": {"tiny": tiny, "odd": odd}}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "odd"])
def test_two_rank_sharded_load_keeps_shards_and_matches_logits(two_rank_io, name):
    model = two_rank_io["models"][name]
    expected = _logits(model, _tokens(model.args))
    for rank in two_rank_io["ranks"]:
        result = rank[name]
        assert set(result["placements"]) == set(dict(model.named_parameters()))
        assert all(p == ("DTensor", ("Shard(dim=0)",), "torch.float32")
                   for p in result["placements"].values()), result["placements"]
        torch.testing.assert_close(result["logits"], expected, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_two_rank_save_writes_hf_files_that_load_in_one_process(two_rank_io):
    model = two_rank_io["models"]["tiny"]
    tokens = _tokens(TINY)
    folder = two_rank_io["root"] / "saved"
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    sd = load_file(str(folder / "model-00001-of-00001.safetensors"))
    assert {k: tuple(v.shape) for k, v in sd.items()} == llama_hf.expected_shapes(TINY)
    assert all(v.dtype == torch.float32 for v in sd.values())
    reference = hf_storage.state_dict_to_hf(model.state_dict(), LLAMA3_SPEC, TINY)
    assert all(torch.equal(sd[k], reference[k]) for k in reference)  # RoPE permutation included
    config = json.loads((folder / "config.json").read_text())
    assert config == llama_hf.config_for(TINY, torch.float32)
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"],
            config["rope_theta"], config["tie_word_embeddings"], config["torch_dtype"]) == (
        64, 2, 4, 2, TINY.ffn_hidden_dim, 258, 10000.0, False, "float32")
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    loaded = Transformer(TINY)
    hf_storage.load_hf_weights(loaded, folder, spec=LLAMA3_SPEC)
    torch.testing.assert_close(_logits(loaded, tokens), _logits(model, tokens), rtol=0, atol=1e-5)
    bf16_folder = two_rank_io["root"] / "saved_bf16"
    bf16 = load_file(str(next(bf16_folder.glob("*.safetensors"))))
    assert all(v.dtype == torch.bfloat16 for v in bf16.values())
    assert all(torch.equal(bf16[k], reference[k].to(torch.bfloat16)) for k in reference)
    assert json.loads((bf16_folder / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.slow
def test_bf16_file_fills_fp32_shards_with_upcast_values(two_rank_io):
    file = two_rank_io["root"] / "bf16" / "model.safetensors"
    expected = hf_storage.state_dict_from_hf(load_file(str(file)), LLAMA3_SPEC, TINY)
    for rank in two_rank_io["ranks"]:
        params = rank["bf16"]["params"]
        assert all(p[2] == "torch.float32" for p in rank["bf16"]["placements"].values())
        assert params.keys() == expected.keys()
        for name, value in params.items():
            assert value.dtype == torch.float32
            assert torch.equal(value, expected[name].float()), name


@pytest.mark.slow
def test_hsdp_2x2_load_and_save(tmp_path):
    model = _model(TINY)
    tokens = _tokens(TINY)
    cases = [{"name": "tiny", "args": TINY, "load": str(_write_hf(model, tmp_path / "in")),
              "save": [(str(tmp_path / "out"), None)]}]
    ranks = run_distributed(_rank_sharded_io, 4, cases, 2, 2)
    expected = _logits(model, tokens)
    for rank in ranks:
        assert all(p == ("DTensor", ("Replicate()", "Shard(dim=0)"), "torch.float32")
                   for p in rank["tiny"]["placements"].values())
        torch.testing.assert_close(rank["tiny"]["logits"], expected, rtol=0, atol=1e-5)
    loaded = Transformer(TINY)
    hf_storage.load_hf_weights(loaded, tmp_path / "out", spec=LLAMA3_SPEC)
    assert torch.equal(_logits(loaded, tokens), expected)


# --------------------------------------------------------------------------------------------
# Memory: no rank holds the whole model while loading
# --------------------------------------------------------------------------------------------


def _rank_load_measured(folder: str, kind: str) -> dict[str, int]:
    import gc

    import torch.distributed as dist

    from torchtitan_lite.checkpoint.manager import CheckpointManager
    from torchtitan_lite.config import Checkpoint
    from torchtitan_lite.distributed import ParallelDims, build_mesh, init_distributed
    from torchtitan_lite.memory.measure import process_memory, reset_peak_rss

    init_distributed(torch.device("cpu"))
    mesh = build_mesh(torch.device("cpu"), ParallelDims(dp_replicate=1, dp_shard=2, world_size=2)).fsdp
    model = _sharded_model(MEASURED, mesh)  # allocated (not yet touched) before measuring
    config = Checkpoint(initial_load_path=folder, initial_load_in_hf=kind == "hf")
    manager = CheckpointManager(config, dump_folder=folder, model=model, model_spec=LLAMA3_SPEC,
                                optimizer=None,
                                lr_scheduler=None, loader=None)
    gc.collect()
    dist.barrier()
    reset_peak_rss()  # the peak restarts from the current resident size
    before = process_memory()
    assert manager.load() == {}  # the trainer's initial_load_path: weights only
    after = process_memory()
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {"rss_before": before["rss"], "peak": after["peak_rss"], "shard_bytes": shard_bytes}


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("kind", ["hf", "dcp"])
def test_sharded_load_peak_memory_stays_near_one_shard(tmp_path, kind):
    """Loading pretrained weights (HF safetensors or a DCP checkpoint) into a 2-rank sharded
    model raises each rank's peak RSS by about its shard, not by the whole model."""
    full_bytes = MEASURED.num_params() * 4
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=generator)
               for name, shape in llama_hf.expected_shapes(MEASURED).items()}
    if kind == "hf":
        save_file(weights, str(tmp_path / "model.safetensors"))
    else:
        import torch.distributed.checkpoint as dcp

        ours = hf_storage.state_dict_from_hf(weights, LLAMA3_SPEC, MEASURED)
        dcp.save({"model": ours}, checkpoint_id=str(tmp_path), no_dist=True)
    del weights
    results = run_distributed(_rank_load_measured, 2, str(tmp_path), kind)
    for rank, result in enumerate(results):
        delta = result["peak"] - result["rss_before"]
        print(f"{kind} rank {rank}: peak RSS delta {delta / 2**20:.1f} MiB = {delta / full_bytes:.3f} x full "
              f"model ({full_bytes / 2**20:.1f} MiB); own shard {result['shard_bytes'] / 2**20:.1f} MiB")
        assert result["shard_bytes"] == full_bytes // 2
        assert delta < 0.65 * full_bytes, (rank, delta, full_bytes)  # one shard is 0.5


# --------------------------------------------------------------------------------------------
# Errors: one line, before reading any weight
# --------------------------------------------------------------------------------------------


def _load_error(model: Transformer, folder: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        hf_storage.load_hf_weights(model, folder, spec=LLAMA3_SPEC)
    message = str(info.value)
    assert "\n" not in message and str(folder) in message, message
    return message


def test_errors_name_the_folder_the_tensor_and_the_mismatch(tmp_path):
    folder = _write_hf(_model(TINY), tmp_path / "hf")
    with torch.device("meta"):  # errors come before any weight is read
        tiny, debug = Transformer(TINY), Transformer(LLAMA3_FLAVORS["debugmodel"])

    (tmp_path / "debug").mkdir()
    save_file(load_file(str(folder / "model.safetensors")), str(tmp_path / "debug" / "model.safetensors"))
    message = _load_error(debug, tmp_path / "debug")  # another flavor, no config.json
    assert "'model.embed_tokens.weight' has shape [258, 64]" in message and "[258, 256]" in message

    message = _load_error(debug, folder)  # with config.json: the first disagreeing field
    assert "hidden_size=64" in message and "hidden_size=256" in message

    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    message = _load_error(tiny, folder)
    assert "config.json has num_hidden_layers=3 but this model has num_hidden_layers=2" in message
    (folder / "config.json").write_text(json.dumps({**config, "rope_theta": 500000.0}))
    assert "rope_theta=500000.0" in _load_error(tiny, folder)
    (folder / "config.json").write_text(
        json.dumps({**config, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}))
    assert "rope_scaling of type 'llama3' lacks a usable field: 'low_freq_factor'" in _load_error(tiny, folder)
    complete = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
    (folder / "config.json").write_text(json.dumps({**config, "rope_scaling": complete}))
    assert "config.json has RoPE scaling 'llama3' but this model has rope_scaling='none'" in _load_error(tiny, folder)
    (folder / "config.json").write_text(json.dumps(config))

    sd = load_file(str(folder / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(folder / "model.safetensors"))
    message = _load_error(tiny, folder)
    assert "tensor 'model.layers.1.mlp.up_proj.weight' is missing" in message

    (tmp_path / "empty").mkdir()
    assert "holds no .safetensors files" in _load_error(tiny, tmp_path / "empty")
    assert "does not exist" in _load_error(tiny, tmp_path / "nowhere")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"\x00" * 4)
    assert "not a readable safetensors file" in _load_error(tiny, tmp_path / "broken")
    (tmp_path / "truncated").mkdir()
    data = (_write_hf(_model(TINY), tmp_path / "whole") / "model.safetensors").read_bytes()
    (tmp_path / "truncated" / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "(a truncated file)" in _load_error(tiny, tmp_path / "truncated")


def test_model_args_from_hf_config_reproduces_flavors():
    for name in ("tiny", "debugmodel", "1B", "8B"):
        args = LLAMA3_FLAVORS[name]
        assert llama_hf.args_from_config(llama_hf.config_for(args, torch.bfloat16)) == args, name
    # A shape that is no flavor: intermediate_size is still reproduced exactly.
    config = {**llama_hf.config_for(ODD, torch.float32), "intermediate_size": 100, "vocab_size": 77}
    rebuilt = llama_hf.args_from_config(config)
    assert (rebuilt.ffn_hidden_dim, rebuilt.vocab_size, rebuilt.dim, rebuilt.kv_heads) == (100, 77, 48, 1)


def test_an_export_keeps_the_tokenizer_folders_chat_template_file(tmp_path: Path) -> None:
    """A tokenizer folder saved by transformers 5 keeps its chat template in chat_template.jinja:
    the export copies it with tokenizer.json and tokenizer_config.json, and AutoTokenizer reads
    the template back from the export."""
    transformers = pytest.importorskip("transformers")
    from tests.tokenizer_folders import write_tokenizer_folder
    from torchtitan_lite.checkpoint.hf_storage import HFExportExtras, _write_extras

    source = write_tokenizer_folder(tmp_path / "src", "llama", "LlamaTokenizerFast")
    saved = tmp_path / "saved"
    transformers.AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(saved))
    assert (saved / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((saved / "tokenizer_config.json").read_text())
    export = tmp_path / "export"
    export.mkdir()
    _write_extras(export, {}, HFExportExtras(bos_id=1, eos_id=2, tokenizer_file=saved / "tokenizer.json"))
    read = transformers.AutoTokenizer.from_pretrained(str(export))
    assert read.chat_template == (saved / "chat_template.jinja").read_text()
