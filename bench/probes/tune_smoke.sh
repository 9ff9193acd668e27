#!/usr/bin/env bash
# One-GPU smoke run of the tuning path (kareus optimize --profiler nvml), so that the
# multi-GPU runs only measure. A world of one process: LoopbackCollective stands in for
# communication, so the figures are of the path, not of kareus (no collective is measured).
# Clocks are never changed (the frequency dimension is the default clock alone).
#
#   bash bench/probes/tune_smoke.sh OUTDIR
#
# 1. one partition type (fwd_attn, Llama 3.2 3B at TP=2 shapes), budget 8: search, logs,
#    frontiers.json, tune.json;
# 2. the same command again: resumes, measuring nothing;
# 3. the whole job (every partition type, the baselines, the outside work, composition),
#    budget 3: results.json, plan.json, tune.json.
set -uo pipefail
out=${1:?usage: bash bench/probes/tune_smoke.sh OUTDIR}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
job="--workload llama3.2-3b --tp 2 --pp 1 --microbatch-size 8 --seq-len 4096 --nanobatches 2"
run() {  # run LIMIT_S ARGS...: kareus optimize --profiler nvml under torchrun, one process
    local limit=$1; shift
    echo "\$ torchrun --standalone --nproc_per_node 1 -m kareus optimize --profiler nvml $*"
    timeout "$limit" torchrun --standalone --nproc_per_node 1 -m kareus optimize \
        --profiler nvml "$@" --quiet
    echo "exit status $?"
}
run 90 $job --types fwd_attn --budget 8 --out "$out/one_type"
run 40 $job --types fwd_attn --budget 8 --out "$out/one_type"
run 150 $job --microbatches 2 --budget 3 --out "$out/whole_job"
