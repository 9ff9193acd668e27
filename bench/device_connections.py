"""``CUDA_DEVICE_MAX_CONNECTIONS=1`` against the default, with kareus's overlap, on one GPU.

Megatron-LM's scripts set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware work queue per
device, so that its communication kernels are issued before the computation queued after
them). kareus overlaps a collective with independent computation by launching it on a side
stream at a chosen slot; with one connection every stream's kernels share one queue, so
the question is what the setting costs kareus's schedules.

The variable is read when the CUDA context is created, so each setting runs in its own
process: ``bench/planned_layers.py`` (the planned layers of ``kareus.integrations``, one
node per layer and one for the stack, eager and replayed from their own graphs, under the
sequential, nanobatching and kareus schedules) runs ``--repeats`` times per setting, the
settings interleaved (default, 1, default, 1, ...). Per row the table gives the median
iteration time under each setting over the repeats' medians and their ratio (1 / default).

On one GPU the group is stood in for by the loopback collective (a copy through HBM on
the collective's SMs), so this measures the queueing cost of the setting for kareus's
launch order, not the real collective's overlap on several GPUs.

Usage (one CUDA GPU; clocks are never changed)::

    python bench/device_connections.py --rows 4:4x4096 --repeats 2 \
        --json bench/results/device_connections_h200.json

Prints a table and writes JSON (``--json``): every run's rows and the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
SETTINGS = ("default", "1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="4:4x4096", help="as bench/planned_layers.py --rows")
    ap.add_argument("--modes", default="layers,stack,layers+graphs,stack+graphs",
                    help="as bench/planned_layers.py --modes")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per run")
    ap.add_argument("--repeats", type=int, default=2, help="runs per setting, interleaved")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--extra", default="", help="more arguments for planned_layers.py "
                                                "(e.g. '--device cpu --tiny' for a smoke run)")
    return ap.parse_args(argv)


def _run(setting: str, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    env = dict(os.environ)
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    if setting != "default":
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = setting
    cmd = [sys.executable, str(_REPO / "bench" / "planned_layers.py"), "--rows", args.rows,
           "--modes", args.modes, "--rounds", str(args.rounds), "--json", str(out),
           *args.extra.split()]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    rows: list[dict[str, Any]] = json.loads(out.read_text())["rows"]
    return rows


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["layers"], row["microbatch_size"], row["seq_len"], row["mode"],
            row["schedule"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for setting in SETTINGS:
                rows = _run(setting, args, Path(tmp) / f"{setting}-{rep}.json")
                runs.append({"setting": setting, "repeat": rep, "rows": rows})
                print(f"run {rep} CUDA_DEVICE_MAX_CONNECTIONS={setting}: {len(rows)} rows",
                      flush=True)
    table: dict[tuple[Any, ...], dict[str, list[float]]] = {}
    busy: dict[tuple[Any, ...], dict[str, list[float]]] = {}
    for run in runs:
        for row in run["rows"]:
            table.setdefault(_key(row), {s: [] for s in SETTINGS})[run["setting"]].append(
                row["iteration_s"])
            if row.get("busy") is not None:
                busy.setdefault(_key(row), {s: [] for s in SETTINGS})[run["setting"]].append(
                    row["busy"])
    out_rows = []
    print(f"{'rows':>10} {'mode':<14} {'schedule':<13} {'default ms':>10} {'=1 ms':>8} "
          f"{'ratio':>6} {'busy d/1':>10}")
    for key, by in table.items():
        d, one = statistics.median(by["default"]), statistics.median(by["1"])
        b = busy.get(key)
        bd = statistics.median(b["default"]) if b and b["default"] else None
        b1 = statistics.median(b["1"]) if b and b["1"] else None
        out_rows.append({"layers": key[0], "microbatch_size": key[1], "seq_len": key[2],
                         "mode": key[3], "schedule": key[4], "default_s": d, "one_s": one,
                         "ratio": one / d, "busy_default": bd, "busy_one": b1})
        bt = f"{bd:.3f}/{b1:.3f}" if bd is not None and b1 is not None else "n/a"
        print(f"{key[0]:>3}:{key[1]}x{key[2]:<5} {key[3]:<14} {key[4]:<13} {d * 1e3:>10.2f} "
              f"{one * 1e3:>8.2f} {one / d:>6.3f} {bt:>10}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": "python bench/device_connections.py " + " ".join(argv or sys.argv[1:]),
            "date": datetime.date.today().isoformat(),
            "collective": "loopback (one GPU stands in for the group)",
            "rows": out_rows, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
