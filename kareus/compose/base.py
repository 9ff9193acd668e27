"""The FrontierComposer role: compose the frontiers of one level into the next level up.

kareus composes in two steps: partition frontiers -> microbatch frontiers
(:class:`~kareus.compose.microbatch.MicrobatchComposer`), and microbatch frontiers ->
the iteration frontier over the pipeline DAG
(:class:`~kareus.compose.iteration.IterationComposer`). Both take the lower level's
frontiers keyed by what they describe, plus the context they need as keyword
arguments, and return the upper level's frontier(s).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

__all__ = ["FrontierComposer"]


class FrontierComposer(abc.ABC):
    """Composes lower-level time-energy frontiers into the level above.

    Subclasses implement :meth:`compose`. Every point of every frontier they return keeps
    the choices that produce it (a plan), so that any point can be executed.
    """

    @abc.abstractmethod
    def compose(self, frontiers: Mapping[Any, Any], /, **context: Any) -> Any:
        """Compose ``frontiers`` (keyed by what each describes) into the level above."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
