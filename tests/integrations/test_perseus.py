"""A plan's per-rank, per-microbatch frequencies in Perseus's schedule format."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from kareus.compose.plan import Plan
from kareus.errors import PlanError
from kareus.integrations.perseus import (
    frequency_schedules,
    optimizer_arguments,
    rank_schedules,
    read_point_solution,
    stage_of_rank,
    stage_schedules,
    write_point_solution,
)
from kareus.model.pipeline import get_schedule
from kareus.model.workload import Workload
from kareus.workflow import optimize


@pytest.fixture(scope="module")
def plan() -> Plan:
    wl = Workload.preset("qwen3-1.7b", tp=2, cp=2, pp=2, dp=2, microbatch_size=4,
                         num_microbatches=4)
    res = optimize(wl, budget=8, seed=0, progress=False, systems=["kareus", "perseus"])
    # The lowest-energy kareus plan: it runs several clocks.
    return res.kareus.points[-1].plan


def test_stage_lists_follow_the_pipeline_order(plan: Plan) -> None:
    stages = stage_schedules(plan)
    sched = get_schedule(plan.schedule, plan.num_stages, plan.num_microbatches)
    assert len(stages) == plan.num_stages == 2
    for s, order in enumerate(sched.stage_orders):
        assert len(stages[s]) == 2 * plan.num_microbatches
        assert stages[s] == [({"fwd": "forward", "bwd": "backward"}[c.phase], plan.freq_mhz(c))
                             for c in order]
    # 1F1B on the first of two stages: one warm-up forward, then alternating.
    assert [name for name, _ in stages[0][:4]] == ["forward", "forward", "backward", "forward"]
    assert [name for name, _ in stages[1][:2]] == ["forward", "backward"]


def test_ranks_take_their_stage_in_megatron_order(plan: Plan) -> None:
    ranks = rank_schedules(plan)  # TP=2, CP=2, DP=2 from the plan's workload
    assert len(ranks) == 16
    stages = stage_schedules(plan)
    assert all(ranks[r] == stages[r // 8] for r in range(16))
    assert stage_of_rank(9, tp=2, cp=2, dp=2) == 1
    assert len(rank_schedules(plan, tp=1, cp=1, dp=1)) == 2
    with pytest.raises(PlanError, match="pass tp="):
        rank_schedules(attrs.evolve(plan, workload=None))


def test_server_json_round_trips(plan: Plan) -> None:
    scheds = json.loads(json.dumps(frequency_schedules(plan)))
    assert [s["rank"] for s in scheds] == list(range(16))
    assert all(isinstance(f, int) and name in ("forward", "backward")
               for s in scheds for name, f in s["frequencies"])
    assert [tuple(x) for x in scheds[15]["frequencies"]] == stage_schedules(plan)[1]


@pytest.mark.parametrize("per", ["stage", "rank"])
def test_solution_file_is_one_literal(plan: Plan, tmp_path: Path, per: str) -> None:
    path = write_point_solution(plan, tmp_path / "kareus_freqs.py", per=per)
    want = stage_schedules(plan) if per == "stage" else rank_schedules(plan)
    assert read_point_solution(path) == want
    # Perseus's PointSolution reads the file with eval(): the same value comes out.
    assert eval(path.read_text(encoding="utf-8")) == want  # a literal we wrote
    assert plan.digest[:12] in path.read_text().splitlines()[0]


def test_bad_requests(plan: Plan, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ending in .py"):
        write_point_solution(plan, tmp_path / "freqs.json")
    with pytest.raises(ValueError, match="per must be"):
        write_point_solution(plan, tmp_path / "f.py", per="gpu")
    with pytest.raises(TypeError, match="kareus Plan"):
        stage_schedules({"gpu": "a100-40gb"})  # type: ignore[arg-type]
    (tmp_path / "x.py").write_text("__import__('os').getcwd()\n")
    with pytest.raises(ValueError, match="not a Perseus solution literal"):
        read_point_solution(tmp_path / "x.py")


def test_cp_is_folded_into_dp_for_zeus(plan: Plan) -> None:
    # TP=2, CP=2, DP=2, PP=2: Zeus registers TP 2, DP 4 (CP x DP), PP 2, 16 ranks
    args = [optimizer_arguments(plan, r) for r in range(16)]
    job = {k: args[0][k] for k in ("dp_degree", "pp_degree", "tp_degree", "world_size")}
    assert job == {"dp_degree": 4, "pp_degree": 2, "tp_degree": 2, "world_size": 16}
    assert all(a["world_size"] == a["dp_degree"] * a["pp_degree"] * a["tp_degree"]
               for a in args)
    # Megatron order tp-cp-dp-pp: rank = tp_rank + 2 * (cp_rank + 2 * (dp_rank + 2 * pp_rank))
    for r, a in enumerate(args):
        tp_rank, cp_rank, dp_rank, pp_rank = r % 2, (r // 2) % 2, (r // 4) % 2, r // 8
        assert (a["rank"], a["tp_rank"], a["pp_rank"]) == (r, tp_rank, pp_rank)
        assert a["dp_rank"] == dp_rank * 2 + cp_rank
    # every (tp_rank, pp_rank) pair has one rank per folded DP rank
    seen = {(a["tp_rank"], a["dp_rank"], a["pp_rank"]) for a in args}
    assert len(seen) == 16
    # without CP nothing is folded; degrees given explicitly
    a = optimizer_arguments(plan, 5, tp=2, cp=1, dp=2)
    assert a == {"rank": 5, "dp_rank": 0, "pp_rank": 1, "tp_rank": 1, "dp_degree": 2,
                 "pp_degree": 2, "tp_degree": 2, "world_size": 8}
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 16\)"):
        optimizer_arguments(plan, 16)
    with pytest.raises(ValueError, match="rank must be"):
        optimizer_arguments(plan, -1)
    with pytest.raises(PlanError, match="pass cp="):
        optimizer_arguments(attrs.evolve(plan, workload=None), 0, tp=2)


def test_tp_pp_dp_mapping_lays_stages_out_inside_replicas(plan: Plan) -> None:
    # --use-tp-pp-dp-mapping (tp-cp-ep-pp-dp): rank = tp + 2 (cp + 2 (pp + 2 dp))
    mapped = attrs.evolve(plan, workload={**(plan.workload or {}),
                                          "rank_order": "tp-cp-ep-pp-dp"})
    stages = stage_schedules(plan)
    ranks = rank_schedules(mapped)
    assert all(ranks[r] == stages[(r // 4) % 2] for r in range(16))
    for r, a in enumerate(optimizer_arguments(mapped, x) for x in range(16)):
        tp_rank, cp_rank, pp_rank, dp_rank = r % 2, (r // 2) % 2, (r // 4) % 2, r // 8
        assert (a["tp_rank"], a["pp_rank"], a["dp_rank"]) == (tp_rank, pp_rank,
                                                              dp_rank * 2 + cp_rank)
    assert stage_of_rank(4, tp=2, cp=2, dp=2, pp=2, rank_order="tp-cp-ep-pp-dp") == 1
    with pytest.raises(ValueError, match="needs pp="):
        stage_of_rank(4, tp=2, rank_order="tp-cp-ep-pp-dp")
    with pytest.raises(ValueError, match="rank_order must be one of"):
        stage_of_rank(4, tp=2, rank_order="pp-tp")


def test_perseus_server_reads_the_file(plan: Plan, tmp_path: Path) -> None:
    # Runs where Zeus's frequency server is installed (zeus[pfo-server]: fastapi, lowtime,
    # torch, pydantic 1.x); checked with zeus 0.16.0: both schedulers loaded kareus's files
    # and handed out these lists to a job registered with CP folded into DP.
    sched_mod = pytest.importorskip("zeus.optimizer.pipeline_frequency.server.scheduler")
    common = pytest.importorskip("zeus.optimizer.pipeline_frequency.common")
    path = write_point_solution(plan, tmp_path / "kareus_freqs.py")
    args = [optimizer_arguments(plan, r) for r in range(16)]
    job = common.JobInfo(**{k: args[0][k] for k in
                            ("pp_degree", "dp_degree", "tp_degree", "world_size")})
    ranks = [common.RankInfo(**{k: a[k] for k in ("rank", "dp_rank", "pp_rank", "tp_rank")},
                             available_frequencies=[1410]) for a in args]
    settings = common.PFOServerSettings(scheduler="PointSolution3D", dump_data=False)
    got = sched_mod.PointSolution3D(job, ranks, settings, solution_path=str(path))
    by_rank = {s.rank: list(s.frequencies) for s in got.next_schedule()}
    assert by_rank == dict(enumerate(rank_schedules(plan)))
