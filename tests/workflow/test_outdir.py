"""kareus.workflow.outdir (and kareus._io's path checks): early path checks, the manifest of inputs and the folder lock."""

from __future__ import annotations

import json
import os

import pytest

from kareus._io import check_output_file, check_output_folder
from kareus.errors import FolderInUseError, OutputError
from kareus.workflow.outdir import LOCK_NAME, MANIFEST_NAME, guarded_folder, is_held, move_aside

INPUTS = {"workload": {"model": "llama3.2-3b", "tp": 2}, "budget": 32, "seed": 0}


def test_folder_checks(tmp_path):
    assert check_output_folder(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    for empty in (None, "", "  "):
        with pytest.raises(OutputError, match="--out is empty"):
            check_output_folder(empty)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(OutputError, match="is an existing file"):
        check_output_folder(afile)
    with pytest.raises(OutputError, match="is a file, so the folder cannot be created"):
        check_output_folder(afile / "sub", what="log_dir")


def test_file_checks(tmp_path):
    assert check_output_file(tmp_path / "rec.json") == tmp_path / "rec.json"
    with pytest.raises(OutputError, match="--record is empty"):
        check_output_file("")
    with pytest.raises(OutputError, match="is a folder"):
        check_output_file(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(OutputError, match="cannot be written"):
        check_output_file(afile / "rec.json")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_places_are_refused(tmp_path):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(OutputError, match="not writable"):
            check_output_folder(locked / "out")
        with pytest.raises(OutputError, match="not writable"):
            check_output_file(locked / "rec.json")
    finally:
        locked.chmod(0o700)


def test_guarded_folder_writes_the_manifest_and_holds_the_lock(tmp_path):
    out = tmp_path / "run"
    with guarded_folder(out, INPUTS) as folder:
        assert folder == out
        assert is_held(out) and is_held(out / "logs")
        assert (out / LOCK_NAME).read_text().strip() == f"pid {os.getpid()}"
        with pytest.raises(FolderInUseError, match="in use by another kareus run"), \
                guarded_folder(out, INPUTS):
            pass
    assert not is_held(out)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["inputs"] == INPUTS
    with guarded_folder(out, INPUTS):  # the same inputs resume
        pass


def test_other_inputs_are_refused_naming_the_first_difference(tmp_path):
    out = tmp_path / "run"
    with guarded_folder(out, INPUTS):
        (out / "results.json").write_text("{}")
    other = {**INPUTS, "workload": {"model": "llama3.2-3b", "tp": 4}}
    with pytest.raises(OutputError, match=r"its workload\.tp is 2, this run's is 4"), \
            guarded_folder(out, other):
        pass
    assert (out / "results.json").exists()
    with guarded_folder(out, other, fresh=True):  # fresh discards the old results
        assert not (out / "results.json").exists()
    assert json.loads((out / MANIFEST_NAME).read_text())["inputs"] == other


def test_a_run_that_fails_before_writing_leaves_no_manifest(tmp_path):
    # An input refused inside the run (before any result or log) must not make the
    # corrected command "another job"; once something is written, the manifest stays.
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="late"), guarded_folder(out, INPUTS):
        raise ValueError("an input refused late")
    assert not (out / MANIFEST_NAME).exists()
    other = {**INPUTS, "schedule": "gpipe"}
    with guarded_folder(out, other):
        (out / "logs").mkdir()
        (out / "logs" / "search-fwd_attn.jsonl").write_text("{}\n")
    with pytest.raises(KeyboardInterrupt), guarded_folder(out, other):
        raise KeyboardInterrupt
    assert json.loads((out / MANIFEST_NAME).read_text())["inputs"] == other
    # A manifest this run did not write (a resume) is never removed.
    (out / "logs" / "search-fwd_attn.jsonl").unlink()
    with pytest.raises(ValueError), guarded_folder(out, other):
        raise ValueError("x")
    assert (out / MANIFEST_NAME).exists()


def test_results_without_a_manifest_are_refused(tmp_path):
    out = tmp_path / "old"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "search-attn_fwd.jsonl").write_text("")
    with pytest.raises(OutputError, match="without a manifest"), guarded_folder(out, INPUTS):
        pass
    with guarded_folder(out, INPUTS, fresh=True):
        assert not (out / "logs" / "search-attn_fwd.jsonl").exists()


def test_a_foreign_manifest_is_refused(tmp_path):
    out = tmp_path / "f"
    out.mkdir()
    (out / MANIFEST_NAME).write_text(json.dumps({"kind": "something-else", "version": 1}))
    with pytest.raises(OutputError, match="not a manifest this kareus reads"), \
            guarded_folder(out, INPUTS):
        pass


def test_a_corrupt_manifest_is_refused_saying_what_to_do(tmp_path):
    out = tmp_path / "f"
    out.mkdir()
    (out / MANIFEST_NAME).write_text("garbage")
    with pytest.raises(OutputError, match=r"not valid JSON.*--fresh to discard"), \
            guarded_folder(out, INPUTS):
        pass


def test_move_aside_never_overwrites(tmp_path):
    torn = tmp_path / "search.jsonl"
    torn.write_text("first")
    assert move_aside(torn) == tmp_path / "search.jsonl.torn"
    torn.write_text("second")
    assert move_aside(torn) == tmp_path / "search.jsonl.torn-1"
    assert (tmp_path / "search.jsonl.torn").read_text() == "first"
    assert (tmp_path / "search.jsonl.torn-1").read_text() == "second"
    assert not torn.exists()
