"""The search log: header, appended records, reading back a killed search's log."""

from __future__ import annotations

import json

import pytest

from kareus.search._log import (
    CHECK_FIELD,
    LOG_FORMAT,
    LOG_VERSION,
    append_record,
    check_header,
    log_header,
    read_log,
    record_checksum,
    space_description,
)


def test_header_describes_the_search(small_space):
    head = log_header(small_space, seed=5, batch_size=8, budget=40, initial_size=16)
    assert head["kind"] == "header" and head["format"] == LOG_FORMAT
    assert head["version"] == LOG_VERSION and head["kareus_version"]
    assert head["partition"] == "fwd_attn" and head["gpu"] == "a100-40gb"
    assert (head["seed"], head["batch_size"], head["budget"], head["initial_size"]) == \
        (5, 8, 40, 16)
    assert head["space"] == space_description(small_space)
    assert head["space"]["comm_sms"] == [1, 2, 4, 8, 16, 32]
    assert head["created_utc"].endswith("Z")
    json.dumps(head)  # JSON-serialisable as written


def test_records_round_trip_and_a_torn_last_line_is_cut(small_space, tmp_path):
    path = tmp_path / "s.jsonl"
    head = log_header(small_space, seed=1, batch_size=8, budget=16, initial_size=16)
    append_record(path, head)
    append_record(path, {"kind": "ask", "batch": 1, "configs": [], "passes": []})
    whole = path.read_text()
    assert read_log(path) == [head, {"kind": "ask", "batch": 1, "configs": [], "passes": []}]
    with open(path, "a") as f:
        f.write('{"kind":"tell","n":1,"con')  # killed while writing
    assert len(read_log(path)) == 2
    assert path.read_text() == whole  # truncated after the last whole record


def test_corrupt_or_headerless_logs_are_rejected(small_space, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"kind": "header"}\nnot json\n{"kind": "ask"}\n')
    with pytest.raises(ValueError, match="corrupt at line 2"):
        read_log(path)
    path.write_text('{"kind": "tell"}\n')
    with pytest.raises(ValueError, match="no header"):
        read_log(path)


def test_header_of_another_search_is_rejected(small_space, tmp_path):
    path = tmp_path / "a.jsonl"
    head = log_header(small_space, seed=1, batch_size=8, budget=16, initial_size=16)
    check_header(head, small_space, 1, path)  # its own search: accepted
    with pytest.raises(ValueError, match="seed"):
        check_header(head, small_space, 2, path)
    with pytest.raises(ValueError, match="space"):
        check_header(head, small_space.restrict(comm_sms=[1, 2, 4]), 1, path)
    with pytest.raises(ValueError, match="version"):
        check_header({**head, "version": LOG_VERSION + 1}, small_space, 1, path)
    with pytest.raises(ValueError, match="not a kareus search log"):
        check_header({**head, "format": "other"}, small_space, 1, path)


def test_space_description_names_backends_only_when_there_are_several(small_space):
    from kareus.model import ConfigSpace

    # A space of one backend is described as before (older logs still resume) ...
    assert set(space_description(small_space)) == {"freqs_mhz", "comm_sms", "slots"}
    # ... a space of several names them, so a log of another backend set is refused.
    two = ConfigSpace(small_space.partition, "a100-40gb", freqs_mhz=[1410],
                      comm_sms=[4, 8], backends=["own", "nccl_capped"])
    assert space_description(two)["backends"] == ["own", "nccl_capped"]
    head = log_header(two, seed=0, batch_size=8, budget=8, initial_size=8)
    with pytest.raises(ValueError, match="space"):
        check_header(head, ConfigSpace(small_space.partition, "a100-40gb", freqs_mhz=[1410],
                                       comm_sms=[4, 8], backends=["own"]), 0, "log.jsonl")


def test_records_reach_the_os_at_once_and_the_disk_once_a_second(tmp_path, monkeypatch):
    import json

    import kareus.search._log as log_mod

    synced: list[int] = []
    clock = [100.0]
    monkeypatch.setattr(log_mod.os, "fsync", lambda fd: synced.append(fd))
    monkeypatch.setattr(log_mod.time, "monotonic", lambda: clock[0])
    path = tmp_path / "search-x.jsonl"
    for i in range(10):  # within one second: the first record syncs, the rest wait
        log_mod.append_record(path, {"kind": "tell", "i": i})
    assert len(synced) == 1
    # every line is in the file already (a killed process loses nothing)
    assert [json.loads(ln)["i"] for ln in path.read_text().splitlines()] == list(range(10))
    clock[0] += log_mod.SYNC_INTERVAL_S
    log_mod.append_record(path, {"kind": "tell", "i": 10})
    assert len(synced) == 2
    log_mod.append_record(path, {"kind": "tell", "i": 11}, sync=True)
    log_mod.append_record(path, {"kind": "tell", "i": 12}, sync=False)
    log_mod.sync_log(path)
    assert len(synced) == 4


def _signed_log(small_space, path):
    from kareus.search import MultiPassSearch
    from kareus.testing import FakeProfiler

    MultiPassSearch(small_space, budget=16, batch_size=8, seed=5, log=path).run(FakeProfiler())
    return path.read_text().splitlines()


def test_every_record_carries_a_checksum_that_read_log_leaves_out(small_space, tmp_path):
    path = tmp_path / "s.jsonl"
    lines = _signed_log(small_space, path)
    assert all(record_checksum(json.loads(x)) == json.loads(x)[CHECK_FIELD] for x in lines)
    assert all(CHECK_FIELD not in r for r in read_log(path))


def test_a_number_edited_by_hand_is_refused_naming_file_and_line(small_space, tmp_path):
    from kareus.errors import OutputError
    from kareus.search import MultiPassSearch

    path = tmp_path / "s.jsonl"
    lines = _signed_log(small_space, path)
    k = next(i for i, x in enumerate(lines) if json.loads(x)["kind"] == "tell")
    rec = json.loads(lines[k])
    rec["measurement"]["time_s"] *= 0.5  # a hand edit: a faster measurement than was made
    lines[k] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(OutputError) as err:
        MultiPassSearch(small_space, budget=16, batch_size=8, seed=5, resume=path)
    msg = str(err.value)
    assert f"{path}, line {k + 1}" in msg and "checksum" in msg and "\n" not in msg
    assert "delete that line" in msg and "fresh=True" in msg and "--" not in msg
    rec.pop(CHECK_FIELD)  # dropping the checksum as well does not hide the edit
    lines[k] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(OutputError, match=f"line {k + 1}: the record has no checksum"):
        read_log(path)
    del lines[k]  # what the message says to do: the search measures that point again
    path.write_text("\n".join(lines) + "\n")
    from kareus.testing import FakeProfiler

    resumed = MultiPassSearch(small_space, budget=16, batch_size=8, seed=5, resume=path)
    resumed.run(FakeProfiler())
    assert resumed.n_measured == 16


def test_logs_written_before_checksums_still_load(small_space, tmp_path):
    from kareus.search import MultiPassSearch

    path = tmp_path / "s.jsonl"
    lines = _signed_log(small_space, path)
    old = []
    for x in lines:
        rec = json.loads(x)
        rec.pop(CHECK_FIELD)
        old.append(json.dumps(rec))
    path.write_text("\n".join(old) + "\n")
    s = MultiPassSearch(small_space, budget=16, batch_size=8, seed=5, resume=path)
    assert s.n_measured == sum(json.loads(x)["kind"] == "tell" for x in lines)
