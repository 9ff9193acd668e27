"""How the emulated GPUs are fed (graph replay or eager launches) through optimize() and
`kareus optimize`: stated in the table, results.json, the manifest and the search logs."""

from __future__ import annotations

import json

import pytest

from kareus.cli import main
from kareus.errors import OutputError
from kareus.model import ConfigSpace, Workload, build_partitions
from kareus.profilers.emulator import EmulatedProfiler
from kareus.search import MultiPassSearch
from kareus.workflow import optimize


def _small(**kw):
    return Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=2, seq_len=1024,
                           num_microbatches=4, **kw)


@pytest.fixture(scope="module")
def both():
    return {x: optimize(_small(), "h200-sxm", budget=4, seed=1, progress=False, execution=x)
            for x in ("graphed", "eager")}


def test_the_mode_is_stated_in_the_table_and_results(both, tmp_path):
    assert optimize.__kwdefaults__["execution"] is None
    for mode, res in both.items():
        assert res.execution == mode
        assert res.to_dict()["execution"] == mode
        footer = next(line for line in res.table().splitlines()
                      if line.startswith("Maximum-throughput"))
        assert ("graph-captured execution" if mode == "graphed" else "eager execution") in footer
        res.save(tmp_path / mode)
        assert json.loads((tmp_path / mode / "results.json").read_text())["execution"] == mode
    default = optimize(_small(), "h200-sxm", budget=2, seed=1, progress=False)
    assert default.execution == "graphed"


def test_eager_launches_slow_the_small_model_down(both):
    """Qwen3-1.7B at microbatch 2 x 1024 tokens: partitions of tens of microseconds, shorter
    than their launches. Eagerly every system is slower; nanobatching, which launches twice
    as often, loses its lead over Megatron-LM."""
    g = {n: s.time_s for n, s in both["graphed"].systems().items()}
    e = {n: s.time_s for n, s in both["eager"].systems().items()}
    assert all(e[n] > g[n] for n in g)
    assert g["nanobatching"] < g["megatron"]
    assert e["nanobatching"] / e["megatron"] > g["nanobatching"] / g["megatron"]


def test_a_log_dir_of_one_mode_refuses_the_other(tmp_path):
    logs = tmp_path / "logs"
    optimize(_small(), "h200-sxm", budget=2, seed=1, log_dir=logs, progress=False)
    head = json.loads((logs / "search-fwd_attn.jsonl").read_text().splitlines()[0])
    assert head["measured_with"] == {"execution": "graphed"}
    with pytest.raises(OutputError, match="execution"):
        optimize(_small(), "h200-sxm", budget=2, seed=1, log_dir=logs, progress=False,
                 execution="eager")


def test_a_search_log_resumes_only_in_its_own_mode(tmp_path):
    part = build_partitions(_small())["fwd_attn"]
    space = ConfigSpace(part, "h200-sxm")
    log = tmp_path / "s.jsonl"
    MultiPassSearch(space, budget=3, seed=0, log=log,
                    measured_with={"execution": "eager"}).run(
        EmulatedProfiler("h200-sxm", execution="eager"), part)
    MultiPassSearch(space, budget=4, seed=0, resume=log, measured_with={"execution": "eager"})
    with pytest.raises(OutputError, match="measured another way: its measured_with is "
                                          r"\{'execution': 'eager'\}"):
        MultiPassSearch(space, budget=4, seed=0, resume=log,
                        measured_with={"execution": "graphed"})
    with pytest.raises(OutputError, match="measured another way"):
        MultiPassSearch(space, budget=4, seed=0, resume=log)
    # A log without the field (written before it existed, or by a profiler that does not
    # say) does not resume a search that says.
    plain = tmp_path / "p.jsonl"
    MultiPassSearch(space, budget=2, seed=0, log=plain).run(EmulatedProfiler("h200-sxm"), part)
    with pytest.raises(OutputError, match="it records no measured_with"):
        MultiPassSearch(space, budget=3, seed=0, resume=plain,
                        measured_with={"execution": "graphed"})


@pytest.mark.parametrize("given", [{"execution": "graphed"}, {"execution": "eager"},
                                   {"gpu": "h200-sxm"}, {"gpu": "a100-40gb"}])
def test_gpu_and_execution_choose_the_default_profiler_and_are_refused_beside_yours(given):
    # they configure the default emulated profiler: beside a profiler of your own they are
    # refused whether or not they agree with it (no overlap to reconcile)
    name = next(iter(given))
    with pytest.raises(ValueError, match=rf"{name}= chooses the default \(emulated\) profiler; "
                                         r"yours measures h200-sxm, eager"):
        optimize(_small(), budget=2, progress=False,
                 profiler=EmulatedProfiler("h200-sxm", execution="eager"), **given)


def test_a_gpu_name_in_another_case_is_the_same_gpu():
    result = optimize(_small(), "H200-SXM", budget=2, progress=False, systems=["megatron"])
    assert result.gpu == "h200-sxm"


def test_cli_no_graphs(tmp_path, capsys):
    args = ["optimize", "--workload", "qwen3-1.7b", "--gpu", "h200-sxm", "--tp", "2",
            "--pp", "2", "--microbatch-size", "2", "--seq-len", "1024", "--microbatches", "4",
            "--budget", "2"]
    assert main([*args, "--no-graphs", "--out", str(tmp_path / "e")]) == 0
    out = capsys.readouterr()
    assert "eager execution" in out.out and "eager execution" in out.err
    assert json.loads((tmp_path / "e" / "results.json").read_text())["execution"] == "eager"
    assert main([*args, "--out", str(tmp_path / "g")]) == 0
    assert "graph-captured execution" in capsys.readouterr().out
    # The eager folder is another job's for a graphed run.
    assert main([*args, "--out", str(tmp_path / "e")]) == 2
    assert "execution" in capsys.readouterr().err
    rc = main([*args, "--no-graphs", "--profiler", "replay:nope.json",
               "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and "--no-graphs" in err and "replays as it ran" in err
