"""What a collective call may take, and how a message is cut and run.

Pure logic shared by every backend and by the selection: SM counts, group sizes and
dtypes the backends accept, the choice between one-shot and two-shot all-reduce, how a
message larger than the staging buffer is cut into pieces (identically on every rank),
and the bus-bandwidth factor of nccl-tests. Nothing here imports torch.
"""

from __future__ import annotations

import operator
from typing import Any

from kareus.exec.collectives._errors import CollectiveArgumentError, CommSMCountError

__all__ = [
    "ALL_REDUCE_ALGORITHMS",
    "COLLECTIVE_OPS",
    "ONE_SHOT_MAX_BYTES",
    "REGISTERED_ALL_REDUCE_ALGORITHMS",
    "SUPPORTED_DTYPES",
    "SUPPORTED_WORLD_SIZES",
    "bus_bandwidth_factor",
    "choose_all_reduce_algorithm",
    "choose_registered_all_reduce_algorithm",
    "plan_pieces",
    "staging_bytes_needed",
    "validate_comm_sms",
    "validate_dtype",
    "validate_splits",
    "validate_world_size",
]

COLLECTIVE_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter")
SUPPORTED_WORLD_SIZES: tuple[int, ...] = (2, 4, 8)
SUPPORTED_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")
ALL_REDUCE_ALGORITHMS: tuple[str, ...] = ("auto", "one_shot", "two_shot")
REGISTERED_ALL_REDUCE_ALGORITHMS: tuple[str, ...] = ("auto", "one_phase", "two_phase")

_MIB = 1 << 20
#: ``algorithm="auto"`` uses one-shot all-reduce up to this size (and always on 2 GPUs).
ONE_SHOT_MAX_BYTES = 256 * 1024
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Pieces of a split message keep 16-byte alignment: piece sizes are multiples of this
# many bytes.
_PIECE_ALIGN_BYTES = 256


def validate_comm_sms(sms: Any, sm_count: int, *, backend_limit: int | None = None,
                      backend: str = "") -> int:
    """Checks an SM count for one collective call and returns it as an int.

    A communication kernel must leave at least one SM to computation, so the valid
    range on a GPU with ``N`` SMs is ``1..N-1``; a backend may have a lower ceiling
    (the own kernels' grid limit, NCCL's ``MAXCHANNELS``).

    Args:
        sms: The requested number of SMs.
        sm_count: SMs of the GPU (132 on H100/H200).
        backend_limit: Largest count the backend supports, if lower.
        backend: Backend name, for the message.

    Raises:
        CommSMCountError: ``sms`` is not an int in the valid range.
    """
    if isinstance(sms, bool) or not isinstance(sms, int):
        raise CommSMCountError(f"comm_sms must be an int, got {type(sms).__name__} {sms!r}")
    if sm_count < 2:
        raise CommSMCountError(f"a GPU needs at least 2 SMs to share them, got sm_count={sm_count}")
    if not 1 <= sms <= sm_count - 1:
        raise CommSMCountError(
            f"comm_sms must be in 1..{sm_count - 1} for a GPU with {sm_count} SMs, got {sms}"
        )
    if backend_limit is not None and sms > backend_limit:
        raise CommSMCountError(
            f"comm_sms must be in 1..{backend_limit} for the {backend or 'chosen'} backend, "
            f"got {sms}; use a smaller SM count or another backend"
        )
    return sms


def validate_world_size(world_size: int) -> int:
    """Checks that the own kernels serve ``world_size`` GPUs (2, 4 or 8).

    Raises:
        CollectiveArgumentError: Any other group size.
    """
    if world_size not in SUPPORTED_WORLD_SIZES:
        raise CollectiveArgumentError(
            f"the own collective kernels serve 2, 4 or 8 GPUs of one node, got a group of "
            f"{world_size}; use NCCLCappedCollective for other group sizes"
        )
    return world_size


def validate_dtype(dtype: Any) -> str:
    """Returns the canonical dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``).

    Accepts the names, ``torch.dtype`` objects (by their string form) and the short
    names ``bf16``, ``fp16``, ``fp32``, ``half``, ``float``.

    Raises:
        CollectiveArgumentError: Another dtype.
    """
    name = str(dtype).removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32"}.get(name, name)
    if name not in SUPPORTED_DTYPES:
        raise CollectiveArgumentError(
            f"collectives support {', '.join(SUPPORTED_DTYPES)}, got {dtype}; cast the tensor first"
        )
    return name


def _split_list(splits: Any, what: str, world_size: int, rows: int) -> list[int]:
    if isinstance(splits, (str, bytes)) or not hasattr(splits, "__len__"):
        raise CollectiveArgumentError(f"all_to_all: {what} must be a list of row counts, one "
                                      f"per rank, got {type(splits).__name__}")
    if len(splits) != world_size:
        raise CollectiveArgumentError(f"all_to_all: {what} must list one row count per rank "
                                      f"({world_size}), got {len(splits)}")
    out = []
    for v in splits:
        try:  # ints and integer scalars (numpy, 0-d tensors) that index as ints
            iv = None if isinstance(v, bool) else operator.index(v)
        except TypeError:
            iv = None
        if iv is None or iv < 0:
            raise CollectiveArgumentError(f"all_to_all: {what} must hold whole row counts "
                                          f">= 0, got {v!r:.40}")
        out.append(iv)
    if sum(out) != rows:
        raise CollectiveArgumentError(f"all_to_all: {what} sum to {sum(out)} rows, the tensor "
                                      f"has {rows}; pass the row counts of this call")
    return out


def validate_splits(output_splits: Any, input_splits: Any, *, world_size: int,
                    output_rows: int, input_rows: int) -> tuple[list[int], list[int]]:
    """Checks an all-to-all's splits (host lists of row counts, one per rank, as
    ``torch.distributed.all_to_all_single`` takes them) and returns them as int lists.

    ``input_splits[q]`` rows of the input (in rank order) go to rank ``q``;
    ``output_splits[q]`` rows come from rank ``q``. Each list holds ``world_size``
    whole counts >= 0 summing to its tensor's rows. That rank ``q``'s ``input_splits``
    entry for this rank equals this rank's ``output_splits[q]`` cannot be checked
    locally: the caller exchanges the counts first (a mixture of experts' dispatcher does).

    Raises:
        CollectiveArgumentError: One line naming the list and what is wrong.
    """
    return (_split_list(output_splits, "output_splits", world_size, output_rows),
            _split_list(input_splits, "input_splits", world_size, input_rows))


def _validate_op(op: str) -> str:
    if op not in COLLECTIVE_OPS:
        raise CollectiveArgumentError(f"op must be one of {', '.join(COLLECTIVE_OPS)}, got {op!r}")
    return op


def choose_all_reduce_algorithm(nbytes: int, world_size: int, algorithm: str = "auto") -> str:
    """Picks one-shot or two-shot all-reduce.

    One-shot: every rank pushes its whole tensor to every peer and reduces all copies
    itself; one synchronisation, but ``(n-1) x`` the bytes on each link. Two-shot:
    reduce-scatter then all-gather; two synchronisations and ``2(n-1)/n x`` the bytes,
    the bandwidth-optimal choice for large messages on more than 2 GPUs. On 2 GPUs
    both move the same bytes, so one-shot wins.

    Args:
        nbytes: Message size in bytes.
        world_size: GPUs in the group.
        algorithm: ``"auto"``, ``"one_shot"`` or ``"two_shot"``.

    Raises:
        CollectiveArgumentError: Unknown ``algorithm``.
    """
    if algorithm not in ALL_REDUCE_ALGORITHMS:
        raise CollectiveArgumentError(
            f"algorithm must be one of {', '.join(ALL_REDUCE_ALGORITHMS)}, got {algorithm!r}"
        )
    if algorithm != "auto":
        return algorithm
    if world_size == 2 or nbytes <= ONE_SHOT_MAX_BYTES:
        return "one_shot"
    return "two_shot"


def choose_registered_all_reduce_algorithm(nbytes: int, world_size: int,
                                           algorithm: str = "auto") -> str:
    """Picks the all-reduce for tensors allocated with [`OwnKernelCollective.empty`][kareus.exec.OwnKernelCollective.empty].

    Such tensors are mapped by every rank, so results go straight into the peers'
    tensors. ``"one_phase"``: rank r reads chunk r of every rank's tensor (loads over
    NVLink), reduces, and stores the result into every rank's tensor; each rank moves
    S in and S out. ``"two_phase"``: ranks first push chunks into the owners' staging
    buffers, then each owner reduces and stores into every rank's tensor; only stores
    cross NVLink, at 2(n-1)/n S each way plus local reads.

    Args:
        nbytes: Message size in bytes.
        world_size: GPUs in the group.
        algorithm: ``"auto"``, ``"one_phase"`` or ``"two_phase"``.

    Raises:
        CollectiveArgumentError: Unknown ``algorithm``.
    """
    if algorithm not in REGISTERED_ALL_REDUCE_ALGORITHMS:
        raise CollectiveArgumentError(
            f"registered_algorithm must be one of {', '.join(REGISTERED_ALL_REDUCE_ALGORITHMS)}, "
            f"got {algorithm!r}"
        )
    if algorithm != "auto":
        return algorithm
    # By the bytes each SM moves (S in and S out per rank), one-phase should be faster;
    # not measured yet.
    return "one_phase"


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def staging_bytes_needed(op: str, numel: int, elem_bytes: int, world_size: int,
                         algorithm: str = "two_shot") -> int:
    """Bytes of each rank's staging buffer that one own-kernel call of this size needs.

    ``numel`` is the all-reduce tensor size, the all-gather input (per-rank shard) size
    or the reduce-scatter output size; ``algorithm`` is an all-reduce algorithm of
    either family (``one_shot``/``two_shot`` for plain tensors, ``one_phase``/
    ``two_phase`` for registered ones). Mirrors the layout in ``ext/collectives``.
    """
    _validate_op(op)
    vec = 16 // elem_bytes
    if op == "all_reduce":
        if algorithm == "one_shot":
            return world_size * _round_up(numel, vec) * elem_bytes
        if algorithm == "one_phase":
            return 0
        chunk = max(_round_up(-(-numel // world_size), vec), vec)
        if algorithm == "two_phase":
            return world_size * chunk * elem_bytes
        return 2 * world_size * chunk * elem_bytes
    return world_size * _round_up(numel, vec) * elem_bytes


def plan_pieces(op: str, numel: int, elem_bytes: int, world_size: int, staging_bytes: int,
                algorithm: str = "two_shot") -> list[tuple[int, int]]:
    """Splits a message into pieces whose staging need fits ``staging_bytes``.

    Every rank computes the same pieces from the same arguments, so every rank launches
    the same kernels. Piece boundaries keep 16-byte alignment.

    Returns:
        ``(start, count)`` element ranges covering ``[0, numel)`` in order; empty when
        ``numel`` is 0.

    Raises:
        CollectiveArgumentError: ``staging_bytes`` cannot hold even a minimal piece.
    """
    if numel < 0:
        raise CollectiveArgumentError(f"numel must be >= 0, got {numel}")
    if numel == 0:
        return []
    if staging_bytes_needed(op, numel, elem_bytes, world_size, algorithm) <= staging_bytes:
        return [(0, numel)]
    align = _PIECE_ALIGN_BYTES // elem_bytes
    pieces = 1
    while True:
        pieces += 1
        piece = _round_up(-(-numel // pieces), align)
        if staging_bytes_needed(op, piece, elem_bytes, world_size, algorithm) <= staging_bytes:
            break
        if piece <= align:
            raise CollectiveArgumentError(
                f"staging_bytes={staging_bytes} is too small for any {op} piece on {world_size} "
                "GPUs; use at least 1 MiB"
            )
    return [(s, min(piece, numel - s)) for s in range(0, numel, piece)]


def bus_bandwidth_factor(op: str, world_size: int) -> float:
    """Bus bandwidth / algorithm bandwidth, as nccl-tests defines them.

    Algorithm bandwidth is message bytes / time, where the message is the all-reduce
    tensor, the all-gather output or the reduce-scatter input. Bus bandwidth scales it
    to the bytes each GPU must move over its links in the optimal algorithm, so it is
    comparable across ops and group sizes: ``2(n-1)/n`` for all-reduce, ``(n-1)/n``
    for all-gather and reduce-scatter.
    """
    _validate_op(op)
    n = world_size
    return 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
