#!/usr/bin/env bash
# One device call on nvidia-h200-x2: GPU exactness (fused + staged p2p, one-shot, CUDA graph,
# two groups + 10^5-call soak; the reduce-scatter / all-gather halves on p2p), then the
# all-reduce benchmark at P=2 with every method and the kernel forms forced (fused, staged
# serial, staged in one launch). Results under $OUT. Run: `bash benchmarks/device_x2.sh`.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src ECHO_FLAG_TIMEOUT_S=20
nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.nccl.version())"
T0=$(date +%s)
timeout ${PYTEST_S:-300} python3 -m pytest -q -x -p no:cacheprovider tests/test_p2p_gpu.py \
  -k "not halves" > $OUT/pytest.txt 2>&1
echo "pytest rc=$? in $(( $(date +%s) - T0 )) s"; grep -v "^#loc" $OUT/pytest.txt | tail -15
# the reduce-scatter / all-gather halves on real ranks (p2p vs the reference communicator)
T0=$(date +%s)
timeout ${HALVES_S:-200} python3 -m pytest -q -p no:cacheprovider tests/test_p2p_gpu.py \
  -k "halves and x2" > $OUT/pytest_halves.txt 2>&1
echo "pytest -k halves rc=$? in $(( $(date +%s) - T0 )) s"; grep -v "^#loc" $OUT/pytest_halves.txt | tail -8
T0=$(date +%s)
METHODS=${METHODS:-nccl16,oneshot16,p2p4,p2p4-fused,p2p4-staged,p2p4-launch,p2p8,p2p4c,p2p4c-staged,p2p4c-fp32,p2p4c-out,p2p4-graph,auto4,auto4c,ref4}
timeout ${BENCH_S:-240} python3 benchmarks/allreduce.py --world 2 --out $OUT --iters 50 \
  --budget-s $(( ${BENCH_S:-240} - 40 )) --methods $METHODS > $OUT/ar.log 2>&1
echo "allreduce rc=$? in $(( $(date +%s) - T0 )) s"; grep -v "^#loc" $OUT/ar.log | grep -A 16 "^### P=2"; grep ERROR $OUT/ar.log | head -5
