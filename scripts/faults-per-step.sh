#!/usr/bin/env bash
# Page faults per training step and samples/s of the three MNIST examples (ddp_mnist, accel_mnist, train_mnist).
#
#   scripts/faults-per-step.sh [BIN_DIR] [NPROC]
#
# BIN_DIR holds the built binaries (default: $CARGO_TARGET_DIR/release, else target/release). Each program runs
# twice, for E1 and E2 epochs (MLP 784-512-512-10, batch 64 per process, AdamW); the difference of the two runs
# removes start-up, data loading and the first steps, so what is left is the steady state:
#   faults/step = Δ minor faults (all processes, GNU time's %R) / Δ optimizer steps (summed over processes)
#   samples/s   = Δ training samples / Δ wall seconds (evaluation of the test set each epoch included)
set -euo pipefail
BIN_DIR=${1:-${CARGO_TARGET_DIR:-target}/release}
NPROC=${2:-2}
E1=${E1:-1}
E2=${E2:-3}
HIDDEN=512,512
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

run() { # bin epochs -> "wall minflt"
  local bin=$1 epochs=$2
  case $bin in
    train_mnist)
      args=(--nproc "$NPROC" --hidden "$HIDDEN" --num-train-epochs "$epochs" --per-device-train-batch-size 64
        --learning-rate 2e-3 --eval-strategy no --save-strategy no --logging-strategy no --report-to none
        --load-best-model-at-end false --early-stopping-patience null --disable-tqdm true --save-plots false --output-dir "$OUT/$bin-$epochs" --overwrite-output-dir true) ;;
    *) args=(--nproc "$NPROC" --hidden "$HIDDEN" --epochs "$epochs" --batch-size 64 --lr 2e-3) ;;
  esac
  /usr/bin/time -f '%e %R' -o "$OUT/time" "$BIN_DIR/$bin" "${args[@]}" >"$OUT/log" 2>&1 || { cat "$OUT/log" >&2; exit 1; }
  cat "$OUT/time"
}

printf '%-12s %6s %12s %12s\n' program nproc samples/s faults/step
for bin in ddp_mnist accel_mnist train_mnist; do
  if [ "$bin" = train_mnist ]; then n_train=9000; else n_train=10000; fi
  per_rank=$(( (n_train + NPROC - 1) / NPROC ))
  steps=$(( (per_rank + 63) / 64 * NPROC ))  # optimizer steps per epoch, all processes together
  r1=$(run "$bin" "$E1")
  r2=$(run "$bin" "$E2")
  read -r w1 f1 <<<"$r1"
  read -r w2 f2 <<<"$r2"
  awk -v b="$bin" -v n="$NPROC" -v w1="$w1" -v w2="$w2" -v f1="$f1" -v f2="$f2" -v e=$((E2 - E1)) \
    -v s="$steps" -v N="$n_train" \
    'BEGIN { printf "%-12s %6d %12.0f %12.0f\n", b, n, e * N / (w2 - w1), (f2 - f1) / (e * s) }'
done
