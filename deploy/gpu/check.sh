#!/usr/bin/env bash
# The GPU check of the CUDA backend, for a machine with an NVIDIA GPU and CUDA 13 libraries
# (libcuda, libcublas, libnvrtc). In under 5 minutes it
#   1. builds the worker, parameter server and launcher in release mode,
#   2. runs the CPU-vs-GPU agreement tests (worker/tests/cuda_agreement.rs), which must not skip,
#   3. times a training step of a small and a large MLP on the CPU and the GPU, against a plain
#      cuBLAS SGEMM of the same products measured in the same run (edl-gpu-bench),
#   4. runs a short real training job whose workers train on the GPU (edl-local, EDL_DEVICE),
# and writes a summary table to stdout and to $OUT/summary.md, with every log under $OUT when
# OUT is set (else under a new temporary directory).
#
# It builds with the `gpu-check` profile (release, stripped, no debug info) into
# target/gpu-check/. The device machines we borrow cannot reach crates.io: build there first
# with `deploy/gpu/check.sh --build-only` on a machine that can, carry the five binaries
# target/gpu-check/{edl-cuda-agreement,edl-gpu-bench,edl-local,edl-ps,edl-worker} (about
# 35 MiB together; not the whole folder, which holds the build's intermediates) and
# target/gpu-check/lib (the shared libraries they need that a bare machine lacks, such as
# fontconfig for edl-local's plots; 2 MiB) with the working tree, and run it with
# EDL_CHECK_PREBUILT=1.
#
# Environment: OUT (where results go), EDL_CHECK_PREBUILT=1 (skip the build and use the
# binaries already in target/gpu-check), EDL_DATA_DIR (Fashion-MNIST idx files; without them a
# synthetic dataset of the same format is generated), CARGO_NET_OFFLINE and the like pass to
# cargo as usual.
set -uo pipefail
cd "$(dirname "$0")/../.."

START=$(date +%s)
OUT_DIR=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/edl-gpu-check.XXXXXX")}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/edl-gpu-work.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
SUMMARY=$OUT_DIR/summary.md
ROWS=$WORK/rows.md
: >"$ROWS"
FAILED=0
RESULTS=()

elapsed() { echo $(($(date +%s) - START)); }
say() { echo "== [$(elapsed) s] $*" >&2; }
# record NAME RESULT DETAIL: one row of the summary table.
record() {
  RESULTS+=("| $1 | $2 | ${3//|//} |")
  [ "$2" = ok ] || FAILED=1
}

write_summary() {
  {
    echo "# EDL GPU check"
    echo
    echo "- device: ${GPU_INFO:-unknown}"
    echo "- CUDA libraries: ${CUDA_LIBS:-from the default search path}"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
    echo "- total time: $(elapsed) s"
    echo
    echo "| check | result | detail |"
    echo "|---|---|---|"
    printf '%s\n' "${RESULTS[@]}"
    if [ -s "$ROWS" ]; then
      echo
      echo "## Training step (forward + backward, parameters up, gradients down)"
      echo
      echo "FLOP count: 2·M·N·K per GEMM a step runs (forward, weight gradients, input"
      echo "gradients except the first layer's, just under 3x the forward pass). SGEMM: the same"
      echo "cuBLAS products back to back on resident buffers, no kernels or transfers. copy: the"
      echo "parameters up and the gradients down through pinned memory, not overlapped."
      echo
      cat "$ROWS"
    fi
    echo
    echo "Logs: $OUT_DIR"
  } >"$SUMMARY"
  cat "$SUMMARY"
}

# --- Device and CUDA libraries -------------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi >"$OUT_DIR/nvidia-smi.txt" 2>&1
  GPU_INFO=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n1)
fi
# cudarc loads libcublas and libnvrtc by name; add the usual toolkit places to the search path
# when the dynamic loader does not know them already.
lib_known() { ldconfig -p 2>/dev/null | grep -q "$1"; }
if ! lib_known libcublas.so || ! lib_known libnvrtc.so; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib64 \
    $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
    if [ -d "$d" ] && { ls "$d"/libcublas.so* || ls "$d"/libnvrtc.so*; } >/dev/null 2>&1; then
      CUDA_LIBS="${CUDA_LIBS:+$CUDA_LIBS:}$d"
    fi
  done
  [ -n "${CUDA_LIBS:-}" ] && export LD_LIBRARY_PATH="$CUDA_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
say "device: ${GPU_INFO:-no nvidia-smi}; extra library path: ${CUDA_LIBS:-none}"

# --- 1. Build ------------------------------------------------------------------------------
BIN=target/gpu-check
AGREE=$BIN/edl-cuda-agreement
if [ "${EDL_CHECK_PREBUILT:-0}" = 1 ]; then
  record "release build" ok "skipped (EDL_CHECK_PREBUILT=1)"
else
  say "building in release mode"
  b0=$(elapsed)
  if cargo build --profile gpu-check --locked -p edl-worker -p edl-ps -p edl-deploy --bins \
    >"$OUT_DIR/build.log" 2>&1 &&
    cargo test --profile gpu-check --locked -p edl-worker --test cuda_agreement --no-run \
      --message-format=json >"$WORK/test-build.json" 2>>"$OUT_DIR/build.log"; then
    exe=$(grep -o '"executable":"[^"]*cuda_agreement[^"]*"' "$WORK/test-build.json" | tail -n1 | cut -d'"' -f4)
    if [ -n "$exe" ] && cp "$exe" "$AGREE"; then
      record "release build" ok "$(($(elapsed) - b0)) s"
    else
      record "release build" FAILED "no agreement test executable; see build.log"
    fi
  else
    record "release build" FAILED "see build.log"
    tail -n 30 "$OUT_DIR/build.log" >&2
    write_summary
    exit 1
  fi
fi

if [ "${1:-}" = --build-only ]; then
  # The device machines are bare: edl-local's plots link fontconfig and freetype, which they
  # lack. Keep the libraries the binaries need beside them, but not the C library's own.
  mkdir -p "$BIN/lib"
  for b in "$BIN"/edl-local "$BIN"/edl-ps "$BIN"/edl-worker; do
    ldd "$b" 2>/dev/null | awk '$3 ~ /^\// {print $3}'
  done | sort -u | grep -Ev '/(libc|libm|libgcc_s|libpthread|libdl|librt|ld-linux[^/]*)\.so' |
    while read -r lib; do cp -L "$lib" "$BIN/lib/"; done
  say "built into $BIN (with $(ls "$BIN/lib" | wc -l) libraries in $BIN/lib); carry its five binaries and lib/ to the GPU machine and run with EDL_CHECK_PREBUILT=1"
  exit "$FAILED"
fi
# Libraries carried with prebuilt binaries (see --build-only).
[ -d "$BIN/lib" ] && export LD_LIBRARY_PATH="$PWD/$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# --- 2. Agreement tests --------------------------------------------------------------------
say "CPU-vs-GPU agreement tests"
if [ -x "$AGREE" ] && EDL_REQUIRE_CUDA=1 timeout 180 "$AGREE" --nocapture --test-threads 1 \
  >"$OUT_DIR/agreement.log" 2>&1; then
  worst=$(grep -o 'max rel [0-9.e+-]*' "$OUT_DIR/agreement.log" | awk '{ if ($3 + 0 > w) w = $3 + 0 } END { printf "%.2e", w }')
  n=$(grep -c 'max rel' "$OUT_DIR/agreement.log")
  dev=$(grep -m1 '^device ' "$OUT_DIR/agreement.log" | cut -d' ' -f3-)
  record "CPU-vs-GPU agreement" ok "$n gradient tensors, worst max relative error $worst (limit 1e-4); $dev"
else
  record "CPU-vs-GPU agreement" FAILED "see agreement.log: $(grep -m1 -A1 'panicked at' "$OUT_DIR/agreement.log" | tail -n1 | cut -c1-160)"
fi
grep -E '^test |test result' "$OUT_DIR/agreement.log" >&2

# --- 3. Step timing ------------------------------------------------------------------------
BENCH=$BIN/edl-gpu-bench
"$BENCH" header >"$ROWS" 2>/dev/null
bench() {
  local label=$1 layers=$2 batch=$3 cpu_steps=$4 gpu_steps=$5
  say "timing the $label MLP ($layers, batch $batch)"
  if timeout 150 "$BENCH" step --require-gpu --markdown --label "$label" --layers "$layers" \
    --batch "$batch" --cpu-steps "$cpu_steps" --gpu-steps "$gpu_steps" \
    >>"$ROWS" 2>>"$OUT_DIR/bench.log"; then
    record "step timing, $label" ok "$layers, batch $batch"
  else
    record "step timing, $label" FAILED "see bench.log"
  fi
}
bench small 784,256,128,10 64 50 200
bench large 784,4096,4096,10 512 2 30
cat "$OUT_DIR/bench.log" >&2

# --- 4. A real training job on the GPU ----------------------------------------------------
DATA=${EDL_DATA_DIR:-/usr/share/datasets/fashion-mnist}
data_note="Fashion-MNIST"
if ! ls "$DATA"/train-images-idx3-ubyte* >/dev/null 2>&1; then
  DATA=$WORK/synthetic
  data_note="synthetic idx data (no Fashion-MNIST here)"
  "$BENCH" synth-data "$DATA" 2>>"$OUT_DIR/train.log"
fi
say "training 1 epoch with 2 GPU workers on $data_note"
t0=$(elapsed)
STATE=$WORK/train-state
if EDL_DEVICE=cuda:0 timeout 170 "$BIN"/edl-local --workers 2 --shards 2 --epochs 1 \
  --data-dir "$DATA" --state-dir "$STATE" --report "$OUT_DIR/train-report.json" \
  --no-progress --stall-timeout 60 >>"$OUT_DIR/train.log" 2>&1; then
  acc=$(grep -oE '"test_accuracy": *[0-9.eE+-]+' "$OUT_DIR/train-report.json" | grep -oE '[0-9.eE+-]+$')
  tput=$(grep -oE '"throughput_samples_per_s": *[0-9.eE+-]+' "$OUT_DIR/train-report.json" | grep -oE '[0-9.eE+-]+$')
  detail="1 epoch of $data_note in $(($(elapsed) - t0)) s: test accuracy ${acc:-?}, ${tput:-?} samples/s"
  if ! grep -q "CUDA backend ready" "$STATE"/logs/w*.log 2>/dev/null; then
    record "training job" FAILED "the job ran, but the worker logs do not show the CUDA backend"
  elif ! awk -v a="${acc:-0}" 'BEGIN { exit !(a >= 0.7) }'; then
    # One epoch reaches about 0.85 on Fashion-MNIST; far less means wrong gradients.
    record "training job" FAILED "test accuracy below 0.7: $detail"
  else
    record "training job" ok "2 workers on the GPU, $detail"
  fi
else
  record "training job" FAILED "see train.log and logs/"
fi
[ -d "$STATE/logs" ] && cp -r "$STATE/logs" "$OUT_DIR/logs"
tail -n 5 "$OUT_DIR/train.log" >&2

write_summary
if [ "$(elapsed)" -ge 300 ]; then
  echo "warning: the check took $(elapsed) s, over its 5-minute budget" >&2
fi
exit "$FAILED"
