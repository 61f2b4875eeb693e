#!/usr/bin/env bash
# Sharded data parallelism under a per-process memory budget (docs/benchmarks.md): a
# char-GPT whose training state one process cannot hold within BUDGET MiB trains on 4 processes with FULL_SHARD,
# each process in its own memory cgroup capped at BUDGET MiB. Every run is measured, not computed: its peak RSS
# per rank (VmHWM, printed by accel_gpt), its final loss, and whether the kernel killed it at the cap.
#
#   sudo -E env "PATH=$PATH" scripts/memory-budget.sh [--budget MIB (350)] [--steps N (6)]
#        [--stages "SHARD_GRAD_OP FULL_SHARD"]
#
# (sudo with the caller's PATH and CARGO_TARGET_DIR, so cargo and the build are found.)
#
# Runs, each under the same per-process cap:
#   1 process, no sharding, 8 sequences per step  (expected: killed — params, grads, 2 AdamW moments do not fit)
#   4 processes × 2 sequences, dp_shard 4, each of --stages   (FULL_SHARD expected to fit)
# and first, without a cap, the 1-process run for its uncapped peak and its final loss (the sharded runs see
# the same global batch of 8 sequences, so they end at the same loss). The model: d_model 512, 8 layers, 8 heads,
# d_ff 2048 (25.3 M parameters, 101 MB in f32), context 64.
#
# Needs root and the cgroup memory controller (v1 `memory.limit_in_bytes` or v2 `memory.max`): each rank joins
# its own cgroup through this script's `--join DIR MIB -- CMD…` mode before exec'ing the trainer, so the cap is
# per process, not per job. Builds with the dev profile, as the README does. Never run by CI.
set -euo pipefail
self=$(realpath "$0") # re-invoked by each rank (--join), after the cd below
cd "$(dirname "$self")/.."

if [[ ${1:-} == --join ]]; then
    dir="$2"/rank"${RANK:?--join runs under a launcher that sets RANK}"
    mib="$3"
    shift 4 # --join DIR MIB --
    mkdir -p "$dir"
    if [[ -f "$dir/memory.limit_in_bytes" || -f "$(dirname "$dir")/memory.limit_in_bytes" ]]; then
        echo $((mib * 1024 * 1024)) >"$dir/memory.limit_in_bytes"
        echo 0 >"$dir/memory.swappiness" 2>/dev/null || true
    else
        echo $((mib * 1024 * 1024)) >"$dir/memory.max"
        echo 0 >"$dir/memory.swap.max" 2>/dev/null || true
    fi
    echo $$ >"$dir/cgroup.procs"
    exec "$@"
fi

budget=350
steps=6
stages="SHARD_GRAD_OP FULL_SHARD"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --budget) budget="$2"; shift 2 ;;
        --steps) steps="$2"; shift 2 ;;
        --stages) stages="$2"; shift 2 ;;
        -h | --help) sed -n '2,/^set -euo/p' "$self" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

[[ $(id -u) -eq 0 ]] || { echo "memory-budget.sh: needs root to create memory cgroups" >&2; exit 2; }
if [[ -d /sys/fs/cgroup/memory ]]; then
    root=/sys/fs/cgroup/memory/accel-memory-budget
elif [[ -f /sys/fs/cgroup/cgroup.controllers ]] && grep -qw memory /sys/fs/cgroup/cgroup.controllers; then
    root=/sys/fs/cgroup/accel-memory-budget
    echo +memory >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
else
    echo "memory-budget.sh: no cgroup memory controller under /sys/fs/cgroup" >&2
    exit 2
fi

target=${CARGO_TARGET_DIR:-target}
cargo build -q -p accel-examples --bin accel_gpt
cargo build -q -p accel-cli --bin accel
gpt="$target/debug/accel_gpt"
accel="$target/debug/accel"
model=(--d-model 512 --n-layer 8 --n-head 8 --d-ff 2048 --steps "$steps" --log-every "$steps" --sample-len 0)

cleanup() {
    # Depth first: each run's directory holds one cgroup per rank.
    find "$root" -depth -type d -exec rmdir {} \; 2>/dev/null || true
}
trap cleanup EXIT
mkdir -p "$root"

# run LABEL NPROC LAUNCH_FLAGS... : runs accel_gpt capped at $budget MiB per process; prints one summary line.
run() {
    local label="$1" n="$2"
    shift 2
    local log rc=0
    log=$(mktemp)
    local batch=$((8 / n))
    "$accel" launch -n "$n" "$@" "$self" --join "$root/$label" "$budget" -- "$gpt" "${model[@]}" --batch-size "$batch" \
        >"$log" 2>&1 || rc=$?
    local peaks loss
    peaks=$(grep -o 'peak RSS [0-9.]* MiB' "$log" | awk '{print $3}' | paste -sd/ - || true)
    loss=$(grep -o 'final loss [0-9.]*' "$log" | awk '{print $3}' | head -1 || true)
    if [[ $rc -eq 0 ]]; then
        echo "$label: trained within $budget MiB per process — peak RSS per rank ${peaks} MiB, final loss $loss"
    else
        local why="exit $rc"
        grep -qiE 'killed|signal 9|SIGKILL|137' "$log" && why="killed at the $budget MiB cap (exit $rc)"
        echo "$label: failed within $budget MiB per process: $why — last lines:"
        tail -3 "$log" | sed 's/^/    /'
    fi
    rm -f "$log"
}

echo "machine: $(nproc) cores, $(free -m | awk '/Mem:/ {print $2}') MiB RAM, load $(cut -d' ' -f1 /proc/loadavg); budget $budget MiB per process"
echo "model: ${model[*]}; 8 sequences per optimizer step (--batch-size 8 / number of processes)"
uncapped=$("$gpt" "${model[@]}" --batch-size 8 2>&1 || true)
echo "1 process without a cap: peak RSS $(grep -o 'peak RSS [0-9.]* MiB' <<<"$uncapped" | awk '{print $3}') MiB," \
    "final loss $(grep -o 'final loss [0-9.]*' <<<"$uncapped" | awk '{print $3}')"
run one-process 1
for s in $stages; do
    run "dp_shard4-$s" 4 --parallelism-config-dp-shard-size 4 --fsdp_sharding_strategy "$s"
done
