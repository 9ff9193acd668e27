"""docs/integrations.md's torchtitan recipe, run as written: the CPU smoke test of
torchtitan 0.3's Trainer through kareus's entry point (``-m kareus.testing.torchtitan_cpu``,
which calls ``kareus.integrations.torchtitan.main``, torchtitan's own entry point with
``wrap_trainer``), two ranks over gloo."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan")

from kareus.testing.torchtitan_cpu import trainer_runs_here

REPO = Path(__file__).resolve().parents[2]
_WHY = trainer_runs_here()


def _smoke_command() -> list[str]:
    """The documented command (a ``bash`` block running ``-m kareus.testing.torchtitan_cpu``),
    its line continuations joined."""
    text = (REPO / "docs" / "integrations.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    cmd = [b for b in blocks if "-m kareus.testing.torchtitan_cpu" in b]
    assert len(cmd) == 1, "docs/integrations.md: one CPU smoke-test command"
    return shlex.split(cmd[0].replace("\\\n", " "))


def test_the_documented_entry_points_parse():
    cmd = _smoke_command()
    assert cmd[0] == "OMP_NUM_THREADS=1" and cmd[1] == "torchrun"
    text = (REPO / "docs" / "integrations.md").read_text()
    assert "-m kareus.integrations.torchtitan --plan plan.json" in text


@pytest.mark.slow
@pytest.mark.skipif(_WHY is not None, reason=f"torchtitan's Trainer: {_WHY}")
def test_the_documented_cpu_smoke_test_trains(tmp_path):
    cmd = _smoke_command()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "torch.distributed.run",
            *[str(tmp_path / "tt-assets") if a == "tt-assets" else a for a in cmd[2:]]]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=900, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "Training completed" in out, out[-3000:]
    # two steps, each logged with its loss (torchtitan's metrics line)
    assert len(re.findall(r"step:\s*2\b", out)) >= 1, out[-3000:]


def test_the_documented_optimize_command_describes_the_trainer_s_workload():
    # the `kareus optimize --torchtitan-args` block: its torchtitan flags give the workload
    # the documented training command runs (the same flags, 8 ranks)
    from torchtitan.config import ConfigManager

    from kareus.integrations.torchtitan import workload_from_torchtitan_config

    text = (REPO / "docs" / "integrations.md").read_text()
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
              if "--torchtitan-args" in b]
    assert len(blocks) == 1
    cmd = shlex.split(blocks[0].replace("\\\n", " "))
    flags = shlex.split(cmd[cmd.index("--torchtitan-args") + 1])
    gpus = int(cmd[cmd.index("--gpus") + 1])
    recompute = cmd[cmd.index("--recompute") + 1]
    wl = workload_from_torchtitan_config(ConfigManager().parse_args(flags), world_size=gpus,
                                         selective_as=recompute)
    assert (wl.parallelism.tp, wl.parallelism.sp, wl.recompute) == (8, True, "selective")
    assert wl.chained_layers is False  # the Trainer's blocks are FSDP-wrapped: one by one
    assert wl.model.hidden == 4096 and wl.model.layers == 32
    train = [b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
             if "-m kareus.integrations.torchtitan --plan" in b]
    assert len(train) == 1
    for flag in flags:  # the training command runs with the same flags
        assert flag in train[0], flag
