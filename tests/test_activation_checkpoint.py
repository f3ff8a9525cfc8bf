"""Activation checkpointing (``torchtitan_lite/distributed/activation_checkpoint.py``) through
the trainer, on 2 gloo ranks, and on a plain model.

Each AC mode trains the tiny model 10 steps with the same data as no checkpointing; the blocks
really run again in backward (their forward calls are counted) and hold less memory
(``FSDPMemTracker``), and the losses are the same to the bit. ``torch.compile`` with these modes:
tests/test_compile.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed

STEPS = 5  # (each AC mode and precision: 12 jobs of 2 ranks; equal losses over 5 steps)
AC_MODES: dict[str, list[str]] = {
    "none": [],
    "full": ["--activation_checkpoint.mode", "full"],
    "op": ["--activation_checkpoint.mode", "selective"],
    "every2": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
}
PRECISIONS: dict[str, list[str]] = {
    "fp32": [],
    "bf16": ["--training.mixed_precision_param", "bfloat16"],
    "offload": ["--training.enable_cpu_offload"],
}


def _trainer(argv: list[str], dump: Path) -> Any:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    return Trainer(load_job_config([*TINY_ARGS, "--training.steps", str(STEPS), *argv,
                                    "--job.dump_folder", str(dump)]))


def _ac_runs(dump: str) -> dict[str, Any]:
    """Every AC mode under every precision setting, in this process group."""
    from torchtitan_lite.distributed.activation_checkpoint import checkpoint_policy_of
    from torchtitan_lite.loss import token_loss_sum
    from torchtitan_lite.memory.measure import measure_step_memory

    out: dict[str, Any] = {}
    for precision, precision_args in PRECISIONS.items():
        for mode, mode_args in AC_MODES.items():
            trainer = _trainer([*precision_args, *mode_args], Path(dump) / f"{precision}_{mode}")
            blocks = list(trainer.model.layers.values())
            calls = [0] * len(blocks)
            for index, block in enumerate(blocks):  # a pre-hook: recomputation stops early, inside w2
                block.feed_forward.register_forward_pre_hook(
                    lambda *_, index=index, calls=calls: calls.__setitem__(index, calls[index] + 1))
            result = {
                "policies": [checkpoint_policy_of(b) for b in blocks],
                "names": sorted(n for n, _ in trainer.model.named_parameters()),
                "losses": [h["loss"] for h in trainer.train()],
                "ffn_calls_per_step": [c / STEPS for c in calls],
            }
            if precision == "fp32":
                def loss_fn(trainer: Any = trainer) -> torch.Tensor:
                    (inputs, labels), = trainer.loader.next_batch()
                    return token_loss_sum(trainer.model(inputs), labels) / labels.numel()

                result["activations"] = measure_step_memory(trainer.model, trainer.optimizer,
                                                            loss_fn)["peak"]["activations"]
            out[f"{precision}/{mode}"] = result
    return out


@pytest.fixture(scope="module")
def ac_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_ac_runs, 2, str(tmp_path_factory.mktemp("ac")))


@pytest.mark.slow
def test_every_ac_mode_gives_the_losses_of_none(ac_runs: list[dict[str, Any]]) -> None:
    for rank in ac_runs:
        for precision in PRECISIONS:
            reference = rank[f"{precision}/none"]
            for mode in AC_MODES:
                run = rank[f"{precision}/{mode}"]
                assert run["names"] == reference["names"]  # no wrapper: same parameter names
                assert run["losses"] == reference["losses"], (precision, mode, run["losses"], reference["losses"])
                assert len(run["losses"]) == STEPS and all(x == x for x in run["losses"])


@pytest.mark.slow
def test_checkpointed_blocks_recompute_and_hold_less(ac_runs: list[dict[str, Any]]) -> None:
    expected = {"none": ["none", "none"], "full": ["full", "full"], "op": ["op", "op"], "every2": ["none", "full"]}
    for rank in ac_runs:
        for precision in PRECISIONS:
            for mode, policies in expected.items():
                run = rank[f"{precision}/{mode}"]
                assert run["policies"] == policies
                # One forward per step, and a second one in backward where the block is recomputed.
                assert run["ffn_calls_per_step"] == [1.0 if p == "none" else 2.0 for p in policies]
        act = {mode: rank[f"fp32/{mode}"]["activations"] for mode in AC_MODES}
        assert act["full"] < act["op"] < act["none"], act
        assert act["full"] < act["every2"] < act["none"], act


def test_apply_activation_checkpointing_on_a_plain_model_and_its_errors() -> None:
    """The same function works on a researcher's model; bad settings are one clear line."""
    from torch import nn

    from torchtitan_lite.distributed.activation_checkpoint import (
        apply_activation_checkpointing,
        block_policies,
    )

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    plain = nn.Sequential(*(Block() for _ in range(4)))
    checkpointed = nn.Sequential(*(Block() for _ in range(4)))
    checkpointed.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(checkpointed, blocks=checkpointed, mode="selective",
                                          selective_ac_option=2) == ["none", "full", "none", "full"]
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(3, 8)
    plain(x).square().sum().backward()
    checkpointed(x).square().sum().backward()
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)

    assert block_policies("selective", "3", 6) == ["none", "none", "full", "none", "none", "full"]
    with pytest.raises(ValueError, match=r"^activation_checkpoint.mode: invalid value 'partial'; expected one "
                                         r"of none, full, selective$"):
        block_policies("partial", "op", 2)
    with pytest.raises(ValueError, match="selective_ac_option: invalid value 0"):
        block_policies("selective", 0, 2)
    with pytest.raises(ValueError, match="already checkpointed"):
        apply_activation_checkpointing(checkpointed, blocks=checkpointed, mode="full")
    with pytest.raises(ValueError, match="for each of the 4 blocks"):
        apply_activation_checkpointing(plain, blocks=plain, policies=["full"])
