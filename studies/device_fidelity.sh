#!/usr/bin/env bash
# Issue 19 items 3-4, one GPU call after studies/device_testbed.sh on the same machine: the main
# comm configs on 307k held-out tokens (600 BOS-started windows of 512, bf16) at simulated TP=8
# (the fused p2p kernels of every virtual rank), per-window NLLs for the paired bootstrap,
# last-word accuracy; the testbed rotated (QuaRot-style, folded into the weights); TP=4; the
# shipped demo model on WikiText-2 (never trained on), as far as the call's time allows.
# Carry .work/data/gut108.{bin,json,val.bin,val.json} and .work/data/wiki8k.{bin,json}.
# Each eval writes its own JSON; evals past the deadline are skipped (and say so).
set -uo pipefail
source studies/device_env.sh
archive_results fidelity     # results in $FINAL/fidelity.tgz (device_env.sh)
record_env "$OUT"
D=.work/data
CK=$(ls -d .work/testbed/checkpoints/step-* | sort -t- -k2 -n | tail -1)
echo "testbed checkpoint: $CK"
START=$(date +%s); DEADLINE=${DEADLINE:-500}
EV="python3 -m echo_tp.cli eval --bos --dtype bfloat16 --context 512 --batch-size 32 --kl
    --last-word --no-progress --calibration-windows 8"
TB="--model $CK --data $D/gut108.val.bin --calibration-data $D/gut108.bin --max-windows 600"
run tp8 $TB --simulate 8 --comms 16 4 8 echo4 echo4-output echo4:g=64 echo4:g=32 early8 \
    'echo4:policy=telemetry-rel@4.6' 'echo4:policy=telemetry@4.6' \
    'echo4:policy=telemetry-rel@5.0' 'echo4:policy=telemetry-rel@5.5'
run tp8-rot $TB --simulate 8 --rotate 0 --comms 16 4 echo4 echo4:g=64 early8
run tp4 $TB --simulate 4 --comms 16 4 8 echo4 echo4-output echo4:g=64 early8 \
    'echo4:policy=telemetry-rel@4.6' 'echo4:policy=telemetry-rel@5.0'
DM="--model src/echo_tp/assets/models/demo-8k --data $D/wiki8k.bin --calibration-data $D/gut108.bin"
run demo-tp4 $DM --simulate 4 --max-windows 600 --comms 16 4 8 echo4 echo4-output echo4:g=64 \
    early8 'echo4:policy=telemetry-rel@4.6' 'echo4:policy=telemetry-rel@5.0'
echo "total $(( $(date +%s) - START )) s"
