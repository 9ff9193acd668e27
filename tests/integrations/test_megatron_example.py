"""examples/integrations/megatron_gpt.py run as its docstring says on the CPU (``--cpu``: 2
processes, gloo, fp32, a plan made on the emulated H200): Megatron's own layers and kareus's
give the same loss at every step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "integrations" / "megatron_gpt.py"


@pytest.mark.slow
def test_the_example_trains_alike_with_megatron_s_layers_and_kareus_s():
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", str(EXAMPLE), "--cpu", "--steps", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900,
                          check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "kareus schedule, plan" in proc.stdout
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s*$", proc.stdout, re.M)
    assert [int(r[0]) for r in rows] == [0, 1, 2], proc.stdout
    own, planned = [float(r[1]) for r in rows], [float(r[2]) for r in rows]
    assert planned == pytest.approx(own, rel=1e-5)
    assert own[-1] < own[0]
