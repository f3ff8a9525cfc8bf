"""What the trainer benchmarks share: their command line and the timed rounds.

Each benchmark builds one trainer per job once, then takes ``--steps`` steps of each job in turn
for ``--rounds`` rounds (after one warm-up step each, taken when it is built), so that a busy
host slows every job alike; the median step counts.
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def trainer_bench_parser(description: str, *, seq_len: int) -> argparse.ArgumentParser:
    """``--flavor``, ``--seq_len``, ``--steps``, ``--rounds`` and ``--json``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--seq_len", type=int, default=seq_len)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    return parser


def timed_rounds(trainers: dict[str, Any], *, steps: int, rounds: int) -> dict[str, list[float]]:
    """Each trainer's step times (seconds), ``steps`` steps of each in turn, ``rounds`` times;
    closes the trainers."""
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(rounds):
        for name, trainer in trainers.items():
            for _ in range(steps):
                start = time.perf_counter()
                trainer.train_step()
                times[name].append(time.perf_counter() - start)
    for trainer in trainers.values():
        trainer.close()
    return times


def write_rows(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """With ``--json PATH``: the run's settings and its rows, as JSON."""
    if args.json:
        import json
        from pathlib import Path

        Path(args.json).write_text(json.dumps({"flavor": args.flavor, "seq_len": args.seq_len, "steps": args.steps,
                                               "rounds": args.rounds, "rows": rows}, indent=1) + "\n")
