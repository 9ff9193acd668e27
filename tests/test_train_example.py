"""examples/train_torchrun.py on the CPU: arguments, the committed plan, and the order in
which its schedules enqueue ops and collectives (on a recording fake device, no torch)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kareus.compose.plan import Plan
from kareus.errors import PlanError
from kareus.exec.executor import RecordingStreamBackend, TorchExecutor
from kareus.exec.frequency import FrequencyTrigger
from kareus.exec.torch_partition import PartitionProgram
from kareus.model.partition import build_partitions
from kareus.model.pipeline import get_schedule
from kareus.testing import RecordingCollective

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_torchrun.py"
PLAN = ROOT / "examples" / "plans" / "llama3b_tp2_h200.json"


@pytest.fixture(scope="module")
def ex_mod():
    spec = importlib.util.spec_from_file_location("train_torchrun", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------ arguments


def test_help_runs_without_torch():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--plan", "--steps", "--dry-run-clocks", "--make-plan",
                 "--allow-clock-changes"):
        assert flag in out.stdout


def test_defaults(ex_mod):
    a = ex_mod.parse_args([])
    assert a.clocks == "dry-run" and not a.allow_clock_changes
    assert a.steps == 20 and a.plan == PLAN
    assert a.schedules == ["megatron", "nanobatching", "kareus"]
    assert ex_mod.parse_args(["--dry-run-clocks", "--steps", "3"]).steps == 3


def test_real_clocks_refused_without_permission(ex_mod, capsys):
    with pytest.raises(SystemExit) as exc:
        ex_mod.parse_args(["--nvml-clocks"])
    assert exc.value.code == 2
    assert "--allow-clock-changes" in capsys.readouterr().err
    a = ex_mod.parse_args(["--nvml-clocks", "--allow-clock-changes"])
    assert a.clocks == "nvml"
    with pytest.raises(SystemExit):
        ex_mod.parse_args(["--nvml-clocks", "--dry-run-clocks"])


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--layers", "0"], ["--slack", "-1"],
                                 ["--schedules", "kareus,nope"],
                                 ["--schedules", "kareus,kareus"]])
def test_bad_arguments_exit(ex_mod, bad):
    with pytest.raises(SystemExit):
        ex_mod.parse_args(bad)


# ------------------------------------------------------------------ the plan


def test_committed_plan_loads_with_its_workload(ex_mod):
    plan, wl = ex_mod.load_plan(PLAN)
    assert plan.digest == json.loads(PLAN.read_text())["digest"]
    assert (wl.parallelism.tp, wl.parallelism.pp, wl.nanobatches) == (2, 1, 2)
    assert (wl.microbatch_size, wl.seq_len, wl.model.name) == (8, 4096, "llama3.2-3b")
    assert set(plan.partition_configs()) == set(build_partitions(wl).types)


def test_plan_without_workload_or_tampered_is_refused(ex_mod, tmp_path):
    d = json.loads(PLAN.read_text())
    d["workload"] = None
    d.pop("digest")
    p = tmp_path / "noworkload.json"
    p.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="workload"):
        ex_mod.load_plan(p)
    d = json.loads(PLAN.read_text())
    d["choices"][0]["configs"]["fwd_attn"]["comm_sms"] += 1
    p.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="digest"):
        ex_mod.load_plan(p)


def test_context_parallel_plan_is_refused_with_what_to_do(ex_mod, tmp_path):
    d = json.loads(PLAN.read_text())
    d["workload"]["cp"] = 2
    d.pop("digest")
    p = tmp_path / "cp2.json"
    p.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="CP=1.*TP-only"):
        ex_mod.load_plan(p)


def test_make_plan_writes_a_loadable_plan(ex_mod, tmp_path, capsys):
    pytest.importorskip("xgboost")
    out = tmp_path / "plan.json"
    args = ex_mod.parse_args(["--make-plan", "--plan", str(out), "--budget", "6",
                              "--microbatches", "2"])
    made = ex_mod.make_plan(args)
    plan, wl = ex_mod.load_plan(out)
    assert plan.digest == made.digest and wl.num_microbatches == 2
    assert "saved" in capsys.readouterr().out


# ------------------------------------------------------------------ schedules


def test_segment_order_follows_nanobatches_and_recompute(ex_mod):
    _, wl = ex_mod.load_plan(PLAN)
    pset = build_partitions(wl)
    assert ex_mod.segment_order(pset, "fwd", 2, True) == [
        "fwd_attn", "fwd_attn", "fwd_mlp", "fwd_mlp"]
    assert ex_mod.segment_order(pset, "bwd", 2, True) == [
        "fwd_attn", "fwd_attn", "fwd_mlp", "fwd_mlp",
        "bwd_mlp", "bwd_mlp", "bwd_attn", "bwd_attn"]
    assert ex_mod.segment_order(pset, "bwd", 1, False) == ["bwd_mlp", "bwd_attn"]


class FakeCollective(RecordingCollective):
    def __init__(self, dev, tag):
        super().__init__()
        self.dev, self.tag = dev, tag

    def all_reduce(self, tensor, stream, sms):
        self.dev.launch(f"{self.tag}[{sms}]:{tensor}", stream)
        return tensor


class FakeTrigger(FrequencyTrigger):
    def __init__(self):
        self.requests = []

    def request(self, freq_mhz, *, stream=None):
        self.requests.append(freq_mhz)
        return len(self.requests)


def _setup(ex_mod, layers=2):
    plan, wl = ex_mod.load_plan(PLAN)
    dev = RecordingStreamBackend()

    def programs(pset):
        return {name: PartitionProgram(
            op_names=[o.name for o in p.compute_ops],
            ops=[dev.op(f"{name}:{o.name}") for o in p.compute_ops],
            comm_kind="all_reduce", buffers=[f"{name}#0", f"{name}#1"])
            for name, p in pset.types.items()}

    pset, full = build_partitions(wl), build_partitions(wl.with_(nanobatches=1))
    order = {ph: ex_mod.segment_order(pset, ph, 2, True) * layers for ph in ("fwd", "bwd")}
    full_order = {ph: ex_mod.segment_order(full, ph, 1, True) * layers
                  for ph in ("fwd", "bwd")}
    trig = FakeTrigger()
    capped, default = FakeCollective(dev, "capped"), FakeCollective(dev, "nccl")
    ex = TorchExecutor(plan=plan, collective=capped, default_collective=default, streams=dev,
                       frequency=trig, digest_exchange=lambda d: [d, d])
    base = TorchExecutor(collective=capped, default_collective=default, streams=dev)
    ex.start()
    comps = list(get_schedule("1f1b", 1, plan.num_microbatches).stage_orders[0])
    kw = dict(computations=comps, plan_executor=ex, baseline_executor=base,
              progs=programs(pset), full_progs=programs(full), order=order,
              full_order=full_order)
    return plan, dev, trig, comps, order, full_order, kw


def _host_order(dev):
    """(stream, what) of every launch, in host order."""
    return [(e[1], e[2]) for e in dev.log if e[0] == "launch"]


def test_plan_schedule_follows_the_plan(ex_mod):
    plan, dev, trig, comps, order, _, kw = _setup(ex_mod)
    ex_mod.run_iteration("kareus", **kw)
    # one clock request per computation, with the plan's clocks, in order
    assert trig.requests == [plan.freq_mhz(c) for c in comps]
    log = dev.log
    comms = [j for j, e in enumerate(log) if e[0] == "launch" and e[1] == "comm"]
    # every segment's output is reduced once: n-1 overlapped + the exposed last one
    assert len(comms) == sum(len(order[c.phase]) for c in comps)
    overlapped = exposed = 0
    for j in comms:
        assert log[j + 1][:2] == ("record", "comm")
        after = log[j + 2] if j + 2 < len(log) else None
        if after is not None and after[:2] == ("launch", "compute"):
            kind, op = after[2].split(":")
            (cfg,) = plan.partition_configs()[kind]  # one config per type in this plan
            assert op == cfg.launch_slot  # launched right before the plan's slot op
            assert log[j][2].startswith(f"capped[{cfg.comm_sms}]:")
            overlapped += 1
        else:  # the last collective of a computation: exposed, the compute stream waits
            assert after == ("wait", "compute", log[j + 1][2])
            exposed += 1
    assert exposed == len(comps)
    assert overlapped == len(comms) - len(comps)


def test_each_compute_waits_for_the_collective_before_it_moves_on(ex_mod):
    _, dev, _, comps, _, _, kw = _setup(ex_mod, layers=1)
    ex_mod.run_iteration("kareus", **kw)
    # every record on the comm stream is waited for by the compute stream
    comm_records = [e[2] for e in dev.log if e[0] == "record" and e[1] == "comm"]
    waited = {e[2] for e in dev.log if e[0] == "wait" and e[1] == "compute"}
    assert comm_records and set(comm_records) <= waited


def test_baselines(ex_mod):
    _, dev, trig, comps, order, full_order, kw = _setup(ex_mod, layers=1)
    ex_mod.run_iteration("megatron", **kw)
    seq = _host_order(dev)
    comms = [i for i, (s, _) in enumerate(seq) if s == "comm"]
    assert len(comms) == sum(len(full_order[c.phase]) for c in comps)
    for i in comms:  # sequential: after the segment's last op, NCCL's own CTAs
        assert seq[i][1].startswith("nccl[None]")
        kind = seq[i - 1][1].split(":")[0]
        assert seq[i - 1][1] == f"{kind}:{kw['full_progs'][kind].op_names[-1]}"
    dev.log.clear()
    ex_mod.run_iteration("nanobatching", **kw)
    seq = _host_order(dev)
    comms = [i for i, (s, _) in enumerate(seq) if s == "comm"]
    assert len(comms) == sum(len(order[c.phase]) for c in comps)
    for i in comms:  # launched with the next segment's first op (or last: exposed)
        assert seq[i][1].startswith("nccl[None]")
        if i + 1 < len(seq) and seq[i + 1][0] == "compute":
            kind = seq[i + 1][1].split(":")[0]
            assert seq[i + 1][1].split(":")[1] in (kw["progs"][kind].op_names[0],)
    assert trig.requests == []  # baselines never ask for a clock
    with pytest.raises(ValueError):
        ex_mod.run_iteration("other", **kw)


def test_plan_digest_mismatch_stops_before_any_collective(ex_mod):
    plan, _ = ex_mod.load_plan(PLAN)
    dev = RecordingStreamBackend()
    ex = TorchExecutor(plan=plan, collective=FakeCollective(dev, "c"), streams=dev,
                       digest_exchange=lambda d: [d, "0" * 64])
    with pytest.raises(PlanError, match="different plans"):
        ex.start()
    assert dev.log == []
    assert isinstance(plan, Plan)


def test_programs_take_their_buffers_from_the_executors_backend(ex_mod):
    """main() builds the programs with the executor's backend, so a backend with
    ``empty`` (OwnKernelCollective) hands out every communication buffer."""
    torch = pytest.importorskip("torch")
    from kareus.model.workload import ModelArch, Parallelism, Workload

    class AllocatingBackend(RecordingCollective):
        def __init__(self):
            super().__init__()
            self.given = []

        def all_reduce(self, tensor, stream, sms):
            return tensor

        def empty(self, shape, dtype):
            t = torch.full(tuple(shape), float("nan"), dtype=dtype)
            self.given.append(t)
            return t

    m = ModelArch(name="tiny", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64,
                  ffn=512, vocab=1000)
    wl = Workload(model=m, parallelism=Parallelism(tp=2), microbatch_size=2, seq_len=64,
                  nanobatches=2)
    backend = AllocatingBackend()
    ex = TorchExecutor(collective=backend, streams=RecordingStreamBackend())
    progs, full_progs = ex_mod.build_programs(wl, ex.collective, device="cpu")
    assert set(progs) == set(build_partitions(wl).types)
    assert set(full_progs) == set(build_partitions(wl.with_(nanobatches=1)).types)
    ptrs = {t.data_ptr() for t in backend.given}
    for prog in (*progs.values(), *full_progs.values()):
        assert prog.output.data_ptr() in ptrs and prog.comm_tensor.data_ptr() in ptrs
        assert torch.isfinite(prog.comm_tensor).all()  # zeroed, then written by the ops
    assert len(backend.given) == 2 * (len(progs) + len(full_progs))
