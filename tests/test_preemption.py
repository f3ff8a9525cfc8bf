"""Preemption and damaged checkpoints: a signal saves before the job exits; a checkpoint that
fails verification is named and skipped.

Jobs run under real torchrun (``tests/kill_at_step.py`` sends the signal as a step begins).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_ARGS
from tests.dist_utils import free_port, read_jsonl, run_command, run_distributed
from tests.test_process_group_restarts import _torchrun, _uninterrupted
from torchtitan_lite.checkpoint.manager import committed_steps
from torchtitan_lite.errors import PREEMPTED_EXIT_CODE


def _launch(script: str, *args: str) -> list[str]:
    """``python -m torchtitan_lite.launch`` (torchrun's arguments, the table's exit code) of 2 ranks."""
    return _torchrun(script, *args, max_restarts=0, launcher="torchtitan_lite.launch")


def _argv(dump: Path, *extra: str) -> list[str]:
    return [*TINY_ARGS, "--job.dump_folder", str(dump), "--training.steps", "16", "--checkpoint.enable",
            "--checkpoint.interval", "50", "--validation.no-enable", *extra]


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; the parts: the launcher's
@pytest.mark.slow      # exit code and a signal without checkpointing below, a killed rank's resume elsewhere)
def test_sigterm_saves_once_exits_75_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    """2 ranks, checkpoint.interval 50: SIGTERM reaches rank 0 only, as step 12 begins, and again
    as the save begins. Both ranks stop after step 12, step-12 is committed (nothing partial),
    the workers exit with 75, and running the job again continues with the losses of an
    uninterrupted run, exactly (fp32)."""
    dump = tmp_path / "preempted"
    result = run_command(_launch("tests/kill_at_step.py", *_argv(dump)), timeout=300,
                         extra_env={"KILL_AT_STEP": "12", "KILL_RANK": "0", "KILL_SIGNAL": "SIGTERM",
                                    "SIGNAL_DURING_SAVE": "1"})
    output = f"rc={result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == PREEMPTED_EXIT_CODE, output  # torchrun itself would end with 1
    assert f"stopped by SIGTERM at step 12: run the job again to resume (exit code {PREEMPTED_EXIT_CODE})" \
        in result.stderr, output
    assert f"(exitcode: {PREEMPTED_EXIT_CODE})" in result.stderr, output  # torchrun's report of the workers
    assert "checkpoint step 12 saved in" in result.stdout, output  # how long the save took, for the grace period
    assert "1 more signal(s) during the save were ignored" in result.stdout, output
    assert committed_steps(dump / "checkpoint") == [12]
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-12"]  # nothing partial or torn
    assert [r["step"] for r in read_jsonl(dump / "metrics.jsonl")] == list(range(1, 13))

    again = run_command(_torchrun("-m", "torchtitan_lite.train", *_argv(dump), max_restarts=0), timeout=300)
    assert again.returncode == 0, f"{again.stdout[-3000:]}\n{again.stderr[-3000:]}"
    records = read_jsonl(dump / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 17))
    full = run_distributed(_uninterrupted, 2, _argv(tmp_path / "uninterrupted"))[0]
    assert [r["loss"] for r in records] == full


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
@pytest.mark.parametrize("target", ["agent", "agent_group"])
def test_sigterm_to_the_launcher_ends_it_with_75_and_the_rerun_resumes_exactly(tmp_path: Path, target: str) -> None:
    """SIGTERM to the launcher (alone, or its whole process group as Slurm and job control send it)
    as step 8 begins: torchrun forwards it to the workers, which save step 8 and stop; the
    launcher of ``python -m torchtitan_lite.launch`` ends with 75 (torchrun's own ends with 1),
    and running the job again continues with the losses of an uninterrupted run."""
    dump = tmp_path / "preempted"
    result = run_command(_launch("tests/kill_at_step.py", *_argv(dump)), timeout=300,
                         extra_env={"KILL_AT_STEP": "8", "KILL_RANK": "0", "KILL_SIGNAL": "SIGTERM",
                                    "KILL_TARGET": target})
    output = f"rc={result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == PREEMPTED_EXIT_CODE, output
    assert "launch: SIGTERM received; workers: rank 0: 75, rank 1: 75; exit code 75" in result.stderr, output
    assert committed_steps(dump / "checkpoint") == [8], output
    again = run_command(_launch("-m", "torchtitan_lite.train", *_argv(dump)), timeout=300)
    assert again.returncode == 0, f"{again.stdout[-3000:]}\n{again.stderr[-3000:]}"
    records = read_jsonl(dump / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 17))
    full = run_distributed(_uninterrupted, 2, _argv(tmp_path / "uninterrupted"))[0]
    assert [r["loss"] for r in records] == full


def test_the_launchers_exit_code_follows_the_table() -> None:
    from torchtitan_lite.launch import launch_exit_code

    assert launch_exit_code() == 0
    assert launch_exit_code(failure_codes=[2, 1]) == 2  # the first to fail: a config error keeps its 2
    assert launch_exit_code(failure_codes=[75, 75]) == PREEMPTED_EXIT_CODE
    assert launch_exit_code(failure_codes=[-9, 1]) == 137  # killed by SIGKILL, as a shell says
    assert launch_exit_code(signalled=15, worker_codes={"0": 75, "1": 75}, world_size=2) == PREEMPTED_EXIT_CODE
    assert launch_exit_code(signalled=15, worker_codes={"0": 75}, world_size=2) == 143  # rank 1 saved nothing
    assert launch_exit_code(signalled=15, worker_codes={}, world_size=2) == 143  # signalled while starting
    assert launch_exit_code(signalled=15, worker_codes={"0": 143, "1": 143}, world_size=2) == 143


@pytest.mark.slow
def test_a_signal_without_checkpointing_says_nothing_was_saved(tmp_path: Path) -> None:
    """checkpoint.enable false: the job still stops after the step, but nothing was saved, so it
    neither says "resume" nor ends with 75: 128 + SIGTERM's number, as a shell reports it."""
    argv = [*TINY_ARGS, "--job.dump_folder", str(tmp_path / "job"), "--training.steps", "8",
            "--validation.no-enable", "--metrics.no-enable_tensorboard"]
    result = run_command([sys.executable, "tests/kill_at_step.py", *argv], timeout=300,
                         extra_env={"KILL_AT_STEP": "3", "KILL_RANK": "0", "RANK": "0", "KILL_SIGNAL": "SIGTERM"})
    output = f"rc={result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 128 + 15, output
    assert ("stopped by SIGTERM at step 3 with no checkpoint (checkpoint.enable is false): a new run starts "
            "from step 0 (exit code 143)") in result.stderr, output
    assert "resume" not in result.stderr, output


# --------------------------------------------------------------------------------------------
# Damaged checkpoints
# --------------------------------------------------------------------------------------------


def _damage(step_dir: Path, how: str) -> str:
    """Damage one data file of a checkpoint; return its name."""
    files = sorted(step_dir.glob("*.distcp"))
    target = files[-1]
    if how == "flip":
        data = bytearray(target.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 4096] = bytes(b ^ 0xFF for b in data[middle : middle + 4096])
        target.write_bytes(bytes(data))
    elif how == "truncate":
        with target.open("r+b") as fh:
            fh.truncate(target.stat().st_size // 2)
    else:
        target.unlink()
    return target.name


def _corrupt_rank(base: str) -> dict[str, object]:
    import shutil

    import torch.distributed as dist

    from tests.dist_utils import captured_log
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    root = Path(base)

    def run(dump: Path, steps: int, *extra: str) -> list[float]:
        argv = [*TINY_ARGS, "--job.dump_folder", str(dump), "--training.steps", str(steps), "--validation.no-enable",
                "--checkpoint.enable", "--checkpoint.interval", "4", "--lr_scheduler.total_steps", "12", *extra]
        trainer = Trainer(load_job_config(argv))
        losses = [h["loss"] for h in trainer.train()]
        trainer.metrics.close()  # the process group stays for the next trainer
        return losses

    with captured_log() as lines:
        out: dict[str, object] = {"full": run(root / "full", 12)}
        run(root / "pristine", 8)  # checkpoints at steps 4 and 8
        for how in ("flip", "truncate", "delete"):
            dump = root / how
            if dist.get_rank() == 0:
                shutil.copytree(root / "pristine" / "checkpoint", dump / "checkpoint")
                out[f"{how}_file"] = _damage(dump / "checkpoint" / "step-8", how)
            dist.barrier()
            lines.clear()
            out[how] = run(dump, 12)
            out[f"{how}_log"] = [line for line in lines if "does not verify" in line or "resuming from" in line]
            out[f"{how}_folders"] = sorted(p.name for p in (dump / "checkpoint").iterdir())
    dist.barrier()
    return out


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_is_named_and_the_previous_one_resumed(tmp_path: Path) -> None:
    """2 ranks, checkpoints at steps 4 and 8, then one data file of step 8 damaged (4 KiB flipped,
    truncated to half, deleted): the resumed job logs the step and the file, sets step-8 aside as
    step-8.corrupt, resumes from step 4 and trains steps 5-12 with the losses of an
    uninterrupted run."""
    ranks = run_distributed(_corrupt_rank, 2, str(tmp_path), timeout=400)
    out = ranks[0]
    full = out["full"]
    for how in ("flip", "truncate", "delete"):
        assert out[how] == full[4:], how  # steps 5..12, exactly
        log = out[f"{how}_log"]
        assert any("checkpoint step 8 does not verify" in line and out[f"{how}_file"] in line for line in log), log
        assert any("resuming from checkpoint step 4" in line and "step-8.corrupt" in line for line in log), log
        assert out[f"{how}_folders"] == ["step-12", "step-4", "step-8", "step-8.corrupt"], out[f"{how}_folders"]


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_no_checkpoint_that_verifies_is_one_line_and_exit_4(tmp_path: Path) -> None:
    """One process over a 1-rank run's checkpoints: with both damaged, one error line and exit 4
    (never a fresh start over them); with on_corrupt = 'stop', a damaged latest stops at once,
    naming the file, and nothing is renamed."""
    import shutil
    import sys

    pristine = tmp_path / "pristine"
    argv = [*TINY_ARGS, "--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "4",
            "--validation.no-enable"]
    made = run_command([sys.executable, "-m", "torchtitan_lite.train", *argv, "--job.dump_folder", str(pristine)])
    assert made.returncode == 0, made.stderr[-2000:]

    both = tmp_path / "both"
    shutil.copytree(pristine, both)
    for step in (4, 8):
        _damage(both / "checkpoint" / f"step-{step}", "flip")
    result = run_command([sys.executable, "-m", "torchtitan_lite.train", *argv, "--training.steps", "12",
                          "--job.dump_folder", str(both)])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 4, result.stderr[-2000:]
    assert len(errors) == 1 and "no checkpoint in" in errors[0] and "verifies" in errors[0], errors
    assert "step-8" in errors[0] and "does not match the checksum" in errors[0], errors  # the newest's file
    assert sorted(p.name for p in (both / "checkpoint").iterdir()) == ["step-4.corrupt", "step-8.corrupt"]

    stop = tmp_path / "stop"
    shutil.copytree(pristine, stop)
    name = _damage(stop / "checkpoint" / "step-8", "truncate")
    result = run_command([sys.executable, "-m", "torchtitan_lite.train", *argv, "--training.steps", "12",
                          "--checkpoint.on_corrupt", "stop", "--job.dump_folder", str(stop)])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 4 and len(errors) == 1, result.stderr[-2000:]
    assert "step-8" in errors[0] and name in errors[0] and "on_corrupt = 'stop'" in errors[0], errors
    assert sorted(p.name for p in (stop / "checkpoint").iterdir()) == ["step-4", "step-8"]


_SRUN = """#!/bin/bash
# srun for one node: the head node's address, or the command itself in place of its tasks
for arg in "$@"; do [ "$arg" = hostname ] && { echo 127.0.0.1; exit 0; }; done
while [ $# -gt 0 ] && [[ "$1" == -* ]]; do shift; done
exec "$@"
"""
_SCONTROL = """#!/bin/bash
if [ "$1" = show ]; then echo localhost; else echo "$@" >> "$SCONTROL_LOG"; fi
"""


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_slurm_script_passes_sigterm_on_and_requeues_the_job(tmp_path: Path) -> None:
    """scripts/multinode_trainer.slurm under stand-ins for srun and scontrol (one node, 2 CPU
    ranks): SIGTERM to the batch script only (what --signal=B:TERM does) reaches the workers
    through torchrun, they save a checkpoint at the step they were in and stop, and the script
    requeues the job and exits 0."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.dist_utils import REPO_ROOT

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", _SRUN), ("scontrol", _SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    dump, log = tmp_path / "job", tmp_path / "scontrol.log"
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")},
           "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "SLURM_JOB_NODELIST": "localhost",
           "SLURM_NNODES": "1", "SLURM_JOB_ID": "4242", "NGPU_PER_NODE": "2", "RDZV_PORT": str(free_port()),
           "SCONTROL_LOG": str(log), "CONFIG_FILE": "train_configs/debug_model.toml"}
    argv = [*TINY_ARGS, "--job.dump_folder", str(dump), "--training.steps", "100000", "--checkpoint.enable",
            "--checkpoint.interval", "100000", "--validation.no-enable"]
    proc = subprocess.Popen(["bash", "scripts/multinode_trainer.slurm", *argv], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180  # a hang bound: the job starts and trains a few steps
        while time.monotonic() < deadline and proc.poll() is None:
            if (dump / "metrics.jsonl").is_file() and len(read_jsonl(dump / "metrics.jsonl")) >= 3:
                break
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)  # the batch shell only
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    assert log.read_text().split() == ["requeue", "4242"], out[-4000:]
    steps = committed_steps(dump / "checkpoint")
    logged = [r["step"] for r in read_jsonl(dump / "metrics.jsonl")]
    assert len(steps) == 1 and steps[0] == logged[-1] >= 3, (steps, logged[-5:], out[-4000:])
    assert "SIGTERM received: checkpoint step" in out, out[-4000:]


def test_keep_latest_k_keeps_the_newest_checkpoint_with_checksums_until_a_newer_one_has_them(tmp_path: Path) -> None:
    """An async save is committed before its checksums are recorded (at wait()): until then,
    pruning to keep_latest_k = 1 keeps the newest checkpoint whose checksums were recorded, and
    lets it go once the newer one has its own."""
    import json

    from torchtitan_lite.checkpoint.commit import prune
    from torchtitan_lite.checkpoint.manager import CHECKSUMS_FILE, TRAIN_STATE_FILE

    folder = tmp_path / "checkpoint"
    for step in (2, 4, 6):
        (folder / f"step-{step}").mkdir(parents=True)
        (folder / f"step-{step}" / TRAIN_STATE_FILE).write_text(json.dumps({"step": step}))
        if step < 6:
            (folder / f"step-{step}" / CHECKSUMS_FILE).write_text(json.dumps({"algorithm": "crc32", "files": {}}))
    prune(folder, 1)
    assert committed_steps(folder) == [4, 6]
    (folder / "step-6" / CHECKSUMS_FILE).write_text(json.dumps({"algorithm": "crc32", "files": {}}))
    prune(folder, 1)
    assert committed_steps(folder) == [6]
