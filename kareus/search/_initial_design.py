"""The initial design: which configurations a search profiles before any model is fitted.

A search opens with the configurations a training job runs without kareus (the
systems' own configurations: [`system_config_indices`][kareus.search.system_config_indices]), then
fills the rest of its initial points with a space-filling design
([`maximin_design`][kareus.search.maximin_design]) or uniform random picks (as the public reference
artifact of the Kareus paper does): ``initial_design``. How many points it has depends on the budget
([`default_initial_size`][kareus.search.default_initial_size]): 16 for budgets of 32 profiles and
more, half the budget (at least 8) below, so that at the budgets real GPUs afford (a profile costs
seconds) the acquisition passes still get profiles to spend.
"""

from __future__ import annotations

import numpy as np

from kareus._check import check_count
from kareus.errors import ArgumentError
from kareus.model.config import ConfigSpace, ScheduleConfig

__all__ = ["default_initial_size", "initial_design", "maximin_design", "system_config_indices"]

#: Points of the initial design for budgets of ``2 * DEFAULT_INITIAL_SIZE`` and more.
DEFAULT_INITIAL_SIZE = 16
#: The fewest points of a default initial design (all of a smaller budget).
MIN_INITIAL_SIZE = 8


def default_initial_size(budget: int) -> int:
    """The initial design's size a search uses by default for ``budget`` profiles.

    Half the budget, between 8 and 16 points, and never more than the budget: 16 from 32
    profiles up (the size the emulated benchmark was measured with), 8 at 16 profiles
    (eight left for the acquisition passes), the whole budget at 8 profiles and below.
    At the budgets real GPUs afford (a profile costs about 1.5 s), a design of 16 would
    leave the surrogate nothing to choose; with half the budget the passes get the other
    half. Replayed on the measured 2x H200 grids (50 seeds), the search then finds the
    time optimum, or a configuration the grid's repeat noise cannot tell from it, within
    16 profiles in at least 98% of runs on every partition type, against 88% with the
    16-point design (``bench/small_budget.py``, docs/search.md).

    Args:
        budget: Profiles in all (>= 1).

    Returns:
        ``min(budget, max(8, min(16, budget // 2)))``.
    """
    budget = check_count("budget", budget)
    half = int(budget) // 2
    return min(int(budget), max(MIN_INITIAL_SIZE, min(DEFAULT_INITIAL_SIZE, half)))


def _categories(space: ConfigSpace) -> tuple[np.ndarray, int]:
    """Each configuration's category, the launch slot (sequential included) and, in a space
    of several collective backends, the backend: its index, and the number of categories."""
    backends = getattr(space, "backends", (None,))
    n_b = len(backends)
    slot_of = {name: i for i, name in enumerate(space.slots)}
    back_of = {b: i for i, b in enumerate(backends)}
    cat = [slot_of[c.launch_slot] * n_b + back_of[getattr(c, "backend", None)]
           for c in space.configs]
    return np.array(cat, dtype=float), len(space.slots) * n_b


def _unit_coordinates(space: ConfigSpace) -> np.ndarray:
    """Each configuration as (freq, SMs, category) in [0, 1] x [0, 1] x category index (the
    slot, and the backend in a space of several).

    Both frequency and SM count are linear. (A logarithmic SM scale, which samples the
    small SM counts where a collective's speed changes fastest more densely, gave worse
    16-point designs on the emulator: most of those configurations leave the collective
    exposed and are far from the front. At small budgets, a log scale or one spaced by
    the rank of each SM count was within the scatter of the linear one on the emulated
    development set and worse on the measured 2x H200 grids, whose optima sit at 16-24
    SMs; docs/search.md.)
    """
    cfgs = space.configs
    f = np.array([c.freq_mhz for c in cfgs], dtype=float)
    s = np.array([c.comm_sms for c in cfgs], dtype=float)
    sl, _ = _categories(space)

    def unit(v: np.ndarray) -> np.ndarray:
        span = v.max() - v.min()
        return (v - v.min()) / span if span > 0 else np.zeros_like(v)

    return np.column_stack([unit(f), unit(s), sl])


def maximin_design(space: ConfigSpace, n: int, *, seed: int = 0, tries: int = 64) -> list[int]:
    """A space-filling design of ``n`` distinct configurations (indices into ``space.configs``).

    Latin-hypercube samples in (frequency, SM count), with launch slots (sequential
    included; in a space of several collective backends, each slot-backend pair)
    balanced so each appears ``n // slots`` or ``n // slots + 1`` times; of
    ``tries`` such designs, the one whose closest pair of points is farthest apart
    (maximin; a differing slot counts as distance 1) is kept.

    Args:
        space: The configuration space.
        n: Points (capped at the space's size).
        seed: Random seed.
        tries: Candidate designs to choose among.
    """
    n = min(check_count("n", n), len(space))
    if n <= 0:
        return []
    rng = np.random.default_rng([seed, 7919])
    coords = _unit_coordinates(space)
    freqs = np.array(sorted(set(coords[:, 0])))
    sms = np.array(sorted(set(coords[:, 1])))
    _, n_slots = _categories(space)
    # Lookup from (freq level, sm level, slot) to config index.
    fi = np.searchsorted(freqs, coords[:, 0])
    si = np.searchsorted(sms, coords[:, 1])
    grid = np.full((len(freqs), len(sms), n_slots), -1, dtype=np.int64)
    grid[fi, si, coords[:, 2].astype(int)] = np.arange(len(coords))

    def nearest_level(levels: np.ndarray, x: np.ndarray) -> np.ndarray:
        return np.abs(levels[None, :] - x[:, None]).argmin(axis=1)

    best: list[int] | None = None
    best_score = -np.inf
    for _ in range(max(1, tries)):
        uf = (rng.permutation(n) + rng.random(n)) / n
        us = (rng.permutation(n) + rng.random(n)) / n
        slots = rng.permutation(np.resize(rng.permutation(n_slots), n))
        f_lv = nearest_level(freqs, uf)
        s_lv = nearest_level(sms, us)
        idx = grid[f_lv, s_lv, slots]
        chosen: list[int] = []
        used: set[int] = set()
        for i, j in enumerate(idx):
            if j < 0 or int(j) in used:
                # Collision on a coarse grid: the closest unused configuration.
                d = ((coords[:, 0] - freqs[f_lv[i]]) ** 2 + (coords[:, 1] - sms[s_lv[i]]) ** 2
                     + (coords[:, 2] != slots[i]))
                d[list(used)] = np.inf
                j = int(np.argmin(d))
            used.add(int(j))
            chosen.append(int(j))
        pts = coords[chosen]
        if n < 2:
            return chosen
        diff = pts[:, None, :2] - pts[None, :, :2]
        dist = np.sqrt((diff ** 2).sum(-1) + (pts[:, None, 2] != pts[None, :, 2]))
        np.fill_diagonal(dist, np.inf)
        score = float(dist.min())
        if score > best_score:
            best, best_score = chosen, score
    assert best is not None
    return best


def system_config_indices(space: ConfigSpace) -> list[int]:
    """The systems' own configurations, where they lie in ``space``.

    A training job without kareus runs the maximum clock with the GPU's default SM count
    for communication (NCCL's), sequential (Megatron-LM) or launched in the first slot
    (nanobatching); the other systems compared (Perseus and nanobatching + Perseus) keep
    these schedules and lower the clock. compose's ``system_configs`` returns the same
    configurations. A search opens its initial design with them: the fastest end of a
    front is often at the maximum clock, where the surrogates, which see time nearly flat
    in frequency once a collective is exposed, would not look, and a front missing its
    fastest point loses much of its hypervolume.

    Args:
        space: The configuration space.

    Returns:
        Indices into ``space.configs`` (sequential first); a configuration outside
        ``space`` is left out.
    """
    g = space.gpu
    f = g.max_clock_mhz if g.max_clock_mhz in space.freqs_mhz else max(space.freqs_mhz)
    sms = g.default_comm_sms if g.default_comm_sms in space.comm_sms else max(space.comm_sms)
    slots = [sl for sl in space.slots if sl is not None]
    # Systems communicate through NCCL: its capped form where the space has several backends.
    b = "nccl_capped" if "nccl_capped" in space.backends else space.backends[0]
    cands = [ScheduleConfig(f, sms, None, backend=b)] + (
        [ScheduleConfig(f, sms, slots[0], backend=b)] if slots else [])
    return [space.index(c) for c in cands if c in space]


def initial_design(space: ConfigSpace, size: int, *, kind: str = "maximin",
                   system_configs: bool = True, seed: int = 0) -> list[int]:
    """The configurations a search profiles first, in order.

    Args:
        space: The configuration space.
        size: Points in the design (at most the space's size).
        kind: ``"maximin"`` ([`maximin_design`][kareus.search.maximin_design], space-filling) or
            ``"random"`` (uniform, as the public reference artifact does).
        system_configs: Whether the design opens with
            [`system_config_indices`][kareus.search.system_config_indices] and fills the rest of its
            points with ``kind``.
        seed: Random seed.

    Returns:
        ``size`` distinct indices into ``space.configs``.

    Raises:
        ValueError: for an unknown ``kind``.
    """
    if kind not in ("maximin", "random"):
        raise ArgumentError(f"initial_design must be 'maximin' or 'random', got {kind!r}")
    opening = system_config_indices(space)[:size] if system_configs else []
    rest = size - len(opening)
    if rest <= 0:
        design: list[int] = []
    elif kind == "maximin":
        design = [i for i in maximin_design(space, rest, seed=seed) if i not in opening]
        if len(design) < rest:  # the design hit an opening point: top up from a larger one
            more = maximin_design(space, rest + len(opening), seed=seed)
            design += [i for i in more if i not in opening and i not in design]
    else:
        rng = np.random.default_rng([seed, 104729])
        n = len(space)
        free = np.setdiff1d(np.arange(n), opening) if opening else n
        design = [int(i) for i in rng.choice(free, rest, replace=False)]
    return opening + design[:rest]
