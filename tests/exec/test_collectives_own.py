"""The own SM-capped kernels' wrapper (kareus.exec.collectives._own) without a GPU: build
options and the launch arguments of each call."""

from __future__ import annotations

import pytest

from kareus.exec import collectives as C
from kareus.exec.collectives import _own

MIB = 1 << 20


@pytest.mark.parametrize(("threads", "loads"), [(128, None), (None, 0), (None, 65)])
def test_build_options_are_checked(threads: int | None, loads: int | None) -> None:
    with pytest.raises(C.CollectiveArgumentError):
        _own._build_defines(threads, loads)


def test_build_options_become_macros() -> None:
    assert _own._build_defines(None, None) == {}
    assert _own._build_defines(1024, 8) == {"KC_THREADS": 1024, "KC_INFLIGHT": 8}


# ------------------------------------------------- wrappers (launch arguments, no GPU)


class _Buf:
    """Stands in for a CUDA tensor: a size and an address."""

    def __init__(self, numel: int, ptr: int) -> None:
        self._numel, self._ptr = numel, ptr

    def numel(self) -> int:
        return self._numel

    def data_ptr(self) -> int:
        return self._ptr


def _own_without_gpu(monkeypatch: pytest.MonkeyPatch, registered: dict[int, list[int]]
                     ) -> tuple[C.OwnKernelCollective, list[tuple[object, ...]]]:
    """An OwnKernelCollective whose CUDA side is replaced by a log of launches."""
    monkeypatch.setattr(_own, "_check_pair", lambda op, out, inp, world, dev: "bfloat16")
    own = object.__new__(C.OwnKernelCollective)
    own._closed, own._sm_count, own._max_blocks = False, 132, C.OWN_MAX_BLOCKS
    own._world, own._device, own._staging_bytes = 2, 0, MIB
    log: list[tuple[object, ...]] = []
    own._enter_stream = lambda stream: stream  # type: ignore[method-assign]
    own._registered_ptrs = lambda t: registered.get(t.data_ptr())  # type: ignore[method-assign]
    own._launch = lambda *a: log.append(("plain", *a))  # type: ignore[method-assign]
    own._launch_registered = lambda *a: log.append(("registered", *a))  # type: ignore[method-assign]
    return own, log


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_own_gather_and_scatter_launch_pieces_of_the_shard(op: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    own, log = _own_without_gpu(monkeypatch, {})
    m = 300_000  # bf16 shard: 2 x 600 kB does not fit 1 MiB of staging -> pieces
    shard, full = _Buf(m, 1 << 20), _Buf(2 * m, 1 << 30)
    out, inp = (full, shard) if op == "all_gather" else (shard, full)
    assert getattr(own, op)(out, inp, "s", 8) is out
    pieces = C.plan_pieces(op, m, 2, 2, MIB)
    assert len(pieces) > 1
    assert log == [("plain", op, "bfloat16", inp.data_ptr() + 2 * s, out.data_ptr() + 2 * s,
                    c, m, "", 8, "s") for s, c in pieces]


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_own_gather_and_scatter_use_registered_full_tensor(op: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    m = 1000
    shard, full = _Buf(m, 4096), _Buf(2 * m, 1 << 30)
    regs = [1 << 30, 1 << 31]
    # Only the full-size side (all-gather output, reduce-scatter input) counts as registered.
    own, log = _own_without_gpu(monkeypatch, {full.data_ptr(): regs, shard.data_ptr(): [1, 2]})
    out, inp = (full, shard) if op == "all_gather" else (shard, full)
    assert getattr(own, op)(out, inp, "s", 3) is out
    assert log == [("registered", op, "bfloat16", inp.data_ptr(), out.data_ptr(), regs, m, m, "",
                    3, "s")]
    log.clear()
    empty_shard = _Buf(0, 8)
    out, inp = (_Buf(0, 16), empty_shard) if op == "all_gather" else (empty_shard, _Buf(0, 16))
    assert getattr(own, op)(out, inp, "s", 3) is out and log == []
