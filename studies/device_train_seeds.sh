#!/usr/bin/env bash
# Issue 19 item 5, one GPU call: training with the collective in the loop on the testbed's recipe
# (studies/testbed/model.json, LR 2e-3 -> 2e-4 cosine, 5% warmup, wd 0.1, batch 64 x 512, BOS),
# at simulated TP=4 (every forward and backward site through 4-bit), 16-bit / Echo 4-bit / naive
# 4-bit, two seeds each. A short schedule: the step count is set from a speed probe so that the
# six runs fit one call (the testbed's own 4500 steps do not); every run gets the same steps.
# Carry .work/data/gut108.{bin,json,val.bin,val.json}.
set -uo pipefail
source studies/device_env.sh
archive_results seeds     # results in $FINAL/seeds.tgz (device_env.sh)
record_env "$OUT"
D=.work/data
COMMON="--model ${MODEL:-studies/testbed/model.json} --train-data $D/gut108.bin --val-data $D/gut108.val.bin
  --bos --batch-size ${BATCH:-64} --seq-len ${SEQ:-512} --lr 2e-3 --min-lr 2e-4 --weight-decay 0.1 --sync-every 25
  --eval-batches ${EVAL_BATCHES:-40} --simulate 4 --no-progress"
python3 -m echo_tp.cli train $COMMON --comm echo4 --steps 12 --warmup 1 --out-dir .work/probe \
    > "$OUT/probe.log" 2>&1 || { tail -30 "$OUT/probe.log"; exit 1; }
# seconds per step after step 1 (compile-free), from the probe's log.csv
SPS=$(python3 -c "import csv; r=list(csv.DictReader(open('.work/probe/log.csv')));
print((float(r[-1]['elapsed_s'])-float(r[0]['elapsed_s']))/(len(r)-1))")
STEPS=$(python3 -c "print(max(20, int(${PER_RUN_S:-62} / $SPS)))")
WARM=$(( STEPS / 20 ))
echo "probe: $SPS s/step at echo4 -> $STEPS steps per run (warmup $WARM)" | tee "$OUT/plan.txt"
for seed in 0 1; do
  for comm in 16 echo4 4; do
    dir=.work/seeds/$comm-s$seed
    python3 -m echo_tp.cli train $COMMON --comm $comm --steps $STEPS --warmup $WARM \
        --seed $seed --out-dir $dir > "$OUT/$comm-s$seed.log" 2>&1 || echo "FAILED $comm-s$seed"
    cp $dir/log.csv "$OUT/$comm-s$seed.csv" 2>/dev/null
    tail -2 "$OUT/$comm-s$seed.log" | head -1
    pack
  done
done
