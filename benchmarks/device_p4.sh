#!/usr/bin/env bash
# The P=4 measurements (exactness, all-reduce, end to end) in one device call on nvidia-h200-x4
# (run: `bash benchmarks/device_p4.sh`; every step has its own time limit, results under $OUT).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src ECHO_FLAG_TIMEOUT_S=20
nvidia-smi -L; nvidia-smi topo -m | head -6
# 1. compiled kernel forms vs torch on one GPU (in the background), exactness at P=4 against
#    the torch reference, CUDA graphs, two groups + soak, then the halves on p2p
CUDA_VISIBLE_DEVICES=3 timeout 170 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_kernels_gpu.py > $OUT/pytest_kernels_gpu.txt 2>&1 &
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_p2p_gpu.py \
  -k "4-fused or 4-off or 4-launch or soak" > $OUT/pytest.txt 2>&1
echo "pytest rc=$?"; tail -3 $OUT/pytest.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_p2p_gpu.py \
  -k "halves and x4" > $OUT/pytest_halves.txt 2>&1     # reduce-scatter / all-gather on p2p
echo "pytest -k halves rc=$?"; tail -3 $OUT/pytest_halves.txt
wait; tail -2 $OUT/pytest_kernels_gpu.txt
# 2. all-reduce latency, every method incl. auto, 64 KB .. 1 GB
timeout 150 python3 benchmarks/allreduce.py --world 4 --out $OUT --iters 30 --budget-s 130 \
  --methods nccl16,oneshot16,ref4,p2p8,p2p8-staged,p2p4,p2p4-staged,p2p4-launch,p2p4c,p2p4c-fp32,p2p4c-out,p2p4c-out-unfused,p2p4-graph,auto4,auto4c,auto4c-fp32 --stages \
  > $OUT/ar.log 2>&1
echo "allreduce rc=$?"; grep -A 14 "^### P=4" $OUT/ar.log
# 3. end to end at TP=4: TTFT (1 GB and small), decode, train, background load
timeout 220 torchrun --nproc-per-node 4 benchmarks/e2e.py --out $OUT --big-mb 1024 --iters 3 \
  --loads 0 0.5 0.75 1.0 --decode-iters 20 --order nccl16 echo4bf echo4 echo8 early8 \
  > $OUT/e2e.log 2>&1
echo "e2e rc=$?"; grep -v "^#loc" $OUT/e2e.log | grep "^|" | tail -20
