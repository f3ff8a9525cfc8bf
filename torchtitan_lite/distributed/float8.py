"""float8 training of a model's blocks through ``torchao``, applied from outside the model code.

:func:`apply_float8` swaps the ``nn.Linear`` layers inside the blocks for torchao's
``Float8Linear``: the weights stay in their dtype (fp32 shards, bf16 under mixed precision) and
are what the optimizer and checkpoints see (``state_dict`` keys unchanged); each matmul casts its
input, weight and output gradient to float8 with a dynamic scale and runs ``torch._scaled_mm``
(tensor cores of CUDA devices of compute capability 8.9 or later: H100, L40, RTX 4090). The
token embedding and the output projection are never converted (the output's logits are where
float8's range hurts most and its matmul is small next to the blocks'), nor is a linear whose
dimensions are not multiples of 16 (a requirement of the float8 matmul) or whose name contains
one of ``filter_fqns``, nor a mixture of experts' router (``router.gate``: its logits are computed
in fp32); the experts' stacked weights are not linears and stay in high precision.

``enable_fsdp_float8_all_gather`` makes FSDP all-gather the blocks' weights as float8 (half the
bytes of bf16) with tensorwise scales; ``precompute_float8_dynamic_scale_for_fsdp`` then
computes those scales for all weights in one reduction after each optimizer step
(:func:`precompute_float8_scales`) instead of one per weight in the next forward.

``emulate`` computes the float8 matmuls in high precision on float8-rounded operands, so that
the conversion runs (and is tested) on any device, CPU included; it is for tests, not speed.

Apply it right after building the model on the meta device, before activation checkpointing,
compile and ``fully_shard`` (the path of :func:`~.parallelize.build_sharded_model`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from torchtitan_lite.config.schema import float8_recipe_problem
from torchtitan_lite.distributed.fsdp import Blocks, find_blocks
from torchtitan_lite.dtypes import import_torchao

__all__ = ["Float8Conversion", "apply_float8", "float8_unavailable", "precompute_float8_scales"]


@functools.cache
def _torchao_error() -> str | None:
    try:
        import_torchao("torchao.float8")
    except Exception as exc:  # a torchao built for another torch may fail with any error
        return (f"float8 training needs torchao, which cannot be imported here ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}; torch {torch.__version__}); install a torchao "
                "matching this torch: pip install torchao")
    return None


def float8_unavailable(device: torch.device, *, emulate: bool) -> str | None:
    """Why float8 training cannot run on ``device`` (one line), or None when it can: torchao
    must be importable, and the device must have float8 matmuls (CUDA compute capability 8.9 or
    later) unless ``emulate``."""
    missing = _torchao_error()
    if missing:
        return missing
    if emulate:
        return None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (8, 9):
            return None
        name = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
    else:
        name = f"{device.type}"
    return (f"float8 matmuls need a CUDA GPU of compute capability 8.9 or later (H100, L40, RTX 4090); "
            f"this device is {name}. float8.emulate = true runs the conversion in high precision, "
            "for tests")


AUTO_FILTER = "auto_filter_small_kn"
"""In ``filter_fqns`` (TorchTitan's flag): also keep linears too small for float8 to pay off in
high precision, by torchao's rule for the recipe (``_auto_filter_for_recipe``)."""


def _filter(filter_fqns: Sequence[str], recipe_name: str | None) -> Callable[[nn.Module, str], bool]:
    """Which modules to convert, by their names in the model: exactly ``nn.Linear`` (a layer
    converted already is left alone), both dimensions multiples of 16, no ``filter_fqns`` entry
    in the name (substrings, as in TorchTitan)."""
    names = [f for f in filter_fqns if f != AUTO_FILTER]
    auto: Callable[[nn.Module, str], bool] | None = None
    if AUTO_FILTER in filter_fqns:
        from torchao.float8 import _auto_filter_for_recipe

        auto = _auto_filter_for_recipe(recipe_name or "tensorwise", filter_fqns=list(names))

    def convert(module: nn.Module, fqn: str) -> bool:
        if type(module) is not nn.Linear:
            return False
        out_features, in_features = module.weight.shape
        if out_features % 16 or in_features % 16 or any(f in fqn for f in names) or fqn.endswith("router.gate"):
            return False
        return auto is None or auto(module, fqn)
    return convert


@dataclasses.dataclass(frozen=True)
class Float8Conversion:
    """A job's float8 conversion (``model.converters = ["float8"]`` and its ``[float8]`` options),
    resolved once by :func:`~torchtitan_lite.job.plan_job`; the arguments of :func:`apply_float8`."""

    enable_fsdp_float8_all_gather: bool = False
    """All-gather the blocks' weights in float8; on only where FSDP shards (as in TorchTitan)."""
    force_recompute_fp8_weight_in_bwd: bool = False
    """Recompute the float8 weight in backward instead of saving it."""
    recipe_name: str | None = None
    """torchao's recipe (None or ``tensorwise``: tensorwise scales)."""
    filter_fqns: tuple[str, ...] = ()
    """Linears whose names contain one of these stay in high precision."""
    emulate: bool = False
    """float8 matmuls emulated in high precision (any device; for tests)."""
    precompute_scales: bool = False
    """Compute the float8 all-gather's scales after each optimizer step."""

    def apply(self, model: nn.Module, *, blocks: Blocks) -> list[str]:
        """:func:`apply_float8` with this plan's settings."""
        return apply_float8(model, blocks=blocks, enable_fsdp_float8_all_gather=self.enable_fsdp_float8_all_gather,
                            force_recompute_fp8_weight_in_bwd=self.force_recompute_fp8_weight_in_bwd,
                            recipe_name=self.recipe_name, filter_fqns=self.filter_fqns, emulate=self.emulate)

    def describe(self, converted: int) -> str:
        """One log line: what was converted and how."""
        return (f"float8: {converted} linears of the blocks ({self.recipe_name or 'tensorwise'}"
                f"{', emulated' if self.emulate else ''}); all-gather in float8: "
                f"{'yes' if self.enable_fsdp_float8_all_gather else 'no'}"
                f"{', scales computed after each optimizer step' if self.precompute_scales else ''}")


def apply_float8(
    model: nn.Module,
    *,
    blocks: Blocks,
    enable_fsdp_float8_all_gather: bool = False,
    force_recompute_fp8_weight_in_bwd: bool = False,
    recipe_name: str | None = None,
    filter_fqns: Sequence[str] = (),
    emulate: bool = False,
) -> list[str]:
    """Convert the ``nn.Linear`` layers of ``model``'s blocks to torchao's ``Float8Linear`` in
    place (on the meta device or a real one, before ``fully_shard``); returns the converted
    layers' names (e.g. ``layers.0.attention.wq``).

    ``blocks`` is what :func:`~.fsdp.apply_fsdp` takes. ``recipe_name`` picks one of torchao's
    recipes (``Float8LinearRecipeName``: ``rowwise`` scales each row, more accurate and slower);
    it cannot be combined with ``enable_fsdp_float8_all_gather`` (the float8 all-gather needs
    tensorwise scales). Raises ``ValueError`` (one line) for a bad combination and
    ``ImportError`` without torchao."""
    missing = _torchao_error()
    if missing:
        raise ImportError(missing)
    from torchao.float8 import Float8LinearConfig, Float8LinearRecipeName, convert_to_float8_training

    if recipe_name == "tensorwise":  # torchao's default recipe: the options below apply to it
        recipe_name = None
    if recipe_name is not None:
        recipes = [r.value for r in Float8LinearRecipeName]
        if recipe_name not in recipes:
            raise ValueError(f"float8: unknown recipe_name {recipe_name!r}; allowed: {', '.join(recipes)}")
        problem = float8_recipe_problem(recipe_name, enable_fsdp_float8_all_gather)
        if problem is not None:
            raise ValueError(problem)
        config = Float8LinearConfig.from_recipe_name(recipe_name)
        # As TorchTitan does for rowwise scaling: inductor otherwise rounds the casts
        # differently from eager (pytorch/pytorch#150859).
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
        if emulate or force_recompute_fp8_weight_in_bwd:
            config = dataclasses.replace(config, emulate=emulate,
                                         force_recompute_fp8_weight_in_bwd=force_recompute_fp8_weight_in_bwd)
    else:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather,
                                    force_recompute_fp8_weight_in_bwd=force_recompute_fp8_weight_in_bwd,
                                    emulate=emulate)
    keep = _filter(filter_fqns, recipe_name)
    names = {id(module): name for name, module in model.named_modules()}
    converted = []
    for block in find_blocks(model, blocks):
        if id(block) not in names:
            raise ValueError(f"float8: block {type(block).__name__} is not a module of the model")
        if type(block) is nn.Linear:
            raise ValueError(f"float8: block {names[id(block)]!r} is itself a linear layer; pass the "
                             "modules that hold the linears (e.g. the Transformer blocks)")
        prefix = names[id(block)]
        # torchao names the modules relative to the block it is given; filter on the model's names.
        block_names = [f"{prefix}.{name}" for name, module in block.named_modules() if keep(module, f"{prefix}.{name}")]
        convert_to_float8_training(
            block, config=config,
            module_filter_fn=lambda module, fqn, prefix=prefix: keep(module, f"{prefix}.{fqn}"))
        converted.extend(block_names)
    return converted


def precompute_float8_scales(model: nn.Module) -> None:
    """After an optimizer step, compute the float8 scales of every float8-all-gathered weight of
    ``model`` in one reduction (``precompute_float8_dynamic_scale_for_fsdp``)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
