#!/usr/bin/env bash
# One GPU: the training loop's GPU tests, then the one-GPU loopback smoke run of
# bench/train_e2e.py (one rank of the TP=2 plan's job; the rest of the group stood in for
# by the loopback collective). Installs the carried liger-kernel wheel if there is one.
# Writes under $OUT (or bench/results/). Never changes clocks, power limits or modes.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUTDIR=${OUT:-bench/results}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit \
  --format=csv | tee "$OUTDIR/nvidia_smi.txt"
python3 -m pytest -q -p no:cacheprovider tests/exec/test_train_gpu.py \
  tests/exec/test_train_chain.py 2>&1 | tee "$OUTDIR/pytest_train_gpu.log" | tail -15
python3 -m torch.distributed.run --standalone --nproc_per_node 1 bench/train_e2e.py \
  --backend loopback --plan examples/plans/llama3b_tp2_h200.json --layers 4 --steps 4 \
  --warmup 1 --repeats 3 --json "$OUTDIR/train_e2e_1xh200_loopback.json" "$@" 2>&1 \
  | tee "$OUTDIR/train_e2e_smoke.log"
