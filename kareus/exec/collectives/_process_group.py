"""Collectives through a plain ``torch.distributed`` group, with the library's own CTA count.

This is what Megatron-LM and plain nanobatching use (NCCL picks its CTAs), so the
systems that do not cap SMs run through it; ``sms`` is ignored.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kareus.exec.collectives._base import (
    _DIST_TENSOR_COLLECTIVE,
    CollectiveBackend,
    _check_all_to_all,
)

__all__ = ["ProcessGroupCollective"]


class ProcessGroupCollective(CollectiveBackend):
    """Collectives through a ``torch.distributed`` group with the library's own CTA count.

    The ``sms`` argument of every op is ignored (``None`` is accepted): use it as the
    executor's ``default_collective`` for configurations whose ``comm_sms`` is ``None``.

    Args:
        group: The process group (default: the world).
    """

    name: ClassVar[str] = "process_group"

    def __init__(self, *, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return int(self._dist.get_world_size(self.group))

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return int(self._dist.get_rank(self.group))

    @property
    def sm_count(self) -> int:
        """SMs of this rank's GPU."""
        import torch

        return int(torch.cuda.get_device_properties(torch.cuda.current_device())
                   .multi_processor_count)

    def all_reduce(self, tensor: Any, stream: Any, sms: int | None) -> Any:
        """Sums ``tensor`` over the group in place on ``stream``; returns ``tensor``."""
        import torch

        with torch.cuda.stream(stream):
            self._dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """Gathers every rank's ``input`` into ``output`` in rank order; returns ``output``."""
        return self._shard_collective("all_gather", output, input, stream)

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """Sums ``input`` over the group and keeps this rank's block in ``output``."""
        return self._shard_collective("reduce_scatter", output, input, stream)

    def all_to_all(self, output: Any, input: Any, output_splits: Any, input_splits: Any,
                   stream: Any, sms: int | None) -> Any:
        """Variable-split all-to-all through ``torch.distributed.all_to_all_single``:
        ``input_splits[q]`` rows to rank q, ``output_splits[q]`` rows from rank q into
        ``output``, in rank order (NCCL on GPUs; gloo on the CPU, where ``stream`` is
        ``None``)."""
        import contextlib

        import torch

        outs, ins = _check_all_to_all(output, input, output_splits, input_splits,
                                      self.world_size, None)
        on = (torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream)
              else contextlib.nullcontext())
        with on:
            self._dist.all_to_all_single(output, input, outs, ins, group=self.group)
        return output

    def _shard_collective(self, op: str, output: Any, input: Any, stream: Any) -> Any:
        """All-gather or reduce-scatter through ``torch.distributed``'s flat-tensor call."""
        import torch

        run = getattr(self._dist, _DIST_TENSOR_COLLECTIVE[op])
        with torch.cuda.stream(stream):
            run(output.view(-1), input.view(-1), group=self.group)
        return output
