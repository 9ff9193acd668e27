"""Reaching NVML and finding this process's GPU in it by UUID (kareus.exec.nvml_device),
on a fake NVML with a remapped CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import pytest
from fake_nvml import FakeNVML

from kareus.errors import HardwareError
from kareus.exec.frequency import NVMLFrequencyController
from kareus.profilers.nvml import EnergyMeter, nvml_device_index


def test_missing_driver_says_what_to_do():
    from kareus.profilers.nvml import load_nvml

    class NoDriver:
        def nvmlInit(self):
            raise RuntimeError("NVML Shared Library Not Found")

    with pytest.raises(HardwareError, match="EmulatedProfiler"):
        load_nvml(NoDriver())


# ------------------------------------------------------------- CUDA device -> NVML index


def _no_torch_uuid(device):
    return None


def test_without_remapping_the_cuda_index_is_the_nvml_index(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNVML(n=4)
    assert nvml_device_index(2, nvml=nvml, uuid_of=_no_torch_uuid) == 2


@pytest.mark.parametrize(("visible", "cuda", "nvml_index"),
                         [("2,3", 0, 2), ("3,1", 1, 1), ("3", 0, 3)])
def test_a_remapped_cuda_visible_devices_is_followed(monkeypatch, visible, cuda, nvml_index):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert nvml_device_index(cuda, nvml=FakeNVML(n=4), uuid_of=_no_torch_uuid) == nvml_index


def test_uuids_in_cuda_visible_devices_and_from_cuda_are_matched(monkeypatch):
    nvml = FakeNVML(n=4)
    uuids = [d.uuid for d in nvml.devices]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{uuids[3]},{uuids[1][:12]}")  # a prefix too
    assert nvml_device_index(0, nvml=nvml, uuid_of=_no_torch_uuid) == 3
    assert nvml_device_index(1, nvml=nvml, uuid_of=_no_torch_uuid) == 1
    # The UUID CUDA reports wins over the environment (torch strips the "GPU-" prefix).
    assert nvml_device_index(0, nvml=nvml, uuid_of=lambda d: uuids[2][4:].upper()) == 2
    with pytest.raises(HardwareError, match="UUID"):
        nvml_device_index(0, nvml=nvml, uuid_of=lambda d: "ffffffff")
    with pytest.raises(HardwareError, match="not visible"):
        nvml_device_index(5, nvml=nvml, uuid_of=_no_torch_uuid)


def test_meter_and_frequency_controller_default_to_this_process_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    import kareus.exec.nvml_device as device

    monkeypatch.setattr(device, "cuda_device_uuid", _no_torch_uuid)  # as on a CPU
    nvml = FakeNVML(n=4)
    meter = EnergyMeter(nvml=nvml)
    assert meter.device_indices == (2,)
    with NVMLFrequencyController(nvml=nvml, gpu="h200-sxm", handle_signals=False) as ctrl:
        assert ctrl.device_indices == (2,)
        ctrl.set_frequency(1500)
        assert [d.locked for d in nvml.devices] == [None, None, (1500, 1500), None]
