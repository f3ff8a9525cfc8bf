"""float8 training through torchao (``model.converters = ["float8"]``), on CPU in emulation.

Emulation (``float8.emulate``) rounds the matmuls' operands to float8 with the same scales as the
real path and multiplies them in high precision, so the conversion, the float8 all-gather of
FSDP, the scale precomputation and checkpoints are all exercised here; the float8 matmuls
themselves need a GPU (tests/test_gpu.py).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed
from tests.test_config_torchtitan import _write  # a job.toml of the given text
from torchtitan_lite import train
from torchtitan_lite.config import load_job_config
from torchtitan_lite.distributed.float8 import apply_float8, float8_unavailable
from torchtitan_lite.models import get_model_spec

pytest.importorskip("torchao.float8")

FLOAT8 = ["--model.converters", "float8", "--float8.emulate"]


def _meta_model() -> nn.Module:
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(spec.flavors["tiny"])
    return model


def test_only_the_blocks_linears_are_converted_and_filters_apply() -> None:
    model = _meta_model()
    blocks = list(model.layers.values())
    converted = apply_float8(model, blocks=blocks, emulate=True)
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert sorted(converted) == sorted(n for n in kinds if n.startswith("layers."))
    assert len(converted) == 2 * 7  # wq wk wv wo w1 w2 w3 in each of the 2 blocks
    assert kinds["output"] == "Linear" and all(kinds[n] == "Float8Linear" for n in converted)
    assert dict(model.named_parameters()).keys() == dict(_meta_model().named_parameters()).keys()

    assert apply_float8(model, blocks=blocks, emulate=True) == []  # converted layers stay as they are

    model = _meta_model()
    converted = apply_float8(model, blocks=list(model.layers.values()), filter_fqns=["attention.wq", "w2"],
                             emulate=True)
    assert len(converted) == 2 * 5 and not any("wq" in n or "w2" in n for n in converted)

    # TorchTitan's "auto_filter_small_kn": torchao's size rule keeps small linears in high precision.
    with torch.device("meta"):
        sized = nn.Sequential(_Sized(64), _Sized(8192))
    assert apply_float8(sized, blocks=list(sized), filter_fqns=["auto_filter_small_kn"], emulate=True) == ["1.proj"]


class _Sized(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 24)  # 24 is not a multiple of 16: float8 matmuls cannot take it
        self.down = nn.Linear(24, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.odd(self.up(x)))


def test_a_researchers_model_by_blocks_and_dimensions_not_multiple_of_16_stay() -> None:
    model = nn.Sequential(nn.Linear(32, 32), _Block(), _Block())
    assert apply_float8(model, blocks=[model[1], model[2]], emulate=True) == ["1.up", "2.up"]
    assert type(model[0]).__name__ == "Linear" and type(model[1].odd).__name__ == "Linear"
    out = model(torch.randn(4, 32))
    out.sum().backward()
    assert out.shape == (4, 32) and model[1].up.weight.grad is not None


def test_bad_combinations_and_devices_are_one_line() -> None:
    with pytest.raises(ValueError, match="expected unset or tensorwise with float8.enable_fsdp_float8_all_gather"):
        apply_float8(_meta_model(), blocks=[], recipe_name="rowwise", enable_fsdp_float8_all_gather=True)
    # tensorwise is the recipe the float8 all-gather uses: named or not, the same conversion.
    model = _meta_model()
    assert len(apply_float8(model, blocks=list(model.layers.values()), recipe_name="tensorwise",
                            enable_fsdp_float8_all_gather=True, emulate=True)) == 14
    with pytest.raises(ValueError, match="is itself a linear layer"):
        apply_float8(model, blocks=[model.output], emulate=True)
    line = float8_unavailable(torch.device("cpu"), emulate=False)
    assert line is not None and "compute capability 8.9" in line and "float8.emulate" in line
    assert float8_unavailable(torch.device("cpu"), emulate=True) is None


def test_torchtitans_quantize_tables_load_and_mx_is_refused(tmp_path: Path, capsys: Any) -> None:
    notes: list[str] = []
    config = load_job_config(["--job.config_file", _write(tmp_path, """
[model]
converters = ["quantize.linear.float8"]
[quantize.linear.float8]
enable_fsdp_float8_all_gather = true
precompute_float8_dynamic_scale_for_fsdp = true
filter_fqns = ["output"]
""")], notes=notes)
    f8 = config.float8
    assert f8.enable_fsdp_float8_all_gather and f8.precompute_float8_dynamic_scale_for_fsdp
    assert f8.filter_fqns == ["output"] and config.model.converters == ["quantize.linear.float8"]
    assert any(n.startswith("'quantize.linear.float8.filter_fqns' is TorchTitan's name") for n in notes), notes

    # Options without the converter change nothing, and say so.
    notes = []
    load_job_config(["--float8.emulate", "--float8.filter_fqns", "wq"], notes=notes)
    assert notes == ["float8.filter_fqns, float8.emulate have no effect: model.converters does not name float8"]

    # MX, and recipes that need tensorwise scales with the float8 all-gather: one line each.
    assert train.main(["--model.converters", "float8,mx"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: model.converters") and "MX (microscaling)" in line, line
    assert train.main([*FLOAT8, "--float8.recipe_name", "rowwise", "--float8.enable_fsdp_float8_all_gather"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: float8.recipe_name: invalid value 'rowwise'") and "tensorwise" in line, line
    config = load_job_config([*FLOAT8, "--float8.recipe_name", "tensorwise", "--float8.enable_fsdp_float8_all_gather"])
    assert config.float8.recipe_name == "tensorwise"


def test_without_float8_matmuls_the_job_stops_before_its_process_group(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def not_yet(*args: Any, **kwargs: Any) -> None:
        pytest.fail("the data was read before the device was checked")

    monkeypatch.setattr("torchtitan_lite.trainer.build_data", not_yet)
    assert train.main([*TINY_ARGS, "--model.converters", "float8", "--job.dump_folder", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: model.converters: invalid value ['float8']; float8 matmuls need a CUDA GPU"), line


class _AllGatherBytes(TorchDispatchMode):
    """Bytes this rank contributes to FSDP's all-gathers (``c10d::_allgather_base_`` inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d" and "allgather" in func._schema.name:
            self.bytes += args[1].numel() * args[1].element_size()
        return func(*args, **(kwargs or {}))


def _trainer(argv: list[str], dump: Path) -> Any:
    from torchtitan_lite.trainer import Trainer

    return Trainer(load_job_config([*TINY_ARGS, *argv, "--job.dump_folder", str(dump),
                                    "--metrics.no-enable_tensorboard"]))


_SAVED = [*FLOAT8, "--float8.enable_fsdp_float8_all_gather", "--float8.precompute_float8_dynamic_scale_for_fsdp",
          "--checkpoint.enable", "--checkpoint.interval", "3"]
_HF_LAST = ["--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf"]


def _first_half(dump: str) -> list[float]:
    trainer = _trainer([*_SAVED, "--training.steps", "3"], Path(dump) / "resumed")
    losses = [h["loss"] for h in trainer.train()]
    trainer.close()
    return losses


def _second_half_and_references(dump: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, argv in (("none", []), ("float8", [*FLOAT8]),
                        ("plain_resumed", ["--checkpoint.enable", "--checkpoint.interval", "3"]),
                        ("all_gather", [*FLOAT8, "--float8.enable_fsdp_float8_all_gather",
                                        "--float8.precompute_float8_dynamic_scale_for_fsdp"]),
                        ("resumed", [*_SAVED, *_HF_LAST])):
        trainer = _trainer([*argv, "--training.steps", "6"], Path(dump) / label)
        out[f"{label}_resumed_from"] = trainer.step
        weight = trainer.model.layers["0"].attention.wq.weight
        out[f"{label}_weight"] = f"{type(weight).__name__}({type(weight.to_local()).__name__})"
        counted = _AllGatherBytes()
        with counted:
            history = [trainer.train_step()]
        trainer.config.training.steps = 6
        history += trainer.train()
        out[label] = [h["loss"] for h in history]
        out[f"{label}_all_gather_bytes"] = counted.bytes
        if label == "resumed":  # the float8-wrapped weights as trained, for the Hugging Face export
            from torchtitan_lite.checkpoint.plain import plain_tensor

            out["trained_w1"] = plain_tensor(trainer.model.layers["0"].feed_forward.w1.weight).full_tensor()
        trainer.metrics.close()
        if trainer.checkpointer is not None:
            trainer.checkpointer.close()
    return out


@pytest.mark.slow
def test_float8_trains_all_gathers_in_float8_and_resumes_exactly_on_two_ranks(tmp_path: Path) -> None:
    (first, _) = run_distributed(_first_half, 2, str(tmp_path))
    # Its checkpoint names no torchao class (a job without torchao could not unpickle it), and a
    # job without float8 will resume its step 3 from a copy.
    saved = [f for f in (tmp_path / "resumed" / "checkpoint" / "step-3").iterdir() if f.is_file()]
    assert saved and not [f.name for f in saved if b"torchao" in f.read_bytes()]
    shutil.copytree(tmp_path / "resumed" / "checkpoint", tmp_path / "plain_resumed" / "checkpoint")
    (r, _) = run_distributed(_second_half_and_references, 2, str(tmp_path))
    assert r["resumed_resumed_from"] == 3 and r["none_resumed_from"] == 0
    assert r["none_weight"] == "DTensor(Tensor)" and r["float8_weight"] == "DTensor(Tensor)"
    assert r["all_gather_weight"] == "DTensor(WeightWithDynamicFloat8CastTensor)"
    # float8 changes the losses a little (operands rounded to 3 mantissa bits), not the training.
    for label in ("float8", "all_gather"):
        diffs = [abs(a - b) / b for a, b in zip(r[label], r["none"], strict=True)]
        assert all(math.isfinite(x) for x in r[label]) and 0 < max(diffs) < 0.02, (label, diffs)
    print({label: r[label] for label in ("none", "float8", "all_gather")},
          "all-gather bytes float8 / fp32:", r["all_gather_all_gather_bytes"] / r["none_all_gather_bytes"])
    # The float8 all-gather: the blocks' weights travel as 1 byte instead of 4 (the norms, the
    # embedding and the output stay fp32).
    assert r["float8_all_gather_bytes"] == r["none_all_gather_bytes"]
    assert r["all_gather_all_gather_bytes"] < 0.6 * r["none_all_gather_bytes"], r
    # Checkpointed at step 3 with float8 weights and resumed: the same run as without a stop.
    assert first == r["all_gather"][:3]
    assert r["resumed"] == r["all_gather"][3:]
    # Its checkpoints hold plain tensors: a job without float8 resumes them (and goes on in high precision).
    assert r["plain_resumed_resumed_from"] == 3 and r["plain_resumed_weight"] == "DTensor(Tensor)"
    assert r["plain_resumed"][0] == pytest.approx(r["all_gather"][3], rel=0.02)
    # Its last save, in Hugging Face's format, holds the weights as trained (float8 wrappers and all).
    from safetensors.torch import load_file

    exported = {}
    for file in (tmp_path / "resumed" / "checkpoint" / "step-6").glob("*.safetensors"):
        exported.update(load_file(file))
    assert torch.equal(exported["model.layers.0.mlp.gate_proj.weight"], r["trained_w1"])
