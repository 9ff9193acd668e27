"""The outside work's byte-moving stand-in fills its buffers in chunks small enough for
CUDA's 32-bit-indexed random kernels."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kareus.exec import outside_work


@pytest.mark.parametrize("nbytes", [8, 13, 8 * 40 + 5, 8 * 64])
def test_random_bytes_fills_every_chunk(monkeypatch, nbytes):
    monkeypatch.setattr(outside_work, "_FILL_CHUNK", 16)  # words per random_ call
    calls = []
    real = torch.Tensor.random_

    def counted(self, *args, **kwargs):
        calls.append(self.numel())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "random_", counted)
    gen = torch.Generator().manual_seed(0)
    out = outside_work._random_bytes(torch, nbytes, gen, "cpu")
    assert out.dtype == torch.uint8 and out.numel() == nbytes
    words = nbytes // 8
    assert max(calls) <= 16
    assert sum(calls) == words + (nbytes - 8 * words)
    # every 8-byte word drawn (a zero word among 64-bit draws is practically impossible)
    assert (out[: 8 * words].view(torch.int64) != 0).all()

