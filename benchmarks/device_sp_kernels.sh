#!/usr/bin/env bash
# One call on nvidia-h200 (one GPU) for issue 20 item 4, the sequence-parallel halves on the
# stage kernels: the compiled halves against the torch reference (tests/test_kernels_gpu.py
# -k halves: SimulatedFused.reduce_scatter / all_gather vs collective/sharded.py at P = 2/4/8,
# and SimulatedCommunicator's halves through FusedSimBackend), then benchmarks/stage_profile.py
# at 1 GiB per rank (bf16), P = 2, 4, 8 simulated on the GPU, 4-bit uncompensated (u4) and
# compensated with the default state (c4-loc-bf16c: one bf16 tensor, local residual), the
# routing's tile shape: the all-reduce's stages and the halves' side by side, medians.
# Run from the repo root:
#   bash benchmarks/device_sp_kernels.sh
# Results: $OUT/sp-kernels.tgz (everything), and $OUT/stages-sp.json, $OUT/summary.txt.
# About 3-4 minutes, most of it cold Triton compiles (a stage kernel per rank and config).
# Knobs: PYTEST_S (default 100), NUMEL (values per rank, default 2^29 = 1 GiB of bf16),
# WORLDS (2,4,8), CONFIGS (u4,c4-loc-bf16c), SHAPES (route), REPS (11), BUDGET_S (95: no new
# stage-profile row after it).
set -uo pipefail
source studies/device_env.sh
export ECHO_FLAG_TIMEOUT_S=20
archive_results sp-kernels   # works in $OUT=/tmp/sp-kernels-work, packs into $FINAL
record_env "$OUT"
cat "$OUT/gpus.txt" "$OUT/versions.txt"
START=$(date +%s)

T0=$(date +%s)
timeout ${PYTEST_S:-100} python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py \
  -k halves > "$OUT/pytest_sp_kernels_gpu.txt" 2>&1
echo "pytest -k halves rc=$? in $(( $(date +%s) - T0 )) s"; tail -3 "$OUT/pytest_sp_kernels_gpu.txt"
pack

T0=$(date +%s)
BUDGET=${BUDGET_S:-95}
timeout $(( BUDGET + 45 )) python3 benchmarks/stage_profile.py --out "$OUT" --label sp \
  --numel ${NUMEL:-536870912} --worlds ${WORLDS:-2,4,8} --configs ${CONFIGS:-u4,c4-loc-bf16c} \
  --shapes ${SHAPES:-route} --parts all_reduce,reduce_scatter,all_gather --reps ${REPS:-11} \
  --budget-s $BUDGET > "$OUT/stages_sp.log" 2>&1
echo "stage_profile rc=$? in $(( $(date +%s) - T0 )) s"; grep -c '"part"' "$OUT/stages_sp.log"
pack

python3 - > "$OUT/summary.txt" <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "stages-sp.json")
if not os.path.exists(p):
    print("no stages-sp.json (see stages_sp.log)")
    raise SystemExit
d = json.load(open(p))
print(d["device"], "torch", d["torch"], "copy", d["copy"].get("copy_GBps"), "GB/s")
print("P config part tile/step: per-stage ms = sum ms")
for r in d["rows"]:
    if "error" in r:
        print(r["P"], r["config"], r.get("part"), "ERROR", r["error"])
        continue
    st = [k[:-3] for k in r if k.endswith("_ms") and k != "sum_ms"]
    print(r["P"], r["config"], r["part"], f'{r["tile"]}/{r["step"]}:',
          " ".join(f'{s}={r[s + "_ms"]:.3f}' for s in st), f'= {r["sum_ms"]:.3f}')
PY
cat "$OUT/summary.txt"
cp "$OUT/summary.txt" "$FINAL/"
[ -f "$OUT/stages-sp.json" ] && cp "$OUT/stages-sp.json" "$FINAL/"
pack
echo "total $(( $(date +%s) - START )) s"
