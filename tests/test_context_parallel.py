"""Context parallel: the sequence split over 2 or 4 ranks gives one process's logits and gradients.

Model level: the same weights on every rank, each rank's share of the tokens (load-balanced
head-tail chunks), causal and block-causal (packed documents) attention, both methods; the
logits gathered back and the gradients summed over the ranks equal one process's on the whole
sequence (fp32, within 1e-5)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist_utils import run_distributed, train_history
from tests.test_trainer_data import mixture  # noqa: F401  (the fixture)
from torchtitan_lite.distributed.context_parallel import ContextParallel, context_parallel_problem

SEQ = 32


def _model(family: str) -> torch.nn.Module:
    from torchtitan_lite.models import get_model_spec

    spec = get_model_spec(family)
    torch.manual_seed(0)
    model = spec.model_cls(spec.model_args("tiny"))
    model.init_weights()
    return model


def _batch(vocab: int, documents: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (2, SEQ), generator=g)
    labels = torch.randint(0, vocab, (2, SEQ), generator=g)
    # Packed documents of uneven lengths, boundaries inside the chunks of every rank.
    docs = torch.tensor([[0] * 5 + [1] * 14 + [2] * 13, [0] * 21 + [1] * 11]) if documents else None
    return tokens, labels, docs


def _reference(family: str, documents: bool) -> dict[str, Any]:
    model = _model(family)
    tokens, labels, docs = _batch(model.args.vocab_size, documents)
    logits = model(tokens, docs)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    return {"logits": logits.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _sharded(family: str, documents: bool, method: str) -> dict[str, Any]:
    import torch.distributed as dist

    from torchtitan_lite.distributed import init_distributed

    init_distributed(torch.device("cpu"))
    model = _model(family)
    name, _, split = method.partition("/")  # "allgather/contiguous": without the load balance
    cp = ContextParallel(dist.group.WORLD, method=name, load_balance=split != "contiguous")
    model.use_context_parallel(cp)
    tokens, labels, docs = _batch(model.args.vocab_size, documents)
    local = model(cp.shard(tokens), None if docs is None else cp.shard(docs))
    loss = torch.nn.functional.cross_entropy(local.flatten(0, 1), cp.shard(labels).flatten(), reduction="sum")
    loss.backward()
    pieces = [torch.empty_like(local) for _ in range(cp.degree)]
    dist.all_gather(pieces, local.detach().contiguous())
    gathered = torch.cat(pieces, dim=1)
    logits = gathered.index_select(1, cp.layout(SEQ, gathered.device).gathered_to_global)
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        grads[name] = p.grad
    return {"logits": logits, "grads": grads}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family, documents, method", [
    ("llama3", False, "allgather"), ("llama3", True, "allgather"),
    ("llama3", False, "ulysses"), ("llama3", True, "ulysses"), ("llama3", True, "allgather/contiguous"),
    ("qwen3", True, "allgather"), ("qwen2", False, "ulysses"),
    ("deepseek_v3", True, "allgather"), ("deepseek_v3", False, "ulysses"),
])
def test_sharded_sequence_equals_one_process(world: int, family: str, documents: bool, method: str) -> None:
    reference = _reference(family, documents)
    for rank, got in enumerate(run_distributed(_sharded, world, family, documents, method)):
        torch.testing.assert_close(got["logits"], reference["logits"], atol=1e-5, rtol=1e-5,
                                   msg=lambda m, rank=rank: f"rank {rank} logits: {m}")
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}")


def test_load_balanced_layout() -> None:
    """Head-tail chunks: rank r holds chunks r and 2·degree−1−r; the permutations invert."""

    class Solo(ContextParallel):
        def __init__(self, degree: int, rank: int) -> None:
            self.group, self.method, self.degree, self.rank, self._layouts = None, "allgather", degree, rank, {}
            self.load_balance = True

    layout = Solo(4, 1).layout(16, torch.device("cpu"))
    assert layout.owned.tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert torch.equal(layout.global_to_gathered[layout.gathered_to_global], torch.arange(16))
    x = torch.arange(16).view(1, 16)
    assert Solo(4, 1).shard(x).tolist() == [[2, 3, 12, 13]]


def test_problems_are_one_line() -> None:
    assert context_parallel_problem(seq_len=30, degree=2, method="allgather", n_heads=4, kv_heads=2) == (
        "training.seq_len 30 does not split into 2 × context_parallel_degree = 4 equal chunks (the "
        "load-balanced split); expected a multiple of it")
    assert "6 heads do not divide by context_parallel_degree 4" in context_parallel_problem(
        seq_len=32, degree=4, method="ulysses", n_heads=6, kv_heads=2)
    assert context_parallel_problem(seq_len=32, degree=4, method="ulysses", n_heads=8, kv_heads=2) is None
    assert "unknown method 'ring'" in context_parallel_problem(seq_len=32, degree=2, method="ring", n_heads=4,
                                                               kv_heads=4)


# --------------------------------------------------------------------------------------------
# The trainer at context parallel 2 and 4 against one process
# --------------------------------------------------------------------------------------------


def _trainer_run(argv: list[str]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    try:
        history = trainer.train()
        weight = trainer.model.tok_embeddings.weight
        return {"losses": [h["loss"] for h in history], "tokens": history[-1].get("tokens_seen"),
                "validation": [h["validation_loss"] for h in history if "validation_loss" in h],
                "mesh": tuple(weight.device_mesh.mesh_dim_names) if isinstance(weight, DTensor) else None}
    finally:
        trainer.close()


def _job(dump: Any, *extra: str) -> list[str]:
    from tests.conftest import TINY_ARGS

    return [*TINY_ARGS, "--job.dump_folder", str(dump), "--training.seq_len", "64", "--training.steps", "10",
            "--training.global_batch_size", "4", "--optimizer.lr", "1e-2", "--validation.enable",
            "--validation.steps", "2", "--validation.freq", "5", "--metrics.no-enable_tensorboard", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("family, mask", [pytest.param("llama3", "causal", marks=pytest.mark.scenario),
                                          ("llama3", "block_causal"), ("qwen3", "causal"),
                                          ("qwen3_moe", "causal"), ("deepseek_v3", "block_causal")])
def test_trainer_at_context_parallel_2_and_4_equals_one_process(tmp_path: Any, family: str, mask: str) -> None:
    """Tiny models, fp32, 10 steps at lr 1e-2, validation every 5: 4 ranks as data parallel 2 ×
    context parallel 2 (allgather) and as context parallel 4 (ulysses: 4 heads) give one process's
    training and validation losses within 1e-5 (Qwen3 with its per-head norms, Qwen3-MoE with its
    load-balancing loss over the
    tokens of every rank, DeepSeek-V3's latent attention); the parameters are sharded over
    dp_shard × cp. Llama also runs each method at the other degree."""
    extra = ["--model.name", family, "--model.attention_mask", mask]
    ((one,),) = [run_distributed(_trainer_run, 1, _job(tmp_path / "one", "--training.local_batch_size", "4",
                                                        *extra))]
    runs = {
        "dp2xcp2": run_distributed(_trainer_run, 4, _job(tmp_path / "dp2cp2", "--training.local_batch_size", "2",
                                                         "--parallelism.context_parallel_degree", "2", *extra)),
        "cp4": run_distributed(_trainer_run, 4, _job(tmp_path / "cp4", "--training.local_batch_size", "4",
                                                     "--parallelism.context_parallel_degree", "4",
                                                     "--parallelism.context_parallel_method", "ulysses", *extra)),
    }
    if family == "llama3":  # both methods at both degrees
        runs["dp2xcp2-ulysses"] = run_distributed(_trainer_run, 4, _job(
            tmp_path / "dp2cp2u", "--training.local_batch_size", "2", "--parallelism.context_parallel_degree", "2",
            "--parallelism.context_parallel_method", "ulysses", *extra))
        runs["cp4-allgather"] = run_distributed(_trainer_run, 4, _job(
            tmp_path / "cp4a", "--training.local_batch_size", "4", "--parallelism.context_parallel_degree", "4",
            *extra))
    assert len(one["losses"]) == 10 and len(one["validation"]) == 2
    for name, ranks in runs.items():
        for got in ranks:
            assert got["mesh"] == ("dp_shard_cp",), (name, got["mesh"])
            assert got["tokens"] == one["tokens"], name
            for key in ("losses", "validation"):
                for a, b in zip(got[key], one[key], strict=True):
                    assert abs(a - b) <= 1e-5 * abs(b), (name, key, got[key], one[key])


@pytest.mark.slow
def test_checkpoint_at_context_parallel_2_resumes_at_1_and_4(tmp_path: Any) -> None:
    """A checkpoint saved at step 5 of a data parallel 2 × context parallel 2 run, resumed on the
    same 4 ranks at context parallel 1 (FSDP over 4) and 4: steps 6-10 repeat the uninterrupted
    run's losses within 1e-5."""
    import shutil

    save = ["--checkpoint.enable", "--checkpoint.interval", "5", "--validation.no-enable",
            "--training.local_batch_size", "2"]
    (saved, *_) = run_distributed(_trainer_run, 4, _job(tmp_path / "cp2", *save,
                                                         "--parallelism.context_parallel_degree", "2"))
    assert len(saved["losses"]) == 10
    for degree, local in (("1", "1"), ("4", "4")):
        dump = tmp_path / f"cp{degree}"
        shutil.copytree(tmp_path / "cp2" / "checkpoint" / "step-5", dump / "checkpoint" / "step-5")
        (resumed, *_) = run_distributed(_trainer_run, 4, _job(dump, *save, "--training.local_batch_size", local,
                                                               "--parallelism.context_parallel_degree", degree))
        assert len(resumed["losses"]) == 5, degree
        for a, b in zip(resumed["losses"], saved["losses"][5:], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (degree, resumed["losses"], saved["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_chat_sft_at_context_parallel_2_equals_one_process(tmp_path: Any, family: str) -> None:
    """Chat SFT (Llama 3's template without generation markers, Qwen3's training template with
    them, think blocks), best-fit-decreasing packing, block-causal attention, the loss over the assistant
    tokens only: 2 ranks at context parallel 2 give one process's losses over 3 steps within 1e-5."""
    import json

    from tests.test_data_chat import CONVERSATIONS, TEMPLATES, family_rows, write_chat_tokenizer
    from tests.test_decoder_hf import hf_llama, hf_qwen3
    from tests.test_trainer_sft import _argv, _losses
    from torchtitan_lite.data import HFTokenizer

    # Llama 3's template (no generation markers: the assistant spans found by rendering) and Qwen3's
    # training template (its {% generation %} markers say which tokens count).
    marked = None if family == "llama3" else (TEMPLATES / "qwen3_training.jinja").read_text()
    path = write_chat_tokenizer(tmp_path / "tokenizer", family, template=marked)
    (hf_llama if family == "llama3" else hf_qwen3)(tmp_path / "base", vocab_size=HFTokenizer(path).vocab_size)
    rows = [{"messages": m} for m in CONVERSATIONS] if family == "llama3" else family_rows("qwen3")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def argv(dump: str, *extra: str) -> list[str]:
        args = _argv(tmp_path, tmp_path / dump, "--training.packing", "bfd", "--training.seq_len", "128",
                     "--training.steps", "3", "--optimizer.lr", "1e-3", *extra)
        return [a if a != "llama3" else family for a in args]

    (one,) = run_distributed(_losses, 1, argv("one", "--training.local_batch_size", "4"))
    ranks = run_distributed(_losses, 2, argv("cp2", "--training.local_batch_size", "4",
                                             "--parallelism.context_parallel_degree", "2"))
    assert len(one) == 3
    for losses in ranks:
        for a, b in zip(losses, one, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (losses, one)


def test_a_job_longer_than_the_flavor_gets_a_longer_rotary_table_and_a_note() -> None:
    """seq_len is not capped by the flavor's max_seq_len: the rotary table follows the job (the
    model's RoPE scaling kept: Llama 3.1's factors), and a note says the model was trained for less."""
    import dataclasses

    from tests.conftest import TINY_ARGS
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.job import plan_job
    from torchtitan_lite.models.decoder import precompute_freqs_cis

    plan = plan_job(load_job_config([*TINY_ARGS, "--training.seq_len", "2048"]), world_size=1)
    assert plan.model_args.max_seq_len == 2048
    assert plan.notes == ("the job's sequences (2048 tokens) pass the 512 that llama3 tiny was trained for (its "
                          "max_seq_len): the rotary table follows the job, with the model's RoPE scaling kept",)
    assert not plan_job(load_job_config(TINY_ARGS), world_size=1).notes
    from torchtitan_lite.models.llama3 import LLAMA3_FLAVORS

    scaled = dataclasses.replace(LLAMA3_FLAVORS["8B"], rope_scaling="llama3")
    long = precompute_freqs_cis(scaled.head_dim, 16384, scaled.rope_theta, args=scaled)
    short = precompute_freqs_cis(scaled.head_dim, 8192, scaled.rope_theta, args=scaled)
    assert torch.equal(long[:8192], short)  # the same rotations where they overlap: only the table is longer


def test_memory_cli_finds_the_longest_seq_len_that_fits(capsys: pytest.CaptureFixture[str]) -> None:
    """``--longest_seq_len``: a progress line per estimate, and the answer is the longest tried
    length that fits the budget (90% of the device) with the next step up not fitting; context
    parallel 2 fits a longer sequence than 1."""
    import re

    from torchtitan_lite.memory.cli import main

    found = {}
    for degree in (1, 2):
        argv = ["--world_size", "4", "--job.config_file", "train_configs/debug_model.toml", "--device_memory_gib",
                "1", "--parallelism.context_parallel_degree", str(degree), "--longest_seq_len"]
        assert main(argv) == 0
        out = capsys.readouterr().out
        tried = [(int(n), float(g), v == "fits") for n, g, v in
                 re.findall(r"^seq_len (\d+): estimated peak ([\d.]+) GiB per rank, (fits|does not fit)$", out, re.M)]
        assert tried, out
        answer = int(re.search(r"^longest seq_len that fits: (\d+) tokens", out, re.M).group(1))
        assert answer == max(n for n, _, ok in tried if ok)
        assert all(g <= 0.9 for n, g, ok in tried if ok) and all(g > 0.9 for n, g, ok in tried if not ok)
        assert any(n > answer and not ok for n, _, ok in tried)
        found[degree] = answer
    assert found[2] > found[1], found


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_eight_ranks_data_context_and_tensor_parallel_2_each_equal_one_process(tmp_path: Any) -> None:
    """Llama (tiny, packed documents), fp32, 10 steps: 8 ranks as data parallel 2 × context
    parallel 2 × tensor parallel 2 give one process's training and validation losses within 1e-5;
    the attention projections are split over tp and sharded over dp_shard × cp."""
    extra = ["--model.attention_mask", "block_causal"]
    (one,) = run_distributed(_trainer_run, 1, _job(tmp_path / "one", "--training.local_batch_size", "4", *extra))
    ranks = run_distributed(_trainer_run, 8, _job(tmp_path / "eight", "--training.local_batch_size", "2",
                                                  "--parallelism.context_parallel_degree", "2",
                                                  "--parallelism.tensor_parallel_degree", "2", *extra))
    for got in ranks:
        assert got["mesh"] == ("dp_shard_cp", "tp"), got["mesh"]
        for key in ("losses", "validation"):
            for a, b in zip(got[key], one[key], strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (key, got[key], one[key])


@pytest.mark.parametrize("extra, message", [
    (["--training.seq_len", "30"], "parallelism.context_parallel_degree: invalid value 2; training.seq_len 30 does "
     "not split into 2 × context_parallel_degree = 4 equal chunks (the load-balanced split); expected a multiple "
     "of it"),
    (["--validation.enable", "--validation.seq_len", "18"], "parallelism.context_parallel_degree: invalid value 2; "
     "validation.seq_len 18 does not split into 2 × context_parallel_degree = 4 equal chunks"),
    (["--parallelism.context_parallel_method", "ulysses", "--parallelism.tensor_parallel_degree", "2",
      "--parallelism.context_parallel_degree", "4"], "ulysses splits the attention heads over the context-parallel "
     "ranks: 2 heads per tensor-parallel rank do not divide by context_parallel_degree 4"),
    (["--model.name", "qwen3_moe", "--parallelism.expert_parallel_degree", "2",
      "--parallelism.context_parallel_degree", "4"], "parallelism.expert_parallel_degree: invalid value 2; with "
     "context parallel the expert-parallel ranks are the parallelism.context_parallel_degree = 4 ranks of a "
     "sequence and data-parallel ones: expected a multiple of it"),
])
def test_bad_context_parallel_settings_are_one_line_before_any_process_group(extra: list[str], message: str) -> None:
    from tests.conftest import TINY_ARGS
    from torchtitan_lite.config import ConfigError, load_job_config
    from torchtitan_lite.job import plan_job

    argv = [*TINY_ARGS, "--training.seq_len", "32", "--parallelism.context_parallel_degree", "2", *extra]
    world = 16 if "--parallelism.tensor_parallel_degree" in extra else 4
    with pytest.raises(ConfigError) as raised:
        plan_job(load_job_config(argv), world_size=world)
    assert message in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("deepseek_v3", marks=pytest.mark.scenario)])
def test_expert_parallel_beside_context_parallel_equals_one_process(tmp_path: Any, family: str) -> None:
    """4 ranks as data parallel 2 × context parallel 2 with expert parallel 2 (the two ranks of a
    sequence) and 4 (all of them: tokens of both sequences' halves exchanged), fp32, 10 steps:
    one process's training and validation losses within 1e-5 (Qwen3-MoE with its load-balancing
    loss, DeepSeek-V3 with bias balancing)."""
    extra = ["--model.name", family, "--model.attention_mask", "block_causal"]
    if family == "deepseek_v3":
        extra += ["--moe.bias_update_rate", "0.01"]
    (one,) = run_distributed(_trainer_run, 1, _job(tmp_path / "one", "--training.local_batch_size", "4", *extra))
    for ep in ("2", "4"):
        ranks = run_distributed(_trainer_run, 4, _job(tmp_path / f"ep{ep}", "--training.local_batch_size", "2",
                                                      "--parallelism.context_parallel_degree", "2",
                                                      "--parallelism.expert_parallel_degree", ep, *extra))
        for got in ranks:
            for key in ("losses", "validation"):
                for a, b in zip(got[key], one[key], strict=True):
                    assert abs(a - b) <= 1e-5 * abs(b), (ep, key, got[key], one[key])


def _metrics_run(argv: list[str]) -> None:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    try:
        trainer.train()
    finally:
        trainer.close()


@pytest.mark.slow
def test_mixture_metrics_at_hsdp_by_context_parallel_equal_one_process(tmp_path: Any, mixture: Any) -> None:  # noqa: F811
    """A mixture of three sources with two named validation sets, 6 steps: HSDP (2 replicas) ×
    context parallel 2 on 4 ranks logs one process's loss, each source's loss and tokens, and each
    validation set's loss (within 1e-5): every sum is over the data × context-parallel ranks."""
    from tests.dist_utils import read_jsonl
    from tests.test_trainer_data import _mixture_argv

    def argv(dump: str, *extra: str) -> list[str]:
        return [*_mixture_argv(mixture, tmp_path / dump), "--training.steps", "6", "--validation.freq", "3",
                "--checkpoint.no-enable", "--metrics.no-enable_tensorboard", *extra]

    run_distributed(_metrics_run, 1, argv("one", "--training.local_batch_size", "4"))
    run_distributed(_metrics_run, 4, argv("hsdp_cp", "--training.local_batch_size", "2",
                                          "--parallelism.data_parallel_replicate_degree", "2",
                                          "--parallelism.context_parallel_degree", "2"))
    one, got = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("one", "hsdp_cp"))
    keys = [k for k in one[0] if k == "loss" or k.startswith(("loss/", "tokens/", "validation/"))
            and (k.endswith("/loss") or k.startswith(("loss/", "tokens/")))]
    assert any(k.startswith("loss/") for k in keys) and len(one) == len(got)
    checked = 0
    for a, b in zip(got, one, strict=True):
        for key in keys + [k for k in b if k.startswith("validation/") and k.endswith("/loss")]:
            if b.get(key) is not None:
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (key, a[key], b[key])
                checked += 1
    assert checked > 20


_FOUR_D = {  # name: (ranks, arguments)
    "pp2 x cp2": (4, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.context_parallel_degree", "2",
                      "--training.local_batch_size", "4"]),
    "pp2 x cp2 ulysses, Interleaved1F1B": (4, [
        "--parallelism.pipeline_parallel_degree", "2", "--parallelism.context_parallel_degree", "2",
        "--parallelism.context_parallel_method", "ulysses", "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B", "--model.flavor", "debugmodel", "--training.local_batch_size", "4"]),
    "dp2 x pp2 x cp2": (8, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.context_parallel_degree",
                            "2", "--training.local_batch_size", "2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", [name if name == "pp2 x cp2" else pytest.param(name, marks=pytest.mark.scenario)
                                  for name in _FOUR_D])
@pytest.mark.parametrize("mask", ["causal", pytest.param("block_causal", marks=pytest.mark.scenario)])
def test_pipeline_beside_context_parallel_equals_one_process(tmp_path: Any, case: str, mask: str) -> None:
    """TorchTitan's 4D minus tensor parallel: each sequence split over the context-parallel ranks
    while the blocks are split into pipeline stages (pipeline micro-batches of 1 row; the stages
    pass each rank's share of the hidden states, each stage's attention over the whole sequence).
    The tiny Llama, fp32, 10 steps, validation every 5: pipeline 2 × context parallel 2 (1F1B,
    all-gather; Interleaved1F1B with Ulysses on the debug model's 6 blocks) and data parallel 2 × pipeline 2 × context
    parallel 2 on 8 ranks give one process's training and validation losses within 1e-5, causal
    and with packed documents."""
    ranks, extra = _FOUR_D[case]
    model = ["--model.flavor", "debugmodel"] if "debugmodel" in extra else []
    args = ["--model.attention_mask", mask, "--parallelism.pipeline_parallel_microbatch_size", "1",
            "--validation.local_batch_size", "4" if ranks == 4 else "2"]
    one = train_history(_job(tmp_path / "one", "--training.local_batch_size", "4", *model, *args[:2],
                             "--validation.local_batch_size", "4"))
    many = run_distributed(train_history, ranks, _job(tmp_path / "many", *extra, *args))
    assert len(one) == 10
    for history in many:
        assert len(history) == 10
        for a, b in zip(history, one, strict=True):
            for key in ("loss", "validation_loss"):
                if key in b:
                    assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (case, key, a, b)


def _packed_step_peak(argv: list[str], tile_elements: int | None = None) -> int:
    """The allocator's peak of one steady-state trainer step (``tile_elements``: attention's tile
    size in place of the decoder's; None keeps it)."""
    import functools

    import torchtitan_lite.models.decoder as decoder
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.memory.measure import trainer_step_peak
    from torchtitan_lite.trainer import Trainer

    before = decoder.ATTENTION_TILE_ELEMENTS
    decoder.ATTENTION_TILE_ELEMENTS = tile_elements or before
    try:
        peak, trainer = trainer_step_peak(functools.partial(Trainer, load_job_config(argv)))
        trainer.close()
    finally:
        decoder.ATTENTION_TILE_ELEMENTS = before
    return peak


@pytest.mark.scenario  # (four lengths of two ranks each; left out of the default selection)
@pytest.mark.slow
@pytest.mark.parametrize("method", ["allgather", "ulysses"])
def test_a_packed_step_at_context_parallel_2_grows_linearly_with_the_sequence(tmp_path: Any, method: str) -> None:
    """Packed documents (block-causal) at context parallel 2, one sequence a step of 8,192 to 20,480
    tokens, the tiny Llama in fp32 with full checkpointing: the allocator's peak of a step grows by
    the same bytes for each 4,096 tokens more (within 10%). The same job with attention untiled
    (a mask and scores of the queries over the sequence) grows by more than twice as much."""
    from tests.conftest import TINY_ARGS

    def argv(seq_len: int) -> list[str]:
        return [*TINY_ARGS, "--job.dump_folder", str(tmp_path / str(seq_len)), "--training.seq_len", str(seq_len),
                "--training.local_batch_size", "1", "--training.global_batch_size", "1", "--training.steps", "2",
                "--model.attention_mask", "block_causal", "--activation_checkpoint.mode", "full",
                "--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", method,
                "--metrics.no-enable_tensorboard", "--validation.no-enable"]

    lengths = (8192, 12288, 16384, 20480)
    peaks = [max(run_distributed(_packed_step_peak, 2, argv(n))) for n in lengths]
    growth = [b - a for a, b in zip(peaks, peaks[1:], strict=False)]
    print(method, [f"{p / 2**20:.2f} MiB" for p in peaks], [f"{g / 2**20:.2f} MiB" for g in growth])
    assert min(growth) > 0 and max(growth) <= 1.1 * min(growth), (peaks, growth)
    untiled = [max(run_distributed(_packed_step_peak, 2, argv(n), 1 << 40)) for n in lengths[:2]]
    print("untiled", [f"{p / 2**20:.2f} MiB" for p in untiled])
    assert untiled[1] - untiled[0] > 2 * growth[0], (untiled, growth)
