"""Distributed tests of ``torchtitan_lite.distributed.fsdp.apply_fsdp`` and the Trainer's FSDP2 setup.

Everything runs on spawned CPU ranks over gloo (``tests.dist_utils.run_distributed``). Rank
functions return plain data read from FSDP's own state, from DTensors and from the collectives
the dispatcher actually ran; the assertions are made in the parent test.

How collectives are observed: ``_CollectiveRecorder`` is a ``TorchDispatchMode``. In torch 2.x
every ``ProcessGroup`` method (what ``dist.all_gather_into_tensor`` and
``dist.reduce_scatter_tensor`` call, FSDP2 included) goes through a ``c10d::*`` dispatcher op
(here ``c10d::_allgather_base_`` / ``c10d::_reduce_scatter_base_``), so a dispatch mode sees
them. On CPU the autograd engine runs backward in the calling thread, so the mode also sees the
backward all-gathers and reduce-scatters; the tests check that backward collectives were
recorded (``never`` still records its backward reduce-scatters), so a recorder that silently
saw nothing in backward would fail rather than pass.

To keep the file fast, a few Trainers run in one spawned job (they share the process group),
the apply_fsdp edge cases (section 6) run in one spawned job too, and the spawned jobs that
several tests read are module-scoped fixtures.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed
from tests.fsdp_probes import (
    count_unshards,
    distinct_post_forward_meshes,
    has_root_params,
    offload_flags,
    reshard_kind,
    same_unit,
    unit_param_names,
)

UNITS = ("tok_embeddings", "layers.0", "layers.1", "norm+output")
BLOCKS = ("layers.0", "layers.1")


# --------------------------------------------------------------------------------------------
# Helpers that run inside the rank processes
# --------------------------------------------------------------------------------------------


def _flat_tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _flat_tensors(item)]
    return []


class _CollectiveRecorder(TorchDispatchMode):
    """Records every c10d collective the dispatcher runs (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []
        self.phase = "forward"
        self.unit: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            name = func._schema.name.split("::")[-1]
            kind = (
                "all_gather" if ("allgather" in name or "all_gather" in name)
                else "reduce_scatter" if "reduce_scatter" in name
                else "all_reduce" if ("allreduce" in name or "all_reduce" in name)
                else name
            )
            first = _flat_tensors(args[0]) if args else []
            second = _flat_tensors(args[1]) if len(args) > 1 else []
            n1 = sum(t.numel() for t in first)
            n2 = sum(t.numel() for t in second)
            self.calls.append({
                "op": name,
                "kind": kind,
                "phase": self.phase,
                "unit": self.unit,
                "dtypes": sorted({str(t.dtype) for t in first + second}),
                # all-gather (output, input) / reduce-scatter (output, input): the size ratio
                # is the number of ranks that took part.
                "group_size": max(n1, n2) // min(n1, n2) if n1 and n2 else None,
            })
        return func(*args, **(kwargs or {}))


def _make_trainer(argv: list[str], dump: Path):
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    return Trainer(load_job_config([*TINY_ARGS, *argv, "--job.dump_folder", str(dump)]))


def _llama_units(model: nn.Module) -> dict[str, nn.Module]:
    """One module per FSDP unit of our Llama (the norm+output group is read through ``norm``)."""
    units: dict[str, nn.Module] = {"tok_embeddings": model.tok_embeddings}
    for key, block in model.layers.items():
        units[f"layers.{key}"] = block
    units["norm+output"] = model.norm
    return units


def _param_info(p: torch.Tensor) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return {"dtensor": False, "dtype": str(p.dtype), "device": p.device.type}
    local = p.to_local()
    return {
        "dtensor": True,
        "dtype": str(p.dtype),
        "local_dtype": str(local.dtype),
        "device": p.device.type,
        "local_device": local.device.type,
        "placements": [repr(pl) for pl in p.placements],
        "mesh_dim_names": tuple(p.device_mesh.mesh_dim_names or ()),
        "mesh": p.device_mesh.mesh.tolist(),
        "shape": tuple(p.shape),
        "local_shape": tuple(local.shape),
    }


def _optimizer_state_info(trainer: Any) -> dict[str, dict[str, Any]]:
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    out: dict[str, dict[str, Any]] = {}
    for p, state in trainer.optimizer.state.items():
        out[names[id(p)]] = {k: _param_info(state[k]) for k in ("exp_avg", "exp_avg_sq")}
    return out


def _probe_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, 256, (2, 33), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _probe_collectives(trainer: Any, units: dict[str, nn.Module]) -> list[dict[str, Any]]:
    """One forward + backward on a fixed batch, recording every collective and which unit's
    ``unshard`` issued it; gradients are dropped afterwards (no optimizer step)."""
    rec = _CollectiveRecorder()

    def set_unit(name: str | None) -> str | None:
        previous, rec.unit = rec.unit, name
        return previous

    inputs, labels = _probe_batch()
    with count_unshards(units, set_unit), rec:
        logits = trainer.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        rec.phase = "backward"
        loss.backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    return rec.calls


def _trainer_job(runs: list[tuple[str, list[str]]], dump: str, keep_local: tuple[str, ...] = ()):
    """Build and train one Trainer per run in this process group; return what each saw."""
    import torch.distributed as dist

    results: dict[str, Any] = {}
    from torch.distributed.distributed_c10d import _world

    for label, argv in runs:
        groups_before = len(_world.pg_map)
        trainer = _make_trainer(argv, Path(dump) / label)
        new_process_groups = len(_world.pg_map) - groups_before
        model = trainer.model
        units = _llama_units(model)
        collectives = _probe_collectives(trainer, units)  # also runs FSDP's lazy init
        history = trainer.train()
        result = {
            "reshard": {name: reshard_kind(m) for name, m in units.items()},
            "new_process_groups": new_process_groups,
            "post_forward_mesh_objects": distinct_post_forward_meshes(units),
            "unit_params": {name: unit_param_names(m) for name, m in units.items()},
            "output_shares_norm_state": same_unit(model.output, model.norm),
            "root_has_params": has_root_params(model),
            "model_params": sorted(n for n, _ in model.named_parameters()),
            "params": {n: _param_info(p) for n, p in model.named_parameters()},
            "collectives": collectives,
            "losses": [h["loss"] for h in history],
            "grad_norms": [h["grad_norm"] for h in history],
        }
        if label in keep_local:
            result["local"] = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
        results[label] = result
    dist.barrier()
    return results


def _mode_runs(modes: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    return [(mode, ["--parallelism.reshard_after_forward_mode", mode]) for mode in modes]


# --------------------------------------------------------------------------------------------
# Spawned jobs shared by several tests
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> list[dict[str, Any]]:
    """2 ranks: the three named modes, plus the FSDP reference for the HSDP test (global 8)."""
    runs = [*_mode_runs(("default", "always", "never")),
            ("fsdp_global8", ["--training.local_batch_size", "4"])]
    dump = tmp_path_factory.mktemp("two_rank")
    return run_distributed(_trainer_job, 2, runs, str(dump))


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory) -> list[dict[str, Any]]:
    """4 ranks: a 1-D mesh of 4 with modes default and 2, and HSDP 2 × 2 (global batch 8)."""
    runs = [
        *_mode_runs(("default", "2")),
        ("hsdp", ["--parallelism.data_parallel_replicate_degree", "2",
                  "--parallelism.data_parallel_shard_degree", "2",
                  "--training.global_batch_size", "8", "--training.local_batch_size", "2"]),
    ]
    dump = tmp_path_factory.mktemp("four_rank")
    return run_distributed(_trainer_job, 4, runs, str(dump), ("hsdp",))


# --------------------------------------------------------------------------------------------
# 1. Reshard modes
# --------------------------------------------------------------------------------------------

EXPECTED_RESHARD = {
    "always": dict.fromkeys(UNITS, "full"),
    "never": dict.fromkeys(UNITS, "none"),
    "default": {**dict.fromkeys(UNITS, "full"), "norm+output": "none"},
    "2": {**dict.fromkeys(UNITS, 2), "norm+output": "none"},
}
# Units that all-gather again in backward (the ones whose parameters were freed after forward).
EXPECTED_BACKWARD_GATHERS = {
    "always": set(UNITS),
    "never": set(),
    "default": {"tok_embeddings", *BLOCKS},
    "2": {"tok_embeddings", *BLOCKS},
}


def _check_units_and_gathers(run: dict[str, Any], mode: str, world: int) -> None:
    # The FSDP units are the ones apply_fsdp promises, and together they own every parameter.
    assert run["output_shares_norm_state"], "norm and output must be one FSDP unit"
    assert not run["root_has_params"]
    assert run["unit_params"]["tok_embeddings"] == ["tok_embeddings.weight"]
    assert run["unit_params"]["norm+output"] == ["norm.weight", "output.weight"]
    for block in BLOCKS:
        expected = [n for n in run["model_params"] if n.startswith(block + ".")]
        assert run["unit_params"][block] == expected and expected
    owned = sorted(n for names in run["unit_params"].values() for n in names)
    assert owned == run["model_params"]

    assert run["reshard"] == EXPECTED_RESHARD[mode], mode

    gathers = [c for c in run["collectives"] if c["kind"] == "all_gather"]
    assert all(c["unit"] in UNITS for c in gathers), gathers
    forward = [c for c in gathers if c["phase"] == "forward"]
    backward = [c for c in gathers if c["phase"] == "backward"]
    # Forward: exactly one all-gather per unit, in forward order, over the whole shard group.
    assert [c["unit"] for c in forward] == list(UNITS), (mode, forward)
    assert {c["group_size"] for c in forward} == {world}
    # Backward: exactly one re-gather per unit that was resharded, none for the others.
    backward_units = [c["unit"] for c in backward]
    assert len(backward_units) == len(set(backward_units)), (mode, backward)
    assert set(backward_units) == EXPECTED_BACKWARD_GATHERS[mode], (mode, backward)
    expected_group = 2 if mode == "2" else world
    assert all(c["group_size"] == expected_group for c in backward), (mode, backward)
    # The recorder does see backward collectives: one reduce-scatter per unit, in backward.
    scatters = [c for c in run["collectives"] if c["kind"] == "reduce_scatter"]
    assert len(scatters) == len(UNITS) and {c["phase"] for c in scatters} == {"backward"}


@pytest.mark.parametrize("mode", ["default", "always", "never"])
def test_reshard_modes_two_ranks(two_rank_runs, mode):
    for rank_result in two_rank_runs:
        _check_units_and_gathers(rank_result[mode], mode, world=2)


def test_reshard_mode_integer_group_four_ranks(four_rank_runs):
    for rank_result in four_rank_runs:
        run = rank_result["2"]
        assert run["params"]["output.weight"]["mesh_dim_names"] == ("dp_shard",)
        _check_units_and_gathers(rank_result["default"], "default", world=4)
        _check_units_and_gathers(run, "2", world=4)
        # All units share one post-forward mesh: its 2 process groups are made once, not per
        # unit (FSDP alone would make 2 per unit: one NCCL communicator each on GPUs).
        assert run["post_forward_mesh_objects"] == 1
        assert run["new_process_groups"] - rank_result["default"]["new_process_groups"] <= 2


def test_losses_identical_across_reshard_modes(two_rank_runs, four_rank_runs):
    runs = two_rank_runs[0]
    reference = runs["default"]["losses"]
    assert len(reference) == 4 and all(math.isfinite(x) for x in reference)
    for mode in ("always", "never"):
        assert runs[mode]["losses"] == pytest.approx(reference, rel=1e-6), mode
    four = four_rank_runs[0]
    assert four["2"]["losses"] == pytest.approx(four["default"]["losses"], rel=1e-6)
    # Every rank reports the same (all-reduced) loss.
    for job in (two_rank_runs, four_rank_runs):
        for rank_result in job[1:]:
            for label, run in rank_result.items():
                assert run["losses"] == job[0][label]["losses"], label


# --------------------------------------------------------------------------------------------
# 2. Mixed precision
# --------------------------------------------------------------------------------------------


def _mixed_precision_rank(dump: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    trainer = _make_trainer(["--training.mixed_precision_param", "bfloat16"], Path(dump))
    model = trainer.model
    wq = model.layers["0"].attention.wq
    seen: list[dict[str, Any]] = []

    def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        seen.append({"input": str(args[0].dtype), "weight": str(module.weight.dtype),
                     "weight_is_dtensor": isinstance(module.weight, DTensor)})

    def post_hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        seen[-1]["output"] = str(out.dtype)

    wq.register_forward_pre_hook(pre_hook)
    wq.register_forward_hook(post_hook)

    names = {id(p): n for n, p in model.named_parameters()}
    grads: dict[str, Any] = {}

    def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                grads[names[id(p)]] = _param_info(p.grad)

    trainer.optimizer.register_step_pre_hook(before_step)
    rec = _CollectiveRecorder()
    with rec:
        first = trainer.train_step()
    second = trainer.train_step()
    trainer.metrics.close()
    return {
        "hook": seen,
        "collectives": rec.calls,
        "grads": grads,
        "params": {n: _param_info(p) for n, p in model.named_parameters()},
        "optimizer_states": _optimizer_state_info(trainer),
        "losses": [first["loss"], second["loss"]],
    }


def test_mixed_precision_bf16_compute_fp32_shards_and_reduction(tmp_path):
    results = run_distributed(_mixed_precision_rank, 2, str(tmp_path))
    for r in results:
        # Compute inside a block runs in bf16 on the all-gathered (plain, unsharded) weight,
        # in both training steps.
        assert r["hook"] == [{"input": "torch.bfloat16", "weight": "torch.bfloat16",
                              "weight_is_dtensor": False, "output": "torch.bfloat16"}] * 2
        # Sharded parameters, their gradients and the optimizer state stay fp32 Shard(0) DTensors.
        assert r["params"] and set(r["grads"]) == set(r["params"])
        for info in [*r["params"].values(), *r["grads"].values()]:
            assert info["dtensor"] and info["dtype"] == info["local_dtype"] == "torch.float32"
            assert info["placements"] == ["Shard(dim=0)"]
        assert set(r["optimizer_states"]) == set(r["params"])
        for states in r["optimizer_states"].values():
            for info in states.values():
                assert info["dtensor"] and info["local_dtype"] == "torch.float32"
                assert info["placements"] == ["Shard(dim=0)"]
        # Gradients are reduce-scattered in fp32; parameters are all-gathered in bf16.
        scatters = [c for c in r["collectives"] if c["kind"] == "reduce_scatter"]
        gathers = [c for c in r["collectives"] if c["kind"] == "all_gather"]
        assert len(scatters) == len(UNITS), r["collectives"]
        assert all(c["dtypes"] == ["torch.float32"] for c in scatters), scatters
        assert len(gathers) >= len(UNITS)
        assert all(c["dtypes"] == ["torch.bfloat16"] for c in gathers), gathers
        assert all(math.isfinite(x) for x in r["losses"])
    assert results[0]["losses"] == results[1]["losses"]


# --------------------------------------------------------------------------------------------
# 3. CPU offload
# --------------------------------------------------------------------------------------------


def test_backend_for():
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    from torchtitan_lite.distributed import backend_for

    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cpu"), cpu_collectives=True) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    mixed = backend_for(torch.device("cuda", 0), cpu_collectives=True)
    assert mixed == "cuda:nccl,cpu:gloo"
    # torch itself parses it into a CPU and a CUDA backend.
    assert BackendConfig(Backend(mixed)).get_device_backend_map() == {"cuda": "nccl", "cpu": "gloo"}
    with pytest.raises(ValueError, match="unsupported device type"):
        backend_for(torch.device("meta"))


def _cpu_offload_rank(dump: str) -> dict[str, Any]:
    import torch.distributed as dist

    from torchtitan_lite.trainer import clip_grad_norm_

    baseline = _make_trainer([], Path(dump) / "baseline")
    baseline_losses = [h["loss"] for h in baseline.train()]

    trainer = _make_trainer(["--training.enable_cpu_offload"], Path(dump) / "offload")
    model = trainer.model
    flags = offload_flags(list(_llama_units(model).values()))
    world = dist.group.WORLD
    out: dict[str, Any] = {
        "backend": dist.get_backend(),
        "backend_config": dist.get_backend_config(),
        "cpu_backend_name": world._get_backend(torch.device("cpu")).name(),
        "offload_to_cpu": [offload for offload, _ in flags],
        "pin_memory": [pin for _, pin in flags],
        "n_fsdp_params": len(flags),
        "params": {n: _param_info(p) for n, p in model.named_parameters()},
    }

    # Pieces of train_step by hand: forward, backward, then look at the gradients and clip.
    inputs, labels = _probe_batch()
    logits = model(inputs)
    F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
    params = list(model.parameters())
    out["grads"] = {n: _param_info(p.grad) for n, p in model.named_parameters()}
    out["pre_clip_norm"] = float(clip_grad_norm_(params, 0.01))
    out["post_clip_norm"] = float(clip_grad_norm_(params, 0.0))  # 0: measure only
    trainer.optimizer.zero_grad(set_to_none=True)

    step_grads: list[dict[str, Any]] = []

    def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        step_grads.append({
            "devices": sorted({p.grad.to_local().device.type
                               for g in optimizer.param_groups for p in g["params"]}),
            "count": sum(p.grad is not None for g in optimizer.param_groups for p in g["params"]),
        })

    trainer.optimizer.register_step_pre_hook(before_step)
    history = trainer.train()
    out.update(
        step_grads=step_grads,
        losses=[h["loss"] for h in history],
        grad_norms=[h["grad_norm"] for h in history],
        baseline_losses=baseline_losses,
        optimizer_states=_optimizer_state_info(trainer),
        params_after={n: _param_info(p) for n, p in model.named_parameters()},
    )
    return out


def test_cpu_offload(tmp_path):
    results = run_distributed(_cpu_offload_rank, 2, str(tmp_path))
    for r in results:
        # The default group has a CPU backend (gloo) for the CPU-side collectives of clipping.
        assert r["backend"] == "gloo"
        device_map = dict(item.split(":") for item in r["backend_config"].replace(" ", "").split(","))
        assert device_map["cpu"] == "gloo"
        assert r["cpu_backend_name"] == "gloo"
        # FSDP itself runs every parameter with CPU offload (unpinned: no CUDA here).
        assert r["n_fsdp_params"] == len(r["params"])
        assert all(r["offload_to_cpu"]) and not any(r["pin_memory"])
        for info in [*r["params"].values(), *r["params_after"].values(), *r["grads"].values()]:
            assert info["dtensor"] and info["local_device"] == "cpu" and info["device"] == "cpu"
            assert info["placements"] == ["Shard(dim=0)"]
        assert set(r["grads"]) == set(r["params"])
        assert set(r["optimizer_states"]) == set(r["params"])
        for states in r["optimizer_states"].values():
            for info in states.values():
                assert info["dtensor"] and info["local_device"] == "cpu"
                assert info["placements"] == ["Shard(dim=0)"]
        # In the real train_step, the optimizer sees every gradient, on CPU.
        assert r["step_grads"] == [{"devices": ["cpu"], "count": len(r["params"])}] * 4
        # Clipping works on the offloaded gradients.
        assert math.isfinite(r["pre_clip_norm"]) and r["pre_clip_norm"] > 0.01
        assert r["post_clip_norm"] == pytest.approx(0.01, rel=1e-4)
        assert all(math.isfinite(g) and g > 0 for g in r["grad_norms"])
        # Offload changes where tensors live, not the numbers.
        assert len(r["losses"]) == 4
        assert r["losses"] == pytest.approx(r["baseline_losses"], rel=1e-6)
    assert results[0]["losses"] == results[1]["losses"]


# --------------------------------------------------------------------------------------------
# 4. HSDP
# --------------------------------------------------------------------------------------------


def test_hsdp_placements_and_losses_match_fsdp(four_rank_runs, two_rank_runs):
    for rank, rank_result in enumerate(four_rank_runs):
        run = rank_result["hsdp"]
        assert run["params"]
        for name, info in run["params"].items():
            assert info["dtensor"], name
            assert info["mesh_dim_names"] == ("dp_replicate", "dp_shard"), name
            assert info["mesh"] == [[0, 1], [2, 3]], name
            assert info["placements"] == ["Replicate()", "Shard(dim=0)"], name
            rows = info["shape"][0]
            shard_rank = rank % 2
            expected_rows = min(math.ceil(rows / 2), rows - shard_rank * math.ceil(rows / 2))
            assert info["local_shape"] == (expected_rows, *info["shape"][1:]), name
        assert all(math.isfinite(x) for x in run["losses"]) and len(run["losses"]) == 4
    # The two shards of a replica cover every row; the replicas hold identical shards.
    for name, info in four_rank_runs[0]["hsdp"]["params"].items():
        rows = [four_rank_runs[r]["hsdp"]["params"][name]["local_shape"][0] for r in (0, 1)]
        assert sum(rows) == info["shape"][0], name
    for a, b in ((0, 2), (1, 3)):
        local_a, local_b = four_rank_runs[a]["hsdp"]["local"], four_rank_runs[b]["hsdp"]["local"]
        assert local_a.keys() == local_b.keys()
        for name in local_a:
            assert torch.equal(local_a[name], local_b[name]), (name, a, b)
    # Same global batch (8) on 4 ranks HSDP and on 2 ranks FSDP: same losses.
    fsdp = two_rank_runs[0]["fsdp_global8"]["losses"]
    assert four_rank_runs[0]["hsdp"]["losses"] == pytest.approx(fsdp, rel=1e-5)


# --------------------------------------------------------------------------------------------
# 5. A researcher's own module
# --------------------------------------------------------------------------------------------

VOCAB, DIM = 64, 16


class MyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class MyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MyBlock(DIM) for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _custom_module_rank() -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    from torchtitan_lite.distributed import fsdp_mesh, init_distributed
    from torchtitan_lite.distributed.fsdp import apply_fsdp

    device = torch.device("cpu")
    init_distributed(device)
    mesh = fsdp_mesh(device)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (4, 9), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def build(variant: str) -> MyModel:
        torch.manual_seed(0)
        model = MyModel()
        if variant == "list":
            apply_fsdp(model, mesh, blocks=model.blocks, first_unit=None, last_unit=model.head)
        else:
            apply_fsdp(model, mesh, blocks=lambda name, m: isinstance(m, MyBlock))
        return model

    out: dict[str, Any] = {}
    for variant in ("list", "predicate"):
        model = build(variant)
        units = {"root": model, **{f"blocks.{i}": b for i, b in enumerate(model.blocks)},
                 "head": model.head}
        info: dict[str, Any] = {
            "is_fsdp": {k: isinstance(m, FSDPModule) for k, m in units.items()},
            "params": {n: _param_info(p) for n, p in model.named_parameters()},
        }
        before = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        info["grads"] = {n: _param_info(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        info["changed"] = {n: not torch.equal(before[n], p.to_local())
                           for n, p in model.named_parameters()}
        info["loss"] = loss.item()
        with torch.no_grad():
            info["loss_after"] = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).item()
        # Units and reshard policy, from FSDP's state (after lazy init).
        info["unit_params"] = {}
        info["reshard"] = {}
        for k, m in units.items():
            names = unit_param_names(m)
            if names:
                info["unit_params"][k] = names
                info["reshard"][k] = reshard_kind(m)
        out[variant] = info

    bad = MyModel()
    try:
        apply_fsdp(bad, mesh, reshard_after_forward_mode=3, blocks=bad.blocks)
    except ValueError as exc:
        out["invalid_error"] = str(exc)
    out["invalid_left_unsharded"] = not any(isinstance(m, FSDPModule) for m in bad.modules())
    return out


def test_custom_module():
    results = run_distributed(_custom_module_rank, 2)
    for r in results:
        for variant in ("list", "predicate"):
            v = r[variant]
            assert len(v["params"]) == 1 + 2 * 2 * 3 + 2  # embed, 3 × (2 linears), head
            for name, info in [*v["params"].items(), *v["grads"].items()]:
                assert info["dtensor"] and info["placements"] == ["Shard(dim=0)"], (variant, name)
                assert info["mesh_dim_names"] == ("dp_shard",)
            assert all(v["changed"].values()), (variant, v["changed"])
            assert math.isfinite(v["loss"]) and v["loss_after"] < v["loss"]
            for i in range(3):
                assert v["is_fsdp"][f"blocks.{i}"], variant
                assert v["unit_params"][f"blocks.{i}"] == [
                    f"blocks.{i}.down.bias", f"blocks.{i}.down.weight",
                    f"blocks.{i}.up.bias", f"blocks.{i}.up.weight"]
                assert v["reshard"][f"blocks.{i}"] == "full"
        # blocks= list with an explicit last unit: the head is its own unit, not resharded
        # after forward; the embedding (no first unit) stays with the root.
        listed = r["list"]
        assert listed["is_fsdp"]["head"]
        assert listed["unit_params"]["head"] == ["head.bias", "head.weight"]
        assert listed["reshard"]["head"] == "none"
        assert listed["unit_params"]["root"] == ["embed.weight"]
        # Predicate without first/last units: the root owns the embedding and the head.
        pred = r["predicate"]
        assert not pred["is_fsdp"]["head"]
        assert pred["unit_params"]["root"] == ["embed.weight", "head.bias", "head.weight"]
        # The root is never resharded after forward.
        assert listed["reshard"]["root"] == pred["reshard"]["root"] == "none"
        # How the model is cut into units does not change the numbers.
        assert pred["loss"] == pytest.approx(listed["loss"], rel=1e-6)
        assert pred["loss_after"] == pytest.approx(listed["loss_after"], rel=1e-6)
        # An integer mode that is no proper divisor of the shard degree is refused up front.
        assert "reshard_after_forward_mode" in r.get("invalid_error", "")
        assert r["invalid_left_unsharded"]


def test_reshard_mode_validation_in_process():
    from torchtitan_lite.config import ConfigError, load_job_config
    from torchtitan_lite.distributed.fsdp import validate_reshard_after_forward_mode
    from torchtitan_lite.job import plan_job

    assert validate_reshard_after_forward_mode("2", 4) == 2
    assert validate_reshard_after_forward_mode("never", 2) == "never"
    for mode, degree in ((3, 2), (2, 2), (1, 4), (True, 4), ("sometimes", 4)):
        with pytest.raises(ValueError, match="reshard_after_forward_mode"):
            validate_reshard_after_forward_mode(mode, degree)
    # The config alone is fine (3 is an integer mode); the world size makes it a ConfigError.
    config = load_job_config([*TINY_ARGS, "--parallelism.reshard_after_forward_mode", "3"])
    with pytest.raises(ConfigError, match="parallelism.reshard_after_forward_mode"):
        plan_job(config, world_size=2)


# --------------------------------------------------------------------------------------------
# 6. apply_fsdp edge cases: unit shapes, tied weights, dtype, fully_shard options
# --------------------------------------------------------------------------------------------

N_CLASSES, CHANNELS = 10, 8


class DictModel(nn.Module):
    """Blocks in an ``nn.ModuleDict`` (named, not numbered)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleDict({"early": MyBlock(DIM), "late": MyBlock(DIM)})
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks.values():
            h = block(h)
        return self.head(h)


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.gelu(self.conv1(x)))


class ConvNet(nn.Module):
    """One block (a single module, not a container), a single-module stem and head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, CHANNELS, 3, padding=1)
        self.block = ConvBlock(CHANNELS)
        self.head = nn.Linear(CHANNELS, N_CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(images)).mean(dim=(2, 3)))


class TiedLM(nn.Module):
    """GPT-2 style: the output projection is the token embedding (one parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.h = nn.ModuleList(MyBlock(DIM) for _ in range(2))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens)
        for block in self.h:
            h = block(h)
        return self.lm_head(self.ln_f(h))


def _token_batches(steps: int, batch: int = 4, seq: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch, ``steps`` times (so the loss must fall)."""
    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(11))
    return [(tokens[:, :-1], tokens[:, 1:])] * steps


def _image_batches(steps: int, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(12)
    images, labels = torch.randn(batch, 3, 6, 6, generator=gen), torch.randint(0, N_CLASSES, (batch,), generator=gen)
    return [(images, labels)] * steps


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def _train_against_reference(model: nn.Module, reference: nn.Module, batches: list[Any]) -> dict[str, Any]:
    """Train the sharded ``model`` (each rank on its half of every batch) and the unsharded
    ``reference`` (the whole batch) side by side with AdamW; return both loss curves. The
    sharded loss is the mean over ranks of the local losses, i.e. the whole batch's loss."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for inputs, labels in batches:
        ref_loss = _loss(reference(inputs), labels)
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_losses.append(ref_loss.item())

        n = inputs.shape[0] // world
        mine = slice(rank * n, (rank + 1) * n)
        loss = _loss(model(inputs[mine]), labels[mine])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reported = loss.detach().clone()
        dist.all_reduce(reported, op=dist.ReduceOp.AVG)
        losses.append(reported.item())
    return {"losses": losses, "ref_losses": ref_losses}


def _is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return (any(isinstance(m, FSDPModule) for m in model.modules())
            or any(isinstance(p, DTensor) for p in model.parameters()))


def _error_before_sharding(model: nn.Module, call: Any) -> dict[str, Any]:
    """Run ``call`` (an apply_fsdp that must fail); return its error and whether it sharded."""
    try:
        call()
        error = None
    except Exception as exc:  # noqa: BLE001 - the test checks the type and message
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "sharded_anyway": _is_sharded(model)}


def _edge_cases_rank() -> dict[str, Any]:
    import copy

    from torch.distributed.tensor import DTensor, Shard

    from torchtitan_lite.distributed import fsdp_mesh, init_distributed
    from torchtitan_lite.distributed.fsdp import apply_fsdp

    device = torch.device("cpu")
    init_distributed(device)
    mesh = fsdp_mesh(device)
    out: dict[str, Any] = {}

    def pair(cls: type[nn.Module], dtype: torch.dtype = torch.float32) -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        model = cls().to(dtype)
        return model, copy.deepcopy(model)

    # a. Blocks in a ModuleDict: each value is a unit.
    model, ref = pair(DictModel)
    apply_fsdp(model, mesh, blocks=model.blocks, first_unit=model.embed, last_unit=model.head)
    run = _train_against_reference(model, ref, _token_batches(3))  # also FSDP's lazy init
    out["dict"] = {
        "units": {name: unit_param_names(m) for name, m in
                  [("blocks", model.blocks), ("blocks.early", model.blocks["early"]),
                   ("blocks.late", model.blocks["late"]), ("embed", model.embed), ("head", model.head),
                   ("root", model)]},
        "params": {n: _param_info(p) for n, p in model.named_parameters()},
        **run,
    }

    # b. A single module as blocks, as first_unit and as last_unit (a conv net).
    model, ref = pair(ConvNet)
    apply_fsdp(model, mesh, blocks=model.block, first_unit=model.stem, last_unit=model.head)
    run = _train_against_reference(model, ref, _image_batches(3))
    out["single"] = {
        "units": {name: unit_param_names(getattr(model, name)) for name in ("stem", "block", "head")},
        "root": unit_param_names(model),
        "params": {n: _param_info(p) for n, p in model.named_parameters()},
        **run,
    }

    # c. Overlapping units fail in apply_fsdp before anything is sharded.
    model = DictModel()
    out["nested"] = _error_before_sharding(model, lambda: apply_fsdp(
        model, mesh, blocks=lambda name, m: isinstance(m, (MyBlock, nn.Linear))))

    # d. Tied weights: split between units (or a unit and the root) fails before sharding ...
    model = TiedLM()
    out["tied_split"] = _error_before_sharding(model, lambda: apply_fsdp(
        model, mesh, blocks=model.h, first_unit=model.wte, last_unit=[model.ln_f, model.lm_head]))
    out["tied_root"] = _error_before_sharding(model, lambda: apply_fsdp(
        model, mesh, blocks=model.h, first_unit=model.wte, last_unit=model.ln_f))
    # ... and trains when the modules sharing the weight are one unit.
    model, ref = pair(TiedLM)
    apply_fsdp(model, mesh, blocks=model.h, first_unit=[model.wte, model.lm_head], last_unit=model.ln_f)
    tied_after_wrap = model.lm_head.weight is model.wte.weight
    n_params = len(list(model.parameters()))
    run = _train_against_reference(model, ref, _token_batches(4))
    out["tied"] = {
        "tied_after_wrap": tied_after_wrap,
        "tied_after_training": model.lm_head.weight is model.wte.weight,
        "n_params": n_params,
        "n_ref_params": len(list(ref.parameters())),
        "unit": unit_param_names(model.wte),
        "lm_head_shares_unit": same_unit(model.lm_head, model.wte),
        "params": {n: _param_info(p) for n, p in model.named_parameters()},
        **run,
    }

    # e. A bf16 model with the default param_dtype computes in bf16.
    model, ref = pair(MyModel, torch.bfloat16)
    apply_fsdp(model, mesh, blocks=model.blocks, first_unit=model.embed, last_unit=model.head)
    seen: list[dict[str, Any]] = []
    model.blocks[0].up.register_forward_pre_hook(lambda m, args: seen.append(
        {"weight": str(m.weight.dtype), "weight_is_dtensor": isinstance(m.weight, DTensor),
         "input": str(args[0].dtype)}))
    inputs, labels = _token_batches(1)[0]
    n = inputs.shape[0] // 2
    mine = slice(mesh.get_local_rank() * n, (mesh.get_local_rank() + 1) * n)
    logits = model(inputs[mine])
    _loss(logits, labels[mine]).backward()
    with torch.no_grad():
        ref_logits = ref(inputs[mine])
    out["bf16"] = {
        "hook": seen,
        "output": str(logits.dtype),
        "params": {n: _param_info(p) for n, p in model.named_parameters()},
        "grads": {n: _param_info(p.grad) for n, p in model.named_parameters()},
        "max_diff": (logits.float() - ref_logits.float()).abs().max().item(),
    }

    # f. Another fully_shard option passes through: the head's weight sharded on dim 1.
    model, ref = pair(MyModel)
    head_weight = model.head.weight
    apply_fsdp(model, mesh, blocks=model.blocks, first_unit=model.embed, last_unit=model.head,
               shard_placement_fn=lambda p: Shard(1) if p is head_weight else None)
    out["placement_fn"] = {
        "params": {n: _param_info(p) for n, p in model.named_parameters()},
        **_train_against_reference(model, ref, _token_batches(3)),
    }
    return out


@pytest.fixture(scope="module")
def edge_case_runs() -> list[dict[str, Any]]:
    return run_distributed(_edge_cases_rank, 2)


def _assert_sharded_dim0(params: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
    assert params
    for name, info in params.items():
        if name in skip:
            continue
        assert info["dtensor"] and info["placements"] == ["Shard(dim=0)"], (name, info)
        assert info["mesh_dim_names"] == ("dp_shard",) and info["mesh"] == [0, 1], (name, info)
        rows = info["shape"][0]
        assert info["local_shape"][0] == math.ceil(rows / 2) or info["local_shape"][0] == rows // 2, name


def _assert_same_losses(run: dict[str, Any], steps: int) -> None:
    assert len(run["losses"]) == len(run["ref_losses"]) == steps
    assert all(math.isfinite(x) for x in run["losses"])
    assert run["losses"] == pytest.approx(run["ref_losses"], rel=1e-5)
    assert run["losses"][-1] < run["losses"][0]  # it does train (the same batch every step)


def test_apply_fsdp_module_dict_blocks(edge_case_runs):
    for r in edge_case_runs:
        d = r["dict"]
        units = d["units"]
        # Each value of the ModuleDict is a unit holding its block's parameters; the
        # container itself is not one.
        assert units["blocks"] is None
        for key in ("early", "late"):
            assert units[f"blocks.{key}"] == [f"blocks.{key}.{layer}.{kind}"
                                              for layer in ("down", "up") for kind in ("bias", "weight")]
        assert units["embed"] == ["embed.weight"]
        assert units["head"] == ["head.bias", "head.weight"]
        assert units["root"] == []
        _assert_sharded_dim0(d["params"])
        _assert_same_losses(d, 3)
    assert edge_case_runs[0]["dict"]["losses"] == edge_case_runs[1]["dict"]["losses"]


def test_apply_fsdp_single_module_units(edge_case_runs):
    for r in edge_case_runs:
        s = r["single"]
        assert s["units"] == {
            "stem": ["stem.bias", "stem.weight"],
            "block": ["block.conv1.bias", "block.conv1.weight", "block.conv2.bias", "block.conv2.weight"],
            "head": ["head.bias", "head.weight"],
        }
        assert s["root"] == []
        _assert_sharded_dim0(s["params"])
        _assert_same_losses(s, 3)


def test_apply_fsdp_overlapping_units_fail_before_sharding(edge_case_runs):
    for r in edge_case_runs:
        nested = r["nested"]
        assert nested["error"].startswith("ValueError: apply_fsdp: unit 'blocks.early.up' is inside unit "
                                          "'blocks.early'"), nested
        assert "\n" not in nested["error"] and "Cannot concatenate" not in nested["error"]
        assert not nested["sharded_anyway"]


def test_apply_fsdp_tied_weights(edge_case_runs):
    for r in edge_case_runs:
        split, root = r["tied_split"], r["tied_root"]
        assert split["error"] == (
            "ValueError: apply_fsdp: parameter 'wte.weight' (unit 'wte') and 'lm_head.weight' (unit "
            "'ln_f+lm_head') are the same tensor (tied weights); shard them in one unit, e.g. "
            "first_unit=[model.wte, model.lm_head] (and leave 'lm_head' out of the other units), "
            "or untie them")
        assert "(unit 'the root')" in root["error"] and root["error"].startswith("ValueError"), root
        assert not split["sharded_anyway"] and not root["sharded_anyway"]

        tied = r["tied"]
        # One parameter, shared by both modules, managed once by their one unit, before and
        # after training.
        assert tied["tied_after_wrap"] and tied["tied_after_training"]
        assert tied["n_params"] == tied["n_ref_params"] == 1 + 2 * 4 + 2
        assert tied["unit"] == ["wte.weight"] and tied["lm_head_shares_unit"]
        _assert_sharded_dim0(tied["params"])
        _assert_same_losses(tied, 4)


def test_apply_fsdp_bf16_model_keeps_bf16(edge_case_runs):
    for r in edge_case_runs:
        b = r["bf16"]
        # Compute on the gathered (plain) weight in the model's own dtype: no silent fp32.
        assert b["hook"] == [{"weight": "torch.bfloat16", "weight_is_dtensor": False,
                              "input": "torch.bfloat16"}]
        assert b["output"] == "torch.bfloat16"
        for info in [*b["params"].values(), *b["grads"].values()]:
            assert info["dtensor"] and info["dtype"] == info["local_dtype"] == "torch.bfloat16", info
        # The same numbers as the unsharded bf16 model (same weights, same dtype).
        assert b["max_diff"] == 0.0


def test_apply_fsdp_passes_fully_shard_options(edge_case_runs):
    for r in edge_case_runs:
        f = r["placement_fn"]
        head = f["params"]["head.weight"]
        assert head["placements"] == ["Shard(dim=1)"]
        assert head["shape"] == (VOCAB, DIM) and head["local_shape"] == (VOCAB, DIM // 2)
        _assert_sharded_dim0(f["params"], skip=("head.weight",))
        _assert_same_losses(f, 3)


def test_fsdp_units_refuses_overlaps_and_split_ties_without_a_process_group():
    from torchtitan_lite.distributed.fsdp import apply_fsdp, fsdp_units

    model = MyModel()
    # A predicate that matches the blocks and the Linear layers inside them.
    with pytest.raises(ValueError, match=r"unit 'blocks\.0\.up' is inside unit 'blocks\.0'") as exc:
        fsdp_units(model, blocks=lambda name, m: isinstance(m, (MyBlock, nn.Linear)))
    assert "\n" not in str(exc.value)
    # The same module in two units.
    with pytest.raises(ValueError, match=r"module 'blocks\.2' is in two units \('blocks\.2' and "
                                         r"'blocks\.2\+head'\)"):
        fsdp_units(model, blocks=model.blocks, last_unit=[model.blocks[2], model.head])
    # A module that is not part of the model, and the model itself.
    with pytest.raises(ValueError, match="not a submodule of the model"):
        fsdp_units(model, blocks=model.blocks, last_unit=nn.Linear(2, 2))
    with pytest.raises(ValueError, match="the model itself cannot be a unit"):
        fsdp_units(model, blocks=[model])

    tied = TiedLM()
    with pytest.raises(ValueError, match=r"tied weights.*first_unit=\[model\.wte, model\.lm_head\]"):
        fsdp_units(tied, blocks=tied.h, first_unit=tied.wte, last_unit=[tied.ln_f, tied.lm_head])
    units = fsdp_units(tied, blocks=tied.h, first_unit=[tied.wte, tied.lm_head], last_unit=tied.ln_f)
    assert [(u.name, u.role) for u in units] == [
        ("wte+lm_head", "first"), ("h.0", "block"), ("h.1", "block"), ("ln_f", "last")]
    assert units[0].numel() == VOCAB * DIM  # the tied weight is one tensor, counted once

    # Options apply_fsdp sets itself are refused, before the mesh is used.
    with pytest.raises(ValueError, match="reshard_after_forward is set by apply_fsdp itself"):
        apply_fsdp(model, _FakeMesh(), blocks=model.blocks, reshard_after_forward=True)
    assert not _is_sharded(model)


class _FakeMesh:
    """Just enough of a 1-D DeviceMesh of 2 for apply_fsdp's argument checks."""

    ndim = 1
    shape = (2,)


# --------------------------------------------------------------------------------------------
# 7. A second run in the same process
# --------------------------------------------------------------------------------------------


def _two_hsdp_runs_in_one_process() -> list[float]:
    """Two HSDP 2 × 2 runs one after the other in one process, each with its own process group
    (the second on a port the first agreed on) and gradient clipping; returns the grad norms.
    The first run makes one more group before its mesh, so the two meshes' groups have
    different names (as after any earlier job that made a different number of groups)."""
    import os

    import torch.distributed as dist

    from torchtitan_lite.distributed import ParallelDims, build_mesh, free_port, init_distributed
    from torchtitan_lite.distributed.fsdp import apply_fsdp
    from torchtitan_lite.trainer import clip_grad_norm_

    norms = []
    for run in range(2):
        init_distributed(torch.device("cpu"))
        if run == 0:
            dist.new_group(list(range(4)))
        mesh = build_mesh(torch.device("cpu"), ParallelDims.resolve(dp_replicate=2, dp_shard=2, world_size=4))
        torch.manual_seed(0)
        model = MyModel()
        apply_fsdp(model, mesh, blocks=model.blocks, first_unit=model.embed, last_unit=model.head)
        tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        norms.append(float(clip_grad_norm_(list(model.parameters()), 1.0)))
        port = [free_port() if dist.get_rank() == 0 else 0]
        dist.broadcast_object_list(port, src=0)
        dist.barrier()
        dist.destroy_process_group()  # not destroy_distributed: as research code might
        os.environ["MASTER_PORT"] = str(port[0])
    return norms


def test_second_hsdp_run_in_one_process_does_not_reuse_the_first_runs_groups():
    """DTensor caches sharding plans by mesh layout; a new mesh of the same shape must not be
    handed the first mesh's (destroyed) process groups."""
    for first, second in run_distributed(_two_hsdp_runs_in_one_process, 4):
        assert math.isfinite(first) and first == pytest.approx(second, rel=1e-6)
