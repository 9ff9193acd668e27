"""Meeting other tools where they are: cluster engines, Zeus and Perseus.

- [`kareus.interop.tasks`][kareus.interop.tasks]: partition searches as tasks of any
  ``concurrent.futures.Executor`` (what ``optimize(..., pool=...)`` uses).
- [`kareus.interop.ray`][kareus.interop.ray]: [`RayExecutor`][kareus.interop.ray.RayExecutor], an
  executor whose tasks are Ray tasks asking for the GPUs of their profiling group (``kareus[ray]``).
- [`kareus.interop.zeus`][kareus.interop.zeus]: a frequency controller backed by the Zeus daemon
  (zeusd) and an energy meter backed by Zeus's ZeusMonitor (``kareus[zeus]``).
- [`kareus.interop.perseus`][kareus.interop.perseus]: a plan's per-rank, per-microbatch frequencies
  in the schedule format Perseus's frequency server reads.

Importing this package imports neither Ray nor Zeus; each module imports them when used.
"""

from __future__ import annotations

__all__: list[str] = []
