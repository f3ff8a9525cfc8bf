"""What the framework needs to know of a model family: :class:`ModelSpec`.

A family (``models/<family>/``) registers one spec in :mod:`torchtitan_lite.models`; everything
outside the family's folder (trainer, checkpoints, Hugging Face I/O, memory estimator, converter)
reaches the model only through it. A model built from a spec:

- is built from its args (``model_cls(args)``), on any device, the meta device included; the
  args are a frozen dataclass with ``vocab_size`` and ``max_seq_len`` fields and the methods
  ``num_params()``, ``flops_per_token(seq_len)`` and ``attention_flops_per_token(seq_len)``;
- keeps its args as ``model.args``;
- maps tokens ``(batch, seq)`` to logits ``(batch, seq, vocab)``;
- fills every parameter and buffer with ``init_weights(buffer_device=...)`` (parameters through
  the shard-aware :mod:`torchtitan_lite.models.init`, so the weights do not depend on sharding)
  and rebuilds only its non-persistent buffers with ``init_buffers(buffer_device)`` (after a
  load).

Model code never imports FSDP, activation checkpointing or compile: the spec names the modules
that are sharded together (:meth:`ModelSpec.fsdp_units`) and, where the family splits its layers
over other mesh dimensions, its own parallelize steps; ``torchtitan_lite.distributed`` does the
rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["DecoderArgs", "FSDPLayout", "HFAdapter", "ModelSpec"]


class DecoderArgs:
    """What every family's args (a frozen dataclass deriving from this) declare, so that the rest
    of the package reads them without asking whether a family has them: a dense family has no
    experts, and unless it says otherwise its output layer is its own."""

    num_experts: int = 0
    """Routed experts of the mixture-of-experts layers; 0: a dense model."""
    tie_word_embeddings: bool = False
    """The output projection is the token embedding's weight (one parameter)."""


class FSDPLayout(dict):
    """The keyword arguments of :func:`torchtitan_lite.distributed.fsdp.apply_fsdp` that name a
    model's units: ``first_unit`` (runs before the blocks), ``blocks`` and ``last_unit`` (runs
    after them); each a module or a list of modules sharded as one unit."""


class HFAdapter(Protocol):
    """A family's Hugging Face names, row layouts and ``config.json`` (see
    :mod:`torchtitan_lite.checkpoint.hf_storage`, which does the file work). Our decoder
    families configure one class for it: :class:`~torchtitan_lite.models.decoder_hf.DecoderHFAdapter`."""

    architectures: tuple[str, ...]
    model_type: str
    output_name: str
    embedding_name: str

    def to_hf_name(self, name: str) -> str: ...
    def from_hf_name(self, hf_name: str) -> str: ...
    def hf_names(self, name: str, args: Any) -> list[str]: ...
    def from_hf_part(self, hf_name: str) -> tuple[str, int | None]: ...
    def ignored(self, hf_name: str, args: Any = None) -> bool: ...
    def expected_shapes(self, args: Any) -> dict[str, tuple[int, ...]]: ...
    def row_permutation(self, name: str, args: Any, *, to_hf: bool) -> torch.Tensor | None: ...
    def config_for(self, args: Any, dtype: torch.dtype) -> dict[str, Any]: ...
    def config_mismatch(self, config: Mapping[str, Any], args: Any) -> str | None: ...
    def args_from_config(self, config: Mapping[str, Any], **overrides: Any) -> Any: ...


@dataclass(frozen=True)
class ModelSpec:
    """One model family: its class, named shapes, FSDP units and Hugging Face adapter."""

    name: str
    """``model.name`` of the family."""
    model_cls: Callable[[Any], nn.Module]
    """Builds the model from its args."""
    args_cls: type
    """The args dataclass (a checkpoint's ``model_args`` are read back through it)."""
    flavors: Mapping[str, Any]
    """``model.flavor`` → args."""
    fsdp_units: Callable[[nn.Module], FSDPLayout]
    """The units :func:`~torchtitan_lite.distributed.fsdp.apply_fsdp` shards, for a built model."""
    hf: HFAdapter | None = None
    """Hugging Face import/export, when the family has it."""
    parallel_dims: frozenset[str] = frozenset()
    """The mesh dimensions beyond data parallel (``"tp"``, ``"cp"``, ``"ep"``) the family's models
    can be split over (expert parallel splits the experts of any MoE layer); a job asking for a
    degree above 1 of any other is refused."""
    tensor_parallel: Callable[..., None] | None = None
    """With ``"tp"`` in :attr:`parallel_dims`: the family's split of a model over the
    tensor-parallel mesh, ``(model, tp_mesh, *, loss_parallel) -> None``, run where
    :func:`torchtitan_lite.distributed.parallelize.parallelize` splits layers; None: our decoders'
    plan (:func:`torchtitan_lite.distributed.tensor_parallel.apply_decoder_tensor_parallel`)."""

    def model_args(self, flavor: str, *, vocab_size: int | None = None) -> Any:
        """The args of ``flavor``, with ``vocab_size`` when given (``KeyError`` for an unknown
        flavor: :func:`torchtitan_lite.job.plan_job` checks the name first)."""
        args = self.flavors[flavor]
        return args if vocab_size is None else dataclasses.replace(args, vocab_size=vocab_size)

    def meta_model(self, args: Any) -> nn.Module:
        """The model of ``args`` built on the meta device (shapes only, no memory)."""
        with torch.device("meta"):
            return self.model_cls(args)

    def args_from_dict(self, values: Mapping[str, Any]) -> Any:
        """Args from a dict of their fields (a checkpoint's ``model_args``); unknown keys are
        ignored, a bad shape raises ``ValueError``/``TypeError``."""
        known = {f.name for f in dataclasses.fields(self.args_cls)}
        return self.args_cls(**{k: v for k, v in values.items() if k in known})
