"""Search for partition frontiers: Pareto utilities, surrogates, acquisition, the optimizer.

Nothing here touches hardware.
"""

from __future__ import annotations

from kareus.search.pareto import (
    hypervolume,
    hypervolume_improvement,
    pareto_front,
    pareto_mask,
    reference_point,
)

__all__ = [
    "hypervolume",
    "hypervolume_improvement",
    "pareto_front",
    "pareto_mask",
    "reference_point",
]
