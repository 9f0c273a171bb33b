#!/usr/bin/env bash
# Issue 19 in one GPU call (a fresh machine forgets the checkpoint between calls): the GPU test
# of the simulated communicator's fused path, the testbed (studies/device_testbed.sh), then the
# evaluations (studies/device_fidelity.sh) until ~560 s. Results: $OUT/gpu-test.txt,
# $OUT/testbed.tgz, $OUT/fidelity.tgz. Carry .work/data/gut108.* and .work/data/wiki8k.*.
set -uo pipefail
source studies/device_env.sh
FINAL=$OUT; T0=$(date +%s)
python3 -m pytest -q -x tests/test_kernels_gpu.py -k simulated_communicator \
    > "$FINAL/gpu-test.txt" 2>&1 || { echo "fused simulated path FAILED: evals use the reference";
    export ECHO_BACKEND=reference; }
tail -1 "$FINAL/gpu-test.txt"
W=/tmp/issue19-testbed; rm -rf $W; mkdir -p $W
OUT=$W QUICK=0 bash studies/device_testbed.sh; tar -czf "$FINAL/testbed.tgz" -C $W .
echo "testbed done at $(( $(date +%s) - T0 )) s"
OUT=$FINAL DEADLINE=$(( ${LIMIT:-560} - ($(date +%s) - T0) - 60 )) bash studies/device_fidelity.sh
