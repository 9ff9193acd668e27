"""Errors of the collective backends (all [`KareusError`][kareus.errors.KareusError])."""

from __future__ import annotations

from collections.abc import Mapping

from kareus.errors import HardwareError, InvalidSMCountError, KareusError

__all__ = [
    "CollectiveArgumentError",
    "CollectiveError",
    "CollectiveLaunchError",
    "CollectiveUnavailableError",
    "CommSMCountError",
    "NoCollectiveBackendError",
]


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
