"""Reading and writing kareus's JSON files: one place for encoding, atomic replacement
and the typed errors a corrupt or unreadable file gets.

Every file kareus writes (results.json, plan.json, frontiers, recordings, GPU profiles)
goes through ``write_json_atomic``: the text is written to a temporary file in the
same folder, flushed to disk and renamed over the target, so a reader (or a run killed
half-way) sees either the old file or the new one, never a torn one. Every file kareus
reads goes through ``read_json``, which turns the ways a file can be bad (missing, a
folder, not UTF-8, not JSON, too large, not an object) into one typed error whose message
names the file and says what to do.

This module imports nothing from kareus's layers (only the leaf module of typed errors),
so every layer may use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from kareus.errors import OutputError

__all__ = ["DEFAULT_MAX_BYTES", "dumps", "read_json", "write_json_atomic", "write_text_atomic"]

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
"""Files larger than this are refused before they are parsed (64 MiB: far above any plan,
result or recording kareus writes, far below what would exhaust a laptop's memory)."""


def dumps(obj: Any, *, indent: int | None = 1) -> str:
    """Serialise ``obj`` as kareus writes JSON: NaN and infinities refused, a final newline."""
    return json.dumps(obj, indent=indent, allow_nan=False) + "\n"


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically (temporary file in the same folder, fsync, rename).

    Returns:
        The path written.

    Raises:
        OutputError: ``path`` is an existing folder, or its folder does not exist or cannot
            be written (the message names ``path``, never the temporary file).
    """
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise OutputError(f"{target} is a folder, not a file: pass the path of a file to write "
                          f"(for example {target / 'plan.json'})")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    except FileNotFoundError:
        raise OutputError(f"cannot write {target}: its folder {folder} does not exist; "
                          f"create it first") from None
    except OSError as exc:
        raise OutputError(f"cannot write {target}: {exc.strerror or exc} (in folder {folder})"
                          ) from None
    try:
        # mkstemp makes the file private (0600); give it the mode an ordinary write would
        # (the old file's, else 0666 less the umask), so shared results stay readable.
        try:
            mode = target.stat().st_mode & 0o7777
        except OSError:
            mode = 0o666 & ~_umask()
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _sync_folder(folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def _sync_folder(folder: Path) -> None:
    """fsync the folder, so that the rename itself survives a power failure (best effort:
    some file systems cannot sync a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    """The process's umask, read without changing it where Linux allows (else set and reset)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 1) -> Path:
    """Serialise ``obj`` with ``dumps`` and write it to ``path`` atomically."""
    return write_text_atomic(path, dumps(obj, indent=indent))


def read_json(
    path: str | os.PathLike[str],
    *,
    error: type[Exception],
    what: str = "file",
    max_bytes: int = DEFAULT_MAX_BYTES,
    expect_object: bool = True,
) -> Any:
    """Read a JSON file, turning every way it can be bad into ``error`` with a one-line message.

    Args:
        path: the file.
        error: the exception class raised (a
            [`kareus.errors.KareusError`][kareus.errors.KareusError] subclass, e.g. ``PlanError``);
            it is called with one message string.
        what: what the file is, for the message ("plan", "recording", ...).
        max_bytes: larger files are refused before parsing.
        expect_object: require the top level to be a JSON object.

    Raises:
        error: the file is missing, a folder, unreadable, too large, not UTF-8, not JSON,
            or (with ``expect_object``) not a JSON object.
    """
    p = Path(path)
    if p.is_dir():
        raise error(f"{what} {p} is a folder, not a file: pass the path of the {what} file")
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        raise error(f"{what} {p} does not exist: check the path") from None
    except OSError as exc:
        raise error(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    if size > max_bytes:
        raise error(f"{what} {p} is {size:,} bytes, over the {max_bytes:,}-byte limit: "
                    f"it is not a file kareus wrote")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise error(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {p} is not UTF-8 text (byte {exc.start}): "
                    f"it is corrupt or not a kareus {what}") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as exc:
        raise error(f"{what} {p} is not valid JSON ({exc}): it is corrupt or not a kareus "
                    f"{what}") from None
    if expect_object and not isinstance(data, dict):
        raise error(f"{what} {p} holds a JSON {type(data).__name__}, not an object: "
                    f"it is not a kareus {what}")
    return data


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number kareus writes")


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
    from kareus.errors import OutputError

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
    from kareus.errors import OutputError

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
