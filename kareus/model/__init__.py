"""Value objects of kareus: GPUs, ops, workloads, partitions, configurations, schedules.

The decoder layer's op order (which ops run in which segment, where the collectives sit:
[`DECODER_LAYER`][kareus.model.DECODER_LAYER]) is written once, here, for the partition model
and the runtime schedule alike. Also the role contracts the policy layers need ([`Partition`][kareus.model.Partition],
[`Profiler`][kareus.model.Profiler]) and [`Dag`][kareus.model.Dag], the one DAG (topological order,
longest paths) that the pipeline schedules and the iteration composer share. Nothing here touches
hardware; everything runs on any CPU.
"""

from __future__ import annotations

from kareus.model.config import FEATURE_NAMES, ConfigSpace, ScheduleConfig
from kareus.model.context_parallel import cp_chunks, cp_positions
from kareus.model.dag import Dag
from kareus.model.decoder import (
    ATTENTION_SEGMENT,
    DECODER_LAYER,
    SP_DECODER_LAYER,
    LayerCollective,
    LayerPhase,
    LayerSegment,
    decoder_layer,
    layer_collectives,
    moe_decoder_layer,
)
from kareus.model.documents import document_pairs, document_tokens_of
from kareus.model.gpu import GPU_PRESETS, GPUSpec, get_gpu, gpu_names
from kareus.model.measurement import Measurement
from kareus.model.moe import MoEArch
from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind
from kareus.model.partition import (
    LaunchSlot,
    OpPartition,
    OutsideWork,
    Partition,
    PartitionSet,
    TransformerPartition,
    build_partitions,
    launch_slots,
)
from kareus.model.pipeline import (
    Computation,
    PipelineSchedule,
    get_schedule,
    gpipe,
    one_f_one_b,
)
from kareus.model.profiler import Profiler, ProfilerWrapper
from kareus.model.workload import (
    MODEL_PRESETS,
    RANK_ORDERS,
    RECOMPUTE_POLICIES,
    ModelArch,
    Parallelism,
    Workload,
    get_model,
    model_names,
)

__all__ = [
    "ATTENTION_SEGMENT",
    "DECODER_LAYER",
    "SP_DECODER_LAYER",
    "FEATURE_NAMES",
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "CommKind",
    "CommOp",
    "Computation",
    "ComputeOp",
    "ConfigSpace",
    "Dag",
    "GPUSpec",
    "LaunchSlot",
    "LayerCollective",
    "LayerPhase",
    "LayerSegment",
    "Measurement",
    "ModelArch",
    "MoEArch",
    "OpKind",
    "OpPartition",
    "OutsideWork",
    "Parallelism",
    "Partition",
    "PartitionSet",
    "PipelineSchedule",
    "Profiler",
    "ProfilerWrapper",
    "ScheduleConfig",
    "TransformerPartition",
    "RANK_ORDERS",
    "RECOMPUTE_POLICIES",
    "Workload",
    "build_partitions",
    "cp_chunks",
    "cp_positions",
    "decoder_layer",
    "document_pairs",
    "document_tokens_of",
    "get_gpu",
    "get_model",
    "get_schedule",
    "gpipe",
    "gpu_names",
    "launch_slots",
    "layer_collectives",
    "model_names",
    "moe_decoder_layer",
    "one_f_one_b",
]
