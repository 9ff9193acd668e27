"""Building the first collective backend, in a preference order, that can run on a group."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kareus._logging import get_logger
from kareus.exec.collectives._base import CollectiveBackend
from kareus.exec.collectives._environment import (
    DEFAULT_BACKEND_PREFERENCE,
    CollectiveEnvironment,
    choose_collective_backend,
    probe_collective_environment,
)
from kareus.exec.collectives._mscclpp import MscclppCollective
from kareus.exec.collectives._nccl import NCCLCappedCollective
from kareus.exec.collectives._own import OwnKernelCollective

__all__ = ["select_collective_backend"]

_log = get_logger(__name__)

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
    ``probe_collective_environment``), so every rank picks the same backend.

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
    _log.info("collective backend: %s (preference %s)", name, ", ".join(prefer))
    kwargs = dict(options.get(name, {}))
    kwargs.setdefault("group", group)
    return _BACKEND_CLASSES[name](**kwargs)
