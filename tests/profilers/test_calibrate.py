"""kareus calibrate: measuring a GPU profile (driven on a CPU by a fake device)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from kareus.cli import main
from kareus.model import build_partitions
from kareus.model.gpu_profile import GPUProfile, GPUProfileError, MachineInfo
from kareus.profilers.calibrate import (
    CalibrationDevice,
    MeasuredOp,
    OpProgram,
    TorchCalibrationDevice,
    calibrate_to_file,
    gpu_preset_of,
    measure_profile,
)
from kareus.profilers.emulator import EmulatedGPU, profile_workload
from kareus.profilers.emulator._calibration import TIMED_FLOOR_S, _op_power_terms
from kareus.profilers.emulator._opmodel import _prep_op


class EmulatedDevice(CalibrationDevice):
    """A device whose ops take ``factor[op]`` times the h200-sxm preset's model work time at
    the maximum clock, timed alone (plus the fixed cost of timing one op,
    ``TIMED_FLOOR_S``), and draw the model's power there (no power limit)."""

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
        work = self.gpu.op_time_s(op, 1980) - self.gpu.launch_overhead_s
        return work * self.factors.get(op.name, 1.0) + TIMED_FLOOR_S

    def power(self, run: Callable[[], Any], time_s: float, *, graph: bool) -> MeasuredOp:
        op = run()
        self.powered.append(op.name)
        self.calls.append("power")
        _, base, own = _op_power_terms(self.gpu, _prep_op(self.gpu, op), 1980)
        return MeasuredOp(power_w=base + own, busy_fraction=1.0, freq_mhz=1980)


class HostDevice(EmulatedDevice):
    """:class:`EmulatedDevice` that also measures host cost: each op's launch takes
    ``1 + len(name)`` microseconds (distinct from every default of the emulator)."""

    host_method = "fake: 1 + len(op name) us per call"

    def __init__(self, factors: dict[str, float]) -> None:
        super().__init__(factors)
        self.hosted: list[str] = []

    def host_s(self, run: Callable[[], Any]) -> float | None:
        op = run()
        self.hosted.append(op.name)
        self.calls.append("host")
        return (1 + len(op.name)) * 1e-6


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
        gap = base.launch_overhead_s
        want = (base.op_time_s(op, 1980) - gap) * (3.0 if op.name == "rope" else 1.0) + gap
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

    args = build_parser().parse_args(["optimize", "--workload", "llama3.2-3b", "--gpu",
                                      "h200-sxm", "--gpu-profile", "h200-sxm", "--noise", "0"])
    prof = _profiler_from_args(args)
    assert prof.gpu.name == "h200-sxm" and prof.emulated_gpu.op_calibration
    assert prof.calibration.startswith("profile h200-sxm")


def test_measure_profile_records_host_costs(tmp_path: Path) -> None:
    """A device that measures host cost: every op timed has its host time and the profile
    says how it was measured; the emulator calibrated from it launches each op at that
    cost, eagerly."""
    from kareus.model import ScheduleConfig
    from kareus.profilers.emulator import EmulatedProfiler

    dev = HostDevice({})
    wl = profile_workload("llama3.2-3b tp=2 cp=1 mbs=8 seq=4096 nb=2")
    prof = measure_profile(dev, gpu="h200-sxm", workloads=[wl],
                           kernel_sets=["triton", "reference"],
                           collectives_from=GPUProfile.preset("h200-sxm"))
    assert prof.host_method == HostDevice.host_method
    assert any(n.startswith("ops: host_s = fake") for n in prof.notes)
    assert all(o.host_s == pytest.approx((1 + len(o.op)) * 1e-6) for o in prof.ops)
    assert sorted(dev.hosted) == sorted(dev.timed)
    # Timings and host costs of a kernel set before any of its power loops.
    runs = "".join("p" if c == "power" else "t" for c in dev.calls)
    blocks = runs.replace("pt", "p|t").split("|")
    assert all(b == "t" * b.count("t") + "p" * b.count("p") for b in blocks)
    loaded = GPUProfile.load(prof.save(tmp_path / "p.json"))
    assert loaded == prof and loaded.digest == prof.digest
    gpu = EmulatedGPU.from_profile(loaded, comm_backend="nccl")
    part = build_partitions(wl)["fwd_attn"]
    for op in part.compute_ops:
        assert gpu.host_s(op, "fwd_attn") == pytest.approx((1 + len(op.name)) * 1e-6)
    eager = EmulatedProfiler(gpu, noise=0.0, execution="eager")
    tr = eager.trace(part, ScheduleConfig(1980, 8, None))
    want = sum((1 + len(o.name)) * 1e-6 for o in part.compute_ops) + gpu.collective_host_s
    assert tr.host_s == pytest.approx(want) and not tr.host_bound


def test_a_device_without_host_costs_writes_none() -> None:
    """The default device measures no host cost: the profile has none and stores no field
    for it (a profile written before host costs existed looks the same)."""
    prof = measure_profile(EmulatedDevice({}), gpu="h200-sxm",
                           workloads=[profile_workload("llama3.2-3b")], kernel_sets=["triton"])
    assert prof.host_method == "" and all(o.host_s is None for o in prof.ops)
    body = prof.profile_dict()
    assert "host_method" not in body and all("host_s" not in o for o in body["ops"])


class _FakeCuda:
    """The part of ``torch.cuda`` that :meth:`TorchCalibrationDevice.host_s` uses: a spin
    that stays busy for ``busy_for`` more calls of the op, per spin length."""

    def __init__(self, outlasts: list[bool]) -> None:
        self.outlasts = outlasts  # per spin: whether it is still running after the calls
        self.spins: list[int] = []
        self.syncs = 0

    def _sleep(self, cycles: int) -> None:
        self.spins.append(cycles)

    def synchronize(self) -> None:
        self.syncs += 1

    def Event(self) -> Any:
        cuda = self

        class _Event:
            def record(self) -> None:
                pass

            def query(self) -> bool:  # True: done (no longer busy)
                return not cuda.outlasts[len(cuda.spins) - 1]
        return _Event()


def _torch_device(outlasts: list[bool], reps: int = 30) -> tuple[Any, _FakeCuda]:
    dev = object.__new__(TorchCalibrationDevice)  # no CUDA here: only host_s is driven
    cuda = _FakeCuda(outlasts)
    dev.torch = type("FakeTorch", (), {"cuda": cuda})()
    dev.reps = reps
    return dev, cuda


def test_torch_device_host_cost_median_with_the_gpu_kept_busy() -> None:
    calls: list[int] = []

    def run() -> None:
        calls.append(1)
        sum(range(200))

    dev, cuda = _torch_device([True], reps=10)
    host = dev.host_s(run)
    assert host is not None and 0 < host < 0.01
    assert len(calls) == 1 + 30  # a warm-up call, then at least 30 timed
    assert cuda.spins == [TorchCalibrationDevice._HOST_SPIN_CYCLES]
    # The calls outlast the first spin: timed again under a 4x longer one.
    calls.clear()
    dev, cuda = _torch_device([False, True], reps=40)
    assert dev.host_s(run) is not None
    assert len(calls) == 1 + 2 * 40
    assert cuda.spins == [TorchCalibrationDevice._HOST_SPIN_CYCLES,
                          4 * TorchCalibrationDevice._HOST_SPIN_CYCLES]
    # Never kept busy (the call waits on the GPU): no launch cost to report.
    dev, cuda = _torch_device([False] * (TorchCalibrationDevice._HOST_SPIN_RETRIES + 1))
    assert dev.host_s(run) is None
    assert len(cuda.spins) == TorchCalibrationDevice._HOST_SPIN_RETRIES + 1


class GraphDevice(EmulatedDevice):
    """:class:`EmulatedDevice` whose power loops say how they launched the op: from a CUDA
    graph where the profile asks for one (every op but attention), else eagerly."""

    def power(self, run: Callable[[], Any], time_s: float, *, graph: bool) -> MeasuredOp:
        m = super().power(run, time_s, graph=graph)
        return MeasuredOp(power_w=m.power_w, busy_fraction=m.busy_fraction,
                          freq_mhz=m.freq_mhz, graphed=graph)


def test_the_profile_says_how_each_power_loop_launched_its_op(tmp_path: Path) -> None:
    wl = profile_workload("llama3.2-3b tp=2 cp=1 mbs=8 seq=4096 nb=2")
    prof = measure_profile(GraphDevice({}), gpu="h200-sxm", workloads=[wl],
                           kernel_sets=["triton", "reference"])
    main_set = [o for o in prof.ops if o.kernels == "triton"]
    assert {o.power_execution for o in main_set if o.kind == "attention"} == {"eager"}
    assert {o.power_execution for o in main_set if o.kind != "attention"} == {"graphed"}
    assert all(o.power_execution is None for o in prof.ops if o.kernels == "reference")
    assert any("power_execution" in n and "eagerly" in n for n in prof.notes)
    loaded = GPUProfile.load(prof.save(tmp_path / "p.json"))
    assert loaded == prof and loaded.digest == prof.digest
    # A device that does not say (and every profile written before) stores no such field.
    body = measure_profile(EmulatedDevice({}), gpu="h200-sxm", workloads=[wl],
                           kernel_sets=["triton"]).profile_dict()
    assert all("power_execution" not in o for o in body["ops"])
    with pytest.raises(GPUProfileError, match="power_execution"):
        attrs.evolve(main_set[0], power_execution="replayed")
