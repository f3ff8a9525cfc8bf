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
