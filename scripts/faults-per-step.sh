#!/usr/bin/env bash
# Page faults per training step and samples/s of the three MNIST examples (ddp_mnist, accel_mnist, train_mnist),
# for one or more builds side by side (e.g. before/after a change), interleaved run by run.
#
#   scripts/faults-per-step.sh [-n NPROC] [-r REPS] [-p "ddp_mnist accel_mnist train_mnist"] BIN_DIR...
#
# Each BIN_DIR holds built binaries (e.g. $CARGO_TARGET_DIR/release, or a copy of it). Each program runs twice,
# for E1 and E2 epochs (MLP 784-512-512-10, batch 64 per process, AdamW lr 2e-3); the difference of the two runs
# removes start-up, data loading and the first steps, so what is left is the steady state:
#   faults/step = Δ minor page faults (all processes, GNU time's %R) / Δ optimizer steps (summed over processes)
#   samples/s   = Δ training samples / Δ wall seconds (ddp/accel: with one test-set evaluation per epoch)
# Printed: every measurement, then the median over REPS per program and build.
set -euo pipefail
NPROC=1 REPS=1 PROGRAMS="ddp_mnist accel_mnist train_mnist"
while getopts n:r:p: o; do
  case $o in n) NPROC=$OPTARG ;; r) REPS=$OPTARG ;; p) PROGRAMS=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { echo "usage: $0 [-n NPROC] [-r REPS] [-p PROGRAMS] BIN_DIR..." >&2; exit 2; }
E1=${E1:-1}
E2=${E2:-2}
HIDDEN=512,512
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

run() { # dir bin epochs -> "wall minflt"
  local dir=$1 bin=$2 epochs=$3 args
  case $bin in
    train_mnist)
      args=(--nproc "$NPROC" --hidden "$HIDDEN" --num-train-epochs "$epochs" --per-device-train-batch-size 64
        --learning-rate 2e-3 --eval-strategy no --save-strategy no --logging-strategy no --report-to none
        --load-best-model-at-end false --early-stopping-patience null --disable-tqdm true --save-plots false
        --output-dir "$OUT/trainer" --overwrite-output-dir true) ;;
    *) args=(--nproc "$NPROC" --hidden "$HIDDEN" --epochs "$epochs" --batch-size 64 --lr 2e-3) ;;
  esac
  /usr/bin/time -f '%e %R' -o "$OUT/time" "$dir/$bin" "${args[@]}" >"$OUT/log" 2>&1 || { cat "$OUT/log" >&2; exit 1; }
  cat "$OUT/time"
}

echo "# $(date -u +%FT%TZ), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), nproc $NPROC"
printf '%-12s %-28s %6s %10s %12s\n' program build nproc samples/s faults/step | tee "$OUT/rows"
for _ in $(seq "$REPS"); do
  for bin in $PROGRAMS; do
    if [ "$bin" = train_mnist ]; then n_train=9000; else n_train=10000; fi
    per_rank=$(((n_train + NPROC - 1) / NPROC))
    steps=$(((per_rank + 63) / 64 * NPROC)) # optimizer steps per epoch, all processes together
    for dir in "$@"; do
      r1=$(run "$dir" "$bin" "$E1")
      r2=$(run "$dir" "$bin" "$E2")
      read -r w1 f1 <<<"$r1"
      read -r w2 f2 <<<"$r2"
      awk -v b="$bin" -v d="$dir" -v n="$NPROC" -v w1="$w1" -v w2="$w2" -v f1="$f1" -v f2="$f2" \
        -v e=$((E2 - E1)) -v s="$steps" -v N="$n_train" \
        'BEGIN { printf "%-12s %-28s %6d %10.0f %12.0f\n", b, d, n, e * N / (w2 - w1), (f2 - f1) / (e * s) }' |
        tee -a "$OUT/rows"
    done
  done
done
echo "# medians over $REPS run(s); load average now $(cut -d' ' -f1-3 /proc/loadavg)"
tail -n +2 "$OUT/rows" | sort -k1,2 -k4n | awk -v r="$REPS" '
  { key = $1 " " $2; n[key]++; if (n[key] == int((r + 1) / 2)) { printf "%-12s %-28s %6d %10d %12d\n", $1, $2, $3, $4, $5 } }'
