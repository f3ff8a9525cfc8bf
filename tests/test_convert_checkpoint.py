"""``scripts/convert_checkpoint.py``: DCP step folders ↔ Hugging Face folders ↔ single files.

The conversions call the script's ``main`` in-process (importing torch once keeps the file fast);
one run is a real subprocess, as users run it, to check the process's exit code and its one line
on stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import io
import json
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file

from tests.dist_utils import REPO_ROOT, run_command
from torchtitan_lite.checkpoint import hf_storage
from torchtitan_lite.checkpoint.safe_reading import SafeFileSystemReader
from torchtitan_lite.models.llama3 import LLAMA3_FLAVORS, LLAMA3_SPEC, Transformer
from torchtitan_lite.models.llama3.hf import ADAPTER as llama_hf

SCRIPT = REPO_ROOT / "scripts" / "convert_checkpoint.py"
TINY = LLAMA3_FLAVORS["tiny"]


def _convert_process(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python scripts/convert_checkpoint.py ARGV`` as a real process."""
    return run_command([sys.executable, str(SCRIPT), *argv], timeout=120)


def _convert(*argv: str) -> subprocess.CompletedProcess[str]:
    """The same conversion through the script's ``main`` in this process: its exit code and
    what it wrote to stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _script().main(list(argv))
    return subprocess.CompletedProcess([str(SCRIPT), *argv], code, out.getvalue(), err.getvalue())


@functools.cache
def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("convert_checkpoint", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_error_line(result, *fragments: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """No process group here on purpose: silence DCP's note about it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _model_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Transformer(TINY)
    model.init_weights()
    return model.state_dict()


def _write_step_dir(folder: Path, state: dict[str, torch.Tensor], *, model_args: bool = True) -> Path:
    """A step folder as training writes it: model and optimizer state in DCP + train_state.json."""
    optimizer = {"state": {"tok_embeddings.weight": {"exp_avg": torch.ones(3)}}}
    with _quiet_dcp():
        dcp.save({"model": state, "optimizer": optimizer}, checkpoint_id=str(folder))
    train_state = {"step": 7, "dataloader": {}, "lr_scheduler": {}}
    if model_args:
        train_state["model_args"] = dataclasses.asdict(TINY)
    (folder / "train_state.json").write_text(json.dumps(train_state))
    return folder


def _read_step_dir(folder: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    loaded = {k: torch.empty_like(v, dtype=torch.float32) for k, v in like.items()}
    with _quiet_dcp():
        dcp.load({"model": loaded}, storage_reader=SafeFileSystemReader(str(folder)))
    return loaded


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    state = _model_state()
    root = tmp_path_factory.mktemp("convert")
    return _write_step_dir(root / "step-7", state), state


def test_dcp_to_hf_and_back(step_dir, tmp_path):
    source, state = step_dir
    result = _convert("to-hf", str(source), str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no .partial left behind
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    expected = hf_storage.state_dict_to_hf(state, LLAMA3_SPEC, TINY)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], expected[k]) for k in expected)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == llama_hf.config_for(TINY, torch.float32)

    result = _convert("from-hf", str(tmp_path / "hf"), str(tmp_path / "step-0"))
    assert result.returncode == 0, result.stderr
    train_state = json.loads((tmp_path / "step-0" / "train_state.json").read_text())
    assert train_state == {"step": 0, "model_only": True, "model_name": "llama3",
                           "model_args": dataclasses.asdict(TINY)}
    back = _read_step_dir(tmp_path / "step-0", state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_to_file_in_bfloat16_and_from_file(step_dir, tmp_path):
    source, state = step_dir
    for name in ("model.pt", "model.safetensors"):
        result = _convert("to-file", str(source), str(tmp_path / name), "--dtype", "bfloat16")
        assert result.returncode == 0, result.stderr
    from_pt = torch.load(tmp_path / "model.pt", weights_only=True)
    from_st = load_file(str(tmp_path / "model.safetensors"))
    for written in (from_pt, from_st):
        assert written.keys() == state.keys()
        assert all(v.dtype == torch.bfloat16 for v in written.values())
        assert all(torch.equal(written[k], state[k].to(torch.bfloat16)) for k in state)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as fh:
        assert json.loads(fh.metadata()["model_args"]) == dataclasses.asdict(TINY)

    # The safetensors file records the model's shape, so no --flavor is needed.
    result = _convert("from-file", str(tmp_path / "model.safetensors"), str(tmp_path / "step-0"))
    assert result.returncode == 0, result.stderr
    back = _read_step_dir(tmp_path / "step-0", state)
    assert all(torch.equal(back[k], state[k].to(torch.bfloat16).float()) for k in state)


@pytest.mark.slow
def test_refuses_to_overwrite_and_names_a_bad_input(step_dir, tmp_path):
    source, _ = step_dir
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep").write_text("x")
    # A real process: its exit code, and nothing on stderr but the one line.
    _one_error_line(_convert_process("to-hf", str(source), str(tmp_path / "hf")), str(tmp_path / "hf"),
                    "exists; pass --overwrite")
    assert (tmp_path / "hf" / "keep").exists()
    missing = tmp_path / "step-99"
    _one_error_line(_convert("to-hf", str(missing), str(tmp_path / "out")), str(missing),
                    "does not exist")
    assert not (tmp_path / "out").exists()


def test_more_errors_and_overwrite_in_process(step_dir, tmp_path, capsys):
    source, state = step_dir
    script = _script()

    def error(*argv: str) -> str:
        assert script.main(list(argv)) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        return lines[0]

    assert script.main(["to-hf", str(source), str(tmp_path / "hf")]) == 0
    assert script.main(["to-hf", str(source), str(tmp_path / "hf"), "--overwrite",
                        "--dtype", "float16"]) == 0
    assert load_file(str(tmp_path / "hf" / "model.safetensors"))["lm_head.weight"].dtype == torch.float16
    assert "--flavor debugmodel" in error("to-hf", str(source), str(tmp_path / "x"),
                                          "--flavor", "debugmodel")
    assert "must end in .pt or .safetensors" in error("to-file", str(source), str(tmp_path / "m.bin"))

    bare = _write_step_dir(tmp_path / "bare", state, model_args=False)  # no model_args recorded
    assert "pass --flavor" in error("to-hf", str(bare), str(tmp_path / "y"))
    assert script.main(["to-file", str(bare), str(tmp_path / "m.pt"), "--flavor", "tiny"]) == 0
    message = error("from-file", str(tmp_path / "m.pt"), str(tmp_path / "z"))
    assert "does not record the model's shape" in message
    message = error("from-file", str(tmp_path / "m.pt"), str(tmp_path / "z"), "--flavor", "tiny",
                    "--vocab_size", "300")
    assert "'tok_embeddings.weight' has shape [258, 64] but the model needs [300, 64]" in message
    assert script.main(["from-file", str(tmp_path / "m.pt"), str(tmp_path / "z"), "--flavor", "tiny"]) == 0
    capsys.readouterr()
    # The family comes from the input when it records one; --model may only agree with it.
    assert "is not a flavor of model 'llama3'; expected one of tiny" in error(
        "to-hf", str(bare), str(tmp_path / "y"), "--flavor", "huge")
    assert script.main(["to-file", str(source), str(tmp_path / "m.safetensors"), "--model", "llama3"]) == 0
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as fh:
        assert fh.metadata()["model_name"] == "llama3"
