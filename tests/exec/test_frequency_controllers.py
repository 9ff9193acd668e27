"""Frequency controllers (kareus.exec.frequency._controllers), on CPU with a fake NVML."""

from __future__ import annotations

import os
import signal
import time

import pytest
from fake_nvml import FakeNVML

from kareus.errors import HardwareError, UnsupportedFrequencyError
from kareus.exec.frequency import (
    DryRunFrequencyController,
    FrequencyPermissionError,
    NVMLFrequencyController,
)

# ------------------------------------------------------------------ NVML controller


def test_locks_and_restores_every_gpu():
    nvml = FakeNVML(n=2)
    with NVMLFrequencyController(device_indices=[0, 1], gpu="h200-sxm", nvml=nvml,
                                 handle_signals=False) as ctrl:
        ctrl.set_frequency(1500)
        assert [d.locked for d in nvml.devices] == [(1500, 1500)] * 2
        assert ctrl.locked_devices == (0, 1)
    assert [d.locked for d in nvml.devices] == [None, None]
    assert ("reset", 0) in nvml.calls and ("reset", 1) in nvml.calls


def test_restores_on_exception():
    nvml = FakeNVML(n=1)
    with pytest.raises(RuntimeError, match="boom"), NVMLFrequencyController(
            device_indices=[0], nvml=nvml, handle_signals=False) as ctrl:
        ctrl.set_frequency(1200)
        raise RuntimeError("boom")
    assert nvml.devices[0].locked is None


def test_permission_denied_is_a_clear_hardware_error():
    nvml = FakeNVML(n=1, allow_clock_changes=False)
    ctrl = NVMLFrequencyController(device_indices=[0], nvml=nvml, handle_signals=False)
    with pytest.raises(FrequencyPermissionError, match="root") as info:
        ctrl.set_frequency(1500)
    assert isinstance(info.value, HardwareError) and isinstance(info.value, PermissionError)
    assert ctrl.locked_devices == ()
    ctrl.close()


def test_partial_failure_restores_gpus_already_locked():
    nvml = FakeNVML(n=2)
    orig = nvml.nvmlDeviceSetGpuLockedClocks

    def second_fails(h, lo, hi):
        if h is nvml.devices[1]:
            raise nvml.NVMLError_NoPermission()
        return orig(h, lo, hi)

    nvml.nvmlDeviceSetGpuLockedClocks = second_fails
    ctrl = NVMLFrequencyController(device_indices=[0, 1], nvml=nvml, handle_signals=False)
    with pytest.raises(FrequencyPermissionError):
        ctrl.set_frequency(1500)
    assert nvml.devices[0].locked is None  # the first GPU was put back
    ctrl.close()


def test_unsupported_clock_rejected_before_touching_hardware():
    nvml = FakeNVML(n=1)
    ctrl = NVMLFrequencyController(device_indices=[0], gpu="h200-sxm", nvml=nvml,
                                   handle_signals=False)
    with pytest.raises(UnsupportedFrequencyError, match="nearest"):
        ctrl.set_frequency(1501)
    assert not any(c[0] == "lock" for c in nvml.calls)
    ctrl.close()


def test_sigterm_restores_then_chains_previous_handler():
    nvml = FakeNVML(n=1)
    seen = []
    prev = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        ctrl = NVMLFrequencyController(device_indices=[0], nvml=nvml)
        ctrl.set_frequency(1410)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 2
        while not seen and time.time() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGTERM]
        assert nvml.devices[0].locked is None
        ctrl.close()
        assert signal.getsignal(signal.SIGTERM) is not ctrl._on_sigterm
    finally:
        signal.signal(signal.SIGTERM, prev)


def test_atexit_hook_restores():
    nvml = FakeNVML(n=1)
    ctrl = NVMLFrequencyController(device_indices=[0], nvml=nvml, handle_signals=False)
    ctrl.set_frequency(1605)
    ctrl._atexit()
    assert nvml.devices[0].locked is None
    ctrl.close()


def test_dry_run_records_requests_with_times():
    t = iter([1.0, 2.0, 3.0])
    ctrl = DryRunFrequencyController(gpu="h200-sxm", clock=lambda: next(t))
    with ctrl:
        ctrl.set_frequency(1500, token=7)
        ctrl.set_frequency(1200)
    assert [(r.freq_mhz, r.time_s, r.token) for r in ctrl.requests] == [
        (1500, 1.0, 7), (1200, 2.0, None), (None, 3.0, None)]
    with pytest.raises(UnsupportedFrequencyError):
        ctrl.set_frequency(1)


# ------------------------------------------------------------------ one clock check


@pytest.mark.parametrize("freq", [1501, 100, 5000])
def test_controllers_check_clocks_exactly_as_the_gpu_spec_does(freq):
    from kareus.model.gpu import get_gpu

    with pytest.raises(UnsupportedFrequencyError) as want:
        get_gpu("h200-sxm").check_clock(freq)
    nvml = FakeNVML(n=1)
    with NVMLFrequencyController(device_indices=[0], gpu="h200-sxm", nvml=nvml,
                                 handle_signals=False) as nvml_ctrl:
        for ctrl in (DryRunFrequencyController(gpu="h200-sxm"), nvml_ctrl):
            with pytest.raises(UnsupportedFrequencyError) as got:
                ctrl.set_frequency(freq)
            assert str(got.value) == str(want.value)
            assert "nearest supported" in str(got.value)
    assert not any(c[0] == "lock" for c in nvml.calls)
