"""The surrogates' features: physical knobs, and ratios that line up where a collective hides.

ConfigSpace gives each configuration's physical features (clock in MHz, SM count, launch
slot position and intensity, sequential); [`search_features`][kareus.search.search_features] adds
the SM count per relative clock (and its square) and a datasheet estimate of the balance between the
collective's time and the computation it can hide behind. Features are physical, never
list indices, so a model can interpolate between the configurations it measured.
"""

from __future__ import annotations

import math

import numpy as np

from kareus.model.config import ConfigSpace

__all__ = ["EXTRA_COLUMNS_FROM", "search_features"]

#: The first column of :func:`search_features` past the fixed ones: ConfigSpace's columns
#: after its five physical features (today the collective backend, in a space of several)
#: start here, so the derived columns 5-7 keep their positions in every space.
EXTRA_COLUMNS_FROM = 8


def search_features(space: ConfigSpace) -> np.ndarray:
    """The surrogates' features, one row per configuration of ``space``.

    Columns: 0-4 ConfigSpace's physical features (MHz, SMs, slot position, slot log
    intensity, sequential); 5 the SM count per relative clock, ``comm_sms x max MHz /
    MHz``; 6 the hide balance (``_hide_balance``); 7 the SM count per relative clock
    squared, ``comm_sms x (max MHz / MHz)^2``; from ``EXTRA_COLUMNS_FROM`` (8) on,
    ConfigSpace's further columns: in a space of several collective backends, the
    backend's position in ``space.backends`` (absent in a space of one).

    Whether a collective hides behind the computation is a balance between its speed
    (about proportional to its SMs until the link saturates) and the computation's
    (about proportional to the clock), so the best SM count grows with the clock: a
    diagonal ridge in (MHz, SMs), which axis-aligned trees need many splits to follow
    and which is a single threshold in the ratio. How fast it grows depends on the
    partition: on the emulated A100, ``qwen3-1.7b``'s attention all-reduces want 29 SMs
    at 1410 MHz and 11 at 900 MHz (about clock^2.2), other partitions the same few SMs at
    every clock. Columns 5 and 7 are that ridge for an exponent of 1 and of 2; the trees
    split on whichever lines the data up. The hide balance also accounts for the launch
    slot and for how compute-bound the overlapped ops are.
    """
    base = space.features()
    rel = max(space.freqs_mhz) / base[:, 0]
    return np.column_stack([base[:, :5], base[:, 1] * rel, _hide_balance(space),
                            base[:, 1] * rel ** 2, base[:, 5:]])


def _hide_balance(space: ConfigSpace) -> np.ndarray:
    """log(rough collective time / rough computation time from the launch slot on).

    A datasheet-only estimate, per configuration: the collective's bus bytes over its SM
    count (its speed grows with SMs until the link saturates, and weakly with the clock),
    against the roofline time of the ops from the slot to the end at that clock (the
    compute-bound part scales with 1/clock, the memory-bound part does not). The
    collective hides where this crosses a partition-specific constant, the same for every
    clock and slot, so the trees find the hinge with one split on it instead of one per
    (clock, slot). Sequential configurations get one more than the largest value.
    """
    part, gpu = space.partition, space.gpu
    comm = part.comm_op
    out = np.zeros(len(space), dtype=np.float64)
    if comm is None or not part.compute_ops:
        return out
    fmax = float(gpu.max_clock_mhz)
    peak = gpu.bf16_peak_tflops * 1e12
    hbm = gpu.hbm_bandwidth_gbps * 1e9
    comp = np.array([op.flops / peak for op in part.compute_ops])
    mem = np.array([op.bytes_moved / hbm for op in part.compute_ops])
    start = {s.name: s.index for s in part.slots}
    bus = max(float(comm.bus_bytes), 1.0)
    seq = np.zeros(len(space), dtype=bool)
    for i, c in enumerate(space.configs):
        if c.launch_slot is None:
            seq[i] = True
            continue
        k = start[c.launch_slot]
        scale = fmax / c.freq_mhz
        t_after = float(np.maximum(comp[k:] * scale, mem[k:]).sum()) or 1e-12
        out[i] = math.log(bus * scale ** 0.25 / c.comm_sms / t_after)
    if seq.any():
        out[seq] = (out[~seq].max() + 1.0) if (~seq).any() else 0.0
    return out
