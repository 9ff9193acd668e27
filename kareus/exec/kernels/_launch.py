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
* :func:`lean_sites` builds the fast launch from what the plain call recorded: the same
  arguments in the same places, each tensor replaced by "this root tensor's address plus
  this offset", where the op names the root of each pointer parameter; anything it cannot
  place (an unnamed tensor, an unaligned offset, a non-scalar constant) means no fast path.
* :class:`LaunchRuntime` holds what the installed Triton offers, found once
  (:func:`runtime`): its current-device and current-stream functions, where its launch
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
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["LaunchRecord", "LaunchRuntime", "lean_sites", "plain_launch", "runtime",
           "use_runtime"]

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
    :class:`LaunchRecord` to ``record`` when given."""
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

    def hooks_idle(self) -> bool:
        """True when no launch hook would run: none set, or an empty hook chain (Triton
        3.6 and 3.9 keep a ``HookChain`` there, which their profiler adds to). With a hook
        set, ops take the plain path, which builds the hook's launch metadata."""
        h = self._hooks
        if h is None:
            return True
        for hook in (h.launch_enter_hook, h.launch_exit_hook):
            if hook is not None and (not isinstance(getattr(hook, "calls", None), list)
                                     or hook.calls):
                return False
        return True

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
    """The :class:`LaunchRuntime` of this process (found on first use), or ``None``
    when lean launches are unavailable."""
    global _RUNTIME
    if _RUNTIME is _UNSET:
        try:
            _RUNTIME = _detect()
        except Exception:
            _RUNTIME = None
    return _RUNTIME  # type: ignore[no-any-return]


def use_runtime(rt: LaunchRuntime | None | Any = _UNSET) -> None:
    """Set the runtime that :func:`runtime` returns (``None``: lean launches off); with
    no argument, detect again on next use. For tests with a fake Triton, and to switch
    the fast path off in a running process."""
    global _RUNTIME
    _RUNTIME = rt


def _storage(t: Any) -> Any:
    st = getattr(t, "untyped_storage", None)
    return st().data_ptr() if st is not None else None


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
        records: The plain launches of one op call (:func:`plain_launch`).
        roots: The tensors of that call that every pointer argument lies in (inputs,
            outputs, scratch), all 16-byte aligned.
        root_of: For each pointer parameter name of the kernels, the index of its root.
        values: Per-call scalar arguments by parameter name (e.g. ``eps``): passed on
            each call, not fixed by the op's key.
    """
    ptrs = [t.data_ptr() for t in roots]
    if any(p % 16 for p in ptrs):
        return None
    value_names = list(values)
    params = ", ".join([f"r{i}" for i in range(len(roots))] + [f"v{j}" for j in
                                                                range(len(value_names))])
    out = []
    for k, rec in enumerate(records):
        got = rt.launcher(rec.fn, rec.compiled)
        names = list(getattr(rec.fn, "arg_names", ()))
        if got is None or len(names) != len(rec.args):
            return None
        run, function, metadata = got
        ns: dict[str, Any] = {"run": run, "function": function, "metadata": metadata}
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
                ns[f"c{i}"] = a
                exprs.append(f"c{i}")
            else:
                return None
        grid = tuple(rec.grid) + (1,) * (3 - len(rec.grid))
        if len(grid) != 3 or any(type(g) is not int for g in grid):
            return None
        # One small function written per launch, so that a call is one Python frame
        # that hands the launcher its arguments in place (constants bound by name, each
        # pointer its root's address plus a literal offset): no loop and no list per call,
        # the way Triton writes its own argument binder.
        src = (f"def launch_{k}(stream, {params}):\n"
               f"    run({grid[0]}, {grid[1]}, {grid[2]}, stream, function, metadata, "
               f"None, None, None, {', '.join(exprs)})\n")
        exec(compile(src, f"<kareus lean launch of {getattr(rec.fn, '__name__', 'kernel')}>",
                     "exec"), ns)
        out.append(ns[f"launch_{k}"])
    return out
