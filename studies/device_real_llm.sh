#!/usr/bin/env bash
# The real-LLM fidelity bench on one GPU machine: SmolLM2-135M-Instruct (GGUF) at simulated
# TP=3 on WikiText-2 validation and Gutenberg text, and Gemma-3-270M (GGUF) at TP=2 and 4 on
# WikiText-2 validation (BOS-started windows), every comm config of the table, with KL.
#
# Inputs (carried, git-ignored): the GGUF in pieces under /tmp/m (studies/fetch_models.py
# --split-mib; copied there by earlier calls, see docs/usage/fast-path.md), the texts under
# .work/data, the gguf wheel under .whl (the GPU image has transformers and accelerate, not
# gguf). Outputs under $OUT: one eval JSON per text, the log.
#   REAL_COMMS   the comm specs (default: the table's rows)
#   REAL_WINDOWS windows of 512 tokens per text (default 1000: all of each text)
#   REAL_MODELS  smol, gemma or both (default)
#   GEMMA_COMMS, GEMMA_WINDOWS  as REAL_COMMS / REAL_WINDOWS for Gemma
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
M=${M:-/tmp/m}
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GEMMA_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
MODELS=${REAL_MODELS:-"smol gemma"}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl
export PYTHONPATH=/tmp/site:$PWD/src
convert() {  # name sha: join the pieces, check, write the HF folder once per machine
  if [ ! -d "$M/$1-hf" ]; then
    cat "$M/$1".part* > "$M/$1.gguf"
    echo "$2  $M/$1.gguf" | sha256sum -c -
    python3 -c "from echo_tp.hf.gguf import gguf_to_hf; gguf_to_hf('$M/$1.gguf', '$M/$1-hf')"
  fi
}
COMMS=${REAL_COMMS:-"16 8 echo8 4 echo4"}
WINDOWS=${REAL_WINDOWS:-1000}
if [[ " $MODELS " == *" smol "* ]]; then
  convert smol "$SMOL_SHA"
  for text in wiki.valid.raw gutenberg-eval.txt; do
    python3 -m echo_tp.cli eval --model "$M/smol-hf" --data ".work/data/$text" --simulate 3 \
      --context 512 --batch-size 16 --dtype bfloat16 --device cuda --max-windows "$WINDOWS" \
      --no-progress --kl --comms $COMMS --out "$OUT/smol-${text%%.*}.json" 2>&1 \
      | grep -v Warn | tee -a "$OUT/real_llm.log"
  done
fi
if [[ " $MODELS " == *" gemma "* ]]; then
  convert gemma "$GEMMA_SHA"
  for P in 2 4; do
    python3 -m echo_tp.cli eval --model "$M/gemma-hf" --data .work/data/wiki.valid.raw \
      --simulate "$P" --context 512 --bos-id 2 --batch-size 16 --dtype bfloat16 --device cuda \
      --max-windows "${GEMMA_WINDOWS:-128}" --no-progress --kl \
      --comms ${GEMMA_COMMS:-$COMMS} --out "$OUT/gemma-p$P.json" 2>&1 \
      | grep -v Warn | tee -a "$OUT/real_llm.log"
  done
fi
