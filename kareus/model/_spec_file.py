"""Reading model and GPU description files: the checks every field reader shares.

A leaf of the model layer: ``kareus.model.gpu`` and ``kareus.model.workload`` build their value
objects from files with it (each module owns the loader and the registry of its type), and
[`kareus.model.files`][kareus.model.files] gathers the loaders for users.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from kareus.errors import KareusError

__all__ = ["MAX_NAME", "SpecFileError"]

_MAX_BYTES = 1024 * 1024
"""Spec files are a few hundred bytes; anything over 1 MiB is not one."""


class SpecFileError(KareusError, ValueError):
    """A model or GPU description (file or dict) that kareus cannot use."""


# ----------------------------------------------------------------------------- reading


def _toml_loads() -> Any:
    try:
        import tomllib  # Python 3.11+

        return tomllib.loads
    except ImportError:
        pass
    try:
        import tomli  # the same parser on Python 3.10

        return tomli.loads
    except ImportError:
        return None


def _read_table(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise SpecFileError(f"{what} file {p} is a folder: pass the path of a .toml or .json file")
    suffix = p.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise SpecFileError(f"{what} file {p} must end in .toml or .json (it says which format "
                            f"it is), got {p.suffix or 'no suffix'!r}")
    try:
        raw = p.read_bytes() if p.stat().st_size <= _MAX_BYTES else None
    except FileNotFoundError:
        raise SpecFileError(f"{what} file {p} does not exist: check the path") from None
    except OSError as exc:
        raise SpecFileError(f"cannot read {what} file {p}: {exc.strerror or exc}") from None
    if raw is None:
        raise SpecFileError(f"{what} file {p} is over {_MAX_BYTES:,} bytes: it is not a "
                            f"{what} description")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecFileError(f"{what} file {p} is not UTF-8 text (byte {exc.start}): save it "
                            "as UTF-8") from None
    if suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise SpecFileError(f"{what} file {p} is not valid JSON ({exc})") from None
    else:
        loads = _toml_loads()
        if loads is None:
            raise SpecFileError(f"{what} file {p} is TOML, which needs Python 3.11+ or the tomli "
                                "package: pip install tomli, or write the file as JSON")
        try:
            data = loads(text)
        except ValueError as exc:  # tomllib.TOMLDecodeError is a ValueError
            raise SpecFileError(f"{what} file {p} is not valid TOML ({exc})") from None
    if not isinstance(data, dict):
        raise SpecFileError(f"{what} file {p} holds a JSON {type(data).__name__}, not an "
                            f"object of {what} fields")
    return data


def _check_keys(d: Mapping[str, Any], fields: tuple[str, ...], where: str,
                optional: tuple[str, ...] = ()) -> None:
    """Refuse unknown keys (with the closest field as a hint) and missing ``fields``;
    ``optional`` keys may be present or not."""
    known = fields + optional
    unknown = [k for k in d if k not in known]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(str(k), known, n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise SpecFileError(f"{where}: unknown key(s) {', '.join(hints)}; the fields are "
                            f"{', '.join(known)}")
    missing = [f for f in fields if f not in d]
    if missing:
        raise SpecFileError(f"{where}: missing field(s) {', '.join(missing)}; every one of "
                            f"{', '.join(fields)} is needed")


def _int(value: Any, field: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise SpecFileError(f"{where}: {field} must be a whole number, got {value!r:.60}")
    return value


def _bool(value: Any, field: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise SpecFileError(f"{where}: {field} must be true or false, got {value!r:.60}")
    return value


def _float(value: Any, field: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecFileError(f"{where}: {field} must be a number, got {value!r:.60}")
    try:
        x = float(value)
    except OverflowError:  # an integer beyond float range
        x = float("inf")
    if x != x or x in (float("inf"), float("-inf")):
        raise SpecFileError(f"{where}: {field} must be a finite number, got {value!r:.60}")
    return x


#: The longest model or GPU name a file may give (it appears in every message).
MAX_NAME = 200


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SpecFileError(f"{where}: name must be a non-empty string, got {value!r:.60}")
    if len(value.strip()) > MAX_NAME:
        raise SpecFileError(f"{where}: name is {len(value.strip()):,} characters long (at "
                            f"most {MAX_NAME})")
    return value.strip()


# ----------------------------------------------------------------------------- registries

_T = TypeVar("_T")


def _register(registry: dict[str, _T], presets: Mapping[str, _T], key: str, item: _T, *,
              name: str, kind: str, figures: str, replace: bool) -> _T:
    """Put ``item`` in ``registry`` under ``key``, the rules both registries share: a preset's
    name takes only the preset itself (not registered again); another item under a
    registered name only with ``replace``.

    Raises:
        SpecFileError: ``name`` is a preset's with other ``figures``, or another ``kind`` is
            registered under it (and ``replace`` is false).
    """
    if key in presets:
        if presets[key] == item:
            return item
        raise SpecFileError(f"{kind} {name!r} is a built-in preset with other {figures}: give "
                            f"your {kind} another name")
    old = registry.get(key)
    if old is not None and old != item and not replace:
        raise SpecFileError(f"another {kind} is already registered as {name!r}: give this "
                            "one another name, or pass replace=True")
    registry[key] = item
    return item
