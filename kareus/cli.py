"""The ``kareus`` command.

``kareus gpus`` and ``kareus workloads`` list the presets; ``kareus optimize`` runs
the whole pipeline on a workload; ``kareus show PLAN`` prints a plan file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kareus.errors import KareusError
from kareus.model.gpu import GPU_PRESETS
from kareus.model.workload import MODEL_PRESETS

__all__ = ["main"]


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for k, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if k and _numeric(c) else c.ljust(w)
                               for c, w in zip(row, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _numeric(s: str) -> bool:
    try:
        float(s.replace(",", "").rstrip("%"))
    except ValueError:
        return False
    return True


def cmd_gpus(args: argparse.Namespace) -> int:
    rows = []
    for g in GPU_PRESETS.values():
        rows.append([g.name, g.sm_count, f"{g.min_clock_mhz}-{g.max_clock_mhz}",
                     len(g.clocks_mhz), f"{g.bf16_peak_tflops:.0f}", f"{g.hbm_bandwidth_gbps:.0f}",
                     f"{g.nvlink_bandwidth_gbps:.0f}", f"{g.power_limit_w:.0f}",
                     f"{g.static_power_w:.0f}"])
    print(_table(["gpu", "SMs", "clocks MHz", "#clocks", "bf16 TFLOP/s", "HBM GB/s",
                  "NVLink GB/s", "power limit W", "static W"], rows))
    return 0


def cmd_workloads(args: argparse.Namespace) -> int:
    rows = []
    for m in MODEL_PRESETS.values():
        rows.append([m.name, m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn, m.vocab,
                     f"{m.params / 1e9:.2f}"])
    print(_table(["workload", "layers", "hidden", "heads", "KV heads", "head dim", "FFN",
                  "vocab", "params (B)"], rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kareus",
        description="Joint communication-SM, launch-slot and GPU-frequency scheduling for "
                    "large-model training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("gpus", help="list the GPU presets")
    p.set_defaults(func=cmd_gpus)
    p = sub.add_parser("workloads", help="list the model presets")
    p.set_defaults(func=cmd_workloads)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except KareusError as exc:
        print(f"kareus: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
