"""Reaching NVML (kareus.exec.nvml._device)."""

from __future__ import annotations

import pytest


def test_missing_driver_says_what_to_do():
    from kareus.errors import HardwareError
    from kareus.exec.nvml import load_nvml

    class NoDriver:
        def nvmlInit(self):
            raise RuntimeError("NVML Shared Library Not Found")

    with pytest.raises(HardwareError, match="EmulatedProfiler"):
        load_nvml(NoDriver())
