# Sourced by the studies' one-call device scripts: the environment every call needs
# (multicast/NVLS off, the package from this checkout) and `record_env DIR`, which writes the
# hardware and versions of the run to DIR/gpus.txt and DIR/versions.txt.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src

record_env() {
  nvidia-smi --query-gpu=name,memory.total --format=csv > "$1/gpus.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" > "$1/versions.txt"
}

# archive_results NAME: at most 8 files come back from a device call, so a script works in
# /tmp/NAME-work (its $OUT from here on) and `pack` rewrites $FINAL/NAME.tgz after every step
# (a call cut short still returns what it finished); FINAL is the caller's $OUT.
archive_results() {
  FINAL=${OUT:-/tmp/$1-out}; OUT=/tmp/$1-work; ARCHIVE="$FINAL/$1.tgz"
  rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL"
}
pack() { tar -czf "$ARCHIVE" -C "$OUT" .; }

# run NAME ARGS...: one `$EV ARGS --out $OUT/NAME.json` (EV: the caller's eval command) unless
# DEADLINE seconds have passed since START; prints its table and packs the archive.
run() {
  local name=$1; shift
  if (( $(date +%s) - START > DEADLINE )); then echo "SKIPPED $name (deadline)"; return; fi
  local t0=$(date +%s)
  $EV "$@" --out "$OUT/$name.json" > "$OUT/$name.txt" 2>&1 || echo "FAILED $name"
  echo "== $name ($(( $(date +%s) - t0 )) s)"; tail -n +2 "$OUT/$name.txt" | cut -c1-140
  pack
}
