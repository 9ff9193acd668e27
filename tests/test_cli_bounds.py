"""Absurd option values are refused before any work, naming the option, leaving nothing."""

from __future__ import annotations

import os

import pytest

from kareus.cli import main

BASE = ["optimize", "--workload", "qwen3-1.7b", "--tp", "2", "--pp", "2",
        "--microbatch-size", "2", "--seq-len", "1024", "--microbatches", "4", "--budget", "2"]

ABSURD = [
    ("--tp", "100000"), ("--cp", "100000"), ("--pp", "100000"), ("--dp", "100000000"),
    ("--gpus", "100000000"), ("--microbatches", "100000000"),
    ("--microbatch-size", "1000000"), ("--seq-len", "100000000000"),
    ("--nanobatches", "1000"), ("--budget", "100000000"), ("--seed", "99999999999"),
    ("--seed", "-1"), ("--deadline-s", "inf"), ("--deadline-s", "nan"),
    ("--energy-budget-j", "1e999"), ("--noise", "0.7"), ("--tp", "0"), ("--budget", "-5"),
    ("--jobs", "1000"), ("--microbatches", "2.5"),
]


def _run(argv: list[str]) -> int:
    """The command's exit status, whether argparse exits (a bad value) or main returns."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def _replace(args: list[str], option: str, value: str) -> list[str]:
    out = list(args)
    if option in out:
        out[out.index(option) + 1] = value
    else:
        out += [option, value]
    return out


@pytest.mark.parametrize(("option", "value"), ABSURD)
def test_an_absurd_value_is_refused_before_any_work(option, value, tmp_path, capsys):
    out = tmp_path / "out"
    code = _run([*_replace(BASE, option, value), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert option in err, err
    assert len(err.strip().splitlines()) <= 2, err  # a usage line at most, then one line
    assert not out.exists()  # nothing left behind


def test_a_job_of_more_gpus_than_kareus_models_names_the_degrees(tmp_path, capsys):
    out = tmp_path / "out"
    code = _run([*BASE, "--dp", "1000000", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--dp" in err and "GPUs" in err
    assert not out.exists()


def test_jobs_up_to_the_cores_run(tmp_path):
    jobs = str(min(2, os.cpu_count() or 1))
    assert main([*BASE, "--jobs", jobs, "--quiet", "--out", str(tmp_path / "o")]) == 0


def test_quiet_prints_no_start_line(tmp_path, capsys):
    assert main([*BASE, "--quiet", "--out", str(tmp_path / "o")]) == 0
    assert "optimising" not in capsys.readouterr().err


def test_no_collective_is_refused_in_the_commands_words(tmp_path, capsys):
    code = _run([*_replace(BASE, "--tp", "1"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "--tp 1 --cp 1" in err and "Workload.preset" not in err
    assert not (tmp_path / "o").exists()
