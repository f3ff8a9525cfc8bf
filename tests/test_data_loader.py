"""The loader (``torchtitan_lite/data/loader.py``) over one windowed source: slicing per rank, epochs,
its state. Several sources: tests/test_data_mixture.py; streamed ones: tests/test_data_arrow.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from torchtitan_lite.data import (
    BatchLoader,
    ByteTokenizer,
    LoaderSource,
    TokenWindows,
    WindowReader,
)
from torchtitan_lite.errors import DataError


def _loader(windows, *, global_bs, local_bs, rank, dp, seed=7):
    return BatchLoader([LoaderSource("w", WindowReader(windows, seed=seed, shuffle=True))], seq_len=windows.seq_len,
                       global_batch_size=global_bs, local_batch_size=local_bs, dp_rank=rank, dp_size=dp)


def _step_rows(loader):
    return torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in loader.next_batch()])


# --------------------------------------------------------------------------------------------
# The loader
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dp, local_bs", [(1, 8), (1, 2), (2, 4), (4, 1), (2, 2)])
def test_global_batch_is_independent_of_world_size(dp, local_bs):
    windows = TokenWindows(np.arange(10_000, dtype=np.uint16) % 258, seq_len=15)
    reference = _loader(windows, global_bs=8, local_bs=8, rank=0, dp=1)
    loaders = [_loader(windows, global_bs=8, local_bs=local_bs, rank=r, dp=dp) for r in range(dp)]
    for _ in range(5):
        expected = _step_rows(reference)
        got = torch.cat([_step_rows(ld) for ld in loaders])
        assert torch.equal(got, expected)
    assert loaders[0].grad_accum_steps == 8 // (local_bs * dp)


def test_inputs_and_labels_are_shifted_by_one():
    windows = TokenWindows(np.arange(1000, dtype=np.uint16), seq_len=9)
    (inputs, labels), = _loader(windows, global_bs=2, local_bs=2, rank=0, dp=1).next_batch()
    assert inputs.shape == labels.shape == (2, 9)
    assert inputs.dtype == labels.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


@pytest.mark.parametrize("num_windows, global_bs", [(100, 10), (103, 8)])
def test_ranks_see_disjoint_windows_covering_each_epoch(num_windows, global_bs):
    """Two data-parallel ranks never read the same window within an epoch, and together read
    every window of it (also when the epoch does not end on a step boundary)."""
    seq = 19
    windows = TokenWindows(np.arange(num_windows * (seq + 1), dtype=np.uint32), seq_len=seq)
    loaders = [_loader(windows, global_bs=global_bs, local_bs=global_bs // 2, rank=r, dp=2) for r in (0, 1)]
    steps = 3 * num_windows // global_bs + 1
    per_rank = [[], []]  # (sample number, window) read by each rank
    for step in range(steps):
        for r, ld in enumerate(loaders):
            rows = _step_rows(ld)
            first = step * global_bs + r * (global_bs // 2)
            per_rank[r] += [(first + i, int(row[0]) // (seq + 1)) for i, row in enumerate(rows)]
    for epoch in range(3):
        seen = [[w for s, w in per_rank[r] if s // num_windows == epoch] for r in (0, 1)]
        assert len(set(seen[0])) == len(seen[0]) and len(set(seen[1])) == len(seen[1])
        assert not set(seen[0]) & set(seen[1]), f"epoch {epoch}: a window read by both ranks"
        assert sorted(seen[0] + seen[1]) == list(range(num_windows)), f"epoch {epoch} not covered"
    # Epochs are shuffled differently.
    order = [w for _, w in sorted(per_rank[0] + per_rank[1])]
    assert order[:num_windows] != order[num_windows : 2 * num_windows]


@pytest.mark.parametrize("stop_after", [1, 5, 13])  # 13 steps of 8 cross the 100-window epoch
def test_state_round_trip_is_bit_identical(stop_after):
    windows = TokenWindows(np.arange(100 * 10, dtype=np.uint16), seq_len=9)
    uninterrupted = [_loader(windows, global_bs=8, local_bs=2, rank=r, dp=2) for r in (0, 1)]
    interrupted = [_loader(windows, global_bs=8, local_bs=2, rank=r, dp=2) for r in (0, 1)]
    for _ in range(stop_after):
        for a, b in zip(uninterrupted, interrupted, strict=True):
            a.next_batch()
            b.next_batch()
    # The state is plain data: it survives JSON (no pickled objects).
    states = [json.loads(json.dumps(ld.state_dict())) for ld in interrupted]
    assert states[0] == states[1]
    restored = [_loader(windows, global_bs=8, local_bs=2, rank=r, dp=2) for r in (0, 1)]
    for ld, state in zip(restored, states, strict=True):
        ld.load_state_dict(state)
    for _ in range(15):
        for a, b in zip(uninterrupted, restored, strict=True):
            for (xa, ya), (xb, yb) in zip(a.next_batch(), b.next_batch(), strict=True):
                assert torch.equal(xa, xb) and torch.equal(ya, yb)

    # The same state continues a run on another world size with the same global batches.
    single = _loader(windows, global_bs=8, local_bs=4, rank=0, dp=1)
    single.load_state_dict(states[0])
    reference = _loader(windows, global_bs=8, local_bs=8, rank=0, dp=1)
    for _ in range(stop_after):
        reference.next_batch()
    assert torch.equal(_step_rows(single), _step_rows(reference))


def test_state_from_another_dataset_or_batch_is_rejected():
    windows = TokenWindows(np.arange(1000, dtype=np.uint16), seq_len=9)
    loader = _loader(windows, global_bs=4, local_bs=2, rank=0, dp=1)
    state = loader.state_dict()
    for name, value in [("global_batch_size", 8), ("seq_len", 7)]:
        with pytest.raises(DataError, match=f"{name}={value!r}"):
            loader.load_state_dict({**state, name: value})
    for name, value in [("seed", 1), ("num_windows", 5), ("shuffle", False)]:
        with pytest.raises(DataError, match=f"{name}={value!r}"):
            loader.load_state_dict({**state, "sources": [{**state["sources"][0], name: value}]})
    with pytest.raises(DataError, match="invalid step"):
        loader.load_state_dict({**state, "step": -1})


def test_block_causal_document_ids_of_plain_windows() -> None:
    """With the tokenizer's BOS/EOS (block-causal attention), the loader gives each micro-batch's
    document ids: a document begins at each BOS and after each EOS; without them, none."""
    bos, eos = ByteTokenizer.bos_id, ByteTokenizer.eos_id
    docs = ByteTokenizer().encode_batch(["ab", "cde", "f"])  # [256 a b 257] [256 c d e 257] [256 f 257]
    stream = np.concatenate(docs + docs).astype(np.uint16)
    windows = TokenWindows(stream, seq_len=len(stream) - 1)
    reader = WindowReader(windows, seed=0, shuffle=False)
    loader = BatchLoader([LoaderSource("w", reader)], seq_len=windows.seq_len, global_batch_size=1,
                         local_batch_size=1, dp_rank=0, dp_size=1, documents=(bos, eos))
    ((inputs, labels),) = loader.next_batch()
    (ids,) = loader.batch_documents
    assert ids[0].tolist() == [1] * 4 + [2] * 5 + [3] * 3 + [4] * 4 + [5] * 5 + [6] * 2
    assert torch.equal(labels[0], torch.from_numpy(stream[1:].astype(np.int64)))  # labels as before
    plain = BatchLoader([LoaderSource("w", reader)], seq_len=windows.seq_len, global_batch_size=1,
                        local_batch_size=1, dp_rank=0, dp_size=1)
    plain.next_batch()
    assert plain.batch_documents is None
