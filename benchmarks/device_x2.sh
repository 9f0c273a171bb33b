#!/usr/bin/env bash
# One device call on nvidia-h200-x2: GPU exactness (fused + staged p2p, one-shot, CUDA graph,
# two groups + 10^5-call soak; the reduce-scatter / all-gather halves on p2p), then the
# all-reduce benchmark at P=2 with every method and the kernel forms forced (fused, staged
# serial, staged in one launch), then megatron-core's GPTModel trained with Echo at TP=2 (16 / 4 /
# echo4). Results under $OUT. Run: `bash benchmarks/device_x2.sh`; the training alone (its own
# call, about 6 min; carry .whl): `MEGATRON_ONLY=1 bash benchmarks/device_x2.sh`.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src ECHO_FLAG_TIMEOUT_S=20
nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.nccl.version())"
if [ "${MEGATRON_ONLY:-0}" != 1 ]; then
T0=$(date +%s)
timeout ${PYTEST_S:-300} python3 -m pytest -q -x -p no:cacheprovider tests/test_p2p_gpu.py \
  -k "not halves" > $OUT/pytest.txt 2>&1
echo "pytest rc=$? in $(( $(date +%s) - T0 )) s"; grep -v "^#loc" $OUT/pytest.txt | tail -15
# the reduce-scatter / all-gather halves on real ranks (p2p vs the reference communicator)
T0=$(date +%s)
timeout ${HALVES_S:-200} python3 -m pytest -q -p no:cacheprovider tests/test_p2p_gpu.py \
  -k "halves and x2" > $OUT/pytest_halves.txt 2>&1
echo "pytest -k halves rc=$? in $(( $(date +%s) - T0 )) s"; grep -v "^#loc" $OUT/pytest_halves.txt | tail -8
T0=$(date +%s)
METHODS=${METHODS:-nccl16,oneshot16,p2p4,p2p4-fused,p2p4-staged,p2p4-launch,p2p8,p2p4c,p2p4c-staged,p2p4c-fp32,p2p4c-out,p2p4-graph,auto4,auto4c,ref4}
timeout ${BENCH_S:-240} python3 benchmarks/allreduce.py --world 2 --out $OUT --iters 50 \
  --budget-s $(( ${BENCH_S:-240} - 40 )) --methods $METHODS > $OUT/ar.log 2>&1
echo "allreduce rc=$? in $(( $(date +%s) - T0 )) s"; grep -v "^#loc" $OUT/ar.log | grep -A 16 "^### P=2"; grep ERROR $OUT/ar.log | head -5
fi
# Megatron-core's GPTModel trained with Echo at TP=2 over NCCL (examples/megatron_train.py, bf16):
# 16 vs naive 4 vs echo4, same init and batches. megatron-core is not on the machine (Python
# 3.12): carry its wheel in .whl/, made here with `pip download megatron-core==0.16.1 --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl`, and it is
# installed offline. Tokens: $TOKENS (a .bin + .json from `echo-tp tokenize`, carried), else
# the shipped text (28k tokens: a smoke run, not a measurement).
T0=$(date +%s)
python3 -c "import megatron.core" 2>/dev/null || python3 -m pip install -q --no-deps --no-index \
  --find-links .whl megatron-core==0.16.1 > $OUT/megatron.log 2>&1
TOKENS=${TOKENS:-/tmp/megatron/tokens.bin}
[ -f "$TOKENS" ] || python3 -m echo_tp.cli tokenize src/echo_tp/assets/text/heldout_rowlandson.txt \
  --tokenizer gutenberg-8k --out "$TOKENS" >> $OUT/megatron.log 2>&1
timeout ${MEGATRON_S:-300} torchrun --nproc-per-node 2 examples/megatron_train.py --tokens "$TOKENS" \
  --comm 16 4 echo4 --steps ${MEGATRON_STEPS:-300} --dtype bfloat16 --layers 8 --hidden 1024 \
  --heads 16 --seq-len 1024 --batch-size 8 --lr 1e-3 --out-dir /tmp/megatron/run >> $OUT/megatron.log 2>&1
echo "megatron rc=$? in $(( $(date +%s) - T0 )) s"; grep -E "^ +[0-9a-z:=]+: [0-9]+ steps" $OUT/megatron.log
cp /tmp/megatron/run/summary.json $OUT/megatron_summary.json 2>/dev/null
