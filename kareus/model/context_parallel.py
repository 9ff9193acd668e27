"""Which tokens a context-parallel rank holds: Megatron-Core's load-balanced layout.

Context parallelism (CP) splits every sequence over the ranks of a CP group. Causal
attention makes a token's work grow with its position (it attends to every earlier
token), so CP contiguous chunks would leave the last rank with most of the work. kareus
uses Megatron-Core's layout instead (``get_batch_on_this_cp_rank`` in
``megatron.core.utils``): each sequence is cut into ``2 x CP`` equal chunks and CP rank
``r`` holds chunks ``r`` and ``2 CP - 1 - r``, in that order, concatenated. Every rank then
has the same causal work (a short and a long prefix): over its two chunks of ``c`` tokens
it scores ``2 CP c^2`` query/key pairs, half of the ``CP``-th share of the whole score
matrix, which is what the partition model costs.

A rank's layer input is its two chunks concatenated (``seq_len / CP`` tokens); its RoPE
angles are those of the tokens' global positions (``cp_positions``); attention all-gathers
the keys and values of the group, orders them by position and masks causally by global
position; the gradients of the keys and values go back to their ranks by a
reduce-scatter.

Pure Python; no torch.
"""

from __future__ import annotations

from kareus.errors import ArgumentError

__all__ = ["cp_chunks", "cp_positions"]


def _check(cp: int, rank: int) -> None:
    if int(cp) < 1:
        raise ArgumentError(f"cp must be >= 1, got {cp}")
    if not 0 <= int(rank) < int(cp):
        raise ArgumentError(f"the CP rank must be in [0, {cp}), got {rank}")


def cp_chunks(cp: int, rank: int) -> tuple[int, ...]:
    """The chunks (of ``2 x cp`` per sequence) CP rank ``rank`` holds, in its order:
    ``(rank, 2 cp - 1 - rank)``; ``(0,)`` without context parallelism (the whole sequence)."""
    _check(cp, rank)
    if cp == 1:
        return (0,)
    return (int(rank), 2 * int(cp) - 1 - int(rank))


def cp_positions(seq_len: int, cp: int, rank: int) -> list[int]:
    """The global positions of the ``seq_len / cp`` tokens CP rank ``rank`` holds, in its
    order (its two chunks concatenated).

    Raises:
        ArgumentError: ``seq_len`` is not a multiple of ``2 x cp`` (with ``cp > 1``), or the
            rank is outside the group.
    """
    _check(cp, rank)
    if cp == 1:
        return list(range(int(seq_len)))
    if seq_len % (2 * cp):
        raise ArgumentError(f"seq_len={seq_len} is not divisible by 2 x CP = {2 * cp} "
                            "(Megatron-Core's load-balanced context-parallel chunks)")
    c = seq_len // (2 * cp)
    return [p for j in cp_chunks(cp, rank) for p in range(j * c, (j + 1) * c)]
