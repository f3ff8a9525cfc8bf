"""The trainer's builders used from research code: the script of docs/research.md (its own loop
and loss on the project's config, plan, data, model and optimizer builders) trains the debug
model, and the Trainer is those same builders."""

from __future__ import annotations

import re
import sys

import pytest

from tests.dist_utils import REPO_ROOT, run_command


def _research_example(name: str, folder, file_name: str):
    """docs/research.md's python block marked ``<!-- NAME:start -->``, written to ``folder / file_name``."""
    text = (REPO_ROOT / "docs" / "research.md").read_text(encoding="utf-8")
    match = re.search(rf"<!-- {name}:start -->\n```python\n(.*?)```\n<!-- {name}:end -->", text, re.S)
    assert match, f"docs/research.md lost its marked {name}"
    script = folder / file_name
    script.write_text(match.group(1), encoding="utf-8")
    return script


def _research_script(folder):
    return _research_example("research-example", folder, "research_loop.py")


@pytest.mark.slow
def test_research_script_on_the_builders_trains(tmp_path):
    script = _research_script(tmp_path)
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


def _objective_example(folder):
    """docs/research.md's objective script, imported as a module (its ``__main__`` part not run)."""
    import importlib.util

    script = _research_example("objective-example", folder, "z_loss_objective.py")
    spec = importlib.util.spec_from_file_location("z_loss_objective", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _objective_runs(folder: str) -> dict:
    from pathlib import Path

    from tests.conftest import TINY_ARGS
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    example = _objective_example(Path(folder))
    out = {}
    for name, weight in (("trainer's own", None), ("weight 0", 0.0), ("weight 1e-2", 1e-2)):
        trainer = Trainer(load_job_config([*TINY_ARGS, "--training.steps", "4", "--validation.no-enable",
                                           "--metrics.no-enable_tensorboard", "--job.dump_folder", f"{folder}/{name}"]))
        if weight is not None:
            trainer.objective = example.ZLossObjective(weight, token_ranks=trainer.plan.token_ranks,
                                                       group=trainer.mesh.tokens)
        out[name] = trainer.train()
        trainer.metrics.close()  # (the process group stays for the next trainer)
    return out


@pytest.mark.slow
def test_the_objective_example_of_the_research_page_plugs_into_the_trainer(tmp_path):
    """docs/research.md's z-loss objective, set on a built trainer: with weight 0 it trains
    exactly as the trainer's own objective (same losses and gradient norms, and a z-loss
    metric of its own); with a weight the loss moves and the first z-loss, of the same initial
    logits, is the same."""
    from tests.dist_utils import run_distributed

    runs = run_distributed(_objective_runs, 1, str(tmp_path))[0]
    own, zero, weighted = runs["trainer's own"], runs["weight 0"], runs["weight 1e-2"]
    assert [(r["loss"], r["grad_norm"]) for r in zero] == [(r["loss"], r["grad_norm"]) for r in own]
    assert "z_loss" not in own[0] and all(r["z_loss"] > 0 for r in zero)
    assert weighted[0]["z_loss"] == pytest.approx(zero[0]["z_loss"], rel=1e-9)
    assert weighted[0]["loss"] == pytest.approx(own[0]["loss"] + 1e-2 * zero[0]["z_loss"], rel=1e-6)
    assert weighted[-1]["loss"] != own[-1]["loss"]
