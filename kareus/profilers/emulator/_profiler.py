"""The embedded default profiler: measures partitions on an [`EmulatedGPU`][kareus.profilers.EmulatedGPU]."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from kareus.errors import ArgumentError, ArgumentTypeError, UnknownSlotError
from kareus.model.config import ScheduleConfig
from kareus.model.gpu import GPUSpec
from kareus.model.measurement import Measurement
from kareus.model.ops import ComputeOp
from kareus.model.partition import OutsideWork, Partition
from kareus.model.profiler import Profiler
from kareus.profilers.emulator._gpu import EmulatedGPU
from kareus.profilers.emulator._opmodel import _Op, _prep_op
from kareus.profilers.emulator._sim import EmulationTrace, _Collective, _collective, _Sim

__all__ = ["EmulatedProfiler"]


@attrs.frozen
class _Prepared:
    partition: Partition
    sim: _Sim
    slot_index: dict[str, int]
    bus_bytes: float
    group_gpus: int
    key: str  # a digest of the partition's name, ops and collective (keys the noise)
    results: dict[tuple[int, int, str | None], tuple[float, float, int]] = attrs.field(
        factory=dict)


class EmulatedProfiler(Profiler):
    """The embedded default profiler: measures partitions on an [`EmulatedGPU`][kareus.profilers.EmulatedGPU].

    Args:
        gpu: An [`EmulatedGPU`][kareus.profilers.EmulatedGPU], a [`GPUSpec`][kareus.model.GPUSpec] or a
            preset name (``None``: the ``a100-40gb`` preset).
        noise: Relative standard deviation of the multiplicative measurement noise on
            energy (default 1%); ``0`` gives the noise-free ground truth.
        time_noise: Relative standard deviation of the noise on time; ``None`` = a quarter
            of ``noise`` (on real GPUs time scatters far less than NVML energy: repeats on
            2x H200 scattered by 0.70% / 0.26% in time and 1.65% / 0.48% in energy,
            ``data/h200_llama3b_tp2_grid13.json``, docs/results.md).
        seed: Seed of the noise. The noise of a measurement depends only on ``(seed,
            what is measured, its repeat index)``: what is measured is the partition (its
            name, ops and collective) or the outside work, and the configuration; the
            repeat index counts earlier measurements of that same thing by this profiler.
            Nothing depends on how many other measurements came before, so a run that is
            killed and resumed, or whose searches run in another order or as parallel
            tasks, measures exactly what an uninterrupted serial run measures.
        group_gpus: GPUs a partition's measurement covers: an int, a callable
            ``partition -> int``, or ``None``: ``partition.group_gpus`` (for partitions
            built by ``build_partitions``, the stage's TP x CP GPUs), else the collective's
            group size.
        power_limit: Whether the emulated GPU lowers its clock above its power limit
            (default True, as real GPUs do).
        comm_priority: The collective's stream priority, ``"high"`` or ``"normal"``
            (``EmulatedGPU.comm_priority``); ``None``: the emulated GPU's (``"high"``
            unless it was made otherwise). Part of the run's manifest when not ``"high"``.
        execution: How the host feeds the GPU, ``"graphed"`` (CUDA-graph replay, what the
            executor runs on a GPU) or ``"eager"`` (every op launched from the host at its
            host cost; ``TorchExecutor(graphs=False)``, ``--no-graphs``):
            ``EmulatedGPU.execution``; ``None``: the emulated GPU's (``"graphed"``
            unless it was made otherwise). Part of the run's manifest and search logs.

    Scope: a partition's Measurement covers every GPU of its group: per-GPU energy x GPUs,
    and static power x GPUs (the ranks of a collective are symmetric).
    """

    def __init__(
        self,
        gpu: EmulatedGPU | GPUSpec | str | None = None,
        *,
        noise: float = 0.01,
        time_noise: float | None = None,
        seed: int = 0,
        group_gpus: int | Callable[[Partition], int] | None = None,
        power_limit: bool = True,
        comm_priority: str | None = None,
        execution: str | None = None,
    ) -> None:
        if gpu is None:
            gpu = "a100-40gb"
        if isinstance(gpu, (str, GPUSpec)):
            gpu = EmulatedGPU.from_spec(gpu)
        if not isinstance(gpu, EmulatedGPU):
            raise ArgumentTypeError(f"gpu must be an EmulatedGPU, GPUSpec or preset name, got "
                                    f"{type(gpu).__name__}")
        if comm_priority is not None and comm_priority != gpu.comm_priority:
            gpu = gpu.with_(comm_priority=comm_priority)
        if execution is not None and execution != gpu.execution:
            gpu = gpu.with_(execution=execution)
        for label, value in (("noise", noise), ("time_noise", time_noise)):
            if value is not None and not (isinstance(value, (int, float)) and 0 <= value < 0.5):
                raise ArgumentError(f"{label} must be in [0, 0.5), got {value!r}")
        if (group_gpus is not None and not callable(group_gpus)
                and (not isinstance(group_gpus, int) or group_gpus < 1)):
            raise ArgumentError(f"group_gpus must be a positive int, a callable or None, "
                                f"got {group_gpus!r}")
        self.emulated_gpu: EmulatedGPU = gpu
        self.gpu: GPUSpec = gpu.spec
        self.noise = float(noise)
        self.time_noise = 0.25 * self.noise if time_noise is None else float(time_noise)
        self.seed = int(seed)
        self.group_gpus = group_gpus
        self.power_limit = bool(power_limit)
        self.calls = 0
        self._repeats: dict[str, int] = {}
        self._prepared: dict[int, _Prepared] = {}
        self._op_cache: dict[tuple[str | None, ComputeOp], _Op] = {}
        self._clocks = self.gpu.clocks_mhz

    # ------------------------------------------------------------------ public API
    def measure(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        """Emulate one run of ``partition`` under ``config`` (noisy unless ``noise=0``).

        Raises:
            TypeError: ``partition`` or ``config`` has the wrong type.
            UnsupportedFrequencyError, InvalidSMCountError, UnknownSlotError: ``config``
                does not fit the GPU or the partition.
        """
        prep = self._prepare(partition)
        if not isinstance(config, ScheduleConfig):
            raise ArgumentTypeError(f"config must be a ScheduleConfig, got {type(config).__name__}")
        key = (config.freq_mhz, config.comm_sms, config.launch_slot)
        res = prep.results.get(key)
        if res is None:
            self._check(prep, config)
            res = self._emulate(prep, config)
            if len(prep.results) > 100_000:
                prep.results.clear()
            prep.results[key] = res
        time_s, energy_gpu, _ = res
        g = prep.group_gpus
        return self._noisy(time_s, energy_gpu * g, self.gpu.static_power_w * g,
                           key=f"{prep.key}|{key}|{g}")

    def measure_outside(self, work: OutsideWork, freq_mhz: int, *, group_size: int,
                        comm_sms: int | None = None) -> Measurement:
        """Emulate work outside partitions: its ops, then its collectives, no overlap.

        Args:
            work: The ops and collectives.
            freq_mhz: Requested SM clock (the power limit may lower it).
            group_size: GPUs the measurement covers (energy and static power scale with it).
            comm_sms: SMs of each collective (``None``: the GPU's default, NCCL's CTA count).
        """
        if not isinstance(work, OutsideWork):
            raise ArgumentTypeError(f"work must be an OutsideWork, got {type(work).__name__}")
        if not isinstance(group_size, int) or group_size < 1:
            raise ArgumentError(f"group_size must be a positive int, got {group_size!r}")
        self._check_freq(int(freq_mhz))
        sms = self.gpu.default_comm_sms if comm_sms is None else int(comm_sms)
        self._check_sms(sms)
        key = f"outside|{work!r}|{int(freq_mhz)}|{sms}|{group_size}"
        if work.empty:
            return self._noisy(0.0, 0.0, self.gpu.static_power_w * group_size, key=key)
        time_s, energy = self._outside_gpu(work, int(freq_mhz), sms)
        return self._noisy(time_s, energy * group_size, self.gpu.static_power_w * group_size,
                           key=key)

    def _outside_gpu(self, work: OutsideWork, freq_mhz: int, sms: int) -> tuple[float, float]:
        """(time, energy of one GPU) of outside work: ops and NVLink collectives in the
        simulation; collectives that cross nodes (``OutsideWork.crosses_node``) and the
        pipeline send at the network's (or NVLink's) rate while the GPU waits (idle +
        uncore power, link energy)."""
        gpu = self.emulated_gpu
        sim_comms = [c for c in work.comms if not work.crosses_node(c)]
        net_comms = [c for c in work.comms if work.crosses_node(c)]
        time_s = energy = 0.0
        f = freq_mhz
        if work.ops or sim_comms:
            sim = _Sim(gpu, [self._op(o) for o in work.ops])
            comms = [_collective(gpu, c, sms, None) for c in sim_comms]
            time_s, energy, f, _ = self._run_limited(sim, freq_mhz, comms)
        wait_w = gpu.spec.idle_power_w + gpu.uncore_power_w * gpu.dynamic_scale(f)
        e_link = gpu.link_energy_pj_per_byte * 1e-12
        transfers: list[tuple[float, float]] = []  # (bytes on the wire, bytes/s)
        if net_comms:
            net = gpu.network_gb_per_s * 1e9
            transfers += [(c.bus_bytes, net) for c in net_comms]
        if work.p2p_bytes:
            rate = (gpu.network_gb_per_s * 1e9 if work.p2p_cross_node
                    else gpu.comm_curve("all_gather", 2)[1] * 1e9)
            transfers.append((work.p2p_bytes, rate))
        for nbytes, rate in transfers:
            dt = gpu.network_latency_s + nbytes / rate
            time_s += dt
            energy += wait_w * dt + e_link * nbytes
        return time_s, energy

    @property
    def comm_priority(self) -> str:
        """The collective's stream priority, ``"high"`` or ``"normal"``
        (``EmulatedGPU.comm_priority``); part of a run's manifest when ``"normal"``."""
        return self.emulated_gpu.comm_priority

    @property
    def execution(self) -> str:
        """How the host feeds the emulated GPU, ``"graphed"`` or ``"eager"``
        (``EmulatedGPU.execution``); part of a run's manifest and search logs."""
        return self.emulated_gpu.execution

    @property
    def calibration(self) -> str:
        """How the emulated GPU was calibrated (``""``: the preset's constants); part of a
        run's manifest, so a run with another profile is not mixed with this one."""
        return self.emulated_gpu.calibration

    def static_power_w(self, group_size: int) -> float:
        """Static power of ``group_size`` GPUs."""
        return self.gpu.static_power_w * group_size

    @property
    def uses_gpus(self) -> bool:
        """``False``: the emulated GPU runs on the CPU."""
        return False

    def identity(self) -> dict[str, Any]:
        """The class, the noise levels and seed, whether the power limit lowers the clock,
        the calibration (when from a measured profile), the collective's priority (when
        ``"normal"``) and the execution mode: every setting that changes a number."""
        ident: dict[str, Any] = {"class": f"{type(self).__module__}.{type(self).__qualname__}",
                                 "noise": self.noise, "time_noise": self.time_noise,
                                 "seed": self.seed, "power_limit": self.power_limit}
        if self.calibration:
            ident["calibration"] = self.calibration
        if self.comm_priority != "high":
            ident["comm_priority"] = self.comm_priority
        ident["execution"] = self.execution
        return ident

    @property
    def measurement_count(self) -> int:
        """Measurements made since construction or ``reset_noise`` (``calls``): the noise of a
        measurement is drawn from the seed and this count."""
        return self.calls

    def advance_measurements(self, count: int) -> None:
        """Count ``count`` measurements made by copies (a pool's search tasks) as made here,
        so the next measurement draws the noise one process would."""
        self.calls += int(count)

    def trace(self, partition: Partition, config: ScheduleConfig) -> EmulationTrace:
        """The noise-free emulated run of ``partition`` under ``config``, for one GPU, with
        its effective clock, collective timing and per-op times (does not count as a call)."""
        prep = self._prepare(partition)
        self._check(prep, config)
        comms = self._comms(prep, config)
        time_s, energy, f_eff, limited = self._run_limited(prep.sim, config.freq_mhz, comms)
        _, _, d = prep.sim.run(f_eff, comms, detail=True)
        assert d is not None
        return EmulationTrace(
            time_s=time_s, energy_j=energy, freq_mhz=f_eff, requested_freq_mhz=config.freq_mhz,
            power_limited=limited, average_power_w=energy / time_s if time_s else 0.0,
            compute_end_s=d["compute_end_s"], comm_start_s=d["comm_start_s"],
            comm_end_s=d["comm_end_s"], exposed_comm_s=d["exposed_comm_s"],
            op_times_s=d["op_times_s"], execution=self.execution, host_s=d["host_s"],
            host_bound=d["host_bound"])

    def ground_truth(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        """The noise-free measurement (does not count as a measurement)."""
        prep = self._prepare(partition)
        self._check(prep, config)
        time_s, energy, _ = self._emulate(prep, config)
        g = prep.group_gpus
        return Measurement(time_s=time_s, energy_j=energy * g,
                           static_power_w=self.gpu.static_power_w * g)

    def reset_noise(self, seed: int | None = None) -> None:
        """Forget earlier measurements (call count and repeat indices 0), optionally with a
        new seed: the next measurement of anything draws its first noise again."""
        self.calls = 0
        self._repeats.clear()
        if seed is not None:
            self.seed = int(seed)

    # ------------------------------------------------------------------ internals
    def _op(self, op: ComputeOp, partition: str | None = None) -> _Op:
        p = self._op_cache.get((partition, op))
        if p is None:
            p = _prep_op(self.emulated_gpu, op, partition)
            self._op_cache[(partition, op)] = p
        return p

    def _prepare(self, partition: Partition) -> _Prepared:
        prep = self._prepared.get(id(partition))
        if prep is not None and prep.partition is partition:
            return prep
        if not isinstance(partition, Partition):
            raise ArgumentTypeError(f"partition must be a kareus Partition, got "
                                    f"{type(partition).__name__}")
        ops = [self._op(o, partition.name) for o in partition.compute_ops]
        slot_index = {s.name: s.index for s in partition.slots}
        gg = self._group_gpus(partition)
        what = repr((partition.name, tuple(partition.compute_ops), partition.comm_op))
        prep = _Prepared(partition=partition, sim=_Sim(self.emulated_gpu, ops),
                         slot_index=slot_index, bus_bytes=partition.comm_op.bus_bytes,
                         group_gpus=gg, key=hashlib.blake2b(what.encode(),
                                                            digest_size=16).hexdigest())
        if len(self._prepared) > 4096:
            self._prepared.clear()
        self._prepared[id(partition)] = prep
        return prep

    def _group_gpus(self, partition: Partition) -> int:
        if callable(self.group_gpus):
            g = int(self.group_gpus(partition))
            if g < 1:
                raise ArgumentError(f"group_gpus({partition.name!r}) returned {g}; need >= 1")
            return g
        if isinstance(self.group_gpus, int):
            return self.group_gpus
        own = getattr(partition, "group_gpus", None)
        if isinstance(own, int) and own >= 1:
            return own
        return int(partition.comm_op.group_size)

    def _check_freq(self, f: int) -> None:
        self.gpu.check_clock(f)

    def _check_sms(self, s: int) -> None:
        self.gpu.check_comm_sms(s)

    def _check(self, prep: _Prepared, config: ScheduleConfig) -> None:
        if not isinstance(config, ScheduleConfig):
            raise ArgumentTypeError(f"config must be a ScheduleConfig, got {type(config).__name__}")
        self._check_freq(config.freq_mhz)
        self._check_sms(config.comm_sms)
        if config.launch_slot is not None and config.launch_slot not in prep.slot_index:
            names = ", ".join(prep.slot_index) or "none (sequential only)"
            raise UnknownSlotError(
                f"partition {prep.partition.name!r} has no launch slot {config.launch_slot!r}; "
                f"its slots: {names} (or launch_slot=None for sequential)")

    def _comms(self, prep: _Prepared, config: ScheduleConfig
               ) -> list[_Collective]:
        idx = None if config.launch_slot is None else prep.slot_index[config.launch_slot]
        return [_collective(self.emulated_gpu, prep.partition.comm_op, config.comm_sms, idx)]

    def _emulate(self, prep: _Prepared, config: ScheduleConfig) -> tuple[float, float, int]:
        time_s, energy, f_eff, _ = self._run_limited(prep.sim, config.freq_mhz,
                                                     self._comms(prep, config))
        return time_s, energy, f_eff

    def _run_limited(self, sim: _Sim, freq_mhz: int,
                     comms: list[_Collective]
                     ) -> tuple[float, float, int, bool]:
        """Run at ``freq_mhz``, or at the highest supported clock under the power limit."""
        t, e, _ = sim.run(freq_mhz, comms)
        limit = self.gpu.power_limit_w
        if not self.power_limit or t <= 0 or e <= limit * t:
            return t, e, freq_mhz, False
        clocks = self._clocks
        lo, hi = 0, clocks.index(freq_mhz) - 1  # search clocks[lo..hi] for the highest fit
        best: tuple[float, float, int] | None = None
        while lo <= hi:
            mid = (lo + hi) // 2
            tm, em, _ = sim.run(clocks[mid], comms)
            if em <= limit * tm:
                best = (tm, em, clocks[mid])
                lo = mid + 1
            else:
                hi = mid - 1
        if best is None:  # even the lowest clock is over the limit: run there
            tm, em, _ = sim.run(clocks[0], comms)
            best = (tm, em, clocks[0])
        return best[0], best[1], best[2], True

    def _noisy(self, time_s: float, energy_j: float, static_w: float, *, key: str
               ) -> Measurement:
        """The measurement with its noise, drawn from ``(seed, key, repeat index)`` by
        hashing: never from a stream shared by everything measured."""
        self.calls += 1
        repeat = self._repeats.get(key, 0)
        self._repeats[key] = repeat + 1
        if self.noise > 0 or self.time_noise > 0:
            h = hashlib.blake2b(f"{key}|{repeat}".encode(), digest_size=16).digest()
            words = [int.from_bytes(h[i:i + 4], "little") for i in range(0, 16, 4)]
            z = np.random.default_rng([self.seed % 2**64, *words]).standard_normal(2)
            time_s *= max(0.5, 1.0 + self.time_noise * float(z[0]))
            energy_j *= max(0.5, 1.0 + self.noise * float(z[1]))
        return Measurement(time_s=time_s, energy_j=energy_j, static_power_w=static_w)

    def __repr__(self) -> str:
        return (f"EmulatedProfiler({self.gpu.name}, noise={self.noise}, seed={self.seed}, "
                f"execution={self.execution}, calls={self.calls})")
