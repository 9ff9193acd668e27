"""kareus's own SM-capped collective kernels over CUDA IPC peer memory (``ext/collectives``)."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

from kareus.exec._ext_build import load_shared_library
from kareus.exec.collectives._base import (
    CollectiveBackend,
    _check_pair,
    _check_tensor,
    _resolve_stream,
)
from kareus.exec.collectives._errors import (
    CollectiveArgumentError,
    CollectiveLaunchError,
    CollectiveUnavailableError,
)
from kareus.exec.collectives._validation import (
    _DTYPE_BYTES,
    _MIB,
    ALL_REDUCE_ALGORITHMS,
    _round_up,
    choose_all_reduce_algorithm,
    choose_registered_all_reduce_algorithm,
    plan_pieces,
    validate_dtype,
    validate_world_size,
)

__all__ = ["DEFAULT_STAGING_BYTES", "OWN_MAX_BLOCKS", "OwnKernelCollective"]

#: Staging (receive) buffer of each rank for the own kernels, unless told otherwise.
DEFAULT_STAGING_BYTES = 256 * _MIB
#: Grid-size limit compiled into the own kernels (KC_MAX_BLOCKS).
OWN_MAX_BLOCKS = 256
_DTYPE_CODE = {"bfloat16": 0, "float16": 1, "float32": 2}
_OP_CODE = {"all_reduce": 0, "all_gather": 1, "reduce_scatter": 2}


class _CudaBytes:
    """Exposes raw device bytes through ``__cuda_array_interface__`` (no ownership)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None, "stream": None,
        }


@dataclasses.dataclass
class _SharedAllocation:
    """One allocation of this rank plus its peers' counterparts mapped here."""

    own: ctypes.c_void_p
    opened: list[ctypes.c_void_p]
    bases: list[int]  # data region of every rank (own included), as mapped here
    nbytes: int


class OwnKernelCollective(CollectiveBackend):
    """kareus's own SM-capped kernels over CUDA IPC peer memory (2, 4 or 8 GPUs).

    Construction is collective: every rank allocates a staging buffer, the buffers'
    IPC handles are exchanged through ``torch.distributed``, and every rank maps its
    peers' buffers. The CUDA library is built on first use (see
    ``kareus.exec._ext_build``).

    Two kinds of tensors can be passed:

    * Any CUDA tensor. Data is pushed into the peers' staging buffers and copied out
      there (messages larger than the staging buffer go in pieces, identically on
      every rank).
    * Tensors from [`empty`][kareus.exec.OwnKernelCollective.empty] ("registered": every rank has
      mapped them). Results are stored straight into the peers' tensors, which saves the staging
      copies and moves fewer bytes per SM: use these for the executor's communication buffers.
      A registered tensor must sit at the same offset of its allocation on every rank
      (it does when all ranks allocate and slice alike), and must not be in use on
      another stream while a collective on it runs. Runnable partitions built with
      ``build(collective=this_backend)`` get their buffers this way. Status: checked
      and measured on 2x H200 (``tests/exec/test_collectives_gpu.py``,
      docs/collectives.md); not yet run on 4 or 8 GPUs.

    Args:
        group: ``torch.distributed`` group of 2, 4 or 8 ranks on one node (default:
            the world).
        staging_bytes: Size of each rank's receive buffer (default 256 MiB). Two-shot
            all-reduce needs about 2x the message; one-shot, all-gather and
            reduce-scatter need world_size x the per-rank shard.
        algorithm: All-reduce algorithm for plain tensors: ``"auto"`` (one-shot for
            small messages or 2 GPUs, two-shot otherwise), ``"one_shot"``, ``"two_shot"``.
        registered_algorithm: All-reduce algorithm for registered tensors: ``"auto"``,
            ``"one_phase"`` or ``"two_phase"`` (see
            ``choose_registered_all_reduce_algorithm``).
        memory: ``"ipc"`` (own ``cudaMalloc`` buffers shared with ``cudaIpc*``) or
            ``"symm_mem"`` (PyTorch symmetric memory for the staging buffer,
            multicast unused).
        spin_timeout_s: If set, a kernel that waits longer than this for a peer traps
            (turning a hang into an error); ``None`` waits forever, as NCCL does.
        threads_per_block: Build option, 512 (default) or 1024 threads per SM.
        loads_in_flight: Build option, 16-byte loads each thread keeps in flight
            (default 16 at 512 threads, 8 at 1024).
        arch: CUDA architecture to build for (default: the current GPU's, e.g. sm_90).

    Raises:
        CollectiveArgumentError: Bad group size or options.
        CollectiveUnavailableError: torch.distributed not initialised, no GPU.
        ExtensionBuildError: The kernels could not be built.
        CollectiveLaunchError: Allocating or mapping the buffers failed (e.g. no peer
            access between the GPUs).
    """

    name: ClassVar[str] = "own"

    def __init__(self, *, group: Any = None, staging_bytes: int | None = None,
                 algorithm: str = "auto", registered_algorithm: str = "auto",
                 memory: str = "ipc", spin_timeout_s: float | None = None,
                 threads_per_block: int | None = None, loads_in_flight: int | None = None,
                 arch: str | None = None) -> None:
        torch, dist = self._bind_process_group(group)
        if algorithm not in ALL_REDUCE_ALGORITHMS:
            raise CollectiveArgumentError(
                f"algorithm must be one of {', '.join(ALL_REDUCE_ALGORITHMS)}, got {algorithm!r}"
            )
        choose_registered_all_reduce_algorithm(0, 2, registered_algorithm)  # validates
        if memory not in ("ipc", "symm_mem"):
            raise CollectiveArgumentError(f"memory must be 'ipc' or 'symm_mem', got {memory!r}")
        staging_bytes = DEFAULT_STAGING_BYTES if staging_bytes is None else int(staging_bytes)
        if staging_bytes < _MIB:
            raise CollectiveArgumentError(f"staging_bytes must be >= 1 MiB, got {staging_bytes}")
        if spin_timeout_s is not None and spin_timeout_s <= 0:
            raise CollectiveArgumentError(f"spin_timeout_s must be > 0 or None, got {spin_timeout_s}")
        defines = _build_defines(threads_per_block, loads_in_flight)
        self._group = group
        validate_world_size(self._world)
        props = torch.cuda.get_device_properties(self._device)
        self._algorithm = algorithm
        self._registered_algorithm = registered_algorithm
        self._staging_bytes = staging_bytes
        self._memory = memory
        self._lib = load_shared_library("collectives", arch=arch or f"sm_{props.major}{props.minor}",
                                        defines=defines)
        self._declare(self._lib)
        self._max_blocks = int(self._lib.kc_max_blocks())
        self._offset = int(self._lib.kc_data_offset())
        self._comm = ctypes.c_void_p()
        self._staging: _SharedAllocation | None = None
        self._registered: list[_SharedAllocation] = []
        self._symm: tuple[Any, Any] | None = None
        self._last_stream: Any = None
        self._closed = False
        timeout_ns = 0 if spin_timeout_s is None else int(spin_timeout_s * 1e9)

        if memory == "ipc":
            self._staging = self._alloc_shared(staging_bytes)
            bases = [b - self._offset for b in self._staging.bases]
        else:
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(self._offset + staging_bytes, dtype=torch.uint8,
                                 device=torch.device("cuda", self._device))
            buf.zero_()
            torch.cuda.synchronize()
            gname = (group if group is not None else dist.group.WORLD).group_name
            handle_obj = symm_mem.rendezvous(buf, gname)
            bases = [int(p) for p in handle_obj.buffer_ptrs]
            self._symm = (buf, handle_obj)
        arr = (ctypes.c_void_p * self._world)(*bases)
        self._call("kc_comm_create", self._rank, self._world, arr, ctypes.c_size_t(staging_bytes),
                   ctypes.c_ulonglong(timeout_ns), ctypes.byref(self._comm))
        # Every rank has zeroed its flags and mapped its peers before any kernel runs.
        torch.cuda.synchronize()
        dist.barrier(group=group)

    @staticmethod
    def _declare(lib: ctypes.CDLL) -> None:
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        lib.kc_last_error.restype = ctypes.c_char_p
        lib.kc_data_offset.restype = ctypes.c_longlong
        lib.kc_staging_alloc.argtypes = [sz, ctypes.POINTER(vp), vp]
        lib.kc_ipc_open.argtypes = [vp, ctypes.POINTER(vp)]
        lib.kc_ipc_close.argtypes = [vp]
        lib.kc_free.argtypes = [vp]
        lib.kc_comm_create.argtypes = [i, i, ctypes.POINTER(vp), sz, ctypes.c_ulonglong,
                                       ctypes.POINTER(vp)]
        lib.kc_comm_destroy.argtypes = [vp]
        lib.kc_run.argtypes = [vp, i, i, vp, vp, sz, sz, i, i, vp]
        lib.kc_run_registered.argtypes = [vp, i, i, vp, vp, ctypes.POINTER(vp), sz, sz, i, i, vp]

    def _call(self, fn: str, *args: Any) -> None:
        rc = getattr(self._lib, fn)(*args)
        if rc != 0:
            msg = (self._lib.kc_last_error() or b"").decode(errors="replace")
            hint = ""
            if fn == "kc_ipc_open":
                hint = ("; the GPUs may lack peer access, or the processes may not share the "
                        "node: try memory='symm_mem' or NCCLCappedCollective")
            raise CollectiveLaunchError(f"{fn} failed on rank {self._rank}: {msg}{hint}")

    def _alloc_shared(self, nbytes: int) -> _SharedAllocation:
        """Allocates ``nbytes`` (zeroed) on every rank and maps the peers' (collective)."""
        import torch
        import torch.distributed as dist

        hbytes = int(self._lib.kc_ipc_handle_bytes())
        handle = (ctypes.c_ubyte * hbytes)()
        own = ctypes.c_void_p()
        self._call("kc_staging_alloc", ctypes.c_size_t(nbytes), ctypes.byref(own), handle)
        mine = torch.tensor(list(bytes(handle)), dtype=torch.uint8, device=self._device)
        gathered = torch.empty(self._world * hbytes, dtype=torch.uint8, device=self._device)
        dist.all_gather_into_tensor(gathered, mine, group=self._group)
        all_handles = gathered.cpu().tolist()
        alloc = _SharedAllocation(own=own, opened=[], bases=[], nbytes=nbytes)
        for q in range(self._world):
            if q == self._rank:
                alloc.bases.append(int(own.value or 0) + self._offset)
                continue
            hq = (ctypes.c_ubyte * hbytes)(*all_handles[q * hbytes:(q + 1) * hbytes])
            ptr = ctypes.c_void_p()
            self._call("kc_ipc_open", hq, ctypes.byref(ptr))
            alloc.opened.append(ptr)
            alloc.bases.append(int(ptr.value or 0) + self._offset)
        return alloc

    def _free_shared(self, alloc: _SharedAllocation) -> None:
        for ptr in alloc.opened:
            self._call("kc_ipc_close", ptr)
        alloc.opened = []
        if alloc.own.value:
            self._call("kc_free", alloc.own)
            alloc.own = ctypes.c_void_p()

    @property
    def max_sms(self) -> int:
        """Largest grid the kernels take here: SMs - 1, at most the compiled block limit."""
        return min(self._sm_count - 1, self._max_blocks)

    @property
    def staging_bytes(self) -> int:
        """Capacity of each rank's staging buffer."""
        return self._staging_bytes

    def empty(self, shape: int | Sequence[int], dtype: Any) -> Any:
        """Allocates a registered tensor: one that every rank of the group has mapped.

        Collective: every rank must call it with the same shape and dtype, in the same
        order. Collectives on such tensors (all-reduce in place, all-gather output,
        reduce-scatter input) store into or load from the peers' tensors directly.
        The memory lives until [`close`][kareus.exec.OwnKernelCollective.close]; contents start as
        zeros.

        Args:
            shape: Tensor shape (an int for 1-D).
            dtype: ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.

        Returns:
            A contiguous CUDA tensor on the current device.
        """
        import math

        import torch

        self._check_open()
        shape_t = (int(shape),) if isinstance(shape, int) else tuple(int(d) for d in shape)
        if any(d < 0 for d in shape_t):
            raise CollectiveArgumentError(f"shape must be non-negative, got {shape_t}")
        tdtype = getattr(torch, validate_dtype(dtype))
        esize = _DTYPE_BYTES[validate_dtype(dtype)]
        numel = math.prod(shape_t)
        nbytes = _round_up(max(numel * esize, 16), 256)
        alloc = self._alloc_shared(nbytes)
        self._registered.append(alloc)
        own = alloc.bases[self._rank]
        raw = torch.as_tensor(_CudaBytes(own, nbytes), device=f"cuda:{self._device}")
        return raw[: numel * esize].view(tdtype).view(shape_t)

    def is_registered(self, tensor: Any) -> bool:
        """Whether ``tensor`` lies in memory from [`empty`][kareus.exec.OwnKernelCollective.empty] (zero-copy paths)."""
        return self._registered_ptrs(tensor) is not None

    def _registered_ptrs(self, tensor: Any) -> list[int] | None:
        ptr = int(tensor.data_ptr())
        end = ptr + tensor.numel() * tensor.element_size()
        for alloc in self._registered:
            base = alloc.bases[self._rank]
            if base <= ptr and end <= base + alloc.nbytes:
                return [b + (ptr - base) for b in alloc.bases]
        return None

    def _enter_stream(self, stream: Any) -> Any:
        import torch

        stream = _resolve_stream(stream)
        last = self._last_stream
        if last is not None and last != stream:
            # Buffers are reused: order this call after the previous one.
            ev = torch.cuda.Event()
            ev.record(last)
            stream.wait_event(ev)
        self._last_stream = stream
        return stream

    def _launch(self, op: str, dtype: str, in_ptr: int, out_ptr: int, numel: int, stride: int,
                algo: str, sms: int, stream: Any) -> None:
        self._call("kc_run", self._comm, _OP_CODE[op], _DTYPE_CODE[dtype], ctypes.c_void_p(in_ptr),
                   ctypes.c_void_p(out_ptr), ctypes.c_size_t(numel), ctypes.c_size_t(stride),
                   0 if algo == "one_shot" else 1, sms, ctypes.c_void_p(stream.cuda_stream))

    def _launch_registered(self, op: str, dtype: str, in_ptr: int, out_ptr: int, regs: list[int],
                           numel: int, stride: int, algo: str, sms: int, stream: Any) -> None:
        arr = (ctypes.c_void_p * self._world)(*regs)
        self._call("kc_run_registered", self._comm, _OP_CODE[op], _DTYPE_CODE[dtype],
                   ctypes.c_void_p(in_ptr), ctypes.c_void_p(out_ptr), arr, ctypes.c_size_t(numel),
                   ctypes.c_size_t(stride), 1 if algo == "two_phase" else 0, sms,
                   ctypes.c_void_p(stream.cuda_stream))

    def _check_open(self) -> None:
        if self._closed:
            raise CollectiveArgumentError("this OwnKernelCollective was closed; build a new one")

    def all_reduce(self, tensor: Any, stream: Any, sms: int | None) -> Any:
        """Sums ``tensor`` over the group in place with ``sms`` thread blocks; returns ``tensor``.

        Registered tensors (from [`empty`][kareus.exec.OwnKernelCollective.empty]) take the
        zero-copy kernels; others go through the staging buffer, in pieces when larger than it.
        """
        self._check_open()
        sms = self._check_sms(sms)
        dtype = _check_tensor(tensor, "tensor", self._device)
        stream = self._enter_stream(stream)
        numel = tensor.numel()
        if numel == 0:
            return tensor
        esize = _DTYPE_BYTES[dtype]
        regs = self._registered_ptrs(tensor)
        if regs is not None and all(r % 16 == 0 for r in regs):
            algo = choose_registered_all_reduce_algorithm(numel * esize, self._world,
                                                          self._registered_algorithm)
            for start, count in plan_pieces("all_reduce", numel, esize, self._world,
                                            self._staging_bytes, algo):
                self._launch_registered("all_reduce", dtype, 0, 0, [r + start * esize for r in regs],
                                        count, 0, algo, sms, stream)
            return tensor
        algo = choose_all_reduce_algorithm(numel * esize, self._world, self._algorithm)
        work = tensor
        if tensor.data_ptr() % 16:
            import torch

            with torch.cuda.stream(stream):
                work = tensor.clone()
        base = work.data_ptr()
        for start, count in plan_pieces("all_reduce", numel, esize, self._world,
                                        self._staging_bytes, algo):
            ptr = base + start * esize
            self._launch("all_reduce", dtype, ptr, ptr, count, 0, algo, sms, stream)
        if work is not tensor:
            import torch

            with torch.cuda.stream(stream):
                tensor.copy_(work)
        return tensor

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """Gathers every rank's ``input`` into ``output`` with ``sms`` thread blocks."""
        return self._shard_collective("all_gather", output, input, stream, sms)

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """Sums ``input`` over the group into this rank's ``output`` with ``sms`` thread blocks."""
        return self._shard_collective("reduce_scatter", output, input, stream, sms)

    def _shard_collective(self, op: str, output: Any, input: Any, stream: Any,
                          sms: int | None) -> Any:
        """All-gather or reduce-scatter: one shard of ``m`` elements per rank.

        The full-size tensor (all-gather output, reduce-scatter input) is the one the
        peers touch, so its being registered selects the zero-copy kernels.
        """
        self._check_open()
        sms = self._check_sms(sms)
        dtype = _check_pair(op, output, input, self._world, self._device)
        stream = self._enter_stream(stream)
        full, shard = (output, input) if op == "all_gather" else (input, output)
        m = shard.numel()
        if m == 0:
            return output
        regs = self._registered_ptrs(full)
        if regs is not None:
            self._launch_registered(op, dtype, input.data_ptr(), output.data_ptr(), regs, m, m, "",
                                    sms, stream)
            return output
        esize = _DTYPE_BYTES[dtype]
        for start, count in plan_pieces(op, m, esize, self._world, self._staging_bytes):
            self._launch(op, dtype, input.data_ptr() + start * esize,
                         output.data_ptr() + start * esize, count, m, "", sms, stream)
        return output

    def all_to_all(self, output: Any, input: Any, output_splits: Any, input_splits: Any,
                   stream: Any, sms: int | None) -> Any:
        """Refused: kareus's own kernels have no all-to-all yet.

        An own kernel earns its place only where it beats NCCL at few SMs, as the
        all-reduce, all-gather and reduce-scatter kernels were measured to; an all-to-all
        kernel needs that measurement on GPUs first. Use ``NCCLCappedCollective``.

        Raises:
            CollectiveUnavailableError: always.
        """
        raise CollectiveUnavailableError(
            "kareus's own collective kernels have no all-to-all yet (one must first be "
            "measured against NCCL's at few SMs on GPUs); use nccl_capped for the "
            "expert-parallel group")

    def close(self) -> None:
        """Frees the buffers, registered tensors included.

        Collective: every rank must call it (peers may still be writing).
        """
        if self._closed:
            return
        import torch
        import torch.distributed as dist

        self._closed = True
        torch.cuda.synchronize()
        dist.barrier(group=self._group)
        self._call("kc_comm_destroy", self._comm)
        for alloc in self._registered:
            self._free_shared(alloc)
        self._registered = []
        if self._staging is not None:
            self._free_shared(self._staging)
            self._staging = None
        self._symm = None


def _build_defines(threads_per_block: int | None, loads_in_flight: int | None) -> dict[str, int]:
    """Build-time kernel options as preprocessor macros (validated)."""
    defines: dict[str, int] = {}
    if threads_per_block is not None:
        if threads_per_block not in (256, 512, 1024):
            raise CollectiveArgumentError(
                f"threads_per_block must be 256, 512 or 1024, got {threads_per_block}"
            )
        defines["KC_THREADS"] = threads_per_block
    if loads_in_flight is not None:
        if not 1 <= loads_in_flight <= 64:
            raise CollectiveArgumentError(f"loads_in_flight must be in 1..64, got {loads_in_flight}")
        defines["KC_INFLIGHT"] = loads_in_flight
    return defines
