"""Activation checkpointing and ``torch.compile`` through the trainer, on 2 gloo ranks.

Each AC mode trains the tiny model 10 steps with the same data as no checkpointing; the blocks
really run again in backward (their forward calls are counted) and hold less memory
(``FSDPMemTracker``), and the losses are the same to the bit. Compiled runs (blocks and loss)
match eager and compile nothing new after the first step (dynamo's counters).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed

STEPS = 10
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


def _compiled_runs(dump: str) -> dict[str, Any]:
    """Eager, compiled, and compiled with AC full and selective: losses and what dynamo compiled
    after the first step."""
    from torch._dynamo.utils import counters

    from torchtitan_lite.distributed.compile import is_compiled

    out: dict[str, Any] = {}
    for label, argv in {"eager": [], "compiled": ["--compile.enable"],
                        "compiled_full": ["--compile.enable", *AC_MODES["full"]],
                        "compiled_op": ["--compile.enable", *AC_MODES["op"]]}.items():
        trainer = _trainer(argv, Path(dump) / label)
        losses = [trainer.train_step()["loss"]]
        graphs_after_first = counters["stats"]["unique_graphs"]
        while trainer.step < STEPS:
            losses.append(trainer.train_step()["loss"])
        out[label] = {
            "losses": losses,
            "compiled_blocks": [is_compiled(b) for b in trainer.model.layers.values()],
            "new_graphs_after_first_step": counters["stats"]["unique_graphs"] - graphs_after_first,
            "graph_breaks": sum(counters["graph_break"].values()),
            "names": sorted(n for n, _ in trainer.model.named_parameters()),
        }
    return out


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_compiled_runs, 2, str(tmp_path_factory.mktemp("compile")))


@pytest.mark.slow
def test_compiled_training_matches_eager_and_compiles_once(compiled_runs: list[dict[str, Any]]) -> None:
    for rank in compiled_runs:
        eager = rank["eager"]
        assert eager["compiled_blocks"] == [False, False]
        for label in ("compiled", "compiled_full", "compiled_op"):
            run = rank[label]
            assert run["compiled_blocks"] == [True, True]
            assert run["names"] == eager["names"]
            assert run["new_graphs_after_first_step"] == 0, label
            assert run["graph_breaks"] == 0
            for got, want in zip(run["losses"], eager["losses"], strict=True):
                assert abs(got - want) <= 1e-5 * abs(want), (label, run["losses"], eager["losses"])


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


def test_compiled_bf16_linears_run_in_fp32_where_the_cpu_lacks_bf16_matmul() -> None:
    """On a CPU without native bf16 matmul (AVX2 only) the compiled blocks do their bf16 linears
    as fp32 GEMMs; outputs and gradients stay those of eager to within bf16 rounding."""
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode

    from torchtitan_lite.distributed.compile import Bf16LinearInFp32, bf16_linear_in_fp32, compile_blocks
    from torchtitan_lite.models.decoder import TransformerBlock, precompute_freqs_cis, rope_bits
    from torchtitan_lite.models.llama3.model import LLAMA3_FLAVORS

    assert bf16_linear_in_fp32() == (not torch.ops.mkldnn._is_mkldnn_bf16_supported())

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.dtypes: set[torch.dtype] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.dtypes.add(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    linear = nn.Linear(16, 8).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    with MatmulDtypes() as seen, Bf16LinearInFp32():
        y = linear(x)
        y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and seen.dtypes == {torch.float32}
    want = nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float()).to(torch.bfloat16)
    assert torch.equal(y, want)

    args = LLAMA3_FLAVORS["tiny"]
    torch.manual_seed(0)
    eager = nn.ModuleList(TransformerBlock(i, args) for i in range(2))
    for block in eager:
        block.init_weights()
    eager.to(torch.bfloat16)
    compiled = nn.ModuleList(TransformerBlock(i, args) for i in range(2)).to(torch.bfloat16)
    compiled.load_state_dict(eager.state_dict())
    assert compile_blocks(compiled, blocks=list(compiled)) == 2
    rope = rope_bits(precompute_freqs_cis(args.head_dim, 32, args.rope_theta, args=args), 32)
    x = torch.randn(2, 32, args.dim, dtype=torch.bfloat16)
    outs = []
    for blocks in (eager, compiled):
        h = x
        for block in blocks:
            h = block(h, rope)
        h.float().square().mean().backward()
        outs.append((h.float(), blocks[0].feed_forward.w1.weight.grad.float()))
    for got, want in zip(outs[1], outs[0], strict=True):
        assert (got - want).abs().max() <= 2 ** -6 * want.abs().max(), (got - want).abs().max()
