"""One process without FSDP (``distributed/autocast.py`` and the plan's ``shard``): the plain model
trains with bf16 through autocast over fp32 weights, and float8, activation checkpointing and
compile apply to it as they do on N ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed

STEPS = 4


def _run(argv: list[str], dump: str) -> dict[str, Any]:
    """Train ``STEPS`` steps of the tiny job; what the model is and what its linears computed in."""
    from torch.distributed.fsdp import FSDPModule

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.distributed.activation_checkpoint import checkpoint_policy_of
    from torchtitan_lite.distributed.compile import is_compiled
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config([*TINY_ARGS, "--training.steps", str(STEPS), "--training.global_batch_size", "4",
                                       *argv, "--job.dump_folder", dump]))
    try:
        linear_dtypes: set[torch.dtype] = set()
        wq = trainer.model.layers["0"].attention.wq
        if "--compile.enable" not in argv:  # a hook with side effects inside a block breaks fullgraph
            wq.register_forward_hook(lambda _m, _i, out: linear_dtypes.add(out.dtype))
        grad_dtypes: set[torch.dtype] = set()
        for param in trainer.model.parameters():
            param.register_post_accumulate_grad_hook(lambda p: grad_dtypes.add(p.grad.dtype))
        history = trainer.train()
        blocks = list(trainer.model.layers.values())
        return {
            "fsdp": isinstance(trainer.model, FSDPModule),
            "param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
            "grad_dtypes": sorted(str(d) for d in grad_dtypes),
            "linear_out_dtypes": sorted(str(d) for d in linear_dtypes),
            "losses": [h["loss"] for h in history],
            "float8_linears": sum(type(m).__name__ == "Float8Linear" for m in trainer.model.modules()),
            "compiled": [is_compiled(b) for b in blocks],
            "policies": [checkpoint_policy_of(b) for b in blocks],
        }
    finally:
        trainer.close()


def _close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b, strict=True))


def test_plan_shards_with_several_ranks_or_cpu_offload() -> None:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.distributed.fsdp import FSDPOptions
    from torchtitan_lite.job import plan_job

    bf16 = ["--training.mixed_precision_param", "bfloat16"]
    one = plan_job(load_job_config(bf16), world_size=1)
    assert not one.shard and one.fsdp_options() is None and one.autocast_dtype == torch.bfloat16
    fp32 = ["--training.mixed_precision_param", "float32"]
    assert plan_job(load_job_config(fp32), world_size=1).autocast_dtype is None  # nothing to cast
    offload = plan_job(load_job_config([*bf16, "--training.enable_cpu_offload"]), world_size=1)
    assert offload.shard and offload.autocast_dtype is None
    assert offload.fsdp_options() == FSDPOptions(reshard_after_forward_mode="default", param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32, cpu_offload=True)
    two = plan_job(load_job_config(bf16), world_size=2)
    assert two.shard and two.fsdp_options("never").reshard_after_forward_mode == "never"


@pytest.mark.slow
def test_one_process_bf16_is_autocast_over_fp32_weights(tmp_path: Path) -> None:
    """bf16 on one process: fp32 parameters and gradients, bf16 matmul outputs, and losses within
    bf16 rounding of FSDP2's bf16 on 2 ranks (same data, same initial weights)."""
    bf16 = ["--training.mixed_precision_param", "bfloat16"]
    (one,) = run_distributed(_run, 1, bf16, str(tmp_path / "one"))
    two = run_distributed(_run, 2, bf16, str(tmp_path / "two"))[0]
    assert not one["fsdp"] and two["fsdp"]
    assert one["param_dtypes"] == one["grad_dtypes"] == ["torch.float32"], one
    assert one["linear_out_dtypes"] == ["torch.bfloat16"], one
    assert _close(one["losses"], two["losses"], rtol=2e-2), (one["losses"], two["losses"])
    (fp32,) = run_distributed(_run, 1, [], str(tmp_path / "fp32"))
    assert fp32["linear_out_dtypes"] == ["torch.float32"]
    assert fp32["losses"] != one["losses"]  # bf16 really computed in bf16


@pytest.mark.scenario  # (compile on a fresh machine: 30 s of inductor; test_compile.py compiles with AC at 2 ranks)
@pytest.mark.slow
def test_one_process_checkpointing_and_compile_give_eager_losses(tmp_path: Path) -> None:
    """Activation checkpointing and compile on the plain model: the losses of eager without
    checkpointing (within compile's rounding)."""
    (eager,) = run_distributed(_run, 1, [], str(tmp_path / "eager"))
    (ac_compiled,) = run_distributed(_run, 1, ["--activation_checkpoint.mode", "full", "--compile.enable"],
                                     str(tmp_path / "ac_compiled"))
    assert not ac_compiled["fsdp"] and ac_compiled["compiled"] == [True, True]
    assert ac_compiled["policies"] == ["full", "full"]
    assert _close(ac_compiled["losses"], eager["losses"], rtol=1e-5), (ac_compiled["losses"], eager["losses"])


@pytest.mark.slow
def test_one_process_float8_converts_the_blocks_and_trains(tmp_path: Path) -> None:
    """float8 (emulated on CPU) converts the plain model's block linears and trains."""
    pytest.importorskip("torchao.float8")
    (eager,) = run_distributed(_run, 1, [], str(tmp_path / "eager"))
    (f8,) = run_distributed(_run, 1, ["--model.converters", "float8", "--float8.emulate"], str(tmp_path / "f8"))
    assert not f8["fsdp"] and f8["float8_linears"] > 0
    assert f8["losses"][-1] < f8["losses"][0] and f8["losses"] != eager["losses"]


def test_a_cpu_without_bf16_instructions_is_told_apart() -> None:
    """The start-up warning's test: x86's avx512_bf16 / amx_bf16 and Arm's bf16 feature count,
    AVX-512 alone does not; a cpuinfo without flags tells nothing (no warning)."""
    from torchtitan_lite.dtypes import cpu_has_bf16

    assert cpu_has_bf16("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 amx_tile\n")
    assert cpu_has_bf16("flags\t\t: fpu amx_bf16 amx_tile\n")
    assert cpu_has_bf16("Features\t: fp asimd bf16 i8mm\n")
    assert not cpu_has_bf16("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n")
    assert not cpu_has_bf16("Features\t: fp asimd evtstrm crc32\n")
    assert cpu_has_bf16("model name\t: something\n")
