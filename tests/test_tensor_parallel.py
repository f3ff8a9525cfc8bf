"""Tensor parallel with sequence parallel (``torchtitan_lite/distributed/tensor_parallel.py``)
through the trainer: 4 ranks as data parallel 2 × tensor parallel 2 train with one process's
losses, the parameters are DTensors placed as stated on both dimensions, checkpoints move
between (data-parallel, tensor-parallel) layouts, and bad degrees are one line before any
process group."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.dist_utils import refused_lines, run_distributed


def _argv(dump: Path, *extra: str) -> list[str]:
    return ["--training.seq_len", "32", "--training.global_batch_size", "4", "--training.steps", "10",
            "--training.no-shuffle", "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "2",
            "--job.dump_folder", str(dump), "--metrics.log_freq", "1", "--metrics.no-enable_tensorboard",
            "--validation.no-enable", *extra]


# Parameters whose placements the test reads: (data parallel, tensor parallel) on the 2-D mesh.
_PLACED = ("tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention.wo.weight",
           "layers.0.attention_norm.weight", "output.weight", "layers.0.attention.wq_b.weight",
           "layers.0.attention.wq_a.weight")


def _losses_and_placements(argv: list[str]) -> tuple[list[float], dict[str, Any]]:
    """Train; the losses, and for some parameters their mesh, placements and local shape."""
    from torch.distributed.tensor import DTensor

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    try:
        losses = [h["loss"] for h in trainer.train()]
        placed = {}
        params = dict(trainer.model.named_parameters())
        for name in (*_PLACED, "layers.0.moe.experts.w1", "layers.0.attention.q_norm.weight"):
            p = params.get(name)
            if isinstance(p, DTensor):
                placed[name] = (tuple(p.device_mesh.mesh_dim_names), tuple(str(x) for x in p.placements),
                                tuple(p.to_local().shape))
        return losses, placed
    finally:
        trainer.close()


# family, flavor, extra arguments
_MODELS = {
    "llama3-debugmodel": ["--model.name", "llama3", "--model.flavor", "debugmodel"],
    # head_dim 32 with dim 64 and 4 heads; per-head q/k norms; tied embeddings
    "qwen3-tiny": ["--model.name", "qwen3", "--model.flavor", "tiny"],
    # attention split, the MoE layers whole on every rank
    "qwen3_moe-tiny": ["--model.name", "qwen3_moe", "--model.flavor", "tiny"],
    # latent attention: the heads' up-projections split, the down-projections whole on every rank
    "deepseek_v3-tiny": ["--model.name", "deepseek_v3", "--model.flavor", "tiny"],
    # float8 linears (emulated: tensorwise scales of the whole weight, float8-rounded operands)
    "llama3-tiny-float8": ["--model.name", "llama3", "--model.flavor", "tiny", "--model.converters", "float8",
                           "--float8.emulate"],
}


@pytest.mark.slow
@pytest.mark.parametrize("model", [  # (the debug model's shapes in the scenario tier; llama3 tiny with float8 here)
    pytest.param(name, marks=pytest.mark.scenario) if name == "llama3-debugmodel" else name for name in _MODELS])
def test_tensor_parallel_2_by_data_parallel_2_equals_one_process(tmp_path: Path, model: str) -> None:
    """fp32, 10 steps (clipped at norm 1): 4 ranks as data parallel 2 × tensor parallel 2 (loss
    parallel: the logits split over the vocabulary) give one process's losses within 1e-5 (the
    debug Llama, Qwen3 with head_dim ≠ dim / heads, Qwen3-MoE, DeepSeek-V3's latent attention), with
    every projection split over ``tp`` and FSDP-sharded over ``dp_shard``: column-wise ``wq``
    rows split by both (FSDP's shard strided inside the tensor-parallel one), row-wise ``wo``
    by columns over ``tp``, norms replicated over ``tp``; a mixture of experts' stacked weights,
    and a latent attention's down-projections, sharded over the data-parallel ranks only. With float8 linears
    (emulated) within 1e-3:
    float8's rounding of the split matmuls' partial sums."""
    steps = 4 if "float8" in model else 10  # (float8's check: 4 steps, for the suite's time)
    extra = [*_MODELS[model], "--training.global_batch_size", "2", "--training.steps", str(steps)]
    ((reference, _),) = run_distributed(_losses_and_placements, 1,
                                        _argv(tmp_path / "one", "--training.local_batch_size", "2", *extra))
    ranks = run_distributed(_losses_and_placements, 4, _argv(tmp_path / "tp2", "--training.local_batch_size", "1",
                                                             "--parallelism.tensor_parallel_degree", "2", *extra))
    tolerance = 1e-3 if "float8" in model else 1e-5  # (float8 rounding turns summation-order differences into steps)
    for losses, _ in ranks:
        assert len(losses) == steps
        for a, b in zip(losses, reference, strict=True):
            assert abs(a - b) <= tolerance * abs(b), (losses, reference)
    placed = ranks[0][1]
    mesh = ("dp_shard", "tp")
    column = (mesh, ("_S(0, 2)", "S(0)"))  # rows: tensor parallel first, FSDP within each part
    if model == "deepseek_v3-tiny":
        assert placed["layers.0.attention.wq_b.weight"][:2] == column, placed
        assert placed["layers.0.attention.wq_a.weight"][:2] == (("dp_shard",), ("S(0)",)), placed
    else:
        assert placed["layers.0.attention.wq.weight"][:2] == column, placed
    assert placed["layers.0.attention.wo.weight"][:2] == (mesh, ("S(0)", "S(1)")), placed
    assert placed["layers.0.attention_norm.weight"][:2] == (mesh, ("S(0)", "R")), placed
    assert placed["tok_embeddings.weight"][:2] == column, placed  # rows: the vocabulary
    dim = {"llama3-debugmodel": 256}.get(model, 64)
    if "float8" in model:
        assert placed["layers.0.attention.wq.weight"][2] == (16, 64), placed  # 64 rows: 32 per tp rank, 16 per shard
    assert placed["tok_embeddings.weight"][2] == (65, dim), placed  # rank 0: 65 of the 129 rows of its half of 258
    if model == "qwen3-tiny":  # tied: the output projection is the embedding, once
        assert "output.weight" not in placed or placed["output.weight"] == placed["tok_embeddings.weight"]
        assert placed["layers.0.attention.q_norm.weight"][:2] == (mesh, ("S(0)", "R")), placed
    else:
        assert placed["output.weight"][:2] == column, placed
    if model == "qwen3_moe-tiny":
        assert placed["layers.0.moe.experts.w1"] == (("dp_shard",), ("S(0)",), (4, 32, 64)), placed


@pytest.mark.slow
def test_a_checkpoint_moves_between_tensor_parallel_2_and_data_parallel_2(tmp_path: Path) -> None:
    """fp32, the tiny Llama: a job at data parallel 2 × tensor parallel 2 (4 ranks) saves at
    step 3 of 5 and is resumed from that step at data parallel 2 alone (2 ranks); a job at data
    parallel 2 saves at step 3 and is resumed at data parallel 2 × tensor parallel 2. Steps 4-5
    repeat the uninterrupted losses within 1e-5 (DCP reshards the DTensors)."""
    common = ["--model.name", "llama3", "--model.flavor", "tiny", "--training.steps", "5",
              "--checkpoint.enable", "--checkpoint.interval", "3", "--training.local_batch_size", "2"]
    tp2, dp2 = ["--parallelism.tensor_parallel_degree", "2"], []
    for (first, first_world), (then, then_world) in (((tp2, 4), (dp2, 2)), ((dp2, 2), (tp2, 4))):
        label = f"{first_world}-{then_world}"
        whole = run_distributed(_losses_and_placements, first_world,
                                _argv(tmp_path / label / "whole", *common, *first))[0][0]
        resumed_dump = tmp_path / label / "resumed"
        shutil.copytree(tmp_path / label / "whole" / "checkpoint" / "step-3", resumed_dump / "checkpoint" / "step-3")
        resumed = run_distributed(_losses_and_placements, then_world, _argv(resumed_dump, *common, *then))[0][0]
        assert len(resumed) == 2
        for a, b in zip(resumed, whole[3:], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (label, resumed, whole)


def _train_lora_and_logits(argv: list[str], tokens: Any) -> dict[str, Any]:
    """Train (the last save a PEFT export); the logits on ``tokens`` after training and the
    adapters' placements on the 2-D mesh."""
    from torch.distributed.tensor import DTensor

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    try:
        trainer.train()
        placed = {n: tuple(str(x) for x in p.placements) for n, p in trainer.model.named_parameters()
                  if "lora_" in n and n.startswith("layers.0.") and isinstance(p, DTensor)}
        import torch

        with torch.no_grad():
            logits = trainer.model(tokens)
        return {"logits": logits.full_tensor() if isinstance(logits, DTensor) else logits, "placed": placed}
    finally:
        trainer.close()


@pytest.mark.slow
def test_lora_at_tensor_parallel_2_exports_what_peft_loads(tmp_path: Path) -> None:
    """LoRA on every linear of the tiny Llama from a Hugging Face base, 4 ranks as data parallel
    2 × tensor parallel 2, fp32, 2 steps: each adapter follows its base linear's split (column-wise:
    ``B`` split with the weight's rows, ``A`` replicated; row-wise: ``A`` split with the weight's
    columns, ``B`` replicated) and the PEFT export, read by PEFT onto transformers' model of the
    base, gives the trained model's logits within 1e-5."""
    peft = pytest.importorskip("peft")
    import torch

    from tests.test_lora import ALPHA, RANK, TARGETS, _hf_model, _save_base

    base = _save_base(tmp_path / "base")
    tokens = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(3))
    argv = [
        "--model.name",
        "llama3",
        "--model.flavor",
        "tiny",
        "--training.seq_len",
        "32",
        "--training.steps",
        "2",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "4",
        "--training.mixed_precision_param",
        "float32",
        "--optimizer.lr",
        "3e-3",
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--lora.enable",
        "--lora.rank",
        str(RANK),
        "--lora.alpha",
        str(ALPHA),
        "--lora.target_modules",
        ",".join(TARGETS),
        "--checkpoint.enable",
        "--checkpoint.last_save_model_only",
        "--checkpoint.last_save_in_hf",
        "--checkpoint.initial_load_path",
        str(base),
        "--checkpoint.initial_load_in_hf",
        "--metrics.no-enable_tensorboard",
        "--validation.no-enable",
        "--parallelism.tensor_parallel_degree",
        "2",
    ]
    ranks = run_distributed(_train_lora_and_logits, 4, argv, tokens)
    placed = ranks[0]["placed"]
    assert placed["layers.0.attention.wq.lora_A.weight"] == ("S(0)", "R"), placed
    assert placed["layers.0.attention.wq.lora_B.weight"] == ("_S(0, 2)", "S(0)"), placed
    assert placed["layers.0.attention.wo.lora_A.weight"] == ("S(0)", "S(1)"), placed
    assert placed["layers.0.attention.wo.lora_B.weight"] == ("S(0)", "R"), placed
    loaded = peft.PeftModel.from_pretrained(_hf_model(base), str(tmp_path / "run" / "checkpoint" / "step-2")).eval()
    with torch.no_grad():
        theirs, untrained = loaded(tokens).logits, _hf_model(base)(tokens).logits
    torch.testing.assert_close(theirs, ranks[0]["logits"], rtol=0, atol=1e-5)
    assert (theirs - untrained).abs().max() > 1e-3  # the adapters trained


@pytest.mark.parametrize(("argv", "line"), [
    (["--parallelism.tensor_parallel_degree", "3"],
     "error: parallelism.tensor_parallel_degree: invalid value 3; it must divide the model's 16 attention heads "
     "(n_heads); expected a degree that does"),
    (["--parallelism.tensor_parallel_degree", "4", "--model.flavor", "tiny"],
     "error: parallelism.tensor_parallel_degree: invalid value 4; it must divide the model's 2 key-value heads; "
     "expected a degree that does"),
    (["--parallelism.tensor_parallel_degree", "3", "--model.flavor", "tiny", "--model.name", "qwen3"],
     "error: parallelism.tensor_parallel_degree: invalid value 3; it must divide the model's 4 attention heads "
     "(n_heads); expected a degree that does"),
    (["--parallelism.tensor_parallel_degree", "2", "--model.converters", "float8", "--float8.recipe_name", "rowwise"],
     "error: parallelism.tensor_parallel_degree: invalid value 2; tensor parallel is not combined with float8's "
     "'rowwise' recipe (float8.recipe_name; torchao's tensor-parallel styles take tensorwise scales) yet; expected 1 "
     "with it"),
    (["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "63"],
     "error: training.seq_len: invalid value 63; tensor parallel 2 splits each sequence over its ranks between the "
     "blocks (sequence parallel): expected a multiple of 2"),
    (["--parallelism.enable_async_tensor_parallel"],
     "error: parallelism.enable_async_tensor_parallel: invalid value True; it overlaps tensor-parallel collectives: "
     "expected false without tensor parallel"),
    (["--parallelism.enable_async_tensor_parallel", "--parallelism.tensor_parallel_degree", "2", "--compile.enable"],
     "error: parallelism.enable_async_tensor_parallel: invalid value True; asynchronous tensor parallel runs on CUDA "
     "(symmetric memory between the GPUs of a node) and this machine has none; expected false"),
])
def test_bad_tensor_parallel_settings_are_one_line_before_any_process_group(
        argv: list[str], line: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A degree that does not divide the heads or the key-value heads (each named), float8's
    rowwise recipe with tensor parallel, async TP without TP or without CUDA: exit 2, one
    line (a job of 12 ranks, which every degree here divides)."""
    monkeypatch.setenv("WORLD_SIZE", "12")
    lines = refused_lines(["--job.config_file", "train_configs/debug_model.toml", *argv, "--training.steps", "1",
                           "--validation.no-enable"], capsys)
    assert lines == [line], lines
