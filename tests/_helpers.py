"""Set-up and checks that several test modules share (test support, not a test module;
importable from every test: pytest puts tests/ on the path for its conftest.py).

* ``cuda_marks`` / ``needs_cuda``: a GPU test's marks (``gpu``, skipped without CUDA);
* ``small_workload``: the small Llama (or Qwen3) layer of the one-GPU tests;
* ``rel_error``, ``assert_as_close_as_torch`` and ``assert_run_as_close_as_torch``: how a
  bf16 result is compared with its float reference (relative error in norm; "as close as
  PyTorch's own bf16 autograd"); ``assert_runs_close``: two runs equal to a tolerance.
  A *run* is what a forward and backward gave: ``(output, input gradient, {weight name:
  gradient})``;
* ``qk_counting_kernels``: the default kernel set, counting its query/key norm and RoPE
  calls, fused or as ``KernelSet``'s unfused composition;
* ``warm_up_on_a_side_stream``: the warm-up a user's CUDA graph capture needs;
* ``lab_gpu_toml``: the spec file of a made-up GPU;
* ``megatron_ddp_hooks``: Megatron-Core DDP's gradient path (``main_grad``) on plain
  tensors.

torch is imported inside the functions: importing this module needs no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from kareus.model.workload import ModelArch, Parallelism, Workload

T = TypeVar("T")
#: What a forward and backward gave: (output, input gradient, {weight name: gradient}).
Run = tuple[Any, Any, dict[str, Any]]


def cuda_marks() -> list[pytest.MarkDecorator]:
    """A GPU test module's ``pytestmark``: marked ``gpu`` and skipped without CUDA."""
    import torch

    return [pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def needs_cuda(test: T) -> T:
    """``cuda_marks`` on one test of a module whose other tests run on the CPU."""
    marked: Any = test
    for mark in reversed(cuda_marks()):
        marked = mark(marked)
    return marked


def small_workload(tp: int = 1, cp: int = 1, *, sp: bool = False, qk: bool = False,
                   name: str = "small", mbs: int = 4, seq: int = 512, n: int = 2,
                   recompute: bool | str = "full") -> Workload:
    """The one-GPU tests' small layer (2 layers, hidden 512, 8 query heads of 64 over 4
    key/value heads, FFN 1024, vocabulary 1000), two microbatches of ``mbs`` sequences of
    ``seq`` tokens in ``n`` nanobatches; ``qk``: Qwen3's layer (per-head query/key norms,
    eps 1e-6; 1e-5 otherwise)."""
    m = ModelArch(name=name, layers=2, hidden=512, heads=8, kv_heads=4, head_dim=64,
                  ffn=1024, vocab=1000, qk_norm=qk, norm_eps=1e-6 if qk else 1e-5)
    return Workload(model=m, parallelism=Parallelism(tp=tp, cp=cp, sp=sp),
                    microbatch_size=mbs, seq_len=seq, num_microbatches=2, nanobatches=n,
                    recompute=recompute)


def lab_gpu_toml(name: str, search_count: int) -> str:
    """A GPU spec file (TOML) of a made-up 100-SM GPU named ``name`` whose clock search takes
    ``search_count`` clocks (every field ``load_gpu_file`` reads)."""
    return f"""\
name = "{name}"
sm_count = 100
clocks_mhz = {{min = 300, max = 1500, step = 15}}
search_clocks_mhz = {{max = 1500, step = 60, count = {search_count}}}
bf16_peak_tflops = 300.0
hbm_bandwidth_gbps = 2000.0
nvlink_bandwidth_gbps = 400.0
power_limit_w = 450.0
static_power_w = 90.0
idle_power_w = 60.0
default_comm_sms = 24
memory_gib = 48
"""


def rel_error(got: Any, want: Any) -> float:
    """``|got - want| / |want|`` in float64 (norms over every element; on ``want``'s
    device), the denominator at least 1e-12."""
    w = want.detach().double()
    g = got.detach().to(w.device, w.dtype)
    return float((g - w).norm() / max(float(w.norm()), 1e-12))


def assert_as_close_as_torch(got: Any, torch_bf16: Any, want: Any, what: str) -> None:
    """``got`` (bf16, kareus) is about as close to the fp32 ``want`` as PyTorch's own bf16
    autograd of the same computation (``torch_bf16``) is: within twice its relative error,
    or 5e-3 (bf16 rounding, not a bug)."""
    err, base = rel_error(got, want), rel_error(torch_bf16, want)
    assert err < max(2 * base, 5e-3), f"{what}: relative error {err:.3g}, torch bf16 {base:.3g}"


def assert_run_as_close_as_torch(got: Run, torch_bf16: Run, want: Run) -> None:
    """``assert_as_close_as_torch`` on the output, the input gradient and every weight's
    gradient of the runs."""
    assert_as_close_as_torch(got[0], torch_bf16[0], want[0], "output")
    assert_as_close_as_torch(got[1], torch_bf16[1], want[1], "input gradient")
    for k in want[2]:
        assert_as_close_as_torch(got[2][k], torch_bf16[2][k], want[2][k], k)


def assert_runs_close(got: Run, want: Run, **tol: Any) -> None:
    """``torch.testing.assert_close`` (``tol``: its ``rtol`` and ``atol``) on the output, the
    input gradient and every weight's gradient of two runs."""
    import torch

    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    for k in want[2]:
        torch.testing.assert_close(got[2][k], want[2][k], **tol, msg=k)


def qk_counting_kernels(fused: bool) -> Any:
    """The default kernel set of this machine, counting its RoPE calls (``calls``); with
    ``fused=False`` its query/key norm and RoPE run as ``KernelSet``'s composition of
    ``rms_norm`` and ``rope`` (the unfused math) instead of its fused kernels."""
    from kareus.exec.kernels import KernelSet, get_kernels

    default = type(get_kernels(None))

    class Counting(default):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.calls: Counter[str] = Counter()

        def qk_norm_rope(self, *a: Any, **k: Any) -> Any:
            self.calls["qk_norm_rope"] += 1
            impl = default.qk_norm_rope if fused else KernelSet.qk_norm_rope
            return impl(self, *a, **k)

        def qk_norm_rope_bwd(self, *a: Any, **k: Any) -> Any:
            self.calls["qk_norm_rope_bwd"] += 1
            impl = default.qk_norm_rope_bwd if fused else KernelSet.qk_norm_rope_bwd
            return impl(self, *a, **k)

        def rope(self, *a: Any, **k: Any) -> Any:
            self.calls["rope"] += 1
            return super().rope(*a, **k)

        def rope_bwd(self, *a: Any, **k: Any) -> Any:
            self.calls["rope_bwd"] += 1
            return super().rope_bwd(*a, **k)

    return Counting()


def warm_up_on_a_side_stream(body: Callable[[], object], times: int = 2) -> None:
    """``body()`` ``times`` times on a fresh side stream, ordered after the current stream's
    work and before what it does next: the warm-up PyTorch asks for before a
    ``torch.cuda.graph`` capture of ``body``."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            body()
    torch.cuda.current_stream().wait_stream(side)


def megatron_ddp_hooks(params: list[dict[str, Any]]) -> list[Any]:
    """Megatron-Core DDP's gradient path on every tensor of ``params`` (a dict a layer): an
    fp32 ``main_grad`` each, and a hook on its gradient accumulator that adds ``.grad`` into
    it and drops ``.grad`` (``DistributedDataParallel._make_backward_post_hook``, gradient
    accumulation fusion off). Returns the accumulators, which the caller keeps alive."""
    import torch

    keep = []
    for lp in params:
        for p in lp.values():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)

            def hook(*_: Any, p: Any = p) -> None:
                if p.grad is not None:
                    p.main_grad.add_(p.grad.data)
                p.grad = None

            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(hook)
            keep.append(acc)
    return keep


def run_gloo_ranks(script: str, ranks: int = 2, *, timeout_s: float = 300.0) -> str:
    """Run test module ``script`` (its ``__main__`` is the worker) as ``ranks`` processes
    under ``torch.distributed.run`` on this machine, with the repository on the path and one
    thread each; assert every rank exited 0 and printed ``rank R ok``; return its stdout."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
           "--standalone", str(Path(script).resolve())]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(ranks):
        assert f"rank {r} ok" in proc.stdout, proc.stdout[-3000:]
    return proc.stdout
