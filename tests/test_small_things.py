"""The command line's version, logging and progress; the frontier plot; wording."""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest

from kareus import _logging
from kareus._version import __version__
from kareus.cli import main
from kareus.model.workload import Workload


def _small(tmp_path, *extra: str) -> list[str]:
    return ["optimize", "--workload", "qwen3-1.7b", "--gpu", "h200-sxm", "--tp", "2",
            "--pp", "2", "--microbatches", "4", "--microbatch-size", "2", "--seq-len", "1024",
            "--budget", "8", "--out", str(tmp_path / "out"), *extra]


@pytest.fixture(autouse=True)
def _restore_kareus_logger():
    """main() installs a handler on the kareus logger; leave the logger as found."""
    root = logging.getLogger("kareus")
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"kareus {__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", __version__)


def test_library_logs_only_through_a_null_handler(capsys):
    root = logging.getLogger("kareus")
    root.handlers[:] = [h for h in root.handlers if not isinstance(h, _logging._CliHandler)]
    assert any(isinstance(h, logging.NullHandler) for h in root.handlers)
    _logging.get_logger("kareus.exec.frequency").warning("nobody configured logging")
    assert capsys.readouterr().err == ""  # no lastResort output from a library
    with pytest.raises(ValueError, match="under 'kareus'"):
        _logging.get_logger("other")


def test_cli_handler_follows_stderr(monkeypatch):
    handler = _logging.configure(1)
    for _ in range(2):  # a new stderr each time, the old one closed (as pytest does)
        out = io.StringIO()
        monkeypatch.setattr(sys, "stderr", out)
        _logging.get_logger("kareus.workflow").info("to the stderr of now")
        assert out.getvalue() == "kareus: INFO: to the stderr of now\n"
        out.close()
    assert handler.stream is sys.stderr


def test_configure_levels_and_replaces_its_handler():
    root = logging.getLogger("kareus")
    out = io.StringIO()
    _logging.configure(0, stream=out)
    log = _logging.get_logger("kareus.search")
    log.info("hidden")
    log.warning("shown %d", 1)
    _logging.configure(2, stream=out)
    log.debug("debug shown")
    assert sum(isinstance(h, _logging._CliHandler) for h in root.handlers) == 1
    assert out.getvalue().splitlines() == ["kareus: WARNING: shown 1",
                                           "kareus: DEBUG: debug shown"]


def test_trigger_fallback_to_polling_is_logged(caplog):
    from kareus.exec.frequency import DryRunFrequencyController, StreamOrderedTrigger

    with caplog.at_level(logging.WARNING, logger="kareus"):
        trig = StreamOrderedTrigger(DryRunFrequencyController())
        trig.close()
    if trig.mechanism == "hostfn":  # pragma: no cover - only where the extension builds
        pytest.skip("the host-function extension is available here")
    (rec,) = [r for r in caplog.records if r.name == "kareus.exec.frequency"]
    assert rec.levelno == logging.WARNING and "event polling" in rec.getMessage()
    assert trig.fallback_reason in rec.getMessage()


def test_cli_verbose_logs_resume_and_progress_lines_in_a_pipe(tmp_path, capsys):
    """stderr under pytest is not a terminal: progress comes as plain lines, composition
    included; -v (before or after the command) logs the resumed searches."""
    assert main(_small(tmp_path)) == 0
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert any(re.match(r"fwd_mlp on h200-sxm \[#+\] 8/8 \d+s front \d+ pts", ln)
               for ln in lines)
    assert any(ln.startswith("composing 5 systems ") and ln.endswith(" done") for ln in lines)
    assert "\r" not in err and "INFO" not in err
    assert main(["-v", *_small(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert re.search(r"kareus: INFO: resuming the search of fwd_mlp on h200-sxm from .*"
                     r"search-fwd_mlp\.jsonl: 8 measurements replayed", err)
    assert main([*_small(tmp_path, "--quiet"), "-vv"]) == 0
    err = capsys.readouterr().err
    assert "INFO: resuming" in err and "composing 5 systems" not in err


def test_show_says_1_sm_not_1_sms():
    from kareus.model.config import ScheduleConfig

    assert str(ScheduleConfig(freq_mhz=1410, comm_sms=1, launch_slot=None)) == \
        "1410 MHz, 1 SM, sequential"
    assert "4 SMs" in str(ScheduleConfig(freq_mhz=1410, comm_sms=4, launch_slot=None))


# -- the frontier plot --------------------------------------------------------------------
@pytest.fixture(scope="module")
def result():
    pytest.importorskip("matplotlib")
    from kareus.workflow import optimize

    wl = Workload.preset("qwen3-1.7b", tp=4, cp=2, pp=2, microbatch_size=16, seq_len=4096,
                         num_microbatches=8)
    return optimize(wl, "a100-40gb", budget=8, seed=0, progress=False)


def test_plot_saves_to_the_given_path(result, tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    ax = result.plot(tmp_path / "f.pdf")
    assert (tmp_path / "f.pdf").read_bytes().startswith(b"%PDF")
    assert not (tmp_path / "kareus-frontier.png").exists()
    # the long title is wrapped, so it ends inside the figure
    fig = ax.figure
    fig.canvas.draw()
    box = ax.title.get_window_extent()
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width and "\n" in ax.title.get_text()


def test_plot_in_a_script_saves_and_says_where(result, tmp_path, monkeypatch, capsys):
    import matplotlib
    import matplotlib.pyplot as plt

    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    plt.ioff()
    result.plot()
    assert (tmp_path / "kareus-frontier.png").stat().st_size > 1000
    assert str(tmp_path / "kareus-frontier.png") in capsys.readouterr().err


def test_plot_in_an_interactive_session_only_draws(result, tmp_path, monkeypatch):
    import matplotlib
    import matplotlib.pyplot as plt

    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    plt.ion()
    try:
        ax = result.plot()
    finally:
        plt.ioff()
    assert len(ax.lines) >= 5 and not list(tmp_path.iterdir())
    fig, ax2 = plt.subplots()
    assert result.plot(ax=ax2) is ax2 and not list(tmp_path.iterdir())
    plt.close("all")


def test_device_choice_of_the_energy_meter_is_logged(caplog):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "exec"))
    try:
        from fake_nvml import FakeNVML
    finally:
        sys.path.pop(0)
    from kareus.profilers.nvml import EnergyMeter

    with caplog.at_level(logging.INFO, logger="kareus"):
        EnergyMeter(device_indices=[0, 1], nvml=FakeNVML(2), poll_interval_s=0.001)
    assert "energy meter on NVML GPU(s) 0, 1, polled every 1.00 ms" in caplog.text
