"""``python -m torchtitan_lite.train``: parse → preflight → plan → train → exit code.

    torchrun --standalone --nproc_per_node=2 -m torchtitan_lite.train \\
        --job.config_file train_configs/debug_model.toml --training.steps 20

A user's mistake ends the job with one line ``error: ...`` on stderr (from local rank 0) and the
exit code of its kind (:mod:`torchtitan_lite.errors`: 2 config, 3 data, 4 checkpoint); anything
else keeps its traceback.
"""

from __future__ import annotations

from torchtitan_lite.run.launcher_watch import exit_with_launcher

if __name__ == "__main__":  # first: a torchrun worker ends with its launcher from here on, torch's imports included
    exit_with_launcher()

import logging
import os
import signal
import sys

import torch

from torchtitan_lite.config import format_help, load_job_config
from torchtitan_lite.distributed import destroy_distributed, local_world_size_from_env, world_info_from_env
from torchtitan_lite.errors import PREEMPTED_EXIT_CODE, UserError
from torchtitan_lite.job import plan_job, preflight
from torchtitan_lite.launch import record_worker_exit
from torchtitan_lite.models import MODEL_SPECS
from torchtitan_lite.trainer import Trainer

__all__ = ["main"]


def _setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="[%(asctime)s] %(message)s" if rank == 0 else f"[rank {rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
    )


def _report(error: UserError, local_rank: int) -> int:
    """One ``error:`` line per problem (a config with several has one line each)."""
    if local_rank == 0:
        for line in str(error).splitlines() or [""]:
            print(f"error: {line}", file=sys.stderr)
    return error.exit_code


def _print_notes(notes: list[str], local_rank: int) -> None:
    """The config's ``note:`` lines (TorchTitan's names read as ours), from local rank 0."""
    if local_rank == 0:
        for note in notes:
            print(f"note: {note}", file=sys.stderr)


def _model_notes() -> dict[str, str]:
    """``--help``'s lines on the registered models and their flavors (read from the registry)."""
    return {"model.name": f"registered: {', '.join(MODEL_SPECS)}",
            "model.flavor": "; ".join(f"{name}: {', '.join(spec.flavors)}" for name, spec in MODEL_SPECS.items())}


def main(argv: list[str] | None = None) -> int:
    """Entry point: load, check and plan the job (a bad config exits 2 before any process group),
    then train. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        sys.stdout.write(format_help(notes=_model_notes()))
        return 0
    exit_with_launcher()  # (armed already when run as the entry point; here for callers of main)
    rank, local_rank, world_size = world_info_from_env()
    notes: list[str] = []
    try:
        config = load_job_config(argv, notes=notes)
        preflight(config)
        plan = plan_job(config, world_size=world_size, local_world_size=local_world_size_from_env())
    except UserError as exc:
        _print_notes(notes, local_rank)  # e.g. that a key the error names was read under its new name
        return _report(exc, local_rank)
    _print_notes(notes, local_rank)
    _setup_logging(rank)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    try:
        trainer = Trainer(config, plan)
    except UserError as exc:  # data, auto budget or a checkpoint to resume: found before training
        destroy_distributed(barrier=False)
        return _report(exc, local_rank)
    try:
        if config.checkpoint.create_seed_checkpoint:
            path = trainer.save_seed_checkpoint()
            print(f"seed checkpoint written to {path}")
        else:
            trainer.train()
    except UserError as exc:  # e.g. a background save that failed: one line, not a traceback
        trainer.close(clean=False)
        return _report(exc, local_rank)
    except BaseException:
        trainer.close(clean=False)
        raise
    trainer.close()
    if trainer.stopped_by is not None:
        return _stopped(trainer, local_rank)
    return 0


def _stopped(trainer: Trainer, local_rank: int) -> int:
    """The exit code of a job that a signal of ``checkpoint.save_on_signals`` stopped: 75 with its
    checkpoint saved (a rerun resumes); without checkpointing, 128 + the signal's number, as a
    shell reports a process the signal ended (a rerun starts over)."""
    name = trainer.stopped_by
    if trainer.checkpointer is not None:
        code = PREEMPTED_EXIT_CODE
        line = f"stopped by {name} at step {trainer.step}: run the job again to resume (exit code {code})"
    else:
        code = 128 + int(signal.Signals[name]) if name in signal.Signals.__members__ else 1
        line = (f"stopped by {name} at step {trainer.step} with no checkpoint (checkpoint.enable is false): "
                f"a new run starts from step 0 (exit code {code})")
    if local_rank == 0:
        print(line, file=sys.stderr)
    record_worker_exit(code)  # for python -m torchtitan_lite.launch, when the launcher itself was signalled
    return code


if __name__ == "__main__":
    sys.exit(main())
