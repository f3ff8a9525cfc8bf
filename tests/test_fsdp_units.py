"""``torchtitan_lite.distributed.fsdp.apply_fsdp`` and ``fsdp_units`` on models other than ours: a
researcher's own module (blocks as a list or a predicate), blocks in a ``ModuleDict``, single
modules as units, overlapping units, tied weights, a bf16 model and ``fully_shard``'s own options.

Everything runs on spawned CPU ranks over gloo (``tests.dist_utils.run_distributed``). Rank
functions return plain data read from FSDP's own state and from DTensors; the assertions are made
in the parent test. The edge cases (section 2) run in one spawned job, a module-scoped fixture.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_utils import run_distributed
from tests.fsdp_probes import reshard_kind, same_unit, unit_param_names
from tests.test_fsdp import _param_info

# --------------------------------------------------------------------------------------------
# 1. A researcher's own module
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


# --------------------------------------------------------------------------------------------
# 2. apply_fsdp edge cases: unit shapes, tied weights, dtype, fully_shard options
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
    except Exception as exc:  # the test checks the type and message
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
    with pytest.raises(ValueError, match=r"module 'blocks\.2' is in two units \(blocks 'blocks\.2' and "
                                         r"last_unit 'blocks\.2\+head'\)"):
        fsdp_units(model, blocks=model.blocks, last_unit=[model.blocks[2], model.head])
    # ... also when the unit's own name is the module's: the two roles tell them apart.
    with pytest.raises(ValueError, match=r"module 'blocks\.0' is in two units \(first_unit 'blocks\.0' and "
                                         r"blocks 'blocks\.0'\)"):
        fsdp_units(model, blocks=model.blocks, first_unit=model.blocks[0])
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


def _in_place_reduce_scatter_rank() -> dict[str, Any]:
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from torchtitan_lite.distributed import fsdp_mesh, init_distributed
    from torchtitan_lite.distributed.fsdp import InPlaceReduceScatter, apply_fsdp

    device = torch.device("cpu")
    init_distributed(device)
    mesh = fsdp_mesh(device)
    # The collective alone: gloo's reduce-scatter of a copy against ours.
    x = torch.randn(2 * 1000, generator=torch.Generator().manual_seed(dist.get_rank()))
    theirs, ours = torch.empty(1000), torch.empty(1000)
    dist.reduce_scatter_tensor(theirs, x.clone(), op=dist.ReduceOp.SUM)
    InPlaceReduceScatter()(ours, x.clone(), dist.group.WORLD, dist.ReduceOp.SUM)
    # A model: apply_fsdp (ours installed) against fully_shard with FSDP2's default comm.
    torch.manual_seed(0)
    model = MyModel()
    plain = copy.deepcopy(model)
    apply_fsdp(model, mesh, blocks=model.blocks, first_unit=model.embed, last_unit=model.head)
    for unit in [plain.embed, *plain.blocks, plain.head]:
        fully_shard(unit, mesh=mesh)
    fully_shard(plain, mesh=mesh)
    comms = {type(group._reduce_scatter_comm).__name__ for module in model.modules()
             if hasattr(module, "_get_fsdp_state") for group in module._get_fsdp_state()._fsdp_param_groups}
    (inputs, labels), = _token_batches(1, batch=2)
    grads = []
    for m in (model, plain):
        _loss(m(inputs), labels).backward()
        grads.append({n: p.grad.to_local().clone() for n, p in m.named_parameters()})
    return {"collective_equal": torch.equal(theirs, ours), "comms": sorted(comms),
            "grads_equal": sorted(grads[0]) == sorted(grads[1])
            and all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])}


def test_gradients_reduce_scatter_in_place_on_gloo() -> None:
    """On CPU meshes apply_fsdp reduce-scatters gradients with ``InPlaceReduceScatter`` (an
    all-reduce of FSDP2's own buffer, no copy of it, see its docstring): every unit uses it, and
    the sums are bitwise those of gloo's reduce-scatter, alone and through a model's backward."""
    for result in run_distributed(_in_place_reduce_scatter_rank, 2):
        assert result["comms"] == ["InPlaceReduceScatter"], result
        assert result["collective_equal"] and result["grads_equal"], result
