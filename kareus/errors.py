"""Typed errors of kareus.

Every error a user can cause derives from [`KareusError`][kareus.errors.KareusError] and from the
built-in type that fits it (``ValueError`` for bad values, ``TypeError`` for an object of the
wrong type, ``FileNotFoundError`` for a file that is not there; ``KeyError`` is avoided because
its message is repr-quoted), so that ``except ValueError`` keeps working. Messages say what was
wrong and what to do instead.

The ``kareus`` command reports a ``KareusError`` as one line and its
[`exit_code`][kareus.errors.KareusError]; any other exception reaching it is a bug, reported as
``kareus: internal error: ...`` with a request to report it.
"""

from __future__ import annotations

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "ConfigError",
    "HardwareError",
    "InfeasibleError",
    "InvalidSMCountError",
    "FolderInUseError",
    "GraphCaptureError",
    "KareusError",
    "MissingFileError",
    "OutputError",
    "PlanError",
    "UnknownPresetError",
    "UnknownSlotError",
    "UnsupportedFrequencyError",
    "WorkloadError",
]


class KareusError(Exception):
    """Base class of every error raised by kareus on purpose.

    Attributes:
        exit_code: The ``kareus`` command's exit status for this error: 2 for a bad request
            (arguments, presets, files and folders the user named, constraints no plan
            meets), 1 for a failure of the machine while running (hardware, a folder locked
            by another run).
    """

    exit_code: int = 2


class ArgumentError(KareusError, ValueError):
    """An argument (or command-line option) whose value kareus refuses: out of range, of an
    unknown kind, or in conflict with another argument. The more specific errors below
    (workloads, configurations, plans, outputs) are used where they fit."""

    exit_code = 2


class ArgumentTypeError(KareusError, TypeError):
    """An argument of the wrong type: a plug-in object that does not implement its role
    (a profiler that is not a ``Profiler``...), or a value of the wrong kind."""

    exit_code = 2


class MissingFileError(KareusError, FileNotFoundError):
    """A file the user named (a recording, a profile, a plan...) that does not exist."""

    exit_code = 2


class UnknownPresetError(KareusError, ValueError):
    """A preset name (GPU, workload, schedule) that kareus does not know."""

    exit_code = 2

    def __init__(self, kind: str, name: str, known: list[str] | tuple[str, ...]) -> None:
        self.kind = kind
        self.name = name
        self.known = tuple(known)
        super().__init__(f"unknown {kind} {name!r}; known {kind}s: {', '.join(self.known)}")


class WorkloadError(KareusError, ValueError):
    """A workload whose parallelism or shapes do not fit the model or each other."""

    exit_code = 2


class ConfigError(KareusError, ValueError):
    """A schedule configuration that is not valid for its partition or GPU."""

    exit_code = 2


class InvalidSMCountError(ConfigError):
    """A communication SM count outside what the GPU can give."""


class UnsupportedFrequencyError(ConfigError):
    """An SM clock the GPU does not support."""


class UnknownSlotError(ConfigError):
    """A launch slot that the partition does not have."""


class PlanError(KareusError, ValueError):
    """A plan file that is corrupt, of another version, or invalid for its GPU."""


class HardwareError(KareusError, RuntimeError):
    """A GPU, driver or permission problem found while touching real hardware."""

    exit_code = 1


class GraphCaptureError(HardwareError):
    """Work that cannot be captured in (or replayed from) a CUDA graph: an op that
    synchronises with the host, a stream backend without graphs, a graph replayed out of
    the order its memory pool needs. Run eagerly instead (``graphs=False``,
    ``--no-graphs``)."""


class InfeasibleError(KareusError, ValueError):
    """A constraint (deadline, energy budget, search budget) that no plan can meet."""


class OutputError(KareusError, ValueError):
    """An output folder or file that cannot be used: an existing file where a folder is
    wanted (or the reverse), a folder that is not writable, an empty path, or a folder made
    by another job (its manifest names other inputs)."""

    exit_code = 2


class FolderInUseError(KareusError, RuntimeError):
    """An output folder locked by another running job."""

    exit_code = 1


#: What reading a corrupt JSON document field by field raises (a missing key, a value of
#: the wrong type, a number beyond float range...): the loaders of recordings and search
#: logs turn these into one typed line with :func:`data_problem`.
DATA_ERRORS = (KeyError, TypeError, ValueError, OverflowError, AttributeError)


def data_problem(exc: BaseException, limit: int = 200) -> str:
    """One line saying what was wrong with a document's field (for one of
    ``DATA_ERRORS``)."""
    if isinstance(exc, KeyError):
        return f"missing field {exc.args[0]!r:.60}"
    return " ".join(str(exc).split())[:limit]


def short_repr(value: object, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters, for a bad value shown in a message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
