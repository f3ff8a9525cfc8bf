"""Objectives as registered parts: each objective is an :class:`ObjectiveEntry` under a name
(``training.objective``), and owns what the rest of the package would otherwise have to ask about:

- :meth:`ObjectiveEntry.plan`: its config section's checks and resolved settings, the shape of
  its step for the memory estimate (:class:`~torchtitan_lite.distributed.job_shape.ObjectiveShape`)
  and its notes: an :class:`ObjectivePlan` the job plan holds;
- :meth:`ObjectiveEntry.build`: the objective itself (with its reference model, reward functions,
  rollout engine …) from the trainer's parts (:class:`ObjectiveParts`);
- :meth:`ObjectiveEntry.console`: its part of the console line.

The trainer, the plan, validation, the metrics, the estimator and the engine ask the entry; none of
them names an objective. A new objective is a module with an entry and :func:`register` (or a
dotted path to the entry, ``--training.objective my_module.MY_OBJECTIVE``): ``docs/research.md``
has one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torchtitan_lite.config.schema import JobConfig
from torchtitan_lite.distributed.job_shape import ObjectiveShape
from torchtitan_lite.errors import ConfigError, Problems, UserCodeError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from torchtitan_lite.data import BatchLoader
    from torchtitan_lite.distributed import ParallelDims, ParallelMesh
    from torchtitan_lite.distributed.lora import LoRASetup
    from torchtitan_lite.distributed.pipeline_parallel import PipelineRunner
    from torchtitan_lite.objectives.base import Objective
    from torchtitan_lite.training.runner import LossFn, MicroBatchRunner

__all__ = ["AUTO", "OBJECTIVES", "ObjectiveEntry", "ObjectiveParts", "ObjectivePlan", "PlanContext", "objective_for",
           "plan_objective", "register"]

AUTO = "auto"
"""``training.objective``'s default: the objective whose data the job reads (preference pairs:
DPO; prompts: GRPO), else the token loss."""


@dataclass(frozen=True)
class PlanContext:
    """What an objective's plan may read besides the config: the job's degrees, its LoRA and the
    global batch (samples over all ranks)."""

    dims: ParallelDims
    lora: LoRASetup | None
    global_batch: int


@dataclass(frozen=True)
class ObjectivePlan:
    """An objective resolved for a job: the entry, its own settings, its step's shape."""

    entry: ObjectiveEntry
    setup: Any = None
    """The objective's resolved section (e.g. the DPO or GRPO settings); None when it has none."""
    shape: ObjectiveShape = field(default_factory=ObjectiveShape)
    """What its step holds beyond a token-loss step of the same rows (the estimate, the build)."""
    notes: tuple[str, ...] = ()
    """Start-up notes (a setting that will not do what the user likely wants)."""
    generation_batch_size: int = 0
    """Completions the rollout engine makes at once (0: all it is given)."""
    group: int = 1
    """Samples a step makes of each item the loader reads (online RL: completions per prompt)."""

    @property
    def name(self) -> str:
        return self.entry.name


@dataclass
class ObjectiveParts:
    """The trainer's parts an objective is built from (:meth:`ObjectiveEntry.build`)."""

    config: JobConfig
    plan: Any
    """The :class:`~torchtitan_lite.job.JobPlan`."""
    model: nn.Module
    mesh: ParallelMesh
    device: torch.device
    loader: BatchLoader
    loss_fn: LossFn
    reshard_plan: Any = None
    """What ``auto`` chose (a reference copy is built as the model is)."""
    rollout_engine: Callable[[], Any] | None = None
    """The job's rollout engine (built once, from the runner), for an objective that generates."""
    forward_schedule: Callable[[nn.Module, int], PipelineRunner | None] | None = None
    """A forward-only pipeline schedule over a model's stages for a local batch (None without a pipeline)."""


class ObjectiveEntry:
    """One objective as the package sees it (see the module's text). Subclass it, set
    :attr:`name` (and :attr:`section`, :attr:`data_kinds`), and :func:`register` an instance."""

    name: str = ""
    """``training.objective``'s value for it."""
    section: str | None = None
    """Its config section (``[dpo]``, ``[grpo]``): set while another objective runs, it is refused."""
    data_kinds: frozenset[str] = frozenset()
    """The training data kinds that select it under ``training.objective = "auto"``."""

    def selected(self, config: JobConfig) -> bool:
        """Whether ``auto`` picks it for ``config`` (its training data are of :attr:`data_kinds`)."""
        t = config.training
        return bool(self.data_kinds & set(s.dataset for s in t.datasets or [t]))

    def check_idle(self, config: JobConfig, problems: Problems) -> None:
        """What ``config`` may not set while another objective runs: by default a setting of
        :attr:`section` (one line, naming the first)."""
        if self.section is None:
            return
        values = getattr(config, self.section)
        default = type(values)()
        changed = [name for name in vars(default) if getattr(values, name) != getattr(default, name)]
        if changed:
            kinds = " or ".join(map(repr, sorted(self.data_kinds)))
            problems.require(False, f"{self.section}.{changed[0]}", getattr(values, changed[0]),
                             f"[{self.section}] applies to the {self.name!r} objective, on training.dataset = "
                             f"{kinds} (this job's is {config.training.dataset!r})"
                             if self.selected(config) else
                             f"[{self.section}] applies to training.dataset = {kinds} (this job's is "
                             f"{config.training.dataset!r})")

    def plan(self, config: JobConfig, context: PlanContext) -> ObjectivePlan:
        """Its settings checked (one :class:`ConfigError` with a line for each problem) and resolved."""
        return ObjectivePlan(self)

    def build(self, parts: ObjectiveParts) -> Objective:
        """The objective of the job's steps."""
        raise NotImplementedError

    def add_forward_schedules(self, objective: Objective, runner: MicroBatchRunner, parts: ObjectiveParts, *,
                              local_batch_size: int) -> None:
        """With a pipeline, the forward-only schedules its step runs (none by default)."""

    def pair_scorer(self, objective: Objective) -> Any:
        """What scores validation sets of pairs (None: the objective validates token sets only)."""
        return None

    def batch_text(self, plan: ObjectivePlan, local_batch_size: int) -> str:
        """A micro-batch of ``local_batch_size`` samples, in the memory command's words."""
        return str(local_batch_size)

    def sequence_text(self, plan: ObjectivePlan) -> str:
        """What a sequence of ``training.seq_len`` tokens is, after the longest that fits ("": a row)."""
        return ""

    def step_lines(self, plan: ObjectivePlan) -> list[str]:
        """How its step runs beyond a token step's (the memory command prints them; none by default)."""
        return []

    def console(self, record: dict[str, Any]) -> list[str]:
        """Its parts of the console line for a metrics record (none by default)."""
        return []

    def validation_console(self, record: dict[str, Any]) -> str | None:
        """The console's validation part when it differs from ``val_loss … val_ppl …`` (None)."""
        return None


OBJECTIVES: dict[str, ObjectiveEntry] = {}
"""Every registered objective by name."""


def register(entry: ObjectiveEntry) -> ObjectiveEntry:
    """Add ``entry`` under its name (a name taken by another entry is an error); returns it."""
    if not entry.name or entry.name == AUTO:
        raise ValueError(f"an objective needs a name other than {AUTO!r}: {type(entry).__name__}")
    known = OBJECTIVES.get(entry.name)
    if known is not None and type(known) is not type(entry):
        raise ValueError(f"objective {entry.name!r} is registered already ({type(known).__name__})")
    OBJECTIVES[entry.name] = entry
    return entry


def _resolve(name: str) -> ObjectiveEntry:
    """A registered name, or a dotted path to an entry (``module.ENTRY``), imported and registered."""
    if name in OBJECTIVES:
        return OBJECTIVES[name]
    module_name, _, attribute = name.rpartition(".")
    known = ", ".join(map(repr, [AUTO, *OBJECTIVES]))
    if not module_name:
        raise ConfigError(f"training.objective: invalid value {name!r}; expected one of {known}, or a dotted path "
                          "module.ENTRY to an objective entry of one's own")
    try:
        entry = getattr(importlib.import_module(module_name), attribute, None)
    except ImportError as exc:
        raise ConfigError(f"training.objective: invalid value {name!r}; its module {module_name!r} does not "
                          f"import ({exc})") from None
    except Exception as exc:  # (the user's code: any error is reported as its own)
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        raise UserCodeError(f"training.objective: importing {module_name!r} raised {type(exc).__name__}: "
                            f"{first}") from exc
    if not isinstance(entry, ObjectiveEntry):
        raise ConfigError(f"training.objective: invalid value {name!r}; module {module_name!r} has no objective "
                          f"entry {attribute!r} (an ObjectiveEntry instance); registered: {known}")
    try:
        return register(entry)
    except ValueError as exc:
        raise ConfigError(f"training.objective: invalid value {name!r}; {exc}") from None


def objective_for(config: JobConfig) -> ObjectiveEntry:
    """The job's objective: ``training.objective`` (a name, or a dotted path), or under ``auto``
    the entry its training data select (the token loss when none does)."""
    name = config.training.objective
    if name != AUTO:
        return _resolve(name)
    chosen = [entry for entry in OBJECTIVES.values() if entry.data_kinds and entry.selected(config)]
    return chosen[0] if chosen else OBJECTIVES["token"]


def plan_objective(config: JobConfig, context: PlanContext) -> ObjectivePlan:
    """The job's objective (:func:`objective_for`) planned, after what the others refuse of the
    config while they do not run (their sections' settings …): every problem a line of one
    :class:`ConfigError`."""
    running = objective_for(config)
    problems = Problems()
    t = config.training
    kinds = {s.dataset for s in t.datasets or [t]}
    for entry in OBJECTIVES.values():
        if entry is running:
            continue
        # (data only another objective reads: its rows are not the running objective's)
        others = sorted((entry.data_kinds & kinds) - running.data_kinds)
        if others and t.objective == AUTO:  # (data of two objectives: the mixture is the mistake)
            problems.require(False, "training.datasets" if t.datasets else "training.dataset",
                             sorted(kinds) if t.datasets else t.dataset,
                             f"{others[0]!r} is read by the {entry.name!r} objective and the rest by the "
                             f"{running.name!r} one: expected sources of one objective")
        elif others:
            problems.require(False, "training.objective", t.objective,
                             f"training.dataset = {others[0]!r} is read by the {entry.name!r} objective: expected "
                             f"{AUTO!r} or {entry.name!r}")
        else:
            entry.check_idle(config, problems)
    try:
        planned = running.plan(config, context)
    except ConfigError as exc:  # (with the others' problems: one report)
        problems.add(exc)
    problems.raise_all()
    return planned
