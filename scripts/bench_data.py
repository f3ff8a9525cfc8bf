"""Start-up of a streamed Parquet dataset against tokenizing it whole, as a ratio in one run.

    python scripts/bench_data.py [--mb 50] [--tokenizer_path PATH] [--seq_len 2048] [--folder DIR]

Writes a Parquet file of about ``--mb`` MB of text (this Python's standard-library sources,
repeated), then measures on this process: the streamed source's start-up (index the file, build
the loader of one of 2 data-parallel ranks, read its first global batch), its time per later
global batch, and tokenizing the whole file up front (what the ``text`` dataset does).
"""

from __future__ import annotations

import argparse
import sysconfig
import tempfile
import time
from pathlib import Path

from torchtitan_lite.arrow_data import ArrowCorpus, StreamingLoader
from torchtitan_lite.data import build_token_stream, build_tokenizer


def write_corpus(path: Path, megabytes: float) -> int:
    """A Parquet file of about ``megabytes`` MB of text; returns its rows."""
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
    pq.write_table(pa.table({"text": rows}), path, row_group_size=1000)
    return len(rows)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50.0, help="MB of text to generate")
    parser.add_argument("--tokenizer_path", default=None, help="tokenizer.json / tokenizer.model (default: bytes)")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--global_batch_size", type=int, default=8)
    parser.add_argument("--folder", default=None, help="where to write the file (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(args.folder or tmp) / "bench.parquet"
        file.parent.mkdir(parents=True, exist_ok=True)
        rows = write_corpus(file, args.mb)
        tokenizer = build_tokenizer(args.tokenizer_path)
        start = time.perf_counter()
        corpus = ArrowCorpus("parquet", str(file))
        loader = StreamingLoader(corpus, tokenizer, seq_len=args.seq_len, global_batch_size=args.global_batch_size,
                                 local_batch_size=args.global_batch_size // 2, dp_rank=0, dp_size=2)
        loader.next_batch()
        streamed = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(10):
            loader.next_batch()
        per_batch = (time.perf_counter() - start) / 10
        start = time.perf_counter()
        tokens = len(build_token_stream("parquet", str(file), tokenizer))
        whole = time.perf_counter() - start
    result = {"rows": rows, "tokens": tokens, "streamed_first_batch_s": streamed, "streamed_per_batch_s": per_batch,
              "tokenize_all_s": whole, "ratio": whole / streamed}
    print(f"{args.mb:.0f} MB of text, {rows} rows, {tokens} tokens ({type(tokenizer).__name__}): streamed "
          f"source's first batch after {streamed:.3f} s, then {per_batch * 1e3:.1f} ms per global batch "
          f"(one rank of 2); tokenizing it all first: {whole:.1f} s ({whole / streamed:.0f}x the streamed start-up)")
    return result


if __name__ == "__main__":
    main()
