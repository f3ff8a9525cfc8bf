"""Step metrics to the console, a JSON-lines file and TensorBoard."""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["MetricsLogger", "memory_stats"]

logger = logging.getLogger("torchtitan_lite")


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory in GiB: CUDA max active/reserved on GPU, process peak RSS on CPU."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {
            "memory_max_active_gib": stats.get("active_bytes.all.peak", 0) / 2**30,
            "memory_max_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / 2**30,
        }
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024
    return {"memory_peak_rss_gib": rss * scale / 2**30}


class MetricsLogger:
    """Writes one record per logged step; only rank 0 writes anything.

    Records go to ``<dump_folder>/metrics.jsonl`` (appended; each record carries the run id)
    and, when enabled, to TensorBoard under ``<dump_folder>/<tb_folder>/<run_id>``.
    """

    def __init__(
        self,
        *,
        rank: int,
        dump_folder: str | Path,
        enable_tensorboard: bool,
        tb_folder: str,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        self.rank = rank
        now = time.time()
        self.run_id = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
        self.jsonl_path = Path(dump_folder) / "metrics.jsonl"
        self._tb: Any = None
        self._jsonl: Any = None
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

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.rank != 0:
            return
        record = {"step": step, "run_id": self.run_id, **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        parts = [f"step {step:>6d}", f"loss {values['loss']:8.4f}"]
        if "grad_norm" in values:
            parts.append(f"grad_norm {values['grad_norm']:8.4f}")
        parts.append(f"lr {values['lr']:.3e}")
        parts.append(f"tps {values['tps']:>9,.0f}")
        mem = next((v for k, v in values.items() if k.startswith("memory_")), None)
        if mem is not None:
            parts.append(f"mem {mem:6.2f}GiB")
        logger.info("  ".join(parts))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
