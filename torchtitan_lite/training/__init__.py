"""A training step's parts: the runner of a micro-batch (:mod:`.runner`) and the objectives
that run their micro-batches through it (:mod:`.objectives`; DPO's in :mod:`torchtitan_lite.dpo`)."""

from torchtitan_lite.training.objectives import Objective, StepResult, TokenObjective
from torchtitan_lite.training.runner import LossFn, MicroBatch, MicroBatchRunner

__all__ = ["LossFn", "MicroBatch", "MicroBatchRunner", "Objective", "StepResult", "TokenObjective"]
