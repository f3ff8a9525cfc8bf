"""The process's life around a job: the worker that ends with its launcher (:mod:`.launcher_watch`),
the dump folder's lock (:mod:`.dump_lock`) and the stop signals a job saves on (:mod:`.stop_signals`).
``python -m torchtitan_lite.launch`` (torchrun's agent with the job's exit codes) is the entry point
beside ``python -m torchtitan_lite.train``."""
