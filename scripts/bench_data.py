"""Data-loading speed, as ratios in one run: a streamed source against tokenizing it whole, and a
three-source mixture against its sources read alone.

    python scripts/bench_data.py [--mb 50] [--tokenizer_path PATH] [--seq_len 2048] [--folder DIR]

Writes about ``--mb`` MB of text (this Python's standard-library sources, repeated) as a Parquet
file, the same text as a JSON-lines folder and, tokenized, as a ``.npy`` token file. Then, on this
process, as data-parallel rank 0 of 2:

- the streamed Parquet source: start-up to its first global batch (index the file, build the
  loader, read a batch), its later global batches, and tokenizing the whole file up front (what
  the ``text`` source does) for comparison;
- each source alone (token file, Parquet, text folder) and the mixture of the three (weights
  0.5 / 0.3 / 0.2): start-up to the first batch and windows per second, medians of ``--rounds``
  alternating rounds. The mixture's windows/s
  is compared with what its sources alone give at those weights (time per window
  ``Σ w_s / rate_s``): the ratio is what mixing itself costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from torchtitan_lite.data import (
    BatchLoader,
    LoaderSource,
    SourceSpec,
    Tokenizer,
    build_tokenizer,
    open_reader,
    token_stream,
)

MIXTURE = (("tokens", 0.5), ("parquet", 0.3), ("text", 0.2))


def write_corpus(folder: Path, megabytes: float, tokenizer: Tokenizer) -> dict[str, str]:
    """About ``megabytes`` MB of text as a Parquet file, a JSON-lines folder and a token file;
    returns each source kind's path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    docs = [f.read_text(encoding="utf-8", errors="replace") for f in sources]
    rows: list[str] = []
    size = 0
    while size < megabytes * 1e6:
        doc = docs[len(rows) % len(docs)]
        rows.append(f"# copy {len(rows)}\n{doc}")
        size += len(rows[-1])
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": rows}), folder / "bench.parquet", row_group_size=1000)
    (folder / "text").mkdir(exist_ok=True)
    with (folder / "text" / "bench.jsonl").open("w", encoding="utf-8") as out:
        out.writelines(json.dumps({"text": row}) + "\n" for row in rows)
    ids = np.concatenate(tokenizer.encode_batch(rows)).astype(
        np.uint32 if tokenizer.vocab_size > 1 << 16 else np.uint16
    )
    np.save(folder / "bench.npy", ids)
    return {"parquet": str(folder / "bench.parquet"), "text": str(folder / "text"), "tokens": str(folder / "bench.npy")}


def build_loader(kinds: list[tuple[str, float]], paths: dict[str, str], tokenizer: Tokenizer, *, seq_len: int,
                 global_batch_size: int) -> BatchLoader:
    """Data-parallel rank 0 of 2 reading ``kinds`` (one source, or a mixture), shuffled."""
    lanes = range(global_batch_size // 2)
    sources = [LoaderSource(kind, open_reader(SourceSpec(kind, paths[kind]), tokenizer, seq_len=seq_len,
                                              global_batch_size=global_batch_size, lanes=lanes, seed=0, shuffle=True,
                                              shuffle_buffer=1000, key=(i,), name=kind), weight=weight)
               for i, (kind, weight) in enumerate(kinds)]
    return BatchLoader(sources, seq_len=seq_len, global_batch_size=global_batch_size,
                       local_batch_size=global_batch_size // 2, dp_rank=0, dp_size=2, named=len(kinds) > 1)


def measure(kinds: list[tuple[str, float]], paths: dict[str, str], tokenizer: Tokenizer, *, seq_len: int,
            global_batch_size: int, batches: int, warmup: int = 0) -> tuple[float, float]:
    """Start-up to the first global batch (s), and this rank's windows per second over ``batches``
    global batches after ``warmup`` more (by then every streamed range has filled its shuffle
    buffer, which a source alone does in its first batch and a mixture as the schedule first
    picks it in each range)."""
    start = time.perf_counter()
    loader = build_loader(kinds, paths, tokenizer, seq_len=seq_len, global_batch_size=global_batch_size)
    loader.next_batch()
    startup = time.perf_counter() - start
    for _ in range(warmup):
        loader.next_batch()
    start = time.perf_counter()
    for _ in range(batches):
        loader.next_batch()
    return startup, batches * (global_batch_size // 2) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50.0, help="MB of text to generate")
    parser.add_argument("--tokenizer_path", default=None, help="tokenizer.json / tokenizer.model (default: bytes)")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--global_batch_size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=400, help="global batches timed after the warm-up")
    parser.add_argument("--warmup", type=int, default=20, help="global batches read after the first, untimed")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of every run (medians reported)")
    parser.add_argument("--folder", default=None, help="where to write the files (default: a temporary folder)")
    args = parser.parse_args(argv)
    tokenizer = build_tokenizer(args.tokenizer_path)
    shape = {"seq_len": args.seq_len, "global_batch_size": args.global_batch_size}
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_corpus(Path(args.folder or tmp), args.mb, tokenizer)
        streamed, _ = measure([("parquet", 1.0)], paths, tokenizer, batches=0, **shape)
        start = time.perf_counter()
        tokens = len(token_stream(SourceSpec("parquet", paths["parquet"]), tokenizer))
        whole = time.perf_counter() - start
        result: dict[str, float] = {"tokens": tokens, "streamed_first_batch_s": streamed, "tokenize_all_s": whole,
                                    "ratio": whole / streamed}
        runs: dict[str, list[tuple[float, float]]] = {}
        for _ in range(args.rounds):  # alternating, so that a slower spell of the machine hits every run alike
            for kind, kinds in [*((k, [(k, 1.0)]) for k, _ in MIXTURE), ("mixture", list(MIXTURE))]:
                runs.setdefault(kind, []).append(measure(kinds, paths, tokenizer, batches=args.batches,
                                                         warmup=args.warmup, **shape))
        for kind, values in runs.items():  # medians over the rounds
            result[f"{kind}_first_batch_s"] = statistics.median(v[0] for v in values)
            result[f"{kind}_windows_per_s"] = statistics.median(v[1] for v in values)
    expected = 1 / sum(w / result[f"{kind}_windows_per_s"] for kind, w in MIXTURE)
    result["mixture_expected_windows_per_s"] = expected
    result["mixture_ratio"] = result["mixture_windows_per_s"] / expected
    print(f"{args.mb:g} MB of text, {tokens} tokens ({type(tokenizer).__name__}), seq_len {args.seq_len}, global "
          f"batch {args.global_batch_size}, rank 0 of 2; streamed Parquet: first batch after {streamed:.3f} s, "
          f"tokenizing it all first: {whole:.1f} s ({whole / streamed:.0f}x)")
    for kind in [k for k, _ in MIXTURE] + ["mixture"]:
        print(f"  {kind:8s} first batch after {result[f'{kind}_first_batch_s']:7.3f} s, then "
              f"{result[f'{kind}_windows_per_s']:9.1f} windows/s")
    print(
        f"  mixture 0.5/0.3/0.2 (medians of {args.rounds} rounds): {result['mixture_windows_per_s']:.1f} windows/s "
        f"against {expected:.1f} from its "
        f"sources alone at those weights: ratio {result['mixture_ratio']:.3f}"
    )
    return result


if __name__ == "__main__":
    main()
