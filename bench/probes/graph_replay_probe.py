"""Why a graphed partition can take longer than its GPU-only time: graph length, queueing
and clocks, side by side, on one GPU.

``bench/host_bound.py`` compares each partition's graphed time (replays of a two-step
CUDA graph, back to back) with its GPU-only time (eager steps enqueued behind a sleeping
kernel). Where the two differ, three causes are possible: the host does not keep up with
the replays (then longer graphs, or replays queued behind a sleep, would close the gap);
the graph itself costs the GPU more than the same kernels launched on streams (then
queued replays stay slow too); or the windows ran at different SM clocks (the H200's
power limit lowers the clock on long dense work). This probe separates them for a few
partitions, each with the collective at its first launch slot and with none:

* ``gpu_only``: eager steps queued behind a sleeping kernel (as host_bound.py);
* ``compute_q``: the computation alone, queued the same way;
* ``eager_b2b``: eager steps back to back;
* ``gN_q``: replays of an N-step graph (N = 1, 2, 8), queued behind a sleeping kernel;
* ``gN_b2b``: the same replays back to back.

Times are microseconds per step, medians of ``--rounds`` interleaved rounds; the mean SM
clock of each back-to-back window is recorded (NVML).

Usage (one GPU; changes no GPU setting)::

    python bench/probes/graph_replay_probe.py --json bench/probes/results/graph_replay_probe_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for host_bound
import host_bound as hb  # the same timing helpers

# (preset, tp, cp, microbatch, partitions)
PROBES: list[tuple[str, int, int, int, tuple[str, ...]]] = [
    ("qwen3-1.7b", 4, 2, 8, ("fwd_attn_out_ag", "fwd_attn_in_ag", "fwd_attn_out_ar")),
    ("llama3.2-3b", 4, 1, 8, ("fwd_mlp",)),
    ("llama3.3-70b", 8, 1, 8, ("fwd_attn",)),
]
LENGTHS = (1, 2, 8)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--steps", type=int, default=16, help="steps per timing")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    return ap.parse_args(argv)


def _first(fn: Any, *a: Any) -> float:
    return float(fn(*a)[0])


def _per(n: int, fn: Any, *a: Any) -> float:
    return float(fn(*a)[0]) / n


def probe(args: argparse.Namespace, torch: Any, clocks: Any) -> list[dict[str, Any]]:
    from kareus.exec.executor import TorchExecutor
    from kareus.exec.torch_partition import runnable_partitions
    from kareus.exec.train import LoopbackGroupCollective
    from kareus.model.config import ScheduleConfig
    from kareus.model.gpu import get_gpu
    from kareus.model.workload import Workload

    gpu = get_gpu("h200-sxm")
    rows = []
    for preset, tp, cp, mbs, names in PROBES:
        wl = Workload.preset(preset, tp=tp, cp=cp, microbatch_size=mbs, seq_len=4096,
                             nanobatches=2)
        parts = runnable_partitions(wl)
        for name in names:
            part = parts[name]
            kind = part.comm_op.kind.value
            size = cp if kind in ("all_gather", "reduce_scatter") else tp
            for first_slot in (True, False):
                coll = LoopbackGroupCollective(group_size=size)
                ex = TorchExecutor(collective=coll, graphs=True)
                prog = part.build(collective=coll)
                slot = (part.slots[0].name if part.slots else None) if first_slot else None
                cfg = ScheduleConfig(gpu.max_clock_mhz, gpu.default_comm_sms, slot)

                def step(prog: Any = prog, cfg: Any = cfg, kind: str = kind,
                         ex: Any = ex) -> None:
                    ex.run_partition(prog.ops, prog.op_names, prog.comm_tensor, cfg,
                                     comm_kind=kind, comm_output=prog.comm_output)
                    prog.advance()

                def plain(prog: Any = prog) -> None:
                    prog.run_plain()
                    prog.advance()

                def steps(n: int, step: Any = step) -> None:
                    for _ in range(n):
                        step()

                graphs = {n: ex.capture(f"{name}:{slot}:{n}", [partial(steps, n)], warmup=1)
                          for n in LENGTHS}
                steps(3)
                timings: list[tuple[str, Any]] = [
                    ("gpu_only", partial(_first, hb._queued_time_s, torch, step, args.steps)),
                    ("compute_q", partial(_first, hb._queued_time_s, torch, plain, args.steps)),
                    ("eager_b2b", partial(hb._timed_s, torch, step, args.steps, 1))]
                for n, g in graphs.items():
                    calls = max(1, args.steps // n)
                    timings.append((f"g{n}_q", partial(_per, n, hb._queued_time_s, torch,
                                                       g.replay, calls)))
                    timings.append((f"g{n}_b2b", partial(hb._timed_s, torch, g.replay, calls,
                                                         n)))
                res: dict[str, list[float]] = {}
                mhz: dict[str, list[float]] = {}
                for _ in range(args.rounds):
                    for key, fn in timings:
                        t, m = clocks.mean_mhz(fn)
                        res.setdefault(key, []).append(t)
                        if m is not None:
                            mhz.setdefault(key, []).append(m)
                med = {k: statistics.median(v) * 1e6 for k, v in res.items()}
                row = {"workload": f"{preset} tp{tp}" + (f"cp{cp}" if cp > 1 else ""),
                       "partition": name, "slot": slot, "us": med,
                       "sm_mhz": {k: statistics.median(v) for k, v in mhz.items()},
                       "rounds_us": {k: [x * 1e6 for x in v] for k, v in res.items()}}
                rows.append(row)
                print(f"{row['workload']:16s} {name:16s} slot={str(slot):10s} "
                      + " ".join(f"{k}={v:7.1f}" for k, v in med.items()), flush=True)
                del graphs, prog, ex
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch = hb.cuda_torch("graph_replay_probe.py")
    if torch is None:
        return 2
    out: dict[str, Any] = {
        "bench": "graph_replay_probe",
        "command": " ".join(["python", "bench/probes/graph_replay_probe.py", *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": "1x H200" if "H200" in torch.cuda.get_device_name() else
        torch.cuda.get_device_name(), **hb._versions(),
        "method": __doc__.split("Usage")[0].strip(),
        "rows": probe(args, torch, hb.ClockSampler()),
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
