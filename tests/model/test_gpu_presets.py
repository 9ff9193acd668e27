"""The GPU presets ship as GPU files (``kareus/model/gpus/*.toml``) read by the loader users
use; every figure is the one the presets had when they were written as code."""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import attrs
import pytest

from kareus.model import GPU_PRESETS, get_gpu
from kareus.model.files import load_gpu_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
GPU_DIR = REPO / "kareus" / "model" / "gpus"

#: The presets as kareus.model.gpu wrote them in code before they became files.
BEFORE = {
    "a100-40gb": dict(
        name="a100-40gb", sm_count=108,
        clocks_mhz=tuple(range(210, 1410 + 1, 15)),
        search_clocks_mhz=tuple(1410 - i * 30 for i in range(18)),
        bf16_peak_tflops=312.0, hbm_bandwidth_gbps=1555.0, nvlink_bandwidth_gbps=600.0,
        power_limit_w=400.0, static_power_w=85.0, idle_power_w=55.0, default_comm_sms=32,
        memory_gib=40.0),
    "h100-sxm": dict(
        name="h100-sxm", sm_count=132,
        clocks_mhz=tuple(range(345, 1980 + 1, 15)),
        search_clocks_mhz=tuple(1980 - i * 45 for i in range(18)),
        bf16_peak_tflops=989.0, hbm_bandwidth_gbps=3350.0, nvlink_bandwidth_gbps=900.0,
        power_limit_w=700.0, static_power_w=78.0, idle_power_w=78.0, default_comm_sms=32,
        memory_gib=80.0),
    "h200-sxm": dict(
        name="h200-sxm", sm_count=132,
        clocks_mhz=tuple(range(345, 1980 + 1, 15)),
        search_clocks_mhz=tuple(1980 - i * 45 for i in range(18)),
        bf16_peak_tflops=989.0, hbm_bandwidth_gbps=4800.0, nvlink_bandwidth_gbps=900.0,
        power_limit_w=700.0, static_power_w=78.0, idle_power_w=78.0, default_comm_sms=32,
        memory_gib=141.0),
}


def test_the_presets_are_the_shipped_files() -> None:
    assert sorted(GPU_PRESETS) == sorted(p.stem for p in GPU_DIR.glob("*.toml"))
    assert sorted(GPU_PRESETS) == sorted(BEFORE)


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_every_field_is_unchanged(name: str) -> None:
    spec = GPU_PRESETS[name]
    now = attrs.asdict(spec)
    assert set(now) == set(BEFORE[name]), "a field was added or removed: extend BEFORE"
    for field, value in BEFORE[name].items():
        assert now[field] == value, field
        assert type(now[field]) is type(value), field
    assert spec.clocks_mhz[0] == spec.min_clock_mhz and len(spec.clocks_mhz) == (
        110 if name != "a100-40gb" else 81)


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_each_file_reads_through_the_public_loader(name: str) -> None:
    assert load_gpu_file(GPU_DIR / f"{name}.toml") == get_gpu(name)
    assert get_gpu(name).is_preset


def test_the_files_ship_in_the_wheel() -> None:
    # pyproject's package-data must name the files, or an installed kareus has no presets.
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = config["tool"]["setuptools"]["package-data"]["kareus"]
    for path in GPU_DIR.glob("*.toml"):
        rel = path.relative_to(REPO / "kareus").as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), rel
