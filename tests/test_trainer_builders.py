"""The trainer's builders used from research code: the scripts of docs/research.md,
``examples/research_loop.py`` (its own loop and loss on the project's config, plan, data, model and
optimizer builders) and ``examples/z_loss_objective.py`` (an objective of its own set on the
Trainer), train the debug model; the Trainer is those same builders. (The page shows the files word
for word: tests/test_docs_examples.py's ``file`` marker.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.dist_utils import REPO_ROOT, run_command

EXAMPLES = REPO_ROOT / "examples"


@pytest.mark.slow
def test_research_script_on_the_builders_trains(tmp_path):
    script = EXAMPLES / "research_loop.py"
    steps = 24
    result = run_command([sys.executable, str(script), "--model.flavor", "tiny", "--training.seq_len", "64",
                          "--training.local_batch_size", "4", "--training.steps", str(steps),
                          "--training.mixed_precision_param", "float32", "--optimizer.lr", "3e-3",
                          "--lr_scheduler.warmup_steps", "4", "--job.dump_folder", str(tmp_path / "dump")],
                         cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"^step \d+ cross-entropy (\S+)$", result.stdout, re.M)]
    assert len(losses) == steps, result.stdout
    # From about a uniform guess over the 258 byte ids (ln 258 = 5.55) to well below it.
    assert losses[0] > 5.0, losses
    assert sum(losses[-4:]) / 4 < losses[0] - 1.0, losses


def _objective_runs(folder: str, cases: dict[str, list[str]]) -> dict[str, tuple[int, str, list[dict]]]:
    """Each case's job through ``train.main`` (the command line's path) in this rank process, with
    ``folder`` (where the test wrote the objective's module) on the import path: its exit code,
    what it wrote to stderr, its metrics records."""
    import sys

    from tests.dist_utils import read_jsonl, run_main

    sys.path.insert(0, folder)
    try:
        results = run_main([argv for argv in cases.values()])
    finally:
        sys.path.remove(folder)
    out = {}
    for (name, argv), result in zip(cases.items(), results, strict=True):
        metrics = Path(argv[argv.index("--job.dump_folder") + 1]) / "metrics.jsonl"
        records = [r for r in read_jsonl(metrics) if "loss" in r] if metrics.exists() else []
        out[name] = (result.returncode, result.stderr, records)
    return out


@pytest.mark.slow
def test_an_objective_of_ones_own_registers_and_runs_through_the_command_line(tmp_path):
    """docs/research.md's z-loss objective (``examples/z_loss_objective.py``), written by the test as
    a module of its own and named on the command line (``--training.objective MODULE.Z_LOSS``),
    touching no module of the package: with weight 0 it trains exactly as the token objective
    (same losses and gradient norms) and logs a z-loss of its own; with a weight the first loss is
    the cross-entropy plus the weight times that z-loss, and the later ones move; what its plan
    refuses is one line before any process group."""
    from tests.conftest import TINY_ARGS
    from tests.dist_utils import run_distributed

    (tmp_path / "my_objective.py").write_text((EXAMPLES / "z_loss_objective.py").read_text())

    def job(name: str, *extra: str) -> list[str]:
        return [*TINY_ARGS, "--training.steps", "4", "--validation.no-enable", "--metrics.no-enable_tensorboard",
                "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path / name), *extra]

    own = "--training.objective", "my_objective.Z_LOSS"
    runs = run_distributed(_objective_runs, 1, str(tmp_path), {
        "token": job("token"), "zero": job("zero", *own, "--training.objective_options", '{"weight": 0}'),
        "weighted": job("weighted", *own, "--training.objective_options", '{"weight": 1e-2}'),
        "refused": job("refused", *own, "--training.tiled_loss")}, fresh=True)[0]
    assert all(runs[name][0] == 0 for name in ("token", "zero", "weighted")), runs
    token, zero, weighted = (runs[name][2] for name in ("token", "zero", "weighted"))
    code, stderr, _ = runs["refused"]
    assert code == 2 and stderr.strip() == ("error: training.tiled_loss: invalid value True; the z-loss needs the "
                                            "whole logits: expected false"), stderr
    assert [(r["loss"], r["grad_norm"]) for r in zero] == [(r["loss"], r["grad_norm"]) for r in token]
    assert "z_loss" not in token[0] and all(r["z_loss"] > 0 for r in zero)
    assert weighted[0]["z_loss"] == pytest.approx(zero[0]["z_loss"], rel=1e-9)
    assert weighted[0]["loss"] == pytest.approx(token[0]["loss"] + 1e-2 * zero[0]["z_loss"], rel=1e-6)
    assert weighted[-1]["loss"] != token[-1]["loss"]


@pytest.mark.parametrize("extra, line", [
    (["--training.objective", "token"], "error: training.objective: invalid value 'token'; training.dataset = "
                                        "'preference' is read by the 'dpo' objective: expected 'auto' or 'dpo'"),
    (["--training.objective", "nope"], "error: training.objective: invalid value 'nope'; expected one of 'auto', "),
    (["--training.objective", "json.nope"], "error: training.objective: invalid value 'json.nope'; module 'json' has "
                                            "no objective entry 'nope' (an ObjectiveEntry instance)"),
    (["--training.objective", "no_such_module.ENTRY"], "error: training.objective: invalid value "
                                                       "'no_such_module.ENTRY'; its module 'no_such_module' does "
                                                       "not import"),
])
def test_an_objective_that_cannot_run_the_job_is_one_line(tmp_path, capsys, extra: list[str], line: str) -> None:
    """The shipped DPO toy with another objective named: one line, exit 2, before any process group."""
    from tests.dist_utils import refused_lines

    argv = ["--job.config_file", str(REPO_ROOT / "train_configs" / "dpo_toy.toml"), "--model.tokenizer_path",
            str(REPO_ROOT / "tests" / "assets" / "toy_rl"), "--training.dataset_path",
            str(REPO_ROOT / "tests" / "assets" / "toy_rl" / "pairs.jsonl"), "--job.dump_folder", str(tmp_path), *extra]
    lines = refused_lines(argv, capsys)
    assert len(lines) == 1 and lines[0].startswith(line), lines
