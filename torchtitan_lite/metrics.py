"""Step metrics: throughput, TFLOP/s and MFU, memory; to the console, JSON lines and TensorBoard."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "PEAK_BF16_TFLOPS",
    "RECORD_KEYS",
    "MetricsLogger",
    "device_peak_tflops",
    "memory_stats",
    "reset_peak_memory",
]

logger = logging.getLogger("torchtitan_lite")

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s from the vendors' data sheets, matched
# against torch.cuda.get_device_name() in order (the first substring that occurs wins).
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.4),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),  # SXM
    ("H800", 989.4),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.05),
    ("L40", 181.05),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("MI300X", 1307.4),
    ("MI250X", 383.0),
]

# Every record of metrics.jsonl has exactly these keys, in this order (None where a value does
# not apply to the device or was not measured at that step), so consumers can rely on them.
RECORD_KEYS = (
    "step",
    "run_id",
    "time",
    "loss",
    "grad_norm",
    "skipped",
    "lr",
    "tokens_seen",
    "tps",
    "tokens_per_rank",
    "tflops",
    "mfu_pct",
    "step_time_s",
    "data_time_s",
    "compute_time_s",
    "memory_max_active_gib",
    "memory_max_reserved_gib",
    "memory_peak_rss_gib",
    "validation_loss",
    "validation_perplexity",
    "validation_tokens",
    "validation_time_s",
)


def device_peak_tflops(
    device: torch.device, configured: float | None = None, *, compute_dtype: torch.dtype = torch.bfloat16
) -> tuple[float | None, str]:
    """Peak TFLOP/s for MFU and where it comes from: the configured value, else the table for a
    known GPU when compute runs in bf16, else ``None`` (CPU, unknown devices, fp32 compute: no
    MFU rather than one against the wrong peak)."""
    if configured is not None:
        return configured, "metrics.peak_tflops"
    if device.type != "cuda":
        return None, f"no peak known for {device.type} (set metrics.peak_tflops)"
    if compute_dtype != torch.bfloat16:
        return None, f"the table holds bf16 peaks and compute runs in {compute_dtype} (set metrics.peak_tflops)"
    name = torch.cuda.get_device_name(device)
    for pattern, peak in PEAK_BF16_TFLOPS:
        if pattern in name:
            return peak, f"{name} bf16 dense peak"
    return None, f"no peak known for {name!r} (set metrics.peak_tflops)"


def memory_stats(device: torch.device) -> dict[str, float | None]:
    """Peak memory in GiB: CUDA max active/reserved since the last reset (None off CUDA), and the
    process's peak resident set size (host memory, which CPU offload and the CPU backend use)."""
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out: dict[str, float | None] = {
        "memory_max_active_gib": None,
        "memory_max_reserved_gib": None,
        "memory_peak_rss_gib": rss * (1 if sys.platform == "darwin" else 1024) / 2**30,
    }
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        out["memory_max_active_gib"] = stats.get("active_bytes.all.peak", 0) / 2**30
        out["memory_max_reserved_gib"] = stats.get("reserved_bytes.all.peak", 0) / 2**30
    return out


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory interval (CUDA; the RSS peak is per process and cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class _Style:
    """ANSI colours, only when the console is a terminal, NO_COLOR is not set and colours are not
    disabled (``metrics.disable_color_printing``)."""

    def __init__(self, stream: Any, *, disabled: bool = False) -> None:
        self.enabled = (not disabled and bool(getattr(stream, "isatty", lambda: False)())
                        and "NO_COLOR" not in os.environ)

    def __call__(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.enabled else text


def _fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


class MetricsLogger:
    """Writes one record per logged step; only rank 0 writes anything.

    Records go to ``<dump_folder>/metrics.jsonl`` (appended; each record carries the run id and
    the keys of :data:`RECORD_KEYS`), to TensorBoard under ``<dump_folder>/<tb_folder>/<run_id>``
    when enabled, and as one aligned line to the console.
    """

    def __init__(
        self,
        *,
        rank: int,
        dump_folder: str | Path,
        enable_tensorboard: bool,
        tb_folder: str,
        run_config: dict[str, Any] | None = None,
        disable_color: bool = False,
        objective: Any = None,
    ) -> None:
        self.rank = rank
        # The objective's own parts of the console line (its ObjectiveEntry: console, validation_console).
        self.objective = objective
        now = time.time()
        self.run_id = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
        self.jsonl_path = Path(dump_folder) / "metrics.jsonl"
        self.tb_dir: Path | None = None
        self._tb: Any = None
        self._jsonl: Any = None
        self._style = _Style(sys.stdout, disabled=disable_color)
        if rank != 0:
            return
        self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        self._jsonl = self.jsonl_path.open("a", encoding="utf-8")
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            base = Path(dump_folder) / tb_folder
            run_dir = base / self.run_id
            suffix = 1
            while run_dir.exists():  # never write into an earlier run's folder
                run_dir = base / f"{self.run_id}-{suffix}"
                suffix += 1
            self.tb_dir = run_dir
            self._tb = SummaryWriter(log_dir=str(run_dir))
            if run_config is not None:
                self._tb.add_text("config", f"```\n{json.dumps(run_config, indent=2)}\n```")

    def log(self, step: int, values: dict[str, Any]) -> dict[str, Any] | None:
        """Write the record of ``step`` (rank 0); returns it, or None on other ranks."""
        if self.rank != 0:
            return None
        record: dict[str, Any] = {key: values.get(key) for key in RECORD_KEYS}
        record.update(step=step, run_id=self.run_id, time=time.time())
        record.update({k: v for k, v in values.items() if k not in record})  # caller's extras last
        # JSON has no NaN or Infinity: a non-finite value (a diverged step) is written as null.
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self._jsonl.write(json.dumps(finite, allow_nan=False) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("step", "run_id", "time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        logger.info(self._console_line(record))
        return record

    def _console_line(self, r: dict[str, Any]) -> str:
        s = self._style
        parts = [s(f"step {r['step']:>6d}", "1")]
        if r["loss"] is not None:
            parts.append(s(f"loss {r['loss']:8.4f}", "36"))
        if r["grad_norm"] is not None:
            parts.append(f"grad_norm {r['grad_norm']:8.4f}")
        if r["lr"] is not None:
            parts.append(f"lr {r['lr']:.3e}")
        if r["tps"] is not None:
            parts.append(s(f"tps {r['tps']:>9,.0f}", "34"))
            parts.append(f"tflops {_fmt(r['tflops'], '7.2f', '      -')}")
            if r["mfu_pct"] is not None:
                parts.append(f"mfu {r['mfu_pct']:5.2f}%")
        mem = r["memory_max_active_gib"] if r["memory_max_active_gib"] is not None else r["memory_peak_rss_gib"]
        if mem is not None:
            parts.append(s(f"mem {mem:6.2f}GiB", "33"))
        if r["step_time_s"]:
            data_pct = 100.0 * (r["data_time_s"] or 0.0) / r["step_time_s"]
            parts.append(f"data {data_pct:4.1f}%")
        if r.get("moe/load_max_over_mean") is not None:  # a mixture of experts: the worst layer's load, the aux loss
            aux = r.get("moe/aux_loss")
            parts.append(f"moe_load {r['moe/load_max_over_mean']:.2f}" + ("" if aux is None else f" aux {aux:.4f}"))
        if self.objective is not None:  # the objective's own (DPO's reward metrics, online RL's rollouts …)
            parts += self.objective.console(r)
        if r["validation_loss"] is not None:
            own = None if self.objective is None else self.objective.validation_console(r)
            parts.append(s(own if own is not None else
                           f"val_loss {r['validation_loss']:8.4f} val_ppl {_fmt(r['validation_perplexity'], '.2f')}",
                           "35"))
        # Per source of a mixture: this step's loss and its tokens so far; each validation set's loss.
        for key, value in r.items():
            if key.startswith("loss/"):
                pairs = r.get(f"pairs/{key[5:]}")  # preference pairs count pairs, not tokens
                seen = (f"{_fmt(pairs, ',.0f')} pairs" if pairs is not None
                        else f"{_fmt(r.get(f'tokens/{key[5:]}'), ',.0f')} tok")
                parts.append(f"{key[5:]} {_fmt(value, '.4f')} ({seen})")
            elif key.startswith("validation/") and key.endswith("/loss"):
                parts.append(s(f"val[{key[11:-5]}] {_fmt(value, '.4f')}", "35"))
        return "  ".join(parts)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

