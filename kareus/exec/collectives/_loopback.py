"""A one-GPU stand-in for a collective backend: a world of one rank.

On one GPU there is nobody to communicate with, yet the tuning path, the executor's
stream ordering and the registered-buffer allocation should still run end to end
before a multi-GPU run spends its time only measuring.
[`LoopbackCollective`][kareus.exec.LoopbackCollective] is that stand-in: a group of one rank, whose
all-reduce leaves the tensor as it is (the sum over one rank) but reads and writes it once in a
kernel on the given stream, and whose all-gather and reduce-scatter copy the one shard. Its
all-to-all stands in for an expert-parallel group of ``len(output_splits)`` ranks: it writes
every received row (the output's bytes) from the sent rows, repeated in order (the exact
all-to-all of a world of one when the splits have one entry). Its ``sms``
is checked like a capped backend's and otherwise not applied (the copy kernels take what they take),
so its measurements are of the computation beside a memory-bound kernel, never of communication:
a smoke run's figures, not kareus's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from kareus.exec.collectives._base import (
    CollectiveBackend,
    _check_all_to_all,
    _check_pair,
    _check_tensor,
)

__all__ = ["LoopbackCollective", "cycle_rows"]


class LoopbackCollective(CollectiveBackend):
    """A collective backend over a group of one rank (this process's GPU), for one-GPU runs.

    Raises:
        CollectiveUnavailableError: no CUDA GPU is visible.
    """

    name: ClassVar[str] = "loopback"

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            from kareus.exec.collectives._errors import (
                CollectiveUnavailableError,
            )

            raise CollectiveUnavailableError("no CUDA GPU visible: LoopbackCollective needs one")
        self._torch = torch
        device = torch.cuda.current_device()
        self._bind(world_size=1, rank=0, device=device,
                   sm_count=torch.cuda.get_device_properties(device).multi_processor_count)
        #: Tensors handed out by :meth:`empty` (as a registering backend would).
        self.allocated = 0

    def empty(self, shape: int | Sequence[int], dtype: Any) -> Any:
        """A zeroed tensor, as a registering backend's [`empty`][kareus.exec.LoopbackCollective.empty] gives (plain memory here)."""
        self.allocated += 1
        return self._torch.zeros(shape, dtype=dtype, device=f"cuda:{self._device}")

    def all_reduce(self, tensor: Any, stream: Any, sms: int | None) -> Any:
        """The sum over one rank: ``tensor`` itself, read and written once on ``stream``."""
        if sms is not None:
            self._check_sms(sms)
        _check_tensor(tensor, "tensor", self._device)
        with self._torch.cuda.stream(stream):
            tensor.mul_(1)
        return tensor

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """Copies ``input`` into ``output`` (one shard) on ``stream``."""
        return self._copy("all_gather", output, input, stream, sms)

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """Copies ``input`` into ``output`` (one shard) on ``stream``."""
        return self._copy("reduce_scatter", output, input, stream, sms)

    def _copy(self, op: str, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        if sms is not None:
            self._check_sms(sms)
        _check_pair(op, output, input, 1, self._device)
        with self._torch.cuda.stream(stream):
            output.view(-1).copy_(input.view(-1))
        return output

    def all_to_all(self, output: Any, input: Any, output_splits: Any, input_splits: Any,
                   stream: Any, sms: int | None) -> Any:
        """The stand-in for an all-to-all over ``len(output_splits)`` ranks, on ``stream``:
        ``output``'s rows are ``input``'s rows repeated in order (row ``j`` from input row
        ``j mod rows``; zeros from an empty input), so the call reads the sent rows and
        writes every received one, as the real all-to-all does on this rank. With one rank
        it is that rank's all-to-all (a copy). The splits are checked against the tensors
        (both lists of one length, the group stood in for)."""
        if sms is not None:
            self._check_sms(sms)
        world = len(output_splits) if hasattr(output_splits, "__len__") else 1
        _check_all_to_all(output, input, output_splits, input_splits, world, self._device)
        with self._torch.cuda.stream(stream):
            cycle_rows(self._torch, output, input)
        return output


def cycle_rows(torch: Any, output: Any, input: Any) -> Any:
    """``output[j] = input[j mod rows]`` for every row ``j`` of ``output`` (zeros when
    ``input`` has no row), in place; returns ``output``. What a one-GPU stand-in's
    all-to-all computes ([`LoopbackCollective.all_to_all`][kareus.exec.LoopbackCollective]),
    for stand-ins of an expert-parallel group elsewhere (the time-faithful one's
    ``timed_collective("cycle", ...)`` computes the same on the GPU). ``torch`` is the
    torch module."""
    n_out, n_in = int(output.shape[0]), int(input.shape[0])
    if n_out == 0:
        return output
    if n_in == 0:
        return output.zero_()
    reps = -(-n_out // n_in)
    if reps == 1:
        output.copy_(input[:n_out])
    else:
        output.view(n_out, -1).copy_(
            input.reshape(1, n_in, -1).expand(reps, n_in, -1).reshape(reps * n_in, -1)[:n_out])
    return output
