"""NCCL with the number of CTAs fixed per call: one capped communicator per SM count."""

from __future__ import annotations

from typing import Any, ClassVar

from kareus.exec.collectives._base import (
    _DIST_TENSOR_COLLECTIVE,
    CollectiveBackend,
    _check_all_to_all,
    _check_pair,
    _check_tensor,
    _resolve_stream,
)
from kareus.exec.collectives._errors import CollectiveArgumentError, CollectiveUnavailableError

__all__ = ["NCCL_MAX_CTAS", "NCCLCappedCollective"]

#: NCCL's upper limit for ``max_ctas`` (MAXCHANNELS in current NCCL releases).
NCCL_MAX_CTAS = 64


class NCCLCappedCollective(CollectiveBackend):
    """NCCL with the number of CTAs (= SMs) fixed per call.

    NCCL fixes CTA counts per communicator, so this keeps one ``torch.distributed``
    NCCL group per cap, created on first use with
    ``ProcessGroupNCCL.Options().config.min_ctas = max_ctas = sms`` and cached. It
    never touches ``NCCL_MAX_CTAS`` in the environment (that would cap every
    communicator of the process). Group creation is collective over the group's
    ranks; since all ranks issue the same calls, they create the same groups in the
    same order.

    Args:
        group: Process group whose ranks take part (default: the world).
        max_sms: Largest cap accepted (default: NCCL's 64-channel limit).
        high_priority: Create the capped groups with high-priority NCCL streams
            (``ProcessGroupNCCL.Options().is_high_priority_stream``; default), so that a
            capped collective launched beside an op takes its CTAs ahead of that op's
            pending thread blocks (see [`TorchExecutor`][kareus.exec.TorchExecutor]'s
            ``comm_high_priority``). ProcessGroupNCCL runs collectives on streams of its
            own, so the caller's stream priority does not reach them.
    """

    name: ClassVar[str] = "nccl_capped"

    def __init__(self, *, group: Any = None, max_sms: int | None = None,
                 high_priority: bool = True) -> None:
        torch, dist = self._bind_process_group(group)
        try:
            has_caps = hasattr(dist.ProcessGroupNCCL.Options().config, "max_ctas")
        except AttributeError:
            has_caps = False
        if not has_caps:
            raise CollectiveUnavailableError(
                "this PyTorch's ProcessGroupNCCL.Options().config has no max_ctas; upgrade "
                "PyTorch (NCCL >= 2.17) or use OwnKernelCollective"
            )
        self._group = group
        self._ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self._world))
        self._max_sms = NCCL_MAX_CTAS if max_sms is None else int(max_sms)
        if not 1 <= self._max_sms <= NCCL_MAX_CTAS:
            raise CollectiveArgumentError(f"max_sms must be in 1..{NCCL_MAX_CTAS}, got {max_sms}")
        self._groups: dict[int, Any] = {}
        self.high_priority = bool(high_priority)

    @property
    def max_sms(self) -> int:
        """Largest cap accepted: ``max_sms`` and at most SMs - 1."""
        return min(self._max_sms, self._sm_count - 1)

    def group_for(self, sms: int | None) -> Any:
        """The NCCL group capped at ``sms`` CTAs (created on first use; collective)."""
        sms = self._check_sms(sms)
        if sms not in self._groups:
            import torch.distributed as dist

            opts = dist.ProcessGroupNCCL.Options()
            opts.config.max_ctas = sms
            opts.config.min_ctas = sms
            if self.high_priority and hasattr(opts, "is_high_priority_stream"):
                opts.is_high_priority_stream = True
            self._groups[sms] = dist.new_group(ranks=self._ranks, backend="nccl", pg_options=opts,
                                               use_local_synchronization=True)
        return self._groups[sms]

    def all_reduce(self, tensor: Any, stream: Any, sms: int | None) -> Any:
        """Sums ``tensor`` over the group in place, on NCCL capped at ``sms`` CTAs."""
        import torch
        import torch.distributed as dist

        _check_tensor(tensor, "tensor", self._device)
        g = self.group_for(sms)
        with torch.cuda.stream(_resolve_stream(stream)):
            dist.all_reduce(tensor, group=g)
        return tensor

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """Gathers every rank's ``input`` into ``output``, on NCCL capped at ``sms`` CTAs."""
        return self._shard_collective("all_gather", output, input, stream, sms)

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """Sums ``input`` over the group into this rank's ``output`` (NCCL, ``sms`` CTAs)."""
        return self._shard_collective("reduce_scatter", output, input, stream, sms)

    def all_to_all(self, output: Any, input: Any, output_splits: Any, input_splits: Any,
                   stream: Any, sms: int | None) -> Any:
        """Variable-split all-to-all (``torch.distributed.all_to_all_single``) on the
        communicator capped at ``sms`` CTAs: ``input_splits[q]`` rows to rank q,
        ``output_splits[q]`` rows from rank q into ``output``, in rank order.

        NCCL runs an all-to-all as grouped point-to-point sends and receives; that the
        communicator's ``max_ctas`` bounds their kernel's grid as it bounds the other
        collectives' is what the config promises, still to be measured on GPUs
        (``tests/exec/test_collectives_all_to_all_gpu.py``, on two or more)."""
        import torch
        import torch.distributed as dist

        outs, ins = _check_all_to_all(output, input, output_splits, input_splits,
                                      self._world, self._device)
        g = self.group_for(sms)
        with torch.cuda.stream(_resolve_stream(stream)):
            dist.all_to_all_single(output, input, outs, ins, group=g)
        return output

    def _shard_collective(self, op: str, output: Any, input: Any, stream: Any,
                          sms: int | None) -> Any:
        import torch
        import torch.distributed as dist

        _check_pair(op, output, input, self._world, self._device)
        g = self.group_for(sms)
        run = getattr(dist, _DIST_TENSOR_COLLECTIVE[op])
        with torch.cuda.stream(_resolve_stream(stream)):
            run(output.view(-1), input.view(-1), group=g)
        return output

    def close(self) -> None:
        """Destroys the capped groups (collective)."""
        import torch.distributed as dist

        for g in self._groups.values():
            dist.destroy_process_group(g)
        self._groups = {}
