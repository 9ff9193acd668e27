"""The command's failures: a KareusError is the user's to fix (one line, its exit code);
anything else is a bug, reported as an internal error whatever its type; a Ctrl-C at any
moment, from the first imports on, is one line and a non-zero status, never a traceback and
never lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kareus.cli as cli
from kareus.cli import INTERNAL_ERROR_STATUS, main
from kareus.errors import ArgumentError, HardwareError, MissingFileError, WorkloadError

ROOT = Path(__file__).resolve().parents[1]


def _failing(exc: BaseException):  # type: ignore[no-untyped-def]
    def command(args):  # type: ignore[no-untyped-def]
        raise exc
    return command


@pytest.fixture
def gpus_raising(monkeypatch):
    """``kareus gpus`` made to raise the given exception from inside the command."""
    def arm(exc: BaseException) -> None:
        monkeypatch.setattr(cli, "cmd_gpus", _failing(exc))
    return arm


@pytest.mark.parametrize("exc", [ValueError("x must be positive"),
                                 TypeError("unsupported operand"),
                                 KeyError("fwd_attn"), ZeroDivisionError("float division")])
def test_an_exception_that_is_not_a_kareus_error_is_an_internal_error(exc, gpus_raising, capsys):
    gpus_raising(exc)
    assert main(["gpus"]) == INTERNAL_ERROR_STATUS
    captured = capsys.readouterr()
    line = f"kareus: internal error: {type(exc).__name__}: "
    assert captured.err.startswith(line) and captured.err.count("\n") == 1
    assert "please report it" in captured.err and "python -X dev -m kareus" in captured.err
    assert "arguments refused" not in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize(("exc", "status"), [
    (ArgumentError("--jobs is for emulated runs"), 2),
    (WorkloadError("--tp 3 does not divide 16 heads"), 2),
    (MissingFileError("--profiler replay:x.json: no such file 'x.json'"), 2),
    (HardwareError("NVML: insufficient permissions"), 1),
])
def test_a_kareus_error_is_one_line_and_its_exit_code(exc, status, gpus_raising, capsys):
    gpus_raising(exc)
    assert main(["gpus"]) == status
    assert capsys.readouterr().err == f"kareus: error: {exc}\n"


def test_an_os_error_is_the_machines_one_line(gpus_raising, capsys):
    gpus_raising(OSError(28, "No space left on device"))
    assert main(["gpus"]) == 1
    assert capsys.readouterr().err == "kareus: error: [Errno 28] No space left on device\n"


def test_dev_mode_shows_the_traceback_of_a_bug(tmp_path):
    code = ("import sys, kareus.cli as c\n"
            "def boom(args): raise ValueError('deep inside')\n"
            "c.cmd_gpus = boom\n"
            "sys.exit(c.main(['gpus']))\n")
    out = subprocess.run([sys.executable, "-X", "dev", "-c", code], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0
    assert "kareus: internal error: ValueError: deep inside" in out.stderr
    assert "Traceback" in out.stderr


@pytest.mark.parametrize("argv", [
    ["optimize", "--profiler", "bogus", "--out", "{tmp}/o"],
    ["optimize", "--profiler", "replay:{tmp}/missing.json", "--out", "{tmp}/o"],
    ["optimize", "--jobs", "2", "--profiler", "nvml", "--out", "{tmp}/o"],
    ["optimize", "--deadline-s", "1", "--energy-budget-j", "5", "--out", "{tmp}/o"],
    ["optimize", "--gpu-profile", "h200-sxm", "--profiler", "nvml", "--out", "{tmp}/o"],
])
def test_the_commands_own_refusals_are_kareus_errors(argv, tmp_path, capsys):
    status = main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("kareus: error: ") and "internal error" not in err


@pytest.mark.parametrize("value", ["-1", "nan", "0.5", "x"])
def test_noise_out_of_range_is_refused_by_the_parser(value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["optimize", "--workload", "qwen3-1.7b", "--noise", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kareus: error: argument --noise: ") and err.count("\n") == 1


@pytest.mark.usefixtures("ctrl_c_delivered")
def test_a_stop_swallowed_by_the_command_still_fails(gpus_raising, monkeypatch, capsys):
    """A Ctrl-C whose exception something caught and dropped (a broad except, a finaliser)
    is not a success: the command reports it when it returns."""
    def swallowing(args):  # type: ignore[no-untyped-def]
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs between bytecodes
                pass
        except BaseException:  # what a careless plug-in might do
            pass
        print("done")
        return 0

    monkeypatch.setattr(cli, "cmd_gpus", swallowing)
    assert main(["gpus"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "kareus: interrupted\n"


@pytest.mark.usefixtures("ctrl_c_delivered")
def test_a_stop_turned_into_another_exception_is_a_stop(monkeypatch, capsys):
    """numpy's import reports a stop that lands inside its C initialisation as an
    ImportError ("PyCapsule_Import could not import module datetime"): a failure after a
    stop is the stop's one line, even while the parser is built."""
    def build_parser():  # type: ignore[no-untyped-def]
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
        except BaseException:
            raise ImportError("PyCapsule_Import could not import module 'datetime'") from None
        raise AssertionError("the signal was not delivered")

    monkeypatch.setattr(cli, "build_parser", build_parser)
    assert main(["gpus"]) == 130
    assert capsys.readouterr().err == "kareus: interrupted\n"


def test_a_failure_while_the_parser_is_built_is_one_line(monkeypatch, capsys):
    def build_parser():  # type: ignore[no-untyped-def]
        raise ImportError("numpy is broken")

    monkeypatch.setattr(cli, "build_parser", build_parser)
    assert main(["gpus"]) == INTERNAL_ERROR_STATUS
    assert capsys.readouterr().err.startswith("kareus: internal error: ImportError: numpy is")


@pytest.mark.usefixtures("ctrl_c_delivered")
def test_a_stop_that_lands_in_a_finaliser_is_delivered_again(monkeypatch, capsys):
    """Python only prints an exception raised in a ``__del__``; the command's hook sends the
    stop to the main thread again, so the command stops there, not at its end."""
    reached = []

    class Finalised:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass

    def command(args):  # type: ignore[no-untyped-def]
        obj = Finalised()
        del obj  # the stop is raised inside __del__ and reported as unraisable there
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # where the stop is delivered again
            pass
        reached.append("after")
        return 0

    monkeypatch.setattr(cli, "cmd_gpus", command)
    assert main(["gpus"]) == 130
    assert reached == []
    captured = capsys.readouterr()
    assert captured.err == "kareus: interrupted\n"


def test_a_ctrl_c_while_the_command_modules_load_is_one_line():
    """entry() imports the command inside its guard: a KeyboardInterrupt raised by the
    imports (before the command's handlers exist) is the usual line and status 130."""
    code = ("import sys\n"
            "class Interrupting:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'kareus.cli':\n"
            "            raise KeyboardInterrupt\n"
            "sys.meta_path.insert(0, Interrupting())\n"
            "from kareus.__main__ import entry\n"
            "sys.exit(entry())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert (out.returncode, out.stderr) == (130, "kareus: interrupted\n")


def test_console_main_keeps_the_handlers_for_the_rest_of_the_process():
    code = ("import os, signal, sys, kareus.cli as c\n"
            "status = c.console_main()\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"  # the command is over: nothing to stop
            "for _ in range(1000): pass\n"
            "sys.exit(status)\n")
    out = subprocess.run([sys.executable, "-c", code, "gpus"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stderr == "" and "a100-40gb" in out.stdout


def test_the_command_asks_cublas_for_no_workspace_unless_the_user_set_one():
    """The ``kareus`` process sets ``CUBLAS_WORKSPACE_CONFIG=:0:0`` before anything runs
    (no memset node per GEMM in a graph: kareus.exec._graphs); a value the user set is
    kept."""
    import os

    code = ("import os, sys, kareus.cli as c\n"
            "status = c.console_main()\n"
            "print(os.environ.get('CUBLAS_WORKSPACE_CONFIG'), "
            "os.environ.get('CUBLASLT_WORKSPACE_SIZE'))\n"
            "sys.exit(status)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")}
    for given, want in ((None, ":0:0 0"), (":4096:8", ":4096:8 None")):
        run_env = env if given is None else {**env, "CUBLAS_WORKSPACE_CONFIG": given}
        out = subprocess.run([sys.executable, "-c", code, "gpus"], capture_output=True,
                             text=True, timeout=120, env=run_env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == want


def _handlers_in_place(pid: int) -> bool:
    """Whether the process catches SIGTERM, which only the command's handlers do."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # it has exited (or there is no /proc; the caller skips then)
    caught = int(next(line for line in status.splitlines()
                      if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.15, 0.3, 0.5, 0.8])
def test_an_early_ctrl_c_is_one_line_never_a_traceback_never_lost(tmp_path, delay_s):
    """SIGINT early in ``python -m kareus optimize``: while it imports, sets up or starts to
    search. Either the run stops with one line and status 130, or (on a fast machine, if it
    had already written its results when the signal was sent) it succeeds; never a
    traceback, and never a success when the signal came before the results.

    The delay counts from the moment the command's handlers are in place (the interpreter's
    own start-up, before any of kareus runs, is outside what kareus can guard); the window
    before that, the command's imports, is covered by the test above.
    """
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "kareus", "optimize", "--workload", "qwen3-1.7b", "--gpu",
            "h200-sxm", "--tp", "2", "--pp", "2", "--microbatches", "4", "--microbatch-size",
            "2", "--seq-len", "1024", "--budget", "12", "--quiet", "--out", str(out)]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not _handlers_in_place(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(delay_s)
    results_before = (out / "results.json").exists()
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
    lines = stderr.splitlines()
    assert all(line.startswith("kareus: ") for line in lines), stderr
    if proc.returncode == 0:
        assert results_before, "a SIGINT sent before the results were written was lost"
    else:
        assert proc.returncode == 130, stderr
        assert lines and lines[-1].startswith("kareus: interrupted"), stderr


def test_a_library_remedy_is_said_in_the_commands_words():
    from kareus.cli import _cli_words

    assert _cli_words("delete the log, or start again with optimize(..., fresh=True)") == \
        "delete the log, or start again with --fresh"
