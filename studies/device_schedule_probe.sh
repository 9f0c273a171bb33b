#!/usr/bin/env bash
# Issue 30 item 2: the testbed schedule that does not overfit, chosen by held-out loss. One GPU
# call (nvidia-h200): the 16-bit plain model (compiled, as the testbed is trained) on the
# recipe (studies/testbed/recipe.sh) with the schedule ending after 1, 2 and 3 passes (PASSES;
# 535, 1070, 1604 steps: warmup 1/16, cosine to 2e-4 at the end), seed 0, the held-out books
# evaluated every quarter pass; then, where .work/data/wiki8k.bin is carried, each final model
# on WikiText-2 validation (text from outside the corpus). The schedule with the lowest FINAL
# held-out loss is the recipe's TESTBED_STEPS. Runs past DEADLINE seconds are skipped.
#   bash studies/device_schedule_probe.sh
# Carry .work/data/gut108.{bin,json,val.bin,val.json} (+ wiki8k.{bin,json}: echo-tp tokenize
# ../shared/data/wikitext2/wiki.valid.raw --tokenizer gutenberg-8k --out .work/data/wiki8k.bin).
# Results: $OUT/probe.tgz (per run: log.csv, val_rows.json, train.log, wiki.json; probe.txt).
# CPU smoke: TESTBED_DATA, TESTBED_MODEL, TESTBED_BATCH, TESTBED_SEQ, EXTRA (e.g. --device cpu),
# COMPILE= (empty: eager).
set -uo pipefail
source studies/device_env.sh
source studies/testbed/recipe.sh
archive_results probe      # results in $FINAL/probe.tgz (device_env.sh)
record_env "$OUT"
START=$(date +%s); DEADLINE=${DEADLINE:-480}
D=$TESTBED_DATA
for passes in ${PASSES:-1 2 3}; do
  if (( $(date +%s) - START > DEADLINE )); then
    echo "SKIPPED $passes passes (deadline)"; continue
  fi
  steps=$(testbed_steps "$passes")
  run=.work/probe/p$passes
  rm -rf "$run"; mkdir -p "$OUT/p$passes"
  python3 -m echo_tp.cli train $(testbed_args "$steps") ${COMPILE---compile} --seed 0 \
      --eval-every $(( $(testbed_steps 0.25) )) --save-dtype bfloat16 --out-dir "$run" \
      --no-progress ${EXTRA:-} > "$OUT/p$passes/train.log" 2>&1 || echo "FAILED $passes passes"
  cp "$run"/{log.csv,val_rows.json,train_config.json} "$OUT/p$passes/" 2>/dev/null
  echo "== $passes passes ($steps steps):" \
       "$(tail -2 "$OUT/p$passes/train.log" | head -1 | cut -c1-160)"
  CK=$(ls -d "$run"/checkpoints/step-* 2>/dev/null | sort -t- -k2 -n | tail -1)
  if [ -f "$D/wiki8k.bin" ] && [ -n "$CK" ]; then
    python3 -m echo_tp.cli eval --model "$CK" --data "$D/wiki8k.bin" --bos --context 512 \
        --comms 16 --simulate 1 --batch-size 32 --max-windows 600 --no-progress ${EXTRA:-} \
        --out "$OUT/p$passes/wiki.json" > "$OUT/p$passes/wiki.txt" 2>&1 || echo "FAILED wiki eval"
  fi
  pack
done
python3 - "$OUT" <<'PY' | tee "$OUT/probe.txt"
import csv, json, math, pathlib, sys
out = pathlib.Path(sys.argv[1])
best = None
for d in sorted(out.glob("p*/log.csv")):
    rows = list(csv.DictReader(open(d)))
    vals = [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"]]
    wiki = d.parent / "wiki.json"
    ppl = json.loads(wiki.read_text())["results"][0]["ppl"] if wiki.exists() else None
    lo = min(vals, key=lambda v: v[1])
    print(f"{d.parent.name}: {len(rows)} steps, final held-out loss {vals[-1][1]:.4f} "
          f"(lowest {lo[1]:.4f} at step {lo[0]})" + (f", WikiText-2 ppl {ppl:.2f}" if ppl else ""))
    if best is None or vals[-1][1] < best[1]:
        best = (d.parent.name, vals[-1][1], len(rows))
if best:
    print(f"best final held-out loss: {best[0]} ({best[2]} steps, {best[1]:.4f})")
PY
pack
echo "total $(( $(date +%s) - START )) s"
