"""Embedded corpus, byte tokenizer and the global-batch loader's slicing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchtitan_lite.data import ByteTokenizer, GlobalBatchLoader, TokenWindows, build_token_stream


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "héllo"
    assert list(tok.encode_array("héllo")) == ids


def test_embedded_corpus_is_real_and_large():
    stream = build_token_stream("python_stdlib", None, ByteTokenizer())
    assert len(stream) > 1_000_000  # megabytes of text: not a few memorisable lines
    assert (stream == ByteTokenizer.bos_id).sum() > 50  # many documents


def _loader(windows, *, global_bs, local_bs, rank, dp):
    return GlobalBatchLoader(windows, global_batch_size=global_bs, local_batch_size=local_bs,
                             dp_rank=rank, dp_size=dp, seed=7)


def _step_rows(loader):
    return torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in loader.next_batch()])


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
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


def test_epoch_covers_every_window_once():
    windows = TokenWindows(np.arange(2000, dtype=np.uint16), seq_len=19)  # 100 windows
    loader = _loader(windows, global_bs=10, local_bs=10, rank=0, dp=1)
    firsts = [int(r[0]) for _ in range(10) for r in _step_rows(loader)]
    assert sorted(firsts) == [i * 20 for i in range(100)]


def test_state_dict_resumes_position():
    windows = TokenWindows(np.arange(5000, dtype=np.uint16), seq_len=9)
    a = _loader(windows, global_bs=4, local_bs=2, rank=0, dp=1)
    for _ in range(3):
        a.next_batch()
    b = _loader(windows, global_bs=4, local_bs=2, rank=0, dp=1)
    b.load_state_dict(a.state_dict())
    assert torch.equal(_step_rows(a), _step_rows(b))


def test_too_short_dataset_names_seq_len():
    with pytest.raises(ValueError, match="training.seq_len"):
        TokenWindows(np.arange(10, dtype=np.uint16), seq_len=64)
