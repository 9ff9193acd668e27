"""Communication collectives that use exactly the number of SMs a schedule asks for.

A kareus schedule gives each communication kernel a number of SMs (``comm_sms``):
few SMs leave more of the GPU to the overlapped computation but may expose
communication; many SMs finish communication sooner but slow the computation. For
that trade-off to be real, the collective must occupy exactly ``sms`` SMs. Every
backend here is called as ``op(tensor(s), stream, sms)`` and enqueues the collective
on ``stream`` using ``sms`` SMs:

* [`OwnKernelCollective`][kareus.exec.OwnKernelCollective] runs kareus's own CUDA kernels
  (``ext/collectives``): one thread block per SM, grid size = ``sms``, data pushed over
  NVLink into peer buffers mapped through CUDA IPC, per-block flags instead of grid-wide barriers,
  fp32 accumulation in rank order (bitwise-identical results on every rank). It
  serves 2, 4 or 8 GPUs of one node with peer access, in bf16, fp16 and fp32, on
  any tensors, and without staging copies on tensors allocated with
  [`OwnKernelCollective.empty`][kareus.exec.OwnKernelCollective.empty].
* [`NCCLCappedCollective`][kareus.exec.NCCLCappedCollective] runs NCCL with one communicator per
  cap, created lazily through ``ProcessGroupNCCL.Options().config.min_ctas = max_ctas = sms``.
  It runs anywhere NCCL runs; one CTA of NCCL moves about as much as one SM of the
  plain-tensor own kernels (measured on 4x H200, NVLink: docs/collectives.md).
* [`MscclppCollective`][kareus.exec.MscclppCollective] adapts kernels of MSCCL++ when ``import
  mscclpp`` works; it is never required.
* [`ProcessGroupCollective`][kareus.exec.ProcessGroupCollective] runs plain ``torch.distributed``
  collectives with NCCL's own CTA count (``sms`` ignored): the systems that do not cap SMs use it.
* [`LoopbackCollective`][kareus.exec.LoopbackCollective] is a one-GPU stand-in (a world of one
  rank), so that the tuning path and the executor run end to end on one GPU; it measures no
  communication.

All-to-all (a mixture of experts' expert-parallel dispatch and combine:
``all_to_all(output, input, output_splits, input_splits, stream, sms)``, variable splits in
rows as ``torch.distributed.all_to_all_single`` takes them) runs on NCCL capped (its CTA cap
applies to NCCL's all-to-all kernel too) and on the process-group backend (gloo on the
CPU as well); the loopback stand-in moves the received rows' bytes on one GPU; kareus's own
kernels have none yet (``all_to_all`` raises
[`CollectiveUnavailableError`][kareus.exec.CollectiveUnavailableError]).

Communication buffers: a backend may offer ``empty(shape, dtype)`` (registered memory
that every rank has mapped, for the own kernels; the other backends run on it too);
[TorchExecutor.empty][kareus.exec.TorchExecutor.empty] asks its backends
for it, and runnable partitions built with ``build(collective=executor)`` take their
buffers from there.

[`select_collective_backend`][kareus.exec.select_collective_backend] probes the process group and
picks the first backend in a preference order that can run there, or raises
[`NoCollectiveBackendError`][kareus.exec.NoCollectiveBackendError] naming, for each backend, why it
cannot.

Rules every caller must keep (as with NCCL): every rank of the group issues the same
collectives, in the same order, with the same ``sms`` and sizes. The own kernels
reuse one staging buffer, so calls on one backend are ordered; the backend makes a
new stream wait for the previous one when the caller switches streams.

Only pure-Python validation and selection logic runs at import; torch is imported
inside the functions that need it, and nothing is compiled until the first
[`OwnKernelCollective`][kareus.exec.OwnKernelCollective] is built.

Modules (import the names from this package, not from them): ``_base`` (the
[`CollectiveBackend`][kareus.exec.CollectiveBackend] role), ``_errors``, ``_validation`` (SM counts,
dtypes, algorithm choice, message pieces), ``_environment`` (probing a process group and the
pure backend choice), ``_own``, ``_nccl``, ``_mscclpp``, ``_process_group``,
``_loopback`` (the backends) and ``_selection``
([`select_collective_backend`][kareus.exec.select_collective_backend]).
"""

from __future__ import annotations

from kareus.exec._ext_build import ExtensionBuildError
from kareus.exec.collectives._base import CollectiveBackend
from kareus.exec.collectives._environment import (
    BACKEND_NAMES,
    DEFAULT_BACKEND_PREFERENCE,
    CollectiveEnvironment,
    backend_unavailable_reason,
    choose_collective_backend,
    mscclpp_available,
    probe_collective_environment,
)
from kareus.exec.collectives._errors import (
    CollectiveArgumentError,
    CollectiveError,
    CollectiveLaunchError,
    CollectiveUnavailableError,
    CommSMCountError,
    NoCollectiveBackendError,
)
from kareus.exec.collectives._loopback import LoopbackCollective, cycle_rows
from kareus.exec.collectives._mscclpp import MscclppCollective, MscclppRunner
from kareus.exec.collectives._nccl import NCCL_MAX_CTAS, NCCLCappedCollective
from kareus.exec.collectives._own import (
    DEFAULT_STAGING_BYTES,
    OWN_MAX_BLOCKS,
    OwnKernelCollective,
)
from kareus.exec.collectives._process_group import ProcessGroupCollective
from kareus.exec.collectives._selection import select_collective_backend
from kareus.exec.collectives._validation import (
    ALL_REDUCE_ALGORITHMS,
    COLLECTIVE_OPS,
    ONE_SHOT_MAX_BYTES,
    REGISTERED_ALL_REDUCE_ALGORITHMS,
    SUPPORTED_DTYPES,
    SUPPORTED_WORLD_SIZES,
    bus_bandwidth_factor,
    choose_all_reduce_algorithm,
    choose_registered_all_reduce_algorithm,
    plan_pieces,
    staging_bytes_needed,
    validate_comm_sms,
    validate_dtype,
    validate_splits,
    validate_world_size,
)

__all__ = [
    "ALL_REDUCE_ALGORITHMS",
    "BACKEND_NAMES",
    "COLLECTIVE_OPS",
    "DEFAULT_BACKEND_PREFERENCE",
    "DEFAULT_STAGING_BYTES",
    "NCCL_MAX_CTAS",
    "ONE_SHOT_MAX_BYTES",
    "OWN_MAX_BLOCKS",
    "REGISTERED_ALL_REDUCE_ALGORITHMS",
    "SUPPORTED_DTYPES",
    "SUPPORTED_WORLD_SIZES",
    "CollectiveArgumentError",
    "CollectiveBackend",
    "CollectiveEnvironment",
    "CollectiveError",
    "CollectiveLaunchError",
    "CollectiveUnavailableError",
    "CommSMCountError",
    "ExtensionBuildError",
    "LoopbackCollective",
    "MscclppCollective",
    "MscclppRunner",
    "NCCLCappedCollective",
    "NoCollectiveBackendError",
    "OwnKernelCollective",
    "ProcessGroupCollective",
    "backend_unavailable_reason",
    "bus_bandwidth_factor",
    "choose_all_reduce_algorithm",
    "choose_collective_backend",
    "choose_registered_all_reduce_algorithm",
    "cycle_rows",
    "mscclpp_available",
    "plan_pieces",
    "probe_collective_environment",
    "select_collective_backend",
    "staging_bytes_needed",
    "validate_comm_sms",
    "validate_dtype",
    "validate_splits",
    "validate_world_size",
]
