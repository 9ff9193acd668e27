"""The GPU's own time for some work: steps queued behind a sleeping kernel.

Device events around work launched from the host measure the work *and* any gap where the
GPU waited for the host's next launch. To time what the work costs the GPU alone, hold the
device with a sleeping kernel (``torch.cuda._sleep``) sized to outlast the host's
enqueueing, enqueue the steps behind it, and time them with events: no step then waits on
the host. The ratio of that time to the measured time of the same steps run normally is
the **GPU-busy fraction** of a window (below about 90%, the host set the pace).

The NVML profiler times each partition's steps this way
([`TorchPartitionRunner.queued_step_s`][kareus.profilers.TorchPartitionRunner.queued_step_s]),
and ``kareus verify`` times training iterations this way
([`verify`][kareus.workflow.verification.verify]). torch is imported when called.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs

__all__ = ["QueuedTime", "queued_time_s", "sleep_cycles_per_s"]


def sleep_cycles_per_s() -> float:
    """Clock cycles per second of ``torch.cuda._sleep`` now (it spins on the SM clock,
    which a power cap or a locked clock changes)."""
    import torch

    cycles = 2_000_000
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    b.synchronize()
    return cycles / max(a.elapsed_time(b) / 1e3, 1e-6)


@attrs.frozen
class QueuedTime:
    """The device time per step of steps queued behind a held device.

    Attributes:
        step_s: Device time per timed step.
        held_long_enough: Whether the hold outlasted the host's enqueueing (``False``: the
            device reached the timed steps before the host had queued them all, so the
            time may include host gaps; hold longer next time).
        enqueue_s: Host time spent enqueueing every step.
    """

    step_s: float
    held_long_enough: bool
    enqueue_s: float


def queued_time_s(step: Callable[[], object], *, steps: int, host_step_s: float,
                  hold_factor: float = 3.0) -> QueuedTime:
    """Run ``2 * steps`` steps queued behind a sleeping kernel; time the last ``steps``.

    The first ``steps`` run untimed and queued too: their collectives absorb the ranks'
    different start times, and the GPU leaves the sleeping kernel's low-power state before
    the timed steps (on 1x H200, GEMM-heavy steps timed right after the sleep ran up to 13%
    faster than back to back, at a higher clock). Every rank must call it with the same
    ``steps`` (the steps' collectives must match).

    Args:
        step: Enqueues one step on the current stream (never synchronises).
        steps: Steps to time.
        host_step_s: Host time to enqueue one step (what the hold must outlast).
        hold_factor: How much longer than the expected enqueueing the device is held.
    """
    import torch

    n = max(1, int(steps))
    torch.cuda.synchronize()
    hold_s = float(hold_factor) * 2 * n * max(float(host_step_s), 1e-5) + 1e-3
    cycles = int(min(hold_s * sleep_cycles_per_s(), 2**62))
    t0 = time.perf_counter()
    torch.cuda._sleep(cycles)
    for _ in range(n):
        step()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        step()
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    reached = bool(start.query())  # the GPU got there before the host was done
    enqueue_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    return QueuedTime(step_s=float(start.elapsed_time(end)) / 1e3 / n,
                      held_long_enough=not reached, enqueue_s=enqueue_s)
