"""Convert model weights between our DCP checkpoints, Hugging Face folders and single files.

    python scripts/convert_checkpoint.py to-hf     CHECKPOINT/step-N  OUT_DIR   [--dtype bfloat16]
    python scripts/convert_checkpoint.py to-file   CHECKPOINT/step-N  OUT.pt|OUT.safetensors [--dtype ...]
    python scripts/convert_checkpoint.py from-hf   HF_DIR             OUT_STEP_DIR
    python scripts/convert_checkpoint.py from-file FILE               OUT_STEP_DIR

Runs in one process, without a process group; the whole model is held in memory once.

A DCP step folder is what training writes (``step-N/`` with DCP files holding ``{"model": ...,
"optimizer": ...}`` and ``train_state.json``); only the model part is read. The model's shape
comes from ``train_state.json``'s ``model_args`` when present, otherwise from ``--flavor`` (and
``--vocab_size``); its family from ``train_state.json``'s ``model_name``, otherwise ``--model``
(default ``llama3``). A Hugging Face folder holds ``*.safetensors`` files and ``config.json``
(the family's Hugging Face names and row layout, e.g. ``LlamaForCausalLM``). Files written by
``to-file`` keep our parameter names; ``from-file`` also accepts a file with Hugging Face names.
A step folder written by ``from-hf``/``from-file`` holds the model only (``train_state.json``:
``{"step": 0, "model_only": true, "model_name": ..., "model_args": ...}``).

Nothing from the inputs runs: DCP metadata goes through the allow-list of
``torchtitan_lite.checkpoint.safe_reading``, ``.pt`` files are read with
``torch.load(weights_only=True)``. Outputs are written under ``<name>.partial`` and renamed when
complete; an existing output is replaced only with ``--overwrite``. Errors are one line on stderr
naming the path and the problem, with exit status 2; a DCP checkpoint whose metadata names
something a checkpoint never holds (code to run) exits 4, as training does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan_lite.checkpoint.hf_storage import (
    CONFIG_FILE,
    load_hf_weights,
    quiet_without_process_group,
    state_dict_from_hf,
    state_dict_to_hf,
)
from torchtitan_lite.checkpoint.manager import TRAIN_STATE_FILE
from torchtitan_lite.checkpoint.safe_reading import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    failure_reason,
)
from torchtitan_lite.config.schema import Model
from torchtitan_lite.distributed.fsdp import materialize
from torchtitan_lite.dtypes import DTYPES
from torchtitan_lite.errors import UserError
from torchtitan_lite.models import MODEL_SPECS, family_of
from torchtitan_lite.models.spec import HFAdapter, ModelSpec
from torchtitan_lite.progress import Progress, log_to_stderr

HF_WEIGHTS_FILE = "model.safetensors"
MODEL_ARGS_KEY = "model_args"
MODEL_NAME_KEY = "model_name"
DEFAULT_MODEL = Model().name  # the trainer's default model.name


class ConvertError(ValueError):
    """A user-facing conversion error: one line naming the path and the problem."""


# --------------------------------------------------------------------------------------------
# Model shape
# --------------------------------------------------------------------------------------------


def model_spec(name: str | None, source: str = "--model") -> ModelSpec:
    """The registered family ``name`` (default ``llama3``)."""
    name = DEFAULT_MODEL if name is None else name
    if name not in MODEL_SPECS:
        raise ConvertError(f"{source}: unknown model {name!r}; expected one of {', '.join(MODEL_SPECS)}")
    return MODEL_SPECS[name]


def hf_adapter(spec: ModelSpec) -> HFAdapter:
    if spec.hf is None:
        raise ConvertError(f"model {spec.name!r} has no Hugging Face import/export")
    return spec.hf


def model_args_from_dict(spec: ModelSpec, values: Mapping[str, Any], source: str) -> Any:
    """The family's args from a dict of their fields (unknown keys are ignored)."""
    if not isinstance(values, Mapping):
        raise ConvertError(f"{source}: {MODEL_ARGS_KEY} is not a JSON object")
    try:
        return spec.args_from_dict(values)
    except (TypeError, ValueError) as exc:
        raise ConvertError(f"{source}: {MODEL_ARGS_KEY} is not a valid model shape: {exc}") from None


def model_args_from_flavor(spec: ModelSpec, flavor: str | None, vocab_size: int | None, why: str) -> Any:
    """The args of ``--flavor`` (with ``--vocab_size``); ``why`` says, when no flavor was given,
    why one is needed."""
    if flavor is None:
        raise ConvertError(f"{why}; pass --flavor (one of {', '.join(spec.flavors)}) and --vocab_size")
    if flavor not in spec.flavors:
        raise ConvertError(f"--flavor: {flavor!r} is not a flavor of model {spec.name!r}; expected one "
                           f"of {', '.join(spec.flavors)}")
    return spec.model_args(flavor, vocab_size=vocab_size)


def expected_shapes(spec: ModelSpec, args: Any) -> dict[str, tuple[int, ...]]:
    """Our parameter name → shape for a model with ``args`` (built on the meta device)."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_state_dict(shapes: Mapping[str, tuple[int, ...]], spec: ModelSpec, args: Any, source: str) -> None:
    """The names and shapes found in ``source`` are exactly those of a model with ``args``."""
    expected = expected_shapes(spec, args)
    missing = [name for name in expected if name not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConvertError(f"{source}: tensor {missing[0]!r} is missing{more}")
    for name, shape in shapes.items():
        if name not in expected:
            raise ConvertError(f"{source}: tensor {name!r} is not a parameter of this model")
        if tuple(shape) != expected[name]:
            raise ConvertError(f"{source}: tensor {name!r} has shape {list(shape)} but the model "
                               f"needs {list(expected[name])}")


# --------------------------------------------------------------------------------------------
# DCP step folders
# --------------------------------------------------------------------------------------------


def read_step_dir(step_dir: Path, *, model: str | None, flavor: str | None, vocab_size: int | None
                  ) -> tuple[dict[str, torch.Tensor], ModelSpec, Any]:
    """The model part of a DCP step folder as plain tensors, the model's family and its shape."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    source = repr(str(step_dir))
    if not (step_dir / ".metadata").is_file():
        what = "does not exist" if not step_dir.exists() else "holds no DCP checkpoint (no .metadata)"
        raise ConvertError(f"{source}: {what}")
    state: dict[str, Any] = {}
    state_file = step_dir / TRAIN_STATE_FILE
    if state_file.is_file():
        try:
            loaded = json.loads(state_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConvertError(f"{str(state_file)!r}: cannot be read: {exc}") from None
        state = loaded if isinstance(loaded, dict) else {}
    recorded_model = state.get(MODEL_NAME_KEY)
    if recorded_model is not None and model is not None and recorded_model != model:
        raise ConvertError(f"{str(state_file)!r}: the checkpoint holds model {recorded_model!r}, "
                           f"not --model {model}")
    spec = model_spec(recorded_model or model,
                      "--model" if recorded_model is None else repr(str(state_file)))
    if state.get(MODEL_ARGS_KEY) is not None:
        args = model_args_from_dict(spec, state[MODEL_ARGS_KEY], repr(str(state_file)))
        if flavor is not None:
            flavor_args = model_args_from_flavor(spec, flavor, vocab_size, "")
            if expected_shapes(spec, flavor_args) != expected_shapes(spec, args):
                raise ConvertError(f"{str(state_file)!r}: {MODEL_ARGS_KEY} ({_shape_text(args)}) "
                                   f"disagree with --flavor {flavor}")
    else:
        args = model_args_from_flavor(spec, flavor, vocab_size,
                                      f"{str(state_file)!r} does not record {MODEL_ARGS_KEY}")
    try:
        metadata = SafeFileSystemReader(str(step_dir)).read_metadata()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # unpickling and I/O errors come in many types
        raise ConvertError(f"{source}: DCP metadata cannot be read: {failure_reason(exc)}") from None
    found: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            found[key.removeprefix("model.")] = (item.size, item.properties.dtype)
    if not found:
        raise ConvertError(f"{source}: the checkpoint holds no model weights")
    check_state_dict({name: tuple(size) for name, (size, _) in found.items()}, spec, args, source)
    state_dict = {name: torch.empty(size, dtype=dtype) for name, (size, dtype) in found.items()}
    try:
        with quiet_without_process_group():
            dcp.load({"model": state_dict}, storage_reader=SafeFileSystemReader(str(step_dir)),
                     planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as exc:  # DCP's exception is a BaseException
        raise ConvertError(f"{source}: cannot be read: {failure_reason(exc)}") from None
    return state_dict, spec, args


def _shape_text(args: Any) -> str:
    fields = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else {}
    return ", ".join(f"{k}={fields[k]}" for k in ("dim", "n_layers", "vocab_size") if k in fields)


def write_step_dir(state_dict: Mapping[str, torch.Tensor], spec: ModelSpec, args: Any, out: Path) -> None:
    """A model-only DCP step folder at ``out`` (written as ``out.partial``, then renamed)."""
    import torch.distributed.checkpoint as dcp

    partial = _partial(out)
    with quiet_without_process_group():
        dcp.save({"model": dict(state_dict)}, checkpoint_id=str(partial))
    state = {"step": 0, "model_only": True, MODEL_NAME_KEY: spec.name,
             MODEL_ARGS_KEY: dataclasses.asdict(args)}
    (partial / TRAIN_STATE_FILE).write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------


def _partial(out: Path) -> Path:
    partial = out.with_name(out.name + ".partial")
    if partial.is_dir():
        shutil.rmtree(partial)
    elif partial.exists():
        partial.unlink()
    return partial


def _check_output(out: Path, *, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise ConvertError(f"{str(out)!r}: exists; pass --overwrite to replace it")
    if out.parent.exists() and not out.parent.is_dir():
        raise ConvertError(f"{str(out.parent)!r}: exists and is not a folder")
    out.parent.mkdir(parents=True, exist_ok=True)


def _commit(out: Path) -> None:
    """Replace ``out`` by ``out.partial``."""
    partial = out.with_name(out.name + ".partial")
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    os.replace(partial, out)


def _cast(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return {k: (v if dtype is None else v.to(dtype)).contiguous() for k, v in state_dict.items()}


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def to_hf(step_dir: Path, out: Path, *, dtype: torch.dtype | None, model: str | None,
          flavor: str | None, vocab_size: int | None, overwrite: bool) -> None:
    from safetensors.torch import save_file

    _check_output(out, overwrite=overwrite)
    state_dict, spec, args = read_step_dir(step_dir, model=model, flavor=flavor, vocab_size=vocab_size)
    adapter = hf_adapter(spec)
    hf_state = _cast(state_dict_to_hf(state_dict, spec, args), dtype)
    partial = _partial(out)
    partial.mkdir()
    save_file(hf_state, str(partial / HF_WEIGHTS_FILE), metadata={"format": "pt"})
    config = adapter.config_for(args, next(iter(hf_state.values())).dtype)
    (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    _commit(out)


def to_file(step_dir: Path, out: Path, *, dtype: torch.dtype | None, model: str | None,
            flavor: str | None, vocab_size: int | None, overwrite: bool) -> None:
    from safetensors.torch import save_file

    if out.suffix not in (".pt", ".safetensors"):
        raise ConvertError(f"{str(out)!r}: the output file must end in .pt or .safetensors")
    _check_output(out, overwrite=overwrite)
    state_dict, spec, args = read_step_dir(step_dir, model=model, flavor=flavor, vocab_size=vocab_size)
    state_dict = _cast(state_dict, dtype)
    partial = _partial(out)
    if out.suffix == ".pt":
        torch.save(state_dict, partial)
    else:
        metadata = {"format": "pt", MODEL_NAME_KEY: spec.name,
                    MODEL_ARGS_KEY: json.dumps(dataclasses.asdict(args))}
        save_file(state_dict, str(partial), metadata=metadata)
    _commit(out)


def _is_hf_name(adapter: HFAdapter, name: str) -> bool:
    if adapter.ignored(name):
        return True
    try:
        adapter.from_hf_name(name)
    except ValueError:
        return False
    return True


def _model_hint(config: Mapping[str, Any], spec: ModelSpec) -> str:
    """`` (pass --model qwen3)`` when the config's model_type is another registered family's."""
    family = family_of(dict(config))
    return f" (pass --model {family})" if family not in (None, spec.name) else ""


def _read_config(config_file: Path) -> dict[str, Any]:
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConvertError(f"{str(config_file)!r}: cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise ConvertError(f"{str(config_file)!r}: is not a JSON object")
    return config


def from_hf(hf_dir: Path, out: Path, *, dtype: torch.dtype | None, model: str | None,
            flavor: str | None, vocab_size: int | None, overwrite: bool) -> None:
    _check_output(out, overwrite=overwrite)
    spec = model_spec(model)
    adapter = hf_adapter(spec)
    config_file = hf_dir / CONFIG_FILE
    if flavor is not None or not config_file.is_file():
        args = model_args_from_flavor(spec, flavor, vocab_size, f"{str(config_file)!r} does not exist")
    else:
        config = _read_config(config_file)
        try:
            args = adapter.args_from_config(config)
        except (ValueError, TypeError) as exc:
            raise ConvertError(f"{str(config_file)!r}: {exc}{_model_hint(config, spec)}") from None
    with torch.device("meta"):
        built = spec.model_cls(args)
    materialize(built, torch.device("cpu"))  # a tied output projection stays the embedding
    load_hf_weights(built, hf_dir, spec=spec)  # checks names, shapes and config.json first
    state_dict = _cast(built.state_dict(), dtype or torch.float32)
    write_step_dir(state_dict, spec, args, out)
    _commit(out)


def read_file(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors of a ``.pt`` or ``.safetensors`` file, and the safetensors metadata."""
    source = repr(str(file))
    if not file.is_file():
        raise ConvertError(f"{source}: does not exist" if not file.exists() else f"{source}: is not a file")
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt") as fh:
                metadata = fh.metadata() or {}
                return {k: fh.get_tensor(k) for k in fh.keys()}, metadata
        except Exception as exc:  # safetensors raises its own error types
            raise ConvertError(f"{source}: not a readable safetensors file: {failure_reason(exc)}") from None
    if file.suffix == ".pt":
        try:
            loaded = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # unpickling errors come in many types
            raise ConvertError(f"{source}: cannot be read with weights_only=True: "
                               f"{failure_reason(exc)}") from None
        if isinstance(loaded, dict) and isinstance(loaded.get("model"), dict):
            loaded = loaded["model"]
        if not isinstance(loaded, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
            raise ConvertError(f"{source}: expected a dict of parameter name → tensor")
        return dict(loaded), {}
    raise ConvertError(f"{source}: the input file must end in .pt or .safetensors")


def from_file(file: Path, out: Path, *, dtype: torch.dtype | None, model: str | None,
              flavor: str | None, vocab_size: int | None, overwrite: bool) -> None:
    _check_output(out, overwrite=overwrite)
    state_dict, metadata = read_file(file)
    source = repr(str(file))
    recorded_model = metadata.get(MODEL_NAME_KEY)
    if recorded_model is not None and model is not None and recorded_model != model:
        raise ConvertError(f"{source}: the file holds model {recorded_model!r}, not --model {model}")
    spec = model_spec(recorded_model or model, "--model" if recorded_model is None else source)
    hf_names = spec.hf is not None and any(_is_hf_name(spec.hf, name) for name in state_dict)
    config_file = file.parent / CONFIG_FILE
    if flavor is None and MODEL_ARGS_KEY in metadata:
        try:
            recorded = json.loads(metadata[MODEL_ARGS_KEY])
        except json.JSONDecodeError as exc:
            raise ConvertError(f"{source}: {MODEL_ARGS_KEY} metadata is not JSON: {exc}") from None
        args = model_args_from_dict(spec, recorded, source)
    elif hf_names and config_file.is_file():
        # Hugging Face names: the shape, RoPE and tying come from the config.json beside the file.
        config = _read_config(config_file)
        adapter = hf_adapter(spec)
        if flavor is not None:
            args = model_args_from_flavor(spec, flavor, vocab_size, "")
            problem = adapter.config_mismatch(config, args)
            if problem is not None:
                raise ConvertError(f"{str(config_file)!r}: {problem} (--flavor {flavor})")
        else:
            try:
                args = adapter.args_from_config(config)
            except (ValueError, TypeError) as exc:
                raise ConvertError(f"{str(config_file)!r}: {exc}{_model_hint(config, spec)}") from None
    elif hf_names and flavor is None:
        raise ConvertError(f"{source} holds Hugging Face names and there is no {CONFIG_FILE} beside it to say "
                           "the model's shape, RoPE and tying; put the checkpoint's config.json next to it, "
                           "or pass --flavor to state the shape")
    else:
        args = model_args_from_flavor(spec, flavor, vocab_size, f"{source} does not record the model's shape")
    if hf_names:
        try:
            state_dict = state_dict_from_hf(state_dict, spec, args)
        except ValueError as exc:
            raise ConvertError(f"{source}: {exc}") from None
    check_state_dict({k: tuple(v.shape) for k, v in state_dict.items()}, spec, args, source)
    write_step_dir(_cast(state_dict, dtype or torch.float32), spec, args, out)
    _commit(out)


COMMANDS = {"to-hf": to_hf, "to-file": to_file, "from-hf": from_hf, "from-file": from_file}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    helps = {
        "to-hf": ("DCP step folder → Hugging Face folder (safetensors + config.json)",
                  "DCP step folder (e.g. checkpoint/step-100)", "output folder"),
        "to-file": ("DCP step folder → one .pt or .safetensors file (our names)",
                    "DCP step folder", "output file ending in .pt or .safetensors"),
        "from-hf": ("Hugging Face folder → model-only DCP step folder",
                    "Hugging Face folder", "output step folder"),
        "from-file": ("one .pt or .safetensors file (our or Hugging Face names) → model-only "
                      "DCP step folder", "input file", "output step folder"),
    }
    for name, (text, source_help, out_help) in helps.items():
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument("source", help=source_help)
        sub.add_argument("output", help=out_help)
        sub.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                         help="dtype of the written weights (default: as stored for to-*, float32 "
                              "for from-*)")
        sub.add_argument("--model", choices=sorted(MODEL_SPECS), default=None,
                         help=f"model family, when the input does not record it (default: "
                              f"{DEFAULT_MODEL})")
        sub.add_argument("--flavor", default=None,
                         help="model flavor, when the input does not record the model's shape")
        sub.add_argument("--vocab_size", type=int, default=None,
                         help="vocabulary size with --flavor (default: the flavor's)")
        sub.add_argument("--overwrite", action="store_true", help="replace an existing output")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = COMMANDS[args.command]
    log_to_stderr()
    try:
        with Progress(f"{args.command}: {args.source} -> {args.output}"):
            command(Path(args.source), Path(args.output),
                    dtype=DTYPES[args.dtype] if args.dtype else None, model=args.model, flavor=args.flavor,
                    vocab_size=args.vocab_size, overwrite=args.overwrite)
    except (ConvertError, UserError, ValueError, OSError) as exc:
        print(f"error: {failure_reason(exc)}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, UnsafeCheckpointError) else 2
    finally:  # a failed conversion leaves nothing half-written behind
        output = Path(args.output)
        partial = output.with_name(output.name + ".partial")
        if partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        elif partial.exists():
            partial.unlink()
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
