"""``python -m torchtitan_lite.memory``: estimated memory per rank of a training job, before it runs.

    python -m torchtitan_lite.memory --job.config_file train_configs/llama3_8b.toml \\
        --world_size 64 --device_memory_gib 80 [--section.key value ...]

prints, for every reshard mode (default, never, always, and the configured integer one or auto),
the memory of one rank by category, its peak and where in the step it falls, and whether it fits
the device; ``--json PATH`` writes every figure. The job is planned exactly as the trainer plans
it (:func:`torchtitan_lite.job.plan_job`) for the given world and device type (``--device_type``:
CUDA by default, whatever this machine has; ``cpu`` for a job of CPU processes, whose kernels save
other tensors), with every config check of the trainer's but those that need files
(:func:`plan_without_files`): the datasets, the tokenizer and the job's folders need not be on
this machine (without the tokenizer, the flavor's own vocabulary is used, and a line says so);
``model.flavor = "from_checkpoint"`` reads its shape from the checkpoint, which must be.

Every mistake on the command line is one line (an unknown option of this command's with the one
it most likely meant, a bad value with what is allowed), all of them at once, before any estimate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchtitan_lite.config import load_job_config
from torchtitan_lite.config.cli import closest_name as _closest  # (the config's own "did you mean")
from torchtitan_lite.config.schema import SECTIONS, JobConfig, field_types
from torchtitan_lite.distributed.activation_checkpoint import describe as describe_ac
from torchtitan_lite.distributed.fsdp import RESHARD_MODES, ReshardMode
from torchtitan_lite.distributed.pipeline_parallel import PipelinePlan
from torchtitan_lite.errors import ConfigError, UserError
from torchtitan_lite.job import JobPlan
from torchtitan_lite.memory.estimate import (
    GIB,
    MemoryEstimate,
    estimate_memory,
    estimate_stages,
    job_estimate_shape,
    not_modelled,
    size_text,
    where_text,
)
from torchtitan_lite.memory.job_plans import DEVICE_TEXT, DEVICE_TYPES, UsageError, data_not_here, plan_without_files
from torchtitan_lite.memory.longest import host_bytes, print_longest
from torchtitan_lite.progress import Progress, log_to_stderr

if TYPE_CHECKING:
    from torchtitan_lite.memory.auto import AutoReshardPlan

__all__ = ["DEVICE_TYPES", "build_parser", "main", "plan_without_files"]

_OFFLOAD_TEXT = {False: "off", True: "on (every unit)", "auto": "auto (per unit)"}  # by JobShape.cpu_offload
_DEVICE_NOTE = {
    "cuda": "planned for CUDA devices (--device_type cuda): the tensors CUDA's kernels keep (its fused RMSNorm, its "
            "attention); for a job of CPU processes, --device_type cpu",
    "cpu": "planned for CPU processes (--device_type cpu): the tensors the CPU kernels keep (the composite RMSNorm's "
           "fp32 copies, attention's CPU kernel) and gloo's all-gather buffers",
}

_DESCRIPTION = """\
Estimated memory per rank of a training job, by category, for every reshard mode (default,
never, always, and the configured integer one or auto), with the job's mixed precision, CPU
offload, batch, sequence length, optimizer and gradient accumulation. Nothing is allocated: the
step runs on fake tensors over a fake process group of N ranks, so N and the model need not fit
here. Every other option is a trainer option (--section.key value; see python -m
torchtitan_lite.train --help)."""

_COLUMNS = (
    ("sharded_params", "sh.param"), ("unsharded_params", "unsh.par"), ("sharded_grads", "sh.grad"),
    ("unsharded_grads", "unsh.grd"), ("optimizer_state", "optim"), ("activations", "activ"),
    ("temporaries", "temp"), ("all_gather_buffers", "all-gath"), ("reduce_scatter_buffers", "red-scat"),
    ("buffers", "buffers"), ("inputs", "inputs"),
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError("expected an integer >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value > 0):
        raise ValueError("expected a number > 0")
    return value


def _device_type(text: str) -> str:
    if text not in DEVICE_TYPES:
        raise ValueError(f"expected one of {', '.join(DEVICE_TYPES)} (where the job will run)")
    return text


@dataclasses.dataclass(frozen=True)
class _Option:
    """One of the command's own options: ``convert`` reads its value (raising ``ValueError`` with
    what is allowed); None: a switch, which takes no value."""

    convert: Callable[[str], Any] | None
    metavar: str
    help: str


_OPTIONS: dict[str, _Option] = {
    "--world_size": _Option(_positive_int, "N", "ranks of the job (required)"),
    "--ranks_per_node": _Option(_positive_int, "M", "ranks per node, for data_parallel_replicate_degree = 0 (one "
                                "replica per node); default: $LOCAL_WORLD_SIZE, else all N on one node"),
    "--device_type": _Option(_device_type, "TYPE", f"where the job will run, one of {', '.join(DEVICE_TYPES)} "
                             "(default cuda, whatever this machine has): the estimate holds what that device's "
                             "kernels hold (CUDA's fused RMSNorm and attention; a CPU job's composite norm and "
                             "gloo's all-gather buffers)"),
    "--device_memory_gib": _Option(_positive_float, "G", "memory of one device in GiB, to say whether each mode "
                                   "fits; default: this machine's first CUDA device for a CUDA job, else no verdict"),
    "--host_memory_gib": _Option(_positive_float, "H", "host memory of one node in GiB, to say whether what the "
                                 "job keeps there (CPU offload, activation offload) fits; default: this machine's "
                                 "RAM when it has a CUDA device, else no verdict"),
    "--json": _Option(str, "PATH", "also write every figure as JSON"),
    "--longest_seq_len": _Option(None, "", "instead of the table: search the longest training.seq_len whose "
                                 "configured mode fits the budget (parallelism.memory_budget_gib, else 90%% of the "
                                 "device), from 1,024 tokens up or down to the shortest the job allows, in steps "
                                 "that context and tensor parallel split, printing each estimate as it goes"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2 through main()
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's own options (for ``--help``; :func:`main` reads them with :func:`_own_options`);
    every other ``--section.key`` goes to the job config."""
    parser = _Parser(prog="python -m torchtitan_lite.memory", description=_DESCRIPTION,
                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    for name, option in _OPTIONS.items():
        if option.convert is None:
            parser.add_argument(name, action="store_true", help=option.help)
        else:
            parser.add_argument(name, default=None, metavar=option.metavar, help=option.help)
    return parser


def _unknown_option(name: str) -> tuple[str, str | None]:
    """The line for an unknown option ``--name`` of this command's (not a ``--section.key``), and
    the option it most likely meant: one of the command's own within a few edits (the config's
    "did you mean"), else the one job setting of that name."""
    close = _closest(name[2:], [own[2:] for own in _OPTIONS])
    meant = None if close is None else f"--{close}"
    if meant is None:
        keys = [f"--{section}.{key}" for section, cls in SECTIONS.items() for key in field_types(cls)
                if key == name[2:]]
        meant = keys[0] if len(keys) == 1 else None
    if meant is not None:
        return f"unknown option {name!r}; did you mean {meant!r}?", meant
    return (f"unknown option {name!r}; this command's own are {', '.join(_OPTIONS)} and every other is a job "
            "setting, --section.key value (see --help)"), None


def _own_options(argv: list[str]) -> tuple[dict[str, Any], list[str], list[str]]:
    """The command's own options in ``argv`` (by name without dashes, read; None where not
    given or bad, False for an absent switch), the rest (the job's ``--section.key`` overrides),
    and one line per mistake: an unknown option (its value skipped, so one line for both), a bad
    or missing value, a value given to a switch, ``--world_size`` not given (nor misspelt)."""
    values: dict[str, Any] = {name[2:]: None if option.convert else False for name, option in _OPTIONS.items()}
    rest: list[str] = []
    errors: list[str] = []
    given: set[str] = set()  # (each option given, well or not, or meant by a misspelt one)
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        following = argv[i + 1] if i + 1 < len(argv) else None
        value_next = not eq and following is not None and not following.startswith("--")
        if not arg.startswith("--") or "." in name:  # a job setting, its value, or a stray word (the config's)
            rest.append(arg)
            i += 1
            continue
        option = _OPTIONS.get(name)
        if option is None:
            line, meant = _unknown_option(name)
            errors.append(line)
            given.add(meant or name)
            i += 2 if value_next else 1
            continue
        given.add(name)
        if option.convert is None:  # a switch
            if eq or value_next:
                errors.append(f"{name}: takes no value (got {inline if eq else following!r}); give {name} alone")
            values[name[2:]] = True
            i += 2 if value_next else 1
            continue
        if not (eq or value_next):
            errors.append(f"{name}: expects a value ({option.metavar})")
            i += 1
            continue
        text = inline if eq else str(following)
        try:
            values[name[2:]] = option.convert(text)
        except ValueError as exc:
            errors.append(f"{name}: invalid value {text!r}; {exc}")
        i += 1 if eq else 2
    if "--world_size" not in given:
        errors.append("--world_size: missing; expected the ranks of the job, an integer >= 1 (e.g. --world_size 8)")
    return values, rest, errors


def _host_memory(gib: float | None) -> tuple[float | None, str]:
    """Bytes of one node's host memory and where the figure comes from (``None``: no verdict):
    ``--host_memory_gib``, else this machine's RAM when it has a CUDA device (a training node)."""
    if gib is not None:
        return gib * GIB, f"{gib:g} GiB (--host_memory_gib)"
    if torch.cuda.is_available() and hasattr(os, "sysconf"):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return float(total), f"{total / GIB:.0f} GiB (this node's RAM)"
    return None, "no --host_memory_gib (and no CUDA device here): no verdict"


def _device_memory(gib: float | None, device_type: str = "cuda") -> tuple[float | None, str]:
    """Bytes of one device and where the figure comes from (``None``: no verdict): this machine's
    first CUDA device only for a CUDA job."""
    if gib is not None:
        return gib * GIB, f"{gib:g} GiB (--device_memory_gib)"
    if device_type != "cuda":
        return None, f"no --device_memory_gib for a {device_type.upper()} job: no verdict"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"{props.total_memory / GIB:.1f} GiB ({props.name})"
    return None, "no CUDA device here and no --device_memory_gib: no verdict"


def _json_path(text: str | None) -> Path | None:
    """``--json`` as a path whose folder exists (created) and is writable, checked before any work."""
    if text is None:
        return None
    path = Path(text)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--json: cannot create the folder of {text!r}: {exc.strerror or exc}") from None
    if path.is_dir() or not os.access(path.parent, os.W_OK):
        raise UsageError(f"--json: cannot write {text!r}")
    return path


def _modes(configured: str | int) -> list[str | int]:
    modes: list[str | int] = ["default", "never", "always"]
    assert set(modes) == set(RESHARD_MODES)
    if isinstance(configured, int):
        modes.append(configured)
    return modes


def _label(mode: ReshardMode) -> str:
    """A mode's name in the table: a per-unit plan is what ``auto`` chose."""
    return "auto" if isinstance(mode, tuple) else str(mode)


def _table(estimates: list[MemoryEstimate], configured: str | int, device_bytes: float | None,
           unit: tuple[str, int]) -> str:
    name, scale = unit
    offload = any(any(e.cpu_offload) if isinstance(e.cpu_offload, tuple) else e.cpu_offload for e in estimates)
    width = _where_width(estimates)
    head = (f"{'mode':9} " + " ".join(f"{short:>8}" for _, short in _COLUMNS) + f" {'peak':>8}"
            + (f" {'cpu':>8}" if offload else "") + f"  {'peak in':{width}} fits")
    lines = [f"estimated memory per rank in {name} (tensor bytes)", head]
    for est in estimates:
        mark = "*" if _label(est.reshard_after_forward_mode) == str(configured) else " "
        lines.append(_row(_label(est.reshard_after_forward_mode) + mark, est, scale, device_bytes, offload, width))
    return "\n".join(lines)


def _where_width(estimates: list[MemoryEstimate]) -> int:
    """The "peak in" column's width: its longest entry, whole (module names are not cut)."""
    return max([len("peak in"), *(len(where_text(e.device_peak_phase, e.device_peak_module)) for e in estimates)])


def _row(label: str, est: MemoryEstimate, scale: int, device_bytes: float | None, offload: bool,
         width: int) -> str:
    """One estimate's line of a table: its categories at the device peak, the peak, where, fits."""
    where = where_text(est.device_peak_phase, est.device_peak_module)
    fits = "-" if device_bytes is None else ("yes" if est.fits(device_bytes) else "NO")
    cells = [est.device_categories[category] for category, _ in _COLUMNS] + [est.device_peak]
    if offload:
        cells.append(est.cpu_peak)
    return f"{label:9} " + " ".join(f"{value / scale:8.2f}" for value in cells) + f"  {where:{width}} {fits}"


def _pipeline_text(pipeline: PipelinePlan, local_batch_size: int) -> str:
    """The pipeline's schedule and each rank's stages, one line each."""
    m = pipeline.microbatches(local_batch_size)
    lines = [f"pipeline {pipeline.degree}: {pipeline.schedule}, {m} micro-batches of {pipeline.microbatch_size} "
             f"row{'s' if pipeline.microbatch_size > 1 else ''} per local batch, {pipeline.num_stages} stages"]
    for rank in range(pipeline.degree):
        parts = []
        for stage in pipeline.rank_stages(rank):
            held = ([f"blocks {stage.layers[0]}-{stage.layers[-1]}" if len(stage.layers) > 1
                     else f"block {stage.layers[0]}"] if stage.layers else [])
            held = (["embedding"] if stage.first else []) + held + (["norm, output"] if stage.last else [])
            parts.append(f"stage {stage.index} ({', '.join(held)})")
        lines.append(f"  pp rank {rank}: " + "; ".join(parts))
    return "\n".join(lines)


def _stage_table(stages: list[MemoryEstimate], configured: str | int, device_bytes: float | None,
                 unit: tuple[str, int]) -> str:
    """Each pipeline rank's estimate in the configured mode: its stages' parameters, its
    micro-batches in flight."""
    name, scale = unit
    width = _where_width(stages)
    head = (f"{'pp rank':9} " + " ".join(f"{short:>8}" for _, short in _COLUMNS) + f" {'peak':>8}"
            + f"  {'peak in':{width}} fits")
    lines = [f"per pipeline rank, reshard_after_forward_mode {configured!r}, in {name}", head]
    lines += [_row(str(est.pipeline_rank), est, scale, device_bytes, offload=False, width=width) for est in stages]
    return "\n".join(lines)


@dataclasses.dataclass
class _Estimates:
    """What the command estimated for a job: each mode's, each pipeline rank's, auto's."""

    estimates: list[MemoryEstimate]
    """One per reshard mode (the last: auto's plan, when there is one)."""
    stages: list[MemoryEstimate]
    """With a pipeline: each pipeline rank's (the configured mode's, or auto's)."""
    auto: bool
    """The job's own mode is ``auto``."""
    auto_shape: Any
    """The shape auto planned (its ``cpu_offload`` 'auto' when the command chose offload too)."""
    budget_source: str
    rank_plans: list[AutoReshardPlan]
    """Auto's plan of each pipeline rank (one without a pipeline)."""
    plan_auto: AutoReshardPlan | None
    """The modes table's auto row: the pipeline rank of the highest peak."""
    auto_error: str | None
    """Why auto would find no plan (when the job did not ask for auto)."""
    seconds: float


def main(argv: list[str] | None = None) -> int:
    """Entry point: print the estimate table (exit 0), or one error line (exit 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        build_parser().print_help()
        return 0
    try:
        own, rest, errors = _own_options(argv)
        device_type = own["device_type"] or "cuda"
        world_size, ranks_per_node = own["world_size"], own["ranks_per_node"]
        if ranks_per_node is None and world_size is not None:
            env = os.environ.get("LOCAL_WORLD_SIZE", "")
            ranks_per_node = int(env) if env.isdigit() and int(env) > 0 else world_size
        if world_size is not None and ranks_per_node is not None and world_size % ranks_per_node:
            errors.append(f"--ranks_per_node: invalid value {ranks_per_node}; it must divide --world_size {world_size}")
        json_path = None
        try:
            json_path = _json_path(own["json"])
        except UsageError as exc:
            errors.append(str(exc))
        try:
            config = load_job_config(rest)
        except ConfigError as exc:
            errors += str(exc).splitlines()
        if errors:  # every mistake of the command line at once, before any estimate
            raise UsageError("\n".join(dict.fromkeys(errors)))
        device_bytes, device_source = _device_memory(own["device_memory_gib"], device_type)
        host = _host_memory(own["host_memory_gib"])
        plan, vocab_note = plan_without_files(config, world_size=world_size, local_world_size=ranks_per_node,
                                              device_type=device_type)
        if own["longest_seq_len"]:
            return print_longest(config, plan, world_size=world_size, ranks_per_node=ranks_per_node,
                                  device_bytes=device_bytes, device_source=device_source, host=host)
        log_to_stderr()
        done = _estimate_job(config, plan, world_size=world_size, device_bytes=device_bytes)
    except (UserError, ValueError) as exc:
        for line in str(exc).splitlines() or [""]:  # one line per problem
            print(f"error: {line}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # the estimate's own step failed (a bug to report, not a setting to fix)
        first_line = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        print(f"error: the memory estimate's step failed: {first_line}", file=sys.stderr)
        return 1
    _print_job(config, plan, vocab_note, world_size=world_size, ranks_per_node=ranks_per_node)
    unit = ("GiB", GIB) if max(e.device_peak for e in done.estimates) >= GIB else ("MiB", 2**20)
    configured = plan.shape.reshard_after_forward_mode
    print(_table(done.estimates, configured, device_bytes, unit))
    if done.stages:
        print(_stage_table(done.stages, configured, device_bytes, unit))
    print("\n".join(_notes(config, plan, done, device_source, host=host, ranks_per_node=ranks_per_node)))
    if json_path is not None:
        record = _json_record(config, plan, done, vocab_note, world_size=world_size, ranks_per_node=ranks_per_node,
                              device_bytes=device_bytes)
        try:
            json_path.write_text(json.dumps(record, indent=1))
        except OSError as exc:
            print(f"error: --json: cannot write {str(json_path)!r}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    return 0


def _estimate_job(config: JobConfig, plan: JobPlan, *, world_size: int, device_bytes: float | None) -> _Estimates:
    """Every reshard mode's estimate (one, ``never``, for a zero-bubble schedule, which keeps every
    unit gathered through the step), each pipeline rank's, and what auto chooses: the job's own
    auto, else (given a device) auto with CPU offload chosen per unit too, unless the job offloads
    everything."""
    from torchtitan_lite.memory.auto import auto_budget_bytes, job_auto_shape, plan_auto_reshard

    job = plan.shape
    shape = job_estimate_shape(plan)
    auto = job.reshard_after_forward_mode == "auto"
    would = not auto and device_bytes is not None and not job.compile_by_parts and job.pipeline is None
    budget, budget_source = auto_budget_bytes(plan.memory_budget_gib, device_bytes) if auto or would else (0, "")
    configured = job.reshard_after_forward_mode
    auto_shape = job_auto_shape(plan)
    if would and job.cpu_offload is False:
        auto_shape = auto_shape.replace(cpu_offload="auto")
    with Progress(f"planning the memory of {config.model.name} {config.model.flavor} on {world_size} "
                  f"rank{'s' if world_size > 1 else ''}", first_s=1.0) as progress:
        modes = ["never"] if job.pipeline is not None and job.pipeline.splits_backward else _modes(configured)
        estimates = []
        for index, mode in enumerate(modes):
            progress.update(f"estimate {index + 1} of {len(modes) + int(auto or would)}: "
                            f"reshard_after_forward_mode {mode!r}")
            estimates.append(estimate_memory(plan.spec, plan.model_args, shape, reshard_after_forward_mode=mode))
        # With a pipeline, each rank's stages (the configured mode's; the modes table: the worst
        # stage in each mode)
        stages = [] if job.pipeline is None or auto else estimate_stages(
            plan.spec, plan.model_args, shape, reshard_after_forward_mode=configured)
        seconds = sum(e.seconds for e in estimates)
        rank_plans: list[AutoReshardPlan] = []
        auto_error = None
        if auto or would:
            try:
                for pp_rank in range(plan.dims.pp):
                    if plan.dims.pp > 1:
                        progress.update(f"auto's plan of pipeline rank {pp_rank + 1} of {plan.dims.pp}")
                    rank_plans.append(plan_auto_reshard(plan.spec, plan.model_args, auto_shape, budget_bytes=budget,
                                                        budget_source=budget_source, pipeline_rank=pp_rank))
            except ValueError as exc:
                if auto:
                    raise
                auto_error = str(exc)
    plan_auto = max(rank_plans, key=lambda chosen: chosen.estimate.device_peak) if rank_plans else None
    if plan_auto is not None:
        seconds += sum(chosen.seconds for chosen in rank_plans)
        estimates.append(plan_auto.estimate)
        if plan.dims.pp > 1:
            stages = [chosen.estimate for chosen in rank_plans]
    return _Estimates(estimates=estimates, stages=stages, auto=auto, auto_shape=auto_shape,
                      budget_source=budget_source, rank_plans=rank_plans, plan_auto=plan_auto, auto_error=auto_error,
                      seconds=seconds)


def _print_job(config: JobConfig, plan: JobPlan, vocab_note: str | None, *, world_size: int,
               ranks_per_node: int) -> None:
    """The lines above the table: the plan's notes, the model and its split, the batch and settings."""
    model_args, dims, t = plan.model_args, plan.dims, config.training
    for note in plan.notes:
        print(f"note: {note}")
    print(f"{config.model.name} {config.model.flavor}: {model_args.num_params() / 1e9:.2f}B parameters, "
          f"vocab {model_args.vocab_size}; {world_size} ranks ({ranks_per_node} per node) "
          f"{DEVICE_TEXT[plan.shape.device_type]}: dp_replicate "
          f"{dims.dp_replicate} × dp_shard {dims.dp_shard}"
          + (f" × context parallel {dims.cp} ({plan.shape.context_parallel_method}: each rank holds "
             f"{plan.shape.seq_len // dims.cp} tokens of every sequence)" if dims.cp > 1 else "")
          + (f" × tensor parallel {dims.tp} (attention and dense feed-forward split over {dims.tp} ranks, "
             f"sequence parallel between them)" if dims.tp > 1 else "")
          + (f" (expert parallel {dims.ep}: each rank holds {model_args.num_experts // dims.ep} experts' "
             f"weights per layer, FSDP-sharded over {dims.dp_shard * dims.cp // dims.ep} ranks"
             + (f" and replicated {dims.dp_replicate}×" if dims.dp_replicate > 1 else "") + ")"
             if dims.ep > 1 else "")
          + (f" × pipeline {dims.pp}" if dims.pp > 1 else ""))
    if plan.shape.pipeline is not None:
        print(_pipeline_text(plan.shape.pipeline, t.local_batch_size))
    if vocab_note is not None:
        print(vocab_note)
    for absent in data_not_here(config):
        print(absent)
    batch = plan.objective.entry.batch_text(plan.objective, t.local_batch_size)
    accum = plan.shape.grad_accum_steps
    print(f"local batch {batch} × seq_len {t.seq_len}, {accum} micro-batch"
          f"{'es' if accum > 1 else ''} per step; params {t.mixed_precision_param}, reduce "
          f"{t.mixed_precision_reduce}; CPU offload {_OFFLOAD_TEXT[plan.shape.cpu_offload]}; "
          f"{config.optimizer.name} ({config.optimizer.implementation}); activation checkpointing "
          f"{describe_ac(config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option)}"
          + ("; the checkpointed blocks' inputs offloaded to host memory" if plan.shape.activation_offload else "")
          + ("" if plan.shape.mlp_tiles == 1 else "; dense feed-forwards in "
             + (f"{plan.shape.mlp_tiles} sequence tiles" if plan.shape.mlp_tiles else
                "sequence tiles of about the model's width")))
    if plan.shape.lora is not None:
        lo = plan.shape.lora
        print(f"LoRA rank {lo.rank} on {len(lo.linears)} linears ({', '.join(lo.target_modules)}): gradients and "
              "optimizer state for the adapters only, the base weights frozen")
    for line in plan.objective.entry.step_lines(plan.objective):  # how the estimate runs its step
        print(line)


def _notes(config: JobConfig, plan: JobPlan, done: _Estimates, device_source: str, *,
           host: tuple[float | None, str] = (None, ""), ranks_per_node: int = 1) -> list[str]:
    """The lines below the table."""
    notes = ["* = configured mode; categories at the moment of the device peak"
             + ("; with a pipeline, each mode's row is its pipeline rank of the highest peak" if done.stages else "")]
    if plan.shape.cpu_offload is not False:
        notes.append("CPU offload: sharded params, grads and optimizer state live on CPU (cpu column) "
                     "and are not in the device peak")
    mode = str(plan.shape.reshard_after_forward_mode)
    configured = next((e for e in done.estimates if _label(e.reshard_after_forward_mode) == mode), done.estimates[0])
    if plan.shape.activation_offload or host_bytes(configured):
        kept = max(host_bytes(e) for e in [configured, *done.stages])
        node = kept * ranks_per_node
        verdict = "" if host[0] is None else (" (fits" if node <= 0.9 * host[0] else " (does NOT fit") + \
            f" 90% of {host[1]})"
        notes.append(f"host memory: {size_text(configured.activation_host)} of offloaded activations "
                     f"(activation_checkpoint.offload) + {size_text(configured.cpu_peak)} of CPU-offloaded state per "
                     f"rank at most (configured mode), {size_text(node)} per node of {ranks_per_node} ranks{verdict}")
    if plan.shape.objective_shape.rollout is not None and plan.shape.objective_shape.rollout.generation_rows:
        notes.append(f"online RL: the KV cache of a generation batch is {size_text(configured.kv_cache)} per rank; "
                     f"generation peaks at {size_text(configured.generation_peak)} (configured mode), in the peaks "
                     "above where it is the highest ('generation' in the where column: a smaller "
                     "grpo.generation_batch_size lowers it, resharding and checkpointing do not)")
    notes += not_modelled(config, plan)
    notes.append(_DEVICE_NOTE[plan.shape.device_type])
    notes.append(f"device memory: {device_source}; allocator overhead, "
                 + ("CUDA context and " if plan.shape.device_type == "cuda" else "") + "communication buffers are "
                 "not included")
    if done.plan_auto is not None and done.auto:
        notes += [f"{chosen.summary()} (budget: {done.budget_source}; the fits column is against the whole device)"
                  for chosen in done.rank_plans]
    elif done.plan_auto is not None:
        keys = "parallelism.reshard_after_forward_mode = 'auto'" + (
            ", parallelism.cpu_offload = 'auto'" if done.auto_shape.cpu_offload == "auto" else "")
        notes.append(f"auto would choose, with {keys}: {done.plan_auto.summary()} (budget: {done.budget_source})")
    elif done.auto_error is not None:
        notes.append(f"auto would find no plan: {done.auto_error}")
    notes.append(f"estimated in {done.seconds:.1f} s")
    return notes


def _json_record(config: JobConfig, plan: JobPlan, done: _Estimates, vocab_note: str | None, *, world_size: int,
                 ranks_per_node: int, device_bytes: float | None) -> dict[str, Any]:
    """Every figure of the command, for ``--json``."""
    configured = plan.shape.reshard_after_forward_mode
    return {
        "world_size": world_size,
        "ranks_per_node": ranks_per_node,
        "model": config.model.name,
        "flavor": config.model.flavor,
        "num_params": plan.model_args.num_params(),
        "vocab_size": plan.model_args.vocab_size,
        "vocab_note": vocab_note,
        "not_modelled": not_modelled(config, plan),
        "configured_mode": configured,
        "device_type": plan.shape.device_type,
        "device_memory_bytes": device_bytes,
        "estimates": [
            {
                **e.to_dict(),
                "configured": _label(e.reshard_after_forward_mode) == str(configured),
                "fits": None if device_bytes is None else e.fits(device_bytes),
            }
            for e in done.estimates
        ],
        "pipeline_ranks": [
            {**e.to_dict(), "fits": None if device_bytes is None else e.fits(device_bytes)} for e in done.stages
        ],
        "auto": None if done.plan_auto is None else _auto_record(done.plan_auto, done.auto),
        # with a pipeline: each pipeline rank's plan ("auto" is the one of the highest peak)
        "pipeline_auto": [_auto_record(chosen, done.auto) for chosen in done.rank_plans] if plan.dims.pp > 1 else [],
    }


def _auto_record(chosen: AutoReshardPlan, configured: bool) -> dict[str, Any]:
    """An ``auto`` plan in the CLI's JSON."""
    return {
        "pipeline_rank": chosen.estimate.pipeline_rank,
        "units": chosen.units,
        "reshard": chosen.reshard,
        "order": chosen.order,
        "budget": chosen.budget,
        "peak": chosen.peak,
        "never_peak": chosen.never_peak,
        "tried": chosen.tried,
        "all_gathers_per_step": chosen.all_gathers_per_step,
        "blocks": chosen.blocks,
        "ac_policies": chosen.ac_policies,
        "configured_ac": chosen.configured_ac,
        "actions": chosen.actions,
        "added_flops": chosen.added_flops,
        "offload": chosen.offload,
        "offloaded": chosen.offloaded,
        "added_ms": chosen.added_ms,
        "configured": configured,
    }


if __name__ == "__main__":
    sys.exit(main())
