"""How long torchrun workers outlive their launcher, over many random kills.

    python scripts/launcher_kills.py [--kills 50] [--json PATH]
    python scripts/launcher_kills.py --startup [--kinds group-kill,agent-kill,group-term] [--kills 50]
        [--window 15] [--chain 10] [--steps 1600] [--json PATH]

Without ``--startup``: each round starts ``torchrun --nproc_per_node=2 -m torchtitan_lite.train``
on the tiny Llama (fp32, async checkpoints every 2 steps, so that kills land in staging,
background writes and commits as well as in steps and collectives), waits a random 0-4 s after
its first logged step, SIGKILLs the agent alone (its workers run in sessions of their own) and
measures, as the workers' subreaper, how long each worker lives on.

With ``--startup``, for each kind of kill (``group-kill``: SIGKILL to the agent's process group;
``agent-kill``: SIGKILL to the agent alone; ``group-term``: SIGTERM to the group, which torchrun
forwards to its workers), chains of ``--chain`` faults in a row on one job (async checkpoints
every 10 steps): each launch is hit at a random moment of its first ``--window`` seconds, and the
next launch, started at once, resumes the job. The workers run ``tests/startup_phases.py`` (the
real entry point with its phases marked), so each kill is logged with the phase each worker was
in: ``agent`` (no worker started yet), ``start`` (Python's start-up, before torch's imports
begin), ``imports``, ``config``, ``data``, ``rendezvous``, ``process_group``, ``auto``, ``model``
(and the checkpoint's load), ``steps``. Measured: how long each worker outlived the signal and its
exit code (where this process reaped it), whether the next launch waited for a lock (its rank 0
logs ``waited ... s for pid``) or was refused; after a chain the job runs to its end, and every
step's loss it logged (resumed steps logged again included) must equal an uninterrupted run's,
with no checkpoint folder set aside as damaged.

Prints each round, the worst case per phase, and exits 1 when a worker outlived its launcher by
more than 5 s, a relaunch was refused, or a loss differs. The stated bound is
``LAUNCHER_GONE_BOUND_S`` (torchtitan_lite/launcher_watch.py). Linux only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from torchtitan_lite.distributed import free_port  # noqa: E402

_ARGS = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
         "--training.steps", "100000", "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1",
         "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async",
         "--checkpoint.keep_latest_k", "2", "--validation.no-enable", "--metrics.no-enable_tensorboard"]
_STARTUP_ARGS = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
                 "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--debug.deterministic",
                 "--checkpoint.enable", "--checkpoint.interval", "10", "--checkpoint.async_mode", "async",
                 "--checkpoint.keep_latest_k", "2", "--validation.no-enable", "--metrics.no-enable_tensorboard"]
KINDS = ("group-kill", "agent-kill", "group-term")
PHASES = ("agent", "start", "imports", "config", "data", "rendezvous", "process_group", "auto", "model", "steps")
BOUND_S = 5.0  # the bound on a worker's life after its launcher's; LAUNCHER_GONE_BOUND_S states 2 s
_WAITED = re.compile(r"waited ([0-9.]+) s for pid")


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


def _environment(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", **extra}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    return env


def one_round(folder: Path, rng: random.Random) -> dict[str, object]:
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--nnodes=1", "-m", "torchtitan_lite.train",
         *_ARGS, "--job.dump_folder", str(folder)],
        cwd=REPO_ROOT, env=_environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
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


# --------------------------------------------------------------------------------------------
# --startup: kills across start-up, three kinds, chains of faults, losses compared
# --------------------------------------------------------------------------------------------


def phases_at(log: Path, when: float) -> dict[int, tuple[str, str]]:
    """Each worker's (rank, phase) at unix time ``when``, by pid, from a ``tests/startup_phases.py``
    log (``<time> <rank> <pid> <phase>`` lines); a worker that logged nothing yet is not in it."""
    found: dict[int, tuple[str, str]] = {}
    try:
        lines = log.read_text().splitlines()
    except FileNotFoundError:
        return found
    for line in lines:
        parts = line.split()
        if len(parts) == 4 and float(parts[0]) <= when:
            found[int(parts[2])] = (parts[1], parts[3])
    return found


def launch_job(folder: Path, steps: int, log: Path, out: Path) -> subprocess.Popen[bytes]:
    """The job into ``folder`` on 2 ranks, its output to ``out`` (``tests/startup_phases.py``: the
    entry point, its phases logged to ``log``)."""
    with out.open("ab") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--nnodes=1", "tests/startup_phases.py", *_STARTUP_ARGS,
             "--training.steps", str(steps), "--job.dump_folder", str(folder)],
            cwd=REPO_ROOT, env=_environment(PHASE_LOG=str(log)), stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True)


def _gone(pid: int) -> tuple[bool, int | None]:
    """Whether ``pid`` has ended, and its exit code when this process reaped it (an orphan it
    adopted as subreaper; the agent reaps the workers it outlives)."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return True, os.waitstatus_to_exitcode(status)
        return False, None
    except ChildProcessError:  # the agent's child still
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return True, None
        return stat[stat.rindex(")") + 2] == "Z", None


def _kill(agent: subprocess.Popen[bytes], kind: str) -> None:
    if kind == "group-kill":
        os.killpg(agent.pid, signal.SIGKILL)
    elif kind == "agent-kill":
        os.kill(agent.pid, signal.SIGKILL)
    else:
        os.killpg(agent.pid, signal.SIGTERM)


def startup_round(agent: subprocess.Popen[bytes], kind: str, moment: float, started: float,
                  log: Path) -> dict[str, Any]:
    """Hit ``agent`` ``moment`` seconds after ``started``; how long each of its workers lived on."""
    while time.monotonic() - started < moment and agent.poll() is None:
        time.sleep(0.005)
    if agent.poll() is not None:
        return {"moment_s": round(moment, 3), "finished": True, "code": agent.returncode}
    workers = children(agent.pid)
    when = time.time()
    _kill(agent, kind)
    hit = time.monotonic()
    phases = phases_at(log, when)
    workers = sorted(set(workers) | set(phases))  # one started at the last moment, too
    ended: dict[int, tuple[float, int | None]] = {}
    while time.monotonic() - hit < 60 and len(ended) < len(workers):
        for pid in workers:
            if pid not in ended:
                done, code = _gone(pid)
                if done:
                    ended[pid] = (time.monotonic() - hit, code)
        time.sleep(0.005)
    agent.wait()
    for pid in workers:  # past the hang bound: ended here, and reported as such
        if pid not in ended:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
    return {"moment_s": round(moment, 3), "finished": False, "workers": [
        {"pid": pid, "rank": phases.get(pid, ("?", ""))[0], "phase": phases.get(pid, ("", "start"))[1],
         "outlived_s": None if pid not in ended else round(ended[pid][0], 3),
         "exit_code": None if pid not in ended else ended[pid][1]} for pid in workers]}


def logged_losses(path: Path) -> list[tuple[int, float]]:
    """``(step, loss)`` of each record of a ``metrics.jsonl``, in order (a resumed step's twice)."""
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def run_chain(folder: Path, kind: str, faults: int, window: float, steps: int, rng: random.Random,
              reference: dict[int, float]) -> dict[str, Any]:
    """``faults`` hits in a row on one job, each launch started at once after the last, then the
    job to its end; its losses against ``reference``."""
    folder.mkdir(parents=True)
    rounds: list[dict[str, Any]] = []
    waits: list[float] = []
    refused, final = 0, None
    for index in range(faults + 1):
        log, out = folder / f"phases-{index}", folder / f"out-{index}"
        started = time.monotonic()
        agent = launch_job(folder / "job", steps, log, out)
        if index < faults:
            result = startup_round(agent, kind, rng.uniform(0.0, window), started, log)
            result["store_refused"] = out.read_text(errors="replace").count("refuses connections) is gone")
            rounds.append(result)
            _print_round(kind, len(rounds), result)
        else:
            agent.wait(timeout=3600)
            final = agent.returncode
        if index:  # this launch followed a fault: did its rank 0 wait for a lock, or was it refused?
            text = out.read_text(errors="replace")
            waits += [float(w) for w in _WAITED.findall(text)]
            refused += "another job is using it" in text
        if rounds and rounds[-1].get("finished"):
            final = rounds[-1]["code"]
            break
    logged = logged_losses(folder / "job" / "metrics.jsonl")
    differ = [(step, loss, reference.get(step)) for step, loss in logged if reference.get(step) != loss]
    damaged = sorted(p.name for p in (folder / "job" / "checkpoint").glob("*.corrupt"))
    return {"kind": kind, "rounds": rounds, "final_exit": final, "lock_waits_s": waits, "refused": refused,
            "steps_logged": len(logged), "steps_covered": len({s for s, _ in logged}), "differ": differ[:5],
            "damaged": damaged}


def _print_round(kind: str, index: int, result: dict[str, Any]) -> None:
    if result.get("finished"):
        print(f"{kind} {index:3d}: at {result['moment_s']:6.3f} s the job had ended", flush=True)
        return
    workers = result["workers"]
    said = ", ".join(f"rank {w['rank']} in {w['phase']}: "
                     + ("still running" if w["outlived_s"] is None else f"gone after {w['outlived_s']:.3f} s")
                     + ("" if w["exit_code"] is None else f" (exit {w['exit_code']})")
                     for w in workers) or "no worker yet (agent)"
    print(f"{kind} {index:3d}: at {result['moment_s']:6.3f} s: {said}", flush=True)


def startup(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    kinds = args.kinds.split(",")
    report: dict[str, Any] = {"window_s": args.window, "chain": args.chain, "steps": args.steps, "kinds": {}}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print(f"reference: {args.steps} steps uninterrupted", flush=True)
        ref = launch_job(root / "reference" / "job", args.steps, root / "ref-phases", root / "ref-out")
        if ref.wait(timeout=3600) != 0:
            print((root / "ref-out").read_text()[-3000:])
            return 2
        reference = dict(logged_losses(root / "reference" / "job" / "metrics.jsonl"))
        for kind in kinds:
            chains = []
            done = 0
            while done < args.kills:
                chain = run_chain(root / f"{kind}-{len(chains)}", kind, min(args.chain, args.kills - done),
                                  args.window, args.steps, rng, reference)
                chains.append(chain)
                done += len(chain["rounds"])
                print(f"{kind}: chain {len(chains)}: {len(chain['rounds'])} faults, final exit "
                      f"{chain['final_exit']}, {chain['steps_covered']} of {args.steps} steps, losses "
                      f"{'equal' if not chain['differ'] else 'DIFFER ' + str(chain['differ'])}, lock waits "
                      f"{chain['lock_waits_s']}, refused {chain['refused']}, damaged {chain['damaged']}", flush=True)
            summary = _summarize(kind, chains, args.steps)
            ok = ok and bool(summary["ok"])
            report["kinds"][kind] = {"summary": summary, "chains": chains}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


def _summarize(kind: str, chains: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    worst: dict[str, float] = {}
    count: dict[str, int] = {}
    codes: dict[str, set[int]] = {}
    kills = left = 0
    for chain in chains:
        for result in chain["rounds"]:
            if result.get("finished"):
                continue
            kills += 1
            if not result["workers"]:
                count["agent"] = count.get("agent", 0) + 1
            for w in result["workers"]:
                phase = w["phase"]
                count[phase] = count.get(phase, 0) + 1
                if w["outlived_s"] is None:
                    left += 1
                else:
                    worst[phase] = max(worst.get(phase, 0.0), w["outlived_s"])
                if w["exit_code"] is not None:
                    codes.setdefault(phase, set()).add(w["exit_code"])
    by_store = sum(r.get("store_refused", 0) for chain in chains for r in chain["rounds"])
    waits = [w for chain in chains for w in chain["lock_waits_s"]]
    refused = sum(int(chain["refused"]) for chain in chains)
    equal = all(not chain["differ"] and chain["final_exit"] == 0 and chain["steps_covered"] == steps
                and not chain["damaged"] for chain in chains)
    overall = max(worst.values(), default=0.0)
    print(f"{kind}: {kills} kills; workers by phase hit (count, worst time to gone, exit codes seen):")
    for phase in PHASES:
        if phase in count:
            seen = ", ".join(map(str, sorted(codes.get(phase, ())))) or (
                "no worker" if phase == "agent" else "reaped by the agent")
            print(f"  {phase:14s} {count[phase]:4d}  " + (f"{worst[phase]:.3f} s" if phase in worst else "-")
                  + f"  ({seen})")
    print(f"{kind}: worst {overall:.3f} s; {left} worker(s) alive 60 s on; {by_store} found out from the agent's "
          f"store; relaunches waited for a lock {len(waits)} "
          f"time(s) (longest {max(waits, default=0.0):.2f} s), refused {refused}; losses of every chain equal to "
          f"the uninterrupted run's: {equal}", flush=True)
    return {"kills": kills, "worst_s": overall, "worst_by_phase_s": worst, "count_by_phase": count,
            "exit_codes_by_phase": {k: sorted(v) for k, v in codes.items()}, "left": left, "lock_waits_s": waits,
            "refused": refused, "losses_equal": equal, "found_out_from_the_store": by_store,
            "ok": left == 0 and overall <= BOUND_S and refused == 0 and equal}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=50, help="kills (per kind with --startup)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the rounds here")
    parser.add_argument("--startup", action="store_true", help="kills across start-up, chains of faults, losses")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"with --startup: some of {', '.join(KINDS)}")
    parser.add_argument("--window", type=float, default=15.0, help="with --startup: kill within this many s")
    parser.add_argument("--chain", type=int, default=10, help="with --startup: faults in a row on one job")
    parser.add_argument("--steps", type=int, default=1600, help="with --startup: the job's training.steps")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        print("Linux only (PR_SET_CHILD_SUBREAPER, /proc)")
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(ctypes.c_int(36), ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if args.startup:
        unknown = set(args.kinds.split(",")) - set(KINDS)
        if unknown:
            print(f"--kinds: invalid value {args.kinds!r}; choose among {', '.join(KINDS)}")
            return 2
        return startup(args)
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
