"""LoRA fine-tuning: adapters on the tiny Llama over 2 gloo ranks against PEFT and
``transformers``, checkpoints that hold only the adapters and resume exactly, the PEFT and merged
exports, memory (estimated for Llama 3.1 8B on one GPU, measured on CPU), and bad settings.

The base model is built and saved by our own code with a seed the job does not use, so the
job's base weights come from ``checkpoint.initial_load_path`` (a Hugging Face folder), which
``transformers`` reads too."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY_ARGS
from tests.dist_utils import read_jsonl, run_distributed
from torchtitan_lite.checkpoint import hf_storage
from torchtitan_lite.models import get_model_spec

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 4, 8.0


def _lora_args(dump: Path, base: Path, *extra: str) -> list[str]:
    return [*TINY_ARGS, "--training.steps", "5", "--job.dump_folder", str(dump),
            "--lora.enable", "--lora.rank", str(RANK), "--lora.alpha", str(ALPHA),
            "--lora.target_modules", ",".join(TARGETS),
            "--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.last_save_model_only",
            "--checkpoint.last_save_in_hf", "--checkpoint.initial_load_path", str(base),
            "--checkpoint.initial_load_in_hf", "--metrics.no-enable_tensorboard", "--validation.no-enable", *extra]


def _full(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


def _train_lora(argv: list[str], tokens: torch.Tensor) -> dict[str, Any]:
    """Train with ``argv``; what the test compares: logits before and after, the frozen weights
    before and after, the adapters, which parameters train and which the optimizer holds."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.distributed.fsdp import reshard_all
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    model = trainer.model
    out: dict[str, Any] = {"start": trainer.step}
    with torch.no_grad():
        out["logits_before"] = model(tokens)
    reshard_all(model)
    params = dict(model.named_parameters())
    out["trainable"] = {n: p.numel() for n, p in params.items() if p.requires_grad}
    out["placements"] = {n: str(p.placements) for n, p in params.items() if "lora_" in n}
    frozen_before = {n: _full(p) for n, p in params.items() if not p.requires_grad}
    trainer.train()
    with torch.no_grad():
        out["logits_after"] = model(tokens)
    reshard_all(model)
    names = {id(p): n for n, p in params.items()}
    out["optimizer_state"] = sorted(names[id(p)] for p in trainer.optimizer.state)
    out["frozen_unchanged"] = all(torch.equal(_full(params[n]), before) for n, before in frozen_before.items())
    out["adapters"] = {n: _full(p) for n, p in params.items() if "lora_" in n}
    out["base"] = frozen_before
    trainer.close()
    return out


def _save_base(folder: Path) -> Path:
    """The tiny Llama's weights from seed 7 (the job's own init uses debug.seed) as a Hugging
    Face folder."""
    from torchtitan_lite.distributed.parallelize import build_sharded_model

    spec = get_model_spec("llama3")
    model = build_sharded_model(spec, spec.model_args("tiny"), None, device=torch.device("cpu"), seed=7, sharded=False)
    hf_storage.save_hf_weights(model, folder, spec=spec)
    return folder


def _hf_model(folder: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.mark.slow
def test_two_rank_lora_matches_peft_resumes_exactly_and_exports(tmp_path: Path) -> None:
    """LoRA on every linear of the tiny Llama, fp32, 2 ranks, 5 steps from a Hugging Face base:
    - the adapters are sharded with the frozen base, which is bit-unchanged by training; the
      optimizer holds state for the adapters only; as many trainable parameters as PEFT's;
    - the step-3 checkpoint holds the adapters and their optimizer state, no base weight;
    - the last save is a PEFT adapter folder: PEFT on ``transformers``' model of the base gives
      our logits within 1e-5;
    - a run resumed from step 3 (the base loaded again from initial_load_path) ends bit-identical
      and, with merge_on_export, writes base + (alpha/rank)·B·A as a Hugging Face folder."""
    peft = pytest.importorskip("peft")  # here, not at import: the ranks import this module
    spec = get_model_spec("llama3")
    base = _save_base(tmp_path / "base")
    tokens = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(3))
    first = run_distributed(_train_lora, 2, _lora_args(tmp_path / "a", base), tokens)
    r0 = first[0]
    hf_base = _hf_model(base)
    with torch.no_grad():
        base_logits = hf_base(tokens).logits
    # The base came from the folder (B = 0 at the start: the model is its base), and trained.
    torch.testing.assert_close(r0["logits_before"], base_logits, rtol=0, atol=1e-5)
    assert (r0["logits_after"] - r0["logits_before"]).abs().max() > 1e-3
    for rank in first:
        assert rank["frozen_unchanged"]
        assert set(rank["trainable"]) == set(rank["adapters"]) and all("lora_" in n for n in rank["trainable"])
        assert rank["optimizer_state"] == sorted(rank["trainable"])
        assert set(rank["placements"].values()) == {"(Shard(dim=0),)"}
    n_layers = spec.model_args("tiny").n_layers
    assert len(r0["trainable"]) == 2 * len(TARGETS) * n_layers
    peft_model = peft.get_peft_model(_hf_model(base), peft.LoraConfig(r=RANK, lora_alpha=ALPHA,
                                                                       target_modules=TARGETS))
    assert sum(r0["trainable"].values()) == peft_model.get_nb_trainable_parameters()[0]
    # The step-3 checkpoint: adapters and their optimizer state only.
    from torch.distributed.checkpoint import FileSystemReader

    keys = list(FileSystemReader(str(tmp_path / "a" / "checkpoint" / "step-3")).read_metadata().state_dict_metadata)
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert model_keys == set(r0["trainable"])
    optim_keys = [k for k in keys if k.startswith("optimizer.state.")]
    assert optim_keys and all(".lora_" in k for k in optim_keys)
    # The PEFT export, read by PEFT onto transformers' model of the base.
    export = tmp_path / "a" / "checkpoint" / "step-5"
    config = json.loads((export / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["task_type"], config["bias"]) == \
        ("LORA", RANK, ALPHA, "CAUSAL_LM", "none")
    assert sorted(config["target_modules"]) == sorted(TARGETS) and config["base_model_name_or_path"] == str(base)
    from safetensors import safe_open

    with safe_open(str(export / "adapter_model.safetensors"), framework="pt") as fh:
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in set(fh.keys())
        assert len(list(fh.keys())) == len(r0["trainable"])
    loaded = peft.PeftModel.from_pretrained(_hf_model(base), str(export)).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, r0["logits_after"], rtol=0, atol=1e-5)
    # Resume from step 3 in a new folder: bit-identical end; the last save merged.
    (tmp_path / "b" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoint" / "step-3", tmp_path / "b" / "checkpoint" / "step-3")
    second = run_distributed(_train_lora, 2, _lora_args(tmp_path / "b", base, "--lora.merge_on_export"), tokens)
    s0 = second[0]
    assert s0["start"] == 3
    assert torch.equal(s0["logits_after"], r0["logits_after"])
    losses = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl") if "loss" in r}
    assert resumed == {4: losses[4], 5: losses[5]}
    merged = tmp_path / "b" / "checkpoint" / "step-5"
    assert not (merged / "adapter_config.json").exists()
    ours = spec.model_cls(spec.model_args("tiny"))
    hf_storage.load_hf_weights(ours, merged, spec=spec)
    for name in (f"layers.{i}.{linear}" for i in range(n_layers) for linear in
                 ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                  "feed_forward.w2", "feed_forward.w3")):
        a, b = s0["adapters"][f"{name}.lora_A.weight"], s0["adapters"][f"{name}.lora_B.weight"]
        expected = s0["base"][f"{name}.weight"] + (ALPHA / RANK) * (b @ a)
        torch.testing.assert_close(ours.get_parameter(f"{name}.weight"), expected, rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(_hf_model(merged)(tokens).logits, s0["logits_after"], rtol=0, atol=1e-5)


def _train_features(argv: list[str]) -> dict[str, Any]:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    frozen = {n: _full(p) for n, p in trainer.model.named_parameters() if not p.requires_grad}
    history = trainer.train()
    unchanged = all(torch.equal(_full(p), frozen[n]) for n, p in trainer.model.named_parameters()
                    if not p.requires_grad)
    trainer.close()
    return {"losses": [h["loss"] for h in history], "norms": [h["grad_norm"] for h in history],
            "unchanged": unchanged}


def test_lora_with_bf16_checkpointing_offload_and_reshard_modes(tmp_path: Path) -> None:
    """bf16 mixed precision, selective activation checkpointing and adapter dropout on 2 ranks,
    resharding always with CPU offload and never without: the same finite losses (neither
    changes a value), frozen weights untouched."""
    results = {}
    for mode, offload in (("always", "--training.enable_cpu_offload"), ("never", "--training.no-enable_cpu_offload")):
        results[mode] = run_distributed(_train_features, 2, [
            *TINY_ARGS, "--training.steps", "2", "--job.dump_folder", str(tmp_path / mode), "--lora.enable",
            "--lora.dropout", "0.1", "--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode",
            "selective", offload, "--parallelism.reshard_after_forward_mode", mode,
            "--metrics.no-enable_tensorboard", "--validation.no-enable"])[0]
    for mode, result in results.items():
        assert result["unchanged"], mode
        assert all(0 < n < float("inf") for n in result["norms"]), mode
    assert results["always"]["losses"] == results["never"]["losses"]


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------


def _estimate_8b(root: str) -> dict[str, Any]:
    """Rank 0: the LoRA estimate; rank 1: the full fine-tune's (no process group: the estimator
    makes its fake one)."""
    import os

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.memory.cli import plan_without_files
    from torchtitan_lite.memory.estimate import estimate_memory, job_estimate_shape

    lora = os.environ["RANK"] == "0"
    argv = ["--job.config_file", str(Path(root) / "train_configs" / "llama3_8b.toml"), "--training.seq_len", "4096",
            "--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "selective"]
    if lora:
        argv += ["--lora.enable", "--lora.rank", "16"]
    config = load_job_config(argv)
    plan, _ = plan_without_files(config, world_size=1)
    estimate = estimate_memory(plan.spec, plan.model_args, reshard_after_forward_mode="default",
                               shape=job_estimate_shape(plan))
    return {"device_peak": estimate.device_peak, "state": estimate.state, "fits": estimate.fits(80 * 2**30),
            "params": plan.model_args.num_params()}


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_estimator_fits_8b_lora_on_one_80_gib_gpu_but_not_a_full_fine_tune(repo_root: Path) -> None:
    """Llama 3.1 8B, seq 4096, selective AC, bf16, one GPU: LoRA rank 16 fits 80 GiB, a full
    fine-tune does not; LoRA's state has gradients and optimizer state for the adapters only.
    (The two estimates run on the two kept ranks of a 2-process pool, side by side.)"""
    lora, full = run_distributed(_estimate_8b, 2, str(repo_root))
    gib = 2**30
    assert lora["fits"] and not full["fits"], (lora["device_peak"] / gib, full["device_peak"] / gib)
    n = full["params"]
    assert full["state"]["optimizer_state"] >= 2 * 4 * n and full["state"]["sharded_grads"] >= 4 * n
    # Adapters: 32 layers × rank 16 × (q, k, v, o: (4096 + 4096) + 2 × (4096 + 1024) + (4096 + 4096)).
    adapters = 32 * 16 * (2 * 8192 + 2 * 5120)
    assert lora["state"]["sharded_grads"] == 4 * adapters
    assert lora["state"]["optimizer_state"] < 8 * adapters + 2**20


def _measure() -> dict[str, Any]:
    """Measured step memory of a full fine-tune (rank 0) or of LoRA (rank 1) of the debug model:
    each rank trains it alone (FSDP2 on a mesh of one, its own process group), side by side."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_lite.config.schema import Optimizer
    from torchtitan_lite.distributed.lora import LoRASetup
    from torchtitan_lite.distributed.parallelize import build_sharded_model
    from torchtitan_lite.memory.measure import measure_step_memory
    from torchtitan_lite.optim import build_optimizer

    device = torch.device("cpu")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    spec = get_model_spec("llama3")
    args = spec.model_args("debugmodel")
    plan = None
    if os.environ["RANK"] == "1":
        with torch.device("meta"):
            meta = spec.model_cls(args)
        plan = LoRASetup.for_model(meta, rank=16, alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                  hf_name=spec.hf.to_hf_name)
    model = build_sharded_model(spec, args, init_device_mesh("cpu", (1,)), device=device, seed=0,
                                lora=plan)
    optimizer = build_optimizer(model, Optimizer(lr=1e-3))
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))

    def loss() -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    result = measure_step_memory(model, optimizer, loss)
    result["frozen"] = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return result


def test_measured_lora_peak_is_below_full_fine_tune_by_the_frozen_state() -> None:
    """On CPU, the debug model: LoRA's measured peak is below the full fine-tune's by at least
    the gradients and AdamW state (4 + 8 bytes per parameter) of the frozen weights."""
    full, lora = run_distributed(_measure, 2)
    assert full["frozen"] == 0 and lora["frozen"] > 0
    assert full["peak"]["total"] - lora["peak"]["total"] >= 12 * lora["frozen"], (full["peak"], lora["peak"])
    assert lora["state"]["optimizer_state"] < 0.05 * full["state"]["optimizer_state"]
    assert lora["state"]["sharded_params"] > full["state"]["sharded_params"]  # the adapters


# --------------------------------------------------------------------------------------------
# Bad settings: one line each, before any process group
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "line"), [
    (["--lora.rank", "0"], "error: lora.rank: invalid value 0; expected an integer >= 1"),
    (["--lora.alpha", "0"], "error: lora.alpha: invalid value 0.0; expected a finite number > 0"),
    (["--lora.alpha", "-2"], "error: lora.alpha: invalid value -2.0; expected a finite number > 0"),
    (["--lora.target_modules", "q_proj,w_proj"], "error: lora.target_modules: invalid value 'w_proj'; expected one "
                                                 "of 'q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', "
                                                 "'down_proj', 'experts'"),
    (["--model.name", "lora_test_own_names"], "error: lora.target_modules: invalid value ['q_proj', 'k_proj', "
                                              "'v_proj', 'o_proj']; 'q_proj', 'k_proj', 'v_proj', 'o_proj' name no "
                                              "linear of model 'lora_test_own_names' (its linears: wq, wk, wv, wo, "
                                              "w1, w2, w3, output)"),
], ids=["rank", "alpha-zero", "alpha-negative", "unknown-name", "unknown-for-model"])
def test_bad_lora_settings_are_one_line_before_any_process_group(tmp_path: Path, capsys, extra: list[str],
                                                                 line: str) -> None:
    import torch.distributed as dist

    from torchtitan_lite.models import MODEL_SPECS, register_model_spec
    from torchtitan_lite.train import main

    # A family without Hugging Face names: its linears go by their own names.
    register_model_spec(dataclasses.replace(get_model_spec("llama3"), name="lora_test_own_names", hf=None),
                        replace=True)
    try:
        code = main([*TINY_ARGS, "--job.dump_folder", str(tmp_path / "job"), "--lora.enable", *extra])
    finally:
        MODEL_SPECS.pop("lora_test_own_names")
    lines = [text for text in capsys.readouterr().err.splitlines() if text.strip()]
    assert (code, lines) == (2, [line])
    assert not dist.is_initialized() and not (tmp_path / "job").exists()


@pytest.mark.parametrize("family, targets", [("llama3", ["q_proj", "v_proj", "down_proj"]),
                                             ("qwen3_moe", ["q_proj", "o_proj", "experts"])])
def test_adapters_disabled_is_the_base_model_exactly(family: str, targets: list[str]) -> None:
    """DPO's reference under LoRA: inside ``adapters_disabled`` an adapted model (its adapters far
    from zero, on attention, MLP and stacked expert weights) gives its base's logits bit for bit;
    outside, its own again; the adapters get no gradient from what runs inside."""
    import copy

    from torchtitan_lite.distributed.lora import LoRASetup, adapters_disabled, init_lora_weights

    spec = get_model_spec(family)
    args = spec.model_args("tiny")
    torch.manual_seed(0)
    base = spec.model_cls(args)
    base.init_weights(buffer_device=torch.device("cpu"))
    model = copy.deepcopy(base)
    LoRASetup.for_model(model, rank=4, alpha=8, target_modules=targets, hf_name=spec.hf.to_hf_name).apply(model)
    init_lora_weights(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    tokens = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, adapted = base(tokens), model(tokens)
    assert not torch.allclose(adapted, expected, atol=1e-3)
    with adapters_disabled(model):
        reference = model(tokens)
    assert torch.equal(reference, expected)
    assert not reference.requires_grad  # only the frozen base weights took part: no path to an adapter
    with torch.no_grad():
        assert torch.equal(model(tokens), adapted)
