"""Execution: profilers, energy meters, frequency control, collectives, executors.

Only this package touches hardware, and only lazily: importing it initialises
neither CUDA nor NVML.
"""

from __future__ import annotations

from kareus.exec.profiler import Profiler

__all__ = ["Profiler"]
