"""Guarded output folders: a manifest of the inputs and an exclusive lock.

A folder that ``kareus optimize`` writes (``--out``, or the ``log_dir`` of
[`kareus.workflow.optimize`][kareus.workflow.optimize]) holds search logs that a later run resumes.
Resuming is only right when the later run has the same inputs, and only one run may write at a time:

- **Manifest** (``kareus-manifest.json``, [`manifest_inputs`][kareus.workflow.manifest_inputs]):
  every input that changes a number (the workload with all its shapes, parallelism, the GPU
  and a digest of its specification, the profiler's
  [`identity`][kareus.model.Profiler.identity], the surrogate, the budget, the seed, the kareus
  version). A run whose inputs differ is refused in one line that names the first differing
  field and says what to do (another folder, or ``--fresh`` / ``fresh=True`` to discard the
  old results). A folder with kareus outputs but no manifest is refused the same way.
- **Lock** (``.kareus.lock``): an exclusive, non-blocking ``fcntl.flock`` held for the whole
  run; a second run on the same folder is refused at once. The operating system releases it
  when the process ends, however it ends, so a killed run never leaves a stale lock.
- **Torn logs**: a search log whose header line a kill cut short is moved aside
  ([`recover_torn_logs`][kareus.workflow.outdir.recover_torn_logs]) and that search starts again.

The path checks made before any work (an empty path, a file where a folder is wanted, a
folder that cannot be written) are ``kareus._io``'s, shared with the measuring side.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kareus._io import check_output_folder, read_json, write_json_atomic
from kareus._version import __version__
from kareus.errors import (
    FolderInUseError,
    OutputError,
)
from kareus.model.partition import PartitionSet
from kareus.model.profiler import Profiler
from kareus.model.workload import Workload
from kareus.search.acquisition import AcquisitionPass
from kareus.search.surrogate import Surrogate

__all__ = ["LOCK_NAME", "MANIFEST_NAME", "guarded_folder", "is_held", "manifest_inputs", "move_aside", "recover_torn_logs"]


MANIFEST_NAME = "kareus-manifest.json"

LOCK_NAME = ".kareus.lock"

MANIFEST_KIND = "kareus-manifest"

MANIFEST_VERSION = 1

#: What kareus writes in an output folder (``--fresh`` removes these, nothing else).
_OUTPUTS = ("results.json", "plan.json", "frontier.json", "frontier.png", MANIFEST_NAME)

_LOG_GLOB = "search-*.jsonl*"

_held: set[Path] = set()


def is_held(path: str | os.PathLike[str]) -> bool:
    """Whether this process already holds the lock of ``path`` or of a folder above it."""
    p = Path(path).absolute()
    return any(p == h or h in p.parents for h in _held)


def _first_difference(old: Any, new: Any, prefix: str = "") -> str | None:
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        # the new inputs' order (the workload's model before its architecture), then the rest
        for key in [*new, *(k for k in old if k not in new)]:
            name = f"{prefix}.{key}" if prefix else str(key)
            if key not in old or key not in new:
                return name
            diff = _first_difference(old[key], new[key], name)
            if diff is not None:
                return diff
        return None
    return None if old == new else (prefix or "manifest")


def _lookup(d: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, Mapping) or part not in d:
            return "(absent)"
        d = d[part]
    return d


def _clear(folder: Path) -> None:
    for name in _OUTPUTS:
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()
    for sub in (folder, folder / "logs"):
        if sub.is_dir():
            for log in sub.glob(_LOG_GLOB):
                log.unlink()


def _has_outputs(folder: Path, *, manifest: bool = True) -> bool:
    """Whether ``folder`` holds kareus outputs (the manifest among them unless told not)."""
    names = _OUTPUTS if manifest else tuple(n for n in _OUTPUTS if n != MANIFEST_NAME)
    return any((folder / n).exists() for n in names) or any(
        next(sub.glob(_LOG_GLOB), None) is not None
        for sub in (folder, folder / "logs") if sub.is_dir())


def _current_paths(recorded: Any) -> Any:
    """A manifest's inputs with the profiler's class under its current module path: a folder
    made before a module moved (``kareus.exec.emulator`` is now ``kareus.profilers.emulator``)
    is the same job."""
    from kareus._compat import new_module_name

    profiler = recorded.get("profiler") if isinstance(recorded, dict) else None
    if not isinstance(profiler, dict):
        return recorded
    cls = profiler.get("class")
    if not isinstance(cls, str) or "." not in cls:
        return recorded
    module, name = cls.rsplit(".", 1)
    moved = new_module_name(module)
    if moved is None:
        return recorded
    return {**recorded, "profiler": {**profiler, "class": f"{moved}.{name}"}}


def _check_manifest(folder: Path, inputs: Mapping[str, Any], *, fresh: bool, what: str) -> bool:
    """Check the folder's manifest against ``inputs`` or write it; True when written."""
    path = folder / MANIFEST_NAME
    if fresh:
        _clear(folder)
    elif path.exists():
        try:
            head = read_json(path, error=OutputError, what="manifest")
        except OutputError as exc:  # say what to do about it
            raise OutputError(f"{exc}; use another {what}, or --fresh to discard the folder's "
                              "results and start again") from None
        if head.get("kind") != MANIFEST_KIND or head.get("version") != MANIFEST_VERSION:
            raise OutputError(f"{what} {folder}: {path.name} is not a manifest this kareus "
                              f"reads; use another {what}, or --fresh to discard the folder's "
                              "results")
        field = _first_difference(_current_paths(head.get("inputs")), dict(inputs))
        if field is not None:
            old, new = _lookup(head.get("inputs"), field), _lookup(inputs, field)
            raise OutputError(f"{what} {folder} holds the results of another job: its {field} "
                              f"is {old!r:.60}, this run's is {new!r:.60}; use another {what}, "
                              f"or --fresh to discard them")
        return False
    elif _has_outputs(folder):
        raise OutputError(f"{what} {folder} holds kareus results without a manifest (another "
                          f"job, or an older kareus): use another {what}, or --fresh to "
                          "discard them")
    write_json_atomic(path, {"kind": MANIFEST_KIND, "version": MANIFEST_VERSION,
                             "kareus_version": __version__, "inputs": dict(inputs)})
    return True


@contextlib.contextmanager


def guarded_folder(folder: str | os.PathLike[str], inputs: Mapping[str, Any], *,
                   fresh: bool = False, what: str = "--out") -> Iterator[Path]:
    """Create ``folder``, lock it for this run, and check (or write) its manifest.

    Args:
        folder: The output folder.
        inputs: Every input that changes a number (JSON-ready); compared with the folder's
            manifest.
        fresh: Remove the folder's kareus outputs (results, plan, figure, search logs,
            manifest) and start again.
        what: How the user named the folder, for messages.

    Raises:
        OutputError: the path is unusable, or the folder belongs to another job.
        FolderInUseError: another process holds the folder's lock.
    """
    import fcntl  # POSIX only; imported where it is used

    p = check_output_folder(folder, what=what)
    try:
        p.mkdir(parents=True, exist_ok=True)
        fh = open(p / LOCK_NAME, "a+", encoding="utf-8")  # noqa: SIM115 - held for the run
    except OSError as exc:
        raise OutputError(f"{what} {p}: cannot create it or its lock file "
                          f"({exc.strerror or exc}); choose another folder") from None
    try:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise OutputError(f"{what} {p}: cannot lock it ({exc.strerror or exc})"
                                  ) from None
            fh.seek(0)
            holder = fh.read().strip()[:40] or "another process"
            raise FolderInUseError(f"{what} {p} is in use by another kareus run ({holder}); "
                                   f"wait for it to finish, or use another {what}") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}\n")
        fh.flush()
        key = p.absolute()
        _held.add(key)
        try:
            wrote = _check_manifest(p, inputs, fresh=fresh, what=what)
            try:
                yield p
            except BaseException:
                # A run that fails before it writes anything (an input refused late, a
                # Ctrl-C before the first measurement) leaves no manifest behind: nothing
                # there needs protecting, and the corrected command must not be refused as
                # another job.
                if wrote and not _has_outputs(p, manifest=False):
                    (p / MANIFEST_NAME).unlink(missing_ok=True)
                raise
        finally:
            _held.discard(key)
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    finally:
        fh.close()


def move_aside(path: Path) -> Path:
    """Rename ``path`` to a free ``<name>.torn[-k]`` beside it (kept, never deleted)."""
    target = path.with_name(path.name + ".torn")
    k = 1
    while target.exists():
        target = path.with_name(f"{path.name}.torn-{k}")
        k += 1
    shutil.move(str(path), str(target))
    return target


def recover_torn_logs(log_dir: Path) -> None:
    """Move aside a search log whose header line was cut short by a kill (it holds no
    measurement yet), so that the search starts it again instead of failing on it; the
    torn file is kept beside it as ``<name>.torn``."""
    for log in sorted(log_dir.glob("search-*.jsonl")):
        try:
            with open(log, "rb") as fh:
                head = fh.readline()
        except OSError:
            continue
        if not head or head.endswith(b"\n"):
            continue
        try:
            complete = isinstance(json.loads(head), dict)
        except ValueError:
            complete = False
        if not complete:
            kept = move_aside(log)
            print(f"kareus: {log} had a torn header line (a run was killed as it started); "
                  f"kept it as {kept.name} and starting that search again", file=sys.stderr)


def _digest_json(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _name_of(obj: Any) -> Any:
    if obj is None or isinstance(obj, str):
        return obj
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def manifest_inputs(workload: Workload, profiler: Profiler, *, budget: int,
                    batch_size: int | None, seed: int, schedule: str,
                    surrogate: Surrogate | str | None, systems: Sequence[str] | None,
                    microbatch_composer: Any = None, iteration_composer: Any = None,
                    passes: Sequence[tuple[AcquisitionPass, float]] | None = None,
                    partitions: Any = None, prior_model: Profiler | None = None,
                    smooth: bool = False) -> dict[str, Any]:
    """Every input of ``optimize`` that changes a number, as the manifest of its output
    folder records it: a folder whose manifest differs is refused.

    ``passes``, ``partitions``, ``prior_model`` and ``smooth`` are recorded only when given
    (not the defaults), so a folder made before they could be given keeps its manifest."""
    gpu = profiler.gpu
    spec: dict[str, Any] | str
    try:
        spec = attrs.asdict(gpu)
    except attrs.exceptions.NotAnAttrsClassError:
        spec = repr(gpu)
    return {
        "kareus_version": __version__,
        "workload": {**workload.to_dict(), "dtype_bytes": workload.dtype_bytes,
                     "architecture": _architecture(workload)},
        "gpu": {"name": gpu.name, "spec_digest": _digest_json(spec)},
        "budget": budget,
        "batch_size": batch_size,
        "seed": seed,
        "schedule": schedule,
        "surrogate": _name_of(surrogate) or "gp",
        "profiler": profiler.identity(),
        "systems": list(systems) if systems is not None else None,
        "composers": [_name_of(microbatch_composer), _name_of(iteration_composer)],
        **({} if passes is None else {"passes": [[_name_of(p), _stable_repr(p), float(w)]
                                                 for p, w in passes]}),
        **({} if partitions is None else {"partitions": _partitions_identity(partitions)}),
        **({} if prior_model is None else {"prior_model": prior_model.identity()}),
        **({"smooth": True} if smooth else {}),
    }


def _architecture(workload: Workload) -> dict[str, Any]:
    """Every field of the workload's model, as the manifest records it; ``moe`` only for a
    mixture-of-experts model (a dense model's manifest is as before the field existed)."""
    arch = attrs.asdict(workload.model)
    if arch.get("moe", 0) is None:
        del arch["moe"]
    return arch


def _partitions_identity(partitions: Any) -> Any:
    """What the manifest records of ``optimize(partitions=...)``: a set's digest (its
    types, counts and outside work), or a builder's name."""
    if isinstance(partitions, PartitionSet):
        types = {n: {"class": _name_of(p), "overlappable": p.overlappable,
                     "ops": [[op.name, op.flops, op.bytes_moved] for op in p.compute_ops],
                     "comm": [p.comm_op.kind.value, p.comm_op.bytes, p.comm_op.group_size]}
                 for n, p in partitions.types.items()}
        return {"types": {n: _name_of(p) for n, p in partitions.types.items()},
                "digest": _digest_json([types, partitions.counts, repr(partitions.outside),
                                        repr(partitions.iteration)])}
    return getattr(partitions, "__qualname__", None) or _name_of(partitions)


def _stable_repr(obj: Any) -> str | None:
    """``repr(obj)`` where it says what the object is; ``None`` where it holds a memory
    address (the same configuration would give another manifest in the next run)."""
    text = repr(obj)
    return None if " at 0x" in text else text
