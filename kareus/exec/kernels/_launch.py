"""Lean launches: a compiled Triton kernel launched through its own launcher, without
Triton's per-call dispatch.

What ``kernel[grid](*args)`` costs. On every call Triton 3.x binds the arguments to the
kernel's signature, specialises each one (each tensor's dtype and whether its address is
a multiple of 16 bytes; each int's width, whether it is 1 and whether it divides by 16),
turns that into a cache key, looks the compiled kernel up, checks the globals the kernel
read, builds launch metadata, and only then calls the compiled kernel's launcher, a small
C function around ``cuLaunchKernelEx``. On one H200 host that was 21 us for a kernel of
4 arguments and 35 us for one of 30 (``bench/launch_cost.py`` times it again: its "empty
kernel" rows), for kernels that run 5-20 us on the GPU: eager training of a small model
waits on the host.

An op that launches the same kernel at the same signature again and again needs that
dispatch once. The first call at a signature goes through ``kernel[grid](...)`` (which
compiles if needed and returns the compiled kernel; this module records it); later calls
call the compiled kernel's launcher with the arguments laid out as Triton laid them out,
tensors passed as raw addresses. Three things make that safe:

* The op's cache key fixes the specialisation: every non-pointer argument and the grid
  must be a function of the key (shapes, strides, dtypes, devices, launch settings), and
  the fast path runs only while every pointer is 16-byte aligned, as it was when the
  kernel was compiled (the first call at a key compiles, or fetches, the aligned variant).
* ``lean_sites`` builds the fast launch from what the plain call recorded: the same
  arguments in the same places, each tensor replaced by "this root tensor's address plus
  this offset", where the op names the root of each pointer parameter; anything it cannot
  place (an unnamed tensor, an unaligned offset, a non-scalar constant) means no fast path.
* ``LaunchRuntime`` holds what the installed Triton offers, found once
  (``runtime``): its current-device and current-stream functions, where its launch
  hooks live, and a check of each compiled kernel: its source signature must name every
  parameter of the kernel, constexprs included, because the launcher's argument list is
  built from that signature and the plain path passes it every bound argument. Triton
  3.6 and 3.9 were read for this, and tests/exec/test_kernels_launch.py runs the
  installed Triton's own dispatch and compiler (with a stand-in for its GPU driver)
  against the fast path, launcher call for launcher call. Both launch with
  ``compiled.run(gx, gy, gz, stream, compiled.function, compiled.packed_metadata,
  launch_metadata, enter_hook, exit_hook, *every_argument)`` and keep their hooks in
  ``triton.knobs.runtime``; a Triton without ``knobs`` is looked at for hooks on
  ``CompiledKernel``, and one whose compiled signature leaves the constexprs out (Triton
  3.0 did) fails the check. Anything else (Triton's interpreter, a Triton that is not
  3.x, no GPU driver, a compiled kernel that does not check out, launch hooks installed,
  e.g. by Triton's profiler, ``KAREUS_LEAN_LAUNCH=0``) and the op takes the plain path:
  ``kernel[grid](...)`` on every call.

What the fast path skips that the plain path does: re-reading Triton's debug and
instrumentation knobs (changing them mid-run keeps the kernels compiled before) and the
check that the globals a kernel read have not changed (kareus's kernels read none).

One frame a call. ``lean_op`` writes an op's whole fast call at one signature as one
function: the hook check, each input's address and the alignment check, the outputs
(``torch.empty_like`` of a template), the scratch buffers, the stream, and each launch
with its arguments in place. And where the compiled kernel's launcher is Triton's
``CudaLauncher`` with a ``__call__`` this module has read (3.6 and 3.9, recognised by
its source: ``direct_layout``), asks for no scratch memory and runs no sanitizer,
the launch calls that launcher's C function directly, in the layout that ``__call__``
would have built: its Python (closures, scratch checks; about 1 us a launch on a fast
CPU, measured with a no-op C call) is skipped too. tests/exec/test_kernels_launch.py
runs the installed Triton's own ``CudaLauncher.__call__`` over a recording C function
against the direct call, for every op.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["LaunchRecord", "LaunchRuntime", "Scratch", "direct_layout", "lean_op", "lean_sites",
           "plain_launch", "runtime", "use_runtime"]

ENV = "KAREUS_LEAN_LAUNCH"
_OFF = ("0", "false", "no", "off")


class LaunchRecord:
    """One plain launch as it happened: the kernel, its grid, every argument in the
    kernel's parameter order, the launch options, and what ``kernel[grid](...)``
    returned (the compiled kernel, in Triton 3.x)."""

    __slots__ = ("args", "compiled", "fn", "grid", "options")

    def __init__(self, fn: Any, grid: tuple[int, ...], args: tuple[Any, ...],
                 options: dict[str, Any], compiled: Any) -> None:
        self.fn, self.grid, self.args, self.options = fn, grid, args, options
        self.compiled = compiled


def plain_launch(fn: Any, grid: tuple[int, ...], args: Sequence[Any],
                 options: Mapping[str, Any], record: list[LaunchRecord] | None) -> None:
    """``fn[grid](*args, **options)``: Triton's own dispatch; appends a
    ``LaunchRecord`` to ``record`` when given."""
    compiled = fn[grid](*args, **options)
    if record is not None:
        record.append(LaunchRecord(fn, tuple(grid), tuple(args), dict(options), compiled))


class LaunchRuntime:
    """What the installed Triton offers for launching a compiled kernel directly.

    Args:
        current_device: ``() -> int``, the device Triton launches on (Triton's own).
        current_stream: ``(device) -> int``, the raw stream handle Triton launches on.
        is_capturing: ``() -> bool``, whether the current stream is capturing a CUDA graph.
        hooks: The object whose ``launch_enter_hook`` / ``launch_exit_hook`` Triton calls
            around each launch, or ``None`` if it has none.
        jit_type: The class of kernels the fast path takes (Triton's ``JITFunction``).
        version: Triton's version, for reports.
    """

    def __init__(self, *, current_device: Callable[[], int],
                 current_stream: Callable[[int], int], is_capturing: Callable[[], bool],
                 hooks: Any, jit_type: type, version: str) -> None:
        self.current_device = current_device
        self.current_stream = current_stream
        self.is_capturing = is_capturing
        self.version = version
        self._hooks = hooks
        self._jit_type = jit_type
        # The hook chains in place now: while they stay in place, idle is "both empty".
        self._chains = tuple(getattr(hooks, a, None) for a in ("launch_enter_hook",
                                                                "launch_exit_hook"))
        if not all(_is_chain(c) for c in self._chains):
            self._chains = (_NOT_A_CHAIN, _NOT_A_CHAIN)

    def hooks_idle(self) -> bool:
        """True when no launch hook would run: none set, or an empty hook chain (Triton
        3.6 and 3.9 keep a ``HookChain`` there, which their profiler adds to). With a hook
        set, ops take the plain path, which builds the hook's launch metadata."""
        h = self._hooks
        if h is None:
            return True
        enter, exit_ = h.launch_enter_hook, h.launch_exit_hook
        e, x = self._chains
        if enter is e and exit_ is x:
            return not (e.calls or x.calls)
        return (enter is None or _is_chain(enter) and not enter.calls) and \
            (exit_ is None or _is_chain(exit_) and not exit_.calls)

    def launcher(self, fn: Any, compiled: Any) -> tuple[Any, Any, Any] | None:
        """``(run, function, packed_metadata)`` of ``compiled``, the compiled kernel
        ``fn[grid](...)`` returned, if the fast path can launch it; else ``None``."""
        if not isinstance(fn, self._jit_type) or getattr(fn, "pre_run_hooks", None):
            return None
        if compiled is None or hasattr(compiled, "result"):  # None, or an async-compile future
            return None
        src = getattr(compiled, "src", None)
        sig = getattr(src, "signature", None)
        names = list(getattr(fn, "arg_names", ()))
        if getattr(src, "fn", None) is not fn or not isinstance(sig, dict) or list(sig) != names:
            return None  # e.g. Triton 3.0: constexprs left out, and out of the launcher's args
        try:
            run = compiled.run
            function = compiled.function
            metadata = compiled.packed_metadata
        except Exception:  # a kernel that failed to load (out of resources, ...)
            return None
        if function is None or not callable(run):
            return None
        return run, function, metadata


_NOT_A_CHAIN = object()


def _is_chain(hook: Any) -> bool:
    return isinstance(getattr(hook, "calls", None), list)


def _version_tuple(v: str) -> tuple[int, ...] | None:
    parts = []
    for p in v.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts)


def _detect() -> LaunchRuntime | None:
    """The runtime of the installed Triton and torch, or ``None`` (see the module
    docstring for when)."""
    if os.environ.get(ENV, "1").strip().lower() in _OFF:
        return None
    try:
        import torch
        import triton
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction
    except Exception:
        return None
    ver = _version_tuple(getattr(triton, "__version__", ""))
    if ver is None or ver[0] != 3:
        return None
    knobs = getattr(triton, "knobs", None)
    rt_knobs = getattr(knobs, "runtime", None)
    interpret = getattr(rt_knobs, "interpret", None)
    if interpret is None:
        interpret = os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", *_OFF)
    if interpret:
        return None
    if rt_knobs is not None and hasattr(rt_knobs, "launch_enter_hook"):
        hooks: Any = rt_knobs
    else:
        try:
            from triton.compiler.compiler import CompiledKernel
        except Exception:
            return None
        if not hasattr(CompiledKernel, "launch_enter_hook"):
            return None
        hooks = CompiledKernel
    try:
        active = driver.active
        current_device = active.get_current_device
        current_stream = active.get_current_stream
    except Exception:  # no GPU driver
        return None
    if current_device is getattr(torch.cuda, "current_device", None) and \
            hasattr(torch._C, "_cuda_getDevice"):
        # Triton asks torch; torch's C call gives the same answer without the Python
        # wrapper's lazy-initialisation check (CUDA is up once an op has tensors on it).
        current_device = torch._C._cuda_getDevice
    capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    if capturing is None:
        capturing = torch.cuda.is_current_stream_capturing
    return LaunchRuntime(current_device=current_device, current_stream=current_stream,
                         is_capturing=capturing, hooks=hooks, jit_type=JITFunction,
                         version=str(triton.__version__))


_UNSET: Any = object()
_RUNTIME: Any = _UNSET


def runtime() -> LaunchRuntime | None:
    """The ``LaunchRuntime`` of this process (found on first use), or ``None``
    when lean launches are unavailable."""
    global _RUNTIME
    if _RUNTIME is _UNSET:
        try:
            _RUNTIME = _detect()
        except Exception:
            _RUNTIME = None
    return _RUNTIME  # type: ignore[no-any-return]


def use_runtime(rt: LaunchRuntime | None | Any = _UNSET) -> None:
    """Set the runtime that ``runtime`` returns (``None``: lean launches off); with
    no argument, detect again on next use. For tests with a fake Triton, and to switch
    the fast path off in a running process."""
    global _RUNTIME
    _RUNTIME = rt


def _storage(t: Any) -> Any:
    st = getattr(t, "untyped_storage", None)
    return st().data_ptr() if st is not None else None


def _launch_line(rt: LaunchRuntime, rec: LaunchRecord, k: int, ptrs: Sequence[int],
                 roots: Sequence[Any], root_of: Mapping[str, int], values: Mapping[str, Any],
                 ns: dict[str, Any]) -> str | None:
    """The source of one call of ``rec``'s launcher, ``run{k}(gx, gy, gz, s, ...)``: the
    stream named ``s``, each pointer argument ``r{i}`` (the address of root ``i``) plus
    a literal offset, each per-call value ``v{j}``, every other argument a constant
    bound in ``ns``; ``None`` where an argument cannot be placed."""
    got = rt.launcher(rec.fn, rec.compiled)
    names = list(getattr(rec.fn, "arg_names", ()))
    if got is None or len(names) != len(rec.args):
        return None
    ns[f"run{k}"], ns[f"function{k}"], ns[f"metadata{k}"] = got
    value_names = list(values)
    exprs = []
    for i, (name, a) in enumerate(zip(names, rec.args)):
        if name in values:
            if not (a is values[name] or a == values[name]) or \
                    rec.compiled.src.signature.get(name) == "constexpr":
                return None  # a per-call value must reach the kernel as an argument
            exprs.append(f"v{value_names.index(name)}")
        elif hasattr(a, "data_ptr"):
            r = root_of.get(name)
            if r is None or _storage(a) != _storage(roots[r]):
                return None  # a pointer into a copy, not into its root
            off = a.data_ptr() - ptrs[r]
            if off % 16:
                return None
            exprs.append(f"r{r} + {off}" if off else f"r{r}")
        elif type(a) in (int, float, bool) or a is None:
            ns[f"c{k}_{i}"] = a
            exprs.append(f"c{k}_{i}")
        else:
            return None
    grid = tuple(rec.grid) + (1,) * (3 - len(rec.grid))
    if len(grid) != 3 or any(type(g) is not int for g in grid):
        return None
    return _call_source(k, ns[f"run{k}"], (grid[0], grid[1], grid[2]), ", ".join(exprs), ns)


# The bodies of Triton's ``CudaLauncher.__call__`` read for the direct call (digest of the
# source, each line stripped, blank lines left out) and the layout of the C launch each
# one makes. With no scratch memory (none of kareus's kernels asks for any) and no
# sanitizer, both only pass their arguments on: 3.6 as ``launch(gx, gy, gz, stream,
# function, cooperative, pdl, None, None, *args)``, 3.9 as ``launch(gx, gy, gz, stream,
# function, cooperative, pdl, metadata, launch_metadata, enter, exit, None, None,
# arg_annotations, kernel_signature, kernel_args)``. A launcher whose body is not one of
# these is called as it is.
_DIRECT_LAYOUTS = {"fdaa2b81f7f24ae9": "3.6", "79bae830e3d12742": "3.9"}
_LAYOUT_OF: dict[type, str | None] = {}


def _fingerprint(fn: Any) -> str | None:
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    text = "\n".join(line.strip() for line in src.splitlines() if line.strip())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def direct_layout(run: Any) -> str | None:
    """``"3.6"`` or ``"3.9"`` when ``run`` (a compiled kernel's launcher) is Triton's
    ``CudaLauncher`` with one of the two bodies this module has read, and has no scratch
    memory, no sanitizer and a plain C launch (no tensor-descriptor wrapper): then its
    C launch can be called directly, with the arguments laid out as that body lays
    them out. ``None`` otherwise (the launcher is called as it is)."""
    cls = type(run)
    call = next((c.__dict__["__call__"] for c in cls.__mro__ if "__call__" in c.__dict__),
                None)
    if getattr(call, "__qualname__", "") != "CudaLauncher.__call__":
        return None
    if cls not in _LAYOUT_OF:
        _LAYOUT_OF[cls] = _DIRECT_LAYOUTS.get(_fingerprint(call) or "")
    layout = _LAYOUT_OF[cls]
    if layout is None or getattr(run, "global_scratch_size", 1) != 0 or \
            getattr(run, "profile_scratch_size", 1) != 0 or getattr(run, "gsan_enabled", False):
        return None
    launch = getattr(run, "launch", None)
    if not callable(launch) or isinstance(launch, types.FunctionType):
        return None  # the tensor-descriptor wrapper, a Python function
    if not all(hasattr(run, a) for a in ("launch_cooperative_grid", "launch_pdl")):
        return None
    if layout == "3.9" and not all(hasattr(run, a) for a in ("arg_annotations",
                                                             "kernel_signature")):
        return None
    return layout


def _call_source(k: int, run: Any, grid: tuple[int, int, int], args: str,
                 ns: dict[str, Any]) -> str:
    """The launch of record ``k``: through the launcher's C launch where
    ``direct_layout`` knows it, else through the launcher."""
    gx, gy, gz = grid
    layout = direct_layout(run)
    if layout is None:
        return (f"run{k}({gx}, {gy}, {gz}, s, function{k}, metadata{k}, None, None, None, "
                f"{args})")
    ns[f"launch{k}"] = run.launch
    ns[f"coop{k}"], ns[f"pdl{k}"] = run.launch_cooperative_grid, run.launch_pdl
    head = f"launch{k}({gx}, {gy}, {gz}, s, function{k}, coop{k}, pdl{k}, "
    if layout == "3.6":
        return head + f"None, None, metadata{k}, None, None, None, {args})"
    ns[f"ann{k}"], ns[f"sig{k}"] = run.arg_annotations, run.kernel_signature
    return head + f"metadata{k}, None, None, None, None, None, ann{k}, sig{k}, ({args},))"


def _compile(src: str, name: str, ns: dict[str, Any]) -> Callable[..., Any]:
    exec(compile(src, f"<kareus lean launch of {name}>", "exec"), ns)
    return ns["launch"]  # type: ignore[no-any-return]


def lean_sites(rt: LaunchRuntime, records: Sequence[LaunchRecord], roots: Sequence[Any],
               root_of: Mapping[str, int],
               values: Mapping[str, Any]) -> list[Callable[..., None]] | None:
    """One fast launch function per record, or ``None`` where any cannot have one.

    Each returned function takes ``(stream, *root_addresses, *values)``: the raw stream
    handle, the address of each tensor of ``roots`` (in that order) and each value of
    ``values`` (in that order), and launches its record's compiled kernel with the
    record's arguments, pointers moved to the new addresses.

    Args:
        rt: The runtime.
        records: The plain launches of one op call (``plain_launch``).
        roots: The tensors of that call that every pointer argument lies in (inputs,
            outputs, scratch), all 16-byte aligned.
        root_of: For each pointer parameter name of the kernels, the index of its root.
        values: Per-call scalar arguments by parameter name (e.g. ``eps``): passed on
            each call, not fixed by the op's key.
    """
    ptrs = [t.data_ptr() for t in roots]
    if any(p % 16 for p in ptrs):
        return None
    params = ", ".join([f"r{i}" for i in range(len(roots))] + [f"v{j}" for j in
                                                                range(len(values))])
    out = []
    for k, rec in enumerate(records):
        ns: dict[str, Any] = {}
        line = _launch_line(rt, rec, k, ptrs, roots, root_of, values, ns)
        if line is None:
            return None
        # One small function written per launch, so that a call is one Python frame
        # that hands the launcher its arguments in place (constants bound by name, each
        # pointer its root's address plus a literal offset): no loop and no list per call,
        # the way Triton writes its own argument binder.
        out.append(_compile(f"def launch(s, {params}):\n    {line}\n",
                            getattr(rec.fn, "__name__", "kernel"), ns))
    return out


class Scratch:
    """A root of an op that is neither an input nor an output: a buffer like
    ``template`` kept per stream in ``buffers`` (both of the op's launches run on that
    stream, so a call's first kernel starts after the previous call's last kernel has
    read it, the caching allocator's own rule for memory it hands out again on one
    stream), and allocated per call while the stream captures a CUDA graph (no graph
    holds a buffer that eager calls, or another graph replayed on another stream, also
    write)."""

    __slots__ = ("buffers", "template")

    def __init__(self, template: Any) -> None:
        self.template = template
        self.buffers: dict[int, Any] = {}


def lean_op(rt: LaunchRuntime, records: Sequence[LaunchRecord], roots: Sequence[Any],
            root_of: Mapping[str, int], values: Mapping[str, Any], make: Sequence[Any],
            returns: int | tuple[int, ...], dev: int,
            new: Callable[[Any], Any]) -> Callable[..., Any] | None:
    """The whole lean call of an op at one signature, as one generated function, or
    ``None`` where any of its launches cannot have a fast one (as in ``lean_sites``).

    The function takes the op's input tensors (the roots whose ``make`` entry is
    ``None``, in root order) and then its per-call ``values`` (in that order); it
    returns ``None``, launching nothing, when a launch hook is set or an input is not
    16-byte aligned (the caller then takes the plain path); otherwise it makes the
    outputs (``new(template)``, e.g. ``torch.empty_like`` of a template), takes the
    scratch buffers, launches every record on the current stream of ``dev``, and
    returns the roots named by ``returns`` (one tensor for an int, a tuple for a
    tuple). One frame a call: every address read once, the stream read once, each
    launcher called with its arguments in place.

    Args:
        rt, records, roots, root_of, values: As in ``lean_sites``.
        make: Per root: ``None`` (an input), a template (a fresh output each call), or
            a ``Scratch``.
        returns: The index of the root returned, or a tuple of them.
        dev: The device whose current stream the launches go to.
        new: Makes a fresh tensor from a template.
    """
    ptrs = [t.data_ptr() for t in roots]
    if any(p % 16 for p in ptrs) or len(make) != len(roots):
        return None
    ns: dict[str, Any] = {"idle": rt.hooks_idle, "stream": rt.current_stream, "dev": dev,
                          "capturing": rt.is_capturing, "new": new}
    lines = []
    for k, rec in enumerate(records):
        line = _launch_line(rt, rec, k, ptrs, roots, root_of, values, ns)
        if line is None:
            return None
        lines.append(line)
    ins = [i for i, m in enumerate(make) if m is None]
    body = ["if not idle():", "    return None"]
    body += [f"r{i} = t{i}.data_ptr()" for i in ins]
    body += [f"if ({' | '.join(f'r{i}' for i in ins)}) & 15:", "    return None"]
    fresh = []
    for i, m in enumerate(make):
        if m is None or isinstance(m, Scratch):
            continue
        ns[f"m{i}"] = m
        body += [f"t{i} = new(m{i})", f"r{i} = t{i}.data_ptr()"]
        fresh.append(i)
    body.append("s = stream(dev)")
    for i, m in enumerate(make):
        if isinstance(m, Scratch):
            ns[f"m{i}"], ns[f"b{i}"] = m.template, m.buffers
            body += ["if capturing():", f"    t{i} = new(m{i})", "else:",
                     f"    t{i} = b{i}.get(s)", f"    if t{i} is None:",
                     f"        t{i} = b{i}[s] = new(m{i})", f"r{i} = t{i}.data_ptr()"]
            fresh.append(i)
    if fresh:  # torch's allocators hand out blocks at multiples of 512 (CUDA) or 64 bytes
        body += [f"if ({' | '.join(f'r{i}' for i in fresh)}) & 15:", "    return None"]
    body += lines
    ret = (f"t{returns}" if isinstance(returns, int)
           else "(" + "".join(f"t{i}, " for i in returns) + ")")
    body.append(f"return {ret}")
    params = ", ".join([f"t{i}" for i in ins] + [f"v{j}" for j in range(len(values))])
    src = f"def launch({params}):\n" + "".join(f"    {b}\n" for b in body)
    names = "+".join(getattr(r.fn, "__name__", "kernel") for r in records)
    return _compile(src, names, ns)
