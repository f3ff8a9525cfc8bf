"""Rollouts (``torchtitan_lite/rl/rollout.py``): batched generation with a KV cache on the training
layout.

Greedy completions equal transformers' ``generate`` (left padding, attention mask, EOS) for 64
prompts of 1-39 tokens on a tiny random Llama and Qwen3 loaded through the Hugging Face import: on
one process, on 2 FSDP ranks (with different numbers of prompts and chunks per rank; plain, and with
activation checkpointing, CPU offload and resharding after every forward), and at data parallel 2 ×
tensor parallel 2. Sampled completions carry the log-probabilities a teacher-forced forward gives;
seeds, top-k, top-p, stop tokens, stop strings and the length limit do what they say; compiled blocks
give eager's tokens without compiling during generation; the latent attention and the mixture of
experts generate what full forwards give. The weights an external engine would be handed
(``hf_named_tensors``) are transformers' state dict, on one process and gathered from FSDP shards.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_decoder_hf import hf_llama, hf_qwen3, our_model
from torchtitan_lite.checkpoint.hf_storage import hf_named_tensors
from torchtitan_lite.rl.rollout import (
    Completion,
    DecoderRollouts,
    RolloutEngine,
    SamplingParams,
    filter_logits,
)

transformers = pytest.importorskip("transformers")

PAD = 0
NEW = 16
CPU = torch.device("cpu")


def _prompts(n: int = 64, *, seed: int = 0, vocab: int = 300) -> list[list[int]]:
    """``n`` prompts of 1 to 39 tokens (none of them the pad token)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for length in lengths]


def _hf_greedy(folder: Path, prompts: list[list[int]], eos: int | None) -> list[list[int]]:
    """transformers' greedy ``generate`` of the prompts in one left-padded batch, each completion
    cut after its EOS."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    length = max(map(len, prompts))
    ids = torch.full((len(prompts), length), PAD)
    attention = torch.zeros(len(prompts), length, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, length - len(prompt):] = torch.tensor(prompt)
        attention[i, length - len(prompt):] = 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=attention, do_sample=False, max_new_tokens=NEW, pad_token_id=PAD,
                             eos_token_id=eos)
    completions = []
    for row in out[:, length:].tolist():
        cut = row.index(eos) + 1 if eos in row else len(row)
        completions.append(row[:cut])
    return completions


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per family: its Hugging Face folder, 64 prompts, an EOS (the token greedy decoding emits most,
    so that many completions stop) and transformers' greedy completions."""
    out = {}
    for family, build in (("llama3", hf_llama), ("qwen3", hf_qwen3)):
        folder = build(tmp_path_factory.mktemp(family))
        prompts = _prompts()
        eos = Counter(t for row in _hf_greedy(folder, prompts, None) for t in row[: NEW // 2]).most_common(1)[0][0]
        out[family] = {"folder": folder, "prompts": prompts, "eos": eos,
                       "completions": _hf_greedy(folder, prompts, eos)}
    return out


def _greedy(eos: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=(eos,))


def _check_finish(completions: list[Completion], eos: int) -> None:
    for c in completions:
        assert len(c.token_ids) == len(c.logprobs)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == NEW and eos not in c.token_ids


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_greedy_completions_equal_transformers_generate(references: dict[str, Any], family: str) -> None:
    """One process, 64 prompts in chunks of at most 24: the tokens of transformers' greedy
    ``generate`` of all 64 in one batch, EOS kept; ``stop`` where it came, ``length`` elsewhere."""
    ref = references[family]
    model = our_model(ref["folder"], family)
    engine = DecoderRollouts(model, device=CPU, pad_id=PAD, max_batch=24)
    completions = engine.generate(ref["prompts"], _greedy(ref["eos"]), seed=0)
    assert [c.token_ids for c in completions] == ref["completions"]
    _check_finish(completions, ref["eos"])
    reasons = Counter(c.finish_reason for c in completions)
    assert reasons["stop"] >= 2 and reasons["length"] >= 2, reasons
    assert isinstance(engine, RolloutEngine)


# ---------------------------------------------------------------------------------------------
# On the training layout: FSDP2 at 2 ranks, data parallel 2 × tensor parallel 2 at 4
# ---------------------------------------------------------------------------------------------


def _build(family: str, folder: str | None, *, tp: int = 1, ep: int = 1, **shape: Any) -> Any:
    """In a rank: the model as the trainer builds it (``build_parallelized`` over the job's mesh, with
    the :class:`JobShape` fields ``shape``), filled from a Hugging Face folder or (None) from seed 0;
    and the mesh."""
    import torch.distributed as dist

    from torchtitan_lite.checkpoint import hf_storage
    from torchtitan_lite.distributed import init_distributed
    from torchtitan_lite.distributed.job_shape import JobShape
    from torchtitan_lite.distributed.mesh import build_mesh
    from torchtitan_lite.distributed.parallel_dims import ParallelDims
    from torchtitan_lite.distributed.parallelize import build_parallelized
    from torchtitan_lite.models import get_model_spec

    init_distributed(CPU)
    world = dist.get_world_size()
    mesh = build_mesh(CPU, ParallelDims.resolve(dp_replicate=1, dp_shard=-1, tp=tp, ep=ep, world_size=world))
    spec = get_model_spec(family)
    if folder is None:
        args = spec.model_args("tiny")
    else:
        args = spec.hf.args_from_config(json.loads((Path(folder) / "config.json").read_text()))
    job = JobShape(world_size=world, tensor_parallel=tp, expert_parallel=ep, device_type="cpu").replace(**shape)
    model = build_parallelized(spec, args, mesh, device=CPU, seed=0, shape=job).model
    if folder is not None:
        hf_storage.load_hf_weights(model, folder, spec=spec, buffer_device=CPU)
    return model, mesh


def _generate_on_ranks(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """In a rank, for each case: build its model, generate its data-parallel share of the prompts
    (``shares[dp_rank]``); the completions, and whether every parameter is a shard again after."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    out = []
    for case in cases:
        model, mesh = _build(case["family"], case["folder"], tp=case.get("tp", 1), ep=case.get("ep", 1),
                             **case.get("shape", {}))
        model.train()
        batch = torch.randint(1, 300, (2, 16), generator=torch.Generator().manual_seed(mesh.dp_rank))
        if case.get("weights"):  # a training step's forward and backward before generation
            before = model(batch)
            before.sum().backward()
        engine = DecoderRollouts(model, device=CPU, pad_id=PAD, group=dist.group.WORLD,
                                 max_batch=case.get("max_batch"))
        completions = engine.generate(case["shares"][mesh.dp_rank], case["params"], seed=case.get("seed", 0))
        out.append({"tokens": [c.token_ids for c in completions], "completions": completions,
                    "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
                    "training": model.training})
        if case.get("weights"):  # the training forward after generation: the same logits, and a backward
            after = model(batch)
            out[-1]["same_training_logits"] = torch.equal(after, before)
            after.sum().backward()
            # what an external engine's update_weights would take
            from torchtitan_lite.models import get_model_spec

            out[-1]["weights"] = dict(hf_named_tensors(model, spec=get_model_spec(case["family"])))
        dist.barrier(group=dist.group.WORLD)
    from torchtitan_lite.distributed import destroy_distributed

    destroy_distributed()
    return out


@pytest.mark.slow
def test_two_fsdp_ranks_generate_transformers_tokens(references: dict[str, Any]) -> None:
    """2 ranks, FSDP2: rank 0 completes 40 prompts in chunks of 16 (3 chunks), rank 1 the other 24 (2
    chunks, and a chunk of padding rows to keep the forwards in step); plain, and with full activation
    checkpointing, CPU offload and resharding after every forward. Each rank's completions are
    transformers' for its prompts; afterwards every parameter is a shard again, and a training
    forward gives the logits it gave before generation (then runs its backward). The weights an
    external engine would be handed (``hf_named_tensors``, gathered) are transformers' state dict."""
    cases, expected = [], []
    for family, ref in references.items():
        shares = [ref["prompts"][:40], ref["prompts"][40:]]
        for shape in ({}, {"ac_mode": "full", "cpu_offload": True, "reshard_after_forward_mode": "always"}):
            cases.append({"family": family, "folder": str(ref["folder"]), "shares": shares, "shape": shape,
                          "params": _greedy(ref["eos"]), "max_batch": 16, "weights": not shape})
            expected.append((family, shape, [ref["completions"][:40], ref["completions"][40:]]))
    ranks = run_distributed(_generate_on_ranks, 2, cases)
    for rank, results in enumerate(ranks):
        for (family, shape, wanted), result in zip(expected, results, strict=True):
            assert result["tokens"] == wanted[rank], (family, shape, rank)
            assert result["sharded"] and result["training"], (family, shape)
            if "weights" in result:
                assert result["same_training_logits"], family
                _check_hf_weights(result["weights"], references[family]["folder"])


def _check_hf_weights(weights: dict[str, torch.Tensor], folder: Path) -> None:
    """``weights`` are the state dict transformers loads from ``folder`` (a tied output projection once)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    expected = {k: v for k, v in model.state_dict().items()
                if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    assert sorted(weights) == sorted(expected)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_data_parallel_2_by_tensor_parallel_2_generates_transformers_tokens(
        references: dict[str, Any], family: str) -> None:
    """4 ranks, data parallel 2 × tensor parallel 2 (sequence parallel; the logits split over the
    vocabulary, or for Qwen3 gathered: loss parallel off): each tensor-parallel pair completes its
    data-parallel share (40 and 24 prompts) with the same tokens on both ranks, transformers' tokens."""
    ref = references[family]
    case = {"family": family, "folder": str(ref["folder"]), "shares": [ref["prompts"][:40], ref["prompts"][40:]],
            "params": _greedy(ref["eos"]), "tp": 2, "shape": {"loss_parallel": family == "llama3"}}
    ranks = run_distributed(_generate_on_ranks, 4, [case])
    wanted = [ref["completions"][:40], ref["completions"][40:]]
    for rank, (result,) in enumerate(ranks):
        assert result["tokens"] == wanted[rank // 2], rank


def _full_forward_greedy(model: torch.nn.Module, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy completions without a cache: a full forward of each row's sequence per token."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(n):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
            out.append(seq[len(prompt):])
    return out


@pytest.mark.slow
@pytest.mark.scenario
def test_latent_attention_at_tensor_parallel_2_generates_one_process_tokens() -> None:
    """DeepSeek-V3's latent attention (tiny, from seed 0) at data parallel 2 × tensor parallel 2
    gives the tokens of the same model on one process."""
    from torchtitan_lite.distributed.parallelize import build_sharded_model
    from torchtitan_lite.models import get_model_spec

    spec = get_model_spec("deepseek_v3")
    model = build_sharded_model(spec, spec.model_args("tiny"), None, device=CPU, seed=0, sharded=False)
    prompts = _prompts(12, vocab=258)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    wanted = [c.token_ids for c in DecoderRollouts(model, device=CPU, pad_id=PAD).generate(prompts, params, seed=0)]
    case = {"family": "deepseek_v3", "folder": None, "shares": [prompts[:7], prompts[7:]], "params": params, "tp": 2}
    ranks = run_distributed(_generate_on_ranks, 4, [case])
    for rank, (result,) in enumerate(ranks):
        assert result["tokens"] == (wanted[:7], wanted[7:])[rank // 2], rank


@pytest.mark.scenario  # (generation kept in step over the ranks: the FSDP test in the default selection)
@pytest.mark.slow
def test_experts_spread_over_two_ranks_generate_one_process_tokens(tmp_path: Path) -> None:
    """A Qwen3-MoE made by transformers (8 experts, top 2) at expert parallel 2, each rank holding
    4 experts: rank 0 completes 7 prompts in chunks of 3 (3 chunks), rank 1 the other 5 (2 chunks,
    then one of padding rows: every forward's all-to-all of the experts' tokens needs both ranks),
    greedy; each rank's completions are one process's for its prompts."""
    from tests.test_trainer_moe import hf_qwen3_moe

    folder = hf_qwen3_moe(tmp_path / "hf")
    prompts = _prompts(12, vocab=258)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    model = our_model(folder, "qwen3_moe")
    wanted = [c.token_ids for c in DecoderRollouts(model, device=CPU, pad_id=PAD).generate(prompts, params, seed=0)]
    case = {"family": "qwen3_moe", "folder": str(folder), "shares": [prompts[:7], prompts[7:]], "params": params,
            "ep": 2, "max_batch": 3}
    ranks = run_distributed(_generate_on_ranks, 2, [case])
    assert len({tuple(t) for t in wanted}) > 1
    for rank, (result,) in enumerate(ranks):
        assert result["tokens"] == (wanted[:7], wanted[7:])[rank], rank
        assert result["sharded"]


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_latent_attention_and_experts_generate_what_full_forwards_give(family: str) -> None:
    """DeepSeek-V3's latent attention (its own key and value widths in the cache) and Qwen3-MoE's
    experts: greedy completions through the cache are those of a full forward per token."""
    from torchtitan_lite.distributed.parallelize import build_sharded_model
    from torchtitan_lite.models import get_model_spec

    spec = get_model_spec(family)
    model = build_sharded_model(spec, spec.model_args("tiny"), None, device=CPU, seed=0, sharded=False)
    prompts = _prompts(6, vocab=258)
    completions = DecoderRollouts(model, device=CPU, pad_id=PAD).generate(
        prompts, SamplingParams(max_new_tokens=6, temperature=0.0), seed=0)
    assert [c.token_ids for c in completions] == _full_forward_greedy(model, prompts, 6)


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(references: dict[str, Any]) -> torch.nn.Module:
    return our_model(references["llama3"]["folder"], "llama3")


def _teacher_forced(model: torch.nn.Module, prompt: list[int], completion: list[int],
                    temperature: float) -> list[float]:
    """``log_softmax(logits / temperature)`` of each completion token from one forward of prompt + completion."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion]))[0, len(prompt) - 1 : -1]
    logprobs = (logits / (temperature or 1.0)).log_softmax(-1)
    return logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


def test_logprobs_are_those_of_a_teacher_forced_forward(llama: torch.nn.Module) -> None:
    """Sampled at temperature 0.7 with top-k 50 and top-p 0.9 (and greedy): each token's log-probability
    is that of a teacher-forced forward of prompt + completion at the same temperature (before the
    filtering), within 1e-5."""
    prompts = _prompts(8, seed=1)
    engine = DecoderRollouts(llama, device=CPU, pad_id=PAD)
    for params in (SamplingParams(max_new_tokens=12, temperature=0.7, top_k=50, top_p=0.9),
                   SamplingParams(max_new_tokens=12, temperature=0.0)):
        for prompt, c in zip(prompts, engine.generate(prompts, params, seed=3), strict=True):
            assert c.finish_reason == "length" and len(c.token_ids) == 12
            expected = _teacher_forced(llama, prompt, c.token_ids, params.temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(expected), rtol=0, atol=1e-5)


def test_seeds_top_k_and_temperature(llama: torch.nn.Module) -> None:
    """The same seed gives the same completions, another seed others; top-k 1 is greedy."""
    prompts = _prompts(16, seed=2)
    engine = DecoderRollouts(llama, device=CPU, pad_id=PAD, max_batch=5)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    first = engine.generate(prompts, params, seed=11)
    assert engine.generate(prompts, params, seed=11) == first
    other = engine.generate(prompts, params, seed=12)
    assert sum(a.token_ids != b.token_ids for a, b in zip(first, other, strict=True)) >= 8
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0), seed=0)
    top1 = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.3, top_k=1), seed=5)
    assert [c.token_ids for c in top1] == [c.token_ids for c in greedy]


def test_top_k_and_top_p_filter_as_transformers_warpers() -> None:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scores = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 3
    scores[0, :5] = 10.0  # ties at the top
    for top_k, top_p in ((0, 0.9), (20, 1.0), (20, 0.5), (1, 1.0), (0, 0.01), (400, 0.999)):
        expected = scores
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1.0:
            expected = TopPLogitsWarper(top_p)(None, expected)
        assert torch.equal(filter_logits(scores, top_k=top_k, top_p=top_p), expected), (top_k, top_p)


def test_stop_tokens_stop_strings_and_the_length_limit(llama: torch.nn.Module) -> None:
    """A stop token ends a completion with ``stop``, kept; a stop string ends it with the token that
    completes the string; ``max_new_tokens`` ends it with ``length``."""
    prompts = _prompts(12, seed=4)

    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)

    engine = DecoderRollouts(llama, device=CPU, pad_id=PAD, decode=decode)
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=20, temperature=1.0), seed=1)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 20 for c in sampled)
    # Stop tokens: the third token of some completions, which then end there.
    stops = tuple({c.token_ids[2] for c in sampled[:3]})
    stopped = engine.generate(prompts, SamplingParams(max_new_tokens=20, temperature=1.0, stop_token_ids=stops),
                              seed=1)
    for full, c in zip(sampled, stopped, strict=True):
        cut = next((i + 1 for i, t in enumerate(full.token_ids) if t in stops), None)
        assert c.token_ids == full.token_ids[: cut or 20]
        assert c.finish_reason == ("stop" if cut else "length")
        assert c.logprobs == pytest.approx(full.logprobs[: cut or 20], abs=1e-6)
    assert [c.finish_reason for c in stopped[:3]] == ["stop"] * 3
    # Stop strings: two letters some completions spell at their 5th and 6th tokens.
    strings = (decode(sampled[0].token_ids[4:6]), decode(sampled[1].token_ids[4:6]))
    by_string = engine.generate(prompts, SamplingParams(max_new_tokens=20, temperature=1.0, stop_strings=strings),
                                seed=1)
    for full, c in zip(sampled, by_string, strict=True):
        assert c.token_ids == full.token_ids[: len(c.token_ids)]
        text = decode(c.token_ids)
        if c.finish_reason == "stop":
            assert any(s in text for s in strings) and not any(s in decode(c.token_ids[:-1]) for s in strings)
        else:
            assert len(c.token_ids) == 20 and not any(s in text for s in strings)
    assert by_string[0].finish_reason == by_string[1].finish_reason == "stop"
    assert len(by_string[0].token_ids) <= 6


def test_generation_leaves_the_training_forward_and_modes_as_they_were(llama: torch.nn.Module) -> None:
    """Generation runs in eval mode without gradients and restores each module's mode; the training
    forward's logits after it are bit-identical to those before."""
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    llama.train()
    llama.layers["1"].eval()
    before = llama(tokens)
    modes = []
    hook = llama.layers["0"].register_forward_pre_hook(lambda module, args: modes.append(
        (module.training, torch.is_grad_enabled())))
    DecoderRollouts(llama, device=CPU, pad_id=PAD).generate(_prompts(3), SamplingParams(max_new_tokens=3), seed=0)
    hook.remove()
    assert modes and set(modes) == {(False, False)}
    assert llama.training and llama.layers["0"].training and not llama.layers["1"].training
    assert torch.equal(llama(tokens), before)
    llama.eval()


def test_hf_named_tensors_are_the_transformers_state_dict(references: dict[str, Any]) -> None:
    for family, ref in references.items():
        from torchtitan_lite.models import get_model_spec

        model = our_model(ref["folder"], family)
        _check_hf_weights(dict(hf_named_tensors(model, spec=get_model_spec(family))), ref["folder"])


def test_bad_settings_are_one_line(llama: torch.nn.Module) -> None:
    for kwargs, match in (
        ({"max_new_tokens": 0}, r"max_new_tokens=0; expected an integer >= 1$"),
        ({"max_new_tokens": 4, "temperature": -1.0}, r"temperature=-1.0; expected a finite number >= 0"),
        ({"max_new_tokens": 4, "top_p": 0.0}, r"top_p=0.0; expected 0 < top_p <= 1$"),
        ({"max_new_tokens": 4, "top_k": -2}, r"top_k=-2; expected an integer >= 0 \(0: off\)$"),
    ):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kwargs)
    engine = DecoderRollouts(llama, device=CPU, pad_id=PAD)
    with pytest.raises(ValueError, match=r"prompt 1 is empty; expected at least one token$"):
        engine.generate([[1], []], SamplingParams(max_new_tokens=4), seed=0)
    with pytest.raises(ValueError, match=r"max_new_tokens 250 exceeds the model's max_seq_len 256$"):
        engine.generate([[1] * 10], SamplingParams(max_new_tokens=250), seed=0)
    with pytest.raises(ValueError, match=r"stop_strings need the token decoder"):
        engine.generate([[1]], SamplingParams(max_new_tokens=4, stop_strings=("x",)), seed=0)
    with pytest.raises(ValueError, match=r"pad_id=300 is not a token of the 300-token vocabulary$"):
        DecoderRollouts(llama, device=CPU, pad_id=300)


def test_the_cache_checks_its_steps_and_sequence_parallel_shapes(llama: torch.nn.Module) -> None:
    """The prefill takes the prompts' length, then one token per row, up to the capacity; under
    sequence parallel over 2 ranks a step of an odd number of rows (or prompt positions) is refused
    before the cache changes."""
    from torchtitan_lite.models.kv_cache import KVCache

    cache = KVCache(torch.ones(3, 4, dtype=torch.bool), 5)
    with pytest.raises(ValueError, match=r"the first forward takes the 4 prompt positions, got 2$"):
        cache.step(2)
    with torch.no_grad():
        assert llama(torch.ones(3, 4, dtype=torch.long), cache=cache).shape == (3, 1, 300)
        with pytest.raises(ValueError, match=r"one token per row per forward, got 2$"):
            llama(torch.ones(3, 2, dtype=torch.long), cache=cache)
        assert llama(torch.ones(3, 1, dtype=torch.long), cache=cache).shape == (3, 1, 300)
        with pytest.raises(ValueError, match=r"all 5 slots are written$"):
            llama(torch.ones(3, 1, dtype=torch.long), cache=cache)
        llama.split_sequence_between_blocks(2)
        try:
            cache = KVCache(torch.ones(3, 4, dtype=torch.bool), 6)
            assert llama(torch.ones(3, 4, dtype=torch.long), cache=cache).shape == (3, 1, 300)
            with pytest.raises(ValueError, match=r"^generation under sequence parallel: 3 rows is not a multiple of "
                                                 r"the 2 ranks the sequence is split over$"):
                llama(torch.ones(3, 1, dtype=torch.long), cache=cache)
            assert cache.length == 4
            with pytest.raises(ValueError, match=r"3 prompt positions is not a multiple"):
                llama(torch.ones(2, 3, dtype=torch.long), cache=KVCache(torch.ones(2, 3, dtype=torch.bool), 4))
        finally:
            llama.split_sequence_between_blocks(1)


def test_context_and_pipeline_parallel_are_refused() -> None:
    from torchtitan_lite.models import get_model_spec

    spec = get_model_spec("llama3")
    model = spec.model_cls(spec.model_args("tiny"))
    model.use_context_parallel(object())
    with pytest.raises(ValueError, match=r"^DecoderRollouts: the model is context parallel, which generation does "
                                         r"not support; build the rollout model with context_parallel_degree = 1$"):
        DecoderRollouts(model, device=CPU, pad_id=PAD)
    model = spec.model_cls(spec.model_args("tiny"))
    model.pipeline_stages = {}
    with pytest.raises(ValueError, match=r"split into pipeline stages, which generation does not support"):
        DecoderRollouts(model, device=CPU, pad_id=PAD)


def test_compiled_blocks_give_eager_tokens_and_compile_nothing_while_generating(references: dict[str, Any]) -> None:
    """Blocks compiled (after activation checkpointing, as the trainer builds them) and trained one
    step: generation gives the eager model's tokens and compiles no graph; the training forward
    after it compiles nothing new either."""
    from torch._dynamo.utils import counters

    from torchtitan_lite.checkpoint import hf_storage
    from torchtitan_lite.distributed.parallelize import build_sharded_model
    from torchtitan_lite.models import get_model_spec

    ref = references["llama3"]
    spec = get_model_spec("llama3")
    args = spec.hf.args_from_config(json.loads((ref["folder"] / "config.json").read_text()))
    model = build_sharded_model(spec, args, None, device=CPU, seed=0, sharded=False, compile_model=True,
                                compile_backend="aot_eager", ac_mode="full")
    hf_storage.load_hf_weights(model, ref["folder"], spec=spec)
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    counters.clear()
    model.train()
    model(tokens).sum().backward()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    prompts = ref["prompts"][:24]
    completions = DecoderRollouts(model, device=CPU, pad_id=PAD).generate(prompts, _greedy(ref["eos"]), seed=0)
    assert [c.token_ids for c in completions] == ref["completions"][:24]
    assert counters["stats"]["unique_graphs"] == graphs
    model(tokens).sum().backward()
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()
