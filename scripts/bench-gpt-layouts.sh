#!/usr/bin/env bash
# Char-GPT (examples/src/gpt.rs, default size: d_model 128, 4 heads, 4 layers, context 64, d_ff 512 — 820 992
# parameters) trained by `accel_gpt` for a fixed number of optimizer steps at 1 process, dp2, tp2, dp2×tp2 and
# tp4 on this machine's CPUs; prints a markdown table of the throughput (tokens/s over all replicas, the first
# logged interval excluded as warm-up), the final loss and every rank's peak RSS (VmHWM). Not run in CI.
#   scripts/bench-gpt-layouts.sh [steps (default 100)] [extra accel_gpt args, e.g. --batch-size 32]
# The per-replica batch is fixed (--batch-size, default 16), so the global batch grows with dp: compare
# tokens/s, not wall time. Each run's full output is kept in $BENCH_LOG_DIR (default: a temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
steps=${1:-100}
shift || true
# The dev profile (dependencies at opt-level 3, as every example here) and --workspace (the feature set of the
# shared build: no candle rebuild).
cargo build -q --workspace --bin accel_gpt
log_dir=${BENCH_LOG_DIR:-$(mktemp -d)}
mkdir -p "$log_dir"
log_every=$(( steps / 4 > 0 ? steps / 4 : 1 ))

# name nproc tp
layouts=("1-process 1 1" "dp2 2 1" "tp2 2 2" "dp2×tp2 4 2" "tp4 4 4")
rows=()
for layout in "${layouts[@]}"; do
  read -r name nproc tp <<<"$layout"
  log="$log_dir/accel_gpt-$nproc-tp$tp.log"
  echo "== $name: accel_gpt --nproc $nproc --tp-size $tp --steps $steps $*" >&2
  env -u RANK "$target/debug/accel_gpt" --nproc "$nproc" --tp-size "$tp" --steps "$steps" \
    --log-every "$log_every" --sample-len 0 "$@" >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
  # "accel_gpt done: 100 steps in 12.3 s, final loss 2.1234, 12345 tokens/s (dp 2 × tp 1)"
  done_line=$(grep -m1 'accel_gpt done:' "$log")
  tokens=$(sed -E 's/.*, ([0-9.]+) tokens\/s.*/\1/' <<<"$done_line")
  loss=$(sed -E 's/.*final loss ([0-9.NaN]+),.*/\1/' <<<"$done_line")
  secs=$(sed -E 's/.* steps in ([0-9.]+) s,.*/\1/' <<<"$done_line")
  # "rank 1 (dp 0 tp 1): peak RSS 123.4 MiB", one per rank, in rank order.
  rss=$(grep -E 'rank [0-9]+ \(dp [0-9]+ tp [0-9]+\): peak RSS' "$log" | sed -E 's/.*rank ([0-9]+) .*peak RSS ([0-9.]+) MiB.*/\1 \2/' \
    | sort -n | awk '{printf "%s%s", sep, $2; sep=" / "}')
  rows+=("| $name | $nproc | $(( nproc / tp )) | $tp | $tokens | $secs | $loss | $rss |")
done

echo
echo "char-GPT, 820 992 parameters, $steps optimizer steps, $(nproc) CPU cores, $(date -u +%Y-%m-%d) ($*)"
echo
echo "| layout | processes | dp | tp | tokens/s | wall (s) | final loss | peak RSS per rank (MiB) |"
echo "|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
echo
echo "logs: $log_dir" >&2
