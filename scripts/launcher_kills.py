"""How long torchrun workers outlive a SIGKILLed launcher, over many random kills.

    python scripts/launcher_kills.py [--kills 50] [--json PATH]

Each round starts ``torchrun --nproc_per_node=2 -m torchtitan_lite.train`` on the tiny Llama
(fp32, async checkpoints every 2 steps, so that kills land in staging, background writes and
commits as well as in steps and collectives), waits a random 0-4 s after its first logged step,
SIGKILLs the agent alone (its workers run in sessions of their own) and measures, as the
workers' subreaper, how long each worker lives on. Prints each round and the largest figure;
the stated bound is ``LAUNCHER_GONE_BOUND_S`` (torchtitan_lite/distributed/process_group.py).
Linux only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from torchtitan_lite.distributed import free_port  # noqa: E402

_ARGS = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
         "--training.steps", "100000", "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1",
         "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async",
         "--checkpoint.keep_latest_k", "2", "--validation.no-enable", "--metrics.no-enable_tensorboard"]


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def one_round(folder: Path, rng: random.Random) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--nnodes=1", "-m", "torchtitan_lite.train",
         *_ARGS, "--job.dump_folder", str(folder)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    metrics = folder / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().strip()):
        if agent.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the job did not start (exit {agent.poll()})")
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 4.0))
    workers = children(agent.pid)
    step = sum(1 for line in metrics.read_text().splitlines() if line.strip())
    agent.kill()
    agent.wait()
    killed = time.monotonic()
    exits: dict[int, tuple[int, float]] = {}
    while len(exits) < len(workers) and time.monotonic() - killed < 60:
        for pid in set(workers) - set(exits):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                exits[pid] = (os.waitstatus_to_exitcode(status), time.monotonic() - killed)
        time.sleep(0.01)
    for pid in set(workers) - set(exits):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return {"step": step, "workers": len(workers), "exit_codes": sorted(c for c, _ in exits.values()),
            "outlived_s": max((s for _, s in exits.values()), default=0.0) if len(exits) == len(workers) else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the rounds here")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        print("Linux only (PR_SET_CHILD_SUBREAPER, /proc)")
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(ctypes.c_int(36), ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    rng = random.Random(args.seed)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.kills):
            result = one_round(Path(tmp) / f"job{index}", rng)
            rounds.append(result)
            gone = "never (60 s)" if result["outlived_s"] is None else f"{result['outlived_s']:.3f} s"
            print(f"kill {index + 1:3d}: after step {result['step']:4}  exit codes {result['exit_codes']}  "
                  f"last worker gone after {gone}", flush=True)
    times = [r["outlived_s"] for r in rounds]
    left = sum(t is None for t in times)
    worst = max((t for t in times if t is not None), default=0.0)
    print(f"{len(rounds)} kills: the last worker gone after at most {worst:.3f} s; {left} round(s) with a worker "
          "alive 60 s after its launcher")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "max_outlived_s": worst, "left": left}, indent=1))
    return 0 if left == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
