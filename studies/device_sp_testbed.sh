#!/usr/bin/env bash
# Issue 20 item 5, one GPU call: the fidelity testbed trained (studies/device_testbed.sh, its
# recipe), then sequence-parallel Echo against the all-reduce on 307k held-out tokens (600
# BOS-started windows of 512, bf16) at simulated TP=8: SP naive 4-bit, SP echo4 (4-bit
# reduce-scatters compensated, all-gathers at gather_bits=8, the default), SP echo4 with 4-bit
# all-gathers and naive 4-bit reduce-scatters with 8-bit all-gathers; then the same windows
# without SP (16, 4, echo4) for the paired comparison; every row with its KL from the 16-bit
# model (--kl). (The run recorded in docs/results/2026-12-01-sp-testbed.md predates the 8-bit
# default: its echo4 row had 4-bit gathers.) Evaluations past DEADLINE seconds are
# skipped (and say so). Carry .work/data/gut108.{bin,json,val.bin,val.json}.
set -uo pipefail
source studies/device_env.sh
archive_results sptestbed     # results in $FINAL/sptestbed.tgz (device_env.sh)
START=$(date +%s); DEADLINE=${DEADLINE:-560}
QUICK=0 OUT=$OUT bash studies/device_testbed.sh || { pack; exit 1; }
pack
D=.work/data
CK=$(ls -d .work/testbed/checkpoints/step-* | sort -t- -k2 -n | tail -1)
export ECHO_BACKEND=reference   # pure torch on the GPU, bit-identical to the kernels: no cold Triton compiles
EV="python3 -m echo_tp.cli eval --model $CK --data $D/gut108.val.bin --bos --dtype bfloat16
    --context 511 --batch-size 32 --max-windows 600 --simulate ${P:-8} --kl --no-progress"
# context 511: BOS + 511 positions = 512, which splits over 8 ranks
run sp --sequence-parallel --comms 16 4 echo4 echo4:gather_bits=4 4:gather_bits=8
run nonsp --comms 16 4 echo4
echo "total $(( $(date +%s) - START )) s"
