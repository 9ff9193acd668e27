"""The kernel sets by name: ``get_kernels`` (what the runnable partitions ask for),
``register_kernels`` and ``available_kernels``; the built-in sets are ``reference``,
``torch`` and ``triton``.

The registry sits above every set it names (``base``, ``triton_ops``): importing it imports
no torch and no triton (each set imports those when built).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from kareus.errors import ArgumentError, ArgumentTypeError
from kareus.exec.kernels.base import KernelSet, ReferenceKernels, TorchKernels
from kareus.exec.kernels.triton_ops import TritonKernels

__all__ = ["available_kernels", "get_kernels", "register_kernels"]

# ---------------------------------------------------------------------------- registry

_REGISTRY: dict[str, Callable[[], KernelSet]] = {}


def register_kernels(name: str, factory: Callable[[], KernelSet]) -> None:
    """Make a kernel set selectable by ``name`` (in ``get_kernels`` and
    ``KAREUS_KERNELS``). ``factory`` is called with no arguments."""
    if not name or not isinstance(name, str):
        raise ArgumentError("a kernel set needs a non-empty name")
    if not callable(factory):
        raise ArgumentTypeError("factory must be callable")
    _REGISTRY[name] = factory


def _triton_factory() -> KernelSet:
    return TritonKernels()


register_kernels("reference", ReferenceKernels)
register_kernels("torch", TorchKernels)
register_kernels("triton", _triton_factory)


def available_kernels() -> list[str]:
    """Names ``get_kernels`` accepts."""
    return sorted(_REGISTRY)


def _triton_usable() -> bool:
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def get_kernels(kernels: KernelSet | str | None = None) -> KernelSet:
    """The kernel set to run ops with.

    Args:
        kernels: A ``KernelSet`` (returned as is), a registered name
            (``available_kernels``), or ``None``/``"auto"``: ``$KAREUS_KERNELS`` if
            set, else ``"triton"`` where CUDA and Triton are available, else ``"torch"``.

    Raises:
        ValueError: For an unknown name.
        TypeError: For anything else.
    """
    if isinstance(kernels, KernelSet):
        return kernels
    if kernels is None or kernels == "auto":
        kernels = os.environ.get("KAREUS_KERNELS") or None
        if kernels is None or kernels == "auto":
            kernels = "triton" if _triton_usable() else "torch"
    if not isinstance(kernels, str):
        raise ArgumentTypeError(f"kernels must be a KernelSet, a name or None, got "
                                f"{type(kernels).__name__}")
    if kernels not in _REGISTRY:
        raise ArgumentError(f"unknown kernel set {kernels!r}; choose one of "
                            f"{available_kernels()} or pass a KernelSet")
    ks = _REGISTRY[kernels]()
    if not isinstance(ks, KernelSet):
        raise ArgumentTypeError(f"kernel set factory {kernels!r} returned {type(ks).__name__}, "
                                f"not a KernelSet")
    return ks
