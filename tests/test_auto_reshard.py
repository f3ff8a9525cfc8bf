"""``reshard_after_forward_mode = "auto"``: per-unit resharding chosen under a memory budget.

The planner (:func:`torchtitan_lite.memory.auto.plan_auto_reshard`) is checked in process on fake
tensors; the trainer's use of it on 2 real gloo ranks: what FSDP2 was told per unit, the
all-gathers that actually ran, and the peak measured by ``FSDPMemTracker`` against the budget.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed
from tests.fsdp_probes import reshard_kind
from tests.test_parallelize import _llama_units, _probe_collectives
from torchtitan_lite.config import ConfigError, load_job_config
from torchtitan_lite.distributed.fsdp import FSDPUnit, fsdp_units
from torchtitan_lite.job import plan_job
from torchtitan_lite.memory.auto import (
    _reshard_order,
    auto_budget_bytes,
    auto_headroom_bytes,
    plan_auto_reshard,
)
from torchtitan_lite.memory.estimate import estimate_memory, job_estimate_kwargs
from torchtitan_lite.models import get_model_spec
from torchtitan_lite.models.llama3 import LLAMA3_FLAVORS, Transformer

MIB = 2**20
SPEC = get_model_spec("llama3")
DEBUG = LLAMA3_FLAVORS["debugmodel"]
# debugmodel (8 units) on short sequences: its gathered parameters are a fair share of the peak.
JOB = [*TINY_ARGS, "--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.steps", "3"]
UNITS = ("tok_embeddings", *(f"layers.{i}" for i in range(6)), "norm+output")


def _estimate_kwargs() -> dict[str, Any]:
    config = load_job_config(JOB)
    return job_estimate_kwargs(config, plan_job(config, world_size=2))


def _units(model: Transformer) -> list[FSDPUnit]:
    """The FSDP units of our Llama, as the spec names them."""
    return fsdp_units(model, **SPEC.fsdp_units(model))


@pytest.fixture(scope="module")
def peaks() -> dict[str, int]:
    kwargs = _estimate_kwargs()
    peaks = {mode: estimate_memory(SPEC, DEBUG, reshard_after_forward_mode=mode, **kwargs).peak
             for mode in ("never", "always")}
    # What auto keeps free below a budget: one block's fp32 parameters here (3.25 MiB).
    peaks["headroom"] = auto_headroom_bytes(SPEC, DEBUG, kwargs["param_dtype"], kwargs["reduce_dtype"])
    return peaks


# --------------------------------------------------------------------------------------------
# The planner, in process
# --------------------------------------------------------------------------------------------


def test_order_larger_units_first_then_cheapest_to_hide_busy_and_last_unit_last():
    args = LLAMA3_FLAVORS["8B"]
    with torch.device("meta"):
        units = _units(Transformer(args))
    names = [u.name for u in units]

    def order(**kwargs: Any) -> list[str]:
        return [names[i] for i in _reshard_order(units, args, seq_len=8192, param_bytes=2, reduce_bytes=4,
                                                 **kwargs)]

    # The embedding (0.53B parameters) frees most per all-gather. Among the equal blocks,
    # layers.31's re-gather hides behind the output projection's backward (4 x 4096 x 128256
    # FLOPs per token) with no reduce-scatter queued before it; layers.30's queues behind
    # norm + output's 2 GiB reduce-scatter, so it is the last block. Norm + output, which
    # backward needs before anything else runs, comes last.
    assert order() == ["tok_embeddings", "layers.31", *(f"layers.{i}" for i in range(30)), "layers.30",
                       "norm+output"]
    # Units gathered at the peak anyway (running and prefetched there) come after the others.
    assert order(busy=frozenset({0, 32}))[-3:] == ["tok_embeddings", "layers.31", "norm+output"]


def test_busy_units_follow_fsdp2_prefetch():
    from torchtitan_lite.memory.auto import _busy_units

    with torch.device("meta"):
        units = _units(Transformer(DEBUG))
    assert _busy_units(units, "backward", "layers.5.feed_forward") == {6, 5}
    assert _busy_units(units, "forward", "layers.2.attention") == {3, 4}
    assert _busy_units(units, "backward", "norm") == {7, 6}
    assert _busy_units(units, "backward", "loss") == frozenset()
    assert _busy_units(units, "optimizer", "") == frozenset()


def test_loose_budget_reshards_nothing_tight_budget_the_fewest_that_fit(peaks):
    kwargs = _estimate_kwargs()
    loose = plan_auto_reshard(SPEC, DEBUG, budget_bytes=int((peaks["never"] + peaks["headroom"]) * 1.05), count_offloaded=True, **kwargs)
    assert loose.reshard == (False,) * len(UNITS) and loose.units == UNITS
    assert loose.peak == peaks["never"] and len(loose.tried) == 1  # one estimate: never fits
    assert loose.all_gathers_per_step == len(UNITS)

    budget = (peaks["never"] + peaks["always"]) // 2
    tight = plan_auto_reshard(SPEC, DEBUG, budget_bytes=budget, count_offloaded=True, **kwargs)
    k = sum(tight.reshard)
    assert 0 < k < len(UNITS) and tight.peak + tight.headroom <= budget
    # Headroom: the largest unit's gathered parameters (fp32 here), a block of debugmodel.
    with torch.device("meta"):
        assert tight.headroom == peaks["headroom"] == max(u.numel() for u in _units(Transformer(DEBUG))) * 4
    assert set(tight.resharded) == set(tight.order[:k])  # a prefix of the order
    assert tight.all_gathers_per_step == len(UNITS) + k
    # The fewest: one unit fewer (the last one added) does not fit.
    fewer = tuple(flag and name != tight.order[k - 1] for name, flag in zip(tight.units, tight.reshard, strict=True))
    assert estimate_memory(SPEC, DEBUG, reshard_after_forward_mode=fewer, **kwargs).peak > budget - tight.headroom
    assert "resharding" in tight.summary() and tight.order[0] in tight.summary()


def test_budget_below_resharding_everything_is_one_clear_error(peaks):
    with pytest.raises(ValueError, match=r"^parallelism\.memory_budget_gib: the estimated peak is .* per rank "
                                         r"even with every unit resharded after forward, plus 3\.3 MiB of "
                                         r"headroom for a collective buffer: above the budget of .* "
                                         r"\(parallelism\.memory_budget_gib = 0\.05\); allow more memory"):
        plan_auto_reshard(SPEC, DEBUG, budget_bytes=peaks["always"] - MIB, count_offloaded=True,
                          budget_source="parallelism.memory_budget_gib = 0.05", **_estimate_kwargs())


def test_budget_source_and_config_checks(tmp_path):
    assert auto_budget_bytes(1.5, None) == (int(1.5 * 2**30), "parallelism.memory_budget_gib = 1.5")
    budget, source = auto_budget_bytes(None, 80 * 2**30)
    assert budget == int(72 * 2**30) and "90%" in source
    with pytest.raises(ValueError, match="parallelism.memory_budget_gib: unset"):
        auto_budget_bytes(None, None)
    dump = ["--job.dump_folder", str(tmp_path)]
    config = load_job_config([*dump, "--parallelism.reshard_after_forward_mode", "auto",
                              "--parallelism.memory_budget_gib", "2"])
    assert config.parallelism.reshard_after_forward_mode == "auto"
    assert plan_job(config, world_size=4).reshard_mode == "auto"
    for argv, message in [
        (["--parallelism.memory_budget_gib", "2"], "used only with parallelism.reshard_after_forward_mode = 'auto'"),
        (["--parallelism.reshard_after_forward_mode", "auto", "--parallelism.memory_budget_gib", "-1"],
         "expected a finite number > 0"),
        (["--parallelism.reshard_after_forward_mode", "sometimes"], "expected one of default, always, never, auto, or an integer group size"),
    ]:
        with pytest.raises(ConfigError, match=message):
            plan_job(load_job_config([*dump, *argv]), world_size=2)


def test_apply_fsdp_checks_the_plan_length():
    from torchtitan_lite.distributed.fsdp import validate_reshard_after_forward_mode

    assert validate_reshard_after_forward_mode([True, False], 2) == (True, False)
    with pytest.raises(ValueError, match="one per FSDP unit"):
        validate_reshard_after_forward_mode((True, 1), 2)
    with pytest.raises(ValueError, match="'auto' is resolved into a per-unit plan"):
        validate_reshard_after_forward_mode("auto", 2)
    result = run_distributed(_wrong_length_rank, 1)
    assert result == ["reshard_after_forward_mode: a per-unit plan of 3 bools, but the model has 4 FSDP "
                      "units (tok_embeddings, layers.0, layers.1, norm+output)"]


def _wrong_length_rank() -> str:
    from torchtitan_lite.distributed import fsdp_mesh, init_distributed
    from torchtitan_lite.distributed.fsdp import apply_fsdp

    init_distributed(torch.device("cpu"))
    mesh = fsdp_mesh(torch.device("cpu"))
    with torch.device("meta"):
        model = Transformer(LLAMA3_FLAVORS["tiny"])
    try:
        apply_fsdp(model, mesh, **SPEC.fsdp_units(model), reshard_after_forward_mode=(True, False, True))
    except ValueError as exc:
        return str(exc)
    return "no error"


# --------------------------------------------------------------------------------------------
# The trainer on 2 ranks: what was chosen, what ran, what it held
# --------------------------------------------------------------------------------------------


def _auto_rank(budgets_gib: dict[str, float | None], dump: str) -> dict[str, Any]:
    import torch.distributed as dist

    from torchtitan_lite.loss import token_loss_sum
    from torchtitan_lite.memory.measure import measure_step_memory
    from torchtitan_lite.trainer import Trainer

    results = {}
    for label, budget in budgets_gib.items():
        mode = ["--parallelism.reshard_after_forward_mode", "never" if budget is None else "auto"]
        if budget is not None:
            mode += ["--parallelism.memory_budget_gib", repr(budget)]
        trainer = Trainer(load_job_config([*JOB, *mode, "--job.dump_folder", str(Path(dump) / label)]))
        units = _llama_units(trainer.model)
        reshard = {name: reshard_kind(m) for name, m in units.items()}
        collectives = _probe_collectives(trainer, units)

        def loss_fn(trainer: Any = trainer) -> torch.Tensor:
            (inputs, labels), = trainer.loader.next_batch()
            return token_loss_sum(trainer.model(inputs), labels) / labels.numel()

        losses = [h["loss"] for h in trainer.train()]
        # Two more steps (after the trainer's, so the optimizer state exists from the start)
        # under FSDPMemTracker, whose hooks stay on the modules afterwards: measured last.
        measured = measure_step_memory(trainer.model, trainer.optimizer, loss_fn)
        plan = trainer.reshard_plan
        results[label] = {
            "plan": None if plan is None else dataclasses.asdict(plan),
            "reshard": reshard,
            "backward_gathers": [c["unit"] for c in collectives
                                 if c["kind"] == "all_gather" and c["phase"] == "backward"],
            "forward_gathers": [c["unit"] for c in collectives
                                if c["kind"] == "all_gather" and c["phase"] == "forward"],
            "peak": measured["peak"]["total"],
            "losses": losses,
        }
    dist.barrier()
    return results


def test_trainer_auto_reshards_under_a_tight_budget_not_a_loose_one_and_stays_within(peaks, tmp_path):
    tight = (peaks["never"] + peaks["always"]) / 2 / 2**30
    loose = (peaks["never"] + peaks["headroom"]) * 1.05 / 2**30
    ranks = run_distributed(_auto_rank, 2, {"never": None, "tight": tight, "loose": loose}, str(tmp_path))
    print(f"\nestimated peaks: never {peaks['never'] / MIB:.2f} MiB, always {peaks['always'] / MIB:.2f} MiB")
    for rank, runs in enumerate(ranks):
        never = runs["never"]
        for label, budget in (("tight", tight), ("loose", loose)):
            run = runs[label]
            plan = run["plan"]
            resharded = {name for name, flag in zip(plan["units"], plan["reshard"], strict=True) if flag}
            if rank == 0:
                print(f"{label}: budget {budget * 1024:.2f} MiB, resharded {sorted(resharded)}, estimated "
                      f"{plan['estimate']['peak'] / MIB:.2f} MiB, measured {run['peak'] / MIB:.2f} MiB "
                      f"(never measured {never['peak'] / MIB:.2f} MiB)")
            # The measured peak of real steps stays within the budget.
            assert run["peak"] <= budget * 2**30, (label, run["peak"], budget)
            # What FSDP2 was told per unit, and the all-gathers that ran: every unit in forward,
            # again in backward exactly the resharded ones.
            assert run["reshard"] == {name: "full" if name in resharded else "none" for name in UNITS}
            assert run["forward_gathers"] == list(UNITS)
            assert sorted(run["backward_gathers"]) == sorted(resharded)
            assert run["losses"] == pytest.approx(never["losses"], rel=1e-6)
        assert runs["loose"]["plan"]["reshard"] == (False,) * len(UNITS)
        assert not runs["loose"]["backward_gathers"]
        # The tight budget binds: keeping every unit gathered would exceed it, measured too.
        assert never["peak"] > tight * 2**30
        assert 0 < len(runs["tight"]["backward_gathers"]) < len(UNITS)
        assert all(math.isfinite(x) for x in never["losses"])


def test_estimate_cli_shows_what_auto_would_choose(peaks, tmp_path, capsys):
    from torchtitan_lite.memory.cli import main

    out = tmp_path / "estimate.json"
    tight = (peaks["never"] + peaks["always"]) / 2 / 2**30
    argv = [*JOB, "--job.dump_folder", str(tmp_path), "--parallelism.reshard_after_forward_mode", "auto"]
    assert main([*argv, "--world_size", "2", "--parallelism.memory_budget_gib", repr(tight),
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert any(line.startswith("auto*") for line in printed.splitlines())
    assert "reshard_after_forward_mode auto: budget" in printed and "parallelism.memory_budget_gib" in printed
    record = json.loads(out.read_text())
    assert 0 < sum(record["auto"]["reshard"]) < len(UNITS) and record["auto"]["peak"] <= tight * 2**30
    assert [e["configured"] for e in record["estimates"]] == [False, False, False, True]
    # No budget and no CUDA device: the device's memory decides (90% of it), or one error line.
    assert main([*argv, "--world_size", "2", "--device_memory_gib", "1"]) == 0
    assert "90% of the device's 1.0 GiB" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert main([*argv, "--world_size", "2"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            "error: parallelism.memory_budget_gib: unset; reshard_after_forward_mode = 'auto' needs a per-rank "
            "memory budget without a CUDA device (e.g. 16 for 16 GiB; the estimator also takes --device_memory_gib)"]
