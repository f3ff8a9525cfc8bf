"""GPU paths: NCCL, CUDA memory metrics, CPU offload with a ``cuda:nccl,cpu:gloo`` group.

Skipped without CUDA. Runs as many ranks as there are GPUs (at most 2), one GPU each.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _world() -> int:
    return min(2, torch.cuda.device_count())


def _train_on_gpu(dump: str, offload: bool) -> dict:
    import torch.distributed as dist

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    # Not --debug.deterministic: some CUDA attention kernels have no deterministic backward.
    base = [a for a in TINY_ARGS if a != "--debug.deterministic"]
    argv = [*base, "--training.steps", "6", "--job.dump_folder", dump,
            "--training.mixed_precision_param", "bfloat16"]
    if offload:
        argv.append("--training.enable_cpu_offload")
    trainer = Trainer(load_job_config(argv))
    backend_config = str(dist.get_backend_config())
    params = list(trainer.model.parameters())
    param_devices = sorted({p.device.type for p in params})
    history = trainer.train()
    state_devices = sorted({
        v.device.type
        for s in trainer.optimizer.state.values() for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    })
    result = {
        "device": str(trainer.device),
        "backend_config": backend_config,
        "param_devices": param_devices,
        "state_devices": state_devices,
        "freqs_device": trainer.model.freqs_cis.device.type,
        "losses": [h["loss"] for h in history],
        "grad_norms": [h["grad_norm"] for h in history],
        "memory_max_active_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    trainer.close()
    return result


def test_trains_on_cuda_with_nccl(tmp_path: Path) -> None:
    (r0, *_) = run_distributed(_train_on_gpu, _world(), str(tmp_path), False, timeout=300)
    assert r0["device"].startswith("cuda")
    assert "nccl" in r0["backend_config"] and "gloo" not in r0["backend_config"]
    assert r0["param_devices"] == ["cuda"] and r0["state_devices"] == ["cuda"]
    assert all(math.isfinite(x) for x in r0["losses"])
    assert r0["memory_max_active_gib"] > 0


def test_cpu_offload_on_cuda(tmp_path: Path) -> None:
    (off, *_) = run_distributed(_train_on_gpu, _world(), str(tmp_path / "off"), True, timeout=300)
    (ref, *_) = run_distributed(_train_on_gpu, _world(), str(tmp_path / "ref"), False, timeout=300)
    assert "cuda:nccl" in off["backend_config"] and "cpu:gloo" in off["backend_config"]
    assert off["param_devices"] == ["cpu"] and off["state_devices"] == ["cpu"]
    assert off["freqs_device"] == "cuda"  # buffers live on the compute device
    assert all(math.isfinite(g) and g > 0 for g in off["grad_norms"])  # clipping ran on CPU grads
    # Same math, different devices for the optimizer step: equal up to bf16/GPU rounding.
    for a, b in zip(off["losses"], ref["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-3)


def _profile_on_gpu(dump: str) -> dict:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    base = [a for a in TINY_ARGS if a != "--debug.deterministic"]
    argv = [*base, "--training.steps", "4", "--job.dump_folder", dump, "--metrics.log_freq", "1",
            "--profiling.enable_profiling", "--profiling.enable_memory_snapshot",
            "--profiling.profile_freq", "2", "--profiling.profiler_warmup", "0"]
    trainer = Trainer(load_job_config(argv))
    try:
        history = trainer.train()
        return {"rank": trainer.rank, "peak": trainer.peak_tflops, "history": history}
    finally:
        trainer.close()


def test_cuda_metrics_traces_and_memory_snapshots(tmp_path: Path) -> None:
    """On a GPU: CUDA memory peaks and (for a known GPU) MFU in the records, a trace per rank
    with CUDA kernels, and allocator snapshots every profile_freq steps."""
    import json

    from tests.dist_utils import read_jsonl

    world = _world()
    results = run_distributed(_profile_on_gpu, world, str(tmp_path), timeout=300)
    for record in read_jsonl(tmp_path / "metrics.jsonl"):
        assert record["memory_max_active_gib"] > 0 and record["memory_max_reserved_gib"] > 0
        if results[0]["peak"] is not None:
            assert record["mfu_pct"] == pytest.approx(100 * record["tflops"] / results[0]["peak"])
    for step in (2, 4):
        for rank in range(world):
            trace = tmp_path / "profile_traces" / f"iteration_{step}" / f"rank{rank}_trace.json"
            events = json.loads(trace.read_text())["traceEvents"]
            assert any(e.get("cat") == "kernel" for e in events), trace
            snapshot = tmp_path / "memory_snapshot" / f"iteration_{step}" / f"rank{rank}_memory_snapshot.pickle"
            assert snapshot.stat().st_size > 0


def _float8_on_gpu(dump: str) -> dict:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    base = [a for a in TINY_ARGS if a != "--debug.deterministic"]
    out: dict = {}
    for label, extra in (("bf16", []), ("float8", ["--model.converters", "float8",
                                                   "--float8.enable_fsdp_float8_all_gather",
                                                   "--float8.precompute_float8_dynamic_scale_for_fsdp"])):
        argv = [*base, "--training.steps", "20", "--job.dump_folder", f"{dump}/{label}",
                "--training.mixed_precision_param", "bfloat16", "--metrics.no-enable_tensorboard", *extra]
        trainer = Trainer(load_job_config(argv))
        out[f"{label}_linears"] = sorted({type(m).__name__ for m in trainer.model.layers.modules()
                                          if isinstance(m, torch.nn.Linear)})
        out[label] = [h["loss"] for h in trainer.train()]
        trainer.metrics.close()
    return out


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="float8 matmuls need compute capability 8.9 or later")
def test_float8_trains_on_a_float8_gpu(tmp_path: Path) -> None:
    """Real float8 matmuls (torch._scaled_mm) and the float8 all-gather: the blocks' linears are
    converted and 20 steps follow bf16's losses."""
    pytest.importorskip("torchao.float8")
    (r, *_) = run_distributed(_float8_on_gpu, _world(), str(tmp_path), timeout=300)
    assert r["float8_linears"] == ["Float8Linear"] and r["bf16_linears"] == ["Linear"]
    assert all(math.isfinite(x) for x in r["float8"])
    assert r["float8"][-1] == pytest.approx(r["bf16"][-1], rel=0.03)
