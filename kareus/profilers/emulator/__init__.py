"""The emulated GPU: a physical time and power model, and the embedded default profiler.

Every user without the exact GPU, every CI run, the demo and every 70B-scale study
runs on this model, so it is built as a performance model, not a lookup table:

* **Computation kernels** (roofline at the running clock). An op with ``F`` FLOPs and
  ``B`` HBM bytes on ``s`` SMs at clock ``f`` needs ``F / (eff * flops_per_clock_per_sm
  * s * f)`` of compute time (tensor cores for GEMM and attention at an efficiency below
  peak, CUDA cores for the rest) and ``B / bw`` of memory time, where ``bw`` is the
  smaller (smoothly) of the op's share of the achievable HBM bandwidth and what ``s`` SMs
  can issue at ``f`` (a per-SM issue limit puts a *knee* in frequency: above it
  memory-bound ops are nearly flat in frequency). Tensor-core kernels also have a
  clock-independent feed time (the L2 and crossbar feed the tensor cores at a rate that
  does not follow the SM clock; measured on H200, GEMMs reach 0.82 of the clock's peak at
  1500 MHz and 0.74 at 1980 MHz). The terms combine as a p-norm close to the roofline's
  max, plus a fixed GPU-side gap per kernel (2 us, measured on H200). Fused memory-bound
  kernels are one op with the fused work: the per-head query/key RMSNorm with RoPE of a
  qk-norm model (``qk_norm_rope``, ``qk_norm_rope_bwd``; ``kareus.model.partition``) is one
  memory-bound op of kind ``rope`` whose bytes are its minimum HBM traffic (q and k read
  and written, the norm weights and cos/sin tables read; backward dQ, dK, dV and the
  pre-norm q and k read, dQKV and the weights' gradients written) and whose FLOPs run on
  CUDA cores, so it costs about that traffic over the op's bandwidth share (the compute
  term is far below it), one launch gap, and in eager execution one RoPE launch's host
  time; a measured profile's record of it (``kareus calibrate`` on a qk-norm workload)
  scales it as any op's, and without one the op kind's default does.
* **Communication kernels** move ``CommOp.bus_bytes`` at a rate that grows with their SM
  count and saturates at the effective link bandwidth: ``1/R = ((s r(f))^-p + L^-p)^(1/p)``
  with a per-SM throughput ``r(f) = r0 (f/f_max)^alpha`` (mildly frequency dependent),
  after a fixed start-up latency. They also read and write HBM (a few bytes per bus byte).
* **Overlap** is an event-driven simulation of the computation stream and the
  communication stream. While the collective runs, its SMs are taken from the
  computation; HBM bandwidth is shared in proportion to the kernels' demands when they
  ask for more than the memory delivers. Beside a tensor-core kernel the collective's
  per-SM rate drops, and the tensor-core kernel runs slower than its SM share alone
  explains (both measured on H200). Rates are recomputed at every event (a kernel
  or a kernel's phase starts or ends), so a partition needs a few dozen events at most.
  The collective starts together with the op of its launch slot (or after all
  computation, when sequential) when its stream has high priority (the default,
  ``EmulatedGPU.comm_priority``; what kareus's executor does). At normal priority the
  block scheduler dispatches the slot op's blocks first and the collective starts at the
  op's last wave, which the emulator takes as the op's end (ops carry no shape from which
  to count waves): launched with the last op, it is sequential.
* **The host** (``_host``): graph-captured execution (the default, what the executor runs
  on a GPU) issues a partition's kernels with one graph launch and they run back to back;
  eager execution issues every op and the collective in program order at its own host
  cost (measured per op by ``kareus calibrate``, else defaults by kind from measurements
  on one H200, ``data/host_launch_h200.json``), and an op starts when both its stream and
  the host are there. A partition's time is that of back-to-back runs in the steady
  state: the GPU's own when it is the slower, the host's when that is.
* **Power** = idle power + dynamic. Dynamic SM power is activity x f x V(f)^2 with V(f)
  flat below a floor clock and linear above it (a tensor-core term for GEMM/attention, a
  busy-SM term for every kernel, an uncore term while anything runs), plus HBM energy
  per byte and link energy per byte. When the average power of the (repeated) work
  exceeds the board power limit, the emulated GPU lowers its own clock to the highest
  supported clock under the limit, as real GPUs do (measured on 2x H200 at the 700 W limit
  with unlocked clocks: the mean SM clock of a partition's run ranged from 1386 to 1980 MHz,
  ``data/h200_llama3b_tp2_grid13.json``). The requested clock is an upper bound.
* **Noise**: seeded multiplicative measurement noise on time and energy, deterministic
  per (seed, call count); ``noise=0`` gives the noise-free ground truth.

Scope: a partition's [`Measurement`][kareus.model.Measurement] covers every GPU of
the partition's group. All ranks of a collective are symmetric, so the emulator
simulates one rank and multiplies its energy (and the static power) by the group's GPU
count: the profiler's ``group_gpus`` argument if given, else ``partition.group_gpus``
(the TP x CP GPUs of a stage for partitions built by ``build_partitions``; the
collective's group by default), else ``partition.comm_op.group_size``.

The constants of the presets, where each comes from, and the calibration against the
measured H200 probe are in ``docs/emulator.md``.

Calibration: [`EmulatedGPU.from_profile`][kareus.profilers.EmulatedGPU.from_profile] takes per-op time
and power factors, HBM bandwidth, idle, static and uncore power and the collective curves from a
measured ``GPUProfile`` (``_calibration``; docs/emulator.md).

Modules (import the names from this package, not from them): ``_gpu`` (the GPU and
power model, [`EmulatedGPU`][kareus.profilers.EmulatedGPU]), ``_comm`` (the collective curves),
``_calibration`` (factors from a measured profile), ``_host`` (host costs, eager or graphed),
``_sim`` (the event-driven simulation) and ``_profiler``
([`EmulatedProfiler`][kareus.profilers.EmulatedProfiler]).
"""

from __future__ import annotations

from kareus.profilers.emulator._calibration import (
    OpCalibration,
    profile_workload,
    profile_workload_key,
)
from kareus.profilers.emulator._comm import CommCurve
from kareus.profilers.emulator._gpu import COMM_PRIORITIES, EmulatedGPU, measured_priority
from kareus.profilers.emulator._host import DEFAULT_HOST_COSTS, EXECUTIONS, HostCost
from kareus.profilers.emulator._profiler import EmulatedProfiler
from kareus.profilers.emulator._sim import EmulationTrace

__all__ = ["COMM_PRIORITIES", "DEFAULT_HOST_COSTS", "EXECUTIONS", "CommCurve", "EmulatedGPU",
           "EmulatedProfiler", "EmulationTrace", "HostCost", "OpCalibration",
           "measured_priority", "profile_workload", "profile_workload_key"]
