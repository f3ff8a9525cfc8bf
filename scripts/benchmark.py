"""What FSDP2's knobs cost and buy, measured: trainer overhead, memory per rank by category,
collectives per step, activation checkpointing, compile, meta-device init and start-up time.

    python scripts/benchmark.py --quick                    # a few minutes on a 2-core CPU machine
    python scripts/benchmark.py --json docs/benchmarks/benchmark.json  # also write every figure as JSON
    python scripts/benchmark.py --skip overhead,metainit,startup --world_sizes 1,2 \
        --param_dtypes float32 --cpu_offload off           # memory, collectives, auto: one launch

The script launches its measurements as ``torchrun`` jobs (CPU processes on gloo, or one rank per
GPU where there are GPUs) and prints one table per part. Parts whose figures are counts (memory,
collectives, auto) share one launch per number of ranks; overhead and meta init, which time and
take the resident memory of their processes, get fresh ones:

overhead      tokens/s of the real trainer loop (``Trainer.train``, the code path of
              ``python -m torchtitan_lite.train``) against a bare, hand-written FSDP2 loop on the
              same model, data, batch, optimizer and seed; the two alternate round by round in one
              process group and the ratio of the medians is reported (>= 0.97 is the target).
single        one process: tokens/s of the real trainer loop, which trains the plain model on one
              rank (no FSDP; bf16 through autocast), against a bare eager loop around the same
              model (same init, data, AdamW, schedule and clipping), fp32 and each of
              --param_dtypes, then fp32 at each of --single_vocab_sizes (e.g. Llama 3's 128,256
              ids, where FSDP's copies of the embedding and output cost most); alternating round
              by round, the ratio of the medians (>= 0.97 is the target). Not in the default
              run (--parts single).
memory        per rank and category (sharded/unsharded params, grads, optimizer state,
              activations, temporaries, peak), measured by ``FSDPMemTracker`` over real steps, for
              every reshard mode × parameter dtype (--param_dtypes) × CPU offload setting
              (--cpu_offload), at each world size w (--world_sizes): on CPU processes (gloo), by
              the first w ranks of a launch on the largest world size (FSDP shards over a mesh of
              those w ranks: what a job of w ranks holds); a world size that does not divide the
              largest gets its own launch.
collectives   all-gathers and reduce-scatters per step (count and MiB per rank) counted from the
              ``c10d`` ops that ran, next to what each reshard mode implies.
ac            each activation checkpointing setting (none, full, selective op, selective every
              2nd block) on 2 ranks at ``--ac_seq_len``: activations and peak measured next to
              the estimate, step time, and whether the losses equal those of none.
compile       compiled (blocks and loss) against eager trainer on 2 ranks (--compile_ranks),
              alternating round by round; the ratio of the median step times, and compilation
              time on its own. Then two profiled steps of each: the time in library kernels
              that compiled code calls unchanged (matrix multiplications, the fused attention
              kernels) and in inductor's generated code, and the bound on the ratio were the
              generated code free (the compiled step less its generated code's time).
peak          the estimator's peak per rank against the measured one for every reshard mode ×
              activation checkpointing setting, on --peak_ranks ranks at --flavor, --seq_len,
              --local_batch_size and the first of --param_dtypes, through the real trainer:
              ``torch.cuda.max_memory_allocated`` after two steps on a GPU; on CPU the peak of live
              bytes over one real ``Trainer.train_step`` from torch.profiler's memory timeline (the
              allocator's events: independent of the FSDPMemTracker the estimator runs on), with
              FSDPMemTracker's own peak beside it (tracker vs tracker). Not in the default run (name it in
              --parts, e.g. on one GPU:
              --parts peak --peak_ranks 1 --flavor 1B --seq_len 2048 --param_dtypes bfloat16).
float8        float8 training (the blocks' linears through torchao, float8 all-gather with
              precomputed scales) against the same job without it, eager and compiled, on
              --peak_ranks ranks in the first of --param_dtypes for --float8_steps steps: median
              tokens/s after 10 steps and the loss (mean of the last 10 steps). Not in the
              default run (--parts float8); without float8 matmuls (CPU) in emulation, which
              checks the plumbing, not speed.
auto          reshard_after_forward_mode = auto on 2 ranks under a tight and a loose budget (set
              from the estimates of never and always): the units it reshards, all-gathers per
              step, estimated and measured peak, tokens/s, next to never / default / always.
meta init     peak RSS per rank while building a ~1B-parameter model on the meta device, sharding
              it over 2 ranks, materialising and initialising it, against that rank's shard and
              against a naive full initialisation.
start-up      wall time from launching ``torchrun -m torchtitan_lite.train`` to its first step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
MODES = ("default", "always", "never")
CATEGORY_COLUMNS = ("sharded_params", "unsharded_params", "sharded_grads", "optimizer_state",
                    "activations", "temporaries", "all_gather_buffers", "total")


# --------------------------------------------------------------------------------------------
# Launches that end with the script (shared by the scripts beside this one)
# --------------------------------------------------------------------------------------------

LAUNCHER_GRACE_S = 40.0
"""How long a stopped script waits for its torchrun launcher to end its workers (torchrun gives
them 30 s after passing SIGTERM on) before it SIGKILLs what is left."""


def end_on_signals() -> None:
    """SIGTERM and SIGHUP (``timeout``, a scheduler, a closed terminal) end this script as an
    exception does: its ``finally`` blocks and temporary folders clean up, and
    :func:`run_launched` stops the launch in flight. The exit code is 128 + the signal's number."""
    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def run_launched(cmd: list[str], *, timeout: float | None = None, check: bool = False,
                 **popen: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a torchrun launch, which must not outlive this script: the launcher
    starts in a session of its own, and when this script is stopped (an exception, Ctrl-C,
    :func:`end_on_signals`' signals, ``timeout``) it gets SIGTERM, which torchrun passes on to
    its workers before it ends, then after :data:`LAUNCHER_GRACE_S` SIGKILL to its group.
    (``subprocess.run`` would SIGKILL the launcher at once, and torchrun's workers, in sessions of
    their own, would train on.) torchrun's log folder, which it would leave in the temporary
    folder as ``torchelastic_*`` after every launch, is one of ours, removed at the end."""
    logs = tempfile.mkdtemp(prefix="benchmark_torchrun_logs_")
    if "torch.distributed.run" in cmd and not any(arg.startswith(("--log-dir", "--log_dir")) for arg in cmd):
        at = cmd.index("torch.distributed.run") + 1
        cmd = [*cmd[:at], f"--log-dir={logs}", *cmd[at:]]
    try:
        proc = subprocess.Popen(cmd, start_new_session=True, **popen)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            stop_launched(proc)
            raise
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop_launched(proc: subprocess.Popen) -> None:
    """End a launch of :func:`run_launched`: SIGTERM, then SIGKILL to its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=LAUNCHER_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# --------------------------------------------------------------------------------------------
# Workers (run inside torchrun)
# --------------------------------------------------------------------------------------------


def _kind(op_name: str) -> str | None:
    if "allgather" in op_name or "all_gather" in op_name:
        return "all_gather"
    if "reduce_scatter" in op_name:
        return "reduce_scatter"
    if "allreduce" in op_name or "all_reduce" in op_name:
        return "all_reduce"
    if "all_to_all" in op_name or "alltoall" in op_name:
        return "all_to_all"
    return None


class CollectiveCounter(TorchDispatchMode):
    """Counts c10d collectives and the bytes each rank contributes (input tensors).

    ProcessGroup collectives go through the dispatcher as ``c10d::*`` ops; on CPU autograd
    runs backward in the calling thread, so backward collectives are seen too. Collectives that
    DTensor issues inside its own dispatch (the gradient-norm reduction) run below this mode and
    are not counted: the all_reduce column is the loss reduction.
    """

    def __init__(self, *, unsharded: bool = False) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.unsharded = unsharded
        """Count the unsharded side instead: what an all-gather delivers to the rank (and what a
        reduce-scatter or all-reduce takes in, the rows an all-to-all sends)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torchtitan_lite.distributed.fsdp import InPlaceReduceScatter

        kind = _kind(func._schema.name.split("::")[-1]) if func.namespace in ("c10d", "_c10d_functional") else None
        if kind == "all_reduce" and InPlaceReduceScatter.running:
            kind = "reduce_scatter"  # on gloo apply_fsdp reduce-scatters as an in-place all-reduce
        if kind is not None:
            self.calls[kind] += 1
            # c10d all-gather / reduce-scatter / all-to-all: (output, input, ...); all-reduce (also
            # the in-place reduce-scatter): (tensors, ...); functional collectives: (input, ...)
            name = func._schema.name
            if func.namespace == "_c10d_functional" or "allreduce" in name or "all_reduce" in name:
                source = args[0]
            else:
                source = args[0] if kind == "all_gather" and self.unsharded else args[1]
            tensors = [t for t in torch.utils._pytree.tree_leaves(source)
                       if isinstance(t, torch.Tensor)]
            self.bytes[kind] += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))


def timed_collectives(trainer: Any, steps: int) -> dict[str, Any]:
    """After one warm-up step, ``steps`` timed steps of ``trainer`` (each after a barrier), then
    ``steps`` more with their collectives counted (unsharded bytes; the counter's dispatch mode
    would slow the timed ones): the median step time and, per step, the MiB and calls of each
    kind of collective (every rank's own figures)."""
    import torch.distributed as dist

    trainer.train_step()  # warm-up
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
    counter = CollectiveCounter(unsharded=True)
    with counter:
        for _ in range(steps):
            trainer.train_step()
    return {"step_s": statistics.median(times),
            "mib_per_step": {k: v / steps / 2**20 for k, v in counter.bytes.items()},
            "calls_per_step": {k: v / steps for k, v in counter.calls.items()}}


def sweep_worker(opts: argparse.Namespace, family: str, shape: Any, extra: list[str], record: dict[str, Any]) -> None:
    """The worker of a degree sweep: trains ``shape`` registered as ``family``'s ``bench`` flavor
    (fp32, ``opts``' sequence length, local batch and dump folder, plus ``extra``), times
    ``opts.steps`` steps with their collectives counted (:func:`timed_collectives`) and has rank 0
    write ``record`` with those figures to ``opts.out``."""
    import dataclasses

    import torch.distributed as dist

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.models import MODEL_SPECS, register_model_spec
    from torchtitan_lite.trainer import Trainer

    spec = MODEL_SPECS[family]
    register_model_spec(dataclasses.replace(spec, flavors={**spec.flavors, "bench": shape}), replace=True)
    job = argparse.Namespace(flavor="bench", seq_len=opts.seq_len, local_batch_size=opts.local_batch_size,
                             dump=opts.dump)
    trainer = Trainer(load_job_config(_job_args(job, "--model.name", family, *extra)))
    try:
        result = timed_collectives(trainer, opts.steps)
        if dist.get_rank() == 0:
            Path(opts.out).write_text(json.dumps({**record, **result}))
    finally:
        trainer.close()


def alternating_medians(fns: dict[str, Any], rounds: int, steps: int, device: torch.device) -> dict[str, float]:
    """Seconds per call of each of ``fns`` (name → a no-argument callable): one warm-up call of
    each (compilation, kernel selection), then ``rounds`` rounds timing ``steps`` calls of each in
    turn (between CUDA synchronisations on a GPU); the median over the rounds."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            sync()
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def device_label(device: torch.device) -> str:
    """The device a figure was measured on: the GPU's name, or the CPU and its threads."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"


def sweep_parser(description: str, options: dict[str, int], dump: str) -> argparse.ArgumentParser:
    """The arguments of a degree sweep (``bench_expert_parallel.py``, ``bench_tensor_parallel.py``):
    the integer ``options`` with their defaults, ``--degrees``, ``--json`` and the worker's own."""
    parser = argparse.ArgumentParser(description=description)
    for name, default in options.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--degrees", default="2,4")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    parser.add_argument("--dump", default=dump)
    return parser


def sweep(script: str, opts: argparse.Namespace, degree: str, forwarded: tuple[str, ...], title: str,
          label: Any, header: str) -> None:
    """Run ``script``'s worker at ``--{degree}=1`` and each of ``opts.degrees`` (with the
    ``forwarded`` options), print ``title`` and one row per run (``label(row)``, the median step
    time, its speed against the first run, the MiB of each kind of collective per step, their
    total; ``title`` may use the first run's ``{params}`` and ``{active}`` in millions), and
    write them to ``opts.json`` if given."""
    args = [f"--{k}={getattr(opts, k)}" for k in forwarded]
    degrees = [1, *(int(d) for d in opts.degrees.split(","))]
    rows = list(run_variants(script, opts.ranks, {f"{degree}{d}": [f"--{degree}={d}", *args] for d in degrees},
                             opts.dump).values())
    base = rows[0]
    print(title.format(params=base["params"] / 1e6, active=base.get("active", 0) / 1e6))
    kinds = sorted({k for r in rows for k in r["mib_per_step"]})
    print(f"{header} {'step s':>8} {'speed':>8} " + " ".join(f"{k + ' MiB':>18}" for k in kinds)
          + f" {'total MiB':>10}")
    for r in rows:
        total = sum(r["mib_per_step"].values())
        print(f"{label(r):>{len(header)}} {r['step_s']:8.3f} {base['step_s'] / r['step_s']:8.2f} "
              + " ".join(f"{r['mib_per_step'].get(k, 0.0):18.2f}" for k in kinds) + f" {total:10.2f}")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"config": vars(opts), "rows": rows}, indent=2) + "\n")


def run_variants(script: str, ranks: int, variants: dict[str, list[str]], dump: str) -> dict[str, Any]:
    """Run ``script --worker --out=FILE ARGS`` on ``ranks`` gloo processes (torchrun, one
    thread each) once per variant (name → ARGS); each variant's rank 0 writes its figures as
    JSON to FILE. Returns them by name."""
    rows = {}
    for name, args in variants.items():
        out = Path(dump) / f"{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", script,
               "--worker", f"--out={out}", f"--dump={dump}/run-{name}", *args]
        run_launched(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows[name] = json.loads(out.read_text())
    return rows


def _bare_model(spec: Any, args: Any, mesh: Any, device: torch.device) -> torch.nn.Module:
    """The spec's model sharded by hand with ``fully_shard`` over the spec's units (first unit,
    each block, last unit kept gathered after forward, root), fp32 throughout."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    units = spec.fsdp_units(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    if units.get("first_unit") is not None:
        fully_shard(units["first_unit"], mesh=mesh, mp_policy=mp)
    for block in units["blocks"]:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    if units.get("last_unit") is not None:
        fully_shard(units["last_unit"], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights(buffer_device=device)
    return model




def _job_args(opts: argparse.Namespace, *extra: str, param_dtype: str = "float32") -> list[str]:
    return ["--model.flavor", opts.flavor, "--training.seq_len", str(opts.seq_len),
            "--training.local_batch_size", str(opts.local_batch_size), "--training.steps", "1000000",
            "--training.mixed_precision_param", param_dtype, "--metrics.log_freq", "1000000",
            "--metrics.no-enable_tensorboard", "--validation.no-enable", "--job.dump_folder",
            opts.dump, *extra]


def _worker_overhead(opts: argparse.Namespace) -> dict[str, Any]:
    """Trainer.train() vs a bare FSDP2 loop, alternating, in one process group."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.distributed.clip import clip_grad_norm_
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(_job_args(opts)))
    bare = _bare_model(trainer.plan.spec, trainer.plan.model_args, trainer.mesh.fsdp, trainer.device)
    bare_opt = torch.optim.AdamW(bare.parameters(), lr=trainer.config.optimizer.lr, weight_decay=0.1,
                                 foreach=True)

    def bare_steps(n: int) -> None:
        for _ in range(n):
            for inputs, labels in trainer.loader.next_batch():
                inputs, labels = inputs.to(trainer.device), labels.to(trainer.device)
                loss = F.cross_entropy(bare(inputs).flatten(0, 1).float(), labels.flatten())
                loss.backward()
            clip_grad_norm_(list(bare.parameters()), 1.0)
            bare_opt.step()
            bare_opt.zero_grad(set_to_none=True)

    def ours_steps(n: int) -> None:
        trainer.config.training.steps = trainer.step + n
        trainer.train()

    def timed(fn: Any) -> float:
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn(opts.steps)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        return (time.perf_counter() - start) / opts.steps

    ours_steps(2)
    bare_steps(2)  # warm-up both
    ours, bare_t = [], []
    for _ in range(opts.rounds):
        ours.append(timed(ours_steps))
        bare_t.append(timed(bare_steps))
    tokens = opts.local_batch_size * opts.seq_len
    return {"ours_step_s": ours, "bare_step_s": bare_t, "tokens_per_rank_step": tokens,
            "ours_tps": tokens / statistics.median(ours), "bare_tps": tokens / statistics.median(bare_t),
            "ratio": statistics.median(bare_t) / statistics.median(ours)}


def _worker_single(opts: argparse.Namespace) -> dict[str, Any]:
    """One process: Trainer.train() (no FSDP on one rank) against a bare eager loop around the
    same model, for each of ``--param_dtypes`` and vocabulary (the flavor's, then each of
    ``--single_vocab_sizes``), alternating round by round (see the docstring)."""
    import torch
    import torch.nn.functional as F

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.distributed.clip import clip_grad_norm_
    from torchtitan_lite.distributed.parallelize import build_sharded_model
    from torchtitan_lite.trainer import Trainer, build_optimizers

    def timed(fn: Any, n: int) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(n)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / n

    runs = [(dtype, None) for dtype in opts.param_dtypes.split(",")]
    runs += [("float32", int(v)) for v in filter(None, opts.single_vocab_sizes.split(","))]
    out = {}
    for dtype, vocab in runs:
        label = f"{dtype}" + ("" if vocab is None else f", vocab {vocab:,}")
        extra = [] if vocab is None else ["--model.vocab_size", str(vocab)]
        trainer = Trainer(load_job_config(_job_args(
            opts, *extra, "--job.dump_folder", str(Path(opts.dump) / f"single_{dtype}_{vocab}"), param_dtype=dtype)))
        assert trainer.plan.fsdp_options() is None, "one process should train the plain model"
        plan, device = trainer.plan, trainer.device
        # The same model as the trainer's, plain (fsdp=None) and under autocast for bf16.
        bare = build_sharded_model(plan.spec, plan.model_args, None, device=device, seed=trainer.config.debug.seed,
                                   sharded=False, param_dtype=plan.shape.param_dtype)
        bare_opt, bare_sched = build_optimizers(trainer.config, plan, bare)  # the trainer's AdamW and schedule

        def bare_steps(n: int, bare: Any = bare, bare_opt: Any = bare_opt, bare_sched: Any = bare_sched,
                       trainer: Any = trainer) -> None:
            for _ in range(n):
                for inputs, labels in trainer.loader.next_batch():
                    logits = bare(inputs.to(trainer.device))
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.to(trainer.device).flatten())
                    loss.backward()
                clip_grad_norm_(list(bare.parameters()), 1.0)
                bare_opt.step()
                bare_sched.step()
                bare_opt.zero_grad(set_to_none=True)

        def ours_steps(n: int, trainer: Any = trainer) -> None:
            trainer.config.training.steps = trainer.step + n
            trainer.train()

        steps = opts.steps if vocab is None else max(2, opts.steps // 2)
        ours_steps(2)
        bare_steps(2)  # warm-up both
        ours, bare_t = [], []
        for _ in range(opts.rounds):
            ours.append(timed(ours_steps, steps))
            bare_t.append(timed(bare_steps, steps))
        tokens = opts.local_batch_size * opts.seq_len
        ratios = [b / o for o, b in zip(ours, bare_t, strict=True)]
        out[label] = {"ours_step_s": ours, "bare_step_s": bare_t, "steps": steps, "vocab": plan.model_args.vocab_size,
                      "ours_tps": tokens / statistics.median(ours), "bare_tps": tokens / statistics.median(bare_t),
                      "ratio": statistics.median(bare_t) / statistics.median(ours),
                      "median_round_ratio": statistics.median(ratios), "round_ratios": ratios}
        trainer.metrics.close()
        trainer._lock.release()
        del trainer, bare, bare_opt
    return out


def _worker_memory(opts: argparse.Namespace) -> dict[str, Any]:
    """measure_step_memory for every mode × param dtype × offload setting, at each world size w
    of ``--memory_worlds`` (each dividing this launch's): ranks 0..w-1 shard over a mesh of
    their own, the others wait. Returns ``{str(w): this rank's figures, or None}``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_lite.distributed import fsdp_mesh, init_distributed
    from torchtitan_lite.distributed.parallelize import build_sharded_model
    from torchtitan_lite.loss import token_loss_sum
    from torchtitan_lite.memory.measure import measure_step_memory
    from torchtitan_lite.models import get_model_spec

    device = torch.device("cpu")
    init_distributed(device)
    launched, rank = dist.get_world_size(), dist.get_rank()
    spec = get_model_spec("llama3")
    args = spec.model_args(opts.flavor)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, args.vocab_size, (opts.local_batch_size, opts.seq_len + 1), generator=generator)
    out: dict[str, Any] = {}
    for world in (int(w) for w in opts.memory_worlds.split(",")):
        # Every rank takes part in creating the groups; the first group (ranks 0..world-1) measures.
        mesh = fsdp_mesh(device) if world == launched else init_device_mesh(
            "cpu", (launched // world, world), mesh_dim_names=("group", "dp_shard"))["dp_shard"]
        out[str(world)] = None
        if rank < world:
            results = []
            for mode in MODES:
                for mp in opts.param_dtypes.split(","):
                    for offload in (s == "on" for s in opts.cpu_offload.split(",")):
                        model = build_sharded_model(spec, args, mesh, device=device, seed=0,
                                                    reshard_after_forward_mode=mode, param_dtype=getattr(torch, mp),
                                                    reduce_dtype=torch.float32, cpu_offload=offload)
                        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

                        def loss_fn(model: Any = model) -> torch.Tensor:
                            labels = tokens[:, 1:]
                            return token_loss_sum(model(tokens[:, :-1]), labels) / labels.numel()

                        measured = measure_step_memory(model, optimizer, loss_fn)
                        results.append({"mode": mode, "param_dtype": mp, "cpu_offload": offload, **measured})
                        del model, optimizer
            out[str(world)] = {"world_size": world, "configs": results,
                               "param_bytes_fp32": args.num_params() * 4}
        dist.barrier()
    return out


def _worker_collectives(opts: argparse.Namespace) -> dict[str, Any]:
    import torch

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.distributed.fsdp import fsdp_units
    from torchtitan_lite.trainer import Trainer

    out = {}
    for mode in MODES:
        trainer = Trainer(load_job_config(_job_args(opts, "--parallelism.reshard_after_forward_mode", mode)))
        trainer.train_step()
        with CollectiveCounter() as counter:
            trainer.train_step()
        # The spec's units: tok_embeddings, every block, norm + output for llama3.
        units = len(fsdp_units(trainer.model, **trainer.plan.spec.fsdp_units(trainer.model)))
        shard_bytes = sum(p.to_local().numel() * p.element_size() for p in trainer.model.parameters())
        out[mode] = {"all_gather": counter.calls["all_gather"],
                     "all_gather_mib": counter.bytes["all_gather"] / 2**20,
                     "reduce_scatter": counter.calls["reduce_scatter"],
                     "reduce_scatter_mib": counter.bytes["reduce_scatter"] / 2**20,
                     "units": units, "shard_mib": shard_bytes / 2**20}
        trainer.metrics.close()
        del trainer
        torch.manual_seed(0)
    return out


def _auto_budgets(opts: argparse.Namespace) -> dict[str, float]:
    """Tight and loose budgets (GiB) for the auto part at 2 ranks: halfway between the
    estimated peak of always plus auto's headroom and that of never; and never's plus the
    headroom plus 5%."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.job import plan_job
    from torchtitan_lite.memory.auto import auto_headroom_bytes
    from torchtitan_lite.memory.estimate import estimate_memory, job_estimate_shape

    with tempfile.TemporaryDirectory() as tmp:
        config = load_job_config(_job_args(argparse.Namespace(**{**vars(opts), "dump": tmp})))
    plan = plan_job(config, world_size=2)
    shape = job_estimate_shape(plan)
    never, always = (estimate_memory(plan.spec, plan.model_args, shape, reshard_after_forward_mode=mode).peak
                     for mode in ("never", "always"))
    headroom = auto_headroom_bytes(plan.spec, plan.model_args, plan.shape.param_dtype, plan.shape.reduce_dtype)
    return {"tight": (never + always + headroom) / 2 / 2**30, "loose": (never + headroom) * 1.05 / 2**30}


def _worker_auto(opts: argparse.Namespace) -> dict[str, Any]:
    """Each labelled run: a Trainer, timed steps, the collectives of one step, then the
    measured peak (FSDPMemTracker's hooks stay on the model, so that comes last)."""
    import torch.distributed as dist

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.loss import token_loss_sum
    from torchtitan_lite.memory.measure import measure_step_memory
    from torchtitan_lite.trainer import Trainer

    runs = {mode: ["--parallelism.reshard_after_forward_mode", mode] for mode in ("never", "default", "always")}
    for label, gib in json.loads(opts.budgets).items():
        runs[f"auto {label}"] = ["--parallelism.reshard_after_forward_mode", "auto",
                                 "--parallelism.memory_budget_gib", repr(gib)]
    out = {}
    for label, argv in runs.items():
        trainer = Trainer(load_job_config(_job_args(opts, *argv)))
        trainer.config.training.steps = 2
        trainer.train()  # warm-up
        dist.barrier()
        start = time.perf_counter()
        trainer.config.training.steps += opts.steps
        trainer.train()
        dist.barrier()
        step_s = (time.perf_counter() - start) / opts.steps
        with CollectiveCounter() as counter:
            trainer.train_step()

        def loss_fn(trainer: Any = trainer) -> torch.Tensor:
            (inputs, labels), = trainer.loader.next_batch()
            return token_loss_sum(trainer.model(inputs), labels) / labels.numel()

        peak = measure_step_memory(trainer.model, trainer.optimizer, loss_fn)["peak"]["total"]
        plan = trainer.reshard_plan
        out[label] = {"all_gather": counter.calls["all_gather"], "measured_peak": peak,
                      "tokens_per_s": opts.local_batch_size * opts.seq_len / step_s,
                      "budget_gib": None if plan is None else plan.budget / 2**30,
                      "resharded": None if plan is None else list(plan.resharded),
                      "resharded_text": None if plan is None else plan.resharded_text(),
                      "recomputed": None if plan is None else plan.recomputed_text(),
                      "estimated_peak": None if plan is None else plan.peak,
                      "plan_seconds": None if plan is None else plan.seconds}
        trainer.metrics.close()
        del trainer
    return out


AC_RUNS = {"none": ["--activation_checkpoint.mode", "none"],
           "full": ["--activation_checkpoint.mode", "full"],
           "selective op": ["--activation_checkpoint.mode", "selective",
                            "--activation_checkpoint.selective_ac_option", "op"],
           "selective 2": ["--activation_checkpoint.mode", "selective",
                           "--activation_checkpoint.selective_ac_option", "2"]}


_AC_SHORT = {"none": "none", "full": "full", "op": "selective op", "2": "selective 2"}


def _peak_cases(opts: argparse.Namespace) -> dict[str, tuple[str, str, bool]]:
    """The peak part's runs, by label: ``(reshard mode, AC_RUNS key, CPU offload)``. ``--peak_cases``
    is ``all`` (every mode × AC setting) or a comma list of ``MODE:AC[:offload]`` (AC: none, full,
    op, 2; e.g. on one GPU, where only CPU offload shards the model, ``default:full,always:none:offload``)."""
    if opts.peak_cases == "all":
        cases = [(mode, label, False) for mode in MODES for label in AC_RUNS]
    else:
        cases = []
        for item in opts.peak_cases.split(","):
            mode, _, rest = item.partition(":")
            ac, _, offload = rest.partition(":")
            if mode not in MODES or ac not in _AC_SHORT or offload not in ("", "offload"):
                raise SystemExit(f"--peak_cases: invalid case {item!r}; expected MODE:AC[:offload] with MODE one of "
                                 f"{', '.join(MODES)} and AC one of {', '.join(_AC_SHORT)}")
            cases.append((mode, _AC_SHORT[ac], offload == "offload"))
    # CPU offload first: the first trainer creates the process group, and offload needs its CPU backend
    cases.sort(key=lambda case: not case[2])
    return {f"{mode} / {label}{' / cpu offload' if offload else ''}": (mode, label, offload)
            for mode, label, offload in cases}


def _peak_argv(opts: argparse.Namespace, mode: str, ac: list[str], dump: str, offload: bool = False) -> list[str]:
    return _job_args(argparse.Namespace(**{**vars(opts), "dump": dump}), "--parallelism.reshard_after_forward_mode",
                     mode, *ac, *(["--training.enable_cpu_offload"] if offload else []),
                     param_dtype=opts.param_dtypes.split(",")[0])


def _worker_peak(opts: argparse.Namespace) -> dict[str, Any]:
    """Measured peak per rank of each reshard mode × AC setting (see the module docstring)."""
    import functools

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.memory.measure import measure_step_memory, trainer_step_peak
    from torchtitan_lite.trainer import Trainer

    out = {}
    for key, (mode, label, offload) in _peak_cases(opts).items():
        # The allocator's own figures, from before the model exists, over the second step.
        dump = str(Path(opts.dump) / key.replace(" / ", "_").replace(" ", "_"))
        peak, trainer = trainer_step_peak(functools.partial(Trainer, load_job_config(
            _peak_argv(opts, mode, AC_RUNS[label], dump, offload))))
        how = ("torch.cuda.max_memory_allocated" if trainer.device.type == "cuda"
               else "the CPU allocator's total, reported to torch.profiler")
        # FSDPMemTracker's own peak (it tracks FSDP models only), on CPU, where the allocator's
        # figure comes from the profiler; on a GPU max_memory_allocated is the reference and the
        # tracker's extra steps (slow with CPU offload at 1B) are left out.
        tracked = None
        if isinstance(trainer.model, FSDPModule) and trainer.device.type == "cpu":
            by_device = measure_step_memory(trainer.model, trainer.optimizer, _trainer_loss(trainer))["peak_by_device"]
            tracked = next((v for d, v in by_device.items() if torch.device(d).type == trainer.device.type), None)
        out[key] = {"mode": mode, "ac": label, "cpu_offload": offload, "peak": peak, "measured_by": how,
                    "tracker_peak": tracked}
        if dist.get_rank() == 0:  # as it goes: a run cut short keeps the cases it measured in its log
            print(f"peak case {key}: measured {peak / 2**20:.1f} MiB ({how})", flush=True)
        trainer.metrics.close()
        del trainer
        dist.barrier()
    return out


FLOAT8_RUNS = {
    "without float8": [],
    "float8": ["--model.converters", "float8", "--float8.enable_fsdp_float8_all_gather",
               "--float8.precompute_float8_dynamic_scale_for_fsdp"],
}


def _worker_float8(opts: argparse.Namespace) -> dict[str, Any]:
    """Each of :data:`FLOAT8_RUNS`, eager and compiled: losses and step times (see the docstring)."""
    import torch
    import torch.distributed as dist

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.distributed.float8 import float8_unavailable
    from torchtitan_lite.distributed.process_group import choose_device
    from torchtitan_lite.trainer import Trainer

    emulate = float8_unavailable(choose_device(), emulate=False) is not None
    out = {}
    for label, argv in FLOAT8_RUNS.items():
        for compiled in [mode == "compiled" for mode in opts.float8_modes.split(",")]:
            extra = [*argv, *(["--float8.emulate"] if argv and emulate else []),
                     *(["--compile.enable"] if compiled else []), "--lr_scheduler.warmup_steps", "10"]
            name = f"{label}{' compiled' if compiled else ''}"
            trainer = Trainer(load_job_config(_job_args(
                argparse.Namespace(**{**vars(opts), "dump": str(Path(opts.dump) / name.replace(" ", "_"))}),
                *extra, param_dtype=opts.param_dtypes.split(",")[0])))
            times, losses = [], []
            for _ in range(opts.float8_steps):
                dist.barrier()
                start = time.perf_counter()
                losses.append(trainer.train_step()["loss"])
                if trainer.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            tokens = opts.local_batch_size * opts.seq_len
            out[name] = {"tps": tokens / statistics.median(times[10:] or times), "losses": losses,
                         "final_loss": statistics.fmean(losses[-10:]), "emulated": bool(argv) and emulate}
            trainer.metrics.close()
            del trainer
            dist.barrier()
    return out


def _job_estimate(argv: list[str], world_size: int) -> Any:
    """The estimator's figures (a ``MemoryEstimate``) for the job ``argv`` at ``world_size``
    ranks, planned as the trainer plans it (in this process: no process group)."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.job import plan_job
    from torchtitan_lite.memory.estimate import estimate_memory, job_estimate_shape

    config = load_job_config(argv)
    plan = plan_job(config, world_size=world_size)
    return estimate_memory(plan.spec, plan.model_args, reshard_after_forward_mode=plan.shape.reshard_after_forward_mode,
                           shape=job_estimate_shape(plan))


def _trainer_loss(trainer: Any) -> Any:
    """A ``loss_fn`` for ``measure_step_memory``: the trainer's next batch through its model and loss."""
    def loss_fn() -> Any:
        (inputs, labels), = trainer.loader.next_batch()
        inputs, labels = inputs.to(trainer.device), labels.to(trainer.device)
        return trainer.loss_fn(trainer.model(inputs), labels) / labels.numel()
    return loss_fn


def _peak_estimates(opts: argparse.Namespace) -> dict[str, int]:
    """The estimator's peak per rank for each run of :func:`_worker_peak`."""
    with tempfile.TemporaryDirectory() as tmp:
        # On a GPU the accelerator's share (with CPU offload, the offloaded state is on CPU and
        # max_memory_allocated does not see it); on CPU the allocator sees every byte.
        estimates = {key: _job_estimate(_peak_argv(opts, mode, AC_RUNS[label], tmp, offload), opts.peak_ranks)
                     for key, (mode, label, offload) in _peak_cases(opts).items()}
        return {key: e.device_peak if torch.cuda.is_available() else e.peak for key, e in estimates.items()}


def _ac_args(opts: argparse.Namespace) -> argparse.Namespace:
    """The AC part's job: ``--ac_seq_len`` (activations dominate there), fp32."""
    return argparse.Namespace(**{**vars(opts), "seq_len": opts.ac_seq_len})


def _ac_estimates(opts: argparse.Namespace) -> dict[str, int]:
    """Estimated peak per rank at 2 ranks of each AC run (in this process: no process group)."""

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, argv in AC_RUNS.items():
            estimate = _job_estimate(_job_args(argparse.Namespace(**{**vars(_ac_args(opts)), "dump": tmp}), *argv), 2)
            out[label] = {"peak": estimate.peak, "activations": estimate.categories.get("activations", 0)}
    return out


def _worker_ac(opts: argparse.Namespace) -> dict[str, Any]:
    """Each activation checkpointing setting: a Trainer, step time over ``--steps`` steps (after
    a warm-up step), the losses, then the peak measured by FSDPMemTracker (last: its hooks stay)."""
    import torch.distributed as dist

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.memory.measure import measure_step_memory
    from torchtitan_lite.trainer import Trainer

    ac_opts = _ac_args(opts)
    out = {}
    for label, argv in AC_RUNS.items():
        trainer = Trainer(load_job_config(_job_args(ac_opts, *argv)))
        trainer.config.training.steps = 1
        trainer.train()  # warm-up
        dist.barrier()
        start = time.perf_counter()
        trainer.config.training.steps += opts.steps
        losses = [h["loss"] for h in trainer.train()]
        dist.barrier()
        step_s = (time.perf_counter() - start) / opts.steps
        measured = measure_step_memory(trainer.model, trainer.optimizer, _trainer_loss(trainer))["peak"]
        out[label] = {"step_s": step_s, "losses": losses, "peak": measured["total"],
                      "activations": measured["activations"]}
        trainer.metrics.close()
        del trainer
    return out


def _worker_compile(opts: argparse.Namespace) -> dict[str, Any]:
    """Compiled vs eager Trainer on the same job in one process group, for each of
    ``--param_dtypes``: the compiled one's first step (compilation) timed on its own, then both
    alternate round by round after a warm-up, and the ratio of the median step times is reported."""
    import torch
    import torch._dynamo as dynamo
    import torch.distributed as dist

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    def steps(trainer: Any, n: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        trainer.config.training.steps = trainer.step + n
        trainer.train()
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        return (time.perf_counter() - start) / n

    out = {}
    for dtype in opts.param_dtypes.split(","):
        # Two jobs alive at once: each needs its own dump folder (one job per folder, locked).
        eager = Trainer(load_job_config(_job_args(
            opts, "--job.dump_folder", str(Path(opts.dump) / f"eager_{dtype}"), param_dtype=dtype)))
        compiled = Trainer(load_job_config(_job_args(
            opts, "--compile.enable", "--job.dump_folder", str(Path(opts.dump) / f"compiled_{dtype}"),
            param_dtype=dtype)))
        eager_first = steps(eager, 1)
        compile_first = steps(compiled, 1)  # compiles the blocks and the loss
        steps(eager, 1)
        steps(compiled, 1)  # warm-up both (the compiled step's first backward ran in step 1)
        graphs_after_warmup = dynamo.utils.counters["stats"]["unique_graphs"]
        eager_s, compiled_s = [], []
        for _ in range(opts.rounds):
            eager_s.append(steps(eager, opts.steps))
            compiled_s.append(steps(compiled, opts.steps))
        tokens = opts.local_batch_size * opts.seq_len
        out[dtype] = {
            "eager_step_s": eager_s, "compiled_step_s": compiled_s, "eager_first_step_s": eager_first,
            "compiled_first_step_s": compile_first, "compile_s": compile_first - eager_first,
            "eager_tps": tokens / statistics.median(eager_s), "compiled_tps": tokens / statistics.median(compiled_s),
            "ratio": statistics.median(eager_s) / statistics.median(compiled_s),
            "new_graphs_after_warmup": dynamo.utils.counters["stats"]["unique_graphs"] - graphs_after_warmup}
        for name, trainer in (("eager", eager), ("compiled", compiled)):
            out[dtype][f"{name}_library"] = _library_share(lambda trainer=trainer: steps(trainer, 2))
        profiled = out[dtype]["compiled_library"]
        out[dtype]["ratio_bound"] = (out[dtype]["eager_library"]["wall_s"]
                                     / (profiled["wall_s"] - profiled["generated_s"]))
        for trainer in (eager, compiled):
            trainer.metrics.close()
        del eager, compiled
    return out


# Kernels that compiled code calls as they are (inductor generates the rest): GEMMs and the fused
# attention kernels. Their time is a floor of a compiled step.
LIBRARY_KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_")


def _library_share(run: Any) -> dict[str, Any]:
    """Profile ``run()`` (CPU ops of this process): wall time, the self time of
    :data:`LIBRARY_KERNELS` (per kernel name, summed, share of the wall time) and of inductor's
    generated code (its kernels and wrapper, not the library calls it makes)."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    kernels = {e.key: e.self_cpu_time_total / 1e6 for e in events if e.key.startswith(LIBRARY_KERNELS)}
    generated = sum(e.self_cpu_time_total for e in events if e.key.startswith("## Call CompiledFxGraph")) / 1e6
    return {"wall_s": wall, "library_s": sum(kernels.values()), "share": sum(kernels.values()) / wall,
            "generated_s": generated, "kernels_s": kernels}


def _worker_metainit(opts: argparse.Namespace) -> dict[str, Any]:
    """Peak RSS of meta build → shard → to_empty → init_weights of the 1B flavor (this rank)."""
    import torch
    import torch.distributed as dist

    from torchtitan_lite.distributed import fsdp_mesh, init_distributed
    from torchtitan_lite.distributed.parallelize import build_sharded_model
    from torchtitan_lite.memory.measure import process_memory, reset_peak_rss
    from torchtitan_lite.models import get_model_spec

    device = torch.device("cpu")
    init_distributed(device)
    mesh = fsdp_mesh(device)
    spec = get_model_spec("llama3")
    args = spec.model_args("1B")
    dist.barrier()
    reset_peak_rss()
    before = process_memory()
    start = time.perf_counter()
    model = build_sharded_model(spec, args, mesh, device=device, seed=0)
    seconds = time.perf_counter() - start
    after = process_memory()
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    result = {"params": args.num_params(), "shard_bytes": shard, "peak_delta_bytes": after["peak_rss"] - before["rss"],
              "seconds": seconds}
    if dist.get_rank() == 0 and opts.naive:
        del model
        reset_peak_rss()
        before = process_memory()
        naive = spec.model_cls(args)  # every parameter allocated in full, then initialised
        torch.manual_seed(0)
        naive.init_weights()
        result["naive_peak_delta_bytes"] = process_memory()["peak_rss"] - before["rss"]
        del naive
    dist.barrier()
    return result


WORKERS = {"overhead": _worker_overhead, "memory": _worker_memory, "collectives": _worker_collectives,
           "auto": _worker_auto, "metainit": _worker_metainit, "ac": _worker_ac, "compile": _worker_compile,
           "peak": _worker_peak, "float8": _worker_float8, "single": _worker_single}


def _worker_main(opts: argparse.Namespace) -> None:
    """Run the parts of ``--worker`` (a comma list) one after another in this process group."""
    import torch.distributed as dist

    from torchtitan_lite.distributed import destroy_distributed

    result = {part: WORKERS[part](opts) for part in opts.worker.split(",")}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        Path(opts.out).write_text(json.dumps(gathered))
    destroy_distributed()


# --------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------


def _launch(parts: list[str], nproc: int, opts: argparse.Namespace, *extra: str) -> dict[str, list[Any]]:
    """Run ``parts`` one after another under one torchrun launch on ``nproc`` ranks; returns
    every rank's result of each part."""
    from torchtitan_lite.distributed import free_port

    worker = ",".join(parts)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--nnodes=1",
               str(Path(__file__).resolve()), "--worker", worker, "--out", str(out), "--dump", tmp,
               "--flavor", opts.flavor, "--seq_len", str(opts.seq_len),
               "--local_batch_size", str(opts.local_batch_size), "--steps", str(opts.steps),
               "--rounds", str(opts.rounds), "--param_dtypes", opts.param_dtypes,
               "--cpu_offload", opts.cpu_offload, "--ac_seq_len", str(opts.ac_seq_len),
               "--single_vocab_sizes", opts.single_vocab_sizes, *extra]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        # stdout passes through (the workers' progress lines); stderr is kept for the failure line
        done = run_launched(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, timeout=1800)
        if done.returncode != 0:
            # The ranks' tracebacks are in torchrun's stderr, before its own summary: keep it all.
            log = Path(tempfile.gettempdir()) / f"benchmark_{worker.replace(',', '_')}_{nproc}_ranks.stderr.txt"
            log.write_text(done.stderr)
            # A Python error names itself; a rank killed in C++ shows only torchrun's signal line.
            # The exception's own line ("...Error: message") names the cause best; the first line
            # mentioning an error is often only the `raise` of a traceback.
            lines = done.stderr.splitlines()
            named = [
                line for line in lines if re.search(r"\w(Error|Exception): ", line) and "ChildFailedError" not in line
            ]
            ranks = named or [line for line in lines if ("Error" in line and "ChildFailedError" not in line)
                              or "terminate called" in line or "Signal " in line]
            raise SystemExit(f"error: benchmark part(s) {worker!r} on {nproc} ranks failed (exit {done.returncode}): "
                             f"{(ranks or [''])[0].strip()} (torchrun's stderr: {log})")
        gathered = json.loads(out.read_text())  # per rank: {part: result}
        return {part: [rank[part] for rank in gathered] for part in parts}


def _startup(opts: argparse.Namespace, nproc: int) -> float:
    """Seconds from launching the trainer to the record of its first step."""
    from torchtitan_lite.distributed import free_port

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--nnodes=1",
               "-m", "torchtitan_lite.train", "--job.config_file", "train_configs/debug_model.toml",
               "--training.steps", "1", "--validation.no-enable", "--metrics.no-enable_tensorboard",
               "--job.dump_folder", tmp]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        start = time.time()
        run_launched(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=True, timeout=600)
        record = json.loads((Path(tmp) / "metrics.jsonl").read_text().splitlines()[0])
        return record["time"] - start - record["step_time_s"]


def _print_memory(memory: dict[int, list[Any]]) -> None:
    print("\nmemory per rank (MiB), measured with FSDPMemTracker over 2 steps; peak = all categories "
          "at the moment the total peaked; state = after a step")
    head = f"{'ranks':>5} {'mode':8} {'param':9} {'offload':7} " + " ".join(f"{c[:12]:>12}" for c in CATEGORY_COLUMNS)
    print(head)
    for world, ranks in memory.items():
        for cfg in ranks[0]["configs"]:
            state, peak = cfg["state"], cfg["peak"]
            cells = [state["sharded_params"], peak["unsharded_params"], state["sharded_grads"],
                     state["optimizer_state"], peak["activations"], peak["temporaries"],
                     peak["all_gather_buffers"], peak["total"]]
            print(f"{world:>5} {cfg['mode']:8} {cfg['param_dtype']:9} {str(cfg['cpu_offload']):7} "
                  + " ".join(f"{c / 2**20:12.2f}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and world sizes 1, 2, 4 (minutes)")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--local_batch_size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10,
                        help="steps per timed round (overhead) and timed steps per run (auto)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of each loop")
    parser.add_argument("--world_sizes", default="1,2,4", help="memory part: world sizes, comma-separated")
    parser.add_argument(
        "--param_dtypes",
        default="float32,bfloat16",
        help="memory and compile parts: parameter (compute) dtypes, comma-separated (float32, bfloat16)",
    )
    parser.add_argument("--cpu_offload", default="off,on",
                        help="memory part: CPU offload settings, comma-separated (off, on)")
    parser.add_argument("--ac_seq_len", type=int, default=1024,
                        help="ac part: sequence length (long enough for activations to dominate)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: "
                        "overhead, memory, collectives, auto, ac, compile, metainit, startup")
    parser.add_argument("--compile_ranks", type=int, default=2, help="compile part: number of ranks")
    parser.add_argument("--peak_ranks", type=int, default=2, help="peak part: number of ranks (GPUs)")
    parser.add_argument("--parts", default="", help="parts to run besides the default ones: peak, float8, single")
    parser.add_argument("--single_vocab_sizes", default="128256",
                        help="single part: vocabulary sizes run in fp32 besides the flavor's (comma list; '' for none)")
    parser.add_argument("--float8_steps", type=int, default=100, help="float8 part: steps per run")
    parser.add_argument("--float8_modes", default="eager,compiled", help="float8 part: eager, compiled or both")
    parser.add_argument("--peak_cases", default="all",
                        help="peak part: all, or a comma list of MODE:AC[:offload] (AC: none, full, op, 2)")
    parser.add_argument("--json", default=None, help="write every figure here")
    # worker-side (internal)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--memory_worlds", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--dump", help=argparse.SUPPRESS)
    parser.add_argument("--naive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--budgets", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    for name, allowed in (("param_dtypes", ("float32", "bfloat16")), ("cpu_offload", ("off", "on")),
                          ("float8_modes", ("eager", "compiled"))):
        values = getattr(opts, name).split(",")
        if not values or not set(values) <= set(allowed):
            parser.error(f"--{name}: invalid value {getattr(opts, name)!r}; expected a comma list of "
                         f"{', '.join(allowed)}")
    end_on_signals()
    if opts.worker:
        unknown = set(opts.worker.split(",")) - set(WORKERS)
        if unknown:
            parser.error(f"--worker: unknown part(s) {', '.join(sorted(unknown))}")
        sys.path.insert(0, str(REPO))
        _worker_main(opts)
        return
    if opts.quick:
        opts.rounds, opts.steps = 3, 5
    skip = set(filter(None, opts.skip.split(",")))
    parts = ("overhead", "memory", "collectives", "auto", "ac", "compile", "metainit", "startup")
    if not skip <= set(parts):
        parser.error(f"--skip: unknown part(s) {', '.join(sorted(skip - set(parts)))}; known: {', '.join(parts)}")
    try:
        worlds = list(dict.fromkeys(int(w) for w in opts.world_sizes.split(",")))
    except ValueError:
        worlds = []
    if opts.peak_ranks < 1:
        parser.error(f"--peak_ranks: invalid value {opts.peak_ranks}; expected an integer >= 1")
    if set(filter(None, opts.parts.split(","))) - {"peak", "float8", "single"}:
        parser.error(f"--parts: invalid value {opts.parts!r}; expected a comma list of peak, float8, single")
    if not all(v.strip().isdigit() and int(v) > 0 for v in filter(None, opts.single_vocab_sizes.split(","))):
        parser.error(f"--single_vocab_sizes: invalid value {opts.single_vocab_sizes!r}; expected a comma list of "
                     "integers > 0")
    if opts.float8_steps < 11:
        parser.error(f"--float8_steps: invalid value {opts.float8_steps}; expected an integer >= 11")
    if opts.compile_ranks < 1:
        parser.error(f"--compile_ranks: invalid value {opts.compile_ranks}; expected an integer >= 1")
    if not worlds or min(worlds) < 1:
        parser.error(f"--world_sizes: invalid value {opts.world_sizes!r}; expected a comma list of integers >= 1")
    figures: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "options": {
        k: v for k, v in vars(opts).items()
        if k not in ("worker", "out", "dump", "naive", "budgets", "memory_worlds")}}
    import torch

    figures["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    print(f"benchmark on {figures['device']}, model {opts.flavor}, seq_len {opts.seq_len}, "
          f"local batch {opts.local_batch_size}")

    if "overhead" not in skip:
        o = _launch(["overhead"], 2, opts)["overhead"][0]
        figures["overhead"] = o
        print(f"\noverhead (2 ranks, {opts.rounds} alternating rounds × {opts.steps} steps): trainer "
              f"{o['ours_tps']:,.0f} tok/s/rank, bare FSDP2 loop {o['bare_tps']:,.0f} tok/s/rank, "
              f"ratio trainer/bare = {o['ratio']:.3f}")
    # The counting parts: one launch per number of ranks (memory: the largest world size, or a
    # size of its own where it does not divide that; collectives and auto: 2). On GPUs the
    # trainer parts run on NCCL and the memory part on gloo, so those launch apart.
    launches: dict[tuple[int, bool], list[str]] = {}
    memory_worlds: dict[int, list[int]] = {}
    if "memory" not in skip:
        for w in worlds:
            memory_worlds.setdefault(max(worlds) if max(worlds) % w == 0 else w, []).append(w)
        for n in memory_worlds:
            launches.setdefault((n, torch.cuda.is_available()), []).append("memory")
    for part in ("collectives", "auto"):
        if part not in skip:
            launches.setdefault((2, False), []).append(part)
    budgets = _auto_budgets(opts) if "auto" not in skip else None
    memory: dict[int, list[Any]] = {}
    counted: dict[str, list[Any]] = {}
    for (n, _), launch_parts in launches.items():
        extra = []
        if "memory" in launch_parts:
            extra += ["--memory_worlds", ",".join(map(str, memory_worlds[n]))]
        if "auto" in launch_parts:
            extra += ["--budgets", json.dumps(budgets)]
        for part, ranks in _launch(launch_parts, n, opts, *extra).items():
            if part == "memory":  # world size w: what the first w ranks measured
                memory.update({w: [rank[str(w)] for rank in ranks[:w]] for w in memory_worlds[n]})
            else:
                counted[part] = ranks
    if "memory" not in skip:
        memory = {w: memory[w] for w in worlds}
        figures["memory"] = {str(w): r for w, r in memory.items()}
        _print_memory(memory)
    if "collectives" not in skip:
        coll = counted["collectives"][0]
        figures["collectives"] = coll
        theory = {"default": "fwd: every unit; bwd: every unit but norm+output",
                  "always": "fwd and bwd: every unit", "never": "fwd only"}
        print("\ncollectives per step per rank (2 ranks; counted from the c10d ops that ran)")
        print(f"{'mode':8} {'all-gather':>10} {'AG MiB':>8} {'reduce-scatter':>14} {'RS MiB':>8}  theory "
              "(units = tok_embeddings + blocks + norm/output)")
        for mode, c in coll.items():
            expected = {"default": 2 * c["units"] - 1, "always": 2 * c["units"], "never": c["units"]}[mode]
            print(f"{mode:8} {c['all_gather']:>10} {c['all_gather_mib']:8.2f} {c['reduce_scatter']:>14} "
                  f"{c['reduce_scatter_mib']:8.2f}  {theory[mode]}: {expected} all-gathers, "
                  f"{c['units']} reduce-scatters")
    if "auto" not in skip:
        auto = counted["auto"][0]
        figures["auto"] = auto
        print("\nreshard_after_forward_mode auto (2 ranks): budgets from the estimates (tight: halfway "
              "between always + headroom and never; loose: (never + headroom) + 5%)")
        print(f"{'run':12} {'budget MiB':>10} {'resharded':40} {'recomputation added':36} {'all-gathers':>11} "
              f"{'est. MiB':>9} {'measured MiB':>12} {'tok/s/rank':>10}")
        for label, r in auto.items():
            budget = "-" if r["budget_gib"] is None else f"{r['budget_gib'] * 1024:.2f}"
            units = r["resharded_text"] or "-"
            estimated = "-" if r["estimated_peak"] is None else f"{r['estimated_peak'] / 2**20:.2f}"
            print(
                f"{label:12} {budget:>10} {units:40} {r['recomputed'] or '-':36} {r['all_gather']:>11} {estimated:>9} "
                f"{r['measured_peak'] / 2**20:12.2f} {r['tokens_per_s']:10,.0f}"
            )
    if "ac" not in skip:
        estimates = _ac_estimates(opts)
        ac = _launch(["ac"], 2, opts)["ac"][0]
        for label, r in ac.items():
            r["estimated_peak"], r["estimated_activations"] = estimates[label]["peak"], estimates[label]["activations"]
        figures["ac"] = ac
        none = ac["none"]
        print(f"\nactivation checkpointing (2 ranks, fp32, seq_len {opts.ac_seq_len}, local batch "
              f"{opts.local_batch_size}; peak and activations at the peak measured with FSDPMemTracker, "
              f"next to the estimate; {opts.steps} timed steps)")
        print(f"{'mode':13} {'activations':>11} {'est.':>9} {'peak MiB':>9} {'est.':>9} {'est./meas.':>10} "
              f"{'step s':>7} {'vs none':>7}  losses == none")
        for label, r in ac.items():
            same = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], none["losses"], strict=True))
            print(f"{label:13} {r['activations'] / 2**20:11.2f} {r['estimated_activations'] / 2**20:9.2f} "
                  f"{r['peak'] / 2**20:9.2f} {r['estimated_peak'] / 2**20:9.2f} "
                  f"{r['estimated_peak'] / r['peak']:10.3f} {r['step_s']:7.3f} "
                  f"{r['step_s'] / none['step_s']:7.2f}  max rel. diff {same:.1e}")
    if "compile" not in skip:
        by_dtype = _launch(["compile"], opts.compile_ranks, opts)["compile"][0]
        figures["compile"] = by_dtype
        print(
            f"\ncompile ({opts.compile_ranks} rank(s), {opts.rounds} alternating rounds × {opts.steps} steps, "
            "blocks and loss compiled)"
        )
        for dtype, c in by_dtype.items():
            print(f"  {dtype}: eager {c['eager_tps']:,.0f} tok/s/rank, compiled {c['compiled_tps']:,.0f} "
                  f"tok/s/rank, ratio compiled/eager = {c['ratio']:.2f} (per round: "
                  + ", ".join(f"{e / k:.2f}" for e, k in zip(c["eager_step_s"], c["compiled_step_s"], strict=True))
                  + f"); compilation {c['compile_s']:.1f} s (first step {c['compiled_first_step_s']:.1f} s "
                  f"vs eager {c['eager_first_step_s']:.2f} s), {c['new_graphs_after_warmup']} new graphs after warm-up")
            e, k = c["eager_library"], c["compiled_library"]
            print(f"    library kernels (mm, attention; profiled, 2 steps): eager {e['library_s']:.2f} s of "
                  f"{e['wall_s']:.2f} s ({e['share']:.0%}), compiled {k['library_s']:.2f} s of {k['wall_s']:.2f} s "
                  f"({k['share']:.0%}), generated code {k['generated_s']:.2f} s; the ratio were the generated code "
                  f"free: {c['ratio_bound']:.2f}")
    if "peak" in opts.parts.split(","):
        estimates = _peak_estimates(opts)
        for key, estimate in estimates.items():  # before the runs: a run cut short still pairs them in its log
            print(f"peak case {key}: estimated {estimate / 2**20:.1f} MiB", flush=True)
        peaks = _launch(["peak"], opts.peak_ranks, opts, "--peak_ranks", str(opts.peak_ranks),
                        "--peak_cases", opts.peak_cases)["peak"][0]
        for key, r in peaks.items():
            r["estimated_peak"] = estimates[key]
        figures["peak"] = peaks
        print(f"\npeak per rank, estimated against measured ({opts.peak_ranks} rank(s), {opts.flavor}, seq_len "
              f"{opts.seq_len}, local batch {opts.local_batch_size}, {opts.param_dtypes.split(',')[0]}; "
              f"measured with {next(iter(peaks.values()))['measured_by']})")
        print(f"{'reshard / AC':36} {'measured MiB':>12} {'estimate MiB':>12} {'est./meas.':>10} "
              f"{'tracker MiB':>11} {'est./tracker':>12}")
        for key, r in peaks.items():
            print(f"{key:36} {r['peak'] / 2**20:12.1f} {r['estimated_peak'] / 2**20:12.1f} "
                  f"{r['estimated_peak'] / r['peak']:10.3f} "
                  + (f"{r['tracker_peak'] / 2**20:11.1f} {r['estimated_peak'] / r['tracker_peak']:12.3f}"
                     if r["tracker_peak"] else f"{'-':>11} {'-':>12}"))
    if "single" in opts.parts.split(","):
        single = _launch(["single"], 1, opts)["single"][0]
        figures["single"] = single
        print(f"\none process ({opts.rounds} alternating rounds; trainer without FSDP against a bare eager loop on "
              "the same model, AdamW, schedule and clipping)")
        print(f"{'run':24} {'steps':>5} {'trainer tok/s':>13} {'bare tok/s':>10} {'trainer/bare':>12}  per round")
        for label, r in single.items():
            print(f"{label:24} {r['steps']:>5} {r['ours_tps']:13,.0f} {r['bare_tps']:10,.0f} {r['ratio']:12.3f}  "
                  + ", ".join(f"{x:.3f}" for x in r["round_ratios"]))
    if "float8" in opts.parts.split(","):
        runs = _launch(["float8"], opts.peak_ranks, opts, "--peak_ranks", str(opts.peak_ranks),
                       "--float8_steps", str(opts.float8_steps), "--float8_modes", opts.float8_modes)["float8"][0]
        figures["float8"] = runs
        print(f"\nfloat8 ({opts.peak_ranks} rank(s), {opts.flavor}, seq_len {opts.seq_len}, local batch "
              f"{opts.local_batch_size}, {opts.param_dtypes.split(',')[0]}, {opts.float8_steps} steps"
              f"{'; emulated: plumbing only' if runs['float8']['emulated'] else ''})")
        for name, r in runs.items():
            base = runs["without float8 compiled" if "compiled" in name else "without float8"]
            print(f"  {name:24} {r['tps']:10,.0f} tok/s/rank ({r['tps'] / base['tps']:.2f}x)  loss over the last "
                  f"10 steps {r['final_loss']:.4f} ({100 * (r['final_loss'] / base['final_loss'] - 1):+.2f}%)")
    if "metainit" not in skip:
        ranks = _launch(["metainit"], 2, opts, "--naive")["metainit"]
        figures["metainit"] = ranks
        r0 = ranks[0]
        print(
            f"\nmeta init of the 1B flavor ({r0['params'] / 1e9:.2f}B params) on 2 ranks: peak RSS delta "
            + ", ".join(
                f"rank {i} {r['peak_delta_bytes'] / 2**30:.2f} GiB ({r['peak_delta_bytes'] / r['shard_bytes']:.2f}× "
                f"its {r['shard_bytes'] / 2**30:.2f} GiB shard)"
                for i, r in enumerate(ranks)
            )
            + f"; naive full init {r0['naive_peak_delta_bytes'] / 2**30:.2f} GiB; {r0['seconds']:.1f} s"
        )
    if "startup" not in skip:
        seconds = _startup(opts, 2)
        figures["startup_s"] = seconds
        print(f"\nstart-up (2 ranks, debug_model.toml): {seconds:.1f} s from launching torchrun to the "
              "start of the first step")
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps(figures, indent=1))
        print(f"\nfigures written to {opts.json}")


if __name__ == "__main__":
    main()
