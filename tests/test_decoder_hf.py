"""Today's Hugging Face checkpoints against ``transformers`` itself: Llama with Llama 3.1's RoPE
scaling (and linear scaling), Llama 3.2-style tied embeddings, shapes that are no flavor, Qwen3
(q/k norms, its own head size; tied and untied).

Each folder is a tiny random model built and saved by ``transformers``; its logits are the
reference. Single-process imports here; the 2-rank import → train → export round trip runs on
spawned gloo ranks through the trainer (``model.flavor = "from_checkpoint"``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_utils import read_jsonl, run_distributed
from torchtitan_lite.checkpoint import hf_storage
from torchtitan_lite.errors import CheckpointError
from torchtitan_lite.models import get_model_spec
from torchtitan_lite.models.llama3 import LLAMA3_SPEC, Transformer

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
# Not a flavor: 3 layers, dim 96, 6 heads, 2 kv heads; vocabulary above the byte tokenizer's 258.
ODD_SHAPE = {"hidden_size": 96, "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
             "intermediate_size": 200, "vocab_size": 300}


def hf_llama(folder: Path, *, seed: int = 0, **config: Any) -> Path:
    """A random ``LlamaForCausalLM`` saved by ``transformers`` (safetensors + config.json), its
    query/key weights scaled up so that attention (and so RoPE) is sharp."""
    fields = {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 300, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False, **copy.deepcopy(config)}  # (transformers
    torch.manual_seed(seed)                                                          # edits the dicts)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    model.save_pretrained(str(folder))
    return folder


def hf_qwen3(folder: Path, *, seed: int = 0, **config: Any) -> Path:
    """A random ``Qwen3ForCausalLM`` (head_dim 32, not hidden / heads = 16) saved by
    ``transformers``, its query/key weights and q/k norms perturbed so that the norms' weight
    permutation matters."""
    fields = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 300, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True, **copy.deepcopy(config)}
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder))
    return folder


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def tokens_for(vocab: int, seq: int = 48) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(3))


def our_model(folder: Path, family: str = "llama3") -> torch.nn.Module:
    spec = get_model_spec(family)
    config = json.loads((folder / "config.json").read_text())
    model = spec.model_cls(spec.hf.args_from_config(config))
    hf_storage.load_hf_weights(model, folder, spec=spec)
    return model


CASES = {
    "llama3 rope scaling": {"rope_scaling": LLAMA3_ROPE},
    "linear rope scaling": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "tied (3.2 style)": {"tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE},
    "odd shape": ODD_SHAPE,
}


@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_transformers(tmp_path: Path, case: str) -> None:
    folder = hf_llama(tmp_path / "hf", **CASES[case])
    model = our_model(folder)
    tokens = tokens_for(model.args.vocab_size)
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(ours, hf_logits(folder, tokens), rtol=0, atol=1e-5)
    if "rope_scaling" in CASES[case]:
        # The scaling matters at these positions: the same weights unscaled give other logits.
        plain = Transformer(dataclasses.replace(model.args, rope_scaling="none"))
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (plain(tokens) - ours).abs().max() > 1e-3
    if CASES[case].get("tie_word_embeddings"):
        assert model.output.weight is model.tok_embeddings.weight


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_qwen_import_and_export_match_transformers(tmp_path: Path, family: str, tied: bool) -> None:
    build = hf_qwen3 if family == "qwen3" else hf_qwen2
    folder = build(tmp_path / "hf", tie_word_embeddings=tied)
    model = our_model(folder, family)
    assert model.args.head_dim == (32 if family == "qwen3" else 16)
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    tokens = tokens_for(300)
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(ours, hf_logits(folder, tokens), rtol=0, atol=1e-5)
    spec = get_model_spec(family)
    hf_storage.save_hf_weights(model, tmp_path / "out", spec=spec)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == family
    torch.testing.assert_close(hf_logits(tmp_path / "out", tokens), ours, rtol=0, atol=1e-5)
    # A Qwen folder is not a Llama one, and the other way round: one line each, naming the
    # family that reads it.
    with pytest.raises(CheckpointError, match=rf"model_type='{family}' but this model is 'llama' "
                                              rf"\(LlamaForCausalLM\) \(model.name = '{family}' reads it\)$"):
        hf_storage.load_hf_weights(Transformer(LLAMA3_SPEC.flavors["tiny"]), folder, spec=LLAMA3_SPEC)
    llama = hf_llama(tmp_path / "llama")
    with pytest.raises(ValueError, match=rf"model_type='llama' but this model is '{family}'"):
        spec.hf.args_from_config(json.loads((llama / "config.json").read_text()))


def test_export_of_scaled_and_tied_models_loads_in_transformers(tmp_path: Path) -> None:
    folder = hf_llama(tmp_path / "hf", tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE)
    model = our_model(folder)
    hf_storage.save_hf_weights(model, tmp_path / "out", spec=LLAMA3_SPEC)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["rope_parameters"]["rope_type"] == "llama3"
    tokens = tokens_for(300)
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(hf_logits(tmp_path / "out", tokens), ours, rtol=0, atol=1e-5)


def test_scaled_file_into_an_unscaled_model_is_one_line(tmp_path: Path) -> None:
    folder = hf_llama(tmp_path / "hf", rope_scaling=LLAMA3_ROPE)
    args = dataclasses.replace(LLAMA3_SPEC.hf.args_from_config(json.loads((folder / "config.json").read_text())),
                               rope_scaling="none")
    with pytest.raises(CheckpointError, match=r"config.json has RoPE scaling 'llama3' but this model has "
                                              r"rope_scaling='none'$"):
        hf_storage.load_hf_weights(Transformer(args), folder, spec=LLAMA3_SPEC)


def test_rope_settings_are_read_as_transformers_reads_them(tmp_path: Path) -> None:
    """``rope_parameters`` without a theta takes the top-level one; ``rope_scaling`` entries
    apply over ``rope_parameters`` (as in ``transformers``); two different thetas are refused."""
    config = json.loads((hf_llama(tmp_path / "hf") / "config.json").read_text())
    base = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    args = LLAMA3_SPEC.hf.args_from_config({**base, "rope_parameters": {"rope_type": "default"}, "rope_theta": 5e5})
    assert args.rope_theta == 5e5 and args.rope_scaling == "none"
    args = LLAMA3_SPEC.hf.args_from_config(
        {**base, "rope_parameters": {"rope_theta": 5e5}, "rope_scaling": LLAMA3_ROPE}
    )
    assert (args.rope_theta, args.rope_scaling, args.rope_original_max_seq_len) == (5e5, "llama3", 32)
    args = LLAMA3_SPEC.hf.args_from_config({**base, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5e5},
                                            "rope_scaling": {**LLAMA3_ROPE, "factor": 4.0}})
    assert args.rope_scaling_factor == 4.0
    with pytest.raises(ValueError, match=r"has rope_theta=10000.0 but rope_parameters.rope_theta=500000.0$"):
        LLAMA3_SPEC.hf.args_from_config({**base, "rope_parameters": {"rope_theta": 5e5}, "rope_theta": 1e4})
    qwen = json.loads((hf_qwen3(tmp_path / "qwen") / "config.json").read_text())
    yarn = {**qwen, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}
    with pytest.raises(ValueError,
                       match=r"rope_scaling.rope_type='yarn'; Qwen3ForCausalLM here supports only default RoPE$"):
        get_model_spec("qwen3").hf.args_from_config(yarn)


def test_tied_models_start_with_output_scaled_logits() -> None:
    """From scratch, a tied weight gets the output projection's init (std dim**-0.5), not the
    embedding's std 1 (which gives logits of std about sqrt(dim))."""
    for family in ("llama3", "qwen3"):
        spec = get_model_spec(family)
        args = dataclasses.replace(spec.flavors["tiny"], tie_word_embeddings=True, dim=256) if family == "llama3" \
            else dataclasses.replace(spec.flavors["tiny"], dim=256)
        torch.manual_seed(0)
        model = spec.model_cls(args)
        model.init_weights()
        assert model.output.weight is model.tok_embeddings.weight
        assert abs(float(model.output.weight.std()) * 16 - 1) < 0.1, family  # dim 256: std 1/16
        with torch.no_grad():
            logits = model(tokens_for(args.vocab_size, 32))
        assert logits.std() < 2.0, (family, float(logits.std()))


def test_unsupported_rope_type_and_family_are_one_line(tmp_path: Path) -> None:
    config = json.loads((hf_llama(tmp_path / "hf") / "config.json").read_text())
    yarn = {**config, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}
    with pytest.raises(ValueError, match=r"rope_type='yarn'; supported RoPE types: default, llama3, linear$"):
        LLAMA3_SPEC.hf.args_from_config(yarn)
    other = {**config, "model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    with pytest.raises(ValueError, match=r"config.json has model_type='mistral' but this model is 'llama' "
                                         r"\(LlamaForCausalLM\)$"):
        LLAMA3_SPEC.hf.args_from_config(other)


# --------------------------------------------------------------------------------------------
# 2 ranks: import at any shape, train 3 steps, export; transformers reads the export
# --------------------------------------------------------------------------------------------


def _train_from_hf(folder: str, dump: str, tokens: torch.Tensor, family: str) -> dict[str, Any]:
    """Import logits (sharded), the tied parameter's sharding, 3 trained steps, export; the
    trained model's logits on ``tokens``."""
    from torch.distributed.tensor import DTensor

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.distributed.fsdp import reshard_all
    from torchtitan_lite.trainer import Trainer

    config = load_job_config([
        "--model.name", family, "--model.flavor", "from_checkpoint", "--checkpoint.initial_load_path", folder,
        "--checkpoint.initial_load_in_hf", "--checkpoint.enable", "--checkpoint.interval", "100",
        "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf", "--training.steps", "3",
        "--training.seq_len", "32", "--training.local_batch_size", "2", "--job.dump_folder", dump,
        "--training.mixed_precision_param", "float32",
        "--metrics.log_freq", "1", "--metrics.no-enable_tensorboard", "--validation.no-enable"])
    trainer = Trainer(config)
    model = trainer.model
    out: dict[str, Any] = {"args": dataclasses.asdict(trainer.plan.model_args)}
    with torch.no_grad():
        out["imported"] = model(tokens)
    reshard_all(model)  # the last unit stays gathered after a forward in the default mode
    params = dict(model.named_parameters())
    out["param_names"] = sorted(params)
    out["tied"] = model.output.weight is model.tok_embeddings.weight
    out["tied_local_bytes"] = [p.to_local().numel() * p.element_size() for n, p in params.items()
                               if n == "tok_embeddings.weight" and isinstance(p, DTensor)]
    out["local_bytes"] = sum(p.to_local().numel() * p.element_size() for p in params.values())
    trainer.train()
    with torch.no_grad():
        out["trained"] = model(tokens)
    trainer.close()  # barrier, then the process group is destroyed
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("family", "tied"), [("llama3", True), ("llama3", False), ("qwen3", True),
                                              ("qwen3", False), ("qwen2", True)],
                         ids=["llama3-tied", "llama3-untied", "qwen3-tied", "qwen3-untied", "qwen2-tied"])
@pytest.mark.slow
def test_two_ranks_import_train_export_round_trip_with_transformers(tmp_path: Path, family: str, tied: bool) -> None:
    if family == "llama3":  # a shape no flavor has, with Llama 3.1 RoPE scaling
        folder = hf_llama(tmp_path / "hf", tie_word_embeddings=tied, rope_scaling=LLAMA3_ROPE, **ODD_SHAPE)
        dim = 96
    else:
        folder = (hf_qwen3 if family == "qwen3" else hf_qwen2)(tmp_path / "hf", tie_word_embeddings=tied)
        dim = 64
    spec = get_model_spec(family)
    tokens = tokens_for(300, 32)
    reference = hf_logits(folder, tokens)
    dump = tmp_path / "job"
    ranks = run_distributed(_train_from_hf, 2, str(folder), str(dump), tokens, family)
    r0 = ranks[0]
    # The shape came from config.json, tying (and RoPE scaling) included.
    if family == "llama3":
        assert (r0["args"]["dim"], r0["args"]["n_layers"], r0["args"]["n_heads"], r0["args"]["n_kv_heads"],
                r0["args"]["vocab_size"]) == (96, 3, 6, 2, 300)
        assert r0["args"]["rope_scaling"] == "llama3"
    elif family == "qwen3":
        assert (r0["args"]["dim"], r0["args"]["head_dim"], r0["args"]["vocab_size"]) == (64, 32, 300)
    else:
        assert (r0["args"]["dim"], r0["args"]["vocab_size"]) == (64, 300)
    assert r0["args"]["tie_word_embeddings"] == tied
    for rank in ranks:
        torch.testing.assert_close(rank["imported"], reference, rtol=0, atol=1e-5)
        # Tied: one parameter, output.weight is the embedding's, listed once, sharded once.
        assert rank["tied"] == tied and ("output.weight" not in rank["param_names"]) == tied
        assert rank["tied_local_bytes"] == [150 * dim * 4]  # the embedding: 300 rows over 2 ranks, fp32
    args = r0["args"]
    total = spec.args_from_dict(args).num_params() * 4
    assert sum(rank["local_bytes"] for rank in ranks) == total  # a tied weight counted once
    losses = [r["loss"] for r in read_jsonl(dump / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert not torch.allclose(r0["trained"], r0["imported"])
    export = dump / "checkpoint" / "step-3"
    config = json.loads((export / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert config["rope_parameters"]["rope_type"] == ("llama3" if family == "llama3" else "default")
    torch.testing.assert_close(hf_logits(export, tokens), r0["trained"], rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Former silent mismatches: each path either matches or says one line
# --------------------------------------------------------------------------------------------

QWEN2 = ("config.json has model_type='qwen2' but this model is 'llama' (LlamaForCausalLM) "
         "(model.name = 'qwen2' reads it)")


def hf_qwen2(folder: Path, **config: Any) -> Path:
    """A Qwen2 checkpoint (q/k/v biases): Llama's names plus three bias tensors per layer; the
    biases and query/key weights perturbed so that their row permutation matters."""
    fields = {"hidden_size": 64, "intermediate_size": 192, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 300, "max_position_embeddings": 256,
              "rope_theta": 10000.0, "tie_word_embeddings": False, **copy.deepcopy(config)}
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**fields)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(8)
                proj.bias.uniform_(-1.0, 1.0)
    model.save_pretrained(str(folder))
    return folder


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    from torchtitan_lite.train import main

    code = main(argv)
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _converter() -> Any:
    import importlib.util

    script = Path(__file__).resolve().parent.parent / "scripts" / "convert_checkpoint.py"
    spec = importlib.util.spec_from_file_location("convert_checkpoint_models", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_qwen2_into_llama_is_refused_by_the_trainer_the_api_and_the_converter(tmp_path: Path, capsys) -> None:
    """A Qwen2 checkpoint (which once trained silently as a Llama, its biases dropped) loaded as
    Llama: one line on every path, naming the family that reads it; the converter then reads
    it with --model qwen2."""
    folder = hf_qwen2(tmp_path / "qwen2")
    capsys.readouterr()  # transformers' progress bars
    job = ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf",
           "--job.dump_folder", str(tmp_path / "job"), "--training.steps", "1", "--training.seq_len", "64"]
    # Trainer, shape from the checkpoint: a checkpoint error before any process group.
    code, lines = _main([*job, "--model.flavor", "from_checkpoint"], capsys)
    assert code == 4 and len(lines) == 1 and lines[0].endswith(QWEN2), lines
    # Trainer, a named flavor: the checkpoint is checked against it before any process group.
    code, lines = _main([*job, "--model.flavor", "tiny"], capsys)
    assert code == 4 and len(lines) == 1 and lines[0].endswith(QWEN2), lines
    assert not (tmp_path / "job" / "metrics.jsonl").exists()
    # Python API.
    args = dataclasses.replace(LLAMA3_SPEC.flavors["tiny"], vocab_size=300)
    with pytest.raises(CheckpointError, match=r"config.json has model_type='qwen2'"):
        hf_storage.load_hf_weights(Transformer(args), folder, spec=LLAMA3_SPEC)
    # Converter.
    assert _converter().main(["from-hf", str(folder), str(tmp_path / "step-0")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].endswith(
        "config.json has model_type='qwen2' but this model is 'llama' (LlamaForCausalLM) (pass --model qwen2)"), lines
    assert not (tmp_path / "step-0").exists()
    assert _converter().main(["from-hf", str(folder), str(tmp_path / "step-0"), "--model", "qwen2"]) == 0
    state = json.loads((tmp_path / "step-0" / "train_state.json").read_text())
    assert state["model_name"] == "qwen2" and state["model_args"]["dim"] == 64


def _first_loss(argv: list[str]) -> float:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    history = trainer.train()
    trainer.close()
    return history[0]["loss"]


@pytest.mark.slow
def test_tied_folders_convert_and_train_as_loaded_from_hugging_face(tmp_path: Path) -> None:
    """``from-hf`` on a tied Llama-3.2-style folder (no ``lm_head.weight``, as transformers saves
    it) and on this project's own tied export: the converted step folder trains with the same
    first loss as ``initial_load_in_hf`` on the folder itself."""
    folder = hf_llama(tmp_path / "hf", tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        assert "lm_head.weight" not in fh.keys()
    converter = _converter()
    assert converter.main(["from-hf", str(folder), str(tmp_path / "step-0")]) == 0
    assert converter.main(["to-hf", str(tmp_path / "step-0"), str(tmp_path / "export")]) == 0  # ours, tied
    assert converter.main(["from-hf", str(tmp_path / "export"), str(tmp_path / "step-0b")]) == 0
    job = ["--model.flavor", "from_checkpoint", "--training.steps", "1", "--training.seq_len", "32",
           "--training.local_batch_size", "2", "--metrics.no-enable_tensorboard", "--validation.no-enable",
           "--training.mixed_precision_param", "float32", "--debug.deterministic"]
    runs = {
        "hf": [*job, "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf"],
        "converted": [*job, "--checkpoint.initial_load_path", str(tmp_path / "step-0")],
        "export converted": [*job, "--checkpoint.initial_load_path", str(tmp_path / "step-0b")],
    }
    losses = {name: run_distributed(_first_loss, 1, [*argv, "--job.dump_folder", str(tmp_path / name)])[0]
              for name, argv in runs.items()}
    assert losses["converted"] == losses["hf"] == losses["export converted"], losses


def test_a_flavor_of_another_shape_says_from_checkpoint_takes_the_shape(tmp_path: Path, capsys) -> None:
    """A Llama folder of another shape than the flavor the job names (as a job that forgot
    model.flavor = "from_checkpoint" has): one line naming the mismatch and the key that fixes it."""
    folder = hf_llama(tmp_path / "hf", **ODD_SHAPE)
    capsys.readouterr()
    code, lines = _main(["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf",
                         "--model.flavor", "debugmodel", "--job.dump_folder", str(tmp_path / "job"),
                         "--training.steps", "1", "--training.seq_len", "32"], capsys)
    assert code == 4 and len(lines) == 1, lines
    assert "config.json has hidden_size=96 but this model has hidden_size=256" in lines[0], lines
    assert lines[0].endswith("(model.flavor = 'debugmodel' sets the shape; model.flavor = 'from_checkpoint' takes "
                             "it from the checkpoint)"), lines


def test_from_file_reads_the_config_beside_it_or_refuses(tmp_path: Path, capsys) -> None:
    from safetensors.torch import load_file, save_file

    folder = hf_llama(tmp_path / "hf", rope_scaling=LLAMA3_ROPE)
    single = tmp_path / "single"
    single.mkdir()
    tensors = {k: v.clone() for k, v in load_file(str(folder / "model.safetensors")).items()}
    save_file(tensors, str(single / "weights.safetensors"))
    converter = _converter()
    capsys.readouterr()
    # No config.json beside the file, no --flavor: refused, nothing written.
    assert converter.main(["from-file", str(single / "weights.safetensors"), str(tmp_path / "a")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "no config.json beside it" in lines[0] and not (tmp_path / "a").exists()
    # With the config beside it: RoPE scaling kept, and the weights give transformers' logits.
    (single / "config.json").write_text((folder / "config.json").read_text())
    assert converter.main(["from-file", str(single / "weights.safetensors"), str(tmp_path / "b")]) == 0
    state = json.loads((tmp_path / "b" / "train_state.json").read_text())
    assert state["model_args"]["rope_scaling"] == "llama3" and state["model_args"]["rope_scaling_factor"] == 8.0
    assert converter.main(["to-hf", str(tmp_path / "b"), str(tmp_path / "back")]) == 0
    tokens = tokens_for(300)
    torch.testing.assert_close(hf_logits(tmp_path / "back", tokens), hf_logits(folder, tokens), rtol=0, atol=1e-5)
    # A --flavor that disagrees with the config beside the file is one line.
    capsys.readouterr()
    assert converter.main(["from-file", str(single / "weights.safetensors"), str(tmp_path / "c"),
                           "--flavor", "tiny", "--vocab_size", "300"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "(--flavor tiny)" in lines[0], lines


# --------------------------------------------------------------------------------------------
# A complete export: tokenizer, special tokens, generation config
# --------------------------------------------------------------------------------------------


def _train_and_export(argv: list[str]) -> None:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    trainer.train()
    trainer.close()


@pytest.mark.slow
def test_export_is_a_complete_folder_for_transformers(tmp_path: Path) -> None:
    from tests.data_helpers import DOCS, train_hf_tokenizer

    tok_path = train_hf_tokenizer(tmp_path / "tok")  # special tokens <s> and </s>, no tokenizer_config.json
    data = tmp_path / "corpus.txt"
    data.write_text("\n".join(DOCS) * 30)
    folder = hf_llama(tmp_path / "hf", tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE)
    dump = tmp_path / "job"
    run_distributed(_train_and_export, 1, [
        "--model.flavor", "from_checkpoint", "--model.tokenizer_path", str(tok_path),
        "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf",
        "--checkpoint.enable", "--checkpoint.interval", "100", "--checkpoint.last_save_model_only",
        "--checkpoint.last_save_in_hf", "--training.steps", "2", "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--training.dataset", "text", "--training.dataset_path", str(data),
        "--job.dump_folder", str(dump), "--metrics.no-enable_tensorboard", "--validation.no-enable"])
    export = dump / "checkpoint" / "step-2"
    files = {p.name for p in export.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tok_path))
    bos, eos = vocab.token_to_id("<s>"), vocab.token_to_id("</s>")
    config = json.loads((export / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (bos, eos)
    generation = json.loads((export / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (bos, eos)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    text = DOCS[0][:40]
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == vocab.encode(text).ids
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export)).eval()
    prompt = torch.tensor([[bos, *vocab.encode(text).ids]])
    out = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > prompt.shape[1] and torch.equal(out[:, :prompt.shape[1]], prompt)


def _train_steps(argv: list[str]) -> dict[str, Any]:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    start = trainer.step
    history = trainer.train()
    trainer.close()
    return {"start": start, "steps": len(history), "dim": trainer.plan.model_args.dim}


@pytest.mark.slow
def test_from_checkpoint_resumes_from_its_own_steps_and_plans_without_the_files(tmp_path: Path, capsys) -> None:
    """A resumed from_checkpoint job takes the shape from the step it resumes (the initial folder
    may be gone); the memory estimator plans such a job without reading the files."""
    folder = hf_llama(tmp_path / "hf", **ODD_SHAPE)
    job = ["--model.flavor", "from_checkpoint", "--checkpoint.initial_load_path", str(folder),
           "--checkpoint.initial_load_in_hf", "--checkpoint.enable", "--checkpoint.interval", "2",
           "--training.seq_len", "32", "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path / "job"),
           "--metrics.no-enable_tensorboard", "--validation.no-enable"]
    first = run_distributed(_train_steps, 1, [*job, "--training.steps", "2"])[0]
    assert (first["start"], first["steps"], first["dim"]) == (0, 2, 96)
    import shutil

    shutil.rmtree(folder)
    again = run_distributed(_train_steps, 1, [*job, "--training.steps", "3"])[0]
    assert (again["start"], again["steps"], again["dim"]) == (2, 1, 96)
    # Planning a named flavor never opens the Hugging Face folder (here: gone).
    from torchtitan_lite.memory.cli import main as estimate_main

    capsys.readouterr()
    assert estimate_main(["--model.flavor", "tiny", "--training.seq_len", "64", "--world_size", "2",
                          "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf"]) == 0
