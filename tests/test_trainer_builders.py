"""The trainer's builders used from research code: the script of docs/research.md (its own loop
and loss on the project's config, plan, data, model and optimizer builders) trains the debug
model, and the Trainer is those same builders."""

from __future__ import annotations

import re
import sys

import pytest

from tests.dist_utils import REPO_ROOT, run_command


def _research_script(folder):
    text = (REPO_ROOT / "docs" / "research.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- research-example:start -->\n```python\n(.*?)```\n<!-- research-example:end -->",
                      text, re.S)
    assert match, "docs/research.md lost its marked research script"
    script = folder / "research_loop.py"
    script.write_text(match.group(1), encoding="utf-8")
    return script


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
