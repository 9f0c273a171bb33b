#!/usr/bin/env bash
# One call on nvidia-h200 (one GPU) after a kernel change: the compiled kernels against the torch
# reference (tests/test_kernels_gpu.py: simulated ranks, edge inputs included), then the per-stage
# floors of this tree and, with OLD_SRC, of an older one in the same call. Results under $OUT.
#   OLD_SRC=.work/old_src/src bash benchmarks/device_one_gpu.sh
# Knobs: NUMEL (values per rank, default 256M), WORLDS, CONFIGS, SHAPES, BUDGET_S (per tree).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 ECHO_FLAG_TIMEOUT_S=20
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
T0=$(date +%s)
PYTHONPATH=$PWD/src timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py \
  > $OUT/pytest_kernels_gpu.txt 2>&1
echo "kernels_gpu rc=$? in $(( $(date +%s) - T0 )) s"; tail -3 $OUT/pytest_kernels_gpu.txt
ARGS="--numel ${NUMEL:-268435456} --worlds ${WORLDS:-2,4} --configs ${CONFIGS:-u4,c4-loc-bf16c}
      --shapes ${SHAPES:-2048x4,8192x4s2048,16384x4s2048} --budget-s ${BUDGET_S:-90} --out $OUT"
for tree in new ${OLD_SRC:+old}; do
  src=$PWD/src; [ "$tree" = old ] && src=$PWD/$OLD_SRC
  T0=$(date +%s)
  PYTHONPATH=$src timeout $(( ${BUDGET_S:-90} + 60 )) python3 benchmarks/stage_profile.py $ARGS \
    --label $tree > $OUT/stages_$tree.log 2>&1
  echo "stage_profile $tree rc=$? in $(( $(date +%s) - T0 )) s"
done
python3 - <<'PY'
import json, os
best = {}
for lab in ("new", "old"):
    p = os.path.join(os.environ["OUT"], f"stages-{lab}.json")
    if not os.path.exists(p):
        continue
    for r in json.load(open(p))["rows"]:
        if "sum_ms" in r:
            k = (lab, r["P"], r["config"])
            if k not in best or r["sum_ms"] < best[k]["sum_ms"]:
                best[k] = r
for (lab, P, cfg), r in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
    print(lab, f"P={P}", cfg, f'{r["tile"]}x{r["warps"]}s{r.get("step")}',
          *(f'{k}={r[k]:.3f}' for k in ("entry_ms", "reduce_ms", "tail_ms", "sum_ms")))
PY
