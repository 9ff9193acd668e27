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
