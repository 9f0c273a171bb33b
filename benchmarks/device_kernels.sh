#!/usr/bin/env bash
# One device call on nvidia-h200-x2 after a kernel change: the compiled (hardware) forms against
# torch on one GPU, per-stage cost on one GPU for this tree and an older one side by side
# (OLD_SRC, optional: a copy of another commit's src/), P=2 exactness against the torch
# reference, then the P=2 all-reduce benchmark. Results under $OUT.
#   OLD_SRC=.work/old_src/src bash benchmarks/device_kernels.sh
# Knobs: ONE_GPU=0 (skip the one-GPU phase), STAGE_PROFILE=0, PYTEST_K, PYTEST_S, METHODS,
# MIN_MB, BENCH_S, SHAPES.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src ECHO_FLAG_TIMEOUT_S=20
nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.nccl.version())"
T0=$(date +%s)
if [ "${ONE_GPU:-1}" = 1 ]; then
( CUDA_VISIBLE_DEVICES=0 timeout 170 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_kernels_gpu.py > $OUT/pytest_kernels_gpu.txt 2>&1; echo "kernels_gpu rc=$?" \
    >> $OUT/pytest_kernels_gpu.txt
  [ "${STAGE_PROFILE:-1}" = 1 ] && CUDA_VISIBLE_DEVICES=0 timeout 120 python3 \
    benchmarks/stage_profile.py --out $OUT --label new \
    --budget-s 100 --worlds 2 --configs u4,c4-loc-bf16c,c4-loc-f32 \
    --shapes ${SHAPES:-2048x4,1024x4,8192x4s2048,8192x4s1024,16384x4s2048} > $OUT/stages_new.log 2>&1 ) &
if [ -n "${OLD_SRC:-}" ]; then
  CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$PWD/$OLD_SRC timeout 200 python3 benchmarks/stage_profile.py \
    --out $OUT --label old --budget-s 180 --shapes 1024x4,2048x4 > $OUT/stages_old.log 2>&1 &
fi
wait
fi
echo "one-GPU phase in $(( $(date +%s) - T0 )) s"; tail -3 $OUT/pytest_kernels_gpu.txt
T0=$(date +%s)
timeout ${PYTEST_S:-150} python3 -m pytest -q -x -p no:cacheprovider tests/test_p2p_gpu.py \
  -k "${PYTEST_K:-2-fused or 2-off or 2-launch}" > $OUT/pytest_p2p.txt 2>&1
echo "p2p pytest rc=$? in $(( $(date +%s) - T0 )) s"; grep -v "^#loc" $OUT/pytest_p2p.txt | tail -4
T0=$(date +%s)
METHODS=${METHODS:-nccl16,p2p4,p2p4-staged,p2p4-launch,p2p8,p2p8-launch,p2p4c,p2p4c-staged,p2p4c-fp32,p2p4c-out,auto4,auto4c,auto4c-fp32}
timeout ${BENCH_S:-200} python3 benchmarks/allreduce.py --world 2 --out $OUT --iters 50 \
  --budget-s $(( ${BENCH_S:-200} - 40 )) --methods $METHODS --min-mb ${MIN_MB:-0} --stages \
  > $OUT/ar.log 2>&1
echo "allreduce rc=$? in $(( $(date +%s) - T0 )) s"; grep -v "^#loc" $OUT/ar.log | grep -A 40 "^### P=2" | grep -v "^$"; grep ERROR $OUT/ar.log | head -5
python3 - <<'EOF'
import json, os
for lab in ("old", "new"):
    p = os.path.join(os.environ["OUT"], f"stages-{lab}.json")
    if os.path.exists(p):
        for r in json.load(open(p))["rows"]:
            print(lab, r.get("P"), r.get("config"), f'{r.get("tile")}x{r.get("warps")}s{r.get("step")}',
                  *(f'{k}={r[k]}' for k in ("entry_ms", "reduce_ms", "tail_ms", "sum_ms", "error") if k in r))
EOF
