"""A model of one's own, registered with ``register_model_spec``, trains through the normal entry
point (``torchtitan_lite.train.main``); the registry refuses duplicates and unusable specs, and an
unknown ``model.name`` lists what is registered.

The model here is deliberately not our decoder: learned positions, LayerNorm, one-head causal
attention and a GELU MLP, built only on the contract of :mod:`torchtitan_lite.models.spec`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_utils import REPO_ROOT, read_jsonl
from torchtitan_lite.models import MODEL_SPECS, get_model_spec, register_model_spec
from torchtitan_lite.models import init as shard_init
from torchtitan_lite.models.spec import DecoderArgs, FSDPLayout, ModelSpec

NAME = "test_registry_lm"


@dataclass(frozen=True)
class TinyLMArgs(DecoderArgs):
    """Shape of :class:`TinyLM` (dense, its output layer its own: ``DecoderArgs``' defaults)."""

    dim: int = 32
    n_layers: int = 2
    vocab_size: int = 258
    max_seq_len: int = 64
    hidden: int = 64

    def num_params(self, *, include_embedding: bool = True) -> int:
        d = self.dim
        block = 4 * d + (3 * d * d + d * d) + (2 * d * self.hidden + self.hidden + d)  # 2 norms, attention, MLP
        total = self.n_layers * block + 2 * d + self.vocab_size * d  # final norm, output
        if include_embedding:
            total += self.vocab_size * d + self.max_seq_len * d
        return total

    def attention_flops_per_token(self, seq_len: int) -> int:
        return 12 * self.dim * seq_len

    def flops_per_token(self, seq_len: int) -> int:
        return 6 * self.num_params(include_embedding=False) + self.n_layers * self.attention_flops_per_token(seq_len)


class Block(nn.Module):
    def __init__(self, args: TinyLMArgs) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(args.dim), nn.LayerNorm(args.dim)
        self.qkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.proj = nn.Linear(args.dim, args.dim, bias=False)
        self.up = nn.Linear(args.dim, args.hidden)
        self.down = nn.Linear(args.hidden, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).unsqueeze(1).chunk(3, dim=-1)  # one head
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))

    def init_weights(self) -> None:
        for norm in (self.norm1, self.norm2):
            shard_init.ones_(norm.weight)
            shard_init.zeros_(norm.bias)
        for linear in (self.qkv, self.proj, self.up, self.down):
            shard_init.trunc_normal_(linear.weight, std=0.02)
        shard_init.zeros_(self.up.bias)
        shard_init.zeros_(self.down.bias)


class TinyLM(nn.Module):
    """Token and learned position embeddings, ``n_layers`` blocks, a final norm and the output."""

    def __init__(self, args: TinyLMArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("positions", torch.arange(args.max_seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos_embeddings(self.positions[: tokens.shape[1]])
        for block in self.blocks:
            h = block(h)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        self.init_buffers(buffer_device)
        shard_init.normal_(self.tok_embeddings.weight, std=1.0)
        shard_init.normal_(self.pos_embeddings.weight, std=0.02)
        for block in self.blocks:
            block.init_weights()
        shard_init.ones_(self.norm.weight)
        shard_init.zeros_(self.norm.bias)
        shard_init.trunc_normal_(self.output.weight, std=self.args.dim**-0.5)

    def init_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        device = torch.device(buffer_device) if buffer_device is not None else self.positions.device
        self.positions = torch.arange(self.args.max_seq_len, device="cpu" if device.type == "meta" else device)


def tiny_lm_units(model: nn.Module) -> FSDPLayout:
    assert isinstance(model, TinyLM)
    return FSDPLayout(first_unit=[model.tok_embeddings, model.pos_embeddings], blocks=list(model.blocks),
                      last_unit=[model.norm, model.output])


def split_mlps(model: nn.Module, tp_mesh: object, *, loss_parallel: bool) -> None:
    """TinyLM's own tensor-parallel plan: each block's MLP split (``up`` by columns, ``down`` by
    rows), attention and the embeddings whole on every rank (``loss_parallel`` not taken)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


SPEC = ModelSpec(name=NAME, model_cls=TinyLM, args_cls=TinyLMArgs, flavors={"small": TinyLMArgs()},
                 fsdp_units=tiny_lm_units, parallel_dims=frozenset({"tp"}), tensor_parallel=split_mlps)


@pytest.fixture
def registered() -> Iterator[ModelSpec]:
    register_model_spec(SPEC)
    yield SPEC
    MODEL_SPECS.pop(NAME, None)


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "fsdp"])
def test_a_registered_model_trains_through_main(registered: ModelSpec, sharded: bool, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """One process trains the plain model; with CPU offload FSDP2 shards it by the spec's units."""
    from torchtitan_lite.train import main

    dump = tmp_path / "dump"
    code = main(["--job.config_file", str(REPO_ROOT / "train_configs" / "debug_model.toml"),
                 "--model.name", NAME, "--model.flavor", "small",
                 "--training.steps", "6", "--training.seq_len", "32", "--training.local_batch_size", "2",
                 "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
                 "--metrics.no-enable_tensorboard", "--validation.no-enable", "--job.dump_folder", str(dump),
                 *(["--training.enable_cpu_offload"] if sharded else [])])
    assert code == 0, capsys.readouterr().err
    losses = [r["loss"] for r in read_jsonl(dump / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses), losses
    assert losses[0] > math.log(258) - 0.5, losses  # untrained: near uniform over the byte vocabulary
    assert sum(losses[-2:]) / 2 < losses[0] - 0.5, losses


def _trained_with_own_split(argv: list[str]) -> tuple[list[float], dict[str, dict[str, str]]]:
    """Register the family in this (spawned) process, train; the losses and some placements."""
    from torch.distributed.tensor import DTensor

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    register_model_spec(SPEC, replace=True)
    trainer = Trainer(load_job_config(argv))
    try:
        losses = [h["loss"] for h in trainer.train()]
        placed = {name: dict(zip(p.device_mesh.mesh_dim_names, (str(x) for x in p.placements), strict=True))
                  for name, p in trainer.model.named_parameters()
                  if isinstance(p, DTensor) and name.startswith("blocks.0.")}
        return losses, placed
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_registered_family_is_split_by_its_own_tensor_parallel_plan(tmp_path: Path) -> None:
    """``ModelSpec.tensor_parallel``: with ``tensor_parallel_degree = 2`` on 2 ranks the family's
    own plan splits the model (its MLPs, not our decoders' projections), and the losses equal one
    process's within 1e-5 (fp32, 6 steps)."""
    from tests.dist_utils import run_distributed

    def argv(dump: str, *extra: str) -> list[str]:
        return ["--model.name", NAME, "--model.flavor", "small", "--training.steps", "6",
                "--training.seq_len", "32", "--training.global_batch_size", "2", "--training.no-shuffle",
                "--training.mixed_precision_param", "float32", "--optimizer.lr", "1e-2",
                "--lr_scheduler.warmup_steps", "2", "--metrics.no-enable_tensorboard", "--validation.no-enable",
                "--job.dump_folder", str(tmp_path / dump), *extra]

    ((reference, _),) = run_distributed(_trained_with_own_split, 1, argv("one", "--training.local_batch_size", "2"))
    ranks = run_distributed(_trained_with_own_split, 2, argv("tp2", "--training.local_batch_size", "2",
                                                             "--parallelism.data_parallel_shard_degree", "1",
                                                             "--parallelism.tensor_parallel_degree", "2"))
    for losses, placed in ranks:
        assert len(losses) == 6
        for a, b in zip(losses, reference, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (losses, reference)
        assert placed["blocks.0.up.weight"]["tp"] == "S(0)", placed  # (and FSDP's shard over dp_shard of 1)
        assert placed["blocks.0.down.weight"]["tp"] == "S(1)", placed
        assert "tp" not in placed["blocks.0.qkv.weight"], placed  # attention: not split by this plan


def test_auto_is_refused_for_a_family_s_own_tensor_parallel_plan(registered: ModelSpec) -> None:
    """The memory planner sizes our decoders' split only: ``auto`` with a family's own plan is one line."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.errors import ConfigError
    from torchtitan_lite.job import plan_job

    argv = ["--model.name", NAME, "--model.flavor", "small", "--training.seq_len", "32",
            "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
    plan_job(load_job_config(argv), world_size=2, device_type="cpu")  # (a fixed setting: planned)
    with pytest.raises(ConfigError, match=r"^parallelism.reshard_after_forward_mode: invalid value 'auto'; model "
                       rf"'{NAME}' splits over tensor parallel by its own plan \(ModelSpec.tensor_parallel\)"):
        plan_job(load_job_config([*argv, "--parallelism.reshard_after_forward_mode", "auto"]), world_size=2,
                 device_type="cpu")


def test_registering_a_name_twice_fails_unless_replaced(registered: ModelSpec) -> None:
    with pytest.raises(ValueError, match=rf"model '{NAME}' is registered already \(pass replace=True"):
        register_model_spec(dataclasses.replace(SPEC))
    assert get_model_spec(NAME) is SPEC
    other = dataclasses.replace(SPEC, flavors={"other": TinyLMArgs(dim=16)})
    register_model_spec(other, replace=True)
    assert get_model_spec(NAME) is other


def test_an_unusable_spec_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"^register_model_spec: expected a ModelSpec, got dict$"):
        register_model_spec({"name": NAME})
    with pytest.raises(ValueError, match=r"^register_model_spec: flavors must be a non-empty mapping[^\n]*$"):
        register_model_spec(dataclasses.replace(SPEC, flavors={}))
    with pytest.raises(ValueError, match=r"^register_model_spec: args_cls int must be a dataclass[^\n]*$"):
        register_model_spec(dataclasses.replace(SPEC, args_cls=int))

    @dataclass(frozen=True)
    class Undeclared:  # (what the rest of the package reads of every family's args, not declared)
        vocab_size: int = 8
        max_seq_len: int = 8

    with pytest.raises(ValueError, match=r"args_cls Undeclared must derive from torchtitan_lite.models.spec.Decoder"):
        register_model_spec(dataclasses.replace(SPEC, args_cls=Undeclared, flavors={"small": Undeclared()}))
    assert NAME not in MODEL_SPECS


def test_an_unknown_model_name_lists_the_registered_ones(registered: ModelSpec,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from torchtitan_lite.train import main

    assert main(["--model.name", "nope", "--model.flavor", "small"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: model.name: invalid value 'nope'; expected one of "), lines
    assert f"'{NAME}'" in lines[0], lines
    assert main(["--help"]) == 0
    assert f"registered: {', '.join(MODEL_SPECS)}" in capsys.readouterr().out


_SCRIPT_FAMILY = '''
import dataclasses

from torchtitan_lite.distributed.job_shape import JobShape
from torchtitan_lite.memory.estimate import estimate_here, in_child_process
from torchtitan_lite.models import register_model_spec
from torchtitan_lite.models.llama3 import LLAMA3_SPEC, Transformer


class ScriptDecoder(Transformer):
    """A family of this script's own (its model class defined here, in __main__)."""


SPEC = dataclasses.replace(LLAMA3_SPEC, name="script_family", model_cls=ScriptDecoder)

if __name__ == "__main__":
    register_model_spec(SPEC)
    shape = JobShape(world_size=2, seq_len=32, local_batch_size=2, device_type="cpu")
    here = estimate_here(SPEC, SPEC.flavors["tiny"], shape)
    child = in_child_process(estimate_here, SPEC, SPEC.flavors["tiny"], {"shape": shape})
    print("peaks", here.peak, child.peak)
'''


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_a_family_registered_by_a_script_is_estimated_in_the_child_process(tmp_path) -> None:
    """The estimator's child process (what ``auto`` uses while a process group exists) gets a
    family that a script registered at run time, its model class defined in the script itself:
    the same estimate as in this process, not an unknown model.name."""
    import sys

    from tests.dist_utils import run_command

    script = tmp_path / "my_family.py"
    script.write_text(_SCRIPT_FAMILY)
    result = run_command([sys.executable, str(script)], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    here, child = result.stdout.split()[-2:]
    assert here == child and int(here) > 0, result.stdout
