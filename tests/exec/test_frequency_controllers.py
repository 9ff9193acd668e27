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
    LockingFrequencyController,
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


# ------------------------------------------------------------------ the shared base


class _ListController(LockingFrequencyController):
    """A controller over a dict of clocks: what a new backend implements (three hooks)."""

    def __init__(self, *, fail_on: int | None = None, fail_reset: bool = False) -> None:
        self.clocks: dict[int, int | None] = {0: None, 1: None}
        self.fail_on = fail_on
        self.fail_reset = fail_reset
        super().__init__(device_indices=[0, 1], gpu="h200-sxm")

    def _lock_device(self, index: int, freq_mhz: int) -> None:
        if index == self.fail_on:
            raise OSError("refused")
        self.clocks[index] = freq_mhz

    def _unlock_device(self, index: int) -> None:
        if self.fail_reset:
            raise OSError("stuck")
        self.clocks[index] = None

    def _error(self, exc: BaseException, what: str) -> HardwareError:
        return HardwareError(f"could not {what}: {exc}")


def test_the_base_restores_whatever_a_subclass_locked():
    with _ListController() as ctrl:
        ctrl.set_frequency(1500)
        assert ctrl.clocks == {0: 1500, 1: 1500} and ctrl.locked_devices == (0, 1)
        with pytest.raises(UnsupportedFrequencyError):
            ctrl.set_frequency(1501)  # checked before any GPU is touched
        assert ctrl.clocks == {0: 1500, 1: 1500}
    assert ctrl.clocks == {0: None, 1: None} and ctrl.locked_devices == ()
    assert [r.freq_mhz for r in ctrl.requests] == [1500, None]
    # a failure part way restores the GPUs already locked before it is raised
    partial = _ListController(fail_on=1)
    with pytest.raises(HardwareError, match="could not lock GPU 1 at 1200 MHz: refused"):
        partial.set_frequency(1200)
    assert partial.clocks == {0: None, 1: None}
    partial.close()
    # a failure to restore is raised, and the GPU stays marked as locked
    stuck = _ListController(fail_reset=True)
    stuck.set_frequency(1200)
    with pytest.raises(HardwareError, match="could not restore the default clocks of GPU 0"):
        stuck.reset()
    assert stuck.locked_devices == (0, 1)
    stuck.fail_reset = False
    stuck.close()
    assert stuck.locked_devices == ()
    with pytest.raises(ValueError, match="needs at least one GPU"):
        NVMLFrequencyController(device_indices=[], nvml=FakeNVML(n=1), handle_signals=False)


def test_dry_run_is_not_a_locking_controller():
    # The dry-run controller records; it never inherits the code that touches GPUs.
    assert not issubclass(DryRunFrequencyController, LockingFrequencyController)
    assert issubclass(NVMLFrequencyController, LockingFrequencyController)
