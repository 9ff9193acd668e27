import pytest

from kareus.errors import UnknownPresetError
from kareus.model import GPU_PRESETS, GPUSpec, get_gpu, gpu_names


def test_presets_match_facts():
    a100 = get_gpu("a100-40gb")
    assert a100.sm_count == 108
    assert a100.max_clock_mhz == 1410
    assert a100.static_power_w == 85.0
    assert a100.search_clocks_mhz[0] == 1410 and a100.search_clocks_mhz[-1] == 900
    assert len(a100.search_clocks_mhz) == 18
    h200 = get_gpu("h200-sxm")
    assert h200.sm_count == 132
    assert len(h200.clocks_mhz) == 110
    assert h200.clocks_mhz[0] == 345 and h200.max_clock_mhz == 1980
    assert h200.hbm_bandwidth_gbps == 4800.0
    assert get_gpu("h100-sxm").hbm_bandwidth_gbps == 3350.0


def test_unknown_gpu_lists_known_names():
    with pytest.raises(UnknownPresetError) as info:
        get_gpu("v100")
    msg = str(info.value)
    assert "v100" in msg
    for name in gpu_names():
        assert name in msg
    assert isinstance(info.value, ValueError)


def test_gpuspec_passes_through_and_validates():
    g = GPU_PRESETS["h200-sxm"]
    assert get_gpu(g) is g
    with pytest.raises(ValueError, match="search_clocks_mhz"):
        GPUSpec(name="x", sm_count=10, clocks_mhz=[100, 200], search_clocks_mhz=(150,),
                bf16_peak_tflops=1, hbm_bandwidth_gbps=1, nvlink_bandwidth_gbps=1,
                power_limit_w=1, static_power_w=1, idle_power_w=1, default_comm_sms=2,
                memory_gib=1)


def test_nearest_clock_and_support():
    g = get_gpu("h200-sxm")
    assert g.supports_clock(1500)
    assert not g.supports_clock(1501)
    assert g.nearest_clock(1501) == 1500
