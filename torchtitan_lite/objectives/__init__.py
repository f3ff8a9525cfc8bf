"""What a training step optimises, one module per objective and one registry
(:mod:`.registry`): the token loss (:mod:`.token`), preference tuning with DPO
(:mod:`.preference`), the GRPO family (:mod:`.grpo`), and the frozen reference they share
(:mod:`.reference`). Each entry owns its checks, its build, its console line and its step's shape;
the trainer, the plan, validation, the metrics and the estimator ask it."""

from torchtitan_lite.objectives import grpo, preference, token  # noqa: F401  (each registers its entry)
from torchtitan_lite.objectives.base import Objective, StatefulObjective, StepResult
from torchtitan_lite.objectives.registry import (
    AUTO,
    OBJECTIVES,
    ObjectiveEntry,
    ObjectiveParts,
    ObjectivePlan,
    PlanContext,
    objective_for,
    plan_objective,
    register,
)

__all__ = ["AUTO", "OBJECTIVES", "Objective", "ObjectiveEntry", "ObjectiveParts", "ObjectivePlan", "PlanContext",
           "StatefulObjective", "StepResult", "objective_for", "plan_objective", "register"]
