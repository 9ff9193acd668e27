"""kareus: joint communication-SM, launch-slot and frequency scheduling for LLM training.

kareus cuts a training iteration into partitions (a collective next to computation
that does not depend on it), finds each partition type's time-energy Pareto
frontier with multi-objective Bayesian optimisation, composes those frontiers into
microbatch and iteration frontiers over the pipeline schedule, and applies the
chosen point in a PyTorch training loop.

Importing kareus is light: it imports neither torch, xgboost nor pynvml.
"""

from __future__ import annotations

from kareus import errors
from kareus.errors import (
    ConfigError,
    HardwareError,
    InvalidSMCountError,
    KareusError,
    PlanError,
    UnknownPresetError,
    UnknownSlotError,
    UnsupportedFrequencyError,
    WorkloadError,
)
from kareus.exec import Profiler
from kareus.model import (
    CommKind,
    CommOp,
    Computation,
    ComputeOp,
    ConfigSpace,
    GPUSpec,
    Measurement,
    ModelArch,
    OpKind,
    OpPartition,
    Parallelism,
    Partition,
    PartitionSet,
    PipelineSchedule,
    ScheduleConfig,
    TransformerPartition,
    Workload,
    build_partitions,
    get_gpu,
    get_schedule,
    one_f_one_b,
)
from kareus.search import hypervolume, hypervolume_improvement, pareto_front, pareto_mask

__version__ = "0.1.0"

__all__ = [
    "CommKind",
    "CommOp",
    "Computation",
    "ComputeOp",
    "ConfigError",
    "ConfigSpace",
    "GPUSpec",
    "HardwareError",
    "InvalidSMCountError",
    "KareusError",
    "Measurement",
    "ModelArch",
    "OpKind",
    "OpPartition",
    "Parallelism",
    "Partition",
    "PartitionSet",
    "PipelineSchedule",
    "PlanError",
    "Profiler",
    "ScheduleConfig",
    "TransformerPartition",
    "UnknownPresetError",
    "UnknownSlotError",
    "UnsupportedFrequencyError",
    "Workload",
    "WorkloadError",
    "__version__",
    "build_partitions",
    "errors",
    "get_gpu",
    "get_schedule",
    "hypervolume",
    "hypervolume_improvement",
    "one_f_one_b",
    "pareto_front",
    "pareto_mask",
]
