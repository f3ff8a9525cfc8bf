"""From a job's config to its data: the sources it names, checked before any process group, and
:func:`build_data`, the training loader and the validation sets.

A job names its training data either as one ``training.dataset`` (with ``dataset_path``) or as a
weighted mixture of ``[[training.datasets]]`` tables, and its validation data as one
``validation.dataset`` or several named ``[[validation.datasets]]``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torchtitan_lite.config.schema import JobConfig
from torchtitan_lite.data.loader import BatchLoader, LoaderSource, rank_samples
from torchtitan_lite.data.sources import SourceSpec, check_dataset, open_reader, source_windows
from torchtitan_lite.data.tokenizers import Tokenizer
from torchtitan_lite.data.windows import Documents, PackedWindows, TokenWindows
from torchtitan_lite.errors import DataError, UserError

__all__ = ["DataNeeds", "NamedSource", "build_data", "check_sources", "document_bounds", "training_sources",
           "validation_sources"]


class DataNeeds(Protocol):
    """What the data needs of a job's plan (:class:`~torchtitan_lite.job.JobPlan` has it)."""

    tokenizer: Tokenizer
    global_batch_size: int
    val_global_batch_size: int
    val_seq_len: int

    @property
    def dp_size(self) -> int: ...

    @property
    def rollout_group(self) -> int:
        """Completions per prompt (online RL; 1 otherwise): the loader gives global batch / this prompts."""
        ...


@dataclass(frozen=True)
class NamedSource:
    """A source of the job: its name (None: the one ``training.dataset`` / ``validation.dataset``)."""

    name: str | None
    spec: SourceSpec
    weight: float = 1.0
    max_epochs: int | None = None


def _reading(config: JobConfig) -> dict[str, Any]:
    """How every source of the job is read (the ``training`` keys that apply to all of them)."""
    t = config.training
    return {"text_column": t.dataset_text_column, "token_dtype": t.dataset_token_dtype, "loss_on": t.loss_on,
            "truncate": t.truncate, "chat_template": t.chat_template, "on_bad_row": t.on_bad_row,
            "chat_template_kwargs": tuple(sorted(t.chat_template_kwargs.items())),
            "cache_dir": str(Path(config.job.dump_folder) / t.chat_cache_dir) if t.chat_cache_dir else None,
            "packing": t.packing, "pair_truncation": config.dpo.truncation,
            "pair_packing": config.dpo.packing,
            "max_prompt_length": max(t.seq_len - config.grpo.max_completion_length, 0)}


def training_sources(config: JobConfig) -> list[NamedSource]:
    """The training sources: the ``[[training.datasets]]`` mixture, or the one ``training.dataset``."""
    t = config.training
    common = _reading(config)
    if config.grpo.rollouts_path is not None:  # (given rollouts in place of prompts)
        return [NamedSource(None, SourceSpec("prompts", config.grpo.rollouts_path, section="grpo", rollouts=True,
                                             **common))]
    if not t.datasets:
        return [NamedSource(None, SourceSpec(t.dataset, t.dataset_path, section="training", **common))]
    return [NamedSource(d.name, SourceSpec(d.dataset, d.dataset_path, section=f"training.datasets[{d.name}]", **common),
                        weight=d.weight, max_epochs=d.max_epochs) for d in t.datasets]


def validation_sources(config: JobConfig) -> list[NamedSource]:
    """The validation sets (none when validation is off)."""
    v = config.validation
    if not v.enable:
        return []
    common = _reading(config)
    if not v.datasets:
        return [NamedSource(None, SourceSpec(v.dataset, v.dataset_path, section="validation", **common))]
    return [NamedSource(d.name, SourceSpec(d.dataset, d.dataset_path, section=f"validation.datasets[{d.name}]",
                                           **common)) for d in v.datasets]


def check_sources(config: JobConfig) -> list[UserError]:
    """Every source's cheap checks (kind, path, files, schema); the problems found, one line each."""
    problems: list[UserError] = []
    template = config.training.chat_template
    if template is not None and not Path(template).expanduser().is_file():
        problems.append(DataError(f"training.chat_template: invalid value {template!r}; "
                                  + ("no such file" if not Path(template).expanduser().exists() else "not a file")
                                  + " (the path of a .jinja chat template)"))
    for source in [*training_sources(config), *validation_sources(config)]:
        s = source.spec
        try:
            check_dataset(s.dataset, s.dataset_path, section=s.section, text_column=s.text_column,
                          key=s.key if s.rollouts else None)
        except UserError as exc:  # reported with the others
            problems.append(exc)
    return problems


def build_data(config: JobConfig, plan: DataNeeds, *, dp_rank: int,
               ) -> tuple[BatchLoader, dict[str | None, TokenWindows | PackedWindows]]:
    """The training loader of data-parallel rank ``dp_rank`` and the validation sets by name
    (empty when validation is off). Reads and tokenizes the files (streamed sources: their
    metadata only), so a bad path, an empty source or a tokenizer that does not fit fails here,
    on every rank alike, before any process group; needs none itself."""
    t, v = config.training, config.validation
    # (online RL: the loader gives prompts, a step's global batch / num_generations of them)
    global_batch = plan.global_batch_size // plan.rollout_group
    local_batch = t.local_batch_size if plan.rollout_group == 1 else global_batch // plan.dp_size
    lanes = rank_samples(global_batch, dp_rank=dp_rank, dp_size=plan.dp_size)
    sources = []
    for source in training_sources(config):
        key = () if source.name is None else (zlib.crc32(source.name.encode()),)
        reader = open_reader(source.spec, plan.tokenizer, seq_len=t.seq_len, global_batch_size=global_batch,
                             lanes=lanes, seed=config.debug.seed, shuffle=t.shuffle, shuffle_buffer=t.shuffle_buffer,
                             key=key, name=source.name)
        sources.append(LoaderSource(source.name or source.spec.dataset, reader, weight=source.weight,
                                    max_epochs=source.max_epochs,
                                    where=source.spec.dataset_path or source.spec.dataset))
    loader = BatchLoader(sources, seq_len=t.seq_len, global_batch_size=global_batch,
                         local_batch_size=local_batch, dp_rank=dp_rank, dp_size=plan.dp_size,
                         named=bool(t.datasets), allow_mixture_change=t.allow_mixture_change,
                         documents=document_bounds(config, plan.tokenizer),
                         epoch_log_steps=max(10, config.metrics.log_freq))
    max_tokens = None if v.steps == -1 else v.steps * plan.val_global_batch_size * (plan.val_seq_len + 1)
    validation = {}
    for source in validation_sources(config):
        s = source.spec
        validation[source.name] = source_windows(
            s, plan.tokenizer, seq_len=plan.val_seq_len, max_tokens=max_tokens,
            seq_len_key="validation.seq_len" if v.seq_len > 0 else "training.seq_len",
            source=f"validation dataset {s.dataset_path or s.dataset!r}" if source.name is None
            else f"{s.section} {s.where}")
    return loader, validation


def document_bounds(config: JobConfig, tokenizer: Tokenizer) -> Documents | None:
    """Where plain windows' documents begin and end (the tokenizer's BOS/EOS) when attention is
    block-causal (``model.attention_mask``); None for causal attention."""
    return (tokenizer.bos_id, tokenizer.eos_id) if config.model.attention_mask == "block_causal" else None
