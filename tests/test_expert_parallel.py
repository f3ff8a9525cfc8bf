"""Expert parallelism (``torchtitan_lite/distributed/expert_parallel.py``). The token exchange: an
MoE layer whose experts are split over 2 or 4 gloo ranks, each rank routing its own tokens, gives
every rank the outputs and input gradients of the whole layer run in one process on that rank's
tokens, and each rank's experts the gradient summed over every rank's tokens; the exchanges ran.
Through the trainer: expert parallel 2 and 4 give one process's losses (under auto, selective
checkpointing and compile too); checkpoints moving between degrees: test_resume_across_layouts.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_trainer_moe import _losses_and_expert_placements, _tiny_argv

DIM, HIDDEN, EXPERTS, TOP_K = 32, 24, 8, 2


def _ranks(world: int) -> dict[str, float]:
    import torch.distributed as dist

    from torchtitan_lite.distributed import init_distributed
    from torchtitan_lite.distributed.expert_parallel import AllToAllDispatcher
    from torchtitan_lite.models.moe import MoE

    init_distributed(torch.device("cpu"))
    rank = dist.get_rank()
    torch.manual_seed(0)
    reference = MoE.build(DIM, HIDDEN, EXPERTS, TOP_K, shared_hidden_dim=16)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.2)
    parallel = MoE.build(DIM, HIDDEN, EXPERTS, TOP_K, shared_hidden_dim=16)
    parallel.load_state_dict(reference.state_dict())
    # Expert parallel by hand on plain tensors: this rank keeps its experts' slice of each
    # stacked weight and exchanges tokens through the dispatcher.
    dispatcher = parallel.dispatcher = AllToAllDispatcher(dist.group.WORLD, EXPERTS)
    local = dispatcher.local
    for name in parallel.experts.stacked_weights:
        whole = getattr(parallel.experts, name)
        setattr(parallel.experts, name, torch.nn.Parameter(whole.detach()[local.start:local.stop].clone()))
    # Each rank's own tokens (some experts get none on some ranks: 9 tokens, top-2 of 8).
    x = torch.randn(1, 9 + 4 * rank, DIM, generator=torch.Generator().manual_seed(10 + rank))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(20 + rank))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out = reference(a), parallel(b)
    out_ref.backward(grad)
    out.backward(grad)
    errors = {"output": float((out - out_ref).abs().max()), "input_grad": float((b.grad - a.grad).abs().max()),
              "router_grad": float((parallel.router.gate.weight.grad - reference.router.gate.weight.grad).abs().max())}
    rows = slice(dispatcher.local.start, dispatcher.local.stop)
    for name in ("w1", "w2", "w3"):
        full = getattr(reference.experts, name).grad.clone()
        dist.all_reduce(full)  # an expert's gradient: over every rank's tokens
        errors[name] = float((getattr(parallel.experts, name).grad - full[rows]).abs().max())
        assert getattr(parallel.experts, name).shape[0] == EXPERTS // dist.get_world_size()
    errors["calls"] = dispatcher.all_to_all_calls
    dist.destroy_process_group()
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("world", [4])
def test_experts_split_over_ranks_equal_the_whole_layer(world: int) -> None:
    for errors in run_distributed(_ranks, world, world):
        assert errors.pop("calls") == 3  # counts, rows out, outputs back (backward: the reverse exchanges)
        assert all(v <= 1e-5 for v in errors.values()), errors


def _ep_losses_and_experts(argv: list[str]) -> tuple[list[float], dict[str, Any]]:
    """Train; the losses, and one stacked expert weight's mesh, placements and this rank's
    experts (their global rows)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    try:
        losses = [h["loss"] for h in trainer.train()]
        layer = next(n for n, _ in trainer.model.named_parameters() if n.endswith("moe.experts.w1")).removesuffix(
            ".experts.w1")
        w1 = trainer.model.get_parameter(f"{layer}.experts.w1")
        assert isinstance(w1, DTensor)
        shape, offset = compute_local_shape_and_global_offset(w1.shape, w1.device_mesh, w1.placements)
        dispatcher = trainer.model.get_submodule(layer).dispatcher
        offloaded = {name.removesuffix(".moe.experts"): type(module._get_fsdp_state()._fsdp_param_group.offload_policy)
                     .__name__ == "CPUOffloadPolicy" for name, module in trainer.model.named_modules()
                     if name.endswith("moe.experts") and hasattr(module, "_get_fsdp_state")}
        return losses, {"mesh": tuple(w1.device_mesh.mesh_dim_names), "placements": [str(p) for p in w1.placements],
                        "experts": list(range(offset[0], offset[0] + shape[0])), "local": list(w1.to_local().shape),
                        "calls": getattr(dispatcher, "all_to_all_calls", 0),
                        "offloaded": offloaded,
                        "compiled": sorted(n.removeprefix(f"{layer.rsplit('.', 1)[0]}.") for n, m in
                                           trainer.model.named_modules()
                                           if n.startswith(layer.rsplit(".", 1)[0] + ".")
                                           and hasattr(m, "_compiled_with")),
                        "auto": None if trainer.reshard_plan is None else trainer.reshard_plan.offload}
    finally:
        trainer.close()


_AUTO = ("--parallelism.reshard_after_forward_mode", "auto", "--parallelism.cpu_offload", "auto",
         "--parallelism.memory_budget_gib", "0.0015", "--activation_checkpoint.mode", "selective")
"""A budget under which auto (per unit, at 4 ranks, expert parallel 2) offloads the first block only and
fully checkpoints both: each layer's experts follow their block."""


# (Expert parallel 1 on 4 ranks is plain FSDP, which the rank/mode test holds to the same
# one-process losses.)
@pytest.mark.scenario  # (the default selection: the compiled expert-parallel test and context parallel beside it)
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_expert_parallel_2_and_4_equal_expert_parallel_1_and_one_process(tmp_path: Path, family: str) -> None:
    """Tiny Qwen3-MoE and DeepSeek-V3 (8 experts; DeepSeek's in 2 groups, a shared expert and a
    dense first layer), 4 ranks, fp32, 10 steps (clipped at norm 1): expert parallel 2 and 4 give
    the losses of one process within 1e-5 (as expert parallel 1, plain FSDP, does); each rank holds only its
    experts (ep 2: the experts split over the 2 expert-parallel ranks, each half FSDP-sharded over
    the 2 expert-data ranks, 2 experts per rank; ep 4: 2 experts per rank, whole), and the
    all-to-all ran (3 exchanges per forward per MoE layer). Qwen3-MoE's expert parallel 2 runs
    under auto (reshard, checkpointing and CPU offload per unit from a memory budget) on top of
    selective checkpointing: the experts of the offloaded block are offloaded too; expert
    parallel 4 runs with selective checkpointing (the experts' FSDP unit, on one rank, inside each
    checkpointed block)."""
    name = ["--model.name", family]
    ((reference, _),), = run_distributed(_losses_and_expert_placements, 1, _tiny_argv(tmp_path / "one", 4, *name))
    results = {}
    for ep in (2, 4):
        argv = _tiny_argv(tmp_path / f"ep{ep}", 1, "--parallelism.expert_parallel_degree", str(ep), *name,
                          *(_AUTO if family == "qwen3_moe" and ep == 2 else ()),
                          *(("--activation_checkpoint.mode", "selective") if ep == 4 else ()))
        results[ep] = run_distributed(_ep_losses_and_experts, 4, argv, timeout=600)  # (4 ranks on 2 loaded cores)
    for ep, ranks in results.items():
        for losses, _ in ranks:
            for a, b in zip(losses, reference, strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (ep, losses, reference)
    if family == "qwen3_moe":  # auto's plan offloads layers.0 and its experts with it, not layers.1's
        assert all(e["auto"] == (False, True, False, False) and e["offloaded"] == {"layers.0": True, "layers.1": False}
                   for _, e in results[2]), results[2][0][1]
    held = [experts["experts"] for _, experts in results[2]]
    assert held == [[0, 1], [4, 5], [2, 3], [6, 7]], held  # rank = 2 × (expert-data rank) + (expert-parallel rank)
    assert all(e["mesh"] == ("dp_shard_mod_ep", "ep") and e["local"] == [2, 32, 64] for _, e in results[2])
    assert [e["experts"] for _, e in results[4]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(e["calls"] == 3 * 10 for _, e in results[4])  # 10 steps, one micro-batch each


@pytest.mark.slow
def test_compiled_expert_parallel_equals_one_process(tmp_path: Path) -> None:
    """Expert parallel 2 on 2 ranks with compiled blocks (compiled by their parts: attention,
    norms, router and experts each a graph, the token exchange eager) and full checkpointing,
    fp32, 4 steps: one process's losses within 1e-5; every part of the MoE blocks was compiled.
    (AOTAutograd's eager backend here, for the suite's time; inductor gave the same losses by
    hand.)"""
    common = ["--training.steps", "4", "--compile.enable", "--compile.backend", "aot_eager",
              "--activation_checkpoint.mode", "full"]
    ((reference, _),), = run_distributed(_losses_and_expert_placements, 1, _tiny_argv(tmp_path / "one", 4, *common))
    ranks = run_distributed(_ep_losses_and_experts, 2, _tiny_argv(tmp_path / "ep2", 2, *common,
                                                                  "--parallelism.expert_parallel_degree", "2"))
    for losses, experts in ranks:
        assert experts["compiled"] == ["attention", "attention_norm", "ffn_norm", "moe.experts", "moe.router"]
        for a, b in zip(losses, reference, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (losses, reference)
