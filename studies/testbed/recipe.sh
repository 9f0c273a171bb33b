# The fidelity testbed's training recipe, in one place: sourced by the `testbed` job,
# `schedule-probe` and `train-schedule` (README: "For a fidelity study").
#   testbed_args STEPS   -> the `echo-tp train` arguments of a schedule of STEPS steps
# Model studies/testbed/model.json (86.0M parameters, Qwen3-style, 24 x 512). Data .work/data/
# gut108 (101 Gutenberg books, 17,514,666 tokens; 7 whole books held out, 726,632 tokens:
# docs/results/2026-12-01-fidelity-testbed.md): BOS-packed rows of 512, 34,226 training rows,
# so one pass is 534.8 steps of 64 rows.
# Schedule: TWO passes (1070 steps, 35.1M tokens): warmup 1/16 of the steps, cosine from 2e-3
# to 2e-4 ending at the last step. Until 2026-12-02 it was 3600 steps (6.7 passes), which
# overfits: held-out loss 3.834 at step 2001, 4.125 at 3338, 4.139 at 3600, and perplexity on
# text from outside the corpus 30.9 -> 80.7 (issue 30). The held-out minimum of that run lies
# at or before ~3.7 passes with the LR still at half its peak; a schedule whose LR anneals to
# its end takes its drop earlier, so its best end is earlier still. 2 passes is the schedule
# the probe (the `schedule-probe` job: 1, 2 and 3 passes, 16-bit, held-out loss)
# confirms or replaces; set TESTBED_STEPS from its best final held-out loss.
# Held-out loss: 22 batches of 64 rows, 1408 of the 1421 held-out rows (whole batches: a
# partial last one would compile another graph under --compile).
TESTBED_ROWS=${TESTBED_ROWS:-34226}
TESTBED_BATCH=${TESTBED_BATCH:-64}
TESTBED_SEQ=${TESTBED_SEQ:-512}
TESTBED_STEPS=${TESTBED_STEPS:-1070}
TESTBED_MODEL=${TESTBED_MODEL:-studies/testbed/model.json}
TESTBED_DATA=${TESTBED_DATA:-.work/data}

testbed_steps() {  # testbed_steps PASSES -> steps of PASSES passes over the training rows
  python3 -c "print(round($1 * $TESTBED_ROWS / $TESTBED_BATCH))"
}

testbed_args() {   # testbed_args STEPS
  local steps=$1
  echo "--model $TESTBED_MODEL --train-data $TESTBED_DATA/gut108.bin" \
       "--val-data $TESTBED_DATA/gut108.val.bin --bos --batch-size $TESTBED_BATCH" \
       "--seq-len $TESTBED_SEQ --lr 2e-3 --min-lr 2e-4 --weight-decay 0.1 --steps $steps" \
       "--warmup $(( steps / 16 )) --eval-batches 22 --sync-every 25"
}
