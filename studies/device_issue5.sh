#!/usr/bin/env bash
# One device call: training study + demo model (studies/train_study.py), then the inference
# study on the 16-bit-trained model (studies/inference_study.py). Carry .work/study (token files).
# Small results come back as $OUT/results.tar.gz and $OUT/demo_model.tar.gz.
set -uo pipefail
source studies/device_env.sh
W=/tmp/study; mkdir -p $W
record_env $W
python3 studies/train_study.py --data .work/study --out $W/train --budget-s "${TRAIN_BUDGET_S:-270}" 2>&1 | tee $W/train_study.log
CKPT=$(ls -d $W/train/16bit/checkpoints/step-* | tail -1)
python3 studies/inference_study.py --model "$CKPT" --data .work/study/gut8k.val.bin --out $W/inference 2>&1 | tee $W/inference_study.log
DEMO=$(ls -d $W/train/demo-model/checkpoints/step-* | tail -1)
python3 - "$DEMO" $W/demo_model <<'PY'
import sys, torch
from echo_tp.models.hf import load_hf_checkpoint, save_hf_checkpoint
model, cfg = load_hf_checkpoint(sys.argv[1], dtype=torch.bfloat16, device="cpu")
save_hf_checkpoint(model, cfg, sys.argv[2])
PY
tar -czf $OUT/demo_model.tar.gz -C $W demo_model
cd $W && tar -czf $OUT/results.tar.gz gpus.txt versions.txt train_study.log inference_study.log \
  train/summary.json train/loss_curves.png train/*.txt train/*/log.csv train/*/train_config.json \
  inference/inference.json inference/inference.md inference/partial_sums.png inference/eval_raw.json
ls -la $OUT
