"""kareus.profilers.nvml._coordinator: what a partition's ranks agree on while profiling."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kareus.errors import HardwareError
from kareus.profilers.nvml import Coordinator, LocalCoordinator, TorchDistributedCoordinator


def test_local_coordinator_is_a_group_of_one():
    c = LocalCoordinator()
    assert isinstance(c, Coordinator)
    assert (c.rank, c.world_size) == (0, 1)
    got = c.broadcast([1, 2.5])
    assert got == [1.0, 2.5] and all(type(v) is float for v in got)
    assert c.sum((3, 4)) == [3.0, 4.0]
    c.barrier()  # returns at once: nobody else to wait for
    with pytest.raises(NotImplementedError):  # no peer to block on
        c.blocked_wait(waiting=True, peer=1, seconds=0.0)


class _TwoRanks(Coordinator):
    """Rank ``rank`` of a simulated group of two whose other rank holds ``peer_values``."""

    def __init__(self, rank: int, peer_values: Sequence[float]) -> None:
        self._rank, self.peer_values, self.calls = rank, list(peer_values), []

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return 2

    def broadcast(self, values: Sequence[float]) -> list[float]:
        self.calls.append(("broadcast", list(values)))
        return list(values) if self._rank == 0 else list(self.peer_values)

    def sum(self, values: Sequence[float]) -> list[float]:
        self.calls.append(("sum", list(values)))
        return [a + b for a, b in zip(values, self.peer_values)]


def test_barrier_is_a_sum_every_rank_joins():
    c = _TwoRanks(1, [0.0])
    c.barrier()
    assert c.calls == [("sum", [0.0])]
    assert _TwoRanks(1, [7.0]).broadcast([1.0]) == [7.0]  # rank 0's values win


def test_torch_coordinator_needs_an_initialised_group():
    dist = pytest.importorskip("torch.distributed")
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(HardwareError, match="init_process_group"):
        TorchDistributedCoordinator()
