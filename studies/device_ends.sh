#!/usr/bin/env bash
# Issue 19 item 4, the default's gap: the first and last sites at 8 bits ('ends8', since this
# run the default: EchoConfig.edge_bits = 8) against every site at 4 bits (edge_bits=0),
# 'first8', 'last8' and the telemetry policy, and outlier values kept
# out of the packet (studies/outlier_packet.py, the reference all-reduce), on the testbed's 307k
# held-out tokens (600 BOS-started windows of 512, bf16), every row with its KL from the 16-bit
# model. Two GPU calls on one machine, chained (the checkpoint stays in .work/testbed/):
#   PART=1 bash studies/device_ends.sh   # the testbed trained (its recipe), simulated TP=8 rows
#   PART=2 bash studies/device_ends.sh   # the outlier packet and more rows at TP=8, TP=4 rows,
#                                        # simulated TP=4 training speed, the GPU tests
# Carry .work/data/gut108.{bin,json,val.bin,val.json}. Evaluations past DEADLINE are skipped.
set -uo pipefail
source studies/device_env.sh
PART=${PART:-1}
archive_results ends$PART     # results in $FINAL/endsN.tgz (device_env.sh)
START=$(date +%s); DEADLINE=${DEADLINE:-540}
D=.work/data
EV="python3 -m echo_tp.cli eval --bos --dtype bfloat16 --context 512 --batch-size 32 --kl
    --no-progress --calibration-windows 8"
U=echo4:edge_bits=0      # every site at 4 bits (the default before this run)
POL="echo4:policy=ends8 $U,policy=last8 echo4:policy=telemetry-rel@4.6"
if [ "$PART" = 1 ]; then
  QUICK=0 OUT=$OUT bash studies/device_testbed.sh || { pack; exit 1; }
  pack
fi
CK=$(ls -d .work/testbed/checkpoints/step-* | sort -t- -k2 -n | tail -1)
TB="--model $CK --data $D/gut108.val.bin --calibration-data $D/gut108.bin --max-windows 600"
if [ "$PART" = 1 ]; then
  run tp8 $TB --simulate 8 --comms 16 4 $U $POL
else
  EV="python3 studies/outlier_packet.py --bos --dtype bfloat16 --context 512 --batch-size 32
      --kl --no-progress"
  run tp8-outlier $TB --simulate 8 --comms 4 $U echo4:policy=ends8
  EV="python3 -m echo_tp.cli eval --bos --dtype bfloat16 --context 512 --batch-size 32 --kl
      --no-progress --calibration-windows 8"
  run tp8-more $TB --simulate 8 --comms $U,policy=first8 $U,g=64 echo4:g=64,policy=ends8
  run tp4 $TB --simulate 4 --comms 16 4 $U $POL
  # simulated TP=4 training speed since the simulated kernels stopped syncing on every call
  # (the seeds record's runs: 56-65k tokens/s), 12 steps of the testbed recipe
  python3 -m echo_tp.cli train --model studies/testbed/model.json --train-data $D/gut108.bin \
      --val-data $D/gut108.val.bin --bos --batch-size 64 --seq-len 512 --lr 2e-3 --min-lr 2e-4 \
      --weight-decay 0.1 --sync-every 25 --eval-batches 4 --simulate 4 --comm echo4 --steps 12 \
      --warmup 1 --no-progress --out-dir .work/probe > "$OUT/train-speed.log" 2>&1
  echo "== train speed"; grep -i "tokens" "$OUT/train-speed.log" | tail -3; pack
  t0=$(date +%s)
  python3 -m pytest -q tests/test_kernels_gpu.py tests/test_p2p_gpu.py -p no:cacheprovider \
      > "$OUT/pytest-gpu.txt" 2>&1; echo "== pytest rc=$? ($(( $(date +%s) - t0 )) s)"
  tail -3 "$OUT/pytest-gpu.txt"; pack
fi
echo "total $(( $(date +%s) - START )) s"
