"""Integration-test runner: launch a matrix of real training jobs and compare their losses with
stored baselines.

Every case runs the real entry point, one or more times in the case's own dump folder::

    python -m torch.distributed.run --nproc_per_node=N --rdzv-backend=c10d
        --rdzv-endpoint=127.0.0.1:<free port> --nnodes=1 -m torchtitan_lite.train
        --job.config_file train_configs/integration_test.toml --job.dump_folder <dump> <overrides>

on GPUs (one rank per GPU, NCCL) or, where there are none, as CPU processes on gloo. The base
config is a tiny, deterministic fp32 job (llama3 "tiny", seq_len 32, 4 steps, a loss record at
every step); each case adds its own command-line overrides.

Usage::

    python scripts/integration_tests.py                       # every case that fits (see --ngpu)
    python scripts/integration_tests.py --ngpu 2 --test_name default_reshard,checkpoint_resume
    python scripts/integration_tests.py --list
    python scripts/integration_tests.py --generate_baselines --device cpu   # rewrite baselines
    python scripts/integration_tests.py --test_name restart_after_kill --repeat 10  # 10 in a row

Also runnable as ``python -m scripts.integration_tests`` from the repository root.

Baselines
    ``tests/assets/losses/<device>_<case>.jsonl`` (device ``cpu`` or ``cuda``; ``--baseline_dir``
    moves the folder). A case's baseline holds the records of *all* its runs, in the order they
    were written: ``metrics.jsonl`` is appended to by every run of the case, and the runner takes
    each run's new records, one line per logged step::

        {"run": 1, "step": 1, "loss": 6.077266693115234}
        {"run": 2, "step": 5, "loss": 5.2117, "validation_loss": 5.30}

    so a resumed run is checked to continue from the saved step (its step numbers) with the
    saved state (its losses). A step logged twice within one run (torchrun restarted the run's
    workers, which resumed from a checkpoint before it) keeps its last record: the one the run's
    final weights descend from. ``validation_loss`` appears where the job computed one and is
    compared like the loss. A case may add a check of its own over its runs' records (the
    restart case: a restart happened, and the restarted run's losses equal the uninterrupted
    run's bit for bit on CPU). A case passes when every run exits 0 and its records have the
    baseline's (run, step) keys with every loss within tolerance. A missing baseline is a
    failure that says how to generate it; ``--generate_baselines`` writes the files from this
    run instead of comparing.

Tolerances (relative; ``|got - expected| <= rtol * |expected| + 1e-6``; ``--rtol`` overrides)
    cpu:  rtol 1e-4. The base job is fp32 with deterministic algorithms on gloo. Measured on a
          2-core machine: three full runs of every case (bf16 included) gave bit-identical
          losses (difference 0), as did 2 threads per rank instead of 1 (fp32 and bf16); the
          same global batch on 2 ranks with accumulation vs. 4 ranks (HSDP, reshard 2) differs
          by 2e-8 (summation order). 1e-4 leaves room for other CPUs' kernels and reduction
          orders while the smallest real change in this matrix, bf16 instead of fp32 compute,
          moves losses by up to 5.5e-4 within 4 steps; resuming without the optimizer state
          or without the data position moves them by 2e-2 to 1e-1.
    cuda: rtol 5e-3. NCCL reductions and cuBLAS kernels differ by GPU model and library
          version; bf16 compute rounds to 3 significant digits.

Exit code 0 only when every selected case passed; 1 when any failed; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan_lite.distributed import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "train_configs" / "integration_test.toml"
DEFAULT_BASELINE_DIR = REPO_ROOT / "tests" / "assets" / "losses"
DEFAULT_RUN_TIMEOUT_S = 300.0
DUMP_PLACEHOLDER = "{dump}"

#: Relative loss tolerance per device type (see the module docstring for the reasons).
DEFAULT_RTOL = {"cpu": 1e-4, "cuda": 5e-3}
#: Absolute slack added to every comparison (losses are O(1); this only matters near zero).
ATOL = 1e-6
#: Loss-like keys of metrics.jsonl that are stored in baselines and compared.
LOSS_KEYS = ("loss", "validation_loss")

__all__ = [
    "CASES",
    "CaseResult",
    "Run",
    "TestCase",
    "compare_losses",
    "main",
    "select_cases",
]


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One launch of the trainer within a case."""

    overrides: list[str]
    """Command-line overrides applied on the base TOML; ``{dump}`` becomes the case's dump folder."""
    nproc: int | None = None
    """Processes (ranks) for this run; unset: the case's ``ngpu``."""
    script: str | None = None
    """Entry point: a repository-relative script taking the trainer's arguments (a fault-injecting
    wrapper such as tests/kill_at_step.py) instead of ``-m torchtitan_lite.train``."""
    torchrun_args: list[str] = field(default_factory=list)
    """Extra torchrun options, e.g. ``--max-restarts=2``."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of the run."""
    nodes: int = 1
    """Loopback nodes: that many torchrun agents (``--nnodes``, a c10d rendezvous on 127.0.0.1),
    each with ``nproc / nodes`` ranks."""
    fails: bool = False
    """The run is meant to end with a non-zero exit (a fault it injects): it passes when it ends
    by itself within the timeout, with any code but 0; its records still count."""


@dataclass
class TestCase:
    """A named integration test: its runs execute one after another in one dump folder."""

    name: str
    """Identifier (``--test_name``; baseline file ``<device>_<name>.jsonl``)."""
    description: str
    """What the case checks, one line."""
    runs: list[Run]
    """The launches, in order (a plain list of overrides is taken as a :class:`Run`)."""
    ngpu: int = 2
    """Ranks (GPUs) the case needs: the most any of its runs uses."""
    rtol: dict[str, float] = field(default_factory=dict)
    """Per-device relative tolerance where this case needs its own (default: DEFAULT_RTOL)."""
    config_file: str | None = None
    """The case's own base TOML (repository-relative) instead of the runner's ``--config_file``."""
    check: Callable[[list[list[dict[str, Any]]], str], str | None] | None = None
    """A check of the case's own, besides the baseline: given every run's metrics.jsonl records as
    logged (a restarted run's repeated steps included) and the device, None or what is wrong."""

    __test__ = False  # not a pytest class, despite the name

    def __post_init__(self) -> None:
        self.runs = [r if isinstance(r, Run) else Run(list(r)) for r in self.runs]
        if not self.runs:
            raise ValueError(f"test case {self.name!r} has no runs")
        for i, run in enumerate(self.runs, 1):
            nproc = self.nproc(run)
            if not 1 <= nproc <= self.ngpu:
                raise ValueError(f"test case {self.name!r}: run {i} uses {nproc} processes, "
                                 f"expected 1..ngpu={self.ngpu}")

    def nproc(self, run: Run) -> int:
        return self.ngpu if run.nproc is None else run.nproc


_CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2"]

# The restart case: 30 steps, checkpoints every 5; rank 1 SIGKILLed as step 12 begins (once rank 0
# has logged step 11); torchrun restarts both workers, which resume from step 10.
_RESTART_STEPS, _RESTART_KILL_AT, _RESTART_INTERVAL = 30, 12, 5
_RESTART_RUN = ["--training.steps", str(_RESTART_STEPS), "--checkpoint.enable",
                "--checkpoint.interval", str(_RESTART_INTERVAL)]


_FAULT_STEPS, _FAULT_AT, _FAULT_INTERVAL = 12, 7, 3
_FAULT_RUN = ["--training.steps", str(_FAULT_STEPS), "--checkpoint.enable", "--checkpoint.interval",
              str(_FAULT_INTERVAL), "--comm.train_timeout_seconds", "10"]


def _resumed_like_uninterrupted(runs: list[list[dict[str, Any]]], device: str) -> str | None:
    """Run 2 stopped at the fault (after step ``_FAULT_AT - 1``); run 3 resumed from the last
    checkpoint before it and logged the steps after it with the losses of run 1 (the same job
    uninterrupted): bit for bit on CPU, within the device's tolerance on CUDA."""
    full, faulted, resumed = runs
    saved = _FAULT_AT - 1 - (_FAULT_AT - 1) % _FAULT_INTERVAL
    if [int(r["step"]) for r in faulted][-1:] != [_FAULT_AT - 1]:
        return f"run 2 logged steps {_span([int(r['step']) for r in faulted])}, expected 1-{_FAULT_AT - 1}"
    steps = [int(r["step"]) for r in resumed]
    if steps != list(range(saved + 1, _FAULT_STEPS + 1)):
        return f"run 3 logged steps {_span(steps)}, expected {saved + 1}-{_FAULT_STEPS} (resumed from step {saved})"
    reference = {int(r["step"]): r["loss"] for r in full}
    rtol = 0.0 if device == "cpu" else DEFAULT_RTOL[device]
    for r in resumed:
        want = reference[int(r["step"])]
        if abs(r["loss"] - want) > rtol * abs(want):
            return f"run 3 step {r['step']}: loss {r['loss']!r}, the uninterrupted run's {want!r}"
    return None


def _restarted_like_uninterrupted(runs: list[list[dict[str, Any]]], device: str) -> str | None:
    """Run 2 (killed, restarted) logged the steps after its last checkpoint again, and its final
    losses from the kill's checkpoint on equal run 1's (uninterrupted): bit for bit on CPU,
    within the device's tolerance on CUDA."""
    full, restarted = runs
    resumed = _RESTART_KILL_AT - 1 - (_RESTART_KILL_AT - 1) % _RESTART_INTERVAL  # the checkpoint: 10
    steps = [int(r["step"]) for r in restarted]
    expected = [*range(1, _RESTART_KILL_AT), *range(resumed + 1, _RESTART_STEPS + 1)]
    if steps != expected:
        return (f"run 2 logged steps {_span(steps)}, expected {_span(expected[:_RESTART_KILL_AT - 1])} and, "
                f"after the restart from step {resumed}, {resumed + 1}-{_RESTART_STEPS}")
    reference = {int(r["step"]): r["loss"] for r in full}
    rtol = 0.0 if device == "cpu" else DEFAULT_RTOL[device]
    for record in restarted[_RESTART_KILL_AT - 1:]:
        step, loss, want = int(record["step"]), record["loss"], reference.get(int(record["step"]))
        if want is None or not (loss == want if rtol == 0 else _close(loss, want, rtol)):
            return (f"run 2 after its restart, step {step}: loss {loss!r}, the uninterrupted run 1's {want!r} "
                    f"({'bit for bit' if rtol == 0 else f'rtol {rtol:g}'})")
    return None


CASES: list[TestCase] = [
    TestCase("single_rank", "one process: the plain FSDP path without collectives across ranks",
             [[]], ngpu=1),
    TestCase("single_rank_bf16_resume", "one process in bf16 (autocast over fp32 weights): save every 2 steps "
             "for 4 steps, then resume from step 4 to step 8",
             [[*_CKPT, "--training.mixed_precision_param", "bfloat16", "--training.steps", "4"],
              [*_CKPT, "--training.mixed_precision_param", "bfloat16", "--training.steps", "8"]], ngpu=1),
    TestCase("default_reshard", "FSDP over 2 ranks, reshard_after_forward_mode default",
             [["--parallelism.reshard_after_forward_mode", "default"]]),
    TestCase("reshard_never", "reshard_after_forward_mode never (parameters kept from forward to backward)",
             [["--parallelism.reshard_after_forward_mode", "never"]]),
    TestCase("reshard_always", "reshard_after_forward_mode always (every unit resharded after forward)",
             [["--parallelism.reshard_after_forward_mode", "always"]]),
    TestCase("reshard_int_2", "reshard_after_forward_mode 2: reshard to groups of 2 of the 4 shard ranks",
             [["--parallelism.reshard_after_forward_mode", "2"]], ngpu=4),
    TestCase("reshard_auto", "reshard_after_forward_mode auto under a 2.3 MiB budget: rank 0 plans per unit "
             "(never 2.21 MiB estimated, always 2.01, headroom 0.19: it reshards layers.0), every rank "
             "applies the plan", [["--parallelism.reshard_after_forward_mode", "auto",
                                   "--parallelism.memory_budget_gib", "0.00222"]]),
    TestCase("bf16_mixed_precision", "bf16 all-gathers and compute, fp32 sharded params and reductions",
             [["--training.mixed_precision_param", "bfloat16",
               "--training.mixed_precision_reduce", "float32"]]),
    TestCase("cpu_offload", "FSDP2 CPUOffloadPolicy: sharded params, grads and optimizer state on CPU",
             [["--training.enable_cpu_offload"]]),
    TestCase("hsdp_2x2", "HSDP: 2 replicas x 2 shards on a 2-D mesh",
             [["--parallelism.data_parallel_replicate_degree", "2",
               "--parallelism.data_parallel_shard_degree", "2"]], ngpu=4),
    TestCase("context_parallel_2x2", "data parallel 2 x context parallel 2: each rank holds half of every "
             "sequence (head-tail chunks), keys and values gathered, packed documents (block-causal)",
             [["--parallelism.context_parallel_degree", "2", "--model.attention_mask", "block_causal"]], ngpu=4),
    TestCase("context_parallel_ulysses_4", "context parallel 4 with Ulysses (all-to-all from sequence to heads)",
             [["--parallelism.context_parallel_degree", "4", "--parallelism.context_parallel_method", "ulysses"]],
             ngpu=4),
    TestCase("gradient_accumulation", "global batch 8 = 2 ranks x 2 samples x 2 accumulation steps",
             [["--training.global_batch_size", "8"]]),
    TestCase("checkpoint_resume", "save every 2 steps for 4 steps, then resume from step 4 to step 8",
             [[*_CKPT, "--training.steps", "4"],
              [*_CKPT, "--training.steps", "8"]]),
    TestCase("async_checkpoint_resume", "async saves (background writer over gloo), then resume from the last",
             [[*_CKPT, "--checkpoint.async_mode", "async", "--training.steps", "4"],
              [*_CKPT, "--checkpoint.async_mode", "async", "--training.steps", "8"]]),
    TestCase("resume_world_size_2_to_4", "save at 2 ranks, resume at 4 (global batch fixed at 8)",
             [Run([*_CKPT, "--training.global_batch_size", "8", "--training.steps", "4"], nproc=2),
              Run([*_CKPT, "--training.global_batch_size", "8", "--training.steps", "8"], nproc=4)],
             ngpu=4),
    TestCase("resume_world_size_2_to_1", "save at 2 ranks, resume on 1 (global batch fixed at 4)",
             [Run([*_CKPT, "--training.global_batch_size", "4", "--training.steps", "4"], nproc=2),
              Run([*_CKPT, "--training.global_batch_size", "4", "--training.steps", "8"], nproc=1)]),
    TestCase("seed_checkpoint", "seed checkpoint written by 1 process, then a 2-rank run starting from it",
             [Run(["--checkpoint.create_seed_checkpoint"], nproc=1),
              Run(["--checkpoint.enable", "--checkpoint.interval", "100"], nproc=2)]),
    TestCase("hf_export_import", "export the last save as HF safetensors, then start a new run from it",
             [["--checkpoint.enable", "--checkpoint.interval", "100",
               "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf"],
              ["--checkpoint.enable", "--checkpoint.interval", "100", "--checkpoint.folder", "hf_import",
               "--checkpoint.initial_load_path", "{dump}/checkpoint/step-4",
               "--checkpoint.initial_load_in_hf"]]),
    TestCase("validation", "validation loss every 2 steps over 2 batches",
             [["--validation.enable", "--validation.freq", "2", "--validation.steps", "2"]]),
    TestCase("restart_after_kill", f"torchrun --max-restarts=2: rank 1 SIGKILLed at step {_RESTART_KILL_AT} "
             f"of {_RESTART_STEPS}, checkpoints every {_RESTART_INTERVAL}; the restarted workers resume and "
             f"finish with the losses of run 1, the same job uninterrupted (bit for bit on CPU)",
             [Run([*_RESTART_RUN, "--checkpoint.folder", "uninterrupted"]),
              Run(_RESTART_RUN, script="tests/kill_at_step.py", torchrun_args=["--max-restarts=2"],
                  env={"KILL_RANK": "1", "KILL_AT_STEP": str(_RESTART_KILL_AT)})],
             check=_restarted_like_uninterrupted),
    TestCase("node_killed_two_loopback_nodes",
             f"two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1), 2 ranks each, HSDP: node 1's agent "
             f"and ranks SIGKILLed as step {_FAULT_AT} begins; node 0 ends by itself, and the job run again on two "
             f"nodes resumes from step {_FAULT_AT - 1 - (_FAULT_AT - 1) % _FAULT_INTERVAL} with the losses of the "
             "same job uninterrupted (bit for bit on CPU)",
             [Run([*_FAULT_RUN, "--checkpoint.folder", "uninterrupted"], nodes=2),
              Run(_FAULT_RUN, nodes=2, script="tests/kill_at_step.py", fails=True,
                  env={"KILL_RANK": "2", "KILL_AT_STEP": str(_FAULT_AT), "KILL_NODE": "1"}),
              Run(_FAULT_RUN, nodes=2)],
             ngpu=4, check=_resumed_like_uninterrupted),
    TestCase("stopped_rank",
             f"rank 1 SIGSTOPped (alive, silent) as step {_FAULT_AT} begins: rank 0 fails at the collective "
             "timeout (comm.train_timeout_seconds = 10) and the job ends by itself; run again, it resumes with "
             "the losses of the same job uninterrupted (bit for bit on CPU)",
             [Run([*_FAULT_RUN, "--checkpoint.folder", "uninterrupted"]),
              Run(_FAULT_RUN, script="tests/kill_at_step.py", fails=True,
                  env={"KILL_RANK": "1", "KILL_AT_STEP": str(_FAULT_AT), "KILL_SIGNAL": "SIGSTOP"}),
              Run(_FAULT_RUN)],
             check=_resumed_like_uninterrupted),
    TestCase("debug_model_default", "the README's default job unchanged: debug model, 100 steps on the "
             "embedded corpus (this Python's standard library: baselines are per Python version), validation "
             "at steps 50 and 100, TensorBoard on", [[]], config_file="train_configs/debug_model.toml"),
]


def override_keys(overrides: Iterable[str]) -> list[tuple[str, str]]:
    """The ``(section, key)`` pairs an override list sets (``--section.no-flag`` → ``flag``)."""
    keys = []
    for arg in overrides:
        if not arg.startswith("--"):
            continue
        name = arg[2:].partition("=")[0]
        section, _, key = name.partition(".")
        if key.startswith(("no-", "no_")):
            key = key[3:]
        keys.append((section.replace("-", "_"), key.replace("-", "_")))
    return keys


def case_names(cases: Sequence[TestCase] = CASES) -> list[str]:
    return [c.name for c in cases]


def parse_test_names(values: Iterable[str] | None) -> list[str]:
    """``--test_name`` values, each one name or a comma list, flattened in order, without repeats."""
    names: list[str] = []
    for value in values or []:
        for name in value.split(","):
            name = name.strip()
            if name and name not in names:
                names.append(name)
    return names


def select_cases(cases: Sequence[TestCase], *, names: Sequence[str] | None,
                 ngpu: int) -> tuple[list[TestCase], list[tuple[TestCase, str]]]:
    """Cases to run and ``(case, reason)`` for the selected ones skipped for want of ranks.

    ``names`` (empty or None: all) filters by name; an unknown name raises ``ValueError``
    naming the known ones. Order follows ``cases``.
    """
    known = {c.name for c in cases}
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        raise ValueError(f"--test_name: unknown case(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(c.name for c in cases)}")
    chosen = [c for c in cases if not names or c.name in names]
    run = [c for c in chosen if c.ngpu <= ngpu]
    skipped = [(c, f"needs {c.ngpu} ranks, --ngpu {ngpu}") for c in chosen if c.ngpu > ngpu]
    return run, skipped


# --------------------------------------------------------------------------------------------
# Baselines
# --------------------------------------------------------------------------------------------


def baseline_path(baseline_dir: Path, device: str, case: str) -> Path:
    return Path(baseline_dir) / f"{device}_{case}.jsonl"


def loss_records(metrics: Sequence[dict[str, Any]], *, run: int) -> list[dict[str, Any]]:
    """Baseline records (run, step and the loss keys present) from one run's metrics.jsonl records;
    a step logged again (workers restarted from an earlier checkpoint) keeps its last record."""
    rows: dict[int, dict[str, Any]] = {}
    for record in metrics:
        step = int(record["step"])
        row: dict[str, Any] = {"run": run, "step": step}
        for key in LOSS_KEYS:
            if record.get(key) is not None:
                row[key] = float(record[key])
        rows.pop(step, None)
        rows[step] = row
    return sorted(rows.values(), key=lambda r: r["step"])


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, records: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _close(got: float, expected: float, rtol: float) -> bool:
    if math.isnan(got) or math.isnan(expected):
        return False
    return abs(got - expected) <= rtol * abs(expected) + ATOL


def compare_losses(expected: Sequence[dict[str, Any]], got: Sequence[dict[str, Any]], *,
                   rtol: float) -> str | None:
    """None when ``got`` matches ``expected``; otherwise one line about the first difference."""
    exp_keys = [(r.get("run", 1), r["step"]) for r in expected]
    got_keys = [(r.get("run", 1), r["step"]) for r in got]
    for e, g in zip(expected, got, strict=False):
        ek, gk = (e.get("run", 1), e["step"]), (g.get("run", 1), g["step"])
        if ek != gk:
            return (f"run {ek[0]} step {ek[1]}: expected a record for it, got run {gk[0]} step {gk[1]} "
                    f"(logged steps {_steps(got_keys)} vs baseline {_steps(exp_keys)})")
        for key in LOSS_KEYS:
            if key not in e and key not in g:
                continue
            if key not in g:
                return f"run {ek[0]} step {ek[1]}: expected {key} {e[key]:.6f}, got none"
            if key not in e:
                return f"run {ek[0]} step {ek[1]}: got {key} {g[key]:.6f}, the baseline has none"
            if not _close(float(g[key]), float(e[key]), rtol):
                rel = abs(g[key] - e[key]) / abs(e[key]) if e[key] else math.inf
                return (f"run {ek[0]} step {ek[1]}: expected {key} {e[key]:.6f}, got {g[key]:.6f} "
                        f"(relative difference {rel:.1e} > rtol {rtol:g})")
    if len(got) != len(expected):
        return (f"{len(got)} loss records, baseline has {len(expected)} "
                f"(logged steps {_steps(got_keys)} vs baseline {_steps(exp_keys)})")
    return None


def _steps(keys: Sequence[tuple[int, int]]) -> str:
    runs: dict[int, list[int]] = {}
    for run, step in keys:
        runs.setdefault(run, []).append(step)
    return "; ".join(f"run {r}: {_span(s)}" for r, s in runs.items()) or "none"


def _span(steps: list[int]) -> str:
    if steps == list(range(steps[0], steps[-1] + 1)) and len(steps) > 2:
        return f"{steps[0]}-{steps[-1]}"
    return ",".join(map(str, steps))


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


@dataclass
class CaseResult:
    name: str
    ngpu: int
    status: str  # PASS, FAIL or SKIP
    seconds: float = 0.0
    reason: str = ""


def launch_command(*, nproc: int, config_file: Path, dump: Path, overrides: Sequence[str],
                   port: int | None = None, script: str | None = None,
                   torchrun_args: Sequence[str] = (), nodes: int = 1, node_rank: int = 0) -> list[str]:
    """The torchrun command of one run (``{dump}`` in overrides replaced by the dump folder); with
    ``nodes`` > 1, the command of loopback node ``node_rank`` (``nproc / nodes`` ranks)."""
    where = ["--nnodes=1"] if nodes == 1 else [f"--nnodes={nodes}", f"--node_rank={node_rank}",
                                                "--rdzv-id=integration", "--max-restarts=0"]
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc // nodes}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port or free_port()}", *where,
        *torchrun_args, *([str(REPO_ROOT / script)] if script else ["-m", "torchtitan_lite.train"]),
        "--job.config_file", str(config_file),
        "--job.dump_folder", str(dump),
        *(arg.replace(DUMP_PLACEHOLDER, str(dump)) for arg in overrides),
    ]


_ERROR_LINE = re.compile(r"^(error:|[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b)")
_RANK_PREFIX = re.compile(r"^\[(default)?rank\d+\]:\s?")


def last_error_line(stderr: str) -> str:
    """The last line of a run's stderr that states an error (a rank's ``error: ...`` line or an
    exception), skipping torchrun's own ChildFailedError report; else its last non-empty line."""
    lines = [_RANK_PREFIX.sub("", line).strip() for line in stderr.splitlines()]
    lines = [line for line in lines if line]
    for line in reversed(lines):
        if _ERROR_LINE.match(line) and "ChildFailedError" not in line:
            return line
    return lines[-1] if lines else "(stderr is empty)"


def child_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the trainer picks CUDA whenever it sees a GPU
    return env


def run_process(cmd: Sequence[str] | Sequence[Sequence[str]], *, env: dict[str, str], timeout: float,
                log_prefix: Path) -> tuple[int | None, str]:
    """Run ``cmd`` (or several commands at once: the agents of loopback nodes) each in its own
    process group, stdout/stderr to ``<log_prefix>.{stdout,stderr}.log``; on timeout kill every
    group. Returns (exit code: the first non-zero one, 0, or None on timeout; stderr text)."""
    cmds = [list(cmd)] if isinstance(cmd[0], str) else [list(c) for c in cmd]
    out_path = log_prefix.with_name(log_prefix.name + ".stdout.log")
    err_path = log_prefix.with_name(log_prefix.name + ".stderr.log")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        procs = [subprocess.Popen(c, cwd=REPO_ROOT, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                  start_new_session=True) for c in cmds]
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        try:
            for proc in procs:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes = [None]
        finally:
            for proc in procs:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the group: torchrun and every rank
                except ProcessLookupError:
                    pass
                proc.wait()
    code = None if None in codes else next((c for c in codes if c), 0)
    return code, err_path.read_text(errors="replace")


def run_case(case: TestCase, *, device: str, config_file: Path, output_dir: Path, baseline_dir: Path,
             generate: bool, rtol: float | None, timeout: float) -> CaseResult:
    """Run every run of ``case`` in ``<output_dir>/<case>``; compare (or write) its baseline."""
    start = time.monotonic()
    dump = (output_dir / case.name).resolve()
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    metrics_path = dump / "metrics.jsonl"
    records: list[dict[str, Any]] = []
    logged: list[list[dict[str, Any]]] = []  # each run's metrics.jsonl records, as written
    seen = 0

    def result(status: str, reason: str = "") -> CaseResult:
        return CaseResult(case.name, case.ngpu, status, time.monotonic() - start, reason)

    if case.config_file is not None:
        config_file = REPO_ROOT / case.config_file
    for i, run in enumerate(case.runs, 1):
        port = free_port()
        cmds = [launch_command(nproc=case.nproc(run), config_file=config_file, dump=dump, overrides=run.overrides,
                               script=run.script, torchrun_args=run.torchrun_args, port=port, nodes=run.nodes,
                               node_rank=node) for node in range(run.nodes)]
        env_text = "".join(f"{k}={shlex.quote(v)} " for k, v in run.env.items())
        for cmd in cmds:
            print(f"[{case.name}] run {i}/{len(case.runs)}: {env_text}{shlex.join(['python', *cmd[1:]])}",
                  flush=True)
        code, stderr = run_process(cmds[0] if len(cmds) == 1 else cmds, env={**child_env(device), **run.env},
                                   timeout=timeout,
                                   log_prefix=dump / f"run{i}")
        if code is None:
            return result("FAIL", f"{case.name}: run {i}/{len(case.runs)} timed out after {timeout:g} s "
                                  f"(process group killed; logs in {dump})")
        if run.fails and code == 0:
            return result("FAIL", f"{case.name}: run {i}/{len(case.runs)} injects a fault but exited with 0")
        if code != 0 and not run.fails:
            return result("FAIL", f"{case.name}: run {i}/{len(case.runs)} exited with code {code}: "
                                  f"{last_error_line(stderr)}")
        metrics = read_jsonl(metrics_path) if metrics_path.exists() else []
        logged.append(metrics[seen:])
        records += loss_records(metrics[seen:], run=i)
        seen = len(metrics)

    if not records:
        return result("FAIL", f"{case.name}: no loss records in {metrics_path}")
    if case.check is not None:
        problem = case.check(logged, device)
        if problem is not None:
            return result("FAIL", f"{case.name}: {problem}")
    path = baseline_path(baseline_dir, device, case.name)
    if generate:
        write_jsonl(path, records)
        return result("PASS", f"baseline written: {_display(path)}")
    if not path.exists():
        return result("FAIL", f"{case.name}: no baseline {_display(path)}; generate it with "
                              f"`python scripts/integration_tests.py --generate_baselines --device {device} "
                              f"--test_name {case.name}`")
    tol = rtol if rtol is not None else case.rtol.get(device, DEFAULT_RTOL[device])
    diff = compare_losses(read_jsonl(path), records, rtol=tol)
    if diff is not None:
        return result("FAIL", f"{case.name}: {diff}")
    return result("PASS")


def combine_repeats(repeats: Sequence[CaseResult]) -> CaseResult:
    """One case run several times (``--repeat``): PASS only when every repeat passed; the reason
    counts them and quotes the first failure."""
    failed = [(k, r) for k, r in enumerate(repeats, 1) if r.status != "PASS"]
    reason = f"{len(repeats) - len(failed)}/{len(repeats)} repeats passed"
    if failed:
        k, first = failed[0]
        reason += f"; repeat {k}: {first.reason}"
    first = repeats[0]
    return CaseResult(first.name, first.ngpu, "FAIL" if failed else "PASS",
                      sum(r.seconds for r in repeats), reason)


def _display(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def format_summary(results: Sequence[CaseResult]) -> str:
    """The summary table: case, ranks, result, seconds, and a reason where there is one."""
    width = max([len("case"), *(len(r.name) for r in results)])
    lines = [f"{'case':<{width}}  ranks  result  seconds  reason",
             f"{'-' * width}  -----  ------  -------  ------"]
    for r in results:
        seconds = f"{r.seconds:7.1f}" if r.status != "SKIP" else f"{'-':>7}"
        lines.append(f"{r.name:<{width}}  {r.ngpu:>5}  {r.status:<6}  {seconds}  {r.reason}".rstrip())
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    total = sum(r.seconds for r in results)
    lines.append(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
                 f"in {total:.1f} s")
    return "\n".join(lines)


def format_case_list(cases: Sequence[TestCase]) -> str:
    lines = []
    for c in cases:
        lines.append(f"{c.name}  ({c.ngpu} rank{'s' if c.ngpu > 1 else ''}): {c.description}")
        for i, run in enumerate(c.runs, 1):
            args = " ".join(run.overrides) or f"({c.config_file or 'base config'} only)"
            launch = [
                *(f"{k}={v}" for k, v in run.env.items()),
                *run.torchrun_args,
                *([run.script] if run.script else []),
            ]
            if launch:
                args = f"[{' '.join(launch)}] {args}"
            lines.append(f"    run {i} on {c.nproc(run)}: {args}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python scripts/integration_tests.py",
        description="Run the integration-test matrix (real torchrun jobs on the tiny base config) "
                    "and compare each case's losses with tests/assets/losses/<device>_<case>.jsonl.",
        epilog=f"Tolerances: relative, cpu {DEFAULT_RTOL['cpu']:g} (fp32 deterministic gloo runs repeat "
               f"bit for bit on one machine; the margin covers other CPUs), cuda {DEFAULT_RTOL['cuda']:g} "
               "(GPU models and NCCL/cuBLAS versions differ); --rtol overrides both. Baselines hold the "
               "losses of all runs of a case, keyed by run and step. Exit code 0 only when every "
               "selected case passed.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ngpu", type=int, default=None,
                        help="run the cases needing at most this many ranks, skip (and report) the "
                             "others; default: the visible GPUs, or 4 on CPU")
    parser.add_argument("--test_name", action="append", metavar="NAME",
                        help="run only these cases (repeatable, or a comma list); see --list")
    parser.add_argument("--output_dir", type=Path, default=None,
                        help="keep every case's dump folder (metrics, checkpoints, run logs) here; "
                             "default: a temporary folder, deleted when every case passed")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cuda: one rank per GPU on NCCL; cpu: CPU processes on gloo "
                             "(CUDA_VISIBLE_DEVICES='' for the jobs); auto: cuda when a GPU is visible")
    parser.add_argument("--config_file", type=Path, default=DEFAULT_CONFIG,
                        help="base TOML the cases' overrides apply to "
                             f"(default: {_display(DEFAULT_CONFIG)})")
    parser.add_argument("--baseline_dir", type=Path, default=DEFAULT_BASELINE_DIR,
                        help="folder of <device>_<case>.jsonl baselines "
                             f"(default: {_display(DEFAULT_BASELINE_DIR)})")
    parser.add_argument("--generate_baselines", action="store_true",
                        help="(re)write the baselines from this run instead of comparing")
    parser.add_argument("--rtol", type=float, default=None,
                        help="relative loss tolerance for every case (default: per device, see below)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_RUN_TIMEOUT_S,
                        help="seconds per run before its process group is killed (default: %(default)g)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run each selected case N times, each in a fresh dump folder "
                             "(<output_dir>/repeat-<k>/<case>); it passes when all N pass (default: 1)")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        names = parse_test_names(args.test_name)
        selected_all, _ = select_cases(CASES, names=names, ngpu=10**6)
    except ValueError as exc:
        parser.error(str(exc))
    if args.list:
        print(format_case_list(selected_all))
        return 0

    gpus = _cuda_device_count() if args.device != "cpu" else 0
    device = ("cuda" if gpus else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and gpus == 0:
        parser.error("--device cuda: no CUDA device is visible")
    ngpu = args.ngpu if args.ngpu is not None else (gpus if device == "cuda" else 4)
    if ngpu < 1:
        parser.error(f"--ngpu: invalid value {ngpu}; expected an integer >= 1")
    if device == "cuda" and ngpu > gpus:
        parser.error(f"--ngpu {ngpu}: only {gpus} CUDA devices are visible (one rank per GPU)")
    if args.repeat < 1:
        parser.error(f"--repeat: invalid value {args.repeat}; expected an integer >= 1")
    if args.repeat > 1 and args.generate_baselines:
        parser.error("--repeat: baselines are generated from one run of each case; leave out --repeat")
    if args.rtol is not None and not args.rtol >= 0:
        parser.error(f"--rtol: invalid value {args.rtol}; expected a number >= 0")
    config_file = args.config_file.resolve()
    if not config_file.is_file():
        parser.error(f"--config_file: file not found: {str(args.config_file)!r}")

    to_run, skipped = select_cases(CASES, names=names, ngpu=ngpu)
    temporary = args.output_dir is None
    output_dir = Path(tempfile.mkdtemp(prefix="integration_tests_")) if temporary else args.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    print(f"integration tests: {len(to_run)} case(s) on {device} (--ngpu {ngpu}), base config "
          f"{_display(config_file)}, output in {output_dir}", flush=True)
    for case, reason in skipped:
        print(f"[{case.name}] SKIP: {reason}", flush=True)

    results = {c.name: CaseResult(c.name, c.ngpu, "SKIP", 0.0, reason) for c, reason in skipped}
    for case in to_run:
        repeats = []
        for k in range(1, args.repeat + 1):
            result = run_case(case, device=device, config_file=config_file,
                              output_dir=output_dir if args.repeat == 1 else output_dir / f"repeat-{k}",
                              baseline_dir=args.baseline_dir, generate=args.generate_baselines,
                              rtol=args.rtol, timeout=args.timeout)
            which = f" repeat {k}/{args.repeat}" if args.repeat > 1 else ""
            print(f"[{case.name}]{which} {result.status} in {result.seconds:.1f} s"
                  + (f": {result.reason}" if result.reason else ""), flush=True)
            repeats.append(result)
        results[case.name] = repeats[0] if args.repeat == 1 else combine_repeats(repeats)
    ordered = [results[c.name] for c in CASES if c.name in results]

    print()
    print(format_summary(ordered))
    failed = any(r.status == "FAIL" for r in ordered)
    if temporary and not failed:
        shutil.rmtree(output_dir, ignore_errors=True)
    elif failed:
        print(f"dump folders and run logs: {output_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
