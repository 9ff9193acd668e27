"""Lean launches (kareus/exec/kernels/_launch.py and the op wrappers of _triton.py) on the
CPU, with a fake Triton: kernels whose ``kernel[grid](...)`` records the plain launch and
returns a fake compiled kernel whose launcher records the fast one.

What is checked: at every op's signature the first call takes the plain path and later
calls the fast one; the fast launch passes the compiled kernel's launcher exactly what
Triton's dispatch passed on the plain path (the same grid, the same constants, each
pointer at the same place in the same tensor), and the outputs have the same shapes,
strides and dtypes; each cause of falling back (no runtime, launch hooks, an unaligned
tensor, an input the plain path copies, a compiled kernel that does not check out) takes
the plain path; RMSNorm backward's partials buffer is kept per stream and allocated per
call while capturing. What the kernels compute is checked in Triton's interpreter
(tests/exec/test_kernels_interpreted.py) and on a GPU (tests/exec/test_kernels_gpu.py).
Skipped without torch or Triton.
"""

from __future__ import annotations

import gc
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kareus.exec.kernels import _launch

try:
    from kareus.exec.kernels import _triton as kt
except Exception:  # pragma: no cover - a Triton that cannot import its CUDA backend
    pytest.skip("kareus's Triton kernels do not import here", allow_module_level=True)

if not hasattr(kt._rms_norm_fwd_kernel, "arg_names"):  # pragma: no cover - interpreter
    pytest.skip("needs Triton's JIT kernels (not TRITON_INTERPRET=1)", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")  # Triton 3.9
KERNELS = ("_rms_norm_fwd_kernel", "_add_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel",
           "_sum_rows_kernel",
           "_rope_heads_kernel", "_rope_kernel", "_swiglu_fwd_kernel", "_swiglu_bwd_kernel")
STREAM = 77


class FakeCompiled:
    """What ``kernel[grid](...)`` returns in Triton 3.x, for the checks the fast path makes."""

    def __init__(self, fn, log, *, full_signature=True):
        names = fn.arg_names if full_signature else fn.arg_names[:-1]
        self.src = types.SimpleNamespace(fn=fn, signature={n: "i32" for n in names})
        self.function = 1234
        self.packed_metadata = (4, 1, 0)
        self._log = log

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_,
            *args):
        assert (function, metadata, launch_metadata, enter, exit_) == (
            1234, (4, 1, 0), None, None, None)
        self._log.append(("fast", self.src.fn.__name__, (gx, gy, gz), stream, args))


class FakeJIT:
    """A kernel: ``kernel[grid](*args, **options)`` records the plain launch."""

    def __init__(self, real, log, **compiled_kw):
        self.arg_names = list(real.arg_names)
        self.__name__ = real.__name__
        self.pre_run_hooks = []
        self._log = log
        self._compiled = FakeCompiled(self, log, **compiled_kw)

    def __getitem__(self, grid):
        def launch(*args, **options):
            assert len(args) == len(self.arg_names)
            g = tuple(grid) + (1,) * (3 - len(grid))
            self._log.append(("plain", self.__name__, g, options, args))
            return self._compiled
        return launch


def fake_runtime(**kw):
    hooks = kw.pop("hooks", types.SimpleNamespace(launch_enter_hook=None,
                                                  launch_exit_hook=None))
    state = {"stream": STREAM, "capturing": False}
    rt = _launch.LaunchRuntime(current_device=lambda: -1,  # CPU tensors' get_device()
                               current_stream=lambda dev: state["stream"],
                               is_capturing=lambda: state["capturing"], hooks=hooks,
                               jit_type=FakeJIT, version="fake")
    rt.state = state
    return rt


@pytest.fixture
def fake(monkeypatch):
    """The fake Triton in place: ``fake.log`` holds every launch, ``fake.rt`` the runtime."""
    log: list = []
    for name in KERNELS:
        monkeypatch.setattr(kt, name, FakeJIT(getattr(kt, name), log))
    rt = fake_runtime()
    _launch.use_runtime(rt)
    kt.clear_plans()
    yield types.SimpleNamespace(log=log, rt=rt)
    kt.clear_plans()
    _launch.use_runtime()


def rnd(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def place(v, named):
    """A launch argument with pointers made comparable across calls: an address (or a
    tensor) becomes (name of the tensor it lies in, byte offset)."""
    if isinstance(v, torch.Tensor):
        v = v.data_ptr()
    elif type(v) is not int or v < 1 << 20:
        return v
    for name, t in named.items():
        base = t.untyped_storage().data_ptr()
        if base <= v < base + max(1, t.untyped_storage().nbytes()):
            return (name, v - t.data_ptr())
    raise AssertionError(f"address {v} lies in no known tensor")


def launches(log, named, kind=None):
    return [(e[0], e[1], e[2], tuple(place(a, named) for a in e[-1])) for e in log
            if kind is None or e[0] == kind]


def meta(t):
    return (tuple(t.shape), t.stride(), t.dtype)


def ops():
    """(name, call(lean) -> outputs, inputs by name, names of the outputs)."""
    x, dy, w = rnd(70, 96), rnd(70, 96, seed=1), 1 + rnd(96, seed=2)
    b, s, h, kvh, hd = 2, 16, 6, 2, 64
    qkv = rnd(b * s, (h + 2 * kvh) * hd, seed=3)
    ang = torch.randn(s, hd // 2, generator=torch.Generator().manual_seed(4))
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    dq = rnd(b, h, s, hd, seed=5).transpose(1, 2)  # attention's gradient layout
    dk, dv = (rnd(b, kvh, s, hd, seed=i).transpose(1, 2) for i in (6, 7))
    q, k = (t.view(b, s, -1, hd) for t in (qkv[:, :h * hd], qkv[:, h * hd:(h + kvh) * hd]))
    g, u, da = rnd(33, 130, seed=8), rnd(33, 130, seed=9), rnd(33, 130, seed=10)
    r, dres, dw_out = rnd(70, 96, seed=11), rnd(70, 96, seed=12), rnd(96, seed=13)
    return [
        ("add_rms_norm_fwd", lambda lean: kt.add_rms_norm_fwd(x, r, w, 1e-5, lean=lean),
         {"x": x, "r": r, "w": w}, ("s", "y")),
        ("rms_norm_bwd_add",
         lambda lean: (kt.rms_norm_bwd_add(dy, x, w, dres, dw_out, 1e-5, lean=lean),),
         {"dy": dy, "x": x, "w": w, "dres": dres, "dw_out": dw_out}, ("dx",)),
        ("rms_norm_fwd", lambda lean: (kt.rms_norm_fwd(x, w, 1e-5, lean=lean),),
         {"x": x, "w": w}, ("y",)),
        ("rms_norm_bwd", lambda lean: kt.rms_norm_bwd(dy, x, w, 1e-5, lean=lean),
         {"dy": dy, "x": x, "w": w}, ("dx", "dw")),
        ("rope_qkv", lambda lean: kt.rope_qkv(qkv, cos, sin, heads=h, kv_heads=kvh, lean=lean),
         {"qkv": qkv, "cos": cos, "sin": sin}, ("qo", "ko")),
        ("rope_fwd rows grid",
         lambda lean: kt.rope_fwd(q, k, cos, sin, grid="rows", block_r=8, lean=lean),
         {"qkv": qkv, "cos": cos, "sin": sin}, ("qo", "ko")),
        ("rope_bwd", lambda lean: (kt.rope_bwd(dq, dk, dv, cos, sin, lean=lean),),
         {"dq": dq, "dk": dk, "dv": dv, "cos": cos, "sin": sin}, ("out",)),
        ("swiglu_fwd", lambda lean: (kt.swiglu_fwd(g, u, lean=lean),),
         {"g": g, "u": u}, ("a",)),
        ("swiglu_bwd", lambda lean: kt.swiglu_bwd(da, g, u, lean=lean),
         {"da": da, "g": g, "u": u}, ("dg", "du")),
    ]


def _scratch(log, start):
    """RMSNorm backward's partials buffer of the launches from ``start`` on (the sum
    kernel's first argument)."""
    for e in log[start:]:
        if e[1] == "_sum_rows_kernel":
            a = e[-1][0]
            return a if isinstance(a, torch.Tensor) else None
    return None


@pytest.mark.parametrize("case", ops(), ids=lambda c: c[0])
def test_fast_launch_passes_what_the_plain_path_passed(fake, case):
    _, call, inputs, out_names = case
    plain = call(False)
    n_plain = len(fake.log)
    assert {e[0] for e in fake.log} == {"plain"}
    first = call(True)  # the first call at the signature: the plain path, recorded
    assert {e[0] for e in fake.log[n_plain:]} == {"plain"}
    n_first = len(fake.log)
    again = call(True)
    third = call(True)
    fast = fake.log[n_first:]
    assert fast and {e[0] for e in fast} == {"fast"}
    assert {e[3] for e in fast} == {STREAM}
    assert len(fast) == 2 * n_plain  # each of the op's kernels, twice

    def named(outs, scratch_from):
        d = {**inputs, **dict(zip(out_names, outs))}
        sc = _scratch(fake.log, scratch_from)
        if sc is not None:
            d["scratch"] = sc
        return d

    want = launches(fake.log[:n_plain], named(plain, 0))
    assert launches(fake.log[n_plain:n_first], named(first, n_plain)) == want
    dwp = kt._PLANS and next(iter(kt._PLANS.values())).scratch
    fast_named = {**inputs, **dict(zip(out_names, again))}
    if dwp:
        fast_named["scratch"] = next(iter(dwp.values()))
    got = [(k.replace("fast", "plain"), *rest)
           for k, *rest in launches(fast[:n_plain], fast_named)]
    assert got == want
    for o_plain, o_first, o_fast, o_third in zip(plain, first, again, third):
        assert meta(o_plain) == meta(o_first) == meta(o_fast) == meta(o_third)
    assert len(kt._PLANS) == 1


def test_each_signature_gets_its_own_plan(fake):
    for rows in (8, 9, 8, 9, 16):
        x = rnd(rows, 96)
        kt.rms_norm_fwd(x, 1 + rnd(96), 1e-5)
    assert len(kt._PLANS) == 3
    x = rnd(8, 96)
    kt.rms_norm_fwd(x[:, :64], 1 + rnd(64), 1e-5)  # strided rows: another signature
    assert len(kt._PLANS) == 4
    kinds = [e[0] for e in fake.log]
    assert kinds == ["plain", "plain", "fast", "fast", "plain", "plain"]


def test_a_parameter_weight_launches_lean(fake):
    x, w = rnd(16, 96), torch.nn.Parameter(1 + rnd(96))
    for _ in range(2):
        kt.rms_norm_fwd(x, w, 1e-5)
    assert [e[0] for e in fake.log] == ["plain", "fast"]


def test_no_runtime_means_the_plain_path(fake):
    _launch.use_runtime(None)
    x, w = rnd(16, 96), 1 + rnd(96)
    for _ in range(3):
        kt.rms_norm_fwd(x, w, 1e-5)
    assert [e[0] for e in fake.log] == ["plain"] * 3
    assert not kt._PLANS


def test_launch_hooks_mean_the_plain_path(fake):
    chain = types.SimpleNamespace(calls=[])  # Triton 3.4+'s empty HookChain: idle
    hooks = types.SimpleNamespace(launch_enter_hook=chain, launch_exit_hook=chain)
    _launch.use_runtime(fake_runtime(hooks=hooks))
    g, u = rnd(8, 64), rnd(8, 64)
    for _ in range(2):
        kt.swiglu_fwd(g, u)
    chain.calls.append(print)  # a profiler's hook
    kt.swiglu_fwd(g, u)
    chain.calls.clear()
    kt.swiglu_fwd(g, u)
    assert [e[0] for e in fake.log] == ["plain", "fast", "plain", "fast"]
    hooks.launch_exit_hook = print  # Triton 3.2/3.3: a function in place of None
    kt.swiglu_fwd(g, u)
    assert fake.log[-1][0] == "plain"


def test_an_unaligned_tensor_takes_the_plain_path(fake):
    w = 1 + rnd(96)
    base = rnd(16 * 96 + 1)
    x_odd = base[1:].view(16, 96)  # 2 bytes past an aligned address
    x_even = rnd(16, 96)
    kt.rms_norm_fwd(x_odd, w, 1e-5)
    kt.rms_norm_fwd(x_odd, w, 1e-5)
    assert not kt._PLANS  # nothing learnt from an unaligned call
    kt.rms_norm_fwd(x_even, w, 1e-5)
    kt.rms_norm_fwd(x_even, w, 1e-5)
    kt.rms_norm_fwd(x_odd, w, 1e-5)
    assert [e[0] for e in fake.log] == ["plain", "plain", "plain", "fast", "plain"]


def test_inputs_the_plain_path_copies_keep_the_plain_path(fake):
    g = rnd(64, 32).t()  # not contiguous: the plain path copies it first
    u = rnd(32, 64)
    for _ in range(3):
        kt.swiglu_fwd(g, u)
    assert [e[0] for e in fake.log] == ["plain"] * 3
    assert [p.fast for p in kt._PLANS.values()] == [None]


def test_a_compiled_kernel_that_does_not_check_out_keeps_the_plain_path(fake, monkeypatch):
    # Triton 3.0/3.1 named only the non-constexpr parameters in the compiled signature
    # (and their launchers took only those): no fast path.
    monkeypatch.setattr(kt, "_swiglu_fwd_kernel",
                        FakeJIT(kt._swiglu_fwd_kernel, fake.log, full_signature=False))
    g, u = rnd(8, 64), rnd(8, 64)
    for _ in range(3):
        kt.swiglu_fwd(g, u)
    assert [e[0] for e in fake.log] == ["plain"] * 3
    rt = fake.rt
    fn = kt._swiglu_bwd_kernel
    assert rt.launcher(fn, fn._compiled) is not None
    assert rt.launcher(fn, None) is None
    assert rt.launcher(object(), fn._compiled) is None  # not a JIT kernel (interpreter)
    future = types.SimpleNamespace(result=lambda: None)
    assert rt.launcher(fn, future) is None  # an async compile still running
    fn.pre_run_hooks.append(print)
    assert rt.launcher(fn, fn._compiled) is None


def test_rms_norm_bwd_keeps_its_partials_per_stream_but_not_while_capturing(fake):
    dy, x, w = rnd(70, 96), rnd(70, 96, seed=1), 1 + rnd(96)

    def partials_ptr():
        kt.rms_norm_bwd(dy, x, w, 1e-5)
        e = fake.log[-2]
        assert e[0] == "fast" and e[1] == "_rms_norm_bwd_kernel"
        return e[-1][4]

    kt.rms_norm_bwd(dy, x, w, 1e-5)  # plain, learns
    a, b = partials_ptr(), partials_ptr()
    assert a == b
    fake.rt.state["stream"] = STREAM + 1
    c = partials_ptr()
    assert c != a
    fake.rt.state["capturing"] = True
    d1 = partials_ptr()
    assert d1 not in (a, c)
    (plan,) = kt._PLANS.values()
    assert set(plan.scratch) == {STREAM, STREAM + 1}


def test_lean_sites_refuses_what_it_cannot_place(fake):
    log = fake.log
    fn = kt._swiglu_fwd_kernel
    g, u, a = rnd(8, 64), rnd(8, 64), rnd(8, 64)
    rec = [_launch.LaunchRecord(fn, (1,), (g, u, a, 512, 2048), {"num_warps": 8},
                                fn._compiled)]
    roots, root_of = (g, u, a), {"G": 0, "U": 1, "A": 2}
    sites = _launch.lean_sites(fake.rt, rec, roots, root_of, {})
    assert sites is not None
    sites[0](5, g.data_ptr(), u.data_ptr(), a.data_ptr())
    assert log[-1] == ("fast", fn.__name__, (1, 1, 1), 5,
                       (g.data_ptr(), u.data_ptr(), a.data_ptr(), 512, 2048))
    assert _launch.lean_sites(fake.rt, rec, roots, {"G": 0, "U": 1}, {}) is None  # A unnamed
    other = rnd(8, 64)
    assert _launch.lean_sites(fake.rt, rec, (g, u, other), root_of, {}) is None  # not in root
    odd = _launch.LaunchRecord(fn, (1,), (g, u, a, [512], 2048), {}, fn._compiled)
    assert _launch.lean_sites(fake.rt, [odd], roots, root_of, {}) is None  # not a scalar
    eps = _launch.LaunchRecord(fn, (1,), (g, u, a, 512, 0.5), {}, fn._compiled)
    sites = _launch.lean_sites(fake.rt, [eps], roots, root_of, {"BLOCK": 0.5})
    sites[0](5, g.data_ptr(), u.data_ptr(), a.data_ptr(), 0.25)  # a per-call value
    assert log[-1][-1][-1] == 0.25


def test_detection_respects_the_switch_and_the_interpreter(monkeypatch):
    monkeypatch.setenv(_launch.ENV, "0")
    assert _launch._detect() is None
    monkeypatch.setenv(_launch.ENV, "1")
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.runtime, "interpret"):
        # patched before the variable is set, so that undoing it restores False
        monkeypatch.setattr(knobs.runtime, "interpret", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _launch._detect() is None
    assert _launch._version_tuple("3.6.0") == (3, 6)
    assert _launch._version_tuple("3.9.0+git1234") == (3, 9)
    assert _launch._version_tuple("unknown") is None


def test_runtime_is_found_once_and_can_be_set(monkeypatch):
    calls = []
    monkeypatch.setattr(_launch, "_detect", lambda: calls.append(1))
    _launch.use_runtime()
    try:
        assert _launch.runtime() is None and _launch.runtime() is None
        assert calls == [1]
    finally:
        _launch.use_runtime()


def test_triton_kernels_defaults(monkeypatch):
    from kareus.exec.kernels.triton_ops import TritonKernels

    ks = TritonKernels()
    assert ks.use_liger is False and ks.lean is True  # liger is an opt-in now
    assert "liger" not in " ".join(ks.kernel_names().values())
    assert "plain launch" in TritonKernels(lean=False).kernel_names()["rope"]


# ------------------------------------------------- against Triton's own dispatch (no GPU)


class RecordingLauncher:
    """Stands in for Triton's launcher (``driver.active.launcher_cls``): records what
    the plain path and the fast path hand it."""

    log: list = []

    def __init__(self, src, metadata):
        self.name = src.fn.__name__

    def __call__(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter,
                 exit_, *args):
        self.log.append((self.name, (gx, gy, gz), stream, function, metadata, args))


class FakeCudaDriver:
    """Just enough of Triton's CUDA driver for ``kernel[grid](...)`` to compile for
    Hopper (the real compiler; Triton's wheel carries ptxas) and launch through
    :class:`RecordingLauncher`, on the CPU: device -1, the CPU tensors' device."""

    launcher_cls = RecordingLauncher

    def __init__(self):
        self.utils = types.SimpleNamespace(
            load_binary=lambda name, kernel, shared, device: (1, 4321, 32, 0, 1024),
            unload_module=lambda module: None,
            get_device_properties=lambda device: {"max_shared_mem": 232448,
                                                  "multiprocessor_count": 132})

    def get_current_device(self):
        return -1

    def get_current_stream(self, device):
        return 99

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@pytest.fixture
def triton_dispatch():
    """Triton's real dispatch and compiler with :class:`FakeCudaDriver` active, kareus's
    real runtime detection on top; yields the launcher's log."""
    from triton.runtime.driver import driver

    prev = driver._active
    driver.set_active(FakeCudaDriver())
    RecordingLauncher.log = []
    kt.clear_plans()
    _launch.use_runtime()
    try:
        rt = _launch.runtime()
        if rt is None:
            pytest.skip("lean launches unavailable with this Triton")
        rt.is_capturing = lambda: False  # a CPU-only torch has no CUDA graphs
        yield RecordingLauncher.log
    finally:
        kt.clear_plans()
        _launch.use_runtime()
        for name in KERNELS:
            getattr(kt, name).device_caches.pop(-1, None)
        RecordingLauncher.log = []
        gc.collect()  # compiled kernels unload through the fake driver
        driver._active = prev


@pytest.mark.parametrize("case", ops(), ids=lambda c: c[0])
def test_fast_launch_passes_what_tritons_dispatch_passes(triton_dispatch, case):
    """The installed Triton's ``kernel[grid](...)`` (binding, specialisation, cache,
    compilation for sm_90, launch) against the lean path, launcher call for launcher
    call: same kernel, grid, stream, function, metadata and arguments (pointers placed
    in the same tensors), for every op."""
    _, call, inputs, out_names = case
    log = triton_dispatch
    try:
        first = call(True)  # through kernel[grid](...): compiles
    except RuntimeError as exc:  # no ptxas / CUDA backend in this Triton install
        if "ptxas" in str(exc).lower() or "backend" in str(exc).lower():
            pytest.skip(f"Triton cannot compile for CUDA here: {exc}")
        raise
    n = len(log)
    assert n and len(kt._PLANS) == 1
    assert all(p.fast is not None for p in kt._PLANS.values())
    again = call(True)  # the fast path
    assert len(log) == 2 * n

    def placed(entries, outs, scratch):
        named = {**inputs, **dict(zip(out_names, outs))}
        if scratch is not None:
            named["scratch"] = scratch
        return [(e[0], e[1], e[2], e[3], e[4], tuple(place(a, named) for a in e[5]))
                for e in entries]

    dwp = next(iter(kt._PLANS.values())).scratch
    fast_scratch = next(iter(dwp.values())) if dwp else None
    plain_scratch = log[0][5][4] if fast_scratch is not None else None  # a tensor there
    assert placed(log[n:], again, fast_scratch) == placed(log[:n], first, plain_scratch)
    assert all(type(a) is not torch.Tensor for e in log[n:] for a in e[5])


# ------------------------------- Triton's own launcher, its C launch called directly (no GPU)


class RecordingCLaunch:
    """Stands in for the C launch inside Triton's ``CudaLauncher``: records the launch
    arguments and the kernel arguments apart (Triton 3.6 passes the kernel arguments
    last, Triton 3.9 as one tuple); a hook chain or launch metadata becomes ``None``
    (the lean path passes ``None`` there while no hook is set)."""

    def __init__(self, fn, log):
        self.name, self.n, self.log = fn.__name__, len(fn.arg_names), log

    def __call__(self, *args):
        if isinstance(args[-1], tuple) and len(args[-1]) == self.n:
            head, kargs = args[:-1], args[-1]
        else:
            head, kargs = args[:-self.n], args[-self.n:]
        head = tuple(None if type(a).__name__ in ("HookChain", "LazyDict") else a
                     for a in head)
        self.log.append((self.name, head, kargs))


def _cuda_launcher_cls():
    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except Exception:  # pragma: no cover - a Triton without its CUDA backend
        pytest.skip("no Triton CUDA backend")

    class Launcher(CudaLauncher):
        """Triton's own ``CudaLauncher.__call__`` over a recording C launch (its
        ``__init__`` builds the C module, which needs CUDA)."""

        log: list = []

        def __init__(self, src, metadata):
            self.launch = RecordingCLaunch(src.fn, Launcher.log)
            self.num_ctas = 1
            self.global_scratch_size = self.profile_scratch_size = 0
            self.global_scratch_align = self.profile_scratch_align = 1
            self.launch_cooperative_grid = self.launch_pdl = False
            self.arg_annotations, self.kernel_signature = ("annotations",), b"signature"
            self.gsan_enabled = False

    return Launcher


@pytest.mark.parametrize("case", ops(), ids=lambda c: c[0])
def test_direct_c_launch_passes_what_tritons_launcher_passes(triton_dispatch, monkeypatch,
                                                             case):
    """Where the installed Triton's ``CudaLauncher.__call__`` is one the fast path has
    read, the fast path calls its C launch directly: with the same arguments, in the
    same layout, as that ``__call__`` on the plain path."""
    from triton.runtime.driver import driver

    cls = _cuda_launcher_cls()
    monkeypatch.setattr(type(driver.active), "launcher_cls", cls)
    cls.log = []
    _, call, inputs, out_names = case
    try:
        first = call(True)
    except RuntimeError as exc:  # no ptxas / CUDA backend in this Triton install
        if "ptxas" in str(exc).lower() or "backend" in str(exc).lower():
            pytest.skip(f"Triton cannot compile for CUDA here: {exc}")
        raise
    n = len(cls.log)
    assert n and all(p.fast is not None for p in kt._PLANS.values())
    again = call(True)
    assert len(cls.log) == 2 * n
    fn = next(iter(kt._PLANS.values())).fast
    layout = next(_launch.direct_layout(v) for k, v in fn.__globals__.items()
                  if k.startswith("run"))
    import triton

    if triton.__version__.startswith(("3.6.", "3.9.")):
        assert layout in ("3.6", "3.9")  # the two launchers this module has read
    if layout is not None:
        assert any(k.startswith("launch0") for k in fn.__globals__)

    def placed(entries, outs, scratch):
        named = {**inputs, **dict(zip(out_names, outs))}
        if scratch is not None:
            named["scratch"] = scratch
        return [(e[0], e[1], tuple(place(a, named) for a in e[2])) for e in entries]

    dwp = next(iter(kt._PLANS.values())).scratch
    fast_scratch = next(iter(dwp.values())) if dwp else None
    plain_scratch = cls.log[0][2][4] if fast_scratch is not None else None
    assert placed(cls.log[n:], again, fast_scratch) == placed(cls.log[:n], first, plain_scratch)
