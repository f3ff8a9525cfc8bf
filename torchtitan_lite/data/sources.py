"""The source kinds by name: checking a source's files, and opening it as windows for the loader.

A *source* is one dataset a job reads: ``training.dataset`` (with ``dataset_path``), an entry of
``[[training.datasets]]``, or a validation set. Its kind (``dataset``) is one of :data:`DATASETS`;
each kind lives in its own module (:mod:`.stdlib`, :mod:`.text`, :mod:`.c4`, :mod:`.tokens`,
:mod:`.arrow`), and this is the one place that maps names to them. The loader and the mixture
never name a kind: they get a reader (:class:`~torchtitan_lite.data.windows.WindowReader` for
sources tokenized or mapped whole, :class:`~torchtitan_lite.data.arrow.LaneReader` for streamed
ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan_lite.data import arrow, c4, chat, preference, prompts, stdlib, text, tokens
from torchtitan_lite.data.tokenizers import Tokenizer
from torchtitan_lite.data.windows import Encoder, PackedWindows, TokenStream, TokenWindows, WindowReader
from torchtitan_lite.errors import ConfigError

__all__ = ["DATASETS", "STREAMED", "SourceSpec", "check_dataset", "open_reader", "source_windows", "token_stream"]

_MODULES: dict[str, Any] = {kind: module for module in (stdlib, text, tokens, arrow, c4, chat, preference, prompts)
                            for kind in module.KINDS}
DATASETS: dict[str, str] = {kind: module.KINDS[kind] for kind, module in _MODULES.items()}
"""Every source kind and what it reads (shown in errors and ``--help``)."""
STREAMED = frozenset(arrow.KINDS)
"""The kinds read lazily, lane by lane, instead of tokenized or mapped whole at start-up."""


@dataclass(frozen=True)
class SourceSpec:
    """One source of a job, as its config gives it."""

    dataset: str
    dataset_path: str | None = None
    section: str = "training"
    """What errors name: ``training``, ``validation``, or ``training.datasets[NAME]``."""
    text_column: str = "text"
    token_dtype: str = "uint16"
    loss_on: str = "assistant"
    """Chat sources: which labels count (``training.loss_on``)."""
    truncate: str = "right"
    """Chat sources: what happens to a conversation longer than a window (``training.truncate``)."""
    chat_template: str | None = None
    """Chat sources: a .jinja template file instead of the tokenizer's (``training.chat_template``)."""
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()
    """Chat sources: the template's extra variables (``training.chat_template_kwargs``), as items."""
    cache_dir: str | None = None
    """Chat sources: where their encodings are kept (``training.chat_cache_dir``; None: not kept)."""
    on_bad_row: str = "stop"
    """Chat sources: stop on a row that cannot be used, or skip it (``training.on_bad_row``)."""
    packing: str = "greedy"
    """Chat sources: how conversations fill the windows (``training.packing``)."""
    pair_truncation: str = "keep_start"
    """Preference sources: how a pair longer than a window is cut (``dpo.truncation``)."""
    pair_packing: bool = False
    """Preference sources: whole pairs packed into the windows, in ``packing``'s order (``dpo.packing``)."""
    max_prompt_length: int = 0
    """Prompt sources: the tokens a prompt keeps (its last ones; ``training.seq_len −
    grpo.max_completion_length``)."""
    rollouts: bool = False
    """Prompt sources: each row a prompt group with its completions (``grpo.rollouts_path``)."""

    @property
    def key(self) -> str:
        if self.rollouts:
            return "grpo.rollouts_path"
        return f"{self.section}.dataset_path" if self.dataset_path is not None or self.dataset in STREAMED \
            else f"{self.section}.dataset"

    @property
    def where(self) -> str:
        return repr(self.dataset_path) if self.dataset_path is not None else repr(self.dataset)


def check_dataset(dataset: str, dataset_path: str | None, *, section: str = "training", key: str | None = None,
                  text_column: str = "text") -> list[Path]:
    """The files a source reads; cheap checks only (names, existence, suffixes; for Parquet and
    Arrow files the schema has ``text_column``). Raises :class:`~torchtitan_lite.errors.DataError`
    or :class:`~torchtitan_lite.errors.ConfigError` naming ``<section>.dataset`` /
    ``<section>.dataset_path`` (or ``key`` for the path, for callers with their own option names)."""
    if dataset in c4.HUB_ONLY:
        raise c4.hub_only_error(dataset, section)
    if dataset not in _MODULES:
        raise ConfigError(f"{section}.dataset: invalid value {dataset!r}; expected one of "
                          f"{', '.join(map(repr, DATASETS))}")
    key = key or f"{section}.dataset_path"
    if dataset in STREAMED:
        return arrow.find_files(dataset, dataset_path, section=section, key=key, text_column=text_column)
    return _MODULES[dataset].find_files(dataset, dataset_path, section=section, key=key)


def token_stream(spec: SourceSpec, tokenizer: Encoder, *, max_tokens: int | None = None) -> TokenStream:
    """Every document of a source tokenized and packed (token files: mapped). Streamed sources
    read their rows in order only until ``max_tokens`` tokens are packed (None: all). Raises
    :class:`~torchtitan_lite.errors.DataError` for a missing path, an empty source, unreadable
    files, or token ids the tokenizer's vocabulary does not have."""
    if spec.dataset in STREAMED:
        assert spec.dataset_path is not None
        return arrow.token_stream(spec.dataset, spec.dataset_path, tokenizer, section=spec.section,
                                  where=spec.where, text_column=spec.text_column, max_tokens=max_tokens)
    files = check_dataset(spec.dataset, spec.dataset_path, section=spec.section)
    if spec.dataset in tokens.KINDS:
        return tokens.token_stream(files, tokenizer, key=spec.key, where=spec.where, token_dtype=spec.token_dtype)
    if spec.dataset in chat.KINDS or spec.dataset in preference.KINDS or spec.dataset in prompts.KINDS:
        what = {**{k: "packed conversations" for k in chat.KINDS}, **{k: "preference pairs" for k in preference.KINDS},
                **{k: "prompts" for k in prompts.KINDS}}[spec.dataset]
        raise ConfigError(f"{spec.section}.dataset: {spec.dataset!r} is read as {what}, not as a token stream")
    return _MODULES[spec.dataset].token_stream(files, tokenizer, key=spec.key, where=spec.where)


def open_reader(spec: SourceSpec, tokenizer: Tokenizer, *, seq_len: int, global_batch_size: int, lanes: range,
                seed: int, shuffle: bool, shuffle_buffer: int, key: tuple[int, ...] = (),
                name: str | None = None) -> WindowReader | arrow.LaneReader:
    """A source's reader for the loader: streamed sources lane by lane (this rank's ``lanes`` of
    ``global_batch_size``), the others tokenized or mapped whole into windows. ``name``: the
    source's name in a mixture (None: the job's one ``training.dataset``)."""
    label = "training data" if name is None else f"training data {name!r}"
    if spec.dataset in STREAMED:
        assert spec.dataset_path is not None
        corpus = arrow.ArrowCorpus(spec.dataset, spec.dataset_path, text_column=spec.text_column,
                                   section=spec.section)
        return arrow.LaneReader(corpus, tokenizer, seq_len=seq_len, num_lanes=global_batch_size, lanes=lanes,
                                seed=seed, shuffle=shuffle, shuffle_buffer=shuffle_buffer, key=key, label=label)
    source = f"training dataset {spec.where}" if name is None else f"{spec.section} {spec.where}"
    return WindowReader(source_windows(spec, tokenizer, seq_len=seq_len, source=source), seed=seed, shuffle=shuffle,
                        key=key)


def source_windows(spec: SourceSpec, tokenizer: Tokenizer, *, seq_len: int, source: str,
                   seq_len_key: str = "training.seq_len", max_tokens: int | None = None,
                   ) -> TokenWindows | PackedWindows | preference.PairWindows | prompts.PromptWindows:
    """A source read whole into windows of ``seq_len + 1`` tokens: its token stream cut into
    windows, (chat) its conversations packed into them, (preference) a window per pair or whole
    pairs packed into them, or
    (prompts) a window per prompt. ``source`` names it in errors."""
    if spec.dataset in prompts.KINDS:
        files = check_dataset(spec.dataset, spec.dataset_path, section=spec.section, key=spec.key)
        return prompts.prompt_windows(files, tokenizer, max_prompt_length=spec.max_prompt_length, key=spec.key,
                                      where=spec.where, chat_template=spec.chat_template,
                                      template_kwargs=dict(spec.chat_template_kwargs), on_bad_row=spec.on_bad_row,
                                      rollouts=spec.rollouts)
    if spec.dataset in preference.KINDS:
        files = check_dataset(spec.dataset, spec.dataset_path, section=spec.section)
        return preference.pair_windows(files, tokenizer, seq_len=seq_len, key=spec.key, where=spec.where,
                                       chat_template=spec.chat_template,
                                       template_kwargs=dict(spec.chat_template_kwargs), on_bad_row=spec.on_bad_row,
                                       truncation=spec.pair_truncation,
                                       packing=spec.packing if spec.pair_packing else None)
    if spec.dataset in chat.KINDS:
        files = check_dataset(spec.dataset, spec.dataset_path, section=spec.section)
        return chat.packed_windows(files, tokenizer, seq_len=seq_len, loss_on=spec.loss_on, truncate=spec.truncate,
                                   key=spec.key, where=spec.where, chat_template=spec.chat_template,
                                   template_kwargs=dict(spec.chat_template_kwargs),
                                   cache_dir=None if spec.cache_dir is None else Path(spec.cache_dir),
                                   on_bad_row=spec.on_bad_row, packing=spec.packing)
    return TokenWindows(token_stream(spec, tokenizer, max_tokens=max_tokens), seq_len, seq_len_key=seq_len_key,
                        source=source)
