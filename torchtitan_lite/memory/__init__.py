"""Memory of a training step: measured on real steps (:mod:`.measure`), estimated before a run on
fake tensors (:mod:`.estimate`), the ``auto`` reshard planner (:mod:`.auto`) and the
``python -m torchtitan_lite.memory`` command line (:mod:`.cli`). Nothing here is imported by
the trainer unless ``reshard_after_forward_mode = "auto"``."""
