#!/usr/bin/env bash
# Sharded data parallelism, stage by stage (docs/benchmarks.md): the char-GPT trained by
# `accel_gpt` on 2 and 4 processes as plain DDP and with dp_shard = all of them under SHARD_OPTIM (ZeRO-1),
# SHARD_GRAD_OP (ZeRO-2) and FULL_SHARD (ZeRO-3). Prints a markdown table per process count: tokens/s and the ratio
# to DDP, every rank's peak RSS (VmHWM), what rank 0 holds when it steps (parameters, gradients, optimizer state:
# measured from the prepared model, its gradient slots and the optimizer's state), and the data-parallel bytes
# per optimizer step — the payload rank 0 passes to its collectives and what ring algorithms send, as a multiple
# of Ψ·(n−1)/n (ZeRO §7: 2 for DDP, ZeRO-1 and ZeRO-2 without accumulation, 3 for FULL_SHARD). Not run in CI.
#
#   scripts/bench-sharded.sh [steps (default 60)] [extra accel_gpt args, e.g. --d-model 256 --n-layer 6]
#
# The per-replica batch is fixed (--batch-size, default 16), the same for every stage at one process count, so
# the stages train the same global batch and end at the same loss (printed). Each run's output is kept in
# $BENCH_LOG_DIR (default: a temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
steps=${1:-60}
shift || true
cargo build -q -p accel-examples --bin accel_gpt
log_dir=${BENCH_LOG_DIR:-$(mktemp -d)}
mkdir -p "$log_dir"
log_every=$((steps / 3 > 0 ? steps / 3 : 1))

echo "char-GPT sharded stages, $steps optimizer steps, $(nproc) CPU cores, load $(cut -d' ' -f1 /proc/loadavg)," \
    "$(date -u '+%Y-%m-%d %H:%M UTC') (extra args: ${*:-none})"
for n in 2 4; do
    echo
    echo "**$n processes**"
    echo
    echo "| stage | tokens/s | vs DDP | final loss | peak RSS per rank (MiB) | rank 0 parameters / gradients / optimizer (MiB) | dp payload per step (B) | ring bytes per step | = × Ψ·(n−1)/n |"
    echo "|---|---|---|---|---|---|---|---|---|"
    ddp_tokens=""
    for stage in DDP SHARD_OPTIM SHARD_GRAD_OP FULL_SHARD; do
        log="$log_dir/accel_gpt-$n-$stage.log"
        flags=()
        [[ $stage != DDP ]] && flags=(--dp-shard-size "$n" --sharding-strategy "$stage")
        env -u RANK "$target/debug/accel_gpt" --nproc "$n" "${flags[@]}" --steps "$steps" --log-every "$log_every" \
            --sample-len 0 "$@" >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
        done_line=$(grep -m1 'accel_gpt done:' "$log")
        tokens=$(sed -E 's/.*, ([0-9.]+) tokens\/s.*/\1/' <<<"$done_line")
        loss=$(sed -E 's/.*final loss ([0-9.NaN]+),.*/\1/' <<<"$done_line")
        [[ -z $ddp_tokens ]] && ddp_tokens=$tokens
        ratio=$(awk -v a="$tokens" -v b="$ddp_tokens" 'BEGIN { printf "%.2f×", a / b }')
        rss=$(grep -E 'rank [0-9]+ \(pp [0-9]+ dp [0-9]+ tp [0-9]+\): peak RSS' "$log" \
            | sed -E 's/.*rank ([0-9]+) .*peak RSS ([0-9.]+) MiB.*/\1 \2/' | sort -n \
            | awk '{printf "%s%s", sep, $2; sep=" / "}')
        held=$(grep -m1 -E 'rank 0: parameters' "$log" \
            | sed -E 's/.*parameters ([0-9.]+) MiB, gradients when it steps ([0-9.]+) MiB, optimizer state ([0-9.]+) MiB.*/\1 \/ \2 \/ \3/')
        traffic=$(grep -m1 'data-parallel traffic per optimizer step' "$log")
        payload=$(sed -E 's/.*: ([0-9]+) B of payload.*/\1/' <<<"$traffic")
        ring=$(sed -E 's/.*payload, ([0-9]+) B sent.*/\1/' <<<"$traffic")
        psi=$(sed -E 's/.*= ([0-9.]+) Ψ.*/\1/' <<<"$traffic")
        echo "| $stage | $tokens | $ratio | $loss | $rss | $held | $payload | $ring | $psi |"
    done
done
echo
echo "logs: $log_dir" >&2
