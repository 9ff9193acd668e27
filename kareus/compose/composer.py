"""The FrontierComposer role: compose the frontiers of one level into the next level up.

kareus composes in two steps: partition frontiers -> microbatch frontiers
([`MicrobatchComposer`][kareus.compose.MicrobatchComposer]), and microbatch frontiers ->
the iteration frontier over the pipeline DAG
([`IterationComposer`][kareus.compose.IterationComposer]). Both take the lower level's
frontiers keyed by what they describe, plus the context they need as keyword
arguments, and return the upper level's frontier(s).

The role is generic in what a composer takes and what it returns:
``FrontierComposer[Mapping[str, PartitionFrontier], dict[tuple[int, str],
MicrobatchFrontier]]`` is any microbatch composer, ``FrontierComposer[Mapping[tuple[int,
str], MicrobatchFrontier], IterationFrontier]`` any iteration composer.
[`compose_systems`][kareus.compose.compose_systems] and
[`kareus.optimize`][kareus.workflow.optimize] accept any composer of each level (the aliases
``AnyMicrobatchComposer`` and ``AnyIterationComposer`` name the two kinds), so a different
composition (another pipeline model, another trade-off solver) plugs in without touching
the search or the executor. [`kareus.testing`][kareus.testing] has a conformance suite per level
([`kareus.testing.check_microbatch_composer`][kareus.testing.check_microbatch_composer],
[`kareus.testing.check_iteration_composer`][kareus.testing.check_iteration_composer]).
"""

from __future__ import annotations

import abc
from typing import Any, Generic, TypeVar

__all__ = ["FrontierComposer"]

#: What a composer takes: the lower level's frontiers, keyed by what each describes.
InT = TypeVar("InT", contravariant=True)
#: What a composer returns: the level above (one frontier or several, keyed).
OutT = TypeVar("OutT", covariant=True)


class FrontierComposer(abc.ABC, Generic[InT, OutT]):
    """Composes lower-level time-energy frontiers into the level above.

    Subclasses implement [`compose`][kareus.compose.FrontierComposer.compose], naming the context
    they need as keyword-only arguments. Every point of every frontier they return keeps the choices
    that produce it (a plan), so that any point can be executed.
    """

    @abc.abstractmethod
    def compose(self, frontiers: InT, /, *args: Any, **context: Any) -> OutT:
        """Compose ``frontiers`` into the level above.

        Args:
            frontiers: The lower level's frontiers, keyed by what each describes.
            *args: Unused by the defaults; subclasses take their context keyword-only.
            **context: What the composer needs besides the frontiers (the partition set,
                the pipeline schedule, static power, ...), named by each subclass.

        Returns:
            The upper level's frontier(s).
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
