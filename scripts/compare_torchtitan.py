"""Tokens/s and MFU of torchtitan_lite against TorchTitan on the same GPU, job, data and tokenizer.

    python scripts/compare_torchtitan.py --rows all --steps 30 --json compare.json
    python scripts/compare_torchtitan.py --rows 1B_compile_sac --only ours --param_dtype float32  # plumbing, any device

Both frameworks read one TOML file in TorchTitan's last TOML layout (TorchTitan 0.2.x, the last
release that takes TOML configs and runs on torch 2.11), written per row: the same model shape,
local batch, sequence length, bf16 mixed precision, activation checkpointing and compile. Each
job runs on one process per GPU under ``torchrun``; the rows' runs alternate ours / TorchTitan's
(the order flips every round). A run's figure is the median tokens/s per GPU (and MFU) over its
steps after ``--skip_steps`` (compilation and warm-up excluded); the ratio ours/TorchTitan is of
the medians over rounds.

What both share, made once under ``--workdir``: a JSON-lines corpus (this Python's standard
library sources, the text our embedded default dataset uses) read as TorchTitan's ``c4_test``
with ``dataset_path``, and a byte-level BPE ``tokenizer.json`` trained on it (``hf_assets_path``);
the models keep Llama 3's vocabulary of 128,256 rows (TorchTitan's flavors have it; ours gets
``--model.vocab_size 128256``).

Model shapes: ``1B`` is Llama 3.2 1B's (TorchTitan 0.2.x has no 1B flavor; the worker adds it,
with the same args as ours), ``8B_L<N>`` is Llama 3 8B cut to its first N layers (both get it the
same way). On one GPU neither applies FSDP: both compute in bf16 through autocast over fp32
weights; on several, both shard with FSDP2 and a bf16 ``MixedPrecisionPolicy``.

Without a GPU, TorchTitan's workers run on CPU through a small device shim (``_cpu_shim``: the
device type and memory queries); its step is TorchTitan's own, so ``--rows debug --param_dtype
float32`` compares the two trainers on CPU. TorchTitan 0.2.2 imports ``triton`` even there: install
both into one folder, ``pip install --no-deps --target DIR torchtitan==0.2.2 triton torchdata tyro
einops docstring-parser typeguard shtab``, and pass ``--torchtitan_path DIR``.

Needs TorchTitan importable in the workers (``pip install torchtitan==0.2.2``, or its wheels on
``PYTHONPATH``; see docs/gpu_session.md). ``--only ours`` runs without it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VOCAB = 128256
TPS = re.compile(r"step:\s*(\d+).*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")
MEMORY = re.compile(r"step:\s*(\d+).*?memory:\s*([\d.]+)GiB")

# name: (flavor, local batch, seq_len, activation checkpointing, compile)
ROWS: dict[str, tuple[str, int, int, str, bool]] = {
    "1B": ("1B", 4, 2048, "none", False),
    "1B_sac": ("1B", 4, 2048, "selective", False),
    "1B_compile": ("1B", 4, 2048, "none", True),
    "1B_compile_sac": ("1B", 4, 2048, "selective", True),
    "8B_cut": ("8B_L{layers}", 1, 8192, "selective", False),
    "8B_cut_compile": ("8B_L{layers}", 1, 8192, "selective", True),
    "8B_cut_full_ac": ("8B_L{layers}", 1, 8192, "full", False),
    # Not a comparison row: the plumbing on any device (e.g. --only ours --param_dtype float32).
    "debug": ("debugmodel", 2, 256, "none", False),
}


# --------------------------------------------------------------------------------------------
# Workers (run under torchrun): add the flavors both frameworks lack, then run the real entry point
# --------------------------------------------------------------------------------------------


def _cut_layers(flavor: str) -> int | None:
    match = re.fullmatch(r"8B_L(\d+)", flavor)
    return int(match.group(1)) if match else None


def _worker_ours(toml: str, flavor: str, extra: list[str]) -> int:
    import dataclasses

    from torchtitan_lite import train
    from torchtitan_lite.models.llama3.model import LLAMA3_FLAVORS

    layers = _cut_layers(flavor)
    if layers is not None:
        LLAMA3_FLAVORS[flavor] = dataclasses.replace(LLAMA3_FLAVORS["8B"], n_layers=layers)
    return train.main(["--job.config_file", toml, "--model.vocab_size", str(VOCAB), *extra])


def _worker_torchtitan(toml: str, flavor: str, extra: list[str]) -> int:
    import dataclasses

    # Before any import of TorchTitan: its ConfigManager.parse_args takes sys.argv[1:] as a
    # default argument, bound when the module is imported.
    sys.argv = [sys.argv[0], "--job.config_file", toml, *extra]
    import torch

    if not torch.cuda.is_available():
        _cpu_shim()
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args
    from torchtitan.train import Trainer, main

    llama3_args.setdefault("1B", TransformerModelArgs(  # Llama 3.2 1B, as our "1B" flavor
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
        rope_theta=500000, vocab_size=VOCAB))
    layers = _cut_layers(flavor)
    if layers is not None:
        llama3_args[flavor] = dataclasses.replace(llama3_args["8B"], n_layers=layers)
    llama3_args[flavor] = dataclasses.replace(llama3_args[flavor], vocab_size=VOCAB)
    main(Trainer)
    return 0


def _cpu_shim() -> None:
    """Let TorchTitan, which assumes an accelerator, run on CPU processes (gloo): its device
    type becomes ``cpu`` and its device module answers the memory queries with zeros. For
    checking this script's plumbing without a GPU; the figures mean nothing."""
    import types

    import torch
    import torch._utils

    class CpuModule(types.SimpleNamespace):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch.cpu, name) if hasattr(torch.cpu, name) else (lambda *a, **k: None)

    module = CpuModule(
        get_device_name=lambda *a: "cpu", current_device=lambda: 0, device_count=lambda: 1,
        get_device_properties=lambda *a: types.SimpleNamespace(total_memory=2**40, name="cpu"),
        memory_stats=lambda *a: {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0,
                                 "num_alloc_retries": 0, "num_ooms": 0})
    torch._utils._get_available_device_type = lambda: "cpu"  # read by TorchTitan when it is imported
    torch._utils._get_device_module = lambda device_type=None: module


# --------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------


def prepare(workdir: Path, *, corpus_mb: float) -> tuple[Path, Path]:
    """The shared corpus (JSON lines of {"text": ...}) and tokenizer folder under ``workdir``."""
    data, tok = workdir / "corpus", workdir / "tokenizer"
    if (data / "train.json").exists() and (tok / "tokenizer.json").exists():
        return data, tok
    data.mkdir(parents=True, exist_ok=True)
    tok.mkdir(parents=True, exist_ok=True)
    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        size += len(text)
        if size > corpus_mb * 2**20:
            break
    with open(data / "train.json", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=8192, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(tok / "tokenizer.json"))
    (tok / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": special[0], "eos_token": special[1], "add_bos_token": True, "add_eos_token": False}))
    return data, tok


def write_toml(path: Path, row: tuple[str, int, int, str, bool], *, dump: Path, data: Path, tok: Path,
               steps: int, param_dtype: str) -> None:
    flavor, batch, seq, ac, compiled = row
    path.write_text(f"""[job]
dump_folder = "{dump}"
description = "compare_torchtitan {path.stem}"

[model]
name = "llama3"
flavor = "{flavor}"
hf_assets_path = "{tok}"

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8
implementation = "fused"

[lr_scheduler]
warmup_steps = 5

[training]
local_batch_size = {batch}
seq_len = {seq}
max_norm = 1.0
steps = {steps}
dataset = "c4_test"
dataset_path = "{data}"
mixed_precision_param = "{param_dtype}"
mixed_precision_reduce = "float32"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default"

[metrics]
log_freq = 1
disable_color_printing = true
enable_tensorboard = false

[activation_checkpoint]
mode = "{ac}"
selective_ac_option = "op"

[compile]
enable = {str(compiled).lower()}
components = ["model", "loss"]

[checkpoint]
enable = false

[validation]
enable = false
""")


def _figures_ours(dump: Path, skip: int) -> dict[str, Any]:
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("run_id") == records[-1].get("run_id")]  # this run's (the file appends)
    kept = [r for r in records if r.get("step", 0) > skip and r.get("tps")]
    return {"tps": statistics.median(r["tps"] for r in kept),
            "mfu_pct": statistics.median(r["mfu_pct"] for r in kept) if kept[0].get("mfu_pct") is not None else None,
            "memory_gib": max((r.get("memory_max_reserved_gib") or 0) for r in records),
            "steps": len(kept)}


def _figures_torchtitan(log: str, skip: int) -> dict[str, Any]:
    found = [(int(s), float(t.replace(",", "")), float(m)) for s, t, m in TPS.findall(log)]
    kept = [f for f in found if f[0] > skip]
    memory = [float(m) for _, m in MEMORY.findall(log)]
    return {"tps": statistics.median(f[1] for f in kept), "mfu_pct": statistics.median(f[2] for f in kept),
            "memory_gib": max(memory) if memory else None, "steps": len(kept)}


def run_one(framework: str, toml: Path, flavor: str, *, nproc: int, skip: int, dump: Path,
            extra: list[str], torchtitan_path: str | None, timeout: float) -> dict[str, Any]:
    from torchtitan_lite.distributed import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--nnodes=1", str(Path(__file__).resolve()),
           "--worker", framework, "--toml", str(toml), "--flavor", flavor, "--", *extra]
    path = [str(REPO), *([torchtitan_path] if torchtitan_path else []), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    start = time.perf_counter()
    from benchmark import run_launched  # (scripts/benchmark.py, beside this script)

    done = run_launched(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        timeout=timeout)
    wall = time.perf_counter() - start
    log = done.stdout + done.stderr
    (dump / f"{framework}.log").write_text(log)
    if done.returncode != 0:
        kept = Path(tempfile.gettempdir()) / f"compare_torchtitan_{toml.stem}_{framework}.log"  # outlives workdir
        kept.write_text(log)
        tail = "\n".join(log.strip().splitlines()[-15:])
        raise SystemExit(f"error: {framework} run of {toml.stem} failed (exit {done.returncode}); "
                         f"log: {kept}\n{tail}")
    figures = _figures_ours(dump, skip) if framework == "ours" else _figures_torchtitan(log, skip)
    return {**figures, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="all", help=f"comma list of {', '.join(ROWS)}, or all")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip_steps", type=int, default=10, help="steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each framework per row (order flips)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the 8B_cut rows")
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per job")
    parser.add_argument("--only", choices=("ours", "torchtitan"), default=None)
    parser.add_argument("--param_dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--torchtitan_path", default=None, help="prepended to the workers' PYTHONPATH")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the corpus, tokenizer and runs go, kept for the next run (default: a "
                             "temporary folder, removed at the end, also when the script is stopped)")
    parser.add_argument("--corpus_mb", type=float, default=24.0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", choices=("ours", "torchtitan"), help=argparse.SUPPRESS)
    parser.add_argument("--toml", help=argparse.SUPPRESS)
    parser.add_argument("--flavor", help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        sys.path.insert(0, str(REPO))
        worker = _worker_ours if opts.worker == "ours" else _worker_torchtitan
        raise SystemExit(worker(opts.toml, opts.flavor, opts.extra))

    names = list(ROWS) if opts.rows == "all" else opts.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown row(s) {', '.join(unknown)}; known: {', '.join(ROWS)}")
    if opts.skip_steps >= opts.steps:
        parser.error(f"--skip_steps {opts.skip_steps} leaves no step of --steps {opts.steps}")
    sys.path.insert(0, str(REPO))
    from benchmark import end_on_signals  # (scripts/benchmark.py, beside this script)

    end_on_signals()  # a stopped comparison ends its launch and removes its temporary folder
    with contextlib.ExitStack() as stack:
        if opts.workdir is None:
            opts.workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="compare_torchtitan_")))
        _compare(opts, names)


def _compare(opts: argparse.Namespace, names: list[str]) -> None:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    frameworks = [opts.only] if opts.only else ["ours", "torchtitan"]
    data, tok = prepare(opts.workdir, corpus_mb=opts.corpus_mb)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "device": device, "torch": torch.__version__,
                               "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()
                                           if k not in ("worker", "toml", "flavor", "extra")},
                               "rows": {}}
    print(f"compare on {device}, torch {torch.__version__}: rows {', '.join(names)}; {opts.steps} steps, "
          f"medians after step {opts.skip_steps}, {opts.rounds} round(s)")
    for name in names:
        flavor, batch, seq, ac, compiled = ROWS[name]
        row = (flavor.format(layers=opts.layers), batch, seq, ac, compiled)
        runs: dict[str, list[dict[str, Any]]] = {f: [] for f in frameworks}
        for round_index in range(opts.rounds):
            for framework in frameworks if round_index % 2 == 0 else frameworks[::-1]:
                dump = opts.workdir / "runs" / f"{name}_{framework}_{round_index}"
                dump.mkdir(parents=True, exist_ok=True)
                toml = dump / f"{name}.toml"
                write_toml(toml, row, dump=dump, data=data, tok=tok, steps=opts.steps, param_dtype=opts.param_dtype)
                runs[framework].append(run_one(framework, toml, row[0], nproc=opts.nproc, skip=opts.skip_steps,
                                               dump=dump, extra=[], torchtitan_path=opts.torchtitan_path,
                                               timeout=opts.timeout))
        summary: dict[str, Any] = {"flavor": row[0], "local_batch_size": batch, "seq_len": seq, "ac": ac,
                                   "compile": compiled, "runs": runs}
        for framework in frameworks:
            summary[f"{framework}_tps"] = statistics.median(r["tps"] for r in runs[framework])
            mfus = [r["mfu_pct"] for r in runs[framework] if r["mfu_pct"] is not None]
            summary[f"{framework}_mfu_pct"] = statistics.median(mfus) if mfus else None
        if len(frameworks) == 2:
            summary["ratio"] = summary["ours_tps"] / summary["torchtitan_tps"]
        results["rows"][name] = summary
        line = "  ".join(f"{f} {summary[f'{f}_tps']:,.0f} tok/s"
                         + (f" (MFU {summary[f'{f}_mfu_pct']:.1f}%)" if summary[f"{f}_mfu_pct"] is not None else "")
                         for f in frameworks)
        print(f"{name:16} {row[0]:8} b{batch} s{seq} ac={ac:9} compile={str(compiled):5}  {line}"
              + (f"  ours/TorchTitan {summary['ratio']:.3f}" if "ratio" in summary else ""), flush=True)
        if opts.json:  # after every row: a run cut short keeps what it measured
            opts.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
