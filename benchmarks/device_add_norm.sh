#!/usr/bin/env bash
# One call on nvidia-h200 (one GPU) for the block boundary (issue 18 item 2): the compiled
# add + RMSNorm, norm-only and residual-in-the-all-reduce kernels against the torch reference
# (tests/test_kernels_gpu.py -k "rmsnorm or residual"), then benchmarks/add_norm.py (part
# 'kernel', and part 'boundary': P=4 simulated ranks, fused vs all-reduce + add_rmsnorm kernel
# vs all-reduce + torch add + RMSNorm). Results under $OUT.
#   bash benchmarks/device_add_norm.sh
# Knobs: ITERS (default 100), CONFIGS (default c4,u4), SHAPES (TOKENSxHIDDEN, comma-separated).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src ECHO_FLAG_TIMEOUT_S=20
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
T0=$(date +%s)
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py \
  -k "rmsnorm or residual" > $OUT/pytest_add_norm_gpu.txt 2>&1
echo "kernels_gpu rc=$? in $(( $(date +%s) - T0 )) s"; tail -3 $OUT/pytest_add_norm_gpu.txt
T0=$(date +%s)
timeout 300 python3 benchmarks/add_norm.py --out $OUT --iters ${ITERS:-100} \
  --configs ${CONFIGS:-c4,u4} ${SHAPES:+--shapes $SHAPES} > $OUT/add_norm.log 2>&1
echo "add_norm rc=$? in $(( $(date +%s) - T0 )) s"; cat $OUT/add_norm.log
