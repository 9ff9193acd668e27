"""kareus calibrate: measuring a GPU profile (driven on a CPU by a fake device)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kareus.cli import main
from kareus.exec.calibrate import (
    CalibrationDevice,
    MeasuredOp,
    OpProgram,
    calibrate_to_file,
    gpu_preset_of,
    measure_profile,
)
from kareus.exec.emulator import EmulatedGPU, profile_workload
from kareus.exec.emulator._calibration import _op_power_terms
from kareus.exec.emulator._gpu import _prep_op
from kareus.model import build_partitions
from kareus.model.gpu_profile import GPUProfile, GPUProfileError, MachineInfo


class EmulatedDevice(CalibrationDevice):
    """A device whose ops take ``factor[op]`` times the h200-sxm preset's model time at the
    maximum clock and draw the model's power there (no power limit)."""

    def __init__(self, factors: dict[str, float]) -> None:
        self.gpu = EmulatedGPU.from_spec("h200-sxm")
        self.factors = factors
        self.timed: list[str] = []
        self.powered: list[str] = []
        self.calls: list[str] = []  # "time" / "power", in order

    def machine(self) -> MachineInfo:
        return MachineInfo(gpu_name="NVIDIA H200 (fake)")

    def ceilings(self) -> tuple[float, float]:
        return 790.0, 4150.0

    def idle_power(self) -> tuple[float, int | None]:
        return 80.0, 345

    def waiting_power(self) -> tuple[float, int | None]:
        return 121.0, 1980

    def programs(self, workload: Any, kernels: str) -> Iterator[list[OpProgram]]:
        for part in build_partitions(workload):
            yield [OpProgram(partition=part.name, op=op, run=lambda op=op: op,
                             kernel=f"fake {kernels}") for op in part.compute_ops]

    def time_s(self, run: Callable[[], Any]) -> float:
        op = run()
        self.timed.append(op.name)
        self.calls.append("time")
        return self.gpu.op_time_s(op, 1980) * self.factors.get(op.name, 1.0)

    def power(self, run: Callable[[], Any], time_s: float, *, graph: bool) -> MeasuredOp:
        op = run()
        self.powered.append(op.name)
        self.calls.append("power")
        _, base, own = _op_power_terms(self.gpu, _prep_op(self.gpu, op), 1980)
        return MeasuredOp(power_w=base + own, busy_fraction=1.0, freq_mhz=1980)


def test_gpu_preset_of() -> None:
    assert gpu_preset_of("NVIDIA H200") == "h200-sxm"
    assert gpu_preset_of("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert gpu_preset_of("Tesla T4") is None


def test_measure_profile_and_recalibrate() -> None:
    """A device whose RoPE is 3x and swiglu 2x the model: the profile it gives calibrates the
    emulator to those factors (time), while GEMMs stay at the model's time."""
    dev = EmulatedDevice({"rope": 3.0, "swiglu": 2.0})
    wl = profile_workload("llama3.2-3b tp=2 cp=1 mbs=8 seq=4096 nb=2")
    prof = measure_profile(dev, gpu="h200-sxm", workloads=[wl],
                           kernel_sets=["triton", "reference"],
                           collectives_from=GPUProfile.preset("h200-sxm"))
    assert prof.kernel_set == "triton" and prof.static_power_w == 121.0
    assert prof.idle_freq_mhz == 345
    # The main set has every op with power; the second set no GEMMs and no power.
    assert {o.kind for o in prof.ops if o.kernels == "reference"} <= {"attention",
                                                                        "elementwise"}
    assert all(o.power_w is None for o in prof.ops if o.kernels == "reference")
    assert all(o.power_w is not None for o in prof.ops if o.kernels == "triton")
    assert set(dev.powered) == {o.op for o in prof.ops if o.kernels == "triton"}
    assert prof.collectives  # copied from the shipped profile
    gpu = EmulatedGPU.from_profile(prof, comm_backend="nccl")
    part = build_partitions(wl)["fwd_attn"]
    base = EmulatedGPU.from_spec("h200-sxm")
    for op in part.compute_ops:
        want = base.op_time_s(op, 1980) * (3.0 if op.name == "rope" else 1.0)
        assert gpu.op_time_s(op, 1980, partition="fwd_attn") == pytest.approx(want, rel=0.02)
    # Power at the model's: factor 1 (the profile's uncore differs: idle/spin measured).
    for c in gpu.op_calibration:
        if c.partition == "fwd_mlp" and c.op in ("gate", "up", "down"):
            assert c.power_factor == pytest.approx(1.0, abs=0.1)


def test_every_op_is_timed_before_any_power_loop_of_its_workload() -> None:
    # A power loop holds a real GPU at its power limit; an op timed after one would run at
    # a lower clock. Per workload and kernel set: all timings, then all power loops.
    dev = EmulatedDevice({})
    wls = [profile_workload("llama3.2-3b tp=2 cp=1 mbs=8 seq=4096 nb=2"),
           profile_workload("qwen3-1.7b tp=4 cp=2 mbs=8 seq=4096 nb=2")]
    prof = measure_profile(dev, gpu="h200-sxm", workloads=wls, kernel_sets=["triton"])
    runs = "".join("t" if c == "time" else "p" for c in dev.calls)
    # two workloads: t...tp...pt...tp...p, each op timed once and powered once
    blocks = runs.replace("pt", "p|t").split("|")
    assert len(blocks) == 2 and all(b == "t" * b.count("t") + "p" * b.count("p") for b in blocks)
    assert sorted(dev.timed) == sorted(dev.powered) and len(prof.ops) == len(dev.timed)


def test_measure_profile_refuses_other_gpus_collectives() -> None:
    with pytest.raises(GPUProfileError, match="cannot serve"):
        measure_profile(EmulatedDevice({}), gpu="a100-40gb",
                        workloads=[profile_workload("llama3.2-3b")], kernel_sets=["triton"],
                        collectives_from=GPUProfile.preset("h200-sxm"))
    with pytest.raises(GPUProfileError, match="kernel set"):
        measure_profile(EmulatedDevice({}), gpu="h200-sxm",
                        workloads=[profile_workload("llama3.2-3b")], kernel_sets=[])


def test_calibrate_to_file(tmp_path: Path) -> None:
    lines: list[str] = []
    path = calibrate_to_file(tmp_path / "p.json", workloads=["llama3.2-3b"],
                             kernels=["triton"], device=EmulatedDevice({}), log=lines.append)
    prof = GPUProfile.load(path)
    assert prof.gpu == "h200-sxm" and any(n.startswith("measured ") for n in prof.notes)
    assert any("ceilings" in line for line in lines)
    EmulatedGPU.from_profile(path)  # usable as it is
    none = calibrate_to_file(tmp_path / "q.json", workloads=["llama3.2-3b"],
                             kernels=["triton"], device=EmulatedDevice({}),
                             collectives_from="none")
    with pytest.raises(GPUProfileError, match="collective"):
        EmulatedGPU.from_profile(none)


def test_cli_calibrate_without_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    """On a machine without CUDA (or torch) the command fails in one line, exit 1."""
    try:
        import torch
        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
    except ImportError:
        pass
    rc = main(["calibrate", "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "GPU" in err
    assert not (tmp_path / "p.json").exists()


def test_cli_optimize_gpu_profile_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    rc = main(["optimize", "--workload", "llama3.2-3b", "--gpu", "a100-40gb",
               "--gpu-profile", "h200-sxm", "--out", str(tmp_path / "o")])
    assert rc == 2 and "disagree" in capsys.readouterr().err
    rc = main(["optimize", "--workload", "llama3.2-3b", "--profiler", "nvml",
               "--gpu-profile", "h200-sxm", "--out", str(tmp_path / "o")])
    assert rc == 2 and "--gpu-profile calibrates the emulated" in capsys.readouterr().err


def test_cli_profiler_from_gpu_profile() -> None:
    from kareus.cli import _profiler_from_args, build_parser

    args = build_parser().parse_args(["optimize", "--workload", "llama3.2-3b",
                                      "--gpu-profile", "h200-sxm", "--noise", "0"])
    prof = _profiler_from_args(args)
    assert prof.gpu.name == "h200-sxm" and prof.emulated_gpu.op_calibration
    assert prof.calibration.startswith("profile h200-sxm")
