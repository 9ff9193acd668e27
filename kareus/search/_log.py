"""The search log: a versioned JSONL record of every batch asked and measurement told.

A [`MultiPassSearch`][kareus.search.MultiPassSearch] given ``log=PATH`` writes a header line
(format, version, partition, GPU, space, seed, sizes, and how the measurements are made where the
search was told: ``measured_with``, e.g. ``{"execution": "graphed"}``), then one ``ask`` record per batch (the
configurations and the pass that chose each) and one ``tell`` record per measurement, each
line handed to the operating system before the search goes on (a killed run loses nothing)
and synced to disk at least once a second and at the end of the search. ``resume=PATH`` reads it back
(``read_log``), checks that it belongs to the same search (``check_header``) and
replays it. A line cut short by a kill is dropped from the file; a corrupt line anywhere
else is an error. Logs are JSON, never executable code.

Every record carries a checksum of its content (``"check"``: the first 16 hex digits of the
SHA-256 of the record's canonical JSON, without that field), so that a record edited by hand
or damaged on disk is refused on resume, naming its file and line, rather than replayed as
if it had been measured. Logs written before checksums existed (a header without
``"check"``) still resume, unchecked.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kareus._version import __version__
from kareus.errors import OutputError
from kareus.model.config import ConfigSpace

__all__ = ["CHECK_FIELD", "LOG_FORMAT", "LOG_VERSION", "SYNC_INTERVAL_S", "append_record",
           "check_header", "log_header", "read_log", "record_checksum", "space_description",
           "sync_log"]

#: The ``format`` field of a search log's header.
LOG_FORMAT = "kareus-search-log"
#: The version of the search log format this kareus writes and reads.
LOG_VERSION = 1

#: What to do with a log that cannot be resumed, said in every such error.
REMEDY = ("delete that log to measure its partition type again, or start over with "
          "optimize(..., fresh=True)")

#: The field of every record that holds its checksum (``record_checksum``).
CHECK_FIELD = "check"


def record_checksum(record: Mapping[str, Any]) -> str:
    """The checksum of a log record: the first 16 hex digits of the SHA-256 of its JSON
    with sorted keys and no spaces, the ``CHECK_FIELD`` left out.

    JSON numbers read back as the same floats and are written again as the same text, so
    a record read from a log has the checksum it was written with, unless it was changed.
    """
    body = {k: v for k, v in record.items() if k != CHECK_FIELD}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def space_description(space: ConfigSpace) -> dict[str, Any]:
    """The knob values of ``space``, as the log's header records them.

    Args:
        space: The searched configuration space.

    Returns:
        ``{"freqs_mhz": [...], "comm_sms": [...], "slots": [...]}``, plus ``"backends"``
        in a space of several collective backends (a space of one backend describes
        itself as before, so older logs still resume).
    """
    out: dict[str, Any] = {"freqs_mhz": list(space.freqs_mhz),
                           "comm_sms": list(space.comm_sms), "slots": list(space.slots)}
    backends = getattr(space, "backends", (None,))
    if len(backends) > 1:
        out["backends"] = list(backends)
    return out


def log_header(space: ConfigSpace, *, seed: int, batch_size: int, budget: int,
               initial_size: int, measured_with: Mapping[str, str] | None = None,
               prior_mean: Mapping[str, str] | None = None
               ) -> dict[str, Any]:
    """The header record of a new search log.

    Args:
        space: The searched configuration space.
        seed: The search's seed.
        batch_size: Configurations per batch.
        budget: Profiles in all.
        initial_size: Profiles of the initial design.
        measured_with: How the measurements are made, beyond the space (e.g.
            ``{"execution": "graphed"}``); recorded when given and not empty, and checked
            on resume (``check_header``).
        prior_mean: The search's prior mean, ``{"source": ..., "digest": ...}``
            ([`PriorMean`][kareus.search.PriorMean]); recorded when given, its digest
            checked on resume.

    Returns:
        The header record (``kind == "header"``), with the kareus version and the time of
        creation (UTC).
    """
    head = {"kind": "header", "format": LOG_FORMAT, "version": LOG_VERSION,
            "kareus_version": __version__,
            "partition": space.partition.name, "gpu": space.gpu.name,
            "space": space_description(space), "seed": seed,
            "batch_size": batch_size, "budget": budget,
            "initial_size": initial_size,
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if measured_with:
        head["measured_with"] = dict(measured_with)
    if prior_mean:
        head["prior_mean"] = dict(prior_mean)
    return head


#: Longest time between two syncs of a log to disk, seconds (see :func:`append_record`).
SYNC_INTERVAL_S = 1.0

_last_sync: dict[str, float] = {}


def append_record(path: Path, record: dict[str, Any], *, sync: bool | None = None) -> None:
    """Append ``record`` to the log at ``path`` as one JSON line.

    The line reaches the operating system at once, so a killed run (Ctrl-C, SIGTERM,
    SIGKILL) loses nothing. It is synced to disk (fsync) when the log was last synced
    ``SYNC_INTERVAL_S`` or more ago, and always with ``sync=True`` (the end of a
    search): a power failure loses at most the last second's records, which a resumed
    search measures again. Syncing every record instead costs a disk wait per
    measurement, which on a busy machine is a wait for a core too (the README job made
    over a thousand).

    Args:
        path: The log file.
        record: A JSON-serialisable record; written with its checksum (``CHECK_FIELD``)
            added, ``record`` itself left as it is.
        sync: ``True`` syncs now; ``False`` never; ``None`` (default) by the interval.
    """
    key = os.fspath(path)
    signed = {**record, CHECK_FIELD: record_checksum(record)}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(signed, separators=(",", ":")) + "\n")
        f.flush()
        now = time.monotonic()
        if sync or (sync is None and now - _last_sync.get(key, -math.inf) >= SYNC_INTERVAL_S):
            os.fsync(f.fileno())
            _last_sync[key] = now


def sync_log(path: Path) -> None:
    """Sync the log at ``path`` to disk now (the end of a search)."""
    with open(path, "a", encoding="utf-8") as f:
        os.fsync(f.fileno())
    _last_sync[os.fspath(path)] = time.monotonic()


def read_log(path: Path) -> list[dict[str, Any]]:
    """Every record of the log at ``path``, the header first.

    A last line cut short (a search killed while writing) is dropped, and the file is
    truncated after the last whole record so that appending continues cleanly. Each
    record's checksum is checked (``record_checksum``) and left out of what is returned;
    in a log whose header has none (written before checksums existed) a record without
    one is accepted.

    Args:
        path: The log file.

    Returns:
        The records, in order, without their checksums; the first is the header.

    Raises:
        OutputError: if a line other than the last is not a JSON record, there is no
            header, or a record does not match its checksum or lacks one (an OutputError is
            a ValueError).
    """
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    records: list[dict[str, Any]] = []
    line_numbers: list[int] = []
    good_bytes = 0
    for k, line in enumerate(lines):
        if not line.strip():
            good_bytes += len(line) + (1 if k < len(lines) - 1 else 0)
            continue
        try:
            records.append(json.loads(line))
            line_numbers.append(k + 1)
        except json.JSONDecodeError:
            if k == len(lines) - 1:  # a record cut short by the kill: drop it
                break
            raise OutputError(f"search log {path} is corrupt at line {k + 1}: "
                              f"{REMEDY}") from None
        good_bytes += len(line) + (1 if k < len(lines) - 1 else 0)
    if good_bytes < len(raw):
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    if not records or not all(isinstance(r, dict) for r in records) \
            or records[0].get("kind") != "header":
        raise OutputError(f"{path} is not a kareus search log (no header line, or a line "
                          f"that is not a record): {REMEDY}")
    return _verified(path, records, line_numbers)


def prior_count(path: str | os.PathLike[str]) -> int:
    """How many prior observations (``MultiPassSearch``'s ``prior``: measured before the
    search, outside its budget) the search log at ``path`` holds; 0 for a missing or empty
    file.

    Raises:
        OutputError: the file is not an intact kareus search log.
    """
    p = Path(path)
    if not p.exists() or p.stat().st_size == 0:
        return 0
    return sum(1 for rec in read_log(p)[1:] if rec.get("kind") == "prior")


def _verified(path: Path, records: list[dict[str, Any]], line_numbers: list[int]
              ) -> list[dict[str, Any]]:
    """The records without their checksums, each checked against its own."""
    signed = CHECK_FIELD in records[0]
    out = []
    for k, (rec, line) in enumerate(zip(records, line_numbers)):
        # The header cannot be dropped alone: the whole log goes.
        todo = REMEDY if k == 0 else f"delete that line to measure it again, or {REMEDY}"
        if CHECK_FIELD in rec:
            if rec[CHECK_FIELD] != record_checksum(rec):
                raise OutputError(f"search log {path}, line {line}: the record does not match "
                                  f"its checksum (edited by hand or damaged): {todo}")
            rec = {key: v for key, v in rec.items() if key != CHECK_FIELD}
        elif signed:
            raise OutputError(f"search log {path}, line {line}: the record has no checksum "
                              f"(edited by hand or damaged): {todo}")
        out.append(rec)
    return out


def check_header(head: dict[str, Any], space: ConfigSpace, seed: int, path: Path,
                 measured_with: Mapping[str, str] | None = None,
                 prior_mean: str | None = None) -> None:
    """Check that the header ``head`` of the log at ``path`` belongs to this search.

    Args:
        head: The log's header record.
        space: This search's configuration space.
        seed: This search's seed.
        path: The log file (for the messages).
        measured_with: How this search's measurements are made (``log_header``); a
            log that recorded other values, or none where this search has some, is
            another search's (a log of eager runs does not resume a graph-captured one).
        prior_mean: The digest of this search's prior mean (``None``: it has none); a log
            started from another prior mean, or from none, chose its batches from other
            predictions and is another search's.

    Raises:
        OutputError: for another format or version, or another partition, GPU, space,
            seed or ``measured_with`` (an OutputError is a ValueError).
    """
    if head.get("format") != LOG_FORMAT:
        raise OutputError(f"{path} is not a kareus search log: {REMEDY}")
    if head.get("version") != LOG_VERSION:
        raise OutputError(f"search log {path} has version {head.get('version')!r:.20}; this "
                          f"kareus reads version {LOG_VERSION}: {REMEDY}")
    mine = {"partition": space.partition.name, "gpu": space.gpu.name,
            "space": space_description(space), "seed": seed}
    for key, value in mine.items():
        if head.get(key) != value:
            raise OutputError(f"search log {path} belongs to another search: its {key} is "
                              f"{head.get(key)!r:.80}, this search's is {value!r:.80}")
    theirs = head.get("measured_with") or {}
    ours = dict(measured_with or {})
    if theirs != ours:
        said = f"its measured_with is {theirs!r:.80}" if theirs else "it records no measured_with"
        raise OutputError(f"search log {path} was measured another way: {said}, this "
                          f"search's is {ours!r:.80}: {REMEDY}")
    logged = head.get("prior_mean")
    theirs_digest = logged.get("digest") if isinstance(logged, dict) else None
    if theirs_digest != prior_mean:
        said = (f"from the prior mean {logged.get('source')!r:.60} (digest {theirs_digest})"
                if isinstance(logged, dict) else "without a prior mean")
        ours_said = "none" if prior_mean is None else f"digest {prior_mean}"
        raise OutputError(f"search log {path} was started {said}; this search's prior mean is "
                          f"{ours_said}: {REMEDY}")
