from __future__ import annotations

import pytest

from tests.dist_utils import REPO_ROOT, shutdown_pools

# Settings for a tiny but real job: the tiny Llama flavor (GQA, 2 layers) on short windows of
# the embedded corpus, fp32 and deterministic so that runs can be compared to 1e-5.
TINY_ARGS = [
    "--model.flavor", "tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--training.steps", "4",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
    "--optimizer.lr", "3e-3",
    "--metrics.log_freq", "1",
    "--debug.deterministic",
]


@pytest.fixture
def repo_root():
    return REPO_ROOT


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with the most ``slow`` tests first (order within a module kept): with
    ``-n 2 --dist loadscope`` each module runs whole on one worker, and the long ones start
    at once instead of leaving one worker busy at the end."""
    slow: dict[str, int] = {}
    for item in items:
        slow[item.module.__name__] = slow.get(item.module.__name__, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.module.__name__])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_pools()
