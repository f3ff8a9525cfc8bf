"""Rollouts: batched generation with a KV cache, on the model exactly as the trainer built it.

:class:`RolloutEngine` is what an online RL objective (GRPO) asks for completions; :class:`DecoderRollouts`
answers it with the training model itself (:meth:`~torchtitan_lite.models.decoder.Decoder.forward` with a
:class:`~torchtitan_lite.models.kv_cache.KVCache`), and an inference engine (vLLM, SGLang) may take its
place behind the same two methods.

How a batch runs (``docs/rollouts.md``): the prompts are left-padded, each row's RoPE positions start at
0 at its first real token and padding is masked out; one forward over the prompts fills each layer's
cache (allocated for the prompts' length plus ``max_new_tokens``), then one forward per step takes each
row's last token. Rows that finished keep running on ``pad_id`` until every row is done (or
``max_new_tokens``).

On the training layout:

- **FSDP2**: each forward is a training forward: every unit gathered before it runs and freed after
  (no second copy of the weights); every rank of ``group`` runs the same number of forwards, since
  each unit's all-gather is a collective: "every row done" is all-reduced over ``group`` each step,
  and the number of chunks (``max_batch``) too, a rank with fewer running chunks of padding.
- **Tensor parallel** with sequence parallel and loss parallel: the ranks of a ``tp`` group get the
  same prompts and seed. Sequence parallel splits the hidden states between blocks over the ``tp``
  ranks along the sequence, which a decode step (one position) cannot be: the decoder runs a decode
  step's rows as one sequence of ``bs`` tokens (everything but attention works per token; its
  cached attention reads the rows back out), so sequence parallel splits the step by rows, with the
  plan unchanged. The batch is padded to a multiple of ``tp`` rows, the prompts to a multiple of
  ``tp`` positions. The logits, split over the vocabulary (loss parallel), are gathered, so every
  rank of the group samples the same tokens from the same generator.
- **Activation checkpointing** costs nothing under ``no_grad``; **compiled blocks** run their eager
  forward during generation (``torch.compiler.set_stance("force_eager")``): the compiled graphs are
  training's shapes, and the prefill and each decode step would otherwise compile their own.
- **CPU offload**: FSDP moves each unit to the device for its forward, as in training.
- Context parallel and pipeline parallel are refused (one line).

:func:`torchtitan_lite.checkpoint.hf_storage.hf_named_tensors` (``TrainingEngine.export_weights``)
gives an external engine's :meth:`RolloutEngine.update_weights` the trainer's weights, whole, under
Hugging Face's names.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from torchtitan_lite.distributed.fsdp import reshard_all
from torchtitan_lite.models.decoder import Decoder
from torchtitan_lite.models.kv_cache import KVCache

__all__ = ["Completion", "DecoderRollouts", "RolloutEngine", "SamplingParams", "filter_logits", "generation_mode",
           "sample_tokens"]


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled."""

    max_new_tokens: int
    """Tokens generated at most per prompt (a completion that reaches it ends with ``"length"``)."""
    temperature: float = 1.0
    """Logits are divided by it; 0: greedy (the argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: the most likely tokens whose probabilities sum to ``top_p`` (as transformers
    defines it: tokens with a cumulative probability, counted from the least likely, of at most
    ``1 - top_p`` are removed; the most likely is always kept); 1: off."""
    top_k: int = 0
    """Only the ``top_k`` most likely tokens (and any tied with the last); 0: off."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a completion (e.g. EOS); the stop token is kept in it."""
    stop_strings: tuple[str, ...] = ()
    """Strings that end a completion (needs the engine's ``decode``); the completion ends with the
    token that completes the string."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams: max_new_tokens={self.max_new_tokens!r}; expected an integer >= 1")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"SamplingParams: temperature={self.temperature!r}; expected a finite number >= 0 "
                             "(0: greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: top_p={self.top_p!r}; expected 0 < top_p <= 1")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams: top_k={self.top_k!r}; expected an integer >= 0 (0: off)")
        if any(not s for s in self.stop_strings):
            raise ValueError(f"SamplingParams: stop_strings={self.stop_strings!r}; expected non-empty strings")


@dataclass
class Completion:
    """One prompt's completion."""

    token_ids: list[int]
    """The generated tokens (a stop token included)."""
    logprobs: list[float]
    """Per token: ``log_softmax(logits / temperature)[token]`` of the full distribution (before top-k /
    top-p filtering; at temperature 0, of ``logits / 1``): what a teacher-forced forward of prompt +
    completion gives at the same temperature."""
    finish_reason: str
    """``"stop"`` (a stop token or string) or ``"length"`` (``max_new_tokens`` reached: truncated)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What produces completions: ours (:class:`DecoderRollouts`) or an inference engine (vLLM / SGLang)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seed: int) -> list[Completion]:
        """One completion per prompt, in order; the same seed gives the same completions."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take the trainer's new weights (after an optimizer step): an external engine loads them;
        one that generates on the training model has nothing to do."""
        ...


def filter_logits(scores: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``scores`` ``(rows, vocab)`` (logits divided by the temperature) with the tokens top-k and then
    top-p remove set to ``-inf``, as transformers' ``TopKLogitsWarper`` and ``TopPLogitsWarper`` do."""
    if top_k > 0:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False  # the most likely token stays
        scores = scores.masked_fill(remove.scatter(-1, order, remove), -math.inf)
    return scores


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row of ``logits`` ``(rows, vocab)`` and its log-probability
    (see :attr:`Completion.logprobs`): the argmax at temperature 0, else a draw from ``generator``
    among the tokens top-k and top-p keep."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        logprobs = logits.log_softmax(dim=-1)
    else:
        scaled = logits / params.temperature
        logprobs = scaled.log_softmax(dim=-1)
        kept = filter_logits(scaled, top_k=params.top_k, top_p=params.top_p)
        tokens = torch.multinomial(kept.softmax(dim=-1), 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


@contextlib.contextmanager
def generation_mode(model: nn.Module) -> Iterator[None]:
    """Within: no gradients, every module in eval mode (each module's own mode restored after),
    compiled code run eagerly, and afterwards every FSDP unit resharded."""
    modes = [(module, module.training) for module in model.modules()]
    # (nothing is compiled where dynamo was never imported, and importing it takes seconds)
    eager = torch.compiler.set_stance("force_eager") if "torch._dynamo" in sys.modules else contextlib.nullcontext()
    model.eval()
    try:
        with torch.no_grad(), eager:
            yield
    finally:
        for module, training in modes:
            module.training = training
        reshard_all(model)


class DecoderRollouts:
    """:class:`RolloutEngine` on the training model itself (see the module's docstring).

    ``model``: the decoder as the trainer built it (plain, FSDP2-sharded, tensor parallel, checkpointed,
    compiled, offloaded); ``device``: where its forward runs; ``pad_id``: the token that pads prompts
    and feeds finished rows (masked out); ``group``: the ranks that must run the same forwards (every
    rank FSDP or tensor parallel exchanges with; None: the default group when one is initialized, else
    none); ``decode``: token ids → text, for ``stop_strings``; ``max_batch``: prompts per forward at
    most (None: all of a call's prompts at once).
    """

    def __init__(self, model: nn.Module, *, device: torch.device, pad_id: int, group: ProcessGroup | None = None,
                 decode: Callable[[list[int]], str] | None = None, max_batch: int | None = None) -> None:
        if not isinstance(model, Decoder):  # (what it reads below, the Decoder declares)
            raise ValueError(f"DecoderRollouts: {type(model).__name__} is not a Decoder (no forward with a KV cache)")
        if model.context_parallel is not None:
            raise ValueError("DecoderRollouts: the model is context parallel, which generation does not support; "
                             "build the rollout model with context_parallel_degree = 1")
        if model.pipeline_stages is not None:
            raise ValueError("DecoderRollouts: the model is split into pipeline stages, which generation does not "
                             "support; build the rollout model with pipeline_parallel_degree = 1")
        args = model.args
        if not 0 <= pad_id < args.vocab_size:
            raise ValueError(f"DecoderRollouts: pad_id={pad_id} is not a token of the {args.vocab_size}-token "
                             "vocabulary")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"DecoderRollouts: max_batch={max_batch}; expected an integer >= 1 or None")
        self.model = model
        self.device = torch.device(device)
        self.pad_id = pad_id
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self.group = group
        self.decode = decode
        self.max_batch = max_batch
        self.shards = model.sequence_shards
        """The ranks sequence parallel splits a step over: rows and prompt positions are padded to a multiple."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing: this engine generates with the training model, whose weights are the new ones."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seed: int) -> list[Completion]:
        """One completion per prompt, in order. Every rank of the group calls it (with its own prompts,
        any number; the ranks of a tensor-parallel group with the same prompts and seed)."""
        args = self.model.args
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"generate: prompt {i} is empty; expected at least one token")
            if min(prompt) < 0 or max(prompt) >= args.vocab_size:
                raise ValueError(f"generate: prompt {i} has a token outside the {args.vocab_size}-token vocabulary")
        longest = max((len(p) for p in prompts), default=0)
        if longest + params.max_new_tokens > args.max_seq_len:
            raise ValueError(f"generate: the longest prompt ({longest} tokens) plus max_new_tokens "
                             f"{params.max_new_tokens} exceeds the model's max_seq_len {args.max_seq_len}")
        if params.stop_strings and self.decode is None:
            raise ValueError("generate: stop_strings need the token decoder (DecoderRollouts(decode=...))")
        size = self.max_batch or max(len(prompts), 1)
        chunks = [prompts[i : i + size] for i in range(0, len(prompts), size)]
        count = len(chunks)
        if self.group is not None:  # every rank runs as many chunks (forwards) as the rank with the most
            count = int(self._all_reduce(count, dist.ReduceOp.MAX))
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        completions: list[Completion] = []
        with generation_mode(self.model):
            for index in range(count):
                completions += self._generate_chunk(chunks[index] if index < len(chunks) else [], params, generator)
        return completions

    def _all_reduce(self, value: int, op: Any) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=op, group=self.group)
        return int(tensor.item())

    def next_logits(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One forward through ``cache`` (the prompts, then one token per row): each row's
        next-token logits ``(bs, vocab)``, whole on every rank (gathered over the vocabulary under
        loss parallel). Inside :func:`generation_mode`."""
        logits = self.model(tokens, cache=cache)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return logits[:, -1]

    def prefill(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[torch.Tensor, KVCache]:
        """A batch's first forward: ``prompts`` (none: one padding row) left-padded (the rows to a
        multiple of the sequence-parallel ranks, the positions too) into a :class:`KVCache` with
        room for ``max_new_tokens`` more; the next-token logits of every row of the batch
        (padding rows last) and the cache. Inside :func:`generation_mode`."""
        shards, pad = self.shards, self.pad_id
        rows = len(prompts)
        batch = -(-max(rows, 1) // shards) * shards
        prompt_len = -(-max((len(p) for p in prompts), default=1) // shards) * shards
        tokens = torch.full((batch, prompt_len), pad, dtype=torch.long)
        mask = torch.zeros(batch, prompt_len, dtype=torch.bool)
        for i in range(batch):  # left-padded; a padding row is one pad token
            prompt = prompts[i] if i < rows else [pad]
            tokens[i, prompt_len - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[i, prompt_len - len(prompt):] = True
        tokens, mask = tokens.to(self.device), mask.to(self.device)
        cache = KVCache(mask, prompt_len + max_new_tokens)
        return self.next_logits(tokens, cache), cache

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams,
                        generator: torch.Generator) -> list[Completion]:
        """Complete ``prompts`` (none: padding rows only, for a rank with fewer chunks) in one batch."""
        rows = len(prompts)
        logits, cache = self.prefill(prompts, params.max_new_tokens)
        batch = logits.shape[0]
        stop_ids = set(params.stop_token_ids)
        window = 4 * max((len(s) for s in params.stop_strings), default=0) + 4
        generated: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] = [[] for _ in range(rows)]
        finished = [False] * rows
        for step in range(params.max_new_tokens):
            next_tokens, next_logprobs = sample_tokens(logits, params, generator)
            for i, (token, logprob) in enumerate(zip(next_tokens[:rows].tolist(), next_logprobs[:rows].tolist(),
                                                     strict=True)):
                if finished[i]:
                    continue
                generated[i].append(token)
                logprobs[i].append(logprob)
                if token in stop_ids or (params.stop_strings and self._stopped(generated[i], params, window)):
                    finished[i] = True
            done = all(finished)
            if self.group is not None:
                done = bool(self._all_reduce(int(done), dist.ReduceOp.MIN))
            if done or step == params.max_new_tokens - 1:
                break
            running = torch.tensor([not f for f in finished] + [False] * (batch - rows), device=self.device)
            logits = self.next_logits(torch.where(running, next_tokens, self.pad_id)[:, None], cache)
        return [Completion(token_ids=generated[i], logprobs=logprobs[i],
                           finish_reason="stop" if finished[i] else "length") for i in range(rows)]

    def _stopped(self, generated: list[int], params: SamplingParams, window: int) -> bool:
        """Whether the completion's text now holds a stop string. Only its last ``window`` tokens are
        decoded (4 tokens a character, the most a byte-level tokenizer spends, beyond the longest
        string): a stop string is looked for after every token, so the one that completes it is the
        last."""
        text = self.decode(generated[-window:])  # type: ignore[misc]
        return any(s in text for s in params.stop_strings)
