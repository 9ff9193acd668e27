"""The collective-backend role: all-reduce, all-gather and reduce-scatter on an exact SM count.

[`CollectiveBackend`][kareus.exec.CollectiveBackend] is the contract every backend implements (and
the type the executor takes); the helpers here check tensors and resolve streams for the torch-based
backends. torch is imported inside the functions that need it.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from kareus.exec.collectives._errors import CollectiveArgumentError, CollectiveUnavailableError
from kareus.exec.collectives._validation import (
    validate_comm_sms,
    validate_dtype,
    validate_splits,
)

__all__ = ["CollectiveBackend"]

# torch.distributed function that runs each op on flat tensors (NCCL backend).
_DIST_TENSOR_COLLECTIVE = {"all_gather": "all_gather_into_tensor",
                           "reduce_scatter": "reduce_scatter_tensor"}


def _require_dist(group: Any) -> tuple[Any, Any]:
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise CollectiveUnavailableError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group("
            "'nccl') (e.g. under torchrun) before building a collective backend"
        )
    if not torch.cuda.is_available():
        raise CollectiveUnavailableError("no CUDA GPU visible: collective backends need GPUs")
    return torch, dist


class CollectiveBackend(abc.ABC):
    """A way to run all-reduce, all-gather, reduce-scatter (and all-to-all, where the
    backend has it) on an exact SM count.

    Every op is enqueued on ``stream`` (``None``: the current stream) and uses
    ``sms`` SMs (thread blocks / CTAs); ``sms=None`` asks for the library's own choice,
    which only backends without exact caps accept
    ([`ProcessGroupCollective`][kareus.exec.ProcessGroupCollective]; the capped backends raise
    [`CommSMCountError`][kareus.exec.CommSMCountError]). Ops are collective: every rank of the group
    calls the same op with the same sizes and ``sms``, in the same order.

    Shapes: ``all_reduce(tensor)`` reduces in place and returns ``tensor``;
    ``all_gather(output, input)`` writes rank q's ``input`` to
    ``output.view(-1)[q*m:(q+1)*m]`` with ``m = input.numel()``;
    ``reduce_scatter(output, input)`` writes to rank r's ``output`` the sum over ranks
    of ``input.view(-1)[r*m:(r+1)*m]`` with ``m = output.numel()``;
    ``all_to_all(output, input, output_splits, input_splits)`` sends rows (dimension 0)
    ``input[sum(input_splits[:q]) : sum(input_splits[:q+1])]`` to rank q and writes the
    rows received from rank q at ``output[sum(output_splits[:q]) : ...]`` (variable
    splits, host lists of row counts: ``torch.distributed.all_to_all_single``'s
    semantics, what a mixture of experts' token dispatcher runs). Tensors are
    contiguous CUDA tensors of one supported dtype on the current device.

    ``all_to_all`` is not abstract (backends written before it keep working): by default
    it raises [`CollectiveUnavailableError`][kareus.exec.CollectiveUnavailableError] naming
    the backend; the NCCL capped, process-group and loopback backends implement it.

    A backend may also offer ``empty(shape, dtype)`` for tensors its collectives run
    faster on ([`OwnKernelCollective.empty`][kareus.exec.OwnKernelCollective.empty]); runnable
    partitions (``kareus.exec.torch_partition``) allocate their communication buffers with it
    when it is there and with ``torch.zeros`` otherwise.

    An implementation states its group and GPU in one of two ways: it calls
    ``self._bind(world_size=, rank=, device=, sm_count=)`` in ``__init__`` (or
    ``self._bind_process_group(group)``, which reads them from an initialised
    ``torch.distributed`` group and the current CUDA device), and the properties below
    answer from there; or it overrides ``world_size``, ``rank`` and ``sm_count`` (e.g. to
    delegate to another backend).
    """

    #: Short name used by :func:`select_collective_backend` (``prefer=``).
    name: ClassVar[str] = ""

    # What _bind stores; unset until an implementation calls it.
    _world: int
    _rank: int
    _device: int
    _sm_count: int

    def _bind(self, *, world_size: int, rank: int, device: int, sm_count: int) -> None:
        """Records the group (its size and this rank) and this rank's GPU (index and SMs)."""
        self._world = int(world_size)
        self._rank = int(rank)
        self._device = int(device)
        self._sm_count = int(sm_count)

    def _bind_process_group(self, group: Any) -> tuple[Any, Any]:
        """Binds to ``group`` (``None``: the world) and the current CUDA device.

        Returns:
            ``(torch, torch.distributed)``.

        Raises:
            CollectiveUnavailableError: ``torch.distributed`` is not initialised or no GPU
                is visible.
        """
        torch, dist = _require_dist(group)
        device = torch.cuda.current_device()
        self._bind(world_size=dist.get_world_size(group), rank=dist.get_rank(group),
                   device=device,
                   sm_count=torch.cuda.get_device_properties(device).multi_processor_count)
        return torch, dist

    def _bound(self, attr: str) -> int:
        try:
            return int(getattr(self, attr))
        except AttributeError:
            raise NotImplementedError(
                f"{type(self).__name__} has not stated its group and GPU: call self._bind(...) "
                "or self._bind_process_group(group) in __init__, or override world_size, rank "
                "and sm_count"
            ) from None

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self._bound("_world")

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._bound("_rank")

    @property
    def sm_count(self) -> int:
        """SMs of this rank's GPU."""
        return self._bound("_sm_count")

    @property
    def max_sms(self) -> int:
        """Largest ``sms`` this backend accepts on this GPU."""
        return self.sm_count - 1

    @abc.abstractmethod
    def all_reduce(self, tensor: Any, stream: Any, sms: int | None) -> Any:
        """Sums ``tensor`` over the group in place; returns ``tensor``."""

    @abc.abstractmethod
    def all_gather(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """Gathers every rank's ``input`` into ``output`` in rank order; returns ``output``."""

    @abc.abstractmethod
    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """Sums ``input`` over the group and keeps this rank's block in ``output``."""

    def all_to_all(self, output: Any, input: Any, output_splits: Any, input_splits: Any,
                   stream: Any, sms: int | None) -> Any:
        """Sends ``input_splits[q]`` rows of ``input`` (in rank order) to rank q and
        receives ``output_splits[q]`` rows from rank q into ``output``, in rank order;
        returns ``output``. The splits are host lists of row counts, one per rank.

        Raises:
            CollectiveUnavailableError: this backend has no all-to-all (the default).
        """
        raise CollectiveUnavailableError(
            f"the {self.name or type(self).__name__} collective backend runs no all-to-all; "
            "use nccl_capped (SM-capped) or process_group for expert-parallel groups")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases resources (collective where the backend holds shared buffers)."""

    def __enter__(self) -> CollectiveBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Helpers shared by the torch-based backends.
    def _check_sms(self, sms: int | None) -> int:
        return validate_comm_sms(sms, self.sm_count,
                                 backend_limit=min(self.max_sms, self.sm_count - 1), backend=self.name)


def _check_tensor(t: Any, what: str, device: int) -> str:
    """Validates one tensor; returns its dtype name."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise CollectiveArgumentError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda or t.device.index != device:
        raise CollectiveArgumentError(
            f"{what} must be on cuda:{device} (the current device), got {t.device}; "
            "call torch.cuda.set_device(local_rank) first"
        )
    if not t.is_contiguous():
        raise CollectiveArgumentError(f"{what} must be contiguous; call .contiguous() first")
    return validate_dtype(t.dtype)


def _check_pair(op: str, output: Any, input: Any, world: int, device: int) -> str:
    d_out = _check_tensor(output, "output", device)
    d_in = _check_tensor(input, "input", device)
    if d_out != d_in:
        raise CollectiveArgumentError(f"{op}: input is {d_in} but output is {d_out}; use one dtype")
    if op == "all_gather" and output.numel() != world * input.numel():
        raise CollectiveArgumentError(
            f"all_gather: output must hold world_size x input.numel() = {world} x {input.numel()} "
            f"elements, got {output.numel()}"
        )
    if op == "reduce_scatter" and input.numel() != world * output.numel():
        raise CollectiveArgumentError(
            f"reduce_scatter: input must hold world_size x output.numel() = {world} x "
            f"{output.numel()} elements, got {input.numel()}"
        )
    return d_in


def _check_all_to_all(output: Any, input: Any, output_splits: Any, input_splits: Any,
                      world: int, device: int | None) -> tuple[list[int], list[int]]:
    """Validates an all-to-all's tensors (``device=None``: any device, e.g. gloo on the CPU)
    and splits; returns the splits as int lists."""
    import torch

    for t, what in ((output, "output"), (input, "input")):
        if device is not None:
            _check_tensor(t, what, device)
        elif not isinstance(t, torch.Tensor):
            raise CollectiveArgumentError(f"all_to_all: {what} must be a torch.Tensor, got "
                                          f"{type(t).__name__}")
        elif not t.is_contiguous():
            raise CollectiveArgumentError(f"all_to_all: {what} must be contiguous; call "
                                          ".contiguous() first")
        if t.dim() == 0:
            raise CollectiveArgumentError(f"all_to_all: {what} needs rows (dimension 0), got a "
                                          "0-d tensor")
    if output.dtype != input.dtype:
        raise CollectiveArgumentError(f"all_to_all: input is {input.dtype} but output is "
                                      f"{output.dtype}; use one dtype")
    if tuple(output.shape[1:]) != tuple(input.shape[1:]):
        raise CollectiveArgumentError(f"all_to_all: rows of input {tuple(input.shape[1:])} and "
                                      f"output {tuple(output.shape[1:])} differ; give both one "
                                      "row shape")
    return validate_splits(output_splits, input_splits, world_size=world,
                           output_rows=int(output.shape[0]), input_rows=int(input.shape[0]))


def _resolve_stream(stream: Any) -> Any:
    import torch

    return torch.cuda.current_stream() if stream is None else stream
