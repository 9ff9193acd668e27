"""The README job alone and beside busy processes: how much a shared CPU slows kareus.

On a shared machine kareus competes for cores. The GP surrogate fits and predicts with one
BLAS thread (threadpoolctl), so that its many small linear-algebra calls do not spin
threads against the neighbours. This benchmark runs the README job (``kareus optimize``,
emulated, in a fresh output folder each time) alternately alone and beside ``--busy``
processes that keep one core busy each (numpy matrix products on one BLAS thread, as a
neighbouring analysis job would), interleaved in one run so that drift of
the machine touches both arms alike, and reports the median wall times and their ratio
(target: at most 1.5).

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
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args(argv)

    alone: list[float] = []
    beside: list[float] = []
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
                finally:
                    for h in hogs:
                        h.terminate()
                    for h in hogs:
                        h.wait()
                (alone if arm == "alone" else beside).append(wall)
                figures.append(systems)
                loads.append(os.getloadavg()[0])
                print(f"run {r + 1}/{args.repeats} {arm:5s}: {wall:6.1f} s (load average "
                      f"{loads[-1]:.1f})", flush=True)
    ratio = statistics.median(beside) / statistics.median(alone)
    same = all(f == figures[0] for f in figures)
    print()
    print(f"README job, median of {args.repeats}: alone {statistics.median(alone):.1f} s, "
          f"beside {args.busy} busy processes {statistics.median(beside):.1f} s: "
          f"ratio {ratio:.2f} (target <= 1.5); figures identical across runs: {same}")
    result = {
        "what": "README job (kareus optimize, emulated) alone and beside busy processes, "
                "interleaved",
        "command": README_JOB, "busy_processes": args.busy, "repeats": args.repeats,
        "alone_s": alone, "beside_busy_s": beside,
        "median_alone_s": statistics.median(alone),
        "median_beside_busy_s": statistics.median(beside),
        "ratio": ratio, "target_ratio": 1.5, "figures_identical": same,
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
