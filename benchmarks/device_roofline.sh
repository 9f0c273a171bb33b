#!/usr/bin/env bash
# One call on nvidia-h200 (one GPU) for the kernel-roofline work (issue 27): the compiled kernels
# against the torch reference (tests/test_kernels_gpu.py) while every stage-profile variant is
# compiled in parallel (Triton's cache; 2^26 values specialize like 2^29), then, serially, the
# entry ladder (benchmarks/entry_ladder.py), the decode boundary (benchmarks/decode_boundary.py)
# and the per-stage floors of this tree and of OLD_SRC
# at 2^26 and 2^29 values (128 MiB and 1 GiB of bf16) per rank, P=2/4/8, the HBM copy in the same
# run. Results under $OUT.
#   OLD_SRC=.work/old_b6e bash benchmarks/device_roofline.sh      (carry .work/old_b6e)
# OLD_SRC is an older checkout's root (its src/ and its own benchmarks/stage_profile.py).
# Knobs: WORLDS, CONFIGS, NEW_SHAPES, OLD_SHAPES, TESTS (0: skip the GPU tests), TEST_TIMEOUT,
# LADDER and DECODE (0: skip those benchmarks), TEST_JOBS (pytest-xdist workers), WARM_JOBS.
# $OUT gets at most 8 files (the device tool's limit): logs stay in /tmp.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 ECHO_FLAG_TIMEOUT_S=20
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
WORLDS=${WORLDS:-2,4,8}; CONFIGS=${CONFIGS:-u4,c4-loc-bf16c,u8}
NEW_SHAPES=${NEW_SHAPES:-4096x4s4096,8192x4s4096,16384x4s4096,8192x4s2048,16384x4s2048,16384x4s1024}
OLD_SHAPES=${OLD_SHAPES:-8192x4s2048,16384x4s2048,16384x4s1024}
T0=$(date +%s)
if [ "${TESTS:-1}" = 1 ]; then
  PYTHONPATH=$PWD/src timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider \
    ${TEST_JOBS:+-n $TEST_JOBS} tests/test_kernels_gpu.py \
    > $OUT/pytest_kernels_gpu.txt 2>&1 &
  TESTS_PID=$!
fi
# warm-up: one process per (tree, P, config, shape), WARM_JOBS at a time, one rep at 2^26 values
jobs=$(mktemp)
for P in ${WORLDS//,/ }; do for c in ${CONFIGS//,/ }; do
  for s in ${NEW_SHAPES//,/ }; do echo "$PWD/src $PWD/benchmarks $P $c $s" >> $jobs; done
  [ -n "${OLD_SRC:-}" ] && for s in ${OLD_SHAPES//,/ }; do
    echo "$PWD/$OLD_SRC/src $PWD/$OLD_SRC/benchmarks $P $c $s" >> $jobs; done
done; done
mkdir -p /tmp/warm
xargs -P ${WARM_JOBS:-12} -L 1 sh -c 'PYTHONPATH=$0 timeout 400 python3 $1/stage_profile.py --numel 67108864 \
  --worlds $2 --configs $3 --shapes $4 --reps 1 --out /tmp/warm/$2-$3-$4-$$ > /dev/null 2>&1' < $jobs
echo "warm-up of $(wc -l < $jobs) variants in $(( $(date +%s) - T0 )) s"
if [ -n "${TESTS_PID:-}" ]; then wait $TESTS_PID; echo "kernels_gpu rc=$?"; tail -3 $OUT/pytest_kernels_gpu.txt; fi
T0=$(date +%s)
[ "${LADDER:-1}" = 1 ] && PYTHONPATH=$PWD/src timeout 240 python3 benchmarks/entry_ladder.py --out $OUT > /tmp/ladder.log 2>&1
echo "ladder rc=$? in $(( $(date +%s) - T0 )) s"
T0=$(date +%s)
[ "${DECODE:-1}" = 1 ] && PYTHONPATH=$PWD/src timeout 180 python3 benchmarks/decode_boundary.py --out $OUT > /tmp/decode.log 2>&1
echo "decode_boundary rc=$? in $(( $(date +%s) - T0 )) s"; tail -25 /tmp/decode.log
for numel in 67108864 536870912; do
  for tree in new ${OLD_SRC:+old}; do
    src=$PWD/src; bench=$PWD/benchmarks; shapes=$NEW_SHAPES
    [ "$tree" = old ] && src=$PWD/$OLD_SRC/src && bench=$PWD/$OLD_SRC/benchmarks && shapes=$OLD_SHAPES
    T0=$(date +%s)
    PYTHONPATH=$src timeout 300 python3 $bench/stage_profile.py --numel $numel --worlds $WORLDS \
      --configs $CONFIGS --shapes $shapes --budget-s 240 --label $tree-$numel --out $OUT \
      > /tmp/stages_$tree-$numel.log 2>&1
    echo "stage_profile $tree $numel rc=$? in $(( $(date +%s) - T0 )) s"
  done
done
python3 benchmarks/stage_table.py $OUT
