"""A time-faithful one-GPU stand-in for a group's collectives.

The plain loopback stand-in ([`LoopbackGroupCollective`][kareus.exec.train.LoopbackGroupCollective])
runs a kernel of each collective's bytes that finishes in a fraction of the real
collective's time: on one GPU there is then almost nothing to hide behind computation, and
nanobatching (which exists to hide communication) measures slower than sequential.
[`TimedLoopbackGroupCollective`][kareus.exec.train.TimedLoopbackGroupCollective] computes the
same data but holds the collective's SM count for as long as the real collective takes at
that SM count and size ([`timed_collective`][kareus.exec.kernels.timed_stand_in.timed_collective]),
so that a one-GPU loop, tune or ``kareus verify`` sees the overlap a TP or CP group would.

How long the real collective takes comes from a
[`CollectiveTimes`][kareus.exec.train.CollectiveTimes] (one role, one abstract class): the
default, built above this layer, is ``kareus.profilers.EmulatedCollectiveTimes`` (the
collective curves measured on 2 and 4 H200s where the project has them, the emulator's
link model otherwise; each time says which). Every figure made with this stand-in is a
STAND-IN's: no link carried a byte, and the collective's slow-down beside computation is
only what its own copy suffers.

Without CUDA (the CPU dry path) the collective computes the same data with torch and
records the time it would have held, without waiting.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from kareus.errors import ArgumentError, ArgumentTypeError
from kareus.exec.train._groups import LoopbackGroupCollective, _on

__all__ = ["CollectiveTimes", "FixedRateCollectiveTimes", "TimedLoopbackGroupCollective",
           "STAND_IN_LABEL"]

#: The words every output made with the time-faithful stand-in carries.
STAND_IN_LABEL = "STAND-IN (time-faithful loopback: one GPU, no links)"


class CollectiveTimes(abc.ABC):
    """How long a real collective takes on its group: the role the time-faithful
    stand-in asks.

    Message sizes follow [`CommOp.bytes`][kareus.model.CommOp]: the tensor reduced
    (all-reduce), the gathered output (all-gather), or the input reduced and scattered
    (reduce-scatter), per rank.
    """

    @abc.abstractmethod
    def time_s(self, kind: str, message_bytes: int, group_size: int, sms: int | None, *,
               backend: str) -> float:
        """Seconds the collective takes alone on ``sms`` SMs (``None``: the collective's
        own CTA count) in a group of ``group_size``, on ``backend``'s kernels (``"nccl"``
        or ``"own"``), without its launch."""

    @abc.abstractmethod
    def source(self, kind: str, group_size: int, *, backend: str) -> str:
        """Where ``time_s`` comes from for this kind and group size (one line)."""

    def sms_for(self, sms: int | None) -> int:
        """The SMs a collective with ``sms`` (``None``: uncapped) takes; default: as
        given, 16 when uncapped."""
        return 16 if sms is None else int(sms)


class FixedRateCollectiveTimes(CollectiveTimes):
    """A collective time of ``latency_s + bus bytes / min(sms x per-SM rate, link)``:
    for tests and for stating a model by hand (not measured).

    Args:
        gb_per_s_per_sm: Bus GB/s one SM moves.
        link_gb_per_s: Bus GB/s at which the collective saturates.
        latency_s: Fixed cost of one collective.
        uncapped_sms: SMs an uncapped collective takes.
    """

    def __init__(self, *, gb_per_s_per_sm: float = 20.0, link_gb_per_s: float = 300.0,
                 latency_s: float = 10e-6, uncapped_sms: int = 16) -> None:
        if min(gb_per_s_per_sm, link_gb_per_s) <= 0 or latency_s < 0 or uncapped_sms < 1:
            raise ArgumentError("rates must be > 0, latency_s >= 0, uncapped_sms >= 1")
        self.gb_per_s_per_sm, self.link_gb_per_s = float(gb_per_s_per_sm), float(link_gb_per_s)
        self.latency_s, self.uncapped_sms = float(latency_s), int(uncapped_sms)

    def sms_for(self, sms: int | None) -> int:
        return self.uncapped_sms if sms is None else int(sms)

    def time_s(self, kind: str, message_bytes: int, group_size: int, sms: int | None, *,
               backend: str) -> float:
        g = int(group_size)
        bus = message_bytes * (2.0 * (g - 1) / g if kind == "all_reduce" else (g - 1) / g)
        rate = min(self.sms_for(sms) * self.gb_per_s_per_sm, self.link_gb_per_s) * 1e9
        return self.latency_s + bus / rate

    def source(self, kind: str, group_size: int, *, backend: str) -> str:
        return (f"a fixed rate given by hand ({self.gb_per_s_per_sm:g} GB/s per SM, link "
                f"{self.link_gb_per_s:g} GB/s): not measured")


class TimedLoopbackGroupCollective(LoopbackGroupCollective):
    """A one-GPU stand-in for a group's collectives that takes as long as the real ones.

    Each call computes what [`LoopbackGroupCollective`][kareus.exec.train.LoopbackGroupCollective]
    computes, in one kernel of exactly the call's SM count in thread blocks, which holds
    those SMs for ``times.time_s(kind, bytes, group_size, sms)`` (the real collective's
    time at that count and size) on the given stream. ``sms=None`` (a baseline's uncapped
    collective) takes ``times.sms_for(None)`` SMs. On the CPU it computes the same with
    torch and records the target time without waiting.

    Args:
        group_size: The group size stood in for.
        times: How long the real collectives take.
        backend: Whose collective kernels' times to take (``"nccl"`` or ``"own"``).

    Attributes:
        calls: ``(kind, elements, sms)`` of the latest calls (as the plain stand-in).
        timed: ``(kind, message bytes, SMs used, target seconds)`` of the latest calls.
    """

    name: ClassVar[str] = "loopback_faithful"

    #: The collectives this group runs (``faithful_note`` says where their times come
    #: from): a TP or CP group's three, an EP group's all-to-all.
    kinds: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter")

    def __init__(self, *, group_size: int, times: CollectiveTimes, backend: str = "nccl",
                 kinds: tuple[str, ...] | None = None) -> None:
        super().__init__(group_size=group_size)
        if kinds is not None:
            self.kinds = tuple(kinds)
        if not isinstance(times, CollectiveTimes):
            raise ArgumentTypeError(f"times must be a CollectiveTimes, got "
                                    f"{type(times).__name__}")
        if backend not in ("nccl", "own"):
            raise ArgumentError(f"backend must be 'nccl' or 'own', got {backend!r}")
        self.times, self.backend = times, backend
        self.timed: list[tuple[str, int, int, float]] = []
        self._cache: dict[tuple[str, int, int | None], tuple[int, float]] = {}

    def target(self, kind: str, message_bytes: int, sms: int | None) -> tuple[int, float]:
        """``(SMs used, seconds)`` of one collective (cached per kind, size and SMs)."""
        key = (kind, int(message_bytes), sms)
        got = self._cache.get(key)
        if got is None:
            used = self.times.sms_for(sms)
            if sms is not None:
                self._check_sms(sms)
            got = (used, float(self.times.time_s(kind, int(message_bytes), self.world_size,
                                                 sms, backend=self.backend)))
            if got[1] < 0:
                raise ArgumentError(f"a collective time must be >= 0, got {got[1]} for {key}")
            self._cache[key] = got
        return got

    def source(self, kind: str) -> str:
        """Where this group's ``kind`` times come from."""
        return self.times.source(kind, self.world_size, backend=self.backend)

    def _timed(self, kind: str, message_bytes: int, sms: int | None) -> tuple[int, int]:
        used, secs = self.target(kind, message_bytes, sms)
        self.timed.append((kind, int(message_bytes), used, secs))
        if len(self.timed) >= 2 * self.CALLS_KEPT:
            del self.timed[:-self.CALLS_KEPT]
        return used, round(secs * 1e9)

    def all_reduce(self, tensor: Any, stream: Any, sms: int | None) -> Any:
        """``tensor *= group_size``, holding the SMs for the all-reduce's time."""
        if not tensor.is_cuda:
            self._timed("all_reduce", tensor.numel() * tensor.element_size(), sms)
            return super().all_reduce(tensor, stream, sms)
        from kareus.exec.kernels.timed_stand_in import timed_collective

        self._record("all_reduce", int(tensor.numel()), sms)
        used, ns = self._timed("all_reduce", tensor.numel() * tensor.element_size(), sms)
        with _on(stream):
            flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
            timed_collective("scale", flat, flat, group=self.world_size, ctas=used,
                             duration_ns=ns, scale=float(self.world_size))
            if not tensor.is_contiguous():  # a strided tensor: reduced in a copy
                tensor.copy_(flat.view(tensor.shape))
        return tensor

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """``output`` = ``input`` repeated, holding the SMs for the all-gather's time."""
        if not output.is_cuda:
            self._timed("all_gather", output.numel() * output.element_size(), sms)
            return super().all_gather(output, input, stream, sms)
        from kareus.exec.kernels.timed_stand_in import timed_collective

        self._record("all_gather", int(output.numel()), sms)
        used, ns = self._timed("all_gather", output.numel() * output.element_size(), sms)
        with _on(stream):
            timed_collective("repeat", output.view(-1), input.reshape(-1).contiguous(),
                             group=self.world_size, ctas=used, duration_ns=ns)
        return output

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """``output`` = the sum of ``input``'s blocks, holding the SMs for the
        reduce-scatter's time."""
        if not output.is_cuda:
            self._timed("reduce_scatter", input.numel() * input.element_size(), sms)
            return super().reduce_scatter(output, input, stream, sms)
        from kareus.exec.kernels.timed_stand_in import timed_collective

        self._record("reduce_scatter", int(input.numel()), sms)
        used, ns = self._timed("reduce_scatter", input.numel() * input.element_size(), sms)
        with _on(stream):
            timed_collective("sum_blocks", output.view(-1), input.reshape(-1).contiguous(),
                             group=self.world_size, ctas=used, duration_ns=ns)
        return output

    def all_to_all(self, output: Any, input: Any, output_splits: list[int],
                   input_splits: list[int], stream: Any, sms: int | None) -> Any:
        """The EP group's all-to-all as the plain stand-in computes it (the first block of
        ``input`` cycled over ``output``), holding the SMs for the all-to-all's time (its
        message: the received rows' bytes, as ``CommOp.bytes`` counts a dispatch)."""
        nbytes = output.numel() * output.element_size()
        if not output.is_cuda:
            self._timed("all_to_all", nbytes, sms)
            return super().all_to_all(output, input, output_splits, input_splits, stream, sms)
        from kareus.exec.kernels.timed_stand_in import timed_collective

        self._record("all_to_all", int(output.numel()), sms)
        used, ns = self._timed("all_to_all", nbytes, sms)
        first = input[:int(input_splits[0])].contiguous()
        with _on(stream):
            if first.numel() == 0 or output.numel() == 0:  # nothing to cycle: zeros
                output.zero_()
            else:
                timed_collective("cycle", output.view(-1), first.view(-1),
                                 group=self.world_size, ctas=used, duration_ns=ns)
        return output
