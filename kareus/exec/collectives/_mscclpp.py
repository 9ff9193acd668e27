"""An adapter for SM-capped MSCCL++ kernels, used only where ``import mscclpp`` works."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from kareus.exec.collectives._base import (
    CollectiveBackend,
    _check_pair,
    _check_tensor,
    _resolve_stream,
)
from kareus.exec.collectives._environment import mscclpp_available
from kareus.exec.collectives._errors import CollectiveArgumentError, CollectiveUnavailableError
from kareus.exec.collectives._validation import COLLECTIVE_OPS

__all__ = ["MscclppCollective", "MscclppRunner"]

#: Signature of an MSCCL++ runner: ``runner(output, input, stream, sms)``.
MscclppRunner = Callable[[Any, Any, Any, int], None]


class MscclppCollective(CollectiveBackend):
    """Adapter for SM-capped kernels of MSCCL++, used only when ``import mscclpp`` works.

    MSCCL++ is not on PyPI and its Python API changes between releases, so kareus
    does not build MSCCL++ programs itself: pass one runner per op, each a callable
    ``runner(output, input, stream, sms)`` that launches your MSCCL++ kernel with
    ``sms`` thread blocks on ``stream`` (for all-reduce, ``output is input``). This
    class adds kareus's argument checks and the common interface, so a plan can use
    MSCCL++ kernels where you have them.

    Args:
        runners: Op name (``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``) ->
            runner. Ops without a runner raise
            [`CollectiveUnavailableError`][kareus.exec.CollectiveUnavailableError].
        group: Process group (default: the world).

    Raises:
        CollectiveUnavailableError: ``import mscclpp`` fails.
        CollectiveArgumentError: Unknown op names in ``runners``.
    """

    name: ClassVar[str] = "mscclpp"

    def __init__(self, *, runners: Mapping[str, MscclppRunner], group: Any = None) -> None:
        if not mscclpp_available():
            raise CollectiveUnavailableError(
                "`import mscclpp` fails: MSCCL++ is optional and not on PyPI; build it from "
                "source, or use OwnKernelCollective / NCCLCappedCollective"
            )
        unknown = set(runners) - set(COLLECTIVE_OPS)
        if unknown:
            raise CollectiveArgumentError(
                f"runners has unknown ops {sorted(unknown)}; known: {', '.join(COLLECTIVE_OPS)}"
            )
        self._bind_process_group(group)
        import mscclpp  # noqa: F401  (fails loudly here if the install is broken)

        self._runners = dict(runners)

    def _runner(self, op: str) -> MscclppRunner:
        if op not in self._runners:
            raise CollectiveUnavailableError(
                f"no MSCCL++ runner given for {op}; pass runners={{'{op}': ...}} or use another backend"
            )
        return self._runners[op]

    def all_reduce(self, tensor: Any, stream: Any, sms: int | None) -> Any:
        """Sums ``tensor`` over the group in place (the MSCCL++ runner); returns ``tensor``."""
        sms = self._check_sms(sms)
        _check_tensor(tensor, "tensor", self._device)
        self._runner("all_reduce")(tensor, tensor, _resolve_stream(stream), sms)
        return tensor

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """Gathers every rank's ``input`` into ``output`` through the MSCCL++ runner."""
        return self._shard_collective("all_gather", output, input, stream, sms)

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """Sums ``input`` over the group into this rank's ``output`` through the MSCCL++ runner."""
        return self._shard_collective("reduce_scatter", output, input, stream, sms)

    def _shard_collective(self, op: str, output: Any, input: Any, stream: Any,
                          sms: int | None) -> Any:
        sms = self._check_sms(sms)
        _check_pair(op, output, input, self._world, self._device)
        self._runner(op)(output, input, _resolve_stream(stream), sms)
        return output
