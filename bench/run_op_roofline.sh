#!/usr/bin/env bash
# One GPU: install the carried liger-kernel wheel (if any), run the kernel GPU tests,
# then bench/op_roofline.py. Writes under $OUT (or bench/results/). Never changes clocks,
# power limits or modes.
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
  --format=csv
python3 -m pytest -q -p no:cacheprovider tests/exec/test_kernels_gpu.py \
  tests/exec/test_kernels.py tests/exec/test_torch_partition_gpu.py 2>&1 \
  | tee "$OUTDIR/pytest_kernels.log" | tail -15
python3 bench/op_roofline.py --json "$OUTDIR/op_roofline_h200.json" "$@" 2>&1 \
  | tee "$OUTDIR/op_roofline.log"
