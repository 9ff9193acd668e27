"""What the ranks of a partition's group agree on while profiling (step counts, sums)."""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from typing import Any

from kareus.errors import HardwareError

__all__ = ["Coordinator", "LocalCoordinator", "TorchDistributedCoordinator"]


class Coordinator(abc.ABC):
    """What the ranks of a partition's group agree on while profiling."""

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank in the group."""

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """Ranks in the group."""

    @abc.abstractmethod
    def broadcast(self, values: Sequence[float]) -> list[float]:
        """Rank 0's ``values`` on every rank."""

    @abc.abstractmethod
    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks."""

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        self.sum([0.0])

    def blocked_wait(self, *, waiting: bool, peer: int, seconds: float) -> None:
        """Block this GPU in a receive from ``peer`` (``waiting``) or send to it after
        ``seconds`` of host sleep; used to measure blocked-in-communication power."""
        raise NotImplementedError


class LocalCoordinator(Coordinator):
    """A group of one process (no communication)."""

    @property
    def rank(self) -> int:
        """Always 0."""
        return 0

    @property
    def world_size(self) -> int:
        """Always 1."""
        return 1

    def broadcast(self, values: Sequence[float]) -> list[float]:
        """``values`` as floats (this process is rank 0)."""
        return [float(v) for v in values]

    def sum(self, values: Sequence[float]) -> list[float]:
        """``values`` as floats (the only rank)."""
        return [float(v) for v in values]


class TorchDistributedCoordinator(Coordinator):
    """Coordination over a ``torch.distributed`` group (small CUDA tensors through the
    group's backend; the same calls on every rank)."""

    def __init__(self, *, group: Any = None) -> None:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            raise HardwareError("torch.distributed is not initialised; call "
                                "init_process_group first (or use LocalCoordinator)")
        self._torch, self._dist, self._group = torch, dist, group
        self._device = torch.device("cuda", torch.cuda.current_device())

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return int(self._dist.get_rank(self._group))

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return int(self._dist.get_world_size(self._group))

    def _tensor(self, values: Sequence[float]) -> Any:
        return self._torch.tensor([float(v) for v in values], dtype=self._torch.float64,
                                  device=self._device)

    def broadcast(self, values: Sequence[float]) -> list[float]:
        """Rank 0's ``values`` on every rank (a float64 tensor broadcast)."""
        t = self._tensor(values)
        src = self._dist.get_global_rank(self._group, 0) if self._group is not None else 0
        self._dist.broadcast(t, src=src, group=self._group)
        return [float(v) for v in t.tolist()]

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum of ``values`` over the group (a float64 all-reduce)."""
        t = self._tensor(values)
        self._dist.all_reduce(t, group=self._group)
        return [float(v) for v in t.tolist()]

    def blocked_wait(self, *, waiting: bool, peer: int, seconds: float) -> None:
        """Block in a receive from ``peer`` (``waiting``), or sleep ``seconds``, then send."""
        buf = self._torch.zeros(1024, device=self._device)
        if self._group is not None:
            peer = self._dist.get_global_rank(self._group, peer)
        if waiting:
            self._dist.recv(buf, src=peer, group=self._group)
        else:
            time.sleep(seconds)
            self._dist.send(buf, dst=peer, group=self._group)
