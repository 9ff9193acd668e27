# %% [markdown]
# # kareus tutorial: from a workload to an executable plan, on the emulated GPU
#
# This walks through kareus's Python API step by step. Everything runs on a laptop: the
# measurements come from the embedded emulated GPU (a physical model of time and power),
# so every figure printed here is **emulated**. On real GPUs the same objects take an
# `NVMLProfiler` instead. The notebook `examples/tutorial.ipynb` holds the same cells.

# %%
import os

import kareus
from kareus.model import ConfigSpace, ScheduleConfig, Workload, build_partitions
from kareus.profilers.emulator import EmulatedProfiler
from kareus.search import MultiPassSearch
from kareus.workflow import compose_systems

OUT = os.environ.get("KAREUS_TUTORIAL_OUT", "kareus-tutorial")
os.makedirs(OUT, exist_ok=True)
print("kareus", kareus.__version__)

# %% [markdown]
# ## 1. A workload and its partitions
#
# A workload is a model preset, its parallelism and its batch. kareus cuts each layer into
# *partitions*: one collective (here the tensor-parallel all-reduce) beside the
# computation of the next nanobatch, which does not depend on it. Partitions of one type
# share one configuration, so the search runs once per type.

# %%
workload = Workload.preset("llama3.2-3b", tp=4, pp=2, microbatch_size=8, seq_len=4096,
                           num_microbatches=8)
partitions = build_partitions(workload)
print(partitions)
attn = partitions["fwd_attn"]
print("launch slots of fwd_attn:", [s.name for s in attn.slots])

# %% [markdown]
# ## 2. Measuring one partition
#
# A `ScheduleConfig` is the three knobs: SM clock, SMs given to the collective, and the
# launch slot (`None` = sequential, after all computation, as Megatron-LM does). The
# emulated profiler answers with time and energy over the partition's GPUs.

# %%
profiler = EmulatedProfiler("h200-sxm", seed=0)
for config in [ScheduleConfig(1980, 32, None), ScheduleConfig(1980, 32, "attn_norm"),
               ScheduleConfig(1980, 8, "qkv"), ScheduleConfig(1980, 2, "qkv")]:
    print(f"{str(config):32} -> {profiler.measure(attn, config)}")

# %% [markdown]
# ## 3. Searching one partition type
#
# The space is frequency x SM count x (slots + sequential): thousands of configurations.
# `MultiPassSearch` measures a space-filling initial design, then batches chosen by
# hypervolume-improvement passes on Gaussian-process surrogates and exploration
# passes, and stops when the measured front stops improving. `ask()`/`tell()` let any
# measurement source drive it; `run()` is the convenience loop. `log=` keeps every measurement in a JSONL
# file, and `resume=` continues a killed search from it.

# %%
space = ConfigSpace(attn, profiler.gpu)
print(space)
search = MultiPassSearch(space, budget=48, seed=0, resume=os.path.join(OUT, "fwd_attn.jsonl"))
frontier = search.run(profiler, attn)
print(frontier)
for obs in frontier.points[:5]:
    print(f"  {obs.time_s * 1e3:7.3f} ms  {obs.energy_j:7.3f} J  {obs.config}")

# %% [markdown]
# ## 4. Composing microbatch and iteration frontiers, against the baselines
#
# Partition frontiers combine (at one frequency per microbatch computation) into
# microbatch frontiers, and those into the iteration frontier over the 1F1B pipeline with
# Perseus's time-cost tradeoff algorithm. The baselines are restricted spaces run through
# the same machinery. Here kareus's other partition types get a small search budget so the
# tutorial stays quick; `kareus.workflow.optimize` does all of this in one call.

# %%
def small_search(profiler, partition):
    return MultiPassSearch(ConfigSpace(partition, profiler.gpu), budget=32,
                           seed=0).run(profiler, partition, progress=False)


result = compose_systems(workload, profiler, search=small_search,
                         kareus_frontiers={"fwd_attn": frontier})
print(result.summary())

# %% [markdown]
# ## 5. Selecting a plan
#
# Each frontier point is a `Plan`: a frequency per (stage, microbatch, phase) computation
# and a configuration per partition type. Pick the fastest, the lowest-energy, or the best
# under a deadline or an energy budget; plans are versioned JSON with a digest that ranks
# compare before use.

# %%
kareus_frontier = result["kareus"]
fastest = kareus_frontier.max_throughput()
deadline = fastest.time_s * 1.05
plan = kareus_frontier.select(deadline_s=deadline)
print(f"within {deadline:.3f} s: {plan.time_s:.3f} s and {plan.energy_j:,.0f} J "
      f"(fastest: {fastest.time_s:.3f} s, {fastest.energy_j:,.0f} J)")
plan.save(os.path.join(OUT, "plan.json"))
print(kareus.compose.plan.Plan.load(os.path.join(OUT, "plan.json")).summary())

# %% [markdown]
# ## 6. Plotting
#
# Frontiers have a `plot()`; here the five systems' iteration frontiers side by side.

# %%
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(7, 5))
for name in result:
    result[name].plot(ax, label=name)
ax.legend()
fig.savefig(os.path.join(OUT, "frontiers.png"), dpi=100)
print("saved", os.path.join(OUT, "frontiers.png"))
