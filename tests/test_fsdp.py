"""Distributed tests of ``torchtitan_lite.distributed.fsdp`` through the Trainer's FSDP2 setup:
reshard modes, mixed precision, CPU offload and HSDP (``apply_fsdp`` on other models than ours:
``tests/test_fsdp_units.py``).

Everything runs on spawned CPU ranks over gloo (``tests.dist_utils.run_distributed``). Rank
functions return plain data read from FSDP's own state, from DTensors and from the collectives
the dispatcher actually ran; the assertions are made in the parent test.

How collectives are observed: ``_CollectiveRecorder`` is a ``TorchDispatchMode``. In torch 2.x
every ``ProcessGroup`` method (what ``dist.all_gather_into_tensor`` and
``dist.reduce_scatter_tensor`` call, FSDP2 included) goes through a ``c10d::*`` dispatcher op
(here ``c10d::_allgather_base_``, and ``c10d::allreduce_`` for the gradient reduce-scatters,
which ``apply_fsdp`` runs as in-place all-reduces on gloo: ``InPlaceReduceScatter.running`` tells
them apart), so a dispatch mode sees them. On CPU the autograd engine runs backward in the calling thread, so
the mode also sees the
backward all-gathers and reduce-scatters; the tests check that backward collectives were
recorded (``never`` still records its backward reduce-scatters), so a recorder that silently
saw nothing in backward would fail rather than pass.

To keep the file fast, a few Trainers run in one spawned job (they share the process group),
and the spawned jobs that several tests read are module-scoped fixtures.
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
from torchtitan_lite.distributed.fsdp import InPlaceReduceScatter

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
            if kind == "all_reduce" and InPlaceReduceScatter.running:
                kind = "reduce_scatter"  # gloo: apply_fsdp reduce-scatters as an in-place all-reduce
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


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "always", "never"])
def test_reshard_modes_two_ranks(two_rank_runs, mode):
    for rank_result in two_rank_runs:
        _check_units_and_gathers(rank_result[mode], mode, world=2)


@pytest.mark.slow
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


@pytest.mark.slow
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


def _cpu_offload_rank(dump: str) -> dict[str, Any]:
    import torch.distributed as dist

    from torchtitan_lite.distributed.clip import clip_grad_norm_

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


@pytest.mark.slow
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
