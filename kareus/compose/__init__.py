"""Composition of frontiers: partition -> microbatch -> iteration, plans and baselines.

Nothing here touches hardware.
"""

from __future__ import annotations

__all__: list[str] = []
