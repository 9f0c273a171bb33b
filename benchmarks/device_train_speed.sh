#!/usr/bin/env bash
# Issue 30 item 1, one GPU call (nvidia-h200): training tokens/s of simulated TP=4 on the testbed
# recipe (studies/testbed/: 86M parameters, 64 x 512 tokens a step, bf16 autocast, AdamW, clip)
# through the per-shard path (the reference) and the batched fast path, eager and compiled, and
# the plain model compiled (the ceiling), in the same run (benchmarks/train_speed.py: warm-up,
# medians over windows, JSON); first the two paths' equivalence on this GPU (logits and
# gradients of one step, per comm). Random tokens: nothing to carry.
#   bash benchmarks/device_train_speed.sh          (COMMS="echo4 16" for the 16-bit rows too)
# Results in $OUT: train_speed.json, train_speed.log, gpus.txt, versions.txt. Variants that
# would start past DEADLINE seconds are skipped (and listed).
set -uo pipefail
source studies/device_env.sh
OUT=${OUT:-/tmp/train-speed-out}; mkdir -p "$OUT"
record_env "$OUT"
START=$(date +%s)
timeout "${LIMIT:-570}" python3 benchmarks/train_speed.py --comms ${COMMS:-echo4} \
    --variants ${VARIANTS:-shards batched batched+compile plain+compile} \
    --deadline-s "${DEADLINE:-420}" --out "$OUT/train_speed.json" > "$OUT/train_speed.log" 2>&1
echo "rc=$? in $(( $(date +%s) - START )) s"
grep -v -i "warn" "$OUT/train_speed.log" | tail -12
