"""The outside work's byte-moving stand-in fills its buffers in chunks small enough for
CUDA's 32-bit-indexed random kernels."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kareus.exec import outside_work  # noqa: E402


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


def _storage(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("phase", ["fwd", "bwd", "iteration"])
def test_a_step_reads_nothing_an_earlier_step_made(phase):
    """What a graph replays must read only what outlives it: the program's build-time
    tensors and what the same step made. A tensor made by the previous step is replaced,
    and freed, when the next graph of a sequence is captured, so a replay reading it read
    freed memory (the illegal memory access of the one-GPU tuning run: the embedding's
    backward read the final norm's gradient of the step before)."""
    import attrs
    from torch.utils._python_dispatch import TorchDispatchMode

    from kareus.model import ModelArch, Parallelism, Workload, build_partitions
    from kareus.testing import RecordingExecutor

    tiny = ModelArch(name="tiny", layers=2, hidden=64, heads=8, kv_heads=4, head_dim=8,
                     ffn=128, vocab=512)
    wl = attrs.evolve(Workload.preset("qwen3-1.7b"), model=tiny,
                      parallelism=Parallelism(tp=4, pp=1, cp=1, dp=1), microbatch_size=2,
                      seq_len=64, num_microbatches=4, nanobatches=2)
    pset = build_partitions(wl)
    work = pset.iteration if phase == "iteration" else pset.outside[(0, phase)]
    prog = outside_work.RunnableOutsideWork(work, wl, dtype="float32").build(
        device="cpu", collective=RecordingExecutor())

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made, self.inputs = set(), []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            read = {_storage(a) for a in torch.utils._pytree.tree_leaves((args, kwargs or {}))
                    if isinstance(a, torch.Tensor)}
            self.inputs += [(func, p) for p in read if p not in self.made]
            # made: fresh outputs (an in-place op's output is the tensor it was given)
            self.made |= {_storage(o) for o in torch.utils._pytree.tree_leaves(out)
                          if isinstance(o, torch.Tensor)} - read
            return out

    with torch.no_grad():
        with Reads() as first:
            prog.run_plain()
        with Reads() as second:
            prog.run_plain()
    stale = [(str(f), p) for f, p in second.inputs if p in first.made]
    assert not stale, f"step 2 of {phase} read what step 1 made: {stale}"
    assert second.inputs  # the step did read its build-time inputs
