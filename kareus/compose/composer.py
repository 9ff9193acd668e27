"""The FrontierComposer role: compose the frontiers of one level into the next level up.

kareus composes in two steps: partition frontiers -> microbatch frontiers
([`MicrobatchComposer`][kareus.compose.MicrobatchComposer]), and microbatch frontiers ->
the iteration frontier over the pipeline DAG
([`IterationComposer`][kareus.compose.IterationComposer]). A composer of either level is called as
``compose(frontiers, context)``: the lower level's frontiers keyed by what they describe, and one
frozen context object with everything else the level needs
([`MicrobatchContext`][kareus.compose.MicrobatchContext],
[`IterationContext`][kareus.compose.IterationContext]); it returns the upper level's frontier(s).

The role is generic in what a composer takes, its context and what it returns:
``FrontierComposer[Mapping[str, PartitionFrontier], MicrobatchContext, dict[tuple[int, str],
MicrobatchFrontier]]`` is any microbatch composer (``AnyMicrobatchComposer``),
``FrontierComposer[Mapping[tuple[int, str], MicrobatchFrontier], IterationContext,
IterationFrontier]`` any iteration composer (``AnyIterationComposer``).
[`kareus.optimize`][kareus.workflow.optimize] and
[`compose_systems`][kareus.workflow.compose_systems] accept any composer of each level, so a
different composition (another pipeline model, another trade-off solver) plugs in without touching
the search or the executor. A composer that wraps or refines another passes the context on whole
(``super().compose(frontiers, context)``): it cannot drop a field it does not know about.
[`kareus.testing`][kareus.testing] has a conformance suite per level
([`kareus.testing.check_microbatch_composer`][kareus.testing.check_microbatch_composer],
[`kareus.testing.check_iteration_composer`][kareus.testing.check_iteration_composer]).
"""

from __future__ import annotations

import abc
import inspect
from typing import Any, Generic, TypeVar

from kareus.errors import ArgumentTypeError

__all__ = ["FrontierComposer"]

#: What a composer takes: the lower level's frontiers, keyed by what each describes.
InT = TypeVar("InT", contravariant=True)
#: The context object of the level (``MicrobatchContext``, ``IterationContext``).
CtxT = TypeVar("CtxT", contravariant=True)
#: What a composer returns: the level above (one frontier or several, keyed).
OutT = TypeVar("OutT", covariant=True)

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class FrontierComposer(abc.ABC, Generic[InT, CtxT, OutT]):
    """Composes lower-level time-energy frontiers into the level above.

    Subclasses implement [`compose`][kareus.compose.FrontierComposer.compose]``(frontiers,
    context, /)``. Every point of every frontier they return keeps the choices that produce it
    (a plan), so that any point can be executed.

    Raises:
        TypeError: at class definition, for a ``compose`` that cannot take the context as its
            second positional argument (the keyword form ``compose(frontiers, /, **context)``
            of earlier releases is refused here, not at the first composition).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        compose = cls.__dict__.get("compose")
        if compose is None or getattr(compose, "__isabstractmethod__", False):
            return
        try:
            params = list(inspect.signature(compose).parameters.values())[1:]  # after self
        except (TypeError, ValueError):
            return
        positional = [p for p in params if p.kind in _POSITIONAL]
        if len(positional) < 2 and not any(p.kind is inspect.Parameter.VAR_POSITIONAL
                                           for p in params):
            raise ArgumentTypeError(
                f"{cls.__qualname__}.compose must take (frontiers, context, /): kareus passes "
                f"one context object (MicrobatchContext or IterationContext) instead of keyword "
                f"arguments; read its fields (context.partitions, context.tail, ...) and pass "
                f"it on whole to a composer you delegate to")

    @abc.abstractmethod
    def compose(self, frontiers: InT, context: CtxT, /) -> OutT:
        """Compose ``frontiers`` into the level above.

        Args:
            frontiers: The lower level's frontiers, keyed by what each describes.
            context: Everything else the level needs
                ([`MicrobatchContext`][kareus.compose.MicrobatchContext] or
                [`IterationContext`][kareus.compose.IterationContext]).

        Returns:
            The upper level's frontier(s).
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
