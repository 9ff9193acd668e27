"""Reaching NVML: loading the library, and finding this process's GPU in NVML's numbering.

A leaf module (it imports nothing of kareus but its errors): the energy meter
(``kareus.profilers.nvml``) and the frequency controllers (``kareus.exec.frequency``) both need
these helpers, and the NVML package itself sits above the executor, which sits above the
frequency controllers.

NVML numbers every GPU of the machine in PCI order; CUDA numbers only the GPUs
``CUDA_VISIBLE_DEVICES`` lists, in the order it lists them (Slurm and container runtimes
set it per job). So CUDA device 0 of a rank is NVML device 0 only when nothing remaps
them: [`nvml_device_index`][kareus.exec.nvml_device_index] finds the NVML index through the GPU's
UUID, which both numberings share.

It also holds the rule for how long a window read from NVML's total-energy counter must
last ([`min_energy_window_s`][kareus.exec.nvml_device.min_energy_window_s]), shared by the
training loop's runs (``kareus.exec.train.measure_runs``) and ``kareus verify``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from kareus.errors import HardwareError

__all__ = ["ENERGY_WINDOW_STEPS", "MIN_ENERGY_WINDOW_S", "cuda_device_uuid", "load_nvml",
           "min_energy_window_s", "nvml_device_index"]

#: The shortest window whose energy is read from the counter (s), whatever its step period.
MIN_ENERGY_WINDOW_S = 0.5

#: Counter steps a window spans at least (the NVML profiler's default ``window_steps``).
ENERGY_WINDOW_STEPS = 6


def min_energy_window_s(meter: Any = None) -> float:
    """How long a window must last for its energy to come from the counter's steps:
    ``ENERGY_WINDOW_STEPS + 1.5`` of the meter's observed step periods (the first and the
    last step bound the span; half a step of slack at each end), at least
    ``MIN_ENERGY_WINDOW_S`` (0.5 s). On an H200 (~100 ms steps) that is about 0.75 s:
    six or more steps inside, the span's ends each known to the polling period.

    Args:
        meter: An [`EnergyMeter`][kareus.profilers.EnergyMeter] (started), or anything with
            ``step_period_s()``; ``None`` or no period yet: 100 ms is assumed.
    """
    period = None
    get = getattr(meter, "step_period_s", None)
    if callable(get):
        try:
            period = get()
        except Exception:  # a meter that cannot tell: assume an H200's period
            period = None
    period = 0.1 if not period or period <= 0 else float(period)
    return max(MIN_ENERGY_WINDOW_S, (ENERGY_WINDOW_STEPS + 1.5) * period)


def load_nvml(nvml: Any = None) -> Any:
    """The NVML module (``pynvml``), initialised; ``nvml`` passes a fake through.

    Raises:
        HardwareError: nvidia-ml-py is missing or NVML cannot initialise.
    """
    if nvml is None:
        try:
            import pynvml
        except ImportError as exc:
            raise HardwareError("NVML is not available: install nvidia-ml-py") from exc
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception as exc:  # pynvml raises NVMLError subclasses
        raise HardwareError(
            f"NVML failed to initialise ({exc}): this needs a machine with NVIDIA GPUs and their "
            "driver. Without GPUs, measure with EmulatedProfiler (or replay recorded data with "
            "ReplayProfiler) and use DryRunFrequencyController") from exc
    return nvml


def _norm_uuid(uuid: Any) -> str:
    """A UUID as NVML or CUDA prints it, lower case and without the ``GPU-`` prefix."""
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    text = text.strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def cuda_device_uuid(device: int | None = None) -> str | None:
    """The UUID of CUDA device ``device`` (this process's numbering; ``None``: the current
    device) through torch, or ``None`` when torch or CUDA is not there.

    Args:
        device: CUDA device index as this process sees it.
    """
    try:
        import torch  # heavy, optional
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if device is None else int(device)
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return None if uuid is None or not str(uuid) else _norm_uuid(uuid)


def _visible_entry(device: int) -> str | None:
    """Entry ``device`` of ``CUDA_VISIBLE_DEVICES`` (``None`` when it is unset or empty)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return None
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not 0 <= device < len(entries):
        raise HardwareError(f"CUDA device {device} is not visible: CUDA_VISIBLE_DEVICES="
                            f"{visible!r} lists {len(entries)} GPU(s)")
    return entries[device]


def nvml_device_index(device: int | None = None, *, nvml: Any = None,
                      uuid_of: Callable[[int | None], str | None] | None = None) -> int:
    """The NVML index of CUDA device ``device``, safe under ``CUDA_VISIBLE_DEVICES``.

    The GPU is found by its UUID: from torch when CUDA is there (``uuid_of``), else from a
    UUID entry of ``CUDA_VISIBLE_DEVICES``; an integer entry there is taken as NVML's (PCI)
    index, which it is under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and on nodes of identical GPUs;
    without ``CUDA_VISIBLE_DEVICES`` the CUDA index is the NVML index.

    Args:
        device: CUDA device index as this process sees it (``None``: the current device,
            or 0 without torch).
        nvml: The NVML module (``None``: ``pynvml``); a fake for tests.
        uuid_of: ``device -> UUID or None``; ``None`` = ``cuda_device_uuid``.

    Raises:
        HardwareError: no NVML GPU has the UUID, or the device is not visible.
    """
    nvml = load_nvml(nvml)
    uuid = (uuid_of or cuda_device_uuid)(device)
    index = 0 if device is None else int(device)
    if uuid is None:
        entry = _visible_entry(index)
        if entry is None:
            return index
        if entry.isdigit():
            return int(entry)
        uuid = entry
    uuid = _norm_uuid(uuid)
    count = int(nvml.nvmlDeviceGetCount())
    for i in range(count):
        theirs = _norm_uuid(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)))
        # CUDA_VISIBLE_DEVICES may give a unique prefix of the UUID.
        if theirs == uuid or theirs.startswith(uuid):
            return i
    raise HardwareError(f"no GPU among NVML's {count} has the UUID {uuid} of CUDA device "
                        f"{index}: is NVML seeing another machine (container without the GPU)?")
