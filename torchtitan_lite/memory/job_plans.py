"""A job planned for the memory command: its config checks and its plan, for a job whose files
(datasets, tokenizer) need not be on this machine (:func:`plan_without_files`), on the device it
will run on (:data:`DEVICE_TYPES`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torchtitan_lite.config.schema import JobConfig
from torchtitan_lite.data.build import check_sources
from torchtitan_lite.errors import ConfigError, DataError, DataNotHereError
from torchtitan_lite.job import FROM_CHECKPOINT, JobPlan, plan_job
from torchtitan_lite.models import get_model_spec

__all__ = ["DEVICE_TEXT", "DEVICE_TYPES", "UsageError", "data_not_here", "plan_without_files"]

DEVICE_TYPES = ("cuda", "cpu")
"""What ``--device_type`` takes: where the job will run (CUDA GPUs; CPU processes on gloo)."""

DEVICE_TEXT = {"cuda": "on CUDA devices", "cpu": "as CPU processes"}  # by JobShape.device_type


class UsageError(ValueError):
    """A mistake in the command's own options (one line, exit 2)."""


def _dataset_config_errors(config: JobConfig) -> list[str]:
    """The source checks of :func:`~torchtitan_lite.job.preflight` that are config checks (a
    source kind, a path a kind does not read): one line each. What needs the files (a missing
    or unreadable path, a column, a Hub name with no local copy) is no concern of an estimate
    and is skipped."""
    return [str(exc) for exc in check_sources(config)
            if isinstance(exc, ConfigError) and not isinstance(exc, DataNotHereError)]


def data_not_here(config: JobConfig) -> list[str]:
    """One line per dataset named only by where it is published (no local copy set): planned
    all the same, since the estimate reads no data."""
    return [f"{str(exc).split(':', 1)[0]}: not on this machine (no local copy set); the estimate reads no data"
            for exc in check_sources(config) if isinstance(exc, DataNotHereError)]


def _without_tokenizer(config: JobConfig, error: DataError) -> tuple[JobConfig, str]:
    """``config`` planned without its unreadable tokenizer: the byte tokenizer's ids inside the
    flavor's own vocabulary (or the user's ``model.vocab_size``, or a checkpoint's), and the line
    that says so (completed with the vocabulary by the caller)."""
    m = config.model
    path = str(m.tokenizer_path)
    if not Path(path).expanduser().exists():
        why = "does not exist on this machine"
    else:
        reason = str(error).removeprefix("model.tokenizer_path: ").removeprefix(f"invalid value {path!r}; ")
        why = f"holds no readable tokenizer ({reason})"
    vocab_size = m.vocab_size
    if vocab_size != -1:
        source = "model.vocab_size"
    elif m.flavor == FROM_CHECKPOINT:
        source = "the checkpoint's vocabulary"
    else:
        vocab_size = get_model_spec(m.name).flavors[m.flavor].vocab_size
        source = f"{m.name} {m.flavor}'s own vocabulary"
    planned = dataclasses.replace(config, model=dataclasses.replace(m, tokenizer_path=None, vocab_size=vocab_size))
    return planned, f"model.tokenizer_path {path!r} {why}: the estimate uses {source}"


def plan_without_files(config: JobConfig, *, world_size: int, local_world_size: int | None = None,
                       device_type: str = "cuda") -> tuple[JobPlan, str | None]:
    """The job as :func:`~torchtitan_lite.job.plan_job` plans it, after the config checks of
    :func:`~torchtitan_lite.job.preflight` (dataset names and the paths they need; every problem
    at once, as one :class:`ConfigError` of one line each), for a job whose files need not be on
    this machine: its datasets are not read, and when ``model.tokenizer_path`` holds no readable
    tokenizer the model takes the flavor's own vocabulary (``model.vocab_size`` when set; a
    checkpoint's for ``from_checkpoint``). Returns the plan and, in that case, one line saying so.

    ``device_type`` (one of :data:`DEVICE_TYPES`) is where the job will run, whatever this machine
    has: its estimate then holds what that device's kernels hold (CUDA's fused RMSNorm and
    attention; the CPU's composite norm and gloo's all-gather buffers)."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type: invalid value {device_type!r}; expected one of {', '.join(DEVICE_TYPES)}")
    errors = _dataset_config_errors(config)
    note = None
    try:
        try:
            plan = plan_job(config, world_size=world_size, local_world_size=local_world_size, device_type=device_type)
        except DataError as exc:  # plan_job reads no file but the tokenizer
            if config.model.tokenizer_path is None:
                raise
            planned, note = _without_tokenizer(config, exc)
            plan = plan_job(planned, world_size=world_size, local_world_size=local_world_size,
                            device_type=device_type)
            note = f"{note}, {plan.model_args.vocab_size} ids"
    except ConfigError as exc:
        errors.append(str(exc))
    if errors:
        raise ConfigError("\n".join(errors))
    return plan, note
