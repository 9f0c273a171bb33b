#!/usr/bin/env bash
# The fidelity testbed of issue 19 (item 2), one GPU call: train the recipe (studies/testbed/:
# model.json, recipe.sh; 2 passes since issue 30, 3600 steps before), probe its massive
# activations, and a first look at naive 4-bit at simulated TP=8 and 4.
#   run: bash studies/device_testbed.sh    (carry .work/data/gut108.{bin,json,val.bin,val.json};
#   the checkpoint stays in .work/testbed/ for studies/device_fidelity.sh on the same machine)
# Data (CPU, this repo): all 108 books of ../shared/data/gutenberg.tar.xz,
#   echo-tp tokenize /tmp/gut/gutenberg/*.txt --tokenizer src/echo_tp/assets/tokenizers/gutenberg-8k \
#       --out .work/data/gut108.bin --val-fraction 0.04 --seed 0
#   -> 17,514,666 training tokens (101 books), 726,632 held out (7 whole books).
set -euo pipefail
source studies/device_env.sh
source studies/testbed/recipe.sh
OUT=${OUT:-/tmp/testbed-out}; mkdir -p "$OUT"
record_env "$OUT"
D=$TESTBED_DATA
RUN=.work/testbed
rm -rf "$RUN"
python3 -m echo_tp.cli train $(testbed_args "${STEPS:-$TESTBED_STEPS}") \
    --time-budget "${BUDGET:-340}" --compile --save-dtype bfloat16 --seed 0 \
    --out-dir $RUN --no-progress > "$OUT/train.log" 2>&1 \
    || { tail -40 "$OUT/train.log"; exit 1; }
tail -5 "$OUT/train.log"
cp $RUN/log.csv "$OUT/train-log.csv"
CK=$(ls -d $RUN/checkpoints/step-* | sort -t- -k2 -n | tail -1)
echo "checkpoint $CK"
python3 studies/massive_activations.py --model "$CK" --data $D/gut108.val.bin --bos \
    --out "$OUT/massive.json" | tee "$OUT/massive.txt" | tail -3
[ "${QUICK:-1}" = 1 ] || exit 0
for P in 8 4; do
  python3 -m echo_tp.cli eval --model "$CK" --data $D/gut108.val.bin --bos --dtype bfloat16 \
      --context 512 --batch-size 16 --max-windows 128 --comms 16 4 echo4 --simulate $P \
      --no-progress --out "$OUT/quick-tp$P.json" | tail -4
done
