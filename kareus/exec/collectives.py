"""Communication collectives that use exactly the number of SMs a schedule asks for.

A kareus schedule gives each communication kernel a number of SMs (``comm_sms``):
few SMs leave more of the GPU to the overlapped computation but may expose
communication; many SMs finish communication sooner but slow the computation. For
that trade-off to be real, the collective must occupy exactly ``sms`` SMs. Every
backend here is called as ``op(tensor(s), stream, sms)`` and enqueues the collective
on ``stream`` using ``sms`` SMs:

* :class:`OwnKernelCollective` runs kareus's own CUDA kernels (``ext/collectives``):
  one thread block per SM, grid size = ``sms``, data pushed over NVLink into peer
  buffers mapped through CUDA IPC, per-block flags instead of grid-wide barriers,
  fp32 accumulation in rank order (bitwise-identical results on every rank). It
  serves 2, 4 or 8 GPUs of one node with peer access, in bf16, fp16 and fp32, on
  any tensors, and without staging copies on tensors allocated with
  :meth:`OwnKernelCollective.empty`.
* :class:`NCCLCappedCollective` runs NCCL with one communicator per cap, created
  lazily through ``ProcessGroupNCCL.Options().config.min_ctas = max_ctas = sms``.
  It runs anywhere NCCL runs; one CTA of NCCL moves about as much as one SM of the
  plain-tensor own kernels (measured on 4x H200, NVLink: docs/collectives.md).
* :class:`MscclppCollective` adapts kernels of MSCCL++ when ``import mscclpp``
  works; it is never required.

:func:`select_collective_backend` probes the process group and picks the first
backend in a preference order that can run there, or raises
:class:`NoCollectiveBackendError` naming, for each backend, why it cannot.

Rules every caller must keep (as with NCCL): every rank of the group issues the same
collectives, in the same order, with the same ``sms`` and sizes. The own kernels
reuse one staging buffer, so calls on one backend are ordered; the backend makes a
new stream wait for the previous one when the caller switches streams.

Only pure-Python validation and selection logic runs at import; torch is imported
inside the functions that need it, and nothing is compiled until the first
:class:`OwnKernelCollective` is built.
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from kareus.errors import HardwareError, InvalidSMCountError, KareusError

from ._ext_build import ExtensionBuildError, find_nvcc, load_shared_library

__all__ = [
    "ALL_REDUCE_ALGORITHMS",
    "REGISTERED_ALL_REDUCE_ALGORITHMS",
    "BACKEND_NAMES",
    "COLLECTIVE_OPS",
    "DEFAULT_BACKEND_PREFERENCE",
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
    "MscclppCollective",
    "NCCLCappedCollective",
    "NoCollectiveBackendError",
    "OwnKernelCollective",
    "backend_unavailable_reason",
    "bus_bandwidth_factor",
    "choose_all_reduce_algorithm",
    "choose_collective_backend",
    "choose_registered_all_reduce_algorithm",
    "mscclpp_available",
    "plan_pieces",
    "probe_collective_environment",
    "select_collective_backend",
    "staging_bytes_needed",
    "validate_comm_sms",
    "validate_dtype",
    "validate_world_size",
]

COLLECTIVE_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter")
SUPPORTED_WORLD_SIZES: tuple[int, ...] = (2, 4, 8)
SUPPORTED_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")
ALL_REDUCE_ALGORITHMS: tuple[str, ...] = ("auto", "one_shot", "two_shot")
REGISTERED_ALL_REDUCE_ALGORITHMS: tuple[str, ...] = ("auto", "one_phase", "two_phase")
BACKEND_NAMES: tuple[str, ...] = ("own", "nccl_capped", "mscclpp")
DEFAULT_BACKEND_PREFERENCE: tuple[str, ...] = ("own", "nccl_capped")

_MIB = 1 << 20
#: Staging (receive) buffer of each rank for the own kernels, unless told otherwise.
DEFAULT_STAGING_BYTES = 256 * _MIB
#: ``algorithm="auto"`` uses one-shot all-reduce up to this size (and always on 2 GPUs).
ONE_SHOT_MAX_BYTES = 256 * 1024
#: Grid-size limit compiled into the own kernels (KC_MAX_BLOCKS).
OWN_MAX_BLOCKS = 256
#: NCCL's upper limit for ``max_ctas`` (MAXCHANNELS in current NCCL releases).
NCCL_MAX_CTAS = 64
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_DTYPE_CODE = {"bfloat16": 0, "float16": 1, "float32": 2}
_OP_CODE = {"all_reduce": 0, "all_gather": 1, "reduce_scatter": 2}
# torch.distributed function that runs each op on flat tensors (NCCL backend).
_DIST_TENSOR_COLLECTIVE = {"all_gather": "all_gather_into_tensor",
                           "reduce_scatter": "reduce_scatter_tensor"}
# Pieces of a split message keep 16-byte alignment: piece sizes are multiples of this
# many bytes.
_PIECE_ALIGN_BYTES = 256


# ----------------------------------------------------------------------- errors


class CollectiveError(KareusError):
    """Base class of errors raised by the collective backends."""


class CommSMCountError(CollectiveError, InvalidSMCountError):
    """An SM count (grid size / CTA cap) that the GPU or the backend cannot use."""


class CollectiveArgumentError(CollectiveError, ValueError):
    """Tensors, dtype, world size or option values that a collective cannot take."""


class CollectiveUnavailableError(CollectiveError, HardwareError):
    """A backend that cannot run on this machine or process group (says why)."""


class NoCollectiveBackendError(CollectiveUnavailableError):
    """No backend in the preference order can run here.

    Attributes:
        reasons: Backend name -> why it cannot run.
    """

    def __init__(self, reasons: Mapping[str, str]) -> None:
        self.reasons = dict(reasons)
        detail = "; ".join(f"{name}: {why}" for name, why in self.reasons.items())
        super().__init__(
            f"no collective backend can run here ({detail}). Run on GPUs of one node with "
            "peer access (NVLink or PCIe P2P) for the own kernels, or on a PyTorch build with "
            "NCCL whose ProcessGroupNCCL.Options().config has max_ctas for NCCL caps"
        )


class CollectiveLaunchError(CollectiveError, HardwareError):
    """The CUDA side of a collective (allocation, IPC mapping, launch) failed."""


# ------------------------------------------------------------------- validation


def validate_comm_sms(sms: Any, sm_count: int, *, backend_limit: int | None = None,
                      backend: str = "") -> int:
    """Checks an SM count for one collective call and returns it as an int.

    A communication kernel must leave at least one SM to computation, so the valid
    range on a GPU with ``N`` SMs is ``1..N-1``; a backend may have a lower ceiling
    (the own kernels' grid limit, NCCL's ``MAXCHANNELS``).

    Args:
        sms: The requested number of SMs.
        sm_count: SMs of the GPU (132 on H100/H200).
        backend_limit: Largest count the backend supports, if lower.
        backend: Backend name, for the message.

    Raises:
        CommSMCountError: ``sms`` is not an int in the valid range.
    """
    if isinstance(sms, bool) or not isinstance(sms, int):
        raise CommSMCountError(f"comm_sms must be an int, got {type(sms).__name__} {sms!r}")
    if sm_count < 2:
        raise CommSMCountError(f"a GPU needs at least 2 SMs to share them, got sm_count={sm_count}")
    if not 1 <= sms <= sm_count - 1:
        raise CommSMCountError(
            f"comm_sms must be in 1..{sm_count - 1} for a GPU with {sm_count} SMs, got {sms}"
        )
    if backend_limit is not None and sms > backend_limit:
        raise CommSMCountError(
            f"comm_sms must be in 1..{backend_limit} for the {backend or 'chosen'} backend, "
            f"got {sms}; use a smaller SM count or another backend"
        )
    return sms


def validate_world_size(world_size: int) -> int:
    """Checks that the own kernels serve ``world_size`` GPUs (2, 4 or 8).

    Raises:
        CollectiveArgumentError: Any other group size.
    """
    if world_size not in SUPPORTED_WORLD_SIZES:
        raise CollectiveArgumentError(
            f"the own collective kernels serve 2, 4 or 8 GPUs of one node, got a group of "
            f"{world_size}; use NCCLCappedCollective for other group sizes"
        )
    return world_size


def validate_dtype(dtype: Any) -> str:
    """Returns the canonical dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``).

    Accepts the names, ``torch.dtype`` objects (by their string form) and the short
    names ``bf16``, ``fp16``, ``fp32``, ``half``, ``float``.

    Raises:
        CollectiveArgumentError: Another dtype.
    """
    name = str(dtype).removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32"}.get(name, name)
    if name not in SUPPORTED_DTYPES:
        raise CollectiveArgumentError(
            f"collectives support {', '.join(SUPPORTED_DTYPES)}, got {dtype}; cast the tensor first"
        )
    return name


def _validate_op(op: str) -> str:
    if op not in COLLECTIVE_OPS:
        raise CollectiveArgumentError(f"op must be one of {', '.join(COLLECTIVE_OPS)}, got {op!r}")
    return op


def choose_all_reduce_algorithm(nbytes: int, world_size: int, algorithm: str = "auto") -> str:
    """Picks one-shot or two-shot all-reduce.

    One-shot: every rank pushes its whole tensor to every peer and reduces all copies
    itself; one synchronisation, but ``(n-1) x`` the bytes on each link. Two-shot:
    reduce-scatter then all-gather; two synchronisations and ``2(n-1)/n x`` the bytes,
    the bandwidth-optimal choice for large messages on more than 2 GPUs. On 2 GPUs
    both move the same bytes, so one-shot wins.

    Args:
        nbytes: Message size in bytes.
        world_size: GPUs in the group.
        algorithm: ``"auto"``, ``"one_shot"`` or ``"two_shot"``.

    Raises:
        CollectiveArgumentError: Unknown ``algorithm``.
    """
    if algorithm not in ALL_REDUCE_ALGORITHMS:
        raise CollectiveArgumentError(
            f"algorithm must be one of {', '.join(ALL_REDUCE_ALGORITHMS)}, got {algorithm!r}"
        )
    if algorithm != "auto":
        return algorithm
    if world_size == 2 or nbytes <= ONE_SHOT_MAX_BYTES:
        return "one_shot"
    return "two_shot"


def choose_registered_all_reduce_algorithm(nbytes: int, world_size: int,
                                           algorithm: str = "auto") -> str:
    """Picks the all-reduce for tensors allocated with :meth:`OwnKernelCollective.empty`.

    Such tensors are mapped by every rank, so results go straight into the peers'
    tensors. ``"one_phase"``: rank r reads chunk r of every rank's tensor (loads over
    NVLink), reduces, and stores the result into every rank's tensor; each rank moves
    S in and S out. ``"two_phase"``: ranks first push chunks into the owners' staging
    buffers, then each owner reduces and stores into every rank's tensor; only stores
    cross NVLink, at 2(n-1)/n S each way plus local reads.

    Args:
        nbytes: Message size in bytes.
        world_size: GPUs in the group.
        algorithm: ``"auto"``, ``"one_phase"`` or ``"two_phase"``.

    Raises:
        CollectiveArgumentError: Unknown ``algorithm``.
    """
    if algorithm not in REGISTERED_ALL_REDUCE_ALGORITHMS:
        raise CollectiveArgumentError(
            f"registered_algorithm must be one of {', '.join(REGISTERED_ALL_REDUCE_ALGORITHMS)}, "
            f"got {algorithm!r}"
        )
    if algorithm != "auto":
        return algorithm
    # By the bytes each SM moves (S in and S out per rank), one-phase should be faster;
    # not measured yet.
    return "one_phase"


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def staging_bytes_needed(op: str, numel: int, elem_bytes: int, world_size: int,
                         algorithm: str = "two_shot") -> int:
    """Bytes of each rank's staging buffer that one own-kernel call of this size needs.

    ``numel`` is the all-reduce tensor size, the all-gather input (per-rank shard) size
    or the reduce-scatter output size; ``algorithm`` is an all-reduce algorithm of
    either family (``one_shot``/``two_shot`` for plain tensors, ``one_phase``/
    ``two_phase`` for registered ones). Mirrors the layout in ``ext/collectives``.
    """
    _validate_op(op)
    vec = 16 // elem_bytes
    if op == "all_reduce":
        if algorithm == "one_shot":
            return world_size * _round_up(numel, vec) * elem_bytes
        if algorithm == "one_phase":
            return 0
        chunk = max(_round_up(-(-numel // world_size), vec), vec)
        if algorithm == "two_phase":
            return world_size * chunk * elem_bytes
        return 2 * world_size * chunk * elem_bytes
    return world_size * _round_up(numel, vec) * elem_bytes


def plan_pieces(op: str, numel: int, elem_bytes: int, world_size: int, staging_bytes: int,
                algorithm: str = "two_shot") -> list[tuple[int, int]]:
    """Splits a message into pieces whose staging need fits ``staging_bytes``.

    Every rank computes the same pieces from the same arguments, so every rank launches
    the same kernels. Piece boundaries keep 16-byte alignment.

    Returns:
        ``(start, count)`` element ranges covering ``[0, numel)`` in order; empty when
        ``numel`` is 0.

    Raises:
        CollectiveArgumentError: ``staging_bytes`` cannot hold even a minimal piece.
    """
    if numel < 0:
        raise CollectiveArgumentError(f"numel must be >= 0, got {numel}")
    if numel == 0:
        return []
    if staging_bytes_needed(op, numel, elem_bytes, world_size, algorithm) <= staging_bytes:
        return [(0, numel)]
    align = _PIECE_ALIGN_BYTES // elem_bytes
    pieces = 1
    while True:
        pieces += 1
        piece = _round_up(-(-numel // pieces), align)
        if staging_bytes_needed(op, piece, elem_bytes, world_size, algorithm) <= staging_bytes:
            break
        if piece <= align:
            raise CollectiveArgumentError(
                f"staging_bytes={staging_bytes} is too small for any {op} piece on {world_size} "
                "GPUs; use at least 1 MiB"
            )
    return [(s, min(piece, numel - s)) for s in range(0, numel, piece)]


def bus_bandwidth_factor(op: str, world_size: int) -> float:
    """Bus bandwidth / algorithm bandwidth, as nccl-tests defines them.

    Algorithm bandwidth is message bytes / time, where the message is the all-reduce
    tensor, the all-gather output or the reduce-scatter input. Bus bandwidth scales it
    to the bytes each GPU must move over its links in the optimal algorithm, so it is
    comparable across ops and group sizes: ``2(n-1)/n`` for all-reduce, ``(n-1)/n``
    for all-gather and reduce-scatter.
    """
    _validate_op(op)
    n = world_size
    return 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


# ------------------------------------------------------------------ environment


@dataclasses.dataclass(frozen=True)
class CollectiveEnvironment:
    """What the backends need to know about a process group, agreed by all its ranks.

    Attributes:
        world_size: Ranks (GPUs) in the group.
        sm_count: SMs per GPU (smallest over the group).
        single_node: All ranks run on one host.
        peer_access: Every GPU of the group can map every other's memory (NVLink or
            PCIe peer-to-peer); ``None`` when it could not be checked (each rank sees
            only its own GPU), in which case the own kernels find out when they map
            the peers' buffers.
        compute_capability: ``(major, minor)`` of the GPUs (smallest over the group).
        nvcc_available: Every rank can compile the own kernels (or finds them built).
        nccl_cta_caps: PyTorch's NCCL process group takes ``config.max_ctas``.
        mscclpp_available: ``import mscclpp`` works on every rank.
    """

    world_size: int
    sm_count: int
    single_node: bool = True
    peer_access: bool | None = True
    compute_capability: tuple[int, int] = (9, 0)
    nvcc_available: bool = True
    nccl_cta_caps: bool = True
    mscclpp_available: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise CollectiveArgumentError(f"world_size must be >= 1, got {self.world_size}")
        if self.sm_count < 2:
            raise CollectiveArgumentError(f"sm_count must be >= 2, got {self.sm_count}")


def backend_unavailable_reason(name: str, env: CollectiveEnvironment) -> str | None:
    """Why backend ``name`` cannot run in ``env``, or ``None`` when it can.

    Raises:
        CollectiveArgumentError: Unknown backend name.
    """
    if name not in BACKEND_NAMES:
        raise CollectiveArgumentError(
            f"unknown collective backend {name!r}; known: {', '.join(BACKEND_NAMES)}"
        )
    if name == "own":
        if env.world_size not in SUPPORTED_WORLD_SIZES:
            return f"needs 2, 4 or 8 GPUs, the group has {env.world_size}"
        if not env.single_node:
            return "needs all GPUs on one node (CUDA IPC), the group spans several hosts"
        if env.peer_access is False:
            return "the GPUs lack peer access to each other (no NVLink / PCIe P2P between them)"
        if env.compute_capability < (7, 0):
            return (f"needs compute capability >= 7.0 (system-scope acquire/release), got "
                    f"{env.compute_capability[0]}.{env.compute_capability[1]}")
        if not env.nvcc_available:
            return "nvcc not found to build the kernels (install the CUDA toolkit or set KAREUS_NVCC)"
        return None
    if name == "nccl_capped":
        if not env.nccl_cta_caps:
            return "this PyTorch's ProcessGroupNCCL.Options().config has no max_ctas (needs NCCL >= 2.17)"
        return None
    if not env.mscclpp_available:
        return "`import mscclpp` fails (MSCCL++ is optional and not on PyPI)"
    return None


def choose_collective_backend(env: CollectiveEnvironment,
                              prefer: Sequence[str] = DEFAULT_BACKEND_PREFERENCE,
                              *, disabled: Mapping[str, str] | None = None) -> str:
    """Returns the first backend in ``prefer`` that can run in ``env``.

    Pure logic: the same ``env`` gives the same answer on every rank.

    Args:
        env: The agreed environment of the process group.
        prefer: Backend names in order of preference.
        disabled: Backend name -> reason, for backends the caller rules out.

    Raises:
        CollectiveArgumentError: ``prefer`` is empty or names an unknown backend.
        NoCollectiveBackendError: None of them can run; says why for each.
    """
    if isinstance(prefer, str):
        prefer = (prefer,)
    if not prefer:
        raise CollectiveArgumentError(f"prefer must name at least one of {', '.join(BACKEND_NAMES)}")
    reasons: dict[str, str] = {}
    for name in prefer:
        why = backend_unavailable_reason(name, env)
        if why is None and disabled and name in disabled:
            why = disabled[name]
        if why is None:
            return name
        reasons[name] = why
    raise NoCollectiveBackendError(reasons)


def mscclpp_available() -> bool:
    """Whether ``import mscclpp`` can work here (checked without importing it)."""
    try:
        return importlib.util.find_spec("mscclpp") is not None
    except (ImportError, ValueError):
        return False


def _require_dist(group: Any) -> tuple[Any, Any]:
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise CollectiveUnavailableError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group("
            "'nccl') (e.g. under torchrun) before building a collective backend"
        )
    if not torch.cuda.is_available():
        raise CollectiveUnavailableError("no CUDA GPU visible: collective backends need GPUs")
    return torch, dist


def probe_collective_environment(group: Any = None) -> CollectiveEnvironment:
    """Probes the process group (collective call: every rank of ``group`` must call it).

    Each rank reports its host, GPU and tools; the reports are exchanged so that all
    ranks build the same :class:`CollectiveEnvironment` and hence choose the same
    backend.

    Args:
        group: A ``torch.distributed`` process group (default: the world).

    Raises:
        CollectiveUnavailableError: torch.distributed not initialised or no GPU.
    """
    torch, dist = _require_dist(group)
    import socket

    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    nccl_caps = False
    try:
        nccl_caps = hasattr(dist.ProcessGroupNCCL.Options().config, "max_ctas")
    except (AttributeError, RuntimeError):
        nccl_caps = False
    ndev = torch.cuda.device_count()
    mine = {
        "host": socket.gethostname(),
        "device": dev,
        "ndev": ndev,
        "sm_count": props.multi_processor_count,
        "cc": (props.major, props.minor),
        "nvcc": find_nvcc() is not None,
        "nccl_caps": nccl_caps,
        "mscclpp": mscclpp_available(),
    }
    world = dist.get_world_size(group)
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, mine, group=group)
    single_node = len({r["host"] for r in reports}) == 1
    # Peer access: checkable when every rank sees all GPUs of the node.
    devices = [r["device"] for r in reports]
    peer: bool | None
    if single_node and all(r["ndev"] > max(devices) for r in reports) and len(set(devices)) == world:
        ok = all(torch.cuda.can_device_access_peer(dev, other) for other in devices if other != dev)
        flags: list[Any] = [None] * world
        dist.all_gather_object(flags, ok, group=group)
        peer = all(flags)
    else:
        peer = None
    return CollectiveEnvironment(
        world_size=world,
        sm_count=min(r["sm_count"] for r in reports),
        single_node=single_node,
        peer_access=peer,
        compute_capability=min(tuple(r["cc"]) for r in reports),
        nvcc_available=all(r["nvcc"] for r in reports),
        nccl_cta_caps=all(r["nccl_caps"] for r in reports),
        mscclpp_available=all(r["mscclpp"] for r in reports),
    )


# ------------------------------------------------------------------ backends


class CollectiveBackend(abc.ABC):
    """A way to run all-reduce, all-gather and reduce-scatter on an exact SM count.

    Every op is enqueued on ``stream`` (``None``: the current stream) and uses
    ``sms`` SMs (thread blocks / CTAs). Ops are collective: every rank of the group
    calls the same op with the same sizes and ``sms``, in the same order.

    Shapes: ``all_reduce(tensor)`` reduces in place and returns ``tensor``;
    ``all_gather(output, input)`` writes rank q's ``input`` to
    ``output.view(-1)[q*m:(q+1)*m]`` with ``m = input.numel()``;
    ``reduce_scatter(output, input)`` writes to rank r's ``output`` the sum over ranks
    of ``input.view(-1)[r*m:(r+1)*m]`` with ``m = output.numel()``. Tensors are
    contiguous CUDA tensors of one supported dtype on the current device.

    A backend may also offer ``empty(shape, dtype)`` for tensors its collectives run
    faster on (:meth:`OwnKernelCollective.empty`); runnable partitions
    (:mod:`kareus.exec.torch_partition`) allocate their communication buffers with it
    when it is there and with ``torch.zeros`` otherwise.
    """

    #: Short name used by :func:`select_collective_backend` (``prefer=``).
    name: ClassVar[str] = ""

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """Ranks in the group."""

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank in the group."""

    @property
    @abc.abstractmethod
    def sm_count(self) -> int:
        """SMs of this rank's GPU."""

    @property
    def max_sms(self) -> int:
        """Largest ``sms`` this backend accepts on this GPU."""
        return self.sm_count - 1

    @abc.abstractmethod
    def all_reduce(self, tensor: Any, stream: Any, sms: int) -> Any:
        """Sums ``tensor`` over the group in place; returns ``tensor``."""

    @abc.abstractmethod
    def all_gather(self, output: Any, input: Any, stream: Any, sms: int) -> Any:
        """Gathers every rank's ``input`` into ``output`` in rank order; returns ``output``."""

    @abc.abstractmethod
    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int) -> Any:
        """Sums ``input`` over the group and keeps this rank's block in ``output``."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases resources (collective where the backend holds shared buffers)."""

    def __enter__(self) -> CollectiveBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Helpers shared by the torch-based backends.
    def _check_sms(self, sms: int) -> int:
        return validate_comm_sms(sms, self.sm_count,
                                 backend_limit=min(self.max_sms, self.sm_count - 1), backend=self.name)


def _check_tensor(t: Any, what: str, device: int) -> str:
    """Validates one tensor; returns its dtype name."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise CollectiveArgumentError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda or t.device.index != device:
        raise CollectiveArgumentError(
            f"{what} must be on cuda:{device} (the current device), got {t.device}; "
            "call torch.cuda.set_device(local_rank) first"
        )
    if not t.is_contiguous():
        raise CollectiveArgumentError(f"{what} must be contiguous; call .contiguous() first")
    return validate_dtype(t.dtype)


def _check_pair(op: str, output: Any, input: Any, world: int, device: int) -> str:
    d_out = _check_tensor(output, "output", device)
    d_in = _check_tensor(input, "input", device)
    if d_out != d_in:
        raise CollectiveArgumentError(f"{op}: input is {d_in} but output is {d_out}; use one dtype")
    if op == "all_gather" and output.numel() != world * input.numel():
        raise CollectiveArgumentError(
            f"all_gather: output must hold world_size x input.numel() = {world} x {input.numel()} "
            f"elements, got {output.numel()}"
        )
    if op == "reduce_scatter" and input.numel() != world * output.numel():
        raise CollectiveArgumentError(
            f"reduce_scatter: input must hold world_size x output.numel() = {world} x "
            f"{output.numel()} elements, got {input.numel()}"
        )
    return d_in


def _resolve_stream(stream: Any) -> Any:
    import torch

    return torch.cuda.current_stream() if stream is None else stream


class _CudaBytes:
    """Exposes raw device bytes through ``__cuda_array_interface__`` (no ownership)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None, "stream": None,
        }


@dataclasses.dataclass
class _SharedAllocation:
    """One allocation of this rank plus its peers' counterparts mapped here."""

    own: ctypes.c_void_p
    opened: list[ctypes.c_void_p]
    bases: list[int]  # data region of every rank (own included), as mapped here
    nbytes: int


class OwnKernelCollective(CollectiveBackend):
    """kareus's own SM-capped kernels over CUDA IPC peer memory (2, 4 or 8 GPUs).

    Construction is collective: every rank allocates a staging buffer, the buffers'
    IPC handles are exchanged through ``torch.distributed``, and every rank maps its
    peers' buffers. The CUDA library is built on first use (see
    :mod:`kareus.exec._ext_build`).

    Two kinds of tensors can be passed:

    * Any CUDA tensor. Data is pushed into the peers' staging buffers and copied out
      there (messages larger than the staging buffer go in pieces, identically on
      every rank).
    * Tensors from :meth:`empty` ("registered": every rank has mapped them). Results
      are stored straight into the peers' tensors, which saves the staging copies and
      moves fewer bytes per SM: use these for the executor's communication buffers.
      A registered tensor must sit at the same offset of its allocation on every rank
      (it does when all ranks allocate and slice alike), and must not be in use on
      another stream while a collective on it runs. Runnable partitions built with
      ``build(collective=this_backend)`` get their buffers this way. Status: checked
      and measured on 2x H200 (``tests/exec/test_collectives_gpu.py``,
      docs/collectives.md); not yet run on 4 or 8 GPUs.

    Args:
        group: ``torch.distributed`` group of 2, 4 or 8 ranks on one node (default:
            the world).
        staging_bytes: Size of each rank's receive buffer (default 256 MiB). Two-shot
            all-reduce needs about 2x the message; one-shot, all-gather and
            reduce-scatter need world_size x the per-rank shard.
        algorithm: All-reduce algorithm for plain tensors: ``"auto"`` (one-shot for
            small messages or 2 GPUs, two-shot otherwise), ``"one_shot"``, ``"two_shot"``.
        registered_algorithm: All-reduce algorithm for registered tensors: ``"auto"``,
            ``"one_phase"`` or ``"two_phase"`` (see
            :func:`choose_registered_all_reduce_algorithm`).
        memory: ``"ipc"`` (own ``cudaMalloc`` buffers shared with ``cudaIpc*``) or
            ``"symm_mem"`` (PyTorch symmetric memory for the staging buffer,
            multicast unused).
        spin_timeout_s: If set, a kernel that waits longer than this for a peer traps
            (turning a hang into an error); ``None`` waits forever, as NCCL does.
        threads_per_block: Build option, 512 (default) or 1024 threads per SM.
        loads_in_flight: Build option, 16-byte loads each thread keeps in flight
            (default 16 at 512 threads, 8 at 1024).
        arch: CUDA architecture to build for (default: the current GPU's, e.g. sm_90).

    Raises:
        CollectiveArgumentError: Bad group size or options.
        CollectiveUnavailableError: torch.distributed not initialised, no GPU.
        ExtensionBuildError: The kernels could not be built.
        CollectiveLaunchError: Allocating or mapping the buffers failed (e.g. no peer
            access between the GPUs).
    """

    name: ClassVar[str] = "own"

    def __init__(self, *, group: Any = None, staging_bytes: int | None = None,
                 algorithm: str = "auto", registered_algorithm: str = "auto",
                 memory: str = "ipc", spin_timeout_s: float | None = None,
                 threads_per_block: int | None = None, loads_in_flight: int | None = None,
                 arch: str | None = None) -> None:
        torch, dist = _require_dist(group)
        if algorithm not in ALL_REDUCE_ALGORITHMS:
            raise CollectiveArgumentError(
                f"algorithm must be one of {', '.join(ALL_REDUCE_ALGORITHMS)}, got {algorithm!r}"
            )
        choose_registered_all_reduce_algorithm(0, 2, registered_algorithm)  # validates
        if memory not in ("ipc", "symm_mem"):
            raise CollectiveArgumentError(f"memory must be 'ipc' or 'symm_mem', got {memory!r}")
        staging_bytes = DEFAULT_STAGING_BYTES if staging_bytes is None else int(staging_bytes)
        if staging_bytes < _MIB:
            raise CollectiveArgumentError(f"staging_bytes must be >= 1 MiB, got {staging_bytes}")
        if spin_timeout_s is not None and spin_timeout_s <= 0:
            raise CollectiveArgumentError(f"spin_timeout_s must be > 0 or None, got {spin_timeout_s}")
        defines = _build_defines(threads_per_block, loads_in_flight)
        self._group = group
        self._world = validate_world_size(dist.get_world_size(group))
        self._rank = dist.get_rank(group)
        self._device = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(self._device)
        self._sm_count = props.multi_processor_count
        self._algorithm = algorithm
        self._registered_algorithm = registered_algorithm
        self._staging_bytes = staging_bytes
        self._memory = memory
        self._lib = load_shared_library("collectives", arch=arch or f"sm_{props.major}{props.minor}",
                                        defines=defines)
        self._declare(self._lib)
        self._max_blocks = int(self._lib.kc_max_blocks())
        self._offset = int(self._lib.kc_data_offset())
        self._comm = ctypes.c_void_p()
        self._staging: _SharedAllocation | None = None
        self._registered: list[_SharedAllocation] = []
        self._symm: tuple[Any, Any] | None = None
        self._last_stream: Any = None
        self._closed = False
        timeout_ns = 0 if spin_timeout_s is None else int(spin_timeout_s * 1e9)

        if memory == "ipc":
            self._staging = self._alloc_shared(staging_bytes)
            bases = [b - self._offset for b in self._staging.bases]
        else:
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(self._offset + staging_bytes, dtype=torch.uint8, device=self._device)
            buf.zero_()
            torch.cuda.synchronize()
            gname = (group if group is not None else dist.group.WORLD).group_name
            handle_obj = symm_mem.rendezvous(buf, gname)
            bases = [int(p) for p in handle_obj.buffer_ptrs]
            self._symm = (buf, handle_obj)
        arr = (ctypes.c_void_p * self._world)(*bases)
        self._call("kc_comm_create", self._rank, self._world, arr, ctypes.c_size_t(staging_bytes),
                   ctypes.c_ulonglong(timeout_ns), ctypes.byref(self._comm))
        # Every rank has zeroed its flags and mapped its peers before any kernel runs.
        torch.cuda.synchronize()
        dist.barrier(group=group)

    @staticmethod
    def _declare(lib: ctypes.CDLL) -> None:
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        lib.kc_last_error.restype = ctypes.c_char_p
        lib.kc_data_offset.restype = ctypes.c_longlong
        lib.kc_staging_alloc.argtypes = [sz, ctypes.POINTER(vp), vp]
        lib.kc_ipc_open.argtypes = [vp, ctypes.POINTER(vp)]
        lib.kc_ipc_close.argtypes = [vp]
        lib.kc_free.argtypes = [vp]
        lib.kc_comm_create.argtypes = [i, i, ctypes.POINTER(vp), sz, ctypes.c_ulonglong,
                                       ctypes.POINTER(vp)]
        lib.kc_comm_destroy.argtypes = [vp]
        lib.kc_run.argtypes = [vp, i, i, vp, vp, sz, sz, i, i, vp]
        lib.kc_run_registered.argtypes = [vp, i, i, vp, vp, ctypes.POINTER(vp), sz, sz, i, i, vp]

    def _call(self, fn: str, *args: Any) -> None:
        rc = getattr(self._lib, fn)(*args)
        if rc != 0:
            msg = (self._lib.kc_last_error() or b"").decode(errors="replace")
            hint = ""
            if fn == "kc_ipc_open":
                hint = ("; the GPUs may lack peer access, or the processes may not share the "
                        "node: try memory='symm_mem' or NCCLCappedCollective")
            raise CollectiveLaunchError(f"{fn} failed on rank {self._rank}: {msg}{hint}")

    def _alloc_shared(self, nbytes: int) -> _SharedAllocation:
        """Allocates ``nbytes`` (zeroed) on every rank and maps the peers' (collective)."""
        import torch
        import torch.distributed as dist

        hbytes = int(self._lib.kc_ipc_handle_bytes())
        handle = (ctypes.c_ubyte * hbytes)()
        own = ctypes.c_void_p()
        self._call("kc_staging_alloc", ctypes.c_size_t(nbytes), ctypes.byref(own), handle)
        mine = torch.tensor(list(bytes(handle)), dtype=torch.uint8, device=self._device)
        gathered = torch.empty(self._world * hbytes, dtype=torch.uint8, device=self._device)
        dist.all_gather_into_tensor(gathered, mine, group=self._group)
        all_handles = gathered.cpu().tolist()
        alloc = _SharedAllocation(own=own, opened=[], bases=[], nbytes=nbytes)
        for q in range(self._world):
            if q == self._rank:
                alloc.bases.append(int(own.value or 0) + self._offset)
                continue
            hq = (ctypes.c_ubyte * hbytes)(*all_handles[q * hbytes:(q + 1) * hbytes])
            ptr = ctypes.c_void_p()
            self._call("kc_ipc_open", hq, ctypes.byref(ptr))
            alloc.opened.append(ptr)
            alloc.bases.append(int(ptr.value or 0) + self._offset)
        return alloc

    def _free_shared(self, alloc: _SharedAllocation) -> None:
        for ptr in alloc.opened:
            self._call("kc_ipc_close", ptr)
        alloc.opened = []
        if alloc.own.value:
            self._call("kc_free", alloc.own)
            alloc.own = ctypes.c_void_p()

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def sm_count(self) -> int:
        return self._sm_count

    @property
    def max_sms(self) -> int:
        return min(self._sm_count - 1, self._max_blocks)

    @property
    def staging_bytes(self) -> int:
        """Capacity of each rank's staging buffer."""
        return self._staging_bytes

    def empty(self, shape: int | Sequence[int], dtype: Any) -> Any:
        """Allocates a registered tensor: one that every rank of the group has mapped.

        Collective: every rank must call it with the same shape and dtype, in the same
        order. Collectives on such tensors (all-reduce in place, all-gather output,
        reduce-scatter input) store into or load from the peers' tensors directly.
        The memory lives until :meth:`close`; contents start as zeros.

        Args:
            shape: Tensor shape (an int for 1-D).
            dtype: ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.

        Returns:
            A contiguous CUDA tensor on the current device.
        """
        import math

        import torch

        self._check_open()
        shape_t = (int(shape),) if isinstance(shape, int) else tuple(int(d) for d in shape)
        if any(d < 0 for d in shape_t):
            raise CollectiveArgumentError(f"shape must be non-negative, got {shape_t}")
        tdtype = getattr(torch, validate_dtype(dtype))
        esize = _DTYPE_BYTES[validate_dtype(dtype)]
        numel = math.prod(shape_t)
        nbytes = _round_up(max(numel * esize, 16), 256)
        alloc = self._alloc_shared(nbytes)
        self._registered.append(alloc)
        own = alloc.bases[self._rank]
        raw = torch.as_tensor(_CudaBytes(own, nbytes), device=f"cuda:{self._device}")
        return raw[: numel * esize].view(tdtype).view(shape_t)

    def is_registered(self, tensor: Any) -> bool:
        """Whether ``tensor`` lies in memory from :meth:`empty` (zero-copy paths)."""
        return self._registered_ptrs(tensor) is not None

    def _registered_ptrs(self, tensor: Any) -> list[int] | None:
        ptr = int(tensor.data_ptr())
        end = ptr + tensor.numel() * tensor.element_size()
        for alloc in self._registered:
            base = alloc.bases[self._rank]
            if base <= ptr and end <= base + alloc.nbytes:
                return [b + (ptr - base) for b in alloc.bases]
        return None

    def _enter_stream(self, stream: Any) -> Any:
        import torch

        stream = _resolve_stream(stream)
        last = self._last_stream
        if last is not None and last != stream:
            # Buffers are reused: order this call after the previous one.
            ev = torch.cuda.Event()
            ev.record(last)
            stream.wait_event(ev)
        self._last_stream = stream
        return stream

    def _launch(self, op: str, dtype: str, in_ptr: int, out_ptr: int, numel: int, stride: int,
                algo: str, sms: int, stream: Any) -> None:
        self._call("kc_run", self._comm, _OP_CODE[op], _DTYPE_CODE[dtype], ctypes.c_void_p(in_ptr),
                   ctypes.c_void_p(out_ptr), ctypes.c_size_t(numel), ctypes.c_size_t(stride),
                   0 if algo == "one_shot" else 1, sms, ctypes.c_void_p(stream.cuda_stream))

    def _launch_registered(self, op: str, dtype: str, in_ptr: int, out_ptr: int, regs: list[int],
                           numel: int, stride: int, algo: str, sms: int, stream: Any) -> None:
        arr = (ctypes.c_void_p * self._world)(*regs)
        self._call("kc_run_registered", self._comm, _OP_CODE[op], _DTYPE_CODE[dtype],
                   ctypes.c_void_p(in_ptr), ctypes.c_void_p(out_ptr), arr, ctypes.c_size_t(numel),
                   ctypes.c_size_t(stride), 1 if algo == "two_phase" else 0, sms,
                   ctypes.c_void_p(stream.cuda_stream))

    def _check_open(self) -> None:
        if self._closed:
            raise CollectiveArgumentError("this OwnKernelCollective was closed; build a new one")

    def all_reduce(self, tensor: Any, stream: Any, sms: int) -> Any:
        self._check_open()
        sms = self._check_sms(sms)
        dtype = _check_tensor(tensor, "tensor", self._device)
        stream = self._enter_stream(stream)
        numel = tensor.numel()
        if numel == 0:
            return tensor
        esize = _DTYPE_BYTES[dtype]
        regs = self._registered_ptrs(tensor)
        if regs is not None and all(r % 16 == 0 for r in regs):
            algo = choose_registered_all_reduce_algorithm(numel * esize, self._world,
                                                          self._registered_algorithm)
            for start, count in plan_pieces("all_reduce", numel, esize, self._world,
                                            self._staging_bytes, algo):
                self._launch_registered("all_reduce", dtype, 0, 0, [r + start * esize for r in regs],
                                        count, 0, algo, sms, stream)
            return tensor
        algo = choose_all_reduce_algorithm(numel * esize, self._world, self._algorithm)
        work = tensor
        if tensor.data_ptr() % 16:
            import torch

            with torch.cuda.stream(stream):
                work = tensor.clone()
        base = work.data_ptr()
        for start, count in plan_pieces("all_reduce", numel, esize, self._world,
                                        self._staging_bytes, algo):
            ptr = base + start * esize
            self._launch("all_reduce", dtype, ptr, ptr, count, 0, algo, sms, stream)
        if work is not tensor:
            import torch

            with torch.cuda.stream(stream):
                tensor.copy_(work)
        return tensor

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int) -> Any:
        return self._shard_collective("all_gather", output, input, stream, sms)

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int) -> Any:
        return self._shard_collective("reduce_scatter", output, input, stream, sms)

    def _shard_collective(self, op: str, output: Any, input: Any, stream: Any, sms: int) -> Any:
        """All-gather or reduce-scatter: one shard of ``m`` elements per rank.

        The full-size tensor (all-gather output, reduce-scatter input) is the one the
        peers touch, so its being registered selects the zero-copy kernels.
        """
        self._check_open()
        sms = self._check_sms(sms)
        dtype = _check_pair(op, output, input, self._world, self._device)
        stream = self._enter_stream(stream)
        full, shard = (output, input) if op == "all_gather" else (input, output)
        m = shard.numel()
        if m == 0:
            return output
        regs = self._registered_ptrs(full)
        if regs is not None:
            self._launch_registered(op, dtype, input.data_ptr(), output.data_ptr(), regs, m, m, "",
                                    sms, stream)
            return output
        esize = _DTYPE_BYTES[dtype]
        for start, count in plan_pieces(op, m, esize, self._world, self._staging_bytes):
            self._launch(op, dtype, input.data_ptr() + start * esize,
                         output.data_ptr() + start * esize, count, m, "", sms, stream)
        return output

    def close(self) -> None:
        """Frees the buffers, registered tensors included.

        Collective: every rank must call it (peers may still be writing).
        """
        if self._closed:
            return
        import torch
        import torch.distributed as dist

        self._closed = True
        torch.cuda.synchronize()
        dist.barrier(group=self._group)
        self._call("kc_comm_destroy", self._comm)
        for alloc in self._registered:
            self._free_shared(alloc)
        self._registered = []
        if self._staging is not None:
            self._free_shared(self._staging)
            self._staging = None
        self._symm = None


def _build_defines(threads_per_block: int | None, loads_in_flight: int | None) -> dict[str, int]:
    """Build-time kernel options as preprocessor macros (validated)."""
    defines: dict[str, int] = {}
    if threads_per_block is not None:
        if threads_per_block not in (256, 512, 1024):
            raise CollectiveArgumentError(
                f"threads_per_block must be 256, 512 or 1024, got {threads_per_block}"
            )
        defines["KC_THREADS"] = threads_per_block
    if loads_in_flight is not None:
        if not 1 <= loads_in_flight <= 64:
            raise CollectiveArgumentError(f"loads_in_flight must be in 1..64, got {loads_in_flight}")
        defines["KC_INFLIGHT"] = loads_in_flight
    return defines


class NCCLCappedCollective(CollectiveBackend):
    """NCCL with the number of CTAs (= SMs) fixed per call.

    NCCL fixes CTA counts per communicator, so this keeps one ``torch.distributed``
    NCCL group per cap, created on first use with
    ``ProcessGroupNCCL.Options().config.min_ctas = max_ctas = sms`` and cached. It
    never touches ``NCCL_MAX_CTAS`` in the environment (that would cap every
    communicator of the process). Group creation is collective over the group's
    ranks; since all ranks issue the same calls, they create the same groups in the
    same order.

    Args:
        group: Process group whose ranks take part (default: the world).
        max_sms: Largest cap accepted (default: NCCL's 64-channel limit).
    """

    name: ClassVar[str] = "nccl_capped"

    def __init__(self, *, group: Any = None, max_sms: int | None = None) -> None:
        torch, dist = _require_dist(group)
        try:
            has_caps = hasattr(dist.ProcessGroupNCCL.Options().config, "max_ctas")
        except AttributeError:
            has_caps = False
        if not has_caps:
            raise CollectiveUnavailableError(
                "this PyTorch's ProcessGroupNCCL.Options().config has no max_ctas; upgrade "
                "PyTorch (NCCL >= 2.17) or use OwnKernelCollective"
            )
        self._group = group
        self._world = dist.get_world_size(group)
        self._rank = dist.get_rank(group)
        self._ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self._world))
        self._device = torch.cuda.current_device()
        self._sm_count = torch.cuda.get_device_properties(self._device).multi_processor_count
        self._max_sms = NCCL_MAX_CTAS if max_sms is None else int(max_sms)
        if not 1 <= self._max_sms <= NCCL_MAX_CTAS:
            raise CollectiveArgumentError(f"max_sms must be in 1..{NCCL_MAX_CTAS}, got {max_sms}")
        self._groups: dict[int, Any] = {}

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def sm_count(self) -> int:
        return self._sm_count

    @property
    def max_sms(self) -> int:
        return min(self._max_sms, self._sm_count - 1)

    def group_for(self, sms: int) -> Any:
        """The NCCL group capped at ``sms`` CTAs (created on first use; collective)."""
        sms = self._check_sms(sms)
        if sms not in self._groups:
            import torch.distributed as dist

            opts = dist.ProcessGroupNCCL.Options()
            opts.config.max_ctas = sms
            opts.config.min_ctas = sms
            self._groups[sms] = dist.new_group(ranks=self._ranks, backend="nccl", pg_options=opts,
                                               use_local_synchronization=True)
        return self._groups[sms]

    def all_reduce(self, tensor: Any, stream: Any, sms: int) -> Any:
        import torch
        import torch.distributed as dist

        _check_tensor(tensor, "tensor", self._device)
        g = self.group_for(sms)
        with torch.cuda.stream(_resolve_stream(stream)):
            dist.all_reduce(tensor, group=g)
        return tensor

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int) -> Any:
        return self._shard_collective("all_gather", output, input, stream, sms)

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int) -> Any:
        return self._shard_collective("reduce_scatter", output, input, stream, sms)

    def _shard_collective(self, op: str, output: Any, input: Any, stream: Any, sms: int) -> Any:
        import torch
        import torch.distributed as dist

        _check_pair(op, output, input, self._world, self._device)
        g = self.group_for(sms)
        run = getattr(dist, _DIST_TENSOR_COLLECTIVE[op])
        with torch.cuda.stream(_resolve_stream(stream)):
            run(output.view(-1), input.view(-1), group=g)
        return output

    def close(self) -> None:
        """Destroys the capped groups (collective)."""
        import torch.distributed as dist

        for g in self._groups.values():
            dist.destroy_process_group(g)
        self._groups = {}


#: Signature of an MSCCL++ runner: ``runner(output, input, stream, sms)``.
MscclppRunner = Callable[[Any, Any, Any, int], None]


class MscclppCollective(CollectiveBackend):
    """Adapter for SM-capped kernels of MSCCL++, used only when ``import mscclpp`` works.

    MSCCL++ is not on PyPI and its Python API changes between releases, so kareus
    does not build MSCCL++ programs itself: pass one runner per op, each a callable
    ``runner(output, input, stream, sms)`` that launches your MSCCL++ kernel with
    ``sms`` thread blocks on ``stream`` (for all-reduce, ``output is input``). This
    class adds kareus's argument checks and the common interface, so a plan can use
    MSCCL++ kernels where you have them.

    Args:
        runners: Op name (``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``) ->
            runner. Ops without a runner raise :class:`CollectiveUnavailableError`.
        group: Process group (default: the world).

    Raises:
        CollectiveUnavailableError: ``import mscclpp`` fails.
        CollectiveArgumentError: Unknown op names in ``runners``.
    """

    name: ClassVar[str] = "mscclpp"

    def __init__(self, *, runners: Mapping[str, MscclppRunner], group: Any = None) -> None:
        if not mscclpp_available():
            raise CollectiveUnavailableError(
                "`import mscclpp` fails: MSCCL++ is optional and not on PyPI; build it from "
                "source, or use OwnKernelCollective / NCCLCappedCollective"
            )
        unknown = set(runners) - set(COLLECTIVE_OPS)
        if unknown:
            raise CollectiveArgumentError(
                f"runners has unknown ops {sorted(unknown)}; known: {', '.join(COLLECTIVE_OPS)}"
            )
        torch, dist = _require_dist(group)
        import mscclpp  # noqa: F401  (fails loudly here if the install is broken)

        self._runners = dict(runners)
        self._world = dist.get_world_size(group)
        self._rank = dist.get_rank(group)
        self._device = torch.cuda.current_device()
        self._sm_count = torch.cuda.get_device_properties(self._device).multi_processor_count

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def sm_count(self) -> int:
        return self._sm_count

    def _runner(self, op: str) -> MscclppRunner:
        if op not in self._runners:
            raise CollectiveUnavailableError(
                f"no MSCCL++ runner given for {op}; pass runners={{'{op}': ...}} or use another backend"
            )
        return self._runners[op]

    def all_reduce(self, tensor: Any, stream: Any, sms: int) -> Any:
        sms = self._check_sms(sms)
        _check_tensor(tensor, "tensor", self._device)
        self._runner("all_reduce")(tensor, tensor, _resolve_stream(stream), sms)
        return tensor

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int) -> Any:
        return self._shard_collective("all_gather", output, input, stream, sms)

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int) -> Any:
        return self._shard_collective("reduce_scatter", output, input, stream, sms)

    def _shard_collective(self, op: str, output: Any, input: Any, stream: Any, sms: int) -> Any:
        sms = self._check_sms(sms)
        _check_pair(op, output, input, self._world, self._device)
        self._runner(op)(output, input, _resolve_stream(stream), sms)
        return output


_BACKEND_CLASSES: dict[str, type[CollectiveBackend]] = {
    "own": OwnKernelCollective,
    "nccl_capped": NCCLCappedCollective,
    "mscclpp": MscclppCollective,
}


def select_collective_backend(*, group: Any = None,
                              prefer: Sequence[str] = DEFAULT_BACKEND_PREFERENCE,
                              env: CollectiveEnvironment | None = None,
                              options: Mapping[str, Mapping[str, Any]] | None = None
                              ) -> CollectiveBackend:
    """Builds the first backend in ``prefer`` that can run on ``group``.

    Collective: every rank of ``group`` must call it with the same arguments. The
    environment is probed once and agreed on by all ranks (see
    :func:`probe_collective_environment`), so every rank picks the same backend.

    Args:
        group: Process group (default: the world).
        prefer: Backend names in order of preference; default ``("own", "nccl_capped")``.
            ``"mscclpp"`` needs ``options={"mscclpp": {"runners": ...}}``.
        env: A pre-computed environment (skips the probe).
        options: Backend name -> keyword arguments for its constructor.

    Raises:
        NoCollectiveBackendError: No backend in ``prefer`` can run here; the message
            says why for each.
    """
    env = probe_collective_environment(group) if env is None else env
    options = dict(options or {})
    disabled = {}
    if "runners" not in options.get("mscclpp", {}):
        disabled["mscclpp"] = "no runners given (options={'mscclpp': {'runners': {...}}})"
    name = choose_collective_backend(env, prefer, disabled=disabled)
    kwargs = dict(options.get(name, {}))
    kwargs.setdefault("group", group)
    return _BACKEND_CLASSES[name](**kwargs)
