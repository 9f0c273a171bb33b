#!/usr/bin/env bash
# One device call (nvidia-h200-x2): does the compact compensator state (one bf16 tensor,
# beta1 = beta2 = 0: what the p2p kernels run fastest) hold quality on the 107M model?
# Trains run A's schedule (221 steps) for 16-bit, naive 4-bit, the default Echo 4-bit and the
# compact state, then evaluates the 16-bit model's held-out perplexity under the state variants.
# Carry .work/study (token files). Results: $OUT/train_study.log, $OUT/train, $OUT/inference.
set -uo pipefail
source studies/device_env.sh
W=/tmp/study; mkdir -p $W
record_env $OUT
SINGLE="echo4:beta1=0,beta2=0,state_dtype=bfloat16"
python3 studies/train_study.py --data .work/study --out $W/train --steps ${STEPS:-221} \
  --demo-steps 0 --run 16bit=16 --run naive4=4 --run echo4=echo4 --run "single-bf16=$SINGLE" \
  2>&1 | tee $OUT/train_study.log
CKPT=$(ls -d $W/train/16bit/checkpoints/step-* | tail -1)
python3 studies/inference_study.py --model "$CKPT" --data .work/study/gut8k.val.bin \
  --out $OUT/inference --comm echo4 --comm "echo4:beta1=0,beta2=0" --comm "$SINGLE" \
  --comm "echo4:state_dtype=bfloat16" --comm "echo4:beta1=0.5,beta2=0.1" --comm early8 \
  --comm "early8:beta1=0,beta2=0,state_dtype=bfloat16" --comm "$SINGLE,g=64" \
  2>&1 | tee $OUT/inference_study.log
# few files come back from a device call: the summary (every run's loss curve) and the plot
mkdir -p $OUT/train && cp $W/train/summary.json $W/train/loss_curves.png $OUT/train/
