"""``torch.compile`` (``torchtitan_lite/distributed/compile.py``) through the trainer, on 2 gloo
ranks: compiled runs (blocks and loss, with full and with selective activation checkpointing)
match eager and compile nothing new after the first step (dynamo's counters); on a CPU without
bf16 matmuls the compiled blocks run their bf16 linears in fp32 (the scenario tier).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_activation_checkpoint import AC_MODES, STEPS, _trainer


def _compiled_runs(dump: str) -> dict[str, Any]:
    """Eager, compiled, and compiled with AC full and selective: losses and what dynamo compiled
    after the first step."""
    from torch._dynamo.utils import counters

    from torchtitan_lite.distributed.compile import is_compiled

    out: dict[str, Any] = {}
    # (compiled blocks without checkpointing: the compiled expert-parallel and GRPO cases)
    for label, argv in {"eager": [],
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
        for label in ("compiled_full", "compiled_op"):
            run = rank[label]
            assert run["compiled_blocks"] == [True, True]
            assert run["names"] == eager["names"]
            assert run["new_graphs_after_first_step"] == 0, label
            assert run["graph_breaks"] == 0
            for got, want in zip(run["losses"], eager["losses"], strict=True):
                assert abs(got - want) <= 1e-5 * abs(want), (label, run["losses"], eager["losses"])


@pytest.mark.scenario  # (inductor on a fresh machine: 19 s; the compiled fp32 cases above stay)
@pytest.mark.slow
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

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
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
