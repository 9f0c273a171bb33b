"""Every GPU job as data: name -> what it runs (a bash script), its knobs (environment
variables with their defaults; `--set KEY=VALUE` overrides), what it carries, what it needs on
the machine from an earlier job, the outputs kept as plain files, its expected seconds (the
budget skip) and the records in docs/results it reproduces.

A script runs in the repository root under PRELUDE: multicast off, the package from this
checkout, $OUT its own work folder (packed by the runner as NAME.tgz), `record_env DIR`,
`eval_row NAME ARGS...` (one `$EV ARGS --out $OUT/NAME.json` unless DEADLINE seconds have
passed since START) and `testbed_checkpoint` (the last checkpoint of the `testbed` job).
Usage and the device tool's limits: benchmarks/jobs/__main__.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

KNOB_ENV = "JOB_NAME"
"""The environment variable that names the running job inside its script."""


@dataclass(frozen=True)
class Carry:
    """A git-ignored path the device tool takes along (a folder, or files in it) and how to
    make what it holds on this machine."""

    path: str
    files: tuple[str, ...] = ()
    """Files expected under path (prepare copies them from --from DIR); () : the folder."""
    how: str = ""


@dataclass(frozen=True, kw_only=True)
class Job:
    name: str
    about: str
    """What it measures, in a line or two."""
    kind: str
    """The device kind to ask for (the run tool's `kind`)."""
    seconds: int
    """Expected wall time: skipped when less of the budget is left."""
    script: str
    knobs: dict[str, str] = field(default_factory=dict)
    carry: tuple[Carry, ...] = ()
    needs: tuple[str, ...] = ()
    """Paths an earlier job on the same machine leaves (skipped while absent)."""
    keep: tuple[str, ...] = ()
    """Files of $OUT also returned as plain files (beside NAME.tgz)."""
    records: tuple[str, ...] = ()
    """docs/results records this job reproduces."""


PRELUDE = r"""set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
START=$(date +%s)
record_env() {
  nvidia-smi --query-gpu=name,memory.total --format=csv > "$1/gpus.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" > "$1/versions.txt"
}
eval_row() {
  local name=$1; shift
  if (( $(date +%s) - START > DEADLINE )); then echo "SKIPPED $name (deadline)"; return; fi
  local t0=$(date +%s)
  $EV "$@" --out "$OUT/$name.json" > "$OUT/$name.txt" 2>&1 || echo "FAILED $name"
  echo "== $name ($(( $(date +%s) - t0 )) s)"; tail -n +2 "$OUT/$name.txt" | cut -c1-140
}
testbed_checkpoint() { ls -d .work/testbed/checkpoints/step-* | sort -t- -k2 -n | tail -1; }
gguf_model() {  # NAME SHA256: the pieces $M/NAME.part* joined, checked, converted to $M/NAME-hf
  M=${M:-/tmp/m}; mkdir -p "$M"; cp "${FROM:-.work/parts}"/* "$M/" 2>/dev/null || true
  python3 -c "import gguf" 2>/dev/null || { python3 -m pip install -q --no-index --no-deps \
    --no-compile --target /tmp/site .whl/gguf-*.whl && export PYTHONPATH=/tmp/site:$PWD/src; }
  [ -d "$M/$1-hf" ] && return 0
  cat "$M/$1".part* > "$M/$1.gguf" && echo "$2  $M/$1.gguf" | sha256sum -c - || return 1
  python3 -c "from echo_tp.hf.gguf import gguf_to_hf; gguf_to_hf('$M/$1.gguf', '$M/$1-hf')"
}
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GEMMA_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
"""

GUT108 = Carry(".work/data", ("gut108.bin", "gut108.json", "gut108.val.bin", "gut108.val.json"),
               "all 108 books of ../shared/data/gutenberg.tar.xz: echo-tp tokenize "
               "/tmp/gut/gutenberg/*.txt --tokenizer src/echo_tp/assets/tokenizers/gutenberg-8k "
               "--out .work/data/gut108.bin --val-fraction 0.04 --seed 0 (36.5 MB)")
WIKI8K = Carry(".work/data", ("wiki8k.bin", "wiki8k.json"),
               "echo-tp tokenize ../shared/data/wikitext2/wiki.valid.raw --tokenizer "
               "gutenberg-8k --out .work/data/wiki8k.bin")
STUDY = Carry(".work/study", (), "the Gutenberg 8k-BPE token files of studies/train_study.py "
              "(gut8k.*: docs/results/2026-11-29-studies.md)")
TEXTS = Carry(".work/data", ("wiki.valid.raw", "gutenberg-eval.txt"),
              "../shared/data/wikitext2/wiki.valid.raw; gutenberg-eval.txt: the first 1.25 MB "
              "of six books of the corpus (docs/results/2026-12-04-real-llm.md)")
GGUF_WHEEL = Carry(".whl", (), "the gguf wheel (pip download gguf --no-deps -d .whl): the GPU "
                   "image has transformers, not gguf")
MEGATRON_WHEEL = Carry(".whl", (), "pip download megatron-core==0.16.1 --no-deps "
                       "--only-binary=:all: --python-version 3.12 --platform "
                       "manylinux_2_28_x86_64 -d .whl")
PARTS = Carry(".work/parts", (), "pieces of the GGUF files (studies/fetch_models.py "
              "--split-mib 36), a few per call: prepare --part smol:FILE.partNN")
SMOL_DATA = Carry(".work/data", ("smol-train.bin.xz", "smol-train.json", "smol-val.bin",
                                  "smol-val.json", "wiki.valid.raw"),
                  "the Gutenberg corpus in SmolLM2 tokens, 7 books held out (studies/"
                  "train_real_llm.py's docstring; xz -k smol-train.bin), WikiText-2 validation")
TESTBED = ".work/testbed/checkpoints"

_JOBS = [
    # ----- kernels and collectives (benchmarks/) -----
    Job(name="add-norm", kind="nvidia-h200", seconds=540,
        about="the block boundary: the add + RMSNorm kernels against torch (pytest -k 'rmsnorm "
              "or residual'), then benchmarks/add_norm.py (kernel; P=4 simulated boundary)",
        knobs={"ITERS": "100", "CONFIGS": "c4,u4", "SHAPES": ""},
        records=("2026-12-01-add-norm.md",), keep=("add_norm.log",),
        script=r"""
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
export ECHO_FLAG_TIMEOUT_S=20
T0=$(date +%s)
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py \
  -k "rmsnorm or residual" > $OUT/pytest_add_norm_gpu.txt 2>&1
echo "kernels_gpu rc=$? in $(( $(date +%s) - T0 )) s"; tail -3 $OUT/pytest_add_norm_gpu.txt
T0=$(date +%s)
timeout 300 python3 benchmarks/add_norm.py --out $OUT --iters $ITERS \
  --configs $CONFIGS ${SHAPES:+--shapes $SHAPES} > $OUT/add_norm.log 2>&1
echo "add_norm rc=$? in $(( $(date +%s) - T0 )) s"; cat $OUT/add_norm.log
"""),
    Job(name="kernels-x2", kind="nvidia-h200-x2", seconds=560,
        about="after a kernel change: the compiled forms against torch and the per-stage cost "
              "on one GPU (OLD_SRC: an older src/ side by side, carried), P=2 exactness, the "
              "P=2 all-reduce benchmark",
        knobs={"ONE_GPU": "1", "STAGE_PROFILE": "1", "OLD_SRC": "",
               "PYTEST_K": "2-fused or 2-off or 2-launch", "PYTEST_S": "150", "MIN_MB": "0",
               "BENCH_S": "200",
               "SHAPES": "2048x4,1024x4,8192x4s2048,8192x4s1024,16384x4s2048",
               "METHODS": "nccl16,p2p4,p2p4-staged,p2p4-launch,p2p8,p2p8-launch,p2p4c,"
                          "p2p4c-staged,p2p4c-fp32,p2p4c-out,auto4,auto4c,auto4c-fp32"},
        records=("2026-11-30-p2p-x2-r4.md", "2026-11-30-p2p-x2-r3.md"), keep=("ar.log",),
        script=r"""
export ECHO_FLAG_TIMEOUT_S=20
nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.nccl.version())"
T0=$(date +%s)
if [ "$ONE_GPU" = 1 ]; then
( CUDA_VISIBLE_DEVICES=0 timeout 170 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_kernels_gpu.py > $OUT/pytest_kernels_gpu.txt 2>&1; echo "kernels_gpu rc=$?" \
    >> $OUT/pytest_kernels_gpu.txt
  [ "$STAGE_PROFILE" = 1 ] && CUDA_VISIBLE_DEVICES=0 timeout 120 python3 \
    benchmarks/stage_profile.py --out $OUT --label new \
    --budget-s 100 --worlds 2 --configs u4,c4-loc-bf16c,c4-loc-f32 \
    --shapes $SHAPES > $OUT/stages_new.log 2>&1 ) &
if [ -n "$OLD_SRC" ]; then
  CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$PWD/$OLD_SRC timeout 200 python3 benchmarks/stage_profile.py \
    --out $OUT --label old --budget-s 180 --shapes 1024x4,2048x4 > $OUT/stages_old.log 2>&1 &
fi
wait
fi
echo "one-GPU phase in $(( $(date +%s) - T0 )) s"; tail -3 $OUT/pytest_kernels_gpu.txt
T0=$(date +%s)
timeout $PYTEST_S python3 -m pytest -q -x -p no:cacheprovider tests/test_p2p_gpu.py \
  -k "$PYTEST_K" > $OUT/pytest_p2p.txt 2>&1
echo "p2p pytest rc=$? in $(( $(date +%s) - T0 )) s"; grep -v "^#loc" $OUT/pytest_p2p.txt | tail -4
T0=$(date +%s)
timeout $BENCH_S python3 benchmarks/allreduce.py --world 2 --out $OUT --iters 50 \
  --budget-s $(( BENCH_S - 40 )) --methods $METHODS --min-mb $MIN_MB --stages \
  > $OUT/ar.log 2>&1
echo "allreduce rc=$? in $(( $(date +%s) - T0 )) s"; grep -v "^#loc" $OUT/ar.log | grep -A 40 "^### P=2" | grep -v "^$"; grep ERROR $OUT/ar.log | head -5
python3 - <<'EOF'
import json, os
for lab in ("old", "new"):
    p = os.path.join(os.environ["OUT"], f"stages-{lab}.json")
    if os.path.exists(p):
        for r in json.load(open(p))["rows"]:
            print(lab, r.get("P"), r.get("config"), f'{r.get("tile")}x{r.get("warps")}s{r.get("step")}',
                  *(f'{k}={r[k]}' for k in ("entry_ms", "reduce_ms", "tail_ms", "sum_ms", "error") if k in r))
EOF
"""),
    Job(name="one-gpu", kind="nvidia-h200", seconds=560,
        about="after a kernel change, one GPU: the compiled kernels against torch "
              "(tests/test_kernels_gpu.py), then the per-stage floors of this tree and, with "
              "OLD_SRC (an older src/, carried), of that one",
        knobs={"NUMEL": "268435456", "WORLDS": "2,4", "CONFIGS": "u4,c4-loc-bf16c",
               "SHAPES": "2048x4,8192x4s2048,16384x4s2048", "BUDGET_S": "90", "OLD_SRC": "",
               "TESTS": "1", "TEST_TIMEOUT": "420"},
        records=("2026-12-01-fastpath-redesign.md", "2026-12-01-defined-answers.md"),
        script=r"""
export ECHO_FLAG_TIMEOUT_S=20
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$TESTS" = 1 ]; then
  T0=$(date +%s)
  PYTHONPATH=$PWD/src timeout $TEST_TIMEOUT python3 -m pytest -q -p no:cacheprovider \
    tests/test_kernels_gpu.py > $OUT/pytest_kernels_gpu.txt 2>&1
  echo "kernels_gpu rc=$? in $(( $(date +%s) - T0 )) s"; tail -3 $OUT/pytest_kernels_gpu.txt
fi
ARGS="--numel $NUMEL --worlds $WORLDS --configs $CONFIGS
      --shapes $SHAPES --budget-s $BUDGET_S --out $OUT"
for tree in new ${OLD_SRC:+old}; do
  src=$PWD/src; [ "$tree" = old ] && src=$PWD/$OLD_SRC
  T0=$(date +%s)
  PYTHONPATH=$src timeout $(( BUDGET_S + 60 )) python3 benchmarks/stage_profile.py $ARGS \
    --label $tree > $OUT/stages_$tree.log 2>&1
  echo "stage_profile $tree rc=$? in $(( $(date +%s) - T0 )) s"
done
python3 - <<'PY'
import json, os
best = {}
for lab in ("new", "old"):
    p = os.path.join(os.environ["OUT"], f"stages-{lab}.json")
    if not os.path.exists(p):
        continue
    for r in json.load(open(p))["rows"]:
        if "sum_ms" in r:
            k = (lab, r["P"], r["config"])
            if k not in best or r["sum_ms"] < best[k]["sum_ms"]:
                best[k] = r
for (lab, P, cfg), r in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
    print(lab, f"P={P}", cfg, f'{r["tile"]}x{r["warps"]}s{r.get("step")}',
          *(f'{k}={r[k]:.3f}' for k in ("entry_ms", "reduce_ms", "tail_ms", "sum_ms")))
PY
"""),
    Job(name="p4", kind="nvidia-h200-x4", seconds=590,
        about="P=4 on four GPUs: exactness (fused, staged, graphs, soak; the halves), the "
              "all-reduce at 64 KB-1 GB with every method, end to end at TP=4 (TTFT, decode, "
              "train, background load)",
        keep=("ar.log", "e2e.log"),
        script=r"""
export ECHO_FLAG_TIMEOUT_S=20
nvidia-smi -L; nvidia-smi topo -m | head -6
CUDA_VISIBLE_DEVICES=3 timeout 170 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_kernels_gpu.py > $OUT/pytest_kernels_gpu.txt 2>&1 &
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_p2p_gpu.py \
  -k "4-fused or 4-off or 4-launch or soak" > $OUT/pytest.txt 2>&1
echo "pytest rc=$?"; tail -3 $OUT/pytest.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_p2p_gpu.py \
  -k "halves and x4" > $OUT/pytest_halves.txt 2>&1
echo "pytest -k halves rc=$?"; tail -3 $OUT/pytest_halves.txt
wait; tail -2 $OUT/pytest_kernels_gpu.txt
timeout 150 python3 benchmarks/allreduce.py --world 4 --out $OUT --iters 30 --budget-s 130 \
  --methods nccl16,oneshot16,ref4,p2p8,p2p8-staged,p2p4,p2p4-staged,p2p4-launch,p2p4c,p2p4c-fp32,p2p4c-out,p2p4c-out-unfused,p2p4-graph,auto4,auto4c,auto4c-fp32 --stages \
  > $OUT/ar.log 2>&1
echo "allreduce rc=$?"; grep -A 14 "^### P=4" $OUT/ar.log
timeout 220 torchrun --nproc-per-node 4 benchmarks/e2e.py --out $OUT --big-mb 1024 --iters 3 \
  --loads 0 0.5 0.75 1.0 --decode-iters 20 --order nccl16 echo4bf echo4 echo8 early8 \
  > $OUT/e2e.log 2>&1
echo "e2e rc=$?"; grep -v "^#loc" $OUT/e2e.log | grep "^|" | tail -20
"""),
    Job(name="p8", kind="nvidia-h200-x8", seconds=590,
        about="P=8 on eight GPUs: exactness (the exactness worker on 8 ranks), the all-reduce "
              "at 64 MB-1 GB, end to end at TP=8 idle and at 100% background load",
        keep=("ar.log", "e2e.log", "exact_p8.txt"),
        script=r"""
export ECHO_FLAG_TIMEOUT_S=20
nvidia-smi -L; nvidia-smi topo -m | head -10
timeout 280 python3 - > $OUT/exact_p8.txt 2>&1 <<'PY'
import sys
sys.path[:0] = ["tests", "benchmarks"]
from common import spawn_nccl
from test_p2p_gpu import CASES, exactness_worker
for form, overlap in (("fused", None), ("staged", "off"), ("staged", "launch")):
    res = spawn_nccl(8, exactness_worker, CASES[:8] + CASES[-3:], 2, None, True, form,
                     overlap)
    bad = [(r, row) for r, rows in enumerate(res) for row in rows
           if row.get("error") or row["y"] or row["m1"] or row["m2"]]
    print(f"form={form} overlap={overlap}: {'EXACT' if not bad else bad[:4]}", flush=True)
PY
echo "exact rc=$?"; grep -E "form=|Error" $OUT/exact_p8.txt | tail -4
timeout 150 python3 benchmarks/allreduce.py --world 8 --out $OUT --iters 30 --budget-s 130 \
  --min-mb 64 --methods nccl16,p2p8,p2p4,p2p4c,p2p4c-fp32,p2p4c-out,auto4,auto4c,auto4c-fp32 \
  > $OUT/ar.log 2>&1
echo "allreduce rc=$?"; grep -A 10 "^### P=8" $OUT/ar.log
timeout 170 torchrun --nproc-per-node 8 benchmarks/e2e.py --out $OUT --big-mb 1024 --iters 3 \
  --cases prefill train --loads 0 1.0 --order nccl16 echo4bf echo4 echo8 > $OUT/e2e.log 2>&1
echo "e2e rc=$?"; grep -v "^#loc" $OUT/e2e.log | grep "^|" | tail -12
"""),
    Job(name="roofline", kind="nvidia-h200", seconds=590,
        about="the kernels' roofline on one GPU: the compiled kernels against torch while every "
              "stage-profile variant compiles, the entry ladder, the decode boundary, the "
              "per-stage floors at 2^26 and 2^29 values per rank, P=2/4/8 (OLD_SRC, BASE_SRC: "
              "older checkouts' roots, carried, in the same call, BASE_SRC at this tree's "
              "shapes; NEW_OFF=1: this tree again with the packet's outlier word off)",
        knobs={"WORLDS": "2,4,8", "CONFIGS": "u4,c4-loc-bf16c,u8", "OLD_SRC": "",
               "BASE_SRC": "", "NEW_OFF": "",
               "NEW_SHAPES": "4096x4s4096,8192x4s4096,16384x4s4096,8192x4s2048,16384x4s2048,"
                             "16384x4s1024",
               "OLD_SHAPES": "8192x4s2048,16384x4s2048,16384x4s1024", "TESTS": "1",
               "TEST_TIMEOUT": "420", "TEST_K": "", "LADDER": "1", "DECODE": "1", "TEST_JOBS": "",
               "WARM_JOBS": "12"},
        records=("2026-12-02-kernel-roofline.md", "2026-12-07-runner-h100.md"),
        script=r"""
export ECHO_FLAG_TIMEOUT_S=20
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
T0=$(date +%s)
if [ "$TESTS" = 1 ]; then
  PYTHONPATH=$PWD/src timeout -s INT $TEST_TIMEOUT python3 -m pytest -q -p no:cacheprovider \
    ${TEST_JOBS:+-n $TEST_JOBS} ${TEST_K:+-k "$TEST_K"} tests/test_kernels_gpu.py \
    > $OUT/pytest_kernels_gpu.txt 2>&1 &
  TESTS_PID=$!
fi
jobs=$(mktemp)
for P in ${WORLDS//,/ }; do for c in ${CONFIGS//,/ }; do
  for s in ${NEW_SHAPES//,/ }; do
    echo "$PWD/src $PWD/benchmarks $P $c $s default" >> $jobs
    [ -n "$NEW_OFF" ] && echo "$PWD/src $PWD/benchmarks $P $c $s off" >> $jobs
    [ -n "$BASE_SRC" ] && echo "$PWD/$BASE_SRC/src $PWD/$BASE_SRC/benchmarks $P $c $s default" >> $jobs
  done
  [ -n "$OLD_SRC" ] && for s in ${OLD_SHAPES//,/ }; do
    echo "$PWD/$OLD_SRC/src $PWD/$OLD_SRC/benchmarks $P $c $s default" >> $jobs; done
done; done
mkdir -p /tmp/warm
xargs -P $WARM_JOBS -L 1 sh -c 'w=""; [ "$5" = off ] && w="--outlier off"; PYTHONPATH=$0 \
  timeout 400 python3 $1/stage_profile.py --numel 67108864 --worlds $2 --configs $3 \
  --shapes $4 $w --reps 1 --out /tmp/warm/$2-$3-$4-$$ > /dev/null 2>&1' < $jobs
echo "warm-up of $(wc -l < $jobs) variants in $(( $(date +%s) - T0 )) s"
if [ -n "${TESTS_PID:-}" ]; then wait $TESTS_PID; echo "kernels_gpu rc=$?"; tail -3 $OUT/pytest_kernels_gpu.txt; fi
T0=$(date +%s)
if [ "$LADDER" = 1 ]; then
  PYTHONPATH=$PWD/src timeout 240 python3 benchmarks/entry_ladder.py --out $OUT > /tmp/ladder.log 2>&1
  echo "ladder rc=$? in $(( $(date +%s) - T0 )) s"
fi
T0=$(date +%s)
if [ "$DECODE" = 1 ]; then
  PYTHONPATH=$PWD/src timeout 180 python3 benchmarks/decode_boundary.py --out $OUT > /tmp/decode.log 2>&1
  echo "decode_boundary rc=$? in $(( $(date +%s) - T0 )) s"; tail -25 /tmp/decode.log
fi
for numel in 67108864 536870912; do
  for tree in new ${NEW_OFF:+new-off} ${BASE_SRC:+base} ${OLD_SRC:+old}; do
    src=$PWD/src; bench=$PWD/benchmarks; shapes=$NEW_SHAPES; w=""
    [ "$tree" = new-off ] && w="--outlier off"
    [ "$tree" = base ] && src=$PWD/$BASE_SRC/src && bench=$PWD/$BASE_SRC/benchmarks
    [ "$tree" = old ] && src=$PWD/$OLD_SRC/src && bench=$PWD/$OLD_SRC/benchmarks && shapes=$OLD_SHAPES
    T0=$(date +%s)
    PYTHONPATH=$src timeout 300 python3 $bench/stage_profile.py --numel $numel --worlds $WORLDS \
      --configs $CONFIGS --shapes $shapes $w --budget-s 240 --label $tree-$numel --out $OUT \
      > /tmp/stages_$tree-$numel.log 2>&1
    echo "stage_profile $tree $numel rc=$? in $(( $(date +%s) - T0 )) s"
  done
done
python3 benchmarks/stage_table.py $OUT
"""),
    Job(name="sp-kernels", kind="nvidia-h200", seconds=300,
        about="the sequence-parallel halves on the stage kernels: the compiled halves against "
              "torch (pytest -k halves), then stage_profile.py's all-reduce and halves side by "
              "side at 1 GiB per rank, P=2/4/8 simulated",
        knobs={"PYTEST_S": "100", "NUMEL": "536870912", "WORLDS": "2,4,8",
               "CONFIGS": "u4,c4-loc-bf16c", "SHAPES": "route", "REPS": "11", "BUDGET_S": "95"},
        records=("2026-12-01-sp-testbed.md",), keep=("summary.txt", "stages-sp.json"),
        script=r"""
export ECHO_FLAG_TIMEOUT_S=20
record_env "$OUT"
cat "$OUT/gpus.txt" "$OUT/versions.txt"
T0=$(date +%s)
timeout $PYTEST_S python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py \
  -k halves > "$OUT/pytest_sp_kernels_gpu.txt" 2>&1
echo "pytest -k halves rc=$? in $(( $(date +%s) - T0 )) s"; tail -3 "$OUT/pytest_sp_kernels_gpu.txt"
T0=$(date +%s)
timeout $(( BUDGET_S + 45 )) python3 benchmarks/stage_profile.py --out "$OUT" --label sp \
  --numel $NUMEL --worlds $WORLDS --configs $CONFIGS \
  --shapes $SHAPES --parts all_reduce,reduce_scatter,all_gather --reps $REPS \
  --budget-s $BUDGET_S > "$OUT/stages_sp.log" 2>&1
echo "stage_profile rc=$? in $(( $(date +%s) - T0 )) s"; grep -c '"part"' "$OUT/stages_sp.log"
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
"""),
    Job(name="train-speed", kind="nvidia-h200", seconds=570,
        about="training tokens/s of simulated TP=4 on the testbed recipe: the per-shard path, "
              "the batched path eager and compiled, the plain model compiled (random tokens)",
        knobs={"COMMS": "echo4", "VARIANTS": "shards batched batched+compile plain+compile",
               "DEADLINE": "420", "LIMIT": "570"},
        records=("2026-12-02-train-speed.md",), keep=("train_speed.json",),
        script=r"""
record_env "$OUT"
timeout "$LIMIT" python3 benchmarks/train_speed.py --comms $COMMS --variants $VARIANTS \
    --deadline-s "$DEADLINE" --out "$OUT/train_speed.json" > "$OUT/train_speed.log" 2>&1
echo "rc=$? in $(( $(date +%s) - START )) s"
grep -v -i "warn" "$OUT/train_speed.log" | tail -12
"""),
    Job(name="x2", kind="nvidia-h200-x2", seconds=590,
        about="two GPUs: exactness (fused + staged p2p, one-shot, graph, two groups + soak; "
              "the halves on p2p), then the P=2 all-reduce with every method and form",
        knobs={"PYTEST_S": "300", "HALVES_S": "200", "BENCH_S": "240",
               "METHODS": "nccl16,oneshot16,p2p4,p2p4-fused,p2p4-staged,p2p4-launch,p2p8,"
                          "p2p4c,p2p4c-staged,p2p4c-fp32,p2p4c-out,p2p4-graph,auto4,auto4c,ref4"},
        records=("2026-11-29-p2p-x2.md", "2026-11-29-p2p-x2-r2.md"), keep=("ar.log",),
        script=r"""
export ECHO_FLAG_TIMEOUT_S=20
nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.nccl.version())"
T0=$(date +%s)
timeout $PYTEST_S python3 -m pytest -q -x -p no:cacheprovider tests/test_p2p_gpu.py \
  -k "not halves" > $OUT/pytest.txt 2>&1
echo "pytest rc=$? in $(( $(date +%s) - T0 )) s"; grep -v "^#loc" $OUT/pytest.txt | tail -15
T0=$(date +%s)
timeout $HALVES_S python3 -m pytest -q -p no:cacheprovider tests/test_p2p_gpu.py \
  -k "halves and x2" > $OUT/pytest_halves.txt 2>&1
echo "pytest -k halves rc=$? in $(( $(date +%s) - T0 )) s"; grep -v "^#loc" $OUT/pytest_halves.txt | tail -8
T0=$(date +%s)
timeout $BENCH_S python3 benchmarks/allreduce.py --world 2 --out $OUT --iters 50 \
  --budget-s $(( BENCH_S - 40 )) --methods $METHODS > $OUT/ar.log 2>&1
echo "allreduce rc=$? in $(( $(date +%s) - T0 )) s"; grep -v "^#loc" $OUT/ar.log | grep -A 16 "^### P=2"; grep ERROR $OUT/ar.log | head -5
"""),
    Job(name="header-x2", kind="nvidia-h200-x2", seconds=480,
        about="two GPUs: every call's length and width in its packet header (tests/"
              "test_p2p_gpu.py -k 'header or soak': 1,000 lengths on one workspace, a "
              "mismatch refused on both ranks), then the serving benchmark: LENGTHS distinct "
              "prefill lengths through the communicator (one-shot, NCCL and p2p routes by size; "
              "benchmarks/signature_check.py --backend nccl): agreements and ms per call, new "
              "lengths against seen ones",
        knobs={"LENGTHS": "1000", "HIDDEN": "4096", "CONFIGS": "echo4 4", "SOAK": "20000"},
        records=("2026-12-05-defined-answers-3.md",), keep=("serve.log",),
        script=r"""
export ECHO_FLAG_TIMEOUT_S=20
record_env "$OUT"
T0=$(date +%s)
ECHO_SOAK_CALLS=$SOAK timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_p2p_gpu.py \
  -k "header or soak" > "$OUT/pytest_header.txt" 2>&1
echo "pytest rc=$? in $(( $(date +%s) - T0 )) s"; grep -v "^#loc" "$OUT/pytest_header.txt" | tail -6
T0=$(date +%s)
timeout 150 python3 benchmarks/signature_check.py --backend nccl --world 2 --lengths "$LENGTHS" \
  --hidden "$HIDDEN" --configs $CONFIGS --out "$OUT/serve.json" > "$OUT/serve.log" 2>&1
echo "serve rc=$? in $(( $(date +%s) - T0 )) s"; tail -6 "$OUT/serve.log"
"""),
    Job(name="e2e-x2", kind="nvidia-h200-x2", seconds=400,
        about="end to end at TP=2 (benchmarks/e2e.py: Llama-3-8B / Qwen3-8B shapes, random "
              "weights): prefill and training step, idle and under background load, the time "
              "inside the all-reduce (EXTRA=--phase-log: clocks and power per phase; CASES="
              "decode: the decode step)",
        knobs={"CASES": "prefill train", "LOADS": "0 1.0", "ORDER": "nccl16 echo4",
               "ITERS": "3", "EXTRA": "--call-times", "E2E_S": "360"},
        records=("2026-11-30-e2e-P2-r5.md", "2026-11-30-e2e-P2-power.md",
                 "2026-11-29-e2e-P2-r2.md"), keep=("e2e.log",),
        script=r"""
export ECHO_FLAG_TIMEOUT_S=20
nvidia-smi -L
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,utilization.gpu,\
temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader,nounits -lms 100 \
  > $OUT/smi.csv & SMI=$!
timeout $E2E_S torchrun --nproc-per-node 2 benchmarks/e2e.py --out $OUT --cases $CASES \
  --loads $LOADS --order $ORDER --iters $ITERS $EXTRA > $OUT/e2e.log 2>&1
echo "e2e rc=$?"; kill $SMI; grep -v "^#loc" $OUT/e2e.log | grep "^|" | tail -20
"""),
    Job(name="megatron-x2", kind="nvidia-h200-x2", seconds=360,
        about="megatron-core's GPTModel trained with Echo at TP=2 over NCCL "
              "(examples/megatron_train.py, bf16): 16 vs naive 4 vs echo4, same init and "
              "batches; TOKENS: a carried token file, else the shipped text (a smoke run)",
        knobs={"TOKENS": "/tmp/megatron/tokens.bin", "MEGATRON_S": "300",
               "MEGATRON_STEPS": "300"},
        carry=(MEGATRON_WHEEL,), keep=("megatron_summary.json",),
        script=r"""
export ECHO_FLAG_TIMEOUT_S=20
T0=$(date +%s)
python3 -c "import megatron.core" 2>/dev/null || python3 -m pip install -q --no-deps --no-index \
  --find-links .whl megatron-core==0.16.1 > $OUT/megatron.log 2>&1
mkdir -p "$(dirname "$TOKENS")"
[ -f "$TOKENS" ] || python3 -m echo_tp.cli tokenize src/echo_tp/assets/text/heldout_rowlandson.txt \
  --tokenizer gutenberg-8k --out "$TOKENS" >> $OUT/megatron.log 2>&1
timeout $MEGATRON_S torchrun --nproc-per-node 2 examples/megatron_train.py --tokens "$TOKENS" \
  --comm 16 4 echo4 --steps $MEGATRON_STEPS --dtype bfloat16 --layers 8 --hidden 1024 \
  --heads 16 --seq-len 1024 --batch-size 8 --lr 1e-3 --out-dir /tmp/megatron/run >> $OUT/megatron.log 2>&1
echo "megatron rc=$? in $(( $(date +%s) - T0 )) s"; grep -E "^ +[0-9a-z:=]+: [0-9]+ steps" $OUT/megatron.log
cp /tmp/megatron/run/summary.json $OUT/megatron_summary.json 2>/dev/null
"""),
    # ----- accuracy and training studies (studies/) -----
    Job(name="testbed", kind="nvidia-h200", seconds=450,
        about="the fidelity testbed trained (studies/testbed/: model.json, recipe.sh), its "
              "massive activations, and (QUICK=1) a first look at naive 4-bit at simulated "
              "TP=8 and 4; the checkpoint stays in .work/testbed/ for the jobs after it",
        knobs={"STEPS": "", "BUDGET": "340", "QUICK": "1"}, carry=(GUT108,),
        records=("2026-12-01-fidelity-testbed.md", "2026-12-01-edge-sites.md",
                 "2026-12-01-sp-testbed.md"), keep=("train.log", "massive.txt"),
        script=r"""
set -e
source studies/testbed/recipe.sh
record_env "$OUT"
D=$TESTBED_DATA
RUN=.work/testbed
rm -rf "$RUN"
python3 -m echo_tp.cli train $(testbed_args "${STEPS:-$TESTBED_STEPS}") \
    --time-budget "$BUDGET" --compile --save-dtype bfloat16 --seed 0 \
    --out-dir $RUN --no-progress > "$OUT/train.log" 2>&1 \
    || { tail -40 "$OUT/train.log"; exit 1; }
tail -5 "$OUT/train.log"
cp $RUN/log.csv "$OUT/train-log.csv"
CK=$(testbed_checkpoint)
echo "checkpoint $CK"
python3 studies/massive_activations.py --model "$CK" --data $D/gut108.val.bin --bos \
    --out "$OUT/massive.json" | tee "$OUT/massive.txt" | tail -3
[ "$QUICK" = 1 ] || exit 0
for P in 8 4; do
  python3 -m echo_tp.cli eval --model "$CK" --data $D/gut108.val.bin --bos --dtype bfloat16 \
      --context 512 --batch-size 16 --max-windows 128 --comms 16 4 echo4 --simulate $P \
      --no-progress --out "$OUT/quick-tp$P.json" | tail -4
done
"""),
    Job(name="sim-fused-test", kind="nvidia-h200", seconds=120,
        about="the GPU test of the simulated communicator's fused path (run before the "
              "fidelity evaluations, which use it)",
        keep=("gpu-test.txt",),
        script=r"""
python3 -m pytest -q -x tests/test_kernels_gpu.py -k simulated_communicator \
    > "$OUT/gpu-test.txt" 2>&1; rc=$?
tail -1 "$OUT/gpu-test.txt"; exit $rc
"""),
    Job(name="fidelity", kind="nvidia-h200", seconds=520,
        about="after `testbed`: the main comm configs on 307k held-out tokens (600 BOS-started "
              "windows of 512, bf16) at simulated TP=8 with per-window NLLs and last-word "
              "accuracy; the testbed rotated; TP=4; the demo model on WikiText-2",
        knobs={"DEADLINE": "500"}, carry=(GUT108, WIKI8K), needs=(TESTBED,),
        records=("2026-12-01-fidelity-testbed.md",),
        script=r"""
record_env "$OUT"
D=.work/data
CK=$(testbed_checkpoint)
echo "testbed checkpoint: $CK"
EV="python3 -m echo_tp.cli eval --bos --dtype bfloat16 --context 512 --batch-size 32 --kl
    --last-word --no-progress --calibration-windows 8"
TB="--model $CK --data $D/gut108.val.bin --calibration-data $D/gut108.bin --max-windows 600"
eval_row tp8 $TB --simulate 8 --comms 16 4 8 echo4 echo4-output echo4:g=64 echo4:g=32 early8 \
    'echo4:policy=telemetry-rel@4.6' 'echo4:policy=telemetry@4.6' \
    'echo4:policy=telemetry-rel@5.0' 'echo4:policy=telemetry-rel@5.5'
eval_row tp8-rot $TB --simulate 8 --rotate 0 --comms 16 4 echo4 echo4:g=64 early8
eval_row tp4 $TB --simulate 4 --comms 16 4 8 echo4 echo4-output echo4:g=64 early8 \
    'echo4:policy=telemetry-rel@4.6' 'echo4:policy=telemetry-rel@5.0'
DM="--model src/echo_tp/assets/models/demo-8k --data $D/wiki8k.bin --calibration-data $D/gut108.bin"
eval_row demo-tp4 $DM --simulate 4 --max-windows 600 --comms 16 4 8 echo4 echo4-output echo4:g=64 \
    early8 'echo4:policy=telemetry-rel@4.6' 'echo4:policy=telemetry-rel@5.0'
echo "total $(( $(date +%s) - START )) s"
"""),
    Job(name="ends-tp8", kind="nvidia-h200", seconds=200,
        about="after `testbed` (QUICK=0): the default's ends at 8 bits against every site at 4 "
              "bits, last8 and the telemetry policy, at simulated TP=8 on the held-out tokens, "
              "with KL",
        knobs={"DEADLINE": "540"}, carry=(GUT108,), needs=(TESTBED,),
        records=("2026-12-01-edge-sites.md",),
        script=r"""
D=.work/data
EV="python3 -m echo_tp.cli eval --bos --dtype bfloat16 --context 512 --batch-size 32 --kl
    --no-progress --calibration-windows 8"
U=echo4:edge_bits=0
POL="echo4:policy=ends8 $U,policy=last8 echo4:policy=telemetry-rel@4.6"
CK=$(testbed_checkpoint)
TB="--model $CK --data $D/gut108.val.bin --calibration-data $D/gut108.bin --max-windows 600"
eval_row tp8 $TB --simulate 8 --comms 16 4 $U $POL
"""),
    Job(name="ends-more", kind="nvidia-h200", seconds=540,
        about="after `testbed`: the outlier packet (studies/outlier_packet.py) and first8 / "
              "g=64 rows at TP=8, the TP=4 rows, simulated TP=4 training speed (12 steps), the "
              "GPU tests",
        knobs={"DEADLINE": "540"}, carry=(GUT108,), needs=(TESTBED,),
        records=("2026-12-01-edge-sites.md", "2026-12-01-train-seeds.md"),
        script=r"""
D=.work/data
U=echo4:edge_bits=0
POL="echo4:policy=ends8 $U,policy=last8 echo4:policy=telemetry-rel@4.6"
CK=$(testbed_checkpoint)
TB="--model $CK --data $D/gut108.val.bin --calibration-data $D/gut108.bin --max-windows 600"
EV="python3 studies/outlier_packet.py --bos --dtype bfloat16 --context 512 --batch-size 32
    --kl --no-progress"
eval_row tp8-outlier $TB --simulate 8 --comms 4 $U echo4:policy=ends8
EV="python3 -m echo_tp.cli eval --bos --dtype bfloat16 --context 512 --batch-size 32 --kl
    --no-progress --calibration-windows 8"
eval_row tp8-more $TB --simulate 8 --comms $U,policy=first8 $U,g=64 echo4:g=64,policy=ends8
eval_row tp4 $TB --simulate 4 --comms 16 4 $U $POL
python3 -m echo_tp.cli train --model studies/testbed/model.json --train-data $D/gut108.bin \
    --val-data $D/gut108.val.bin --bos --batch-size 64 --seq-len 512 --lr 2e-3 --min-lr 2e-4 \
    --weight-decay 0.1 --sync-every 25 --eval-batches 4 --simulate 4 --comm echo4 --steps 12 \
    --warmup 1 --no-progress --out-dir .work/probe > "$OUT/train-speed.log" 2>&1
echo "== train speed"; grep -i "tokens" "$OUT/train-speed.log" | tail -3
t0=$(date +%s)
python3 -m pytest -q tests/test_kernels_gpu.py tests/test_p2p_gpu.py -p no:cacheprovider \
    > "$OUT/pytest-gpu.txt" 2>&1; echo "== pytest rc=$? ($(( $(date +%s) - t0 )) s)"
tail -3 "$OUT/pytest-gpu.txt"
echo "total $(( $(date +%s) - START )) s"
"""),
    Job(name="sp-testbed", kind="nvidia-h200", seconds=400,
        about="after `testbed` (QUICK=0): sequence-parallel Echo against the all-reduce on the "
              "held-out tokens at simulated TP=P (SP naive 4-bit, echo4 with 8-bit and 4-bit "
              "gathers; then 16, 4, echo4 without SP), with KL",
        knobs={"P": "8", "DEADLINE": "560"}, carry=(GUT108,), needs=(TESTBED,),
        records=("2026-12-01-sp-testbed.md",),
        script=r"""
D=.work/data
CK=$(testbed_checkpoint)
export ECHO_BACKEND=reference
EV="python3 -m echo_tp.cli eval --model $CK --data $D/gut108.val.bin --bos --dtype bfloat16
    --context 511 --batch-size 32 --max-windows 600 --simulate $P --kl --no-progress"
eval_row sp --sequence-parallel --comms 16 4 echo4 echo4:gather_bits=4 4:gather_bits=8
eval_row nonsp --comms 16 4 echo4
echo "total $(( $(date +%s) - START )) s"
"""),
    Job(name="study", kind="nvidia-h200", seconds=560,
        about="the first accuracy study: studies/train_study.py (training runs + the demo "
              "model), then studies/inference_study.py on the 16-bit-trained model",
        knobs={"TRAIN_BUDGET_S": "270"}, carry=(STUDY,),
        records=("2026-11-29-studies.md",), keep=("results.tar.gz", "demo_model.tar.gz"),
        script=r"""
W=/tmp/study; rm -rf $W; mkdir -p $W
record_env $W
python3 studies/train_study.py --data .work/study --out $W/train --budget-s "$TRAIN_BUDGET_S" 2>&1 | tee $W/train_study.log
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
(cd $W && tar -czf $OUT/results.tar.gz gpus.txt versions.txt train_study.log inference_study.log \
  train/summary.json train/loss_curves.png train/*.txt train/*/log.csv train/*/train_config.json \
  inference/inference.json inference/inference.md inference/partial_sums.png inference/eval_raw.json)
ls -la $OUT
"""),
    Job(name="state-study", kind="nvidia-h200-x2", seconds=560,
        about="the compact compensator state (one bf16 tensor, beta1 = beta2 = 0) on the 107M "
              "model: 4 training runs of run A's schedule, then held-out perplexity of the "
              "state variants",
        knobs={"STEPS": "221"}, carry=(STUDY,), records=("2026-11-30-compact-state.md",),
        keep=("train_study.log",),
        script=r"""
W=/tmp/study; mkdir -p $W
record_env $OUT
SINGLE="echo4:beta1=0,beta2=0,state_dtype=bfloat16"
python3 studies/train_study.py --data .work/study --out $W/train --steps $STEPS \
  --demo-steps 0 --run 16bit=16 --run naive4=4 --run echo4=echo4 --run "single-bf16=$SINGLE" \
  2>&1 | tee $OUT/train_study.log
CKPT=$(ls -d $W/train/16bit/checkpoints/step-* | tail -1)
python3 studies/inference_study.py --model "$CKPT" --data .work/study/gut8k.val.bin \
  --out $OUT/inference --comm echo4 --comm "echo4:beta1=0,beta2=0" --comm "$SINGLE" \
  --comm "echo4:state_dtype=bfloat16" --comm "echo4:beta1=0.5,beta2=0.1" --comm early8 \
  --comm "early8:beta1=0,beta2=0,state_dtype=bfloat16" --comm "$SINGLE,g=64" \
  2>&1 | tee $OUT/inference_study.log
mkdir -p $OUT/train && cp $W/train/summary.json $W/train/loss_curves.png $OUT/train/
"""),
    Job(name="train-seeds", kind="nvidia-h200", seconds=580,
        about="training with the collective in the loop, a short schedule set by a speed "
              "probe: simulated TP=4, 16-bit / echo4 / naive 4-bit, two seeds; then sequence-"
              "parallel echo4 (8-bit gathers) and naive 4-bit (superseded by train-schedule)",
        knobs={"MODEL": "studies/testbed/model.json", "BATCH": "64", "SEQ": "512",
               "EVAL_BATCHES": "40", "PER_RUN_S": "38", "EXTRA": "", "DEADLINE": "540"},
        carry=(GUT108,), records=("2026-12-01-train-seeds.md",), keep=("plan.txt",),
        script=r"""
record_env "$OUT"
D=.work/data
COMMON="--model $MODEL --train-data $D/gut108.bin --val-data $D/gut108.val.bin
  --bos --batch-size $BATCH --seq-len $SEQ --lr 2e-3 --min-lr 2e-4 --weight-decay 0.1 --sync-every 25
  --eval-batches $EVAL_BATCHES --simulate 4 --save-dtype bfloat16 --no-progress $EXTRA"
python3 -m echo_tp.cli train $COMMON --comm echo4 --steps 12 --warmup 1 --out-dir .work/probe \
    > "$OUT/probe.log" 2>&1 || { tail -30 "$OUT/probe.log"; exit 1; }
SPS=$(python3 -c "import csv; r=list(csv.DictReader(open('.work/probe/log.csv')));
print((float(r[-1]['elapsed_s'])-float(r[0]['elapsed_s']))/(len(r)-1))")
STEPS=$(python3 -c "print(max(20, int($PER_RUN_S / $SPS)))")
WARM=$(( STEPS / 20 ))
echo "probe: $SPS s/step at echo4 -> $STEPS steps per run (warmup $WARM)" | tee "$OUT/plan.txt"
one() {
  local name=$1; shift
  if (( $(date +%s) - START > DEADLINE )); then echo "SKIPPED $name (deadline)"; return; fi
  python3 -m echo_tp.cli train $COMMON --steps $STEPS --warmup $WARM --out-dir .work/seeds/$name \
      "$@" > "$OUT/$name.log" 2>&1 || echo "FAILED $name"
  cp .work/seeds/$name/log.csv "$OUT/$name.csv" 2>/dev/null
  tail -2 "$OUT/$name.log" | head -1
}
for seed in 0 1; do
  for comm in 16 echo4 4; do
    one $comm-s$seed --comm $comm --seed $seed
  done
done
one sp-echo4-gb8-s0 --comm echo4:gather_bits=8 --seed 0 --sequence-parallel
one sp-4-s0 --comm 4 --seed 0 --sequence-parallel
echo "total $(( $(date +%s) - START )) s"
"""),
    Job(name="schedule-probe", kind="nvidia-h200", seconds=560,
        about="the testbed schedule chosen by held-out loss: the 16-bit model compiled, the "
              "schedule ending after 1, 2 and 3 passes (PASSES), held-out loss every quarter "
              "pass, each final model on WikiText-2 (wiki8k, when carried)",
        knobs={"PASSES": "1 2 3", "DEADLINE": "480", "COMPILE": "--compile", "EXTRA": ""},
        carry=(GUT108, WIKI8K), records=("2026-12-02-train-speed.md",), keep=("probe.txt",),
        script=r"""
source studies/testbed/recipe.sh
record_env "$OUT"
D=$TESTBED_DATA
for passes in $PASSES; do
  if (( $(date +%s) - START > DEADLINE )); then
    echo "SKIPPED $passes passes (deadline)"; continue
  fi
  steps=$(testbed_steps "$passes")
  run=.work/probe/p$passes
  rm -rf "$run"; mkdir -p "$OUT/p$passes"
  python3 -m echo_tp.cli train $(testbed_args "$steps") $COMPILE --seed 0 \
      --eval-every $(( $(testbed_steps 0.25) )) --save-dtype bfloat16 --out-dir "$run" \
      --no-progress $EXTRA > "$OUT/p$passes/train.log" 2>&1 || echo "FAILED $passes passes"
  cp "$run"/{log.csv,val_rows.json,train_config.json} "$OUT/p$passes/" 2>/dev/null
  echo "== $passes passes ($steps steps):" \
       "$(tail -2 "$OUT/p$passes/train.log" | head -1 | cut -c1-160)"
  CK=$(ls -d "$run"/checkpoints/step-* 2>/dev/null | sort -t- -k2 -n | tail -1)
  if [ -f "$D/wiki8k.bin" ] && [ -n "$CK" ]; then
    python3 -m echo_tp.cli eval --model "$CK" --data "$D/wiki8k.bin" --bos --context 512 \
        --comms 16 --simulate 1 --batch-size 32 --max-windows 600 --no-progress $EXTRA \
        --out "$OUT/p$passes/wiki.json" > "$OUT/p$passes/wiki.txt" 2>&1 || echo "FAILED wiki eval"
  fi
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
echo "total $(( $(date +%s) - START )) s"
"""),
    Job(name="train-schedule", kind="nvidia-h200", seconds=540,
        about="ONE training run of the testbed recipe (2 passes) at simulated TP=4 on the "
              "batched fast path, compiled, bf16: CONFIG (16, 4, echo4), SEED, LR_FACTOR; the "
              "table and verdict: studies/train_schedule_report.py over the unpacked runs",
        knobs={"CONFIG": "echo4", "SEED": "0", "LR_FACTOR": "1", "SIM_PATH": "batched",
               "COMPILE": "--compile", "BUDGET": "500", "EVAL_EVERY": "",
               "TELEMETRY_EVERY": "", "EXTRA": ""},
        carry=(GUT108,), records=("2026-12-02-train-speed.md",), keep=("log.csv",),
        script=r"""
source studies/testbed/recipe.sh
NAME=$(echo "$CONFIG" | tr ':=,' '_-_')-s$SEED$([ "$LR_FACTOR" = 1 ] || echo "-lr$LR_FACTOR")
echo "run $NAME" | tee "$OUT/name.txt"
record_env "$OUT"
LR=$(python3 -c "print(2e-3 * $LR_FACTOR)"); MIN_LR=$(python3 -c "print(2e-4 * $LR_FACTOR)")
case "$CONFIG" in echo*) TEL=${TELEMETRY_EVERY:-100} ;; *) TEL=${TELEMETRY_EVERY:-0} ;; esac
RUN=.work/schedule/$NAME
rm -rf "$RUN"
python3 -m echo_tp.cli train $(testbed_args "$TESTBED_STEPS") --lr "$LR" --min-lr "$MIN_LR" \
    --simulate 4 --sim-path "$SIM_PATH" $COMPILE --comm "$CONFIG" \
    --seed "$SEED" --eval-every "${EVAL_EVERY:-$(testbed_steps 0.25)}" --telemetry-every "$TEL" \
    --time-budget "$BUDGET" --save-dtype bfloat16 --out-dir "$RUN" --no-progress \
    $EXTRA > "$OUT/train.log" 2>&1
echo "rc=$? in $(( $(date +%s) - START )) s"
cp "$RUN"/{log.csv,val_rows.json,train_config.json,loss.png,telemetry.csv} "$OUT/" 2>/dev/null
tail -2 "$OUT/train.log" | head -1 | cut -c1-220
"""),
    Job(name="model-parts", kind="nvidia-h200", seconds=10,
        about="moves the GGUF pieces carried in FROM (.work/parts) to /tmp/m, where they wait "
              "for `real-llm` on the same machine (a model is larger than one call carries); "
              "FROM names a folder prepared beforehand (.work/p0, .work/p1, ...), so the calls "
              "can follow each other within the machine's warm spell",
        knobs={"M": "/tmp/m", "FROM": ".work/parts"}, carry=(PARTS,),
        script=r"""
mkdir -p "$M"; cp -v "$FROM"/* "$M/" 2>/dev/null || echo "no pieces carried in $FROM"
ls -la "$M"
"""),
    Job(name="real-llm", kind="nvidia-h200", seconds=560,
        about="real pretrained LLMs: SmolLM2-135M (GGUF) at simulated TP=3 on WikiText-2 and "
              "Gutenberg, Gemma-3-270M (GGUF) at TP=2 and 4 on WikiText-2 (BOS 2), every comm "
              "config of the table, with KL; the pieces joined in /tmp/m (model-parts)",
        knobs={"M": "/tmp/m", "FROM": ".work/parts", "REAL_COMMS": "16 8 echo8 4 echo4",
               "REAL_WINDOWS": "1000",
               "REAL_TEXTS": "wiki.valid.raw gutenberg-eval.txt",
               "REAL_MODELS": "smol gemma", "GEMMA_COMMS": "", "GEMMA_WINDOWS": "128"},
        carry=(TEXTS, GGUF_WHEEL, PARTS),
        records=("2026-12-04-real-llm.md", "2026-12-07-runner-h100.md"),
        keep=("real_llm.log",),
        script=r"""
set -e
if [[ " $REAL_MODELS " == *" smol "* ]]; then
  gguf_model smol "$SMOL_SHA"
  for text in $REAL_TEXTS; do
    python3 -m echo_tp.cli eval --model "$M/smol-hf" --data ".work/data/$text" --simulate 3 \
      --context 512 --batch-size 16 --dtype bfloat16 --device cuda --max-windows "$REAL_WINDOWS" \
      --no-progress --kl --comms $REAL_COMMS --out "$OUT/smol-${text%%.*}.json" 2>&1 \
      | grep -v Warn | tee -a "$OUT/real_llm.log"
  done
fi
if [[ " $REAL_MODELS " == *" gemma "* ]]; then
  gguf_model gemma "$GEMMA_SHA"
  for P in 2 4; do
    python3 -m echo_tp.cli eval --model "$M/gemma-hf" --data .work/data/wiki.valid.raw \
      --simulate "$P" --context 512 --bos-id 2 --batch-size 16 --dtype bfloat16 --device cuda \
      --max-windows "$GEMMA_WINDOWS" --no-progress --kl \
      --comms ${GEMMA_COMMS:-$REAL_COMMS} --out "$OUT/gemma-p$P.json" 2>&1 \
      | grep -v Warn | tee -a "$OUT/real_llm.log"
  done
fi
"""),
    Job(name="train-llm", kind="nvidia-h200", seconds=240,
        about="continued pretraining of SmolLM2-135M at simulated TP=3 (studies/"
              "train_real_llm.py), STAGES of: test (the CUDA-graph step == eager, GPU), speed "
              "(tokens/s against the plain model, with and without the graph; MODELS), profile "
              "(the graphed step's kernels, plain vs TP, PROFILE_STEPS under torch.profiler), "
              "probe (the LR), study (CONFIGS x SEEDS, AT_ONCE runs at a time, then their "
              "evaluations); "
              "SIDE_TESTS: pytest arguments run beside the probe and study; "
              "runs in $W, which stays on the machine for the next call",
        knobs={"STAGES": "test speed probe", "MODELS": "testbed smollm2", "SPEED_STEPS": "40",
               "SPEED_DATA": ".work/data/smol-train.bin", "PROFILE_STEPS": "3",
               "CONFIGS": "16 4 echo4", "SEEDS": "0 1", "LR": "", "STUDY_BUDGET": "",
               "AT_ONCE": "1", "SIDE_TESTS": "", "W": "/tmp/train-llm", "M": "/tmp/m",
               "FROM": ".work/parts"},
        carry=(SMOL_DATA, GGUF_WHEEL, PARTS),
        keep=("speed.json", "profile.txt", "profile.json", "study.json"),
        records=("2026-12-05-train-speed-graph.md",),
        script=r"""
record_env "$OUT"; mkdir -p "$W"; has() { [[ " $STAGES " == *" $1 "* ]]; }
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if has test; then
  T0=$(date +%s)
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_train_graph.py \
    > "$OUT/pytest_train_graph.txt" 2>&1
  echo "test_train_graph rc=$? in $(( $(date +%s) - T0 )) s"; tail -3 "$OUT/pytest_train_graph.txt"
fi
if [[ " $MODELS " == *" smollm2"* ]] || has probe || has study; then
  gguf_model smol "$SMOL_SHA" || { echo "no SmolLM2 model"; exit 1; }
  python3 studies/train_real_llm.py prep --gguf "$M/smol.gguf" || exit 1
fi
LLM="python3 studies/train_real_llm.py"
if has speed; then
  $LLM speed --out "$W/speed" --models $MODELS --speed-steps "$SPEED_STEPS" \
    --speed-data "$SPEED_DATA" > "$OUT/speed.log" 2>&1; echo "speed rc=$?"
  cp "$W/speed/speed.json" "$OUT/" 2>/dev/null; cp -r "$W/speed/logs" "$OUT/speed-logs"
  grep -h "tokens/s" "$OUT"/speed-logs/*.log | cut -c1-240
fi
if has profile; then
  $LLM profile --out "$W/profile" --models $MODELS --steps "$PROFILE_STEPS" \
    --speed-data "$SPEED_DATA" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
  cp "$W"/profile/profile.{json,txt} "$OUT/" 2>/dev/null
  cp -r "$W/profile/logs" "$OUT/profile-logs"; mkdir -p "$OUT/profile-runs"
  for r in "$W"/profile/*/profile.json; do
    d=${r%/*}; cp "$r" "$OUT/profile-runs/${d##*/}.json"
  done
  sed -n '1,/^$/p;/ vs /,/^  total/p' "$OUT/profile.txt" 2>/dev/null | cut -c1-160
fi
if [ -n "$SIDE_TESTS" ] && { has probe || has study; }; then   # beside runs whose speed is not read
  (PYTHONPATH=$PWD/src timeout 420 python3 -m pytest -q -p no:cacheprovider $SIDE_TESTS \
     > "$OUT/side_tests.txt" 2>&1; echo "side tests rc=$?" >> "$OUT/side_tests.txt") &
fi
if has probe; then
  $LLM probe --out "$W" --at-once "$AT_ONCE" > "$OUT/probe.log" 2>&1; echo "probe rc=$?"
  tail -1 "$OUT/probe.log"
  cp "$W/probe.json" "$OUT/" 2>/dev/null; cp -r "$W/logs" "$OUT/probe-logs"
fi
if has study; then
  $LLM study --out "$W" ${LR:+--lr "$LR"} --configs $CONFIGS --seeds $SEEDS --at-once "$AT_ONCE" \
    ${STUDY_BUDGET:+--budget "$STUDY_BUDGET"} > "$OUT/study.log" 2>&1; echo "study rc=$?"
  grep -E "rc |training:" "$OUT/study.log"; cp "$W/study.json" "$OUT/" 2>/dev/null
  for r in "$W"/*-s[0-9]*; do
    mkdir -p "$OUT/runs/${r##*/}"
    cp "$r"/{log.csv,val_rows.json,train_config.json,telemetry.csv,result.json,eval-*.json} \
      "$OUT/runs/${r##*/}/" 2>/dev/null
  done
  cp -r "$W/logs" "$OUT/study-logs"
fi
if [ -n "$SIDE_TESTS" ]; then wait; echo "side tests ($SIDE_TESTS):"; tail -4 "$OUT/side_tests.txt"; fi
"""),
]

JOBS: dict[str, Job] = {j.name: j for j in _JOBS}
