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
from tests.test_fsdp import _llama_units, _probe_collectives
from torchtitan_lite.config import ConfigError, load_job_config
from torchtitan_lite.distributed.activation_checkpoint import checkpoint_policy_of
from torchtitan_lite.distributed.fsdp import FSDPUnit, fsdp_units
from torchtitan_lite.distributed.job_shape import JobShape
from torchtitan_lite.job import plan_job
from torchtitan_lite.memory.auto import (
    COMM_FLOPS_PER_BYTE,
    MEMORY_FLOPS_PER_BYTE,
    _reshard_order,
    action_costs,
    auto_budget_bytes,
    auto_headroom_bytes,
    plan_auto_reshard,
)
from torchtitan_lite.memory.estimate import estimate_memory, job_estimate_shape
from torchtitan_lite.models import get_model_spec
from torchtitan_lite.models.llama3 import LLAMA3_FLAVORS, Transformer

MIB = 2**20
SPEC = get_model_spec("llama3")
DEBUG = LLAMA3_FLAVORS["debugmodel"]
# debugmodel (8 units) on short sequences: its gathered parameters are a fair share of the peak.
JOB = [*TINY_ARGS, "--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.steps", "3"]
UNITS = ("tok_embeddings", *(f"layers.{i}" for i in range(6)), "norm+output")


def _estimate_shape() -> JobShape:
    return job_estimate_shape(plan_job(load_job_config(JOB), world_size=2))


def _units(model: Transformer) -> list[FSDPUnit]:
    """The FSDP units of our Llama, as the spec names them."""
    return fsdp_units(model, **SPEC.fsdp_units(model))


@pytest.fixture(scope="module")
def peaks() -> dict[str, int]:
    shape = _estimate_shape()
    # In the forms the planner asks for them (per-unit and per-block plans), so that its own
    # estimates of these plans in this process are the cached ones: never, always, and every
    # unit resharded with every block recomputed (the least auto can reach).
    n = len(UNITS)
    peaks = {label: estimate_memory(SPEC, DEBUG, shape, reshard_after_forward_mode=(flag,) * n,
                                    ac_policies=(policy,) * 6).peak
             for label, flag, policy in (("never", False, "none"), ("always", True, "none"),
                                         ("least", True, "full"))}
    # What auto keeps free below a budget: one block's fp32 parameters here (3.25 MiB).
    peaks["headroom"] = auto_headroom_bytes(SPEC, DEBUG, shape.param_dtype, shape.reduce_dtype)
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


def _plan_of(actions: list[str]) -> tuple[tuple[bool, ...], tuple[str, ...]]:
    """Per unit reshard flags and per block policies after ``actions`` ("reshard layers.3",
    "op layers.0", "full layers.0")."""
    reshard, policies = [False] * len(UNITS), ["none"] * 6
    for action in actions:
        kind, name = action.split(" ")
        if kind == "reshard":
            reshard[UNITS.index(name)] = True
        elif kind == "full" or policies[int(name.split(".")[1])] == "none":
            policies[int(name.split(".")[1])] = kind
    return tuple(reshard), tuple(policies)


def test_cost_model_at_8b_hides_reshards_then_recomputes_cheap_ops_then_whole_blocks():
    """The 8B flavor at seq 8192, bf16 parameters, fp32 reduce: every block's re-gather hides
    behind the next block's backward (cost 0), the last unit's cannot; recomputing a block's
    cheap ops costs less per byte than rerunning its matmuls."""
    args = LLAMA3_FLAVORS["8B"]
    with torch.device("meta"):
        units = _units(Transformer(args))
    op_bytes = 1.5 * 2**30  # what op frees per block at batch 1 (illustrative; the planner measures it)
    costs = action_costs(units, args, tokens=8192, seq_len=8192, param_bytes=2, reduce_bytes=4,
                         op_bytes_per_block=op_bytes)
    blocks = [i for i, u in enumerate(units) if u.role == "block"]
    assert all(costs[("reshard", i)] == 0 for i in blocks[:-1])
    last = len(units) - 1
    assert costs[("reshard", last)] == units[last].numel() * 2 * COMM_FLOPS_PER_BYTE
    assert costs[("op", 0)] == 2 * op_bytes * MEMORY_FLOPS_PER_BYTE
    block = units[blocks[0]]
    assert costs[("full", 0)] == (2 * block.numel() + 4 * args.dim * 8192) * 8192
    # Per byte freed, full (its increment over op frees the matmul outputs, at most as much
    # again as op) costs more than op.
    assert costs[("full", 0)] / op_bytes > costs[("op", 0)] / op_bytes


@pytest.mark.slow
def test_loose_budget_changes_nothing_tight_budget_takes_the_fewest_actions_that_fit(peaks):
    shape = _estimate_shape()
    loose = plan_auto_reshard(
        SPEC, DEBUG, shape, budget_bytes=int((peaks["never"] + peaks["headroom"]) * 1.05), count_offloaded=True
    )
    assert loose.reshard == (False,) * len(UNITS) and loose.units == UNITS
    assert loose.ac_policies == loose.configured_ac == ("none",) * 6 and not loose.recomputed
    assert loose.peak == peaks["never"] and len(loose.tried) == 1  # one estimate: never fits
    assert loose.all_gathers_per_step == len(UNITS) and loose.actions == () and loose.added_flops == 0

    budget = (peaks["never"] + peaks["always"]) // 2
    tight = plan_auto_reshard(SPEC, DEBUG, shape, budget_bytes=budget, count_offloaded=True)
    assert tight.peak + tight.headroom <= budget and tight.actions
    # Headroom: the largest unit's gathered parameters (fp32 here), a block of debugmodel.
    with torch.device("meta"):
        assert tight.headroom == peaks["headroom"] == max(u.numel() for u in _units(Transformer(DEBUG))) * 4
    taken = [name for name, _, _ in tight.actions]
    assert (tight.reshard, tight.ac_policies) == _plan_of(taken)
    assert tight.all_gathers_per_step == len(UNITS) + sum(tight.reshard)
    # Taken least added time per byte first, and the modelled cost is their sum.
    rates = [cost / freed if freed else math.inf for _, cost, freed in tight.actions]
    assert rates == sorted(rates) and tight.added_flops == pytest.approx(sum(c for _, c, _ in tight.actions))
    # The fewest: without the last action taken it does not fit.
    reshard, policies = _plan_of(taken[:-1])
    fewer = estimate_memory(SPEC, DEBUG, shape, reshard_after_forward_mode=reshard, ac_policies=policies)
    assert fewer.peak > budget - tight.headroom
    assert "activation checkpointing added" in tight.summary() and "modelled added time" in tight.summary()


@pytest.mark.slow
def test_budget_below_resharding_everything_is_one_clear_error(peaks):
    with pytest.raises(ValueError, match=r"^parallelism\.memory_budget_gib: the estimated peak is .* per rank "
                                         r"even with every unit resharded after forward and every block "
                                         r"fully recomputed, plus 3\.3 MiB of "
                                         r"headroom for a collective buffer: above the budget of .* "
                                         r"\(parallelism\.memory_budget_gib = 0\.05\); allow more memory"):
        plan_auto_reshard(SPEC, DEBUG, budget_bytes=peaks["least"] - MIB, count_offloaded=True,
                          budget_source="parallelism.memory_budget_gib = 0.05", shape=_estimate_shape())


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
    assert plan_job(config, world_size=4).shape.reshard_after_forward_mode == "auto"
    # training.enable_cpu_offload keeps working: it is cpu_offload = all.
    assert plan_job(load_job_config([*dump, "--training.enable_cpu_offload"]), world_size=2).shape.cpu_offload is True
    for argv, message in [
        (["--parallelism.memory_budget_gib", "2"], "used only with parallelism.reshard_after_forward_mode = 'auto'"),
        (["--parallelism.reshard_after_forward_mode", "auto", "--parallelism.memory_budget_gib", "-1"],
         "expected a finite number > 0"),
        (["--parallelism.reshard_after_forward_mode", "sometimes"],
         "expected one of default, always, never, auto, or an integer group size"),
        (["--parallelism.cpu_offload", "auto"],
         r"parallelism.cpu_offload: invalid value 'auto'; auto chooses per unit"),
        (["--parallelism.cpu_offload", "some"], "parallelism.cpu_offload"),
        (["--parallelism.reshard_after_forward_mode", "auto", "--parallelism.cpu_offload", "auto",
          "--training.enable_cpu_offload"], "training.enable_cpu_offload: invalid value True; expected false"),
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


def _auto_rank(budgets_gib: dict[str, float | None], dump: str, job: list[str]) -> dict[str, Any]:
    import torch.distributed as dist

    from torchtitan_lite.loss import token_loss_sum
    from torchtitan_lite.memory.measure import measure_step_memory
    from torchtitan_lite.trainer import Trainer

    results = {}
    for label, budget in budgets_gib.items():
        mode = ["--parallelism.reshard_after_forward_mode", "never" if budget is None else "auto"]
        if budget is not None:
            mode += ["--parallelism.memory_budget_gib", repr(budget)]
        trainer = Trainer(load_job_config([*job, *mode, "--job.dump_folder", str(Path(dump) / label)]))
        units = _llama_units(trainer.model)
        reshard = {name: reshard_kind(m) for name, m in units.items()}
        policies = tuple(checkpoint_policy_of(block) for block in trainer.model.layers.values())
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
            "policies": policies,
            "backward_gathers": [c["unit"] for c in collectives
                                 if c["kind"] == "all_gather" and c["phase"] == "backward"],
            "forward_gathers": [c["unit"] for c in collectives
                                if c["kind"] == "all_gather" and c["phase"] == "forward"],
            "peak": measured["peak"]["total"],
            "losses": losses,
        }
    dist.barrier()
    return results


# The tiny flavor (4 units, 2 blocks) at seq 256, where activations are most of the peak: the
# planner's estimates are quick, and it runs once per auto trainer in a child process.
TINY_JOB = [*TINY_ARGS, "--training.seq_len", "256", "--training.steps", "3"]
TINY_UNITS = ("tok_embeddings", "layers.0", "layers.1", "norm+output")


@pytest.fixture(scope="module")
def tiny_peaks() -> dict[str, int]:
    config = load_job_config(TINY_JOB)
    shape = job_estimate_shape(plan_job(config, world_size=2))
    args = LLAMA3_FLAVORS["tiny"]
    peaks = {label: estimate_memory(SPEC, args, shape, reshard_after_forward_mode=mode, ac_mode=ac).peak
             for label, mode, ac in (("never", "never", "none"), ("always", "always", "none"),
                                     ("least", "always", "full"))}
    peaks["headroom"] = auto_headroom_bytes(SPEC, args, shape.param_dtype, shape.reduce_dtype)
    return peaks


@pytest.mark.slow
def test_trainer_auto_recomputes_when_no_reshard_plan_fits_nothing_under_a_loose_budget(tiny_peaks, tmp_path):
    """2 real ranks: a budget below every unit resharded (always) but above that plus every block
    recomputed makes auto checkpoint blocks; the job runs, FSDP2 and the blocks were told the plan,
    the all-gathers that ran match it, the losses are never's and the measured peak is within the
    budget. A loose budget changes nothing."""
    tight = ((tiny_peaks["always"] + tiny_peaks["least"]) / 2 + tiny_peaks["headroom"]) / 2**30
    assert tight * 2**30 < tiny_peaks["always"] + tiny_peaks["headroom"]  # no reshard-only plan fits
    loose = (tiny_peaks["never"] + tiny_peaks["headroom"]) * 1.05 / 2**30
    # The loose plan is never's (checked below): its losses and measured peak are never's.
    ranks = run_distributed(_auto_rank, 2, {"tight": tight, "loose": loose}, str(tmp_path), TINY_JOB)
    print(f"\nestimated peaks: never {tiny_peaks['never'] / MIB:.2f} MiB, always {tiny_peaks['always'] / MIB:.2f} MiB, "
          f"always + full {tiny_peaks['least'] / MIB:.2f} MiB")
    for rank, runs in enumerate(ranks):
        never = runs["loose"]
        for label, budget in (("tight", tight), ("loose", loose)):
            run = runs[label]
            plan = run["plan"]
            resharded = {name for name, flag in zip(plan["units"], plan["reshard"], strict=True) if flag}
            if rank == 0:
                print(f"{label}: budget {budget * 1024:.2f} MiB, resharded {sorted(resharded)}, "
                      f"checkpointing {plan['ac_policies']}, estimated {plan['estimate']['peak'] / MIB:.2f} MiB, "
                      f"measured {run['peak'] / MIB:.2f} MiB (never measured {never['peak'] / MIB:.2f} MiB)")
            # The measured peak of real steps stays within the budget.
            assert run["peak"] <= budget * 2**30, (label, run["peak"], budget)
            # What FSDP2 and the blocks were told, and the all-gathers that ran: every unit in
            # forward, again in backward exactly the resharded ones.
            assert run["reshard"] == {name: "full" if name in resharded else "none" for name in TINY_UNITS}
            assert run["policies"] == plan["ac_policies"]
            assert run["forward_gathers"] == list(TINY_UNITS)
            assert sorted(run["backward_gathers"]) == sorted(resharded)
            assert run["losses"] == pytest.approx(never["losses"], rel=1e-6)
        assert runs["loose"]["plan"]["reshard"] == (False,) * len(TINY_UNITS)
        assert runs["loose"]["policies"] == ("none",) * 2 and not runs["loose"]["backward_gathers"]
        # The tight budget binds: blocks are recomputed, and keeping everything would exceed it.
        assert set(runs["tight"]["policies"]) != {"none"}
        assert never["peak"] > tight * 2**30
        assert all(math.isfinite(x) for x in never["losses"])


@pytest.mark.slow
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
    assert record["auto"]["actions"] and record["auto"]["peak"] <= tight * 2**30
    assert len(record["auto"]["ac_policies"]) == 6 and record["auto"]["configured_ac"] == ["none"] * 6
    assert [e["configured"] for e in record["estimates"]] == [False, False, False, True]
    # No budget and no CUDA device: one error line (with --device_memory_gib, 90% of it: see
    # test_budget_source_and_config_checks).
    if not torch.cuda.is_available():
        assert main([*argv, "--world_size", "2"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            "error: parallelism.memory_budget_gib: unset; reshard_after_forward_mode = 'auto' needs a per-rank "
            "memory budget without a CUDA device (e.g. 16 for 16 GiB; the estimator also takes --device_memory_gib)"]



@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_estimate_cli_says_what_auto_would_choose_for_a_job_that_does_not_use_it(tmp_path, capsys):
    """Given a device size, the memory CLI prints the plan auto would pick for a job configured
    otherwise (resharding, checkpointing and per-unit CPU offload), with its estimated peak and
    modelled added time; the JSON has it too, marked not configured."""
    from torchtitan_lite.memory.cli import main

    out = tmp_path / "estimate.json"
    # A device of 40 MiB: 90% of it is the budget the offload test plans under (36 MiB).
    assert main([*OFFLOAD_JOB, "--job.dump_folder", str(tmp_path), "--world_size", "2",
                 "--device_memory_gib", repr(40 / 1024), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if line.startswith("auto would choose"))
    assert ("with parallelism.reshard_after_forward_mode = 'auto', parallelism.cpu_offload = 'auto': "
            "reshard_after_forward_mode auto: budget 36.0 MiB") in line, line
    assert "CPU offload: " in line and "-> estimated peak" in line and " ms at 989 TFLOP/s" in line, line
    record = json.loads(out.read_text())["auto"]
    assert record["configured"] is False and any(record["offload"]) and record["peak"] <= 36 * 2**20


# --------------------------------------------------------------------------------------------
# parallelism.cpu_offload = "auto": per-unit offload chosen under the budget
# --------------------------------------------------------------------------------------------

# debugmodel (8 units) at a small batch: its peak is the optimizer step's (the state), which
# neither resharding nor recomputation lowers; offloading units does.
OFFLOAD_JOB = [*TINY_ARGS, "--model.flavor", "debugmodel", "--training.steps", "4"]
OFFLOAD_RUNS = {
    "plain": ["--parallelism.reshard_after_forward_mode", "default"],
    "tight": ["--parallelism.reshard_after_forward_mode", "auto", "--parallelism.cpu_offload", "auto",
              "--parallelism.memory_budget_gib", "0.035"],
    "loose": ["--parallelism.reshard_after_forward_mode", "auto", "--parallelism.cpu_offload", "auto",
              "--parallelism.memory_budget_gib", "10"],
}


def _offload_rank(dump: str) -> dict[str, Any]:
    import torch.distributed as dist

    from tests.dist_utils import captured_log
    from tests.fsdp_probes import offload_flags
    from torchtitan_lite.trainer import Trainer

    results = {}
    with captured_log() as lines:
        for label, extra in OFFLOAD_RUNS.items():
            lines.clear()
            trainer = Trainer(load_job_config([*OFFLOAD_JOB, *extra, "--job.dump_folder", str(Path(dump) / label)]))
            units = _llama_units(trainer.model)
            plan = trainer.reshard_plan
            results[label] = {
                "losses": [h["loss"] for h in trainer.train()],
                "plan": None if plan is None else {"units": plan.units, "offload": plan.offload,
                                                   "peak": plan.peak, "budget": plan.budget},
                # What FSDP2 was told, per unit: every parameter's offload_to_cpu.
                "fsdp_offload": {name: sorted({flag for flag, _ in offload_flags([module])})
                                 for name, module in units.items()},
                "logged": [line for line in lines if "CPU offload:" in line],
            }
            trainer.metrics.close()  # not trainer.close(): that ends the process group the next one uses
    dist.barrier()
    return results


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_trainer_auto_offloads_the_units_a_budget_needs_and_trains_the_same(tmp_path):
    """2 ranks, ``cpu_offload = "auto"``: a budget that only offloading meets (the peak is the
    optimizer step's) offloads some units, FSDP2 is told exactly those, rank 0 logs the plan
    naming them, and the losses equal the job without offload; a loose budget offloads nothing."""
    ranks = run_distributed(_offload_rank, 2, str(tmp_path))
    for rank, runs in enumerate(ranks):
        tight, loose, plain = runs["tight"], runs["loose"], runs["plain"]
        offloaded = [name for name, flag in zip(tight["plan"]["units"], tight["plan"]["offload"], strict=True)
                     if flag]
        assert 0 < len(offloaded) < len(tight["plan"]["units"]), tight["plan"]
        assert tight["plan"]["peak"] <= tight["plan"]["budget"]
        assert tight["fsdp_offload"] == {name: [name in offloaded] for name in tight["plan"]["units"]}
        assert loose["plan"]["offload"] == (False,) * len(loose["plan"]["units"])
        assert loose["fsdp_offload"] == {name: [False] for name in loose["plan"]["units"]}
        if rank == 0:  # the plan is logged once, by rank 0, naming the offloaded units
            assert len(tight["logged"]) == 1 and f"CPU offload: {len(offloaded)} of 8 units" in tight["logged"][0]
            assert "layers.0" in tight["logged"][0], tight["logged"]
            assert "CPU offload: none" in loose["logged"][0]
            print(f"\n{tight['logged'][0]}")
        assert tight["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=0)
        assert loose["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=0)
        assert all(math.isfinite(x) for x in plain["losses"])


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_auto_plans_a_pipeline_ranks_own_units_and_keeps_zero_bubble_units_gathered():
    """With a pipeline (debugmodel over 2 pipeline ranks × data parallel 2, seq 512, on fake
    tensors), ``pipeline_rank`` plans that rank's units only and its estimate is that rank's.
    Under a budget below both ranks' peaks, 1F1B's plans fit it. ZBVZeroBubble's cannot reshard,
    and full checkpointing raises its peak here (the input pass keeps a block's recomputation
    for the weight pass, which recomputes it again): the same budget is one error that says so,
    and a loose one changes nothing."""
    from torchtitan_lite.memory.estimate import estimate_stages

    job = [*JOB, "--training.seq_len", "512", "--training.local_batch_size", "4",
           "--parallelism.pipeline_parallel_degree", "2"]
    for schedule in ("1F1B", "ZBVZeroBubble"):
        config = load_job_config([*job, "--parallelism.pipeline_parallel_schedule", schedule])
        plan = plan_job(config, world_size=4)
        shape = job_estimate_shape(plan)
        never = [e.peak for e in estimate_stages(SPEC, plan.model_args, shape, reshard_after_forward_mode="never")]
        tight = int(min(never) * 0.9)
        if schedule == "ZBVZeroBubble":
            with pytest.raises(ValueError, match="even with every block fully recomputed .ZBVZeroBubble keeps every "
                                                 "unit gathered."):
                plan_auto_reshard(SPEC, plan.model_args, shape, budget_bytes=tight, count_offloaded=True,
                                  pipeline_rank=1)
        budget = tight if schedule == "1F1B" else int(max(never) * 1.2)
        plans = [plan_auto_reshard(SPEC, plan.model_args, shape, budget_bytes=budget, count_offloaded=True,
                                   pipeline_rank=rank) for rank in range(2)]
        expected = {"1F1B": [("tok_embeddings", "layers.0", "layers.1", "layers.2"),
                             ("layers.3", "layers.4", "layers.5", "norm+output")],
                    # (the V: the first rank holds the first and the last stage)
                    "ZBVZeroBubble": [("tok_embeddings", "layers.0", "layers.5", "norm+output"),
                                      ("layers.1", "layers.2", "layers.3", "layers.4")]}[schedule]
        assert [chosen.units for chosen in plans] == expected
        for rank, chosen in enumerate(plans):
            assert chosen.estimate.pipeline_rank == rank
            assert chosen.never_peak == pytest.approx(never[rank], rel=1e-4)
            assert chosen.peak + chosen.headroom <= budget, (schedule, rank, chosen.summary())
            assert f"pp rank {rank}'s stages" in chosen.summary()
            acted = any(chosen.reshard) or set(chosen.ac_policies) != {"none"}
            assert acted == (schedule == "1F1B"), chosen.summary()
