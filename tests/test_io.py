"""kareus._io: atomic JSON writes and typed, one-line errors for bad files."""

from __future__ import annotations

import json
import math
import os

import pytest

from kareus._io import dumps, read_json, write_json_atomic, write_text_atomic
from kareus.errors import PlanError


def test_dumps_ends_with_a_newline_and_refuses_nan():
    assert dumps({"a": 1}, indent=None) == '{"a": 1}\n'
    with pytest.raises(ValueError):
        dumps({"a": math.nan})
    with pytest.raises(ValueError):
        dumps([math.inf])


def test_write_json_atomic_round_trips_and_leaves_no_temporary(tmp_path):
    path = write_json_atomic(tmp_path / "r.json", {"time_s": 1.5, "names": ["a", "b"]})
    assert path == tmp_path / "r.json"
    assert read_json(path, error=PlanError) == {"time_s": 1.5, "names": ["a", "b"]}
    write_json_atomic(path, {"time_s": 2.0})  # replaces the old file
    assert json.loads(path.read_text()) == {"time_s": 2.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_write_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    path = tmp_path / "shared.json"
    path.write_text("{}")
    os.chmod(path, 0o640)
    write_text_atomic(path, '{"a": 1}\n')
    assert path.stat().st_mode & 0o777 == 0o640


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "plan.json"
    write_json_atomic(path, {"old": True})
    with pytest.raises(ValueError):
        write_json_atomic(path, {"bad": math.nan})  # refused before anything is written
    with pytest.raises(TypeError):
        write_text_atomic(path, 3)  # type: ignore[arg-type]  # fails while writing
    assert json.loads(path.read_text()) == {"old": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


@pytest.mark.parametrize(("content", "said"), [
    (None, "does not exist"),
    (b"\xff\xfe", "not UTF-8"),
    (b"{not json", "not valid JSON"),
    (b'{"x": NaN}', "not valid JSON"),
    (b"[1, 2]", "JSON list, not an object"),
])
def test_bad_files_raise_the_given_error_in_one_line(tmp_path, content, said):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(PlanError, match=said) as info:
        read_json(path, error=PlanError, what="plan")
    assert "\n" not in str(info.value)
    assert str(path) in str(info.value)


def test_folders_and_large_files_are_refused(tmp_path):
    with pytest.raises(PlanError, match="is a folder"):
        read_json(tmp_path, error=PlanError)
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"x": "y" * 100}))
    with pytest.raises(PlanError, match="over the 50-byte limit"):
        read_json(path, error=PlanError, max_bytes=50)


def test_a_non_object_is_read_when_allowed(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert read_json(path, error=PlanError, expect_object=False) == [1, 2]


def test_writing_onto_a_folder_or_into_a_missing_one_names_the_path_not_a_temporary(tmp_path):
    from kareus.errors import KareusError, OutputError

    with pytest.raises(OutputError, match="is a folder, not a file") as err:
        write_text_atomic(tmp_path, "{}\n")
    assert str(tmp_path) in str(err.value) and ".tmp" not in str(err.value)
    with pytest.raises(OutputError, match="does not exist; create it first") as err:
        write_text_atomic(tmp_path / "no" / "plan.json", "{}\n")
    assert isinstance(err.value, KareusError) and ".tmp" not in str(err.value)
    assert list(tmp_path.iterdir()) == []
