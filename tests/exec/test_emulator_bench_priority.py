"""bench/emulator_calibration.py and bench/emulator_validation_tp2.py emulate measured data
at the stream priority it ran at (docs/emulator.md)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_calibration_emulates_the_probe_at_normal_priority() -> None:
    ec = _bench("emulator_calibration")
    if not ec.DATA.exists():
        pytest.skip("needs the measured probe in data/")
    data = json.loads(ec.DATA.read_text())
    gpu = ec.EmulatedGPU.from_spec("h200-sxm", comm_backend="nccl")
    err = {}
    for p in ("high", "normal"):
        rows, _ = ec.probe_rows(gpu.with_(comm_priority=p), data, 32)
        err[p] = {(r["cap"], r["mode"]): r["time_rel_err"] for r in rows}
    # seq is unaffected; the all-reduce launched with the first GEMM at 2 CTAs (on the
    # critical path) starts later at normal priority, closer to the measured time.
    assert err["normal"][(4, "seq")] == err["high"][(4, "seq")]
    assert abs(err["normal"][(2, "with_gemm")]) < abs(err["high"][(2, "with_gemm")])
