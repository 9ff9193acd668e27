"""The attention work of packed documents.

Training data is often packed: each sequence of ``seq_len`` tokens holds several documents
back to back, and the attention masks them (each token attends to the earlier tokens of its
own document only: torchtitan's FlexAttention / VarlenAttention ``block_causal``). A
block-sparse kernel then computes the score pairs within documents only: for documents of
``L_1, L_2, ...`` tokens, ``sum L_i^2 / 2`` pairs per sequence instead of ``seq_len^2 / 2``.

A [`Workload`][kareus.model.Workload] says so with ``document_tokens``: the cost model cuts
each sequence into documents of that many tokens (the last one the remainder) and costs
their causal attention ([`document_pairs`][kareus.model.document_pairs]). As
``sum L_i^2 = seq_len x (sum L_i^2 / sum L_i)``, documents of varied lengths do the same
work as documents all of length ``sum L_i^2 / sum L_i``, each token's document length
averaged over the tokens; [`document_tokens_of`][kareus.model.document_tokens_of] measures
it from a batch's positions. (It is longer than the documents' plain mean: long documents
hold more tokens.)

No torch: positions are given as rows of integers.
"""

from __future__ import annotations

from collections.abc import Iterable

from kareus.errors import ArgumentError

__all__ = ["document_pairs", "document_tokens_of"]


def document_pairs(seq_len: int, document_tokens: int | None) -> float:
    """Causal score pairs of one sequence of ``seq_len`` tokens, counted as the cost model
    counts causal attention (``s^2 / 2`` for ``s`` tokens): over the whole sequence
    (``document_tokens=None``), or over documents of ``document_tokens`` tokens each, the
    last one the remainder.

    Raises:
        ArgumentError: a length below 1.
    """
    if seq_len < 1 or (document_tokens is not None and document_tokens < 1):
        raise ArgumentError(f"seq_len and document_tokens must be >= 1, got {seq_len} and "
                            f"{document_tokens}")
    if document_tokens is None or document_tokens >= seq_len:
        return 0.5 * seq_len * seq_len
    whole, rest = divmod(seq_len, document_tokens)
    return 0.5 * (whole * document_tokens * document_tokens + rest * rest)


def document_tokens_of(positions: Iterable[Iterable[int]]) -> float:
    """The document length whose attention work equals that of a batch's documents:
    ``sum L_i^2 / sum L_i`` over its documents (a document starts where its position is
    0; tokens before a sequence's first 0 are a document too), the value to give a
    workload's ``document_tokens`` (rounded) for data like this batch.

    Args:
        positions: The batch's RoPE positions, ``[batch, seq]`` as rows of integers
            (``tensor.tolist()``).

    Raises:
        ArgumentError: no tokens.
    """
    squares = tokens = 0
    for row in positions:
        length = 0
        for p in row:
            if int(p) == 0 and length:
                squares += length * length
                tokens += length
                length = 0
            length += 1
        squares += length * length
        tokens += length
    if not tokens:
        raise ArgumentError("document_tokens_of needs positions of at least one token")
    return squares / tokens
