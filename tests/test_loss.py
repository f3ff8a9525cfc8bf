"""The training loss (``loss.py``): the row-chunked cross-entropy gives ``F.cross_entropy``'s sum and
gradient in fp32 and bf16, ignored labels included, over several chunks and a partial last one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan_lite import loss
from torchtitan_lite.data import IGNORE_INDEX


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_equals_torch(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    vocab = 1000
    monkeypatch.setattr(loss, "_CHUNK_ELEMENTS", 3 * vocab)  # chunks of 3 rows: 14 rows = 4 full + 2
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 7, vocab, generator=generator)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (2, 7), generator=generator)
    labels[0, :3] = IGNORE_INDEX
    ours = loss.token_loss_sum(logits, labels)
    (grad,) = torch.autograd.grad(0.37 * ours, logits)
    reference = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum")
    (expected,) = torch.autograd.grad(0.37 * reference, logits)
    assert ours.dtype == torch.float32 and grad.dtype == dtype
    assert torch.allclose(ours, reference, rtol=1e-6), (ours, reference)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-3  # bf16: one rounding of the same fp32 value
    assert torch.allclose(grad.float(), expected.float(), atol=tolerance), (grad - expected).abs().max()
    assert torch.all(grad[0, :3] == 0)  # ignored rows get no gradient
    with torch.no_grad():  # validation's path
        assert torch.allclose(loss.token_loss_sum(logits, labels), reference, rtol=1e-6)


def test_chunks_are_few_rows_on_a_cpu_and_eighths_elsewhere() -> None:
    # (an expanded row: the shape of 8192 × 128256 logits on the CPU without allocating 4 GiB)
    assert loss._chunk_rows(torch.empty(1, 128256).expand(8192, -1)) == 8  # 4 MiB of fp32: in cache
    assert loss._chunk_rows(torch.empty(8192, 128256, device="meta")) == 1024  # 8 chunks: few launches
    assert loss._chunk_rows(torch.empty(16, 258, device="meta")) == 4064  # small logits: one chunk
