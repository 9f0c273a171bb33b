#!/usr/bin/env bash
# (Superseded for issue 30 by studies/device_train_schedule.sh: one run per call of the 2-pass
# recipe on the batched simulated path. Kept as the record of 2026-12-01-train-seeds.md.)
# Issue 19 item 5, one GPU call: training with the collective in the loop on the testbed's recipe
# (studies/testbed/model.json, LR 2e-3 -> 2e-4 cosine, 5% warmup, wd 0.1, batch 64 x 512, BOS),
# at simulated TP=4 (every forward and backward site through 4-bit), 16-bit / Echo 4-bit / naive
# 4-bit, two seeds each; then (issue 20 item 5) sequence-parallel, seed 0: Echo with 8-bit
# all-gathers (echo4:gather_bits=8) and naive 4-bit. A short schedule: the step count is set
# from a speed probe so that the runs fit one call (the testbed's own 3600 steps do not); every
# run gets the same steps; runs past DEADLINE seconds are skipped (and say so).
# Carry .work/data/gut108.{bin,json,val.bin,val.json}. CPU smoke: MODEL, BATCH, SEQ,
# EVAL_BATCHES, PER_RUN_S, EXTRA (e.g. --amp to run bf16 autocast on a CPU).
set -uo pipefail
source studies/device_env.sh
archive_results seeds     # results in $FINAL/seeds.tgz (device_env.sh)
record_env "$OUT"
D=.work/data
COMMON="--model ${MODEL:-studies/testbed/model.json} --train-data $D/gut108.bin --val-data $D/gut108.val.bin
  --bos --batch-size ${BATCH:-64} --seq-len ${SEQ:-512} --lr 2e-3 --min-lr 2e-4 --weight-decay 0.1 --sync-every 25
  --eval-batches ${EVAL_BATCHES:-40} --simulate 4 --save-dtype bfloat16 --no-progress ${EXTRA:-}"
START=$(date +%s); DEADLINE=${DEADLINE:-540}
python3 -m echo_tp.cli train $COMMON --comm echo4 --steps 12 --warmup 1 --out-dir .work/probe \
    > "$OUT/probe.log" 2>&1 || { tail -30 "$OUT/probe.log"; exit 1; }
# seconds per step after step 1 (compile-free), from the probe's log.csv
SPS=$(python3 -c "import csv; r=list(csv.DictReader(open('.work/probe/log.csv')));
print((float(r[-1]['elapsed_s'])-float(r[0]['elapsed_s']))/(len(r)-1))")
STEPS=$(python3 -c "print(max(20, int(${PER_RUN_S:-38} / $SPS)))")
WARM=$(( STEPS / 20 ))
echo "probe: $SPS s/step at echo4 -> $STEPS steps per run (warmup $WARM)" | tee "$OUT/plan.txt"
one() {  # one NAME ARGS...: a training run unless the deadline has passed
  local name=$1; shift
  if (( $(date +%s) - START > DEADLINE )); then echo "SKIPPED $name (deadline)"; return; fi
  python3 -m echo_tp.cli train $COMMON --steps $STEPS --warmup $WARM --out-dir .work/seeds/$name \
      "$@" > "$OUT/$name.log" 2>&1 || echo "FAILED $name"
  cp .work/seeds/$name/log.csv "$OUT/$name.csv" 2>/dev/null
  tail -2 "$OUT/$name.log" | head -1
  pack
}
for seed in 0 1; do
  for comm in 16 echo4 4; do
    one $comm-s$seed --comm $comm --seed $seed
  done
done
one sp-echo4-gb8-s0 --comm echo4:gather_bits=8 --seed 0 --sequence-parallel
one sp-4-s0 --comm 4 --seed 0 --sequence-parallel
echo "total $(( $(date +%s) - START )) s"
