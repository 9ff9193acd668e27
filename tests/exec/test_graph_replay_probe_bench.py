"""bench/probes/graph_replay_probe.py on a CPU: its command line and its refusal without a GPU."""

from __future__ import annotations

import pytest
from bench_scripts import load_bench

probe = load_bench("probes/graph_replay_probe")


def test_command_line_and_refusal_without_a_gpu(capsys):
    args = probe.parse_args(["--steps", "8", "--rounds", "1"])
    assert (args.steps, args.rounds, args.json) == (8, 1, None)
    assert probe.LENGTHS == (1, 2, 8)
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the refusal is not reachable")
    assert probe.main([]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
