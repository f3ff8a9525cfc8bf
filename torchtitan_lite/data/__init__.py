"""Data: tokenizers, the source kinds, the mixture, and the loader every source feeds.

Imports point one way, from the base up:

- :mod:`.files` (listing, checks) and :mod:`.windows` (token streams and windows);
- :mod:`.tokenizers`;
- one module per source kind: :mod:`.stdlib` (the embedded default), :mod:`.text` (``.txt`` /
  JSON lines), :mod:`.c4` (TorchTitan's names), :mod:`.tokens` (pre-tokenized files),
  :mod:`.arrow` (Parquet / Arrow, streamed), :mod:`.chat` (conversations for fine-tuning),
  :mod:`.preference` (pairs of answers for DPO);
  :mod:`.sources` maps the kinds' names to them;
- :mod:`.mixture` (which source each sample comes from) and :mod:`.loader` (the one contract:
  ``next_batch``, micro-batches, ``state_dict`` / ``load_state_dict``);
- :mod:`.build`: :func:`build_data`, which the trainer calls without naming a source kind.

Text is tokenized with BOS/EOS around every document, and the documents are packed back to back
into windows of ``seq_len + 1`` tokens. The loader's unit is the *global* batch: its samples are
fixed by the config and the seed alone, and each data-parallel rank takes its own slice, so a
run on 1 rank with gradient accumulation and a run on 4 ranks see the same samples at every step
and the loader state resumes on any world size.
"""

from torchtitan_lite.data.build import (
    build_data,
    check_sources,
    document_bounds,
    training_sources,
    validation_sources,
)
from torchtitan_lite.data.loader import BatchLoader, LoaderSource, MicroBatch, check_batch_split, micro_batches
from torchtitan_lite.data.preference import PackedPairWindows, PairWindows, pair_batch
from torchtitan_lite.data.sources import (
    DATASETS,
    STREAMED,
    SourceSpec,
    check_dataset,
    open_reader,
    token_stream,
)
from torchtitan_lite.data.text import MAX_INVALID_UTF8_FRACTION, read_documents
from torchtitan_lite.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    build_tokenizer,
    hf_tokenizer_json,
    read_tiktoken_ranks,
    tiktoken_to_tokenizer_json,
    tokenizer_file,
)
from torchtitan_lite.data.windows import (
    IGNORE_INDEX,
    PackedWindows,
    TokenStream,
    TokenWindows,
    WindowReader,
    num_batches,
    padded_batch,
    token_dtype_for,
)

__all__ = [
    "BatchLoader",
    "MicroBatch",
    "ByteTokenizer",
    "DATASETS",
    "HFTokenizer",
    "IGNORE_INDEX",
    "LoaderSource",
    "MAX_INVALID_UTF8_FRACTION",
    "PackedWindows",
    "PackedPairWindows",
    "PairWindows",
    "STREAMED",
    "SourceSpec",
    "TiktokenTokenizer",
    "TokenStream",
    "TokenWindows",
    "Tokenizer",
    "WindowReader",
    "build_data",
    "build_tokenizer",
    "check_batch_split",
    "check_dataset",
    "check_sources",
    "document_bounds",
    "hf_tokenizer_json",
    "micro_batches",
    "num_batches",
    "open_reader",
    "pair_batch",
    "padded_batch",
    "read_documents",
    "read_tiktoken_ranks",
    "tiktoken_to_tokenizer_json",
    "token_dtype_for",
    "token_stream",
    "tokenizer_file",
    "training_sources",
    "validation_sources",
]
