"""The library example in README.md runs as written, on 2 ranks under torchrun and alone."""

from __future__ import annotations

import re
import sys

from tests.dist_utils import REPO_ROOT, free_port, run_command


def _readme_example(tmp_path):
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(
        r"<!-- readme-example:start -->\n```python\n(.*?)```\n<!-- readme-example:end -->", text, re.S
    )
    assert match, "README.md lost its marked library example"
    script = tmp_path / "my_fsdp.py"
    script.write_text(match.group(1), encoding="utf-8")
    return script


def test_readme_example_under_torchrun(tmp_path):
    script = _readme_example(tmp_path)
    result = run_command(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(script)],
        cwd=tmp_path, timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok: loss" in result.stdout
    assert "DTensor (Shard(dim=0),)" in result.stdout


def test_readme_example_single_process(tmp_path):
    script = _readme_example(tmp_path)
    result = run_command([sys.executable, str(script)], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok: loss" in result.stdout
