"""Convert JSON-lines shards (c4's ``.json.gz``, ``.jsonl``, ...) to Parquet files, once, so that
``training.dataset = "parquet"`` streams them instead of tokenizing everything at start-up.

    python scripts/jsonl_to_parquet.py --input c4/en --output c4_parquet [--pattern 'c4-train.*'] [--column text]

Each input file becomes one ``.parquet`` file of the same name, in the same subfolder under
``--output`` as it stood under ``--input`` (the ``text`` column, or ``--column``, and nothing
else), written in row groups of ``--rows_per_group`` rows while the input is read line by line, so
memory stays small whatever the shard's size. A finished output is never overwritten: a second
run skips the files already converted and goes on with the rest (a file is written as
``.partial`` and renamed when complete).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

_SUFFIXES = (".json.gz", ".jsonl.gz", ".json", ".jsonl")


def convert(source: Path, target: Path, *, column: str = "text", rows_per_group: int = 10_000) -> int:
    """Write ``source``'s records' ``column`` to ``target`` (Parquet); returns the rows written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([(column, pa.large_string())])
    opener = gzip.open if source.name.endswith(".gz") else open
    rows = 0
    batch: list[str] = []
    partial = target.with_name(target.name + ".partial")
    with opener(source, "rt", encoding="utf-8") as lines, pq.ParquetWriter(str(partial), schema) as writer:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get(column), str):
                raise SystemExit(f"{source}: line {lineno} has no string {column!r} field")
            batch.append(record[column])
            if len(batch) == rows_per_group:
                writer.write_table(pa.table({column: batch}, schema=schema))
                rows += len(batch)
                batch = []
        if batch:
            writer.write_table(pa.table({column: batch}, schema=schema))
            rows += len(batch)
    partial.rename(target)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="a JSON-lines file or a folder of them")
    parser.add_argument("--output", required=True, help="folder for the .parquet files")
    parser.add_argument("--pattern", default="*", help="glob of the input files to convert (default: all)")
    parser.add_argument("--column", default="text")
    parser.add_argument("--rows_per_group", type=int, default=10_000)
    args = parser.parse_args(argv)
    source = Path(args.input)
    files = [source] if source.is_file() else sorted(
        f for f in source.rglob(args.pattern) if f.is_file() and f.name.endswith(_SUFFIXES))
    if not files:
        print(f"error: no {' / '.join(_SUFFIXES)} files matching {args.pattern!r} in {str(source)!r}", file=sys.stderr)
        return 2
    out = Path(args.output)
    for file in files:
        stem = next(file.name[: -len(s)] for s in _SUFFIXES if file.name.endswith(s))
        folder = out / (file.parent.relative_to(source) if source.is_dir() else Path())
        target = folder / f"{stem}.parquet"
        if target.exists():
            print(f"{file}: {target} exists (converted before); skipped")
            continue
        folder.mkdir(parents=True, exist_ok=True)
        rows = convert(file, target, column=args.column, rows_per_group=args.rows_per_group)
        print(f"{file} -> {target}: {rows} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
