"""The training engine (``torchtitan_lite/engine.py``): what an RL framework drives. Its weight
export gives the Hugging Face export's tensors; a step through ``train_batch`` is the trainer's
step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_utils import run_distributed


def _streamed_and_saved(argv: list[str], folder: str) -> dict[str, Any]:
    """Every tensor ``export_weights`` yields (rank 0), and the Hugging Face export's folder written."""
    import torch.distributed as dist

    from torchtitan_lite.checkpoint.hf_storage import save_hf_weights
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.engine import TrainingEngine

    engine = TrainingEngine(load_job_config(argv))
    try:
        streamed = {name: tensor.clone() for name, tensor in engine.export_weights()}
        save_hf_weights(engine.model, folder, spec=engine.trainer.plan.spec)
        return streamed if dist.get_rank() == 0 else {}
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "qwen3_moe"])
def test_export_weights_streams_the_hugging_face_exports_tensors(tmp_path: Path, family: str) -> None:
    """2 ranks (FSDP; Qwen3-MoE's stacked experts one tensor per expert, Llama's query and key rows
    in Hugging Face's order): every tensor ``export_weights`` yields equals the one the Hugging
    Face export writes under that name, and the names are the same."""
    from safetensors.torch import load_file

    argv = ["--model.name", family, "--model.flavor", "tiny", "--training.seq_len", "32",
            "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
            "--validation.no-enable", "--metrics.no-enable_tensorboard", "--job.dump_folder", str(tmp_path / "dump")]
    streamed = run_distributed(_streamed_and_saved, 2, argv, str(tmp_path / "hf"))[0]
    saved: dict[str, torch.Tensor] = {}
    for file in sorted((tmp_path / "hf").glob("*.safetensors")):
        saved.update(load_file(str(file)))
    assert len(saved) > 10 and sorted(streamed) == sorted(saved)
    if family == "qwen3_moe":
        assert any(".mlp.experts.3." in name for name in saved)
    for name, tensor in saved.items():
        assert torch.equal(streamed[name], tensor), name


@pytest.mark.scenario  # (two torchrun jobs end to end: left out of the default selection; .ci/run runs it)
@pytest.mark.slow
def test_the_engine_loop_of_the_rl_page_gives_the_built_in_losses(tmp_path: Path) -> None:
    """docs/rl.md's script, ``examples/grpo_on_the_engine.py`` (GRPO written on the engine:
    generate, rewards, advantages, ``train_batch``), under torchrun at 2 ranks on the toy task's
    job: its three steps' losses and gradient norms are those the built-in loop logs for the same
    job, within 1e-6."""
    import re
    import sys

    from tests.dist_utils import REPO_ROOT, free_port, read_jsonl, run_command, run_torchrun

    script = REPO_ROOT / "examples" / "grpo_on_the_engine.py"  # (the page shows it: tests/test_docs_examples.py)
    job = ["--job.config_file", "train_configs/grpo_toy.toml", "--training.steps", "3",
           "--training.global_batch_size", "32", "--training.local_batch_size", "16", "--metrics.log_freq", "1"]
    ours = run_command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--nnodes=1", str(script), *job,
                        "--job.dump_folder", str(tmp_path / "engine")], cwd=REPO_ROOT, timeout=600)
    assert ours.returncode == 0, ours.stderr[-3000:]
    printed = re.findall(r"^step (\d+) loss (\S+) grad_norm (\S+)$", ours.stdout, re.M)
    assert [int(step) for step, _, _ in printed] == [1, 2, 3], ours.stdout
    built_in = run_torchrun([*job, "--job.dump_folder", str(tmp_path / "built-in")], nproc=2, cwd=REPO_ROOT)
    assert built_in.returncode == 0, built_in.stderr[-3000:]
    logged = [r for r in read_jsonl(tmp_path / "built-in" / "metrics.jsonl") if "loss" in r]
    assert len(logged) == 3
    for (_, loss, norm), record in zip(printed, logged, strict=True):
        assert abs(float(loss) - record["loss"]) <= 1e-6 * max(1.0, abs(record["loss"])), (printed, logged)
        assert abs(float(norm) - record["grad_norm"]) <= 1e-6 * record["grad_norm"], (printed, logged)
    assert any(abs(float(loss)) > 1e-6 for _, loss, _ in printed)  # (a loss that says something)
