"""The whole pipeline in one call (kareus.workflow), on the noisy emulator."""

import re

import pytest

from kareus.compose import kareus_types, system_configs
from kareus.errors import ArgumentError, InfeasibleError, OutputError
from kareus.model import ConfigSpace, Workload
from kareus.workflow import iso_energy_time_saving, iso_time_energy_saving, optimize


@pytest.fixture(scope="module")
def result():
    wl = Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=2, seq_len=1024,
                         num_microbatches=4)
    return optimize(wl, "h200-sxm", budget=10, seed=1, progress=False)


def test_searches_start_from_the_baselines_configurations(result):
    types = kareus_types(result.workload)
    # kareus searches the nanobatched types and the unsplit ones (keyed <type>@n1)
    assert set(result.partition_frontiers()) == set(types)
    assert set(result.partitions.types) < set(types)
    for name, pf in result.partition_frontiers().items():
        part = types[name]
        assert pf.partition == part.name == name.split("@")[0]
        measured = {o.config for o in pf.measured()}
        anchors = system_configs(ConfigSpace(part, "h200-sxm"))
        # Megatron-LM's (sequential) and nanobatching's (first slot); unsplit: sequential only
        assert len(anchors) == (1 if name.endswith("@n1") else 2)
        assert set(anchors) <= measured
        # its own search measured at most its budget; the baselines' configurations of the
        # type (measured by them) are on its frontier too
        baselines = {o.config for n, pfs in result.composition.partitions.items()
                     if n != "kareus" for t, bpf in pfs.items() if t == pf.partition
                     for o in bpf.measured()}
        assert len(measured - baselines) <= 10


def test_kareus_is_never_slower_than_the_baselines(result):
    # kareus's space holds every baseline's configurations, its searches measure the
    # baselines' own, and every system shares one measurement per configuration.
    fastest = {n: fr.points[0].time_s for n, fr in result.frontiers.items()}
    assert fastest["kareus"] <= min(fastest["megatron"], fastest["nanobatching"]) * (1 + 1e-6)
    # The frequency-planning baselines measure lower clocks kareus's small search may skip:
    # there only measurement noise (0.25% on time) can put them ahead.
    assert fastest["kareus"] <= min(fastest.values()) * 1.01
    # Likewise in energy at Perseus's fastest time: Perseus measures every clock of its
    # (small) space, kareus's 10 profiles per type may miss the clock it picks.
    assert iso_time_energy_saving(result.kareus, result.frontiers["perseus"]) >= -0.005


def test_summaries_and_selection(result):
    systems = result.systems()
    assert list(systems) == ["megatron", "nanobatching", "perseus", "nanobatching+perseus",
                             "kareus"]
    for s in systems.values():
        assert s.total_j == pytest.approx(s.static_j + s.dynamic_j)
        assert s.static_j == pytest.approx(
            result.workload.parallelism.world_size * 78.0 * s.time_s)
    k = result.kareus
    plan = result.select(deadline_s=k.points[-1].time_s)
    assert plan.energy_j == pytest.approx(k.points[-1].energy_j)
    with pytest.raises(InfeasibleError, match="no plan meets the deadline"):
        result.select(deadline_s=k.points[0].time_s * 0.5)
    with pytest.raises(InfeasibleError, match="energy budget"):
        result.select(energy_budget_j=1.0)
    assert "kareus vs perseus" in result.table()
    assert "OptimizationResult(" in repr(result)


def test_iso_savings_by_hand():
    # The savings read only each point's time_s and energy_j.
    class _Pt:
        def __init__(self, t, e):
            self.time_s, self.energy_j = t, e

    class _Frontier:
        def __init__(self, pts):
            self.points = [_Pt(t, e) for t, e in pts]

        def __len__(self):
            return len(self.points)

    fr = _Frontier
    ref = fr([(1.0, 100.0), (2.0, 80.0)])
    sysf = fr([(0.9, 95.0), (1.0, 90.0), (1.5, 70.0)])
    assert iso_time_energy_saving(sysf, ref) == pytest.approx(0.10)  # 90 vs 100 at t <= 1.0
    assert iso_energy_time_saving(sysf, ref) == pytest.approx(0.25)  # 1.5 vs 2.0 at e <= 80
    slow = fr([(3.0, 50.0)])
    assert iso_time_energy_saving(slow, ref) is None
    assert iso_energy_time_saving(fr([(0.5, 500.0)]), ref) is None


def test_bad_budget():
    wl = Workload.preset("qwen3-1.7b", tp=2, microbatch_size=2, seq_len=1024)
    with pytest.raises(ArgumentError, match="budget"):
        optimize(wl, "h200-sxm", budget=0)


def test_surrogate_by_name_or_instance():
    from kareus.search import BootstrapEnsemble, GaussianProcessSurrogate, XGBoostSurrogate
    from kareus.workflow import resolve_surrogate

    assert resolve_surrogate(None) is None
    assert isinstance(resolve_surrogate("gp"), GaussianProcessSurrogate)
    trees = resolve_surrogate("trees", seed=3)
    assert isinstance(trees, BootstrapEnsemble) and isinstance(trees.base, XGBoostSurrogate)
    mine = XGBoostSurrogate(n_estimators=10)
    assert resolve_surrogate(mine) is mine
    with pytest.raises(ValueError, match="unknown surrogate 'forest'"):
        resolve_surrogate("forest")
    with pytest.raises(TypeError, match="surrogate must be"):
        resolve_surrogate(3)  # type: ignore[arg-type]
    wl = Workload.preset("qwen3-1.7b", tp=2, microbatch_size=2, seq_len=1024)
    with pytest.raises(ValueError, match="unknown surrogate"):
        optimize(wl, "h200-sxm", budget=8, surrogate="forest")


def test_optimize_with_the_tree_surrogate_searches_past_the_design():
    # Budget 24 > the 16-point design: the last batch is chosen on the trees' predictions.
    wl = Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=2, seq_len=1024,
                         num_microbatches=4)
    res = optimize(wl, "h200-sxm", budget=24, seed=2, progress=False, surrogate="trees")
    assert res.profiles and all(n == 24 for n in res.profiles.values())
    assert "kareus" in res.composition.frontiers


def _small_workload(**kw):
    return Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=2, seq_len=1024,
                           num_microbatches=4, **kw)


def test_log_dir_is_guarded_by_a_manifest_and_fresh_starts_again(tmp_path):
    from kareus.errors import OutputError

    logs = tmp_path / "logs"
    first = optimize(_small_workload(), "h200-sxm", budget=4, seed=1, log_dir=logs,
                     progress=False)
    assert (logs / "kareus-manifest.json").is_file()
    # the same job resumes
    again = optimize(_small_workload(), "h200-sxm", budget=4, seed=1, log_dir=logs,
                     progress=False)
    assert again.profiles == first.profiles
    # another job is refused, naming the field
    with pytest.raises(OutputError, match="its workload.seq_len is 1024, this run's is 512"):
        optimize(_small_workload().with_(seq_len=512), "h200-sxm", budget=4, seed=1,
                 log_dir=logs, progress=False)
    with pytest.raises(OutputError, match="its seed is 1"):
        optimize(_small_workload(), "h200-sxm", budget=4, seed=2, log_dir=logs,
                 progress=False)
    other = optimize(_small_workload().with_(seq_len=512), "h200-sxm", budget=4, seed=1,
                     log_dir=logs, progress=False, fresh=True)
    assert other.workload.seq_len == 512


def test_a_workload_beyond_the_gpu_memory_is_refused_with_the_numbers():
    from kareus.errors import WorkloadError

    huge = _small_workload().with_(microbatch_size=4096)
    with pytest.raises(WorkloadError, match=r"does not fit on a100-40gb: .* GiB per GPU"):
        optimize(huge, "a100-40gb", budget=4, progress=False)


def test_arguments_of_the_wrong_type_raise_type_error():
    with pytest.raises(TypeError, match="budget must be a whole number"):
        optimize(_small_workload(), "h200-sxm", budget="8", progress=False)
    with pytest.raises(TypeError, match="seed must be a whole number"):
        optimize(_small_workload(), "h200-sxm", seed=1.5, progress=False)
    with pytest.raises(TypeError, match="gpu must be a GPU preset name"):
        optimize(_small_workload(), 0, progress=False)  # not the default GPU
    with pytest.raises(TypeError, match="systems must be a list"):
        optimize(_small_workload(), "h200-sxm", systems="kareus", progress=False)
    with pytest.raises(TypeError, match="log_dir must be a folder path"):
        optimize(_small_workload(), "h200-sxm", log_dir=3, progress=False)


def test_one_set_of_defaults_for_the_api_and_the_command_line():
    """`kareus optimize --workload NAME` is optimize(Workload.preset(NAME, tp=4, pp=2)) on
    a100-40gb; Workload.preset(NAME) alone (TP = PP = 1) is refused with a message that
    names those degrees in Python's words, before the memory check (it would only say 'does
    not fit')."""
    from kareus.cli import _profiler_from_args, _workload_from_args, build_parser
    from kareus.errors import WorkloadError
    from kareus.model import Workload

    args = build_parser().parse_args(["optimize", "--workload", "qwen3-1.7b"])
    assert _workload_from_args(args) == Workload.preset("qwen3-1.7b", tp=4, pp=2)
    assert _profiler_from_args(args).gpu.name == "a100-40gb"
    with pytest.raises(WorkloadError) as info:
        optimize(Workload.preset("qwen3-1.7b"), progress=False)
    assert "Workload.preset('qwen3-1.7b', tp=4, pp=2)" in str(info.value)
    assert "kareus optimize" not in str(info.value)  # Python's words for Python
    assert "does not fit" not in str(info.value)


def test_a_negative_seed_raises_config_error_naming_seed_before_any_work(tmp_path):
    from kareus.errors import ConfigError

    with pytest.raises(ConfigError, match=r"seed must be >= 0 .*, got -1"):
        optimize(_small_workload(), "h200-sxm", seed=-1, log_dir=tmp_path / "logs",
                 progress=False)
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(("systems", "needle"), [
    ([], "systems is empty"), (["kareus", "zeus"], "unknown system(s) ['zeus']")])
def test_systems_are_checked_before_any_search(systems, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        optimize(_small_workload(), "h200-sxm", systems=systems, progress=False)


def test_an_empty_log_dir_is_refused_not_the_working_folder(tmp_path, monkeypatch):
    from kareus.errors import OutputError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputError, match="log_dir is empty"):
        optimize(_small_workload(), "h200-sxm", log_dir="", progress=False)
    assert list(tmp_path.iterdir()) == []  # nothing written into the working folder


def test_memory_accounting_by_hand():
    """bf16 weights and grads (2 + 2 B), fp32 master + Adam (12 B / DP) per parameter."""
    from kareus.model.memory import estimate_memory

    wl = Workload.preset("llama3.2-3b", tp=1, pp=1, microbatch_size=2, seq_len=128,
                         num_microbatches=1)
    est = estimate_memory(wl)
    params = wl.model.params
    assert est.weights_bytes == pytest.approx(2 * params, rel=1e-6)
    assert est.optimizer_bytes == pytest.approx(12 * params, rel=1e-6)
    dp2 = estimate_memory(wl.with_(parallelism=wl.parallelism.__class__(dp=2)))
    assert dp2.optimizer_bytes == pytest.approx(6 * params, rel=1e-6)
    # recomputation keeps far fewer activations than none
    full = estimate_memory(wl.with_(seq_len=4096, microbatch_size=8))
    none = estimate_memory(wl.with_(seq_len=4096, microbatch_size=8, recompute=False))
    assert none.activations_bytes > 3 * full.activations_bytes


def test_a_folder_made_before_the_profilers_moved_resumes(tmp_path):
    # the manifest of a folder made when the emulator lived in kareus.exec names its class by
    # that path: the same job, so the run resumes instead of refusing the folder
    import json

    wl = Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=2, seq_len=1024,
                         num_microbatches=4)
    first = optimize(wl, "h200-sxm", budget=2, progress=False, log_dir=tmp_path)
    manifest = tmp_path / "kareus-manifest.json"
    data = json.loads(manifest.read_text())
    assert data["inputs"]["profiler"]["class"] == \
        "kareus.profilers.emulator._profiler.EmulatedProfiler"
    data["inputs"]["profiler"]["class"] = "kareus.exec.emulator._profiler.EmulatedProfiler"
    manifest.write_text(json.dumps(data))
    again = optimize(wl, "h200-sxm", budget=2, progress=False, log_dir=tmp_path)
    assert again.profiles == first.profiles
    data["inputs"]["profiler"]["class"] = "kareus.exec.other.EmulatedProfiler"
    manifest.write_text(json.dumps(data))
    with pytest.raises(OutputError, match="profiler.class"):
        optimize(wl, "h200-sxm", budget=2, progress=False, log_dir=tmp_path)


def test_energies_print_with_significant_digits_below_a_kilojoule():
    from kareus.workflow.result import joules

    assert joules(13259.4) == "13,259"
    assert joules(999.5) == "999.5"
    assert joules(0.012345) == "0.01235"  # not "0"
    assert joules(0.0) == "0"


def test_a_plot_into_a_missing_folder_is_refused_in_one_line(tmp_path):
    wl = Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=2, seq_len=1024,
                         num_microbatches=4)
    result = optimize(wl, "h200-sxm", budget=2, progress=False, systems=["megatron"])
    with pytest.raises(OutputError, match="does not exist; create it"):
        result.plot(tmp_path / "missing" / "f.png")


def test_one_sequence_per_microbatch_runs_without_the_nanobatching_systems_at_cp2():
    # a microbatch of one sequence cannot be split along its batch, and along the sequence
    # only at CP=1: at CP=2 the two nanobatching systems are left out of the default five
    # (and refused by name), the rest run
    from kareus.workflow import prepare

    wl = Workload.preset("qwen3-1.7b", tp=2, cp=2, pp=2, microbatch_size=1, seq_len=1024,
                         num_microbatches=4, nanobatches=1)
    run = prepare(wl, "h200-sxm", budget=2)
    assert run.left_out == ("nanobatching", "nanobatching+perseus")
    assert run.systems == ("megatron", "perseus", "kareus")
    result = run.run(progress=False)
    assert sorted(result.frontiers) == ["kareus", "megatron", "perseus"]
    with pytest.raises(ArgumentError, match="systems: nanobatching split each microbatch"):
        prepare(wl, "h200-sxm", budget=2, systems=["megatron", "nanobatching"])


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_sequence_parallel_jobs_are_searched_and_composed_for_every_system(recompute):
    """The sequence-parallel layout's partition types (TP all-gathers and reduce-scatters,
    with CP's of the same kinds) run through search and composition like the others."""
    wl = Workload.preset("llama3.2-3b", tp=2, cp=2, pp=2, sp=True, microbatch_size=2,
                         seq_len=1024, num_microbatches=4, recompute=recompute)
    res = optimize(wl, "h200-sxm", budget=8, seed=0, progress=False)
    assert list(res.systems()) == ["megatron", "nanobatching", "perseus",
                                   "nanobatching+perseus", "kareus"]
    frontiers = res.partition_frontiers()
    assert {"fwd_attn_in_tp_ag", "fwd_attn_in_cp_ag", "bwd_attn_in_tp_rs",
            "bwd_attn_in_cp_rs", "fwd_attn_norm_ag"} <= set(frontiers)
    fastest = {n: fr.points[0].time_s for n, fr in res.frontiers.items()}
    assert fastest["kareus"] <= min(fastest["megatron"], fastest["nanobatching"]) * (1 + 1e-6)
    assert res.workload.parallelism.sequence_parallel


def test_one_sequence_per_microbatch_splits_along_the_sequence_at_cp1():
    """At CP=1 a microbatch of one sequence splits along the sequence, for kareus and the
    nanobatching baselines alike: all five systems run, and each chunk's attention is a type
    of its own (the later chunk reads the earlier one's keys and values too)."""
    from kareus.workflow import prepare

    wl = Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=1, seq_len=1024,
                         num_microbatches=4, nanobatches=1)
    run = prepare(wl, "h200-sxm", budget=2)
    assert run.left_out == () and len(run.systems) == 5
    result = run.run(progress=False)
    assert sorted(result.frontiers) == sorted(["megatron", "nanobatching", "perseus",
                                               "nanobatching+perseus", "kareus"])
    split = result.composition.partitions["nanobatching"]
    assert {"fwd_attn_c0", "fwd_attn_c1", "bwd_attn_c0", "bwd_attn_c1"} <= set(split)
