"""The README job alone and beside busy processes: how much a shared CPU slows kareus.

On a shared machine kareus competes for cores. The GP surrogate fits and predicts with one
BLAS thread (threadpoolctl), so that its many small linear-algebra calls do not spin
threads against the neighbours. This benchmark runs the README job (``kareus optimize``,
emulated, in a fresh output folder each time) alternately alone and beside ``--busy``
processes that keep one core busy each (numpy matrix products on one BLAS thread, as a
neighbouring analysis job would), interleaved in one run so that drift of
the machine touches both arms alike, and reports the median wall times and their ratio
(target: at most 1.5). A control, a single-threaded loop that needs a fixed amount of CPU
time and does no I/O, runs right after the job in each arm: its ratio is what the machine
does to any single-threaded process beside the same busy ones.

Usage::

    python bench/busy_cpu.py --json bench/results/busy_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

README_JOB = ["optimize", "--workload", "qwen3-1.7b", "--gpu", "a100-40gb", "--tp", "4",
              "--cp", "2", "--pp", "2", "--microbatches", "8", "--microbatch-size", "16",
              "--seq-len", "4096", "--quiet"]

# Each busy process keeps one core busy (a BLAS library with its default threads would make
# each of them as many threads as there are cores).
_ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_HOG = """
import time, numpy as np
a = np.random.default_rng(0).random((512, 512))
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    a = a @ a
    a /= np.abs(a).max()
"""


# The control: a single-threaded pure-Python loop with no I/O that needs a fixed amount of
# one core's time. Beside the same busy processes it shows what the machine itself does to
# any single-threaded job: with three tasks on two cores, fair sharing gives it 2/3 of a
# core (1.5x); more where the virtual CPUs share physical cores, caches or memory bandwidth.
def _run_control(cpu_s: float) -> float:
    """Wall time of a loop that needs ``cpu_s`` seconds of one core (measured alone it is
    ``cpu_s``; the loop stops by the process's CPU clock, so beside busy processes it runs
    longer in wall time)."""
    code = (f"import time\nend = time.process_time() + {cpu_s!r}\nn = 0\n"
            "while time.process_time() < end:\n    n += sum(i * i for i in range(10000))\n")
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.monotonic() - t0


def _run_job(folder: Path) -> tuple[float, dict]:
    out = folder / "out"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kareus", *README_JOB, "--out", str(out)],
                          capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the README job failed: {proc.stderr.strip()[-500:]}")
    systems = json.loads((out / "results.json").read_text())["systems"]
    return wall, systems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per arm (default 3)")
    ap.add_argument("--busy", type=int, default=2, help="busy processes (default 2)")
    ap.add_argument("--control-cpu-s", type=float, default=5.0,
                    help="CPU seconds of the control loop (default 5)")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args(argv)

    alone: list[float] = []
    beside: list[float] = []
    control_alone: list[float] = []
    control_beside: list[float] = []
    figures = []
    loads: list[float] = []  # other users of the machine show here; interleaving shares them
    with tempfile.TemporaryDirectory(prefix="kareus-busy-") as tmp:
        for r in range(args.repeats):
            for arm in ("alone", "busy"):
                hogs = []
                if arm == "busy":
                    hogs = [subprocess.Popen([sys.executable, "-c", _HOG.format(seconds=600)],
                                             env={**os.environ, **_ONE_THREAD})
                            for _ in range(args.busy)]
                    time.sleep(1.0)  # let them load the CPU first
                try:
                    wall, systems = _run_job(Path(tmp) / f"{arm}-{r}")
                    control = _run_control(args.control_cpu_s)
                finally:
                    for h in hogs:
                        h.terminate()
                    for h in hogs:
                        h.wait()
                (alone if arm == "alone" else beside).append(wall)
                (control_alone if arm == "alone" else control_beside).append(control)
                figures.append(systems)
                loads.append(os.getloadavg()[0])
                print(f"run {r + 1}/{args.repeats} {arm:5s}: {wall:6.1f} s, control "
                      f"{control:5.1f} s (load average {loads[-1]:.1f})", flush=True)
    ratio = statistics.median(beside) / statistics.median(alone)
    control_ratio = statistics.median(control_beside) / statistics.median(control_alone)
    same = all(f == figures[0] for f in figures)
    print()
    print(f"README job, median of {args.repeats}: alone {statistics.median(alone):.1f} s, "
          f"beside {args.busy} busy processes {statistics.median(beside):.1f} s: "
          f"ratio {ratio:.2f} (target <= 1.5); figures identical across runs: {same}")
    print(f"control (a single-threaded loop of {args.control_cpu_s:.0f} CPU-s, no I/O), same "
          f"conditions: alone {statistics.median(control_alone):.1f} s, beside "
          f"{statistics.median(control_beside):.1f} s: ratio {control_ratio:.2f}; kareus / "
          f"control {ratio / control_ratio:.2f}")
    result = {
        "what": "README job (kareus optimize, emulated) alone and beside busy processes, "
                "interleaved",
        "command": README_JOB, "busy_processes": args.busy, "repeats": args.repeats,
        "alone_s": alone, "beside_busy_s": beside,
        "median_alone_s": statistics.median(alone),
        "median_beside_busy_s": statistics.median(beside),
        "ratio": ratio, "target_ratio": 1.5, "figures_identical": same,
        "control": {"what": "single-threaded pure-Python loop needing a fixed CPU time, no "
                            "I/O, run right after the job in the same arm",
                    "cpu_s": args.control_cpu_s, "alone_s": control_alone,
                    "beside_busy_s": control_beside, "ratio": control_ratio},
        "ratio_over_control": ratio / control_ratio,
        "load_average_1min_after_each_run": loads,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
