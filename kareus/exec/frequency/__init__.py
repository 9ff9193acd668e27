"""GPU frequency control, applied at microbatch boundaries in stream order.

A plan gives every microbatch computation one SM clock. The clock must change when
the *GPU* reaches the boundary between two microbatch computations, not when the
host thread happens to enqueue it (the host runs far ahead of the device), so a
request travels in stream order:

* [`StreamOrderedTrigger`][kareus.exec.StreamOrderedTrigger] (a
  [`FrequencyTrigger`][kareus.exec.FrequencyTrigger], the role the executor asks) puts a marker on
  the stream at the boundary. With the small CUDA extension in ``ext/hostfn`` the marker is a host
  function (``cudaLaunchHostFunc``) that only writes the request's token into a pipe; without
  it, the marker is a CUDA event that a polling thread watches. Either way, the
  trigger's own thread receives the request when the GPU gets there and calls the
  controller; no NVML or CUDA call runs inside the CUDA callback.
* A [`FrequencyController`][kareus.exec.FrequencyController] changes the clock.
  [`NVMLFrequencyController`][kareus.exec.NVMLFrequencyController] locks the SM clock with
  ``nvmlDeviceSetGpuLockedClocks`` and always restores it: on exit from its context, on exceptions,
  at interpreter exit and on SIGTERM. A permission problem raises
  [`FrequencyPermissionError`][kareus.exec.FrequencyPermissionError].
  [`DryRunFrequencyController`][kareus.exec.DryRunFrequencyController] only records each request
  with its time; it is the only controller that may run on shared machines whose clocks must not
  change. Controllers that really lock clocks (NVML's, and Zeus's in ``kareus.integrations.zeus``)
  share ``LockingFrequencyController``, which keeps the locked GPUs and restores them.

Modules (import the names from this package, not from them): ``_controllers`` (the
controllers), ``_markers`` (stream markers) and ``_trigger`` (the trigger role and
[`StreamOrderedTrigger`][kareus.exec.StreamOrderedTrigger]).
"""

from __future__ import annotations

from kareus.exec.frequency._controllers import (
    DryRunFrequencyController,
    FrequencyController,
    FrequencyPermissionError,
    FrequencyRequest,
    LockingFrequencyController,
    NVMLFrequencyController,
)
from kareus.exec.frequency._markers import (
    EventPollingMarker,
    HostFunctionMarker,
    StreamMarker,
    load_hostfn_library,
)
from kareus.exec.frequency._trigger import FrequencyTrigger, StreamOrderedTrigger

__all__ = [
    "DryRunFrequencyController",
    "EventPollingMarker",
    "FrequencyController",
    "FrequencyPermissionError",
    "FrequencyRequest",
    "FrequencyTrigger",
    "HostFunctionMarker",
    "LockingFrequencyController",
    "NVMLFrequencyController",
    "StreamMarker",
    "StreamOrderedTrigger",
    "load_hostfn_library",
]
