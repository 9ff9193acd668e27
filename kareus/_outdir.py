"""Guarded output folders: a manifest of the inputs, an exclusive lock, early path checks.

A folder that ``kareus optimize`` writes (``--out``, or the ``log_dir`` of
[`kareus.workflow.optimize`][kareus.workflow.optimize]) holds search logs that a later run resumes.
Resuming is only right when the later run has the same inputs, and only one run may write at a time:

- **Manifest** (``kareus-manifest.json``): every input that changes a number (the workload
  with all its shapes, parallelism, the GPU and a digest of its specification, the profiler
  and a digest of its data, the noise, the surrogate, the budget, the seed, the kareus
  version). A run whose inputs differ is refused in one line that names the first differing
  field and says what to do (another folder, or ``--fresh`` / ``fresh=True`` to discard the
  old results). A folder with kareus outputs but no manifest is refused the same way.
- **Lock** (``.kareus.lock``): an exclusive, non-blocking ``fcntl.flock`` held for the whole
  run; a second run on the same folder is refused at once. The operating system releases it
  when the process ends, however it ends, so a killed run never leaves a stale lock.
- **Path checks** before any work: an empty path, an existing file where a folder is
  wanted (or the reverse), a folder that cannot be created or written.

This module imports nothing from kareus's layers (only ``kareus._io``, the errors and
the version), so the workflow and the command line both use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kareus._io import read_json, write_json_atomic
from kareus._version import __version__
from kareus.errors import FolderInUseError, OutputError

__all__ = ["LOCK_NAME", "MANIFEST_NAME", "check_output_file", "check_output_folder",
           "guarded_folder", "is_held"]

MANIFEST_NAME = "kareus-manifest.json"
LOCK_NAME = ".kareus.lock"
MANIFEST_KIND = "kareus-manifest"
MANIFEST_VERSION = 1

#: What kareus writes in an output folder (``--fresh`` removes these, nothing else).
_OUTPUTS = ("results.json", "plan.json", "frontier.png", MANIFEST_NAME)
_LOG_GLOB = "search-*.jsonl*"

_held: set[Path] = set()


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_output_folder(path: str | os.PathLike[str] | None, *, what: str = "--out") -> Path:
    """Check that ``path`` can be (or is) a writable folder, before any long work.

    Raises:
        OutputError: an empty path, an existing file, a file on the way, or no write
            permission where the folder is or would be created.
    """
    if path is None or not str(os.fspath(path)).strip():
        raise OutputError(f"{what} is empty: give the folder the results go to")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputError(f"{what} {p} is an existing file, not a folder: choose a folder "
                          "path (it is created if missing)")
    base = _nearest_existing(p)
    if not base.is_dir():
        raise OutputError(f"{what} {p}: {base} is a file, so the folder cannot be created; "
                          "choose another path")
    if not os.access(base, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {p}: {base} is not writable; choose a folder you can "
                          "write to")
    return p


def check_output_file(path: str | os.PathLike[str] | None, *, what: str = "--record") -> Path:
    """Check that ``path`` can be written as a file, before any long work.

    Raises:
        OutputError: an empty path, an existing folder, or a folder on the way that is a
            file or not writable.
    """
    if path is None or not str(os.fspath(path)).strip():
        raise OutputError(f"{what} is empty: give the path of the file to write")
    p = Path(path)
    if p.is_dir():
        raise OutputError(f"{what} {p} is a folder: give the path of a file to write")
    if p.exists() and not os.access(p, os.W_OK):
        raise OutputError(f"{what} {p} exists and is not writable; choose another path")
    base = _nearest_existing(p.parent if str(p.parent) else Path("."))
    if not base.is_dir():
        raise OutputError(f"{what} {p}: {base} is a file, so {p} cannot be written")
    if not os.access(base, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {p}: {base} is not writable; choose another path")
    return p


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
        field = _first_difference(head.get("inputs"), dict(inputs))
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
