"""Reaching NVML: loading and initialising the library (a fake passes through for tests)."""

from __future__ import annotations

from typing import Any

from kareus.errors import HardwareError

__all__ = ["load_nvml"]


def load_nvml(nvml: Any = None) -> Any:
    """The NVML module (``pynvml``), initialised; ``nvml`` passes a fake through.

    Raises:
        HardwareError: nvidia-ml-py is missing or NVML cannot initialise.
    """
    if nvml is None:
        try:
            import pynvml  # noqa: PLC0415
        except ImportError as exc:
            raise HardwareError("NVML is not available: install nvidia-ml-py") from exc
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - pynvml raises NVMLError subclasses
        raise HardwareError(
            f"NVML failed to initialise ({exc}): this needs a machine with NVIDIA GPUs and their "
            "driver. Without GPUs, measure with EmulatedProfiler (or replay recorded data with "
            "ReplayProfiler) and use DryRunFrequencyController") from exc
    return nvml
