"""The library example in docs/apply_fsdp.md runs as written, on 2 ranks under torchrun and alone, and
starts from the same weights either way (its meta-device init does not depend on sharding)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.dist_utils import REPO_ROOT, free_port, run_command


def _readme_example(folder):
    text = (REPO_ROOT / "docs" / "apply_fsdp.md").read_text(encoding="utf-8")
    match = re.search(
        r"<!-- readme-example:start -->\n```python\n(.*?)```\n<!-- readme-example:end -->", text, re.S
    )
    assert match, "docs/apply_fsdp.md lost its marked library example"
    script = folder / "my_fsdp.py"
    script.write_text(match.group(1), encoding="utf-8")
    return script


def _weight_sum(result: subprocess.CompletedProcess[str]) -> float:
    match = re.search(r"^initial weight sum: (\S+)$", result.stdout, re.M)
    assert match, result.stdout + result.stderr
    return float(match.group(1))


@pytest.fixture(scope="module")
def torchrun_result(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme_torchrun")
    script = _readme_example(folder)
    return run_command(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(script)],
        cwd=folder, timeout=180,
    )


@pytest.fixture(scope="module")
def single_process_result(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme_single")
    script = _readme_example(folder)
    return run_command([sys.executable, str(script)], cwd=folder, timeout=120)


@pytest.mark.docs  # (the docs tier, -m docs: an example of a page; .ci/run runs it)
@pytest.mark.slow
def test_readme_example_under_torchrun(torchrun_result):
    result = torchrun_result
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok: loss" in result.stdout
    assert "DTensor (Shard(dim=0),)" in result.stdout


@pytest.mark.docs  # (the docs tier, -m docs: an example of a page; .ci/run runs it)
@pytest.mark.slow
def test_readme_example_single_process(single_process_result):
    result = single_process_result
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok: loss" in result.stdout


@pytest.mark.docs  # (the docs tier, -m docs: an example of a page; .ci/run runs it)
@pytest.mark.slow
def test_readme_example_init_does_not_depend_on_sharding(torchrun_result, single_process_result):
    assert _weight_sum(torchrun_result) == _weight_sum(single_process_result)
