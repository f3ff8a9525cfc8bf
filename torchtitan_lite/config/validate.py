"""Every check of a config that needs nothing but the config itself (:func:`validate_config`):
types and enums, ranges, the rules between values, the data sources' tables; one line per
problem, all at once."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from typing import Any

from torchtitan_lite.config.sections import (
    LOADABLE_PARTS,
    RESHARD_MODES,
    JobConfig,
    Training,
    Validation,
    every_nth_block,
    float8_recipe_problem,
    lora_settings_problem,
)
from torchtitan_lite.config.types import SECTIONS, coerce, field_types
from torchtitan_lite.errors import ConfigError, Problems

__all__ = ["CHAT_TEMPLATE_RESERVED", "objective_ranges", "unrelated", "validate_config"]


# --------------------------------------------------------------------------------------------
# Validation (the config alone: no files, no world size, no model family)
# --------------------------------------------------------------------------------------------


def _check_sources(c: JobConfig, problems: list[str], given: Collection[str]) -> None:
    """``[[training.datasets]]`` and ``[[validation.datasets]]``: names, kinds, weights, epochs;
    refused beside ``dataset`` when that was given (whatever its value) or differs from its default."""
    for section, default in (("training", Training()), ("validation", Validation())):
        sec = getattr(c, section)
        if not sec.datasets:
            continue
        if sec.dataset != default.dataset or f"{section}.dataset" in given or sec.dataset_path is not None:
            problems.append(f"{section}.dataset: {sec.dataset!r} is set together with [[{section}.datasets]]; "
                            f"keep one (the tables, or {section}.dataset and {section}.dataset_path)")
        seen: set[str] = set()
        for i, src in enumerate(sec.datasets):
            where = f"{section}.datasets[{src.name or i}]"
            if not src.name:
                problems.append(f"{where}.name: missing; every [[{section}.datasets]] table needs a unique name")
            elif src.name in seen:
                problems.append(f"{where}.name: duplicate name {src.name!r}; names must be unique")
            elif not all(ch.isalnum() or ch in "_-." for ch in src.name):
                problems.append(f"{where}.name: invalid value {src.name!r}; expected letters, digits, _, - or . "
                                "(it becomes a metric name)")
            seen.add(src.name)
            if not src.dataset:
                problems.append(f"{where}.dataset: missing; expected a source kind, as training.dataset takes")
            if section == "training":
                if not (math.isfinite(src.weight) and src.weight > 0):
                    problems.append(f"{where}.weight: invalid value {src.weight!r}; expected a finite number > 0")
                if src.max_epochs is not None and src.max_epochs < 1:
                    problems.append(f"{where}.max_epochs: invalid value {src.max_epochs!r}; expected an integer "
                                    ">= 1, or unset")
            elif src.weight != 1.0 or src.max_epochs is not None:
                problems.append(f"{where}: weight and max_epochs have no effect on a validation set; remove them")


CHAT_TEMPLATE_RESERVED = ("messages", "tools", "documents", "add_generation_prompt")
"""The chat template's variables the renderer sets for every row (never from chat_template_kwargs)."""


def validate_config(c: JobConfig, *, given: Collection[str] = ()) -> None:
    """Raise :class:`ConfigError` for every value or combination that is not allowed: one line
    each, naming the key. Reads the config only; never changes it. ``given``: the keys
    (``section.key``) a file or the command line set, which count as set even at their default."""
    check = Problems()
    problems, _require = check.lines, check.require

    # Types and enums already ran on load; run them again for configs built in code. A value of
    # the wrong type is reported, and the rules below (which compare values of the right types)
    # run on a copy that has the default in its place; what they say of such a key is left out.
    wrong: list[str] = []
    for section, cls in SECTIONS.items():
        sec = getattr(c, section)
        for name, tp in field_types(cls).items():
            try:
                coerce(f"{section}.{name}", getattr(sec, name), tp, from_cli=False)
            except ConfigError as exc:
                problems.append(str(exc))
                wrong.append(f"{section}.{name}")
    if wrong:
        c = dataclasses.replace(c, **{section: dataclasses.replace(
            getattr(c, section), **{k.split(".", 1)[1]: _default(SECTIONS[section], k.split(".", 1)[1])
                                    for k in wrong if k.startswith(f"{section}.")})
            for section in {k.split(".", 1)[0] for k in wrong}})
    typed = len(problems)

    o = c.optimizer
    _require(math.isfinite(o.lr) and o.lr > 0, "optimizer.lr", o.lr, "expected a finite number > 0")
    _require(0 <= o.beta1 < 1, "optimizer.beta1", o.beta1, "expected 0 <= beta1 < 1")
    _require(0 <= o.beta2 < 1, "optimizer.beta2", o.beta2, "expected 0 <= beta2 < 1")
    _require(math.isfinite(o.eps) and o.eps > 0, "optimizer.eps", o.eps, "expected a finite number > 0")
    _require(math.isfinite(o.weight_decay) and o.weight_decay >= 0, "optimizer.weight_decay",
             o.weight_decay, "expected a finite number >= 0")

    s = c.lr_scheduler
    _require(s.warmup_steps >= 0, "lr_scheduler.warmup_steps", s.warmup_steps, "expected an integer >= 0")
    if s.decay_ratio is not None:
        _require(0 <= s.decay_ratio <= 1, "lr_scheduler.decay_ratio", s.decay_ratio,
                 "expected a number in [0, 1] or unset")
    _require(0 <= s.min_lr_factor <= 1, "lr_scheduler.min_lr_factor", s.min_lr_factor,
             "expected a number in [0, 1]")
    _require(s.total_steps is None or s.total_steps >= c.training.steps, "lr_scheduler.total_steps", s.total_steps,
             f"expected at least training.steps = {c.training.steps} (the schedule of a longer run), or unset")

    e = c.moe
    for key, value in (("aux_loss_coef", e.aux_loss_coef), ("z_loss_coef", e.z_loss_coef),
                       ("bias_update_rate", e.bias_update_rate)):
        _require(value is None or (math.isfinite(value) and value >= 0), f"moe.{key}", value,
                 "expected a finite number >= 0" + (" or unset" if key == "aux_loss_coef" else ""))
    _require(e.top_k >= 0, "moe.top_k", e.top_k, "expected 0 (the model's) or an integer >= 1")

    t = c.training
    _require(t.local_batch_size >= 1, "training.local_batch_size", t.local_batch_size, "expected an integer >= 1")
    _require(t.global_batch_size == -1 or t.global_batch_size >= 1, "training.global_batch_size",
             t.global_batch_size, "expected an integer >= 1, or -1")
    _require(t.seq_len >= 1, "training.seq_len", t.seq_len, "expected an integer >= 1")
    _require(math.isfinite(t.max_norm) and t.max_norm >= 0, "training.max_norm", t.max_norm,
             "expected a finite number >= 0 (0 disables clipping)")
    _require(t.steps >= 1, "training.steps", t.steps, "expected an integer >= 1")
    _require(t.gc_freq >= 1, "training.gc_freq", t.gc_freq, "expected an integer >= 1")
    _require(t.max_rollbacks >= 0, "training.max_rollbacks", t.max_rollbacks, "expected an integer >= 0")
    _require(t.on_nonfinite != "rollback" or c.checkpoint.enable, "training.on_nonfinite", t.on_nonfinite,
             "rollback reloads this run's checkpoints: set checkpoint.enable = true too")
    _require(c.model.vocab_size == -1 or c.model.vocab_size >= 1, "model.vocab_size", c.model.vocab_size,
             "expected an integer >= 1, or -1 (follow the tokenizer)")
    _check_sources(c, problems, given)
    _require(t.shuffle_buffer >= 1, "training.shuffle_buffer", t.shuffle_buffer, "expected an integer >= 1")
    v = c.validation
    if v.enable:
        _require(v.freq >= 1, "validation.freq", v.freq, "expected an integer >= 1")
        _require(v.steps == -1 or v.steps >= 1, "validation.steps", v.steps, "expected an integer >= 1, or -1")
        _require(v.global_batch_size == -1 or v.global_batch_size >= 1, "validation.global_batch_size",
                 v.global_batch_size, "expected an integer >= 1, or -1")
        _require(v.local_batch_size == -1 or v.local_batch_size >= 1, "validation.local_batch_size",
                 v.local_batch_size, "expected an integer >= 1, or -1")
        _require(v.seq_len == -1 or v.seq_len >= 1, "validation.seq_len", v.seq_len,
                 "expected an integer >= 1, or -1")

    pr = c.profiling
    if pr.enable_profiling or pr.enable_memory_snapshot:
        _require(pr.profile_freq >= 1, "profiling.profile_freq", pr.profile_freq, "expected an integer >= 1")
    if pr.enable_profiling:
        _require(pr.profiler_active >= 1, "profiling.profiler_active", pr.profiler_active,
                 "expected an integer >= 1")
        _require(pr.profiler_warmup >= 0, "profiling.profiler_warmup", pr.profiler_warmup,
                 "expected an integer >= 0")
        _require(pr.profiler_warmup + pr.profiler_active <= pr.profile_freq, "profiling.profile_freq",
                 pr.profile_freq,
                 f"expected at least profiler_warmup + profiler_active = "
                 f"{pr.profiler_warmup} + {pr.profiler_active}")

    p = c.parallelism  # the reshard mode itself is checked against the shard degree by plan_job
    mode = p.reshard_after_forward_mode
    _require(not isinstance(mode, str) or mode in (*RESHARD_MODES, "auto") or mode.strip().lstrip("-").isdigit(),
             "parallelism.reshard_after_forward_mode", mode,
             f"expected one of {', '.join(RESHARD_MODES)}, auto, or an integer group size")
    if p.memory_budget_gib is not None:
        _require(math.isfinite(p.memory_budget_gib) and p.memory_budget_gib > 0, "parallelism.memory_budget_gib",
                 p.memory_budget_gib, "expected a finite number > 0, or unset")
        _require(mode == "auto", "parallelism.memory_budget_gib", p.memory_budget_gib,
                 f"it is used only with parallelism.reshard_after_forward_mode = 'auto' (this job has "
                 f"{mode!r})")

    _require(p.cpu_offload != "auto" or mode == "auto", "parallelism.cpu_offload", p.cpu_offload,
             f"auto chooses per unit under the memory budget of parallelism.reshard_after_forward_mode = 'auto' "
             f"(this job has {mode!r})")
    _require(not (c.training.enable_cpu_offload and p.cpu_offload == "auto"), "training.enable_cpu_offload", True,
             "expected false with parallelism.cpu_offload = 'auto' (true offloads every unit: "
             "parallelism.cpu_offload = 'all')")

    ac = c.activation_checkpoint
    try:
        every_nth_block(ac.selective_ac_option)
    except ValueError as exc:
        problems.append(str(exc))
    _require(not c.compile.enable or bool(c.compile.components), "compile.components", c.compile.components,
             "expected model, loss or both with compile.enable = true")
    f8 = c.float8
    problem = float8_recipe_problem(f8.recipe_name, f8.enable_fsdp_float8_all_gather)
    if problem:
        problems.append(problem)

    lo = c.lora
    if lo.enable:
        lora_problem = lora_settings_problem(lo.rank, lo.alpha, lo.dropout)
        if lora_problem:
            _require(False, *lora_problem)
        _require(bool(lo.target_modules), "lora.target_modules", lo.target_modules,
                 "expected at least one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj")

    m = c.metrics
    _require(m.log_freq >= 1, "metrics.log_freq", m.log_freq, "expected an integer >= 1")
    if m.peak_tflops is not None:
        _require(math.isfinite(m.peak_tflops) and m.peak_tflops > 0, "metrics.peak_tflops",
                 m.peak_tflops, "expected a finite number > 0, or unset")

    ck = c.checkpoint
    _require(ck.interval >= 1, "checkpoint.interval", ck.interval, "expected an integer >= 1")
    reserved = sorted(set(c.training.chat_template_kwargs) & set(CHAT_TEMPLATE_RESERVED))
    _require(not reserved, "training.chat_template_kwargs", c.training.chat_template_kwargs,
             f"expected a table without {', '.join(reserved)}: the renderer sets "
             f"{', '.join(CHAT_TEMPLATE_RESERVED)} itself")
    _require(ck.max_failed_saves >= 1, "checkpoint.max_failed_saves", ck.max_failed_saves,
             "expected an integer >= 1")
    _require(ck.keep_latest_k >= 0, "checkpoint.keep_latest_k", ck.keep_latest_k,
             "expected an integer >= 0 (0 keeps all)")
    _require(ck.load_step >= -1, "checkpoint.load_step", ck.load_step, "expected an integer >= 0, or -1")
    unknown = sorted(set(ck.exclude_from_loading) - set(LOADABLE_PARTS))
    _require(not unknown, "checkpoint.exclude_from_loading", ck.exclude_from_loading,
             f"expected names among {', '.join(LOADABLE_PARTS)}")
    _require(ck.load_step == -1 or ck.enable, "checkpoint.load_step", ck.load_step,
             "resuming a step needs checkpoint.enable = true")
    _require(not (ck.create_seed_checkpoint and ck.initial_load_path is not None),
             "checkpoint.create_seed_checkpoint", True,
             "a seed checkpoint holds freshly initialised weights: unset checkpoint.initial_load_path")
    _require(not (ck.initial_load_path is not None and "model" in ck.exclude_from_loading
                  and (ck.initial_load_model_only or ck.initial_load_in_hf)),
             "checkpoint.exclude_from_loading", ck.exclude_from_loading,
             "initial_load_path loads only model weights here: 'model' cannot be excluded")
    _require(not ck.initial_load_in_hf or ck.initial_load_path is not None, "checkpoint.initial_load_in_hf",
             True, "expected checkpoint.initial_load_path to name the Hugging Face folder")
    _require(not ck.initial_load_in_hf or ck.initial_load_model_only, "checkpoint.initial_load_model_only",
             False, "a Hugging Face folder holds only weights: expected true with initial_load_in_hf")
    _require(not ck.last_save_in_hf or ck.last_save_model_only, "checkpoint.last_save_in_hf", True,
             "a Hugging Face export holds only weights: expected checkpoint.last_save_model_only = true too")

    for key in ("init_timeout_seconds", "train_timeout_seconds"):
        _require(getattr(c.comm, key) >= 1, f"comm.{key}", getattr(c.comm, key), "expected an integer >= 1")
    _require(0 <= c.debug.seed < 2**63, "debug.seed", c.debug.seed, "expected 0 <= seed < 2**63")
    objective_ranges(c, _require)
    problems[typed:] = unrelated(problems[typed:], wrong)
    if problems:
        raise ConfigError("\n".join(problems))


def unrelated(lines: list[str], keys: Collection[str]) -> list[str]:
    """The ``lines`` that name none of ``keys`` (what a rule said of a key already reported, or of
    one whose bad value was left at its default, is left out)."""
    return [line for line in lines if not any(key in line for key in keys)]


def _default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def objective_ranges(c: JobConfig, require: Any, *, sections: tuple[str, ...] = ("dpo", "grpo")) -> None:
    """The ranges of ``[dpo]`` and ``[grpo]``'s values (``sections``), which need nothing but the
    config (what needs the world size, the batch or LoRA is the objective's plan's, which runs
    these too for a config built in code): ``require(ok, key, value, allowed)`` for each."""
    if "dpo" not in sections:
        return _grpo_ranges(c, require)
    d = c.dpo
    require(d.beta > 0, "dpo.beta", d.beta, "expected a number > 0")
    require(0 <= d.label_smoothing < 0.5, "dpo.label_smoothing", d.label_smoothing, "expected 0 <= value < 0.5")
    require(d.label_smoothing == 0 or d.loss_type == "sigmoid", "dpo.label_smoothing", d.label_smoothing,
            f"conservative DPO is a sigmoid loss (dpo.loss_type is {d.loss_type!r}): expected 0")
    if "grpo" in sections:
        _grpo_ranges(c, require)


def _grpo_ranges(c: JobConfig, require: Any) -> None:
    g = c.grpo
    require(g.num_generations >= 2, "grpo.num_generations", g.num_generations,
            "a group needs at least 2 completions to compare: expected 2 or more")
    require(g.temperature >= 0, "grpo.temperature", g.temperature, "expected a number >= 0 (0: greedy)")
    require(0 < g.top_p <= 1, "grpo.top_p", g.top_p, "expected 0 < top_p <= 1")
    require(g.top_k >= 0, "grpo.top_k", g.top_k, "expected an integer >= 0 (0: off)")
    require(g.epsilon > 0, "grpo.epsilon", g.epsilon, "expected a number > 0")
    require(g.epsilon_high is None or g.epsilon_high > 0, "grpo.epsilon_high", g.epsilon_high,
            "expected a number > 0, or unset (epsilon)")
    require(g.beta >= 0, "grpo.beta", g.beta, "expected a number >= 0 (0: no reference model)")
    require(g.num_iterations >= 1, "grpo.num_iterations", g.num_iterations, "expected an integer >= 1")
    require(g.importance_sampling_max > 0, "grpo.importance_sampling_max", g.importance_sampling_max,
            "expected a number > 0")
    require(g.generation_batch_size >= 0, "grpo.generation_batch_size", g.generation_batch_size,
            "expected an integer >= 0 (0: a step's completions at once)")
    require(not g.reward_weights or len(g.reward_weights) == len(g.reward_functions), "grpo.reward_weights",
            g.reward_weights, f"expected one weight per reward function ({len(g.reward_functions)}), or none")
