"""kareus.errors: one hierarchy under KareusError, with the built-in type that fits and the
command line's exit status."""

from __future__ import annotations

import pytest

import kareus.errors as errors
from kareus.errors import KareusError, UnknownPresetError

#: Errors of a failing machine (exit 1); every other is a bad request (exit 2).
MACHINE_FAILURES = {"HardwareError", "FolderInUseError", "GraphCaptureError"}


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_is_a_kareus_error_and_a_builtin(name):
    cls = getattr(errors, name)
    assert issubclass(cls, KareusError)
    if cls is not KareusError:
        assert issubclass(cls, (ValueError, TypeError, RuntimeError, FileNotFoundError)), name
    assert cls.__doc__


@pytest.mark.parametrize("name", errors.__all__)
def test_exit_codes(name):
    cls = getattr(errors, name)
    assert cls.exit_code == (1 if name in MACHINE_FAILURES else 2), name


def test_bad_values_are_value_errors_hardware_is_a_runtime_error():
    assert issubclass(errors.InvalidSMCountError, errors.ConfigError)
    assert issubclass(errors.UnsupportedFrequencyError, ValueError)
    assert issubclass(errors.HardwareError, RuntimeError)
    assert not issubclass(errors.HardwareError, ValueError)


def test_unknown_preset_names_what_is_known():
    exc = UnknownPresetError("GPU", "h900", ["a100-sxm", "h200-sxm"])
    assert (exc.kind, exc.name, exc.known) == ("GPU", "h900", ("a100-sxm", "h200-sxm"))
    assert str(exc) == "unknown GPU 'h900'; known GPUs: a100-sxm, h200-sxm"
    with pytest.raises(ValueError):  # callers that catch ValueError still catch it
        raise exc


def test_argument_errors_keep_the_builtin_callers_catch():
    with pytest.raises(ValueError):
        raise errors.ArgumentError("--jobs must be >= 1")
    with pytest.raises(TypeError):
        raise errors.ArgumentTypeError("profiler must be a Profiler, got 'str'")
    with pytest.raises(FileNotFoundError):
        raise errors.MissingFileError("no such file 'x.json'")
    assert issubclass(errors.MissingFileError, OSError)


def _emulated(**kwargs):  # type: ignore[no-untyped-def]
    from kareus.profilers.emulator import EmulatedProfiler

    return EmulatedProfiler("a100-40gb", **kwargs)


def _search(**kwargs):  # type: ignore[no-untyped-def]
    from kareus import ConfigSpace, MultiPassSearch, Workload
    from kareus.model.partition import build_partitions

    pset = build_partitions(Workload.preset("qwen3-1.7b", tp=2))
    part = next(iter(pset.types.values()))
    return MultiPassSearch(ConfigSpace(part, "a100-40gb"), **kwargs)


def _select_on_empty_frontier():  # type: ignore[no-untyped-def]
    from kareus import IterationFrontier

    return IterationFrontier(points=[]).select(deadline_s=1.0)


def _bad_gpu_spec():  # type: ignore[no-untyped-def]
    import attrs

    from kareus import get_gpu

    return attrs.evolve(get_gpu("a100-40gb"), sm_count=1)


def _optimize_a_string():  # type: ignore[no-untyped-def]
    from kareus import optimize

    return optimize("qwen3-1.7b")  # type: ignore[arg-type]


def _unknown_kernels():  # type: ignore[no-untyped-def]
    from kareus.exec.kernels import get_kernels

    return get_kernels("no-such-kernels")


#: Mistakes a user makes through the public API, each with the typed error it raises and the
#: built-in that error still is (so that ``except ValueError`` keeps catching it).
USER_MISTAKES = [
    ("negative emulator noise", lambda: _emulated(noise=-1), errors.ArgumentError, ValueError),
    ("emulator on no GPUs", lambda: _emulated(group_gpus=0), errors.ArgumentError, ValueError),
    ("search budget of 0", lambda: _search(budget=0), errors.ArgumentError, ValueError),
    ("unknown initial design", lambda: _search(initial_design="sobol"), errors.ArgumentError,
     ValueError),
    ("optimize a name", _optimize_a_string, errors.ArgumentTypeError, TypeError),
    ("empty frontier", _select_on_empty_frontier, errors.InfeasibleError, ValueError),
    ("a GPU of one SM", _bad_gpu_spec, errors.ArgumentError, ValueError),
    ("unknown kernel set", _unknown_kernels, errors.ArgumentError, ValueError),
]


@pytest.mark.parametrize(("what", "call", "typed", "builtin"), USER_MISTAKES,
                         ids=[m[0] for m in USER_MISTAKES])
def test_user_mistakes_through_the_api_are_kareus_errors(what, call, typed, builtin):
    with pytest.raises(typed) as info:
        call()
    assert isinstance(info.value, KareusError) and isinstance(info.value, builtin), what
    assert info.value.exit_code == 2


def test_a_library_argument_error_reaches_the_command_as_one_line(monkeypatch, capsys):
    import kareus.cli as cli

    def command(args):  # type: ignore[no-untyped-def]
        _emulated(noise=-1)
    monkeypatch.setattr(cli, "cmd_gpus", command)
    assert cli.main(["gpus"]) == 2
    assert capsys.readouterr().err == "kareus: error: noise must be in [0, 0.5), got -1\n"


#: The bare ``raise ValueError(`` / ``raise TypeError(`` left in the library, per file: each is
#: caught and turned into a typed error by its caller (a corrupt file's field, a JSON constant)
#: or guards an internal invariant that only a kareus bug can break.
BARE_RAISES = {
    "kareus/_io.py": 1,  # json parse_constant hook: read_json turns it into its typed error
    "kareus/compose/plan.py": 1,  # the same hook of Plan.loads: it raises PlanError
    "kareus/profilers/replay.py": 4,  # a recording's bad field: ReplayProfiler raises ConfigError
    "kareus/profilers/emulator/_sim.py": 1,  # the profiler overlaps at most one collective
}


def test_every_bare_value_or_type_error_left_is_accounted_for():
    import re
    from collections import Counter
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bare = re.compile(r"raise (ValueError|TypeError)\(")
    found = Counter(path.relative_to(root).as_posix()
                    for path in (root / "kareus").rglob("*.py")
                    for line in path.read_text(encoding="utf-8").splitlines()
                    if bare.search(line))
    assert dict(found) == BARE_RAISES, ("a user-causable error raises a kareus.errors class "
                                        "(ArgumentError, ArgumentTypeError, ...), not a bare "
                                        "ValueError/TypeError")
