"""``python -m torchtitan_lite.launch``: torchrun, ending with the exit code of the job's table.

    python -m torchtitan_lite.launch --standalone --nproc_per_node=2 \\
        -m torchtitan_lite.train --job.config_file train_configs/debug_model.toml

It takes torchrun's arguments unchanged and runs torchrun's own agent in this process; only the
exit code differs. torchrun ends with 1 whenever a worker fails and with a ``SignalException``
traceback (exit 1) when it is signalled, so a scheduler that requeues a preempted job on 75
(:data:`~torchtitan_lite.errors.PREEMPTED_EXIT_CODE`) never sees it. Here:

- the workers finished: 0;
- a worker failed: the exit code of the first one that failed (torchrun's root cause), so a
  config, data or checkpoint error keeps its 2, 3 or 4, and workers that all stopped on a
  preemption signal give 75; a worker killed by a signal gives 128 + its number;
- the launcher itself was signalled (SIGTERM from Slurm, Kubernetes, ``kill``): torchrun
  forwards the signal to the workers and waits ``--shutdown_timeout`` seconds for them; when
  every worker then reported that it saved its checkpoint and stopped, 75, otherwise
  128 + the signal's number (143 for SIGTERM), as a shell reports a killed command.

The workers report through files in a folder this process creates for the run and names in
:data:`EXIT_FOLDER_ENV` (:func:`record_worker_exit`); the folder is removed at the end. The one
line this module prints on stderr says what happened and which code it chose.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from torchtitan_lite.errors import PREEMPTED_EXIT_CODE

__all__ = ["EXIT_FOLDER_ENV", "launch_exit_code", "main", "record_worker_exit"]

EXIT_FOLDER_ENV = "TORCHTITAN_LITE_EXIT_FOLDER"
"""The environment variable that names the folder where each worker writes its exit code."""


def record_worker_exit(code: int) -> None:
    """Write this worker's exit code where :mod:`torchtitan_lite.launch` reads it (nothing
    without that launcher). Called by ``python -m torchtitan_lite.train`` as it ends."""
    folder = os.environ.get(EXIT_FOLDER_ENV)
    if not folder or not os.path.isdir(folder):
        return
    rank = os.environ.get("RANK", "0")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        (Path(folder) / f"rank-{rank}.attempt-{attempt}").write_text(str(int(code)))
    except OSError:  # the launcher's folder is gone: nobody is left to read it
        pass


def _worker_codes(folder: Path) -> dict[str, int]:
    """The last attempt's exit codes by rank, as the workers wrote them."""
    latest: dict[str, tuple[int, int]] = {}
    for file in folder.glob("rank-*.attempt-*"):
        rank, _, attempt = file.name.removeprefix("rank-").partition(".attempt-")
        try:
            entry = (int(attempt), int(file.read_text().strip()))
        except (OSError, ValueError):
            continue
        if rank not in latest or entry[0] > latest[rank][0]:
            latest[rank] = entry
    return {rank: code for rank, (_, code) in latest.items()}


def launch_exit_code(*, failure_codes: list[int] | None = None, signalled: int | None = None,
                     worker_codes: dict[str, int] | None = None, world_size: int | None = None) -> int:
    """The launcher's exit code. ``failure_codes``: the failed workers' exit codes, the first to
    fail first (negative: killed by that signal); ``signalled``: the signal the launcher got;
    ``worker_codes``: what the workers reported (:func:`record_worker_exit`); ``world_size``:
    how many reports make every worker (None: at least one)."""
    if signalled is not None:
        codes = list((worker_codes or {}).values())
        every = world_size is None or len(codes) >= world_size
        if codes and every and all(code == PREEMPTED_EXIT_CODE for code in codes):
            return PREEMPTED_EXIT_CODE
        return 128 + int(signalled)
    if failure_codes:
        first = failure_codes[0]
        if all(code == PREEMPTED_EXIT_CODE for code in failure_codes):
            return PREEMPTED_EXIT_CODE
        return 128 - first if first < 0 else (first or 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (its own arguments) and return the exit code described above."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    folder = Path(tempfile.mkdtemp(prefix="torchtitan_lite_exit_"))
    previous = os.environ.get(EXIT_FOLDER_ENV)
    os.environ[EXIT_FOLDER_ENV] = str(folder)
    code = 0
    try:
        run(args)
    except ChildFailedError as exc:
        ordered = sorted(exc.failures.items(), key=lambda item: item[1].timestamp)  # global rank → failure
        codes = [failure.exitcode for _, failure in ordered]
        code = launch_exit_code(failure_codes=codes)
        rank, first = ordered[0]
        print(f"launch: rank {rank} exited with {first.exitcode} first ({len(codes)} worker(s) failed); "
              f"exit code {code}", file=sys.stderr)
    except SignalException as exc:
        reports = _worker_codes(folder)
        # Each node's launcher reads the reports of its own workers (the folder is local).
        local = str(getattr(args, "nproc_per_node", ""))
        code = launch_exit_code(signalled=int(exc.sigval), worker_codes=reports,
                                world_size=int(local) if local.isdigit() else None)
        said = ", ".join(f"rank {rank}: {value}" for rank, value in sorted(reports.items())) or "no worker reported"
        print(f"launch: {signal.Signals(exc.sigval).name} received; workers: {said}; exit code {code}",
              file=sys.stderr)
    finally:
        if previous is None:
            os.environ.pop(EXIT_FOLDER_ENV, None)
        else:
            os.environ[EXIT_FOLDER_ENV] = previous
        shutil.rmtree(folder, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
