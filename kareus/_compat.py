"""Old import paths of moved modules and names, kept for one release with a DeprecationWarning.

When a module moves to another package (the measuring side left ``kareus.exec`` for
``kareus.profilers``; the third-party adapters of ``kareus.interop`` joined
``kareus.integrations``; the decoder schedule left ``kareus.exec.train`` for
``kareus.exec.schedule``), code written against the old path keeps working for one release:
``import kareus.exec.emulator`` returns the module now at ``kareus.profilers.emulator`` (the
same module object, so ``isinstance`` checks and monkeypatching see one thing), and
``from kareus.exec import EmulatedProfiler`` returns the class from its new home, each with a
``DeprecationWarning`` that names the new path.

This is the one place that knows the moves: a module finder for module paths (installed by
``kareus/__init__.py``, which runs before any submodule) and ``moved_attribute`` for names
a package used to re-export (its ``__getattr__`` asks here). Neither imports anything until an
old path is used.
"""

from __future__ import annotations

import sys
from typing import Any

#: Old module path -> new module path (submodules follow: ``old.x`` -> ``new.x``).
MOVED_MODULES: dict[str, str] = {
    "kareus.exec.emulator": "kareus.profilers.emulator",
    "kareus.exec.nvml": "kareus.profilers.nvml",
    "kareus.exec.replay": "kareus.profilers.replay",
    "kareus.exec.calibrate": "kareus.profilers.calibrate",
    "kareus.exec.profile_build": "kareus.profilers.profile_build",
    # the first that matches wins: the two pool modules before the rest of kareus.interop
    "kareus.interop.tasks": "kareus.workflow.pools",
    "kareus.interop.ray": "kareus.workflow.ray",
    "kareus.interop": "kareus.integrations",
}

#: Package -> {name it used to re-export: module that has it now}.
MOVED_NAMES: dict[str, dict[str, str]] = {
    "kareus.exec": {
        **dict.fromkeys(("EmulatedGPU", "EmulatedProfiler", "EmulationTrace"),
                        "kareus.profilers"),
        **dict.fromkeys(("Coordinator", "EnergyMeter", "LocalCoordinator", "MeasurementRecord",
                         "NVMLProfiler", "PartitionRunner", "TorchDistributedCoordinator",
                         "TorchPartitionRunner"), "kareus.profilers"),
        "ReplayProfiler": "kareus.profilers",
        "Profiler": "kareus.profilers",
        "ProfilerWrapper": "kareus.profilers",
    },
    "kareus.exec.train": dict.fromkeys(
        ("SCHEDULES", "Comm", "DefaultConfig", "Op", "Piece", "TypeShape", "clip_slot",
         "match_type", "pieces", "run_computation", "stack_stream", "type_shapes"),
        "kareus.exec.schedule"),
}


def _warn(old: str, new: str) -> None:
    import warnings

    warnings.warn(f"{old} has moved to {new}: import it from there (the old path goes in the "
                  "next release)", DeprecationWarning, stacklevel=3)


def new_module_name(fullname: str) -> str | None:
    """The current path of a module imported by its old path, or ``None`` if it did not move
    (the first entry of ``MOVED_MODULES`` that matches)."""
    for old, new in MOVED_MODULES.items():
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old):]
    return None


class _AliasLoader:
    """Loads an old module path as the module at its new path (the same object)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: Any) -> Any:
        import importlib

        return importlib.import_module(self.new)

    def exec_module(self, module: Any) -> None:  # the new module has run already
        return None


class MovedModuleFinder:
    """A ``sys.meta_path`` finder that resolves the old paths of ``MOVED_MODULES``."""

    @staticmethod
    def find_spec(fullname: str, path: Any = None, target: Any = None) -> Any:
        """The spec of an old module path (loading the module at its new path, with a
        ``DeprecationWarning``); ``None`` for any other module."""
        new = new_module_name(fullname)
        if new is None:
            return None
        import importlib.util

        _warn(fullname, new)
        # a loader by its two methods (create_module, exec_module); typeshed's protocol
        # also asks for the legacy load_module, which the import system never calls here
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new))  # type: ignore[arg-type]


def install() -> None:
    """Put ``MovedModuleFinder`` first on ``sys.meta_path`` (once).

    First, so that a folder left at an old path (a ``__pycache__`` of an earlier version in an
    editable install) is not imported as an empty namespace package instead.
    """
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())


def moved_attribute(package: str, name: str) -> Any:
    """``package.name`` for a name the package used to re-export, with a DeprecationWarning.

    Raises:
        AttributeError: ``name`` was never one of the package's names.
    """
    where = MOVED_NAMES.get(package, {}).get(name)
    if where is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    import importlib

    _warn(f"{package}.{name}", f"{where}.{name}")
    return getattr(importlib.import_module(where), name)
