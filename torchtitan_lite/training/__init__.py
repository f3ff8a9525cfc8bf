"""A training step's runner: a micro-batch (or rows with a loss of one's own) to the device,
context parallel's share, the pipeline's schedule or the plain forward (:mod:`.runner`). The
objectives that run their micro-batches through it are :mod:`torchtitan_lite.objectives`."""

from torchtitan_lite.training.runner import LossFn, MicroBatch, MicroBatchRunner, RowsLoss

__all__ = ["LossFn", "MicroBatch", "MicroBatchRunner", "RowsLoss"]
