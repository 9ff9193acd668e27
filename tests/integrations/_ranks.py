"""Run a test file's worker under torchrun on the CPU and collect what each rank saved."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def run_ranks(script: str | Path, out_dir: Path, world: int, *args: str) -> list[Any]:
    """``script out_dir *args`` in ``world`` processes (``torch.distributed.run
    --standalone``: a free port of its own, so suites can run side by side); asserts they
    all exit 0 (their output tails in the message) and returns ``out_dir/rank<r>.pt`` of
    every rank, in rank order. The workers import this checkout's kareus first; the
    caller's ``PYTHONPATH`` follows (a Megatron-Core source tree put first there, for one,
    is the one the workers run)."""
    path = [str(REPO), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", str(Path(script).resolve()), str(out_dir), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
            for r in range(world)]
