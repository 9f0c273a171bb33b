#!/usr/bin/env bash
# Issue 30 items 2-3: ONE training run per call of the testbed recipe (studies/testbed/recipe.sh:
# 2 passes, 1070 steps of 64 x 512, the LR schedule ending there) at simulated TP=4, every
# forward and backward site through the collective, on the fast path (--sim-path batched
# --compile), bf16 autocast:
#   bash studies/device_train_schedule.sh CONFIG SEED [LR_FACTOR]
#   CONFIG: a comm spec: 16 (16-bit), 4 (naive 4-bit), echo4 (the default Echo); SEED: 0, 1.
#   LR_FACTOR (default 1): peak and final LR times it (the paper's remedy for 4-bit: 1.17).
# Carry .work/data/gut108.{bin,json,val.bin,val.json} (36.5 MB; studies/device_testbed.sh says
# how they are made). Results in $OUT/NAME.tgz, NAME = CONFIG-sSEED[-lrF]: log.csv (loss per
# step, held-out loss every EVAL_EVERY steps), val_rows.json (the final held-out NLL per row),
# telemetry.csv (echo* configs: every call of every TELEMETRY_EVERY-th step, default 100;
# simulated ||y - sum x|| per site), train.log, loss.png, train_config.json, gpus.txt,
# versions.txt.
# The table, curves and verdict: python studies/train_schedule_report.py DIR... (its docstring).
# Knobs: TESTBED_STEPS (a shorter schedule), SIM_PATH=shards (the per-shard reference path),
# COMPILE= (eager), BUDGET (seconds, compile included; default 500), EVAL_EVERY (134: a quarter
# pass), TELEMETRY_EVERY. CPU smoke: TESTBED_DATA, TESTBED_MODEL, TESTBED_BATCH, TESTBED_SEQ,
# TESTBED_ROWS, EXTRA (e.g. --device cpu).
set -uo pipefail
CONFIG=${1:?usage: device_train_schedule.sh CONFIG SEED [LR_FACTOR]}
SEED=${2:?usage: device_train_schedule.sh CONFIG SEED [LR_FACTOR]}
LRF=${3:-1}
source studies/device_env.sh
source studies/testbed/recipe.sh
NAME=$(echo "$CONFIG" | tr ':=,' '_-_')-s$SEED${3:+-lr$LRF}
archive_results "$NAME"    # results in $FINAL/NAME.tgz (device_env.sh)
record_env "$OUT"
LR=$(python3 -c "print(2e-3 * $LRF)"); MIN_LR=$(python3 -c "print(2e-4 * $LRF)")
case "$CONFIG" in echo*) TEL=${TELEMETRY_EVERY:-100} ;; *) TEL=${TELEMETRY_EVERY:-0} ;; esac
RUN=.work/schedule/$NAME
rm -rf "$RUN"
START=$(date +%s)
python3 -m echo_tp.cli train $(testbed_args "$TESTBED_STEPS") --lr "$LR" --min-lr "$MIN_LR" \
    --simulate 4 --sim-path "${SIM_PATH:-batched}" ${COMPILE---compile} --comm "$CONFIG" \
    --seed "$SEED" --eval-every "${EVAL_EVERY:-$(testbed_steps 0.25)}" --telemetry-every "$TEL" \
    --time-budget "${BUDGET:-500}" --save-dtype bfloat16 --out-dir "$RUN" --no-progress \
    ${EXTRA:-} > "$OUT/train.log" 2>&1
echo "rc=$? in $(( $(date +%s) - START )) s"
cp "$RUN"/{log.csv,val_rows.json,train_config.json,loss.png,telemetry.csv} "$OUT/" 2>/dev/null
tail -2 "$OUT/train.log" | head -1 | cut -c1-220
pack
