"""TorchTitan's TOML-era keys: what each means here.

TorchTitan configured jobs with TOML files from its first releases until February 2026, in three
layouts this table covers (the eras are named in :data:`ERAS`). Every key those layouts define is
listed in :data:`TORCHTITAN_KEYS` as one of:

- ``alias``: the same setting under another name (or in another section); it is read as our key,
  with one ``note:`` line naming the new one (``value`` converts a value where the spelling
  differs, e.g. ``optimizer.fused = true`` → ``optimizer.implementation = "fused"``);
- ``off``: a setting of a feature torchtitan_lite does not have, accepted while it asks for the
  feature to be off or for something that changes nothing here (``tensor_parallel_degree = 1``,
  ``enable_async_tensor_parallel = false``, empty pipeline split points); any other
  value is one error line saying which feature it asks for;
- keys spelled as ours with the same meaning are not listed (the schema is the table for those).

This module imports nothing of the package but its errors. ``docs/migrating_from_torchtitan.md``
is generated from this table (:func:`migration_markdown`; a test keeps the two equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torchtitan_lite.errors import ConfigError

__all__ = [
    "ERAS",
    "TORCHTITAN_KEYS",
    "TorchTitanKey",
    "LACKING_VALUES",
    "VALUE_ALIASES",
    "lookup",
    "migration_markdown",
    "translate",
]

ERAS: dict[str, str] = {
    "2025-02": "before v0.1.0 (early 2025: `training.batch_size`, `[experimental]`, `[float8]`)",
    "v0.1.0": "v0.1.0 (June 2025: `[parallelism]`, `[lr_scheduler]`, `lr_min`)",
    "2026-02": "the last TOML layout (v0.2.x, until February 2026: `hf_assets_path`, `[quantize]`, `[validation]`)",
}


def _any(_: Any) -> bool:
    return True


ANY = _any
"""The ``neutral`` of a key accepted whatever its value."""


def _in(*values: Any) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        return value in values

    check.values = values
    return check


def _empty(value: Any) -> bool:
    return value in (None, "", [], ())


@dataclass(frozen=True)
class TorchTitanKey:
    """One TorchTitan key and what it means here."""

    name: str
    """TorchTitan's dotted name (``section.key``; ``quantize.linear.float8.emulate`` for nested tables)."""
    type: Any
    """The value's type in TorchTitan (how a command-line string is read)."""
    eras: tuple[str, ...]
    """The layouts that define it (keys of :data:`ERAS`)."""
    kind: Literal["alias", "off"]
    target: str | None = None
    """``alias``: our key."""
    value: Callable[[Any], Any] | None = None
    """``alias``: converts TorchTitan's value to ours (may raise :class:`ConfigError`)."""
    neutral: Callable[[Any], bool] = _any
    """``off``: the values that ask for nothing here."""
    feature: str = ""
    """``off``: what another value asks for (the error says it is not available)."""
    remark: str = ""
    """Shown in the migration table."""
    differs: str = ""
    """``alias``: how the meaning differs from TorchTitan's (in the note and the table)."""

    @property
    def neutral_text(self) -> str:
        if self.neutral is _any:
            return "any value"
        if self.neutral is _empty:
            return "unset / empty"
        values = getattr(self.neutral, "values", ())
        return " or ".join(_toml(v) for v in values)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if value is None:
        return "unset"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


def _alias(name: str, tp: Any, eras: tuple[str, ...], target: str, *, value: Callable[[Any], Any] | None = None,
           remark: str = "", differs: str = "") -> TorchTitanKey:
    return TorchTitanKey(name, tp, eras, "alias", target=target, value=value, remark=remark, differs=differs)


def _off(name: str, tp: Any, eras: tuple[str, ...], neutral: Callable[[Any], bool], feature: str,
         remark: str = "") -> TorchTitanKey:
    return TorchTitanKey(name, tp, eras, "off", neutral=neutral, feature=feature, remark=remark)


# Value conversions of aliases.

def _fused(value: bool) -> str:
    return "fused" if value else "foreach"


def _rotated(value: str) -> str:
    # TorchTitan's ring rotations (allgather, alltoall) compute what our allgather method does.
    return "allgather"


def _seed(value: int | None) -> int:
    # TorchTitan's unset seed leaves weights and data order unseeded; every run here is seeded.
    return 42 if value is None else value


E, V, L = "2025-02", "v0.1.0", "2026-02"
EV, VL, EVL = (E, V), (V, L), (E, V, L)

_PP = "pipeline parallelism"
_CP = "context parallelism"
_EP = "expert parallelism (mixture-of-experts models)"
_FT = "TorchFT fault tolerance (replica groups that survive the loss of a replica)"

TORCHTITAN_KEYS: tuple[TorchTitanKey, ...] = (
    # [job]
    _alias("job.print_args", bool, EV, "job.print_config"),
    _off("job.use_for_integration_test", bool, EV, _any, "",
         "marks a config for TorchTitan's own CI; changes nothing in a job"),
    _off("job.save_config_file", str | None, (L,), _empty,
         "writing the resolved config to a file (every checkpoint here records the run's settings; "
         "job.print_config logs them)"),
    _off("job.custom_config_module", str, (L,), _empty, "custom config modules (extra config sections in Python)"),
    # [metrics]
    _off("metrics.save_for_all_ranks", bool, VL, _in(False), "metrics files of every rank (rank 0 writes them)"),
    _off("metrics.rank_0_only", bool, (E,), _in(True), "metrics files of every rank (rank 0 writes them)"),
    # [model]
    _alias("model.hf_assets_path", str, (L,), "model.tokenizer_path",
           remark="the folder's tokenizer.json (+ tokenizer_config.json); with checkpoint.initial_load_in_hf "
                  "and no checkpoint.initial_load_path, also the Hugging Face weights to start from"),
    _off("model.norm_type", str, (E,), _in("rmsnorm"), "a norm other than RMSNorm"),
    _off("model.print_after_conversion", bool, VL, _in(False),
         "printing the model after converters (the start-up log counts the layers converted to float8)"),
    # [optimizer]
    _alias("optimizer.fused", bool, (E,), "optimizer.implementation", value=_fused,
           remark='true → "fused", false → "foreach"'),
    _off("optimizer.early_step_in_backward", bool, EVL, _in(False),
         "the optimizer step inside backward (freeing each gradient as it is produced)"),
    # [lr_scheduler]
    _alias("lr_scheduler.lr_min", float, (V,), "lr_scheduler.min_lr_factor",
           remark="a fraction of optimizer.lr, as in TorchTitan"),
    # [training]
    _alias("training.batch_size", int, (E,), "training.local_batch_size"),
    _alias("training.warmup_steps", int, (E,), "lr_scheduler.warmup_steps",
           differs="TorchTitan before v0.1.0 warmed up as (step + 1) / (warmup + 1), reaching the peak one step "
                   "later; the decay after it is the same"),
    _alias("training.data_parallel_replicate_degree", int, (E,), "parallelism.data_parallel_replicate_degree"),
    _alias("training.data_parallel_shard_degree", int, (E,), "parallelism.data_parallel_shard_degree"),
    _alias("training.fsdp_reshard_after_forward", str, (E,), "parallelism.reshard_after_forward_mode"),
    _alias("training.tensor_parallel_degree", int, (E,), "parallelism.tensor_parallel_degree"),
    _alias("training.disable_loss_parallel", bool, (E,), "parallelism.disable_loss_parallel"),
    _alias("training.compile", bool, EV, "compile.enable"),
    _alias("training.seed", int | None, EV, "debug.seed", value=_seed,
           differs="unset means seed 42 here (TorchTitan left such runs unseeded)"),
    _alias("training.deterministic", bool, EV, "debug.deterministic"),
    _off("training.gc_debug", bool, VL, _in(False), "garbage-collection debugging (a full collection every step)"),
    _off("training.dtype", str, (L,), _in("float32"),
         "training without float32 master weights (training.mixed_precision_param = bfloat16 computes in "
         "bfloat16 with float32 shards)"),
    _off("training.dataloader.num_workers", int, (L,), _in(0), "data-loader worker processes"),
    _off("training.dataloader.persistent_workers", bool, (L,), _any, "",
         "used only with data-loader worker processes"),
    _off("training.dataloader.pin_memory", bool, (L,), _in(False), "pinned host memory for batches"),
    _off("training.dataloader.prefetch_factor", int | None, (L,), _any, "",
         "used only with data-loader worker processes"),
    # [parallelism]
    _alias("parallelism.fsdp_reshard_after_forward", str, VL, "parallelism.reshard_after_forward_mode"),
    _off("parallelism.pipeline_parallel_split_points", list[str], (V,), _empty,
         "pipeline split points by module name (parallelism.pipeline_parallel_layers_per_stage and "
         "first/last_stage_less_layers split the model here)"),
    _off("parallelism.pipeline_parallel_schedule_csv", str, VL, _empty, "pipeline schedules read from a CSV file"),
    _off("parallelism.module_fqns_per_model_part", list[list[str]] | None, (L,), _empty,
         "pipeline stages named module by module (parallelism.pipeline_parallel_layers_per_stage and "
         "first/last_stage_less_layers split the model here)"),
    _off("parallelism.pipeline_parallel_expert_parallel_overlap", bool, (L,), _any, "", "used only with " + _PP),
    _alias("parallelism.context_parallel_rotate_method", str, VL, "parallelism.context_parallel_method", value=_rotated,
           differs="TorchTitan's ring rotates the keys and values between neighbours; here every rank "
                   "gathers them once (context_parallel_method = 'allgather'): the same attention"),
    _off("parallelism.context_parallel_load_balancer", str | None, (L,), _any, "", "used only with " + _CP),
    _off("parallelism.expert_tensor_parallel_degree", int, (L,), _in(1), _EP),
    _off("parallelism.expert_parallel_comm_backend", str, (L,), _any, "", "used only with " + _EP),
    _off("parallelism.enable_compiled_autograd", bool, (V,), _in(False), "compiled autograd"),
    # [experimental] (before v0.1.0 it held the parallelisms still being built)
    _alias("experimental.pipeline_parallel_degree", int, (E,), "parallelism.pipeline_parallel_degree"),
    _off("experimental.pipeline_parallel_split_points", list[str], (E,), _empty,
         "pipeline split points by module name (parallelism.pipeline_parallel_layers_per_stage and "
         "first/last_stage_less_layers split the model here)"),
    _alias("experimental.pipeline_parallel_schedule", str, (E,), "parallelism.pipeline_parallel_schedule"),
    _off("experimental.pipeline_parallel_schedule_csv", str, (E,), _empty, "pipeline schedules read from a CSV file"),
    _off("experimental.pipeline_parallel_microbatches", int | None, (E,), _empty,
         "a pipeline micro-batch count (parallelism.pipeline_parallel_microbatch_size sets their rows here)"),
    _alias("experimental.context_parallel_degree", int, (E,), "parallelism.context_parallel_degree"),
    _alias("experimental.context_parallel_rotate_method", str, (E,), "parallelism.context_parallel_method",
           value=_rotated,
           differs="TorchTitan's ring rotates the keys and values between neighbours; here every rank "
                   "gathers them once (context_parallel_method = 'allgather'): the same attention"),
    _alias("experimental.enable_async_tensor_parallel", bool, (E,), "parallelism.enable_async_tensor_parallel"),
    _off("experimental.enable_compiled_autograd", bool, (E,), _in(False), "compiled autograd"),
    _off("experimental.custom_model_path", str, (E,), _empty, "custom model modules (register a family in "
         "torchtitan_lite.models instead)"),
    _off("experimental.custom_import", str, VL, _empty, "custom import modules"),
    _off("experimental.custom_args_module", str, VL, _empty, "custom config modules (extra config sections in Python)"),
    # [checkpoint]
    _alias("checkpoint.enable_checkpoint", bool, EV, "checkpoint.enable"),
    _off("checkpoint.interval_type", str, (E,), _in("steps"), "checkpoint intervals in seconds"),
    _alias("checkpoint.model_weights_only", bool, (E,), "checkpoint.last_save_model_only"),
    _alias("checkpoint.last_save_model_weights_only", bool, (V,), "checkpoint.last_save_model_only"),
    _alias("checkpoint.initial_load_model_weights_only", bool, (V,), "checkpoint.initial_load_model_only"),
    _off("checkpoint.initial_load_in_hf_quantized", bool, (L,), _in(False),
         "loading quantized Hugging Face checkpoints"),
    _off("checkpoint.enable_first_step_checkpoint", bool, (L,), _in(False), "a checkpoint after the first step"),
    _off("checkpoint.load_only", bool, (L,), _in(False), "loading a checkpoint without ever saving one"),
    _off("checkpoint.enable_ft_dataloader_checkpoints", bool, (L,), _any, "", "used only with " + _FT),
    # [activation_checkpoint]
    _off("activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns", list[str], (L,), _any, "",
         "names mixture-of-experts router matmuls; the models here have none"),
    _off("activation_checkpoint.early_stop", bool, (L,), _in(False), "early-stopping recomputation"),
    _off("activation_checkpoint.memory_budget", float, (L,), _any, "",
         'used only with activation_checkpoint.mode = "memory_budget" (here: parallelism.reshard_after_forward_mode '
         '= "auto" with parallelism.memory_budget_gib)'),
    _off("activation_checkpoint.visualize_memory_budget_pareto", bool, (L,), _in(False),
         'the memory-budget Pareto plot (mode = "memory_budget")'),
    _off("activation_checkpoint.preserve_rng_state", bool, (L,), _any, "",
         "the models here have no dropout, so recomputation draws no random numbers"),
    _off("activation_checkpoint.determinism_check", str, (L,), _in("default"),
         "other recomputation determinism checks"),
    _off("activation_checkpoint.debug", bool, (L,), _in(False), "activation-checkpoint debug logging"),
    # float8: [float8] of 2025 is ours; the later [quantize.linear.float8] names the same options.
    *(_off(f"mx.{k}", tp, (V,), _any, "", "used only with MX converters (model.converters)")
      for k, tp in (("use_fp8_dim1_cast_triton_kernel", bool), ("recipe_name", str), ("filter_fqns", list[str]))),
    *(_alias(f"quantize.linear.float8.{k}", tp, (L,), f"float8.{k}")
      for k, tp in (("enable_fsdp_float8_all_gather", bool), ("precompute_float8_dynamic_scale_for_fsdp", bool),
                    ("recipe_name", str | None), ("filter_fqns", list[str]), ("emulate", bool))),
    *(_off(f"quantize.linear.mx.{k}", tp, (L,), _any, "", "used only with MX converters (model.converters)")
      for k, tp in (("mxfp8_dim1_cast_kernel_choice", str), ("recipe_name", str), ("filter_fqns", list[str]))),
    _off("quantize.grouped_mm.float8.fqns", list[str], (L,), _any, "", "used only with mixture-of-experts converters"),
    _off("quantize.grouped_mm.mx.recipe_name", str, (L,), _any, "", "used only with mixture-of-experts converters"),
    _off("quantize.grouped_mm.mx.fqns", list[str], (L,), _any, "", "used only with mixture-of-experts converters"),
    # [comm]
    _off("comm.trace_buf_size", int, EVL, _any, "",
         "sizes NCCL's flight recorder; set TORCH_NCCL_TRACE_BUFFER_SIZE in the environment for that"),
    _off("comm.save_traces_folder", str, (L,), _any, "", "folder of NCCL flight-recorder dumps (see trace_buf_size)"),
    _off("comm.save_traces_file_prefix", str, (L,), _any, "", "file prefix of NCCL flight-recorder dumps"),
    _off("comm.mode", str, (L,), _in("default"), "fake or local-tensor communication backends (dry runs)"),
    # [memory_estimation]
    _off("memory_estimation.enabled", bool, EV, _in(False),
         "estimating memory inside the job (run python -m torchtitan_lite.memory --job.config_file FILE instead)"),
    _off("memory_estimation.enable", bool, (L,), _in(False),
         "estimating memory inside the job (run python -m torchtitan_lite.memory --job.config_file FILE instead)"),
    _off("memory_estimation.disable_fake_mode", bool, EVL, _any, "", "used only with memory_estimation.enable"),
    # [fault_tolerance]
    _off("fault_tolerance.enable", bool, VL, _in(False), _FT),
    *(_off(f"fault_tolerance.{k}", tp, eras, _any, "", "used only with " + _FT)
      for k, tp, eras in (("replica_id", int, VL), ("group_size", int, VL), ("min_replica_size", int, VL),
                          ("semi_sync_method", str | None, VL), ("sync_steps", int, (V,)),
                          ("should_quantize", bool, (V,)), ("fragment_sync_delay", int, (V,)),
                          ("fragment_update_alpha", float, (V,)), ("process_group", str, (L,)),
                          ("process_group_timeout_ms", int, (L,)))),
    # [validation]
    _off("validation.dataloader.num_workers", int, (L,), _in(0), "data-loader worker processes"),
    _off("validation.dataloader.persistent_workers", bool, (L,), _any, "",
         "used only with data-loader worker processes"),
    _off("validation.dataloader.pin_memory", bool, (L,), _in(False), "pinned host memory for batches"),
    _off("validation.dataloader.prefetch_factor", int | None, (L,), _any, "",
         "used only with data-loader worker processes"),
    # [debug]
    _off("debug.deterministic_warn_only", bool, (L,), _in(False),
         "warn-only determinism (debug.deterministic = true raises on non-deterministic ops)"),
    _off("debug.moe_force_load_balance", bool, (L,), _any, "", "used only with mixture-of-experts models"),
)

VALUE_ALIASES: dict[tuple[str, Any], tuple[Any, str]] = {
    # (our key, TorchTitan's value) -> (our value, what differs)
    ("checkpoint.async_mode", "async_with_pinned_mem"): (
        "async", "the state is staged in ordinary host memory (pinned staging is a CUDA-only speed-up)"),
}
"""Values of keys we share that TorchTitan spelled otherwise."""

LACKING_VALUES: dict[tuple[str, Any], str] = {
    # (our key, TorchTitan's value) -> the feature it asks for, and what does the job here
    ("activation_checkpoint.mode", "memory_budget"): (
        "activation checkpointing under a memory budget (here parallelism.reshard_after_forward_mode = "
        '"auto" with parallelism.memory_budget_gib chooses recomputation and resharding per block)'),
    **{("model.converters", name): "MX (microscaling) low-precision training (float8 is available: "
                                    'model.converters = ["float8"])'
       for name in ("mx", "quantize.linear.mx")},
    **{("model.converters", name): "float8 grouped matmuls of mixture-of-experts models"
       for name in ("quantize.grouped_mm.float8", "quantize.grouped_mm.mx")},
}
"""Values of keys we share that ask for a feature of TorchTitan's we lack."""

_BY_NAME: dict[str, TorchTitanKey] = {k.name: k for k in TORCHTITAN_KEYS}
assert len(_BY_NAME) == len(TORCHTITAN_KEYS), "a TorchTitan key is listed twice"

def lookup(name: str) -> TorchTitanKey | None:
    """The table's entry for TorchTitan's dotted key ``name``, if it has one."""
    return _BY_NAME.get(name)


def translate(entry: TorchTitanKey, value: Any) -> tuple[str, Any] | None:
    """Our ``(key, value)`` for TorchTitan's ``entry`` set to ``value`` (already of its type), or
    None when it asks for nothing here; :class:`ConfigError` when it asks for a feature we lack."""
    if entry.kind == "alias":
        assert entry.target is not None
        return entry.target, entry.value(value) if entry.value is not None else value
    if entry.neutral(value):
        return None
    raise ConfigError(
        f"{entry.name} = {_toml(value)} asks for {entry.feature}, which torchtitan_lite does not have; "
        f"accepted: {entry.neutral_text} (or leave the key out)"
    )


def migration_markdown() -> str:
    """The key table of ``docs/migrating_from_torchtitan.md`` (generated from :data:`TORCHTITAN_KEYS`)."""
    lines = [
        "| TorchTitan key | layouts | here | accepted as it is | notes |",
        "|---|---|---|---|---|",
    ]
    for entry in sorted(TORCHTITAN_KEYS, key=lambda k: k.name):
        eras = ", ".join(entry.eras)
        if entry.kind == "alias":
            here, accepted = f"`{entry.target}`", "any value"
            if entry.differs:
                here += f" (differs: {entry.differs})"
        else:
            here = "no effect here" if not entry.feature else f"not available: {entry.feature}"
            accepted = entry.neutral_text
        lines.append(f"| `{entry.name}` | {eras} | {here} | {accepted} | {entry.remark} |")
    lines += ["", "Values of shared keys that TorchTitan spells otherwise:", "",
              "| key | TorchTitan's value | read as | notes |", "|---|---|---|---|"]
    for (key, theirs), (ours, differs) in sorted(VALUE_ALIASES.items()):
        lines.append(f"| `{key}` | {_toml(theirs)} | {_toml(ours)} | {differs} |")
    for (key, theirs), feature in sorted(LACKING_VALUES.items()):
        lines.append(f"| `{key}` | {_toml(theirs)} | not available | {feature} |")
    return "\n".join(lines) + "\n"
