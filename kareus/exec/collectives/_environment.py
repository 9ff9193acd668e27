"""What a process group offers, agreed by all its ranks, and which backend can run there.

``probe_collective_environment`` is a collective call: each rank reports its host,
GPU and tools, and every rank builds the same
[`CollectiveEnvironment`][kareus.exec.CollectiveEnvironment], so the pure choice
(``choose_collective_backend``) gives the same answer on every rank.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

from kareus.exec._ext_build import find_nvcc
from kareus.exec.collectives._base import _require_dist
from kareus.exec.collectives._errors import CollectiveArgumentError, NoCollectiveBackendError
from kareus.exec.collectives._validation import SUPPORTED_WORLD_SIZES

__all__ = [
    "BACKEND_NAMES",
    "DEFAULT_BACKEND_PREFERENCE",
    "CollectiveEnvironment",
    "backend_unavailable_reason",
    "choose_collective_backend",
    "mscclpp_available",
    "probe_collective_environment",
]

BACKEND_NAMES: tuple[str, ...] = ("own", "nccl_capped", "mscclpp")
DEFAULT_BACKEND_PREFERENCE: tuple[str, ...] = ("own", "nccl_capped")


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


def probe_collective_environment(group: Any = None) -> CollectiveEnvironment:
    """Probes the process group (collective call: every rank of ``group`` must call it).

    Each rank reports its host, GPU and tools; the reports are exchanged so that all
    ranks build the same [`CollectiveEnvironment`][kareus.exec.CollectiveEnvironment] and hence
    choose the same backend.

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
