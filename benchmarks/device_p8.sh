#!/usr/bin/env bash
# P=8 in one device call on nvidia-h200-x8 (run: `bash benchmarks/device_p8.sh`; every step
# has its own time limit, results under $OUT): exactness at P=8 against the torch reference,
# the all-reduce benchmark at P=8 (64 MB - 1 GB), e2e at TP=8 idle and at 100% background load.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src ECHO_FLAG_TIMEOUT_S=20
nvidia-smi -L; nvidia-smi topo -m | head -10
# 1. exactness at P=8: the exactness worker on 8 ranks (fused kernel; stage kernels with
#    reduce and tail serial and in one launch)
timeout 280 python3 - > $OUT/exact_p8.txt 2>&1 <<'PY'
import sys
sys.path[:0] = ["tests", "benchmarks"]
from common import spawn_nccl
from test_p2p_gpu import CASES, exactness_worker
for form, overlap in (("fused", None), ("staged", "off"), ("staged", "launch")):
    res = spawn_nccl(8, exactness_worker, CASES[:8] + CASES[-3:], 2, None, True, form,
                     overlap)
    bad = [(r, row) for r, rows in enumerate(res) for row in rows
           if row.get("error") or row["y"] or row["m1"] or row["m2"]]
    print(f"form={form} overlap={overlap}: {'EXACT' if not bad else bad[:4]}", flush=True)
PY
echo "exact rc=$?"; grep -E "form=|Error" $OUT/exact_p8.txt | tail -4
# 2. all-reduce latency at P=8, 64 MB .. 1 GB
timeout 150 python3 benchmarks/allreduce.py --world 8 --out $OUT --iters 30 --budget-s 130 \
  --min-mb 64 --methods nccl16,p2p8,p2p4,p2p4c,p2p4c-fp32,p2p4c-out,auto4,auto4c,auto4c-fp32 \
  > $OUT/ar.log 2>&1
echo "allreduce rc=$?"; grep -A 10 "^### P=8" $OUT/ar.log
# 3. end to end at TP=8: TTFT (1 GB), train, idle and 100% background load
timeout 170 torchrun --nproc-per-node 8 benchmarks/e2e.py --out $OUT --big-mb 1024 --iters 3 \
  --cases prefill train --loads 0 1.0 --order nccl16 echo4bf echo4 echo8 > $OUT/e2e.log 2>&1
echo "e2e rc=$?"; grep -v "^#loc" $OUT/e2e.log | grep "^|" | tail -12
