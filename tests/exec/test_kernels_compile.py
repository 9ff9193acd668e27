"""kareus's own Triton kernels compile for Hopper (sm_90: H100, H200) without a GPU.

The interpreter tests (tests/exec/test_kernels_interpreted.py) check what the kernels
compute; they do not compile them, and a kernel the interpreter runs may still fail to
compile (a layout Triton cannot lower, a constexpr misuse). Here Triton's own compiler
lowers each kernel to a cubin for sm_90 with the launch settings the wrappers choose at
the presets' widths (2,048, 3,072 and 8,192), on the CPU: Triton's wheel carries ptxas.
It also checks a property of the RoPE kernels' code: the 3-D grid kernel (the default)
divides nothing, where the row kernel (the fallback) divides flat row indices. Skipped without Triton's CUDA
backend.
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
try:
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "constexprs" not in inspect.signature(ASTSource).parameters:
        raise ImportError
except ImportError:  # pragma: no cover - Triton before 3.3 names the constants otherwise
    pytest.skip("needs Triton 3.3 or newer's compile API", allow_module_level=True)

from kareus.exec.kernels import _triton as kt

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")  # Triton 3.9
HOPPER = GPUTarget("cuda", 90, 32)
FP32_POINTERS = {"DWP", "P_ptr"}
FLOATS = {"eps"}


def _compile(fn, constexprs: dict, num_warps: int, pointer_names=None):
    """Compile ``fn`` for sm_90: pointer arguments (those named in ``pointer_names``, or
    by default the upper-case names and the ``*_src`` / ``*_dst`` / ``cos`` / ``sin``
    ones) as bf16 pointers (float32 for the dw partials), ``eps`` as float32, other
    arguments as int32."""
    names = fn.arg_names

    def kind(n: str) -> str:
        if n in constexprs:
            return "constexpr"
        if n in FLOATS:
            return "fp32"
        is_ptr = (n in pointer_names if pointer_names is not None
                  else n.isupper() or n.endswith(("_src", "_dst")) or n in ("cos", "sin"))
        if is_ptr:
            return "*fp32" if n in FP32_POINTERS else "*bf16"
        return "i32"

    sig = {n: kind(n) for n in names}
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    try:
        return triton.compile(src, target=HOPPER, options={"num_warps": num_warps})
    except RuntimeError as exc:  # no CUDA backend or ptxas in this Triton install
        if "backend" in str(exc).lower() or "ptxas" in str(exc).lower():
            pytest.skip(f"Triton cannot compile for CUDA here: {exc}")
        raise


@pytest.mark.parametrize("width", [2048, 3072, 8192])
def test_rms_norm_kernels_compile_at_the_presets_widths(width):
    block, rows, warps = kt._norm_config(width, None, None)
    k = _compile(kt._rms_norm_fwd_kernel, {"BLOCK": block, "ROWS": rows}, warps,
                 pointer_names={"X", "Y", "W"})
    assert k.asm["cubin"]
    k = _compile(kt._add_rms_norm_fwd_kernel, {"BLOCK": block, "ROWS": rows}, warps,
                 pointer_names={"X", "R", "S", "Y", "W"})
    assert k.asm["cubin"]
    block, rows, warps, _ = kt._bwd_config(width, None, None, None)
    for prefetch in (True, False):
        for has_res in (False, True):
            k = _compile(kt._rms_norm_bwd_kernel,
                         {"BLOCK": block, "ROWS": rows, "PREFETCH": prefetch,
                          "HAS_RES": has_res}, warps,
                         pointer_names={"DY", "X", "W", "DX", "DWP", "DRES"})
            assert k.asm["cubin"]
    for acc in (False, True):
        k = _compile(kt._sum_rows_kernel, {"P": 264, "BLOCK_P": 64, "BLOCK_N": 16, "ACC": acc},
                     4, pointer_names={"P_ptr", "OUT"})
        assert k.asm["cubin"]


@pytest.mark.parametrize("half", [64, 32])
@pytest.mark.parametrize("backward", [False, True])
def test_rope_kernels_compile_and_the_3d_grid_divides_nothing(half, backward):
    common = {"SIGN": -1.0 if backward else 1.0, "HALF": half, "PAD": half,
              "COPY_C": backward}
    rows = _compile(kt._rope_kernel, {**common, "BLOCK_R": 16}, 4)
    heads = _compile(kt._rope_heads_kernel, {**common, "BLOCK_S": 16}, 4)
    assert rows.asm["cubin"] and heads.asm["cubin"]
    division = re.compile(r"\b(div|rem)\.[su]")
    assert division.search(rows.asm["ptx"])  # the row kernel's index arithmetic
    assert not division.search(heads.asm["ptx"])


def test_swiglu_kernels_compile():
    for fn in (kt._swiglu_fwd_kernel, kt._swiglu_bwd_kernel):
        assert _compile(fn, {"BLOCK": 2048}, 8).asm["cubin"]


@pytest.mark.parametrize("kind", [0, 1, 2])
def test_the_timed_stand_in_kernel_compiles(kind):
    # the time-faithful loopback's kernel: the copy, then a wait on %globaltimer (inline PTX)
    from kareus.exec.kernels import timed_stand_in as ts

    fn = ts._timed_kernel
    sig = {"src": "*bf16", "dst": "*bf16", "m": "i32", "total": "i32", "group": "i32",
           "scale": "fp32", "duration_ns": "i64", "KIND": "constexpr", "BLOCK": "constexpr"}
    aligned = [["tt.divisibility", 16]]  # as Triton specializes 16-byte aligned arguments
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(fn.arg_names.index("KIND"),): kind,
                                (fn.arg_names.index("BLOCK"),): ts._BLOCK},
                    attrs={(i,): aligned for i in range(4)})
    try:
        k = triton.compile(src, target=HOPPER, options={"num_warps": ts._NUM_WARPS})
    except RuntimeError as exc:  # no CUDA backend or ptxas in this Triton install
        if "backend" in str(exc).lower() or "ptxas" in str(exc).lower():
            pytest.skip(f"Triton cannot compile for CUDA here: {exc}")
        raise
    assert k.asm["cubin"] and "%globaltimer" in k.asm["ptx"]
    # four 16-byte loads in flight per thread: the copy keeps up on a few SMs
    assert k.asm["ptx"].count("ld.global.v4") == 4
