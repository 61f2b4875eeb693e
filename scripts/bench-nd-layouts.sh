#!/usr/bin/env bash
# The benchmark of layouts: the char-GPT trained by `accel_gpt` on 4 processes at every layout
# dp_replicate × dp_shard × tp × pp the model allows, each with the cost model's prediction beside what was
# measured, then `--parallelism auto` with the same model and global batch, ranked among them. Prints markdown
# (one table per model size and machine count) on stdout; progress on stderr. Not run in CI.
#
#   scripts/bench-nd-layouts.sh [--steps N (12)] [--large-steps N (6)] [--sizes small,large] [--machines 1,2]
#        [--large-machines 1] [--quick] [--budget MIB (350)] [--rate RATE (100mbit)] [--timeout S (600)]
#        [--quiet CORES (0.3)] [--quiet-wait S (0)] [--no-build]
#
# Models (examples/src/gpt.rs, context 64, vocabulary 76, fp32, AdamW):
#   small  the default char-GPT: d_model 128, 4 heads, 4 layers, d_ff 512 (820 992 parameters); global batch 32
#          sequences, 8 micro-batches per pipeline step
#   large  d_model 512, 8 heads, 8 layers, d_ff 2048 (25 330 688 parameters, the large GPT of docs/benchmarks.md's
#          sharded section); global batch 8 sequences, 4 micro-batches per pipeline step; every rank in its own
#          memory cgroup capped at --budget MiB (scripts/memory-budget.sh's --join mode, as that script runs it).
#          A run the kernel kills at the cap is a row "killed (OOM at N MiB)": a result. Its auto run is also told
#          the budget (ACCEL_AUTO_LAYOUT_MEMORY).
# The global batch is the same at every layout (--batch-size = global / (dp_replicate · dp_shard)), so every layout
# trains the same batches. Layouts: every (tp, pp) with tp · pp dividing 4, tp dividing n_head, d_model and d_ff,
# pp ≤ n_layer; the data-parallel rest split into dp_replicate × dp_shard every way; dp_shard > 1 at SHARD_GRAD_OP
# and FULL_SHARD (and SHARD_OPTIM for the small model); pp > 1 with GPipe, 1F1B and Interleaved1F1B (interleaved,
# 2 stages per rank, only where each pp rank gets 2 layers; its micro-batches at least 2·pp and a multiple of pp:
# the next such count that divides the batch where the size's default is too small). --quick: a handful of them.
#
# --machines 1: `accel launch --num_processes 4` on this machine. --machines 2: two simulated machines × 2
# processes (scripts/netns-machines.sh, network namespaces, a --rate link each way; prefix accel-ndl), one
# `accel launch` per machine, both logs kept; an extra column gives the bytes that crossed the links (tc's
# counters, the whole run — probe, start-up and warm-up included — divided by the steps). The large model runs on
# the machine counts of --large-machines (default 1: one machine only).
#
# Per layout: tokens/s (`accel_gpt done:`, the first logged interval excluded as warm-up), the measured step time
# (global tokens per step / tokens/s), the predicted step time and peak per rank (`--predict`: `auto_layout
# predicted:`) and their ratios predicted / measured (peak against the largest rank's VmHWM), peak RSS per rank,
# rank 0's parameters / gradients / optimizer state and every rank's optimizer state, rank 0's data-parallel bytes
# per step (payload, ring bytes, × Ψ·(n−1)/n), rank 0's tp all-reduce payload per step, every rank's measured
# pipeline bubble, the final loss, and the 1-minute load average before the run.
#
# --quiet-wait S: before each run, wait up to S seconds until other programs use less than --quiet cores (sampled
# over 1 s); the table records, per run, the cores other programs used while it ran either way.
# Each measured run holds /tmp/accel-bench.lock (ACCEL_BENCH_LOCK) while it runs, so two benchmarks sharing the
# machine never overlap; builds hold /tmp/accel-build.lock (ACCEL_BUILD_LOCK). Binaries:
# ${CARGO_TARGET_DIR:-target}/debug, built with the dev profile (as the README builds). Each run's log is kept in
# $BENCH_LOG_DIR (default: a temporary directory). Root is needed for the memory cgroups (large) and the network
# namespaces (--machines 2); without it those parts are skipped and say so.
set -euo pipefail
self=$(realpath "$0")
cd "$(dirname "$self")/.."

steps=12
large_steps=6
sizes=small,large
machine_counts=1,2
large_machine_counts=1
quick=0
budget=350
rate=100mbit
run_timeout=600
quiet=0.3
quiet_wait=0
build=1
while [[ $# -gt 0 ]]; do
    case "$1" in
        --steps) steps=${2:?--steps needs a number}; shift 2 ;;
        --large-steps) large_steps=${2:?--large-steps needs a number}; shift 2 ;;
        --sizes) sizes=${2:?--sizes needs small, large or small,large}; shift 2 ;;
        --machines) machine_counts=${2:?--machines needs 1, 2 or 1,2}; shift 2 ;;
        --large-machines) large_machine_counts=${2:?--large-machines needs 1, 2 or 1,2}; shift 2 ;;
        --quick) quick=1; shift ;;
        --budget) budget=${2:?--budget needs MiB}; shift 2 ;;
        --rate) rate=${2:?--rate needs a rate, e.g. 100mbit}; shift 2 ;;
        --timeout) run_timeout=${2:?--timeout needs seconds}; shift 2 ;;
        --quiet) quiet=${2:?--quiet needs cores, e.g. 0.3}; shift 2 ;;
        --quiet-wait) quiet_wait=${2:?--quiet-wait needs seconds}; shift 2 ;;
        --no-build) build=0; shift ;;
        -h | --help) sed -n '2,/^set -euo/p' "$self" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ $quiet_wait =~ ^[0-9]+$ && $quiet =~ ^[0-9]*\.?[0-9]+$ ]] || { echo "--quiet-wait: seconds; --quiet: cores" >&2; exit 2; }
for n in "$steps" "$large_steps" "$budget" "$run_timeout"; do
    [[ $n =~ ^[1-9][0-9]*$ ]] || { echo "--steps, --large-steps, --budget and --timeout take whole numbers > 0" >&2; exit 2; }
done
for s in ${sizes//,/ }; do [[ $s == small || $s == large ]] || { echo "--sizes: small and/or large, not $s" >&2; exit 2; }; done
for m in ${machine_counts//,/ } ${large_machine_counts//,/ }; do
    [[ $m == 1 || $m == 2 ]] || { echo "--machines / --large-machines: 1 and/or 2, not $m" >&2; exit 2; }
done

target=${CARGO_TARGET_DIR:-target}
if ((build)); then
    echo ">> building accel_gpt and accel (dev profile, $target)" >&2
    flock "${ACCEL_BUILD_LOCK:-/tmp/accel-build.lock}" \
        cargo build -q -p accel-examples --bin accel_gpt -p accel-cli --bin accel
fi
gpt=$(realpath "$target/debug/accel_gpt")
accel=$(realpath "$target/debug/accel")
[[ -x $gpt && -x $accel ]] || { echo "$target/debug/accel_gpt or accel missing (build them, or drop --no-build)" >&2; exit 1; }
export ACCEL_BIN=$accel # scripts/netns-machines.sh launch

log_dir=${BENCH_LOG_DIR:-$(mktemp -d)}
mkdir -p "$log_dir"
log_dir=$(realpath "$log_dir")
# No accelerate config file of the user's (the default one under $HF_HOME) may change a run.
export HF_HOME=$log_dir/hf_home
mkdir -p "$HF_HOME"
data_dir=$PWD/data/shakespeare
world=4
lock_file=${ACCEL_BENCH_LOCK:-/tmp/accel-bench.lock}
exec {lock_fd}>>"$lock_file"
is_root=0
[[ $(id -u) -eq 0 ]] && is_root=1

load1() { cut -d' ' -f1 /proc/loadavg; }
# CPU time in clock ticks: the whole machine's busy time (/proc/stat: user, nice, system), and this
# script's reaped children's (/proc/$$/stat cutime + cstime: every run, its launcher and workers, once waited for).
# Their difference over a run is what other programs used meanwhile.
machine_busy() { awk '$1 == "cpu" {print $2 + $3 + $4; exit}' /proc/stat; }
children_cpu() { sed -E 's/^.*\) //' "/proc/$$/stat" | awk '{print $14 + $15}'; }
ticks_now() { echo $(( $(date +%s%N) / (1000000000 / $(getconf CLK_TCK)) )); }
# Waits (up to --quiet-wait s) until other programs use less than --quiet cores, sampled over 1 s.
wait_quiet() {
    ((quiet_wait > 0)) || return 0
    local from used b0 t0
    from=$(date +%s)
    while :; do
        b0=$(machine_busy); t0=$(ticks_now)
        sleep 1
        used=$(awk -v b="$(( $(machine_busy) - b0 ))" -v t="$(( $(ticks_now) - t0 ))" 'BEGIN { printf "%.2f", (t > 0) ? b / t : 0 }')
        awk -v u="$used" -v q="$quiet" 'BEGIN { exit !(u < q) }' && break
        if (( $(date +%s) - from >= quiet_wait )); then
            echo "   other programs still use $used cores after ${quiet_wait} s; running anyway (recorded)" >&2
            break
        fi
        sleep 2
    done
}
load3() { cut -d' ' -f1-3 /proc/loadavg; }
now_utc() { date -u '+%Y-%m-%d %H:%M:%S UTC'; }
# A launcher's or an outer job's variables must not reach the runs.
clean_env=(env -u RANK -u LOCAL_RANK -u WORLD_SIZE -u LOCAL_WORLD_SIZE -u GROUP_RANK -u MASTER_ADDR -u MASTER_PORT
    -u ACCEL_CPU_HOST -u PARALLELISM_CONFIG_TP_SIZE -u PARALLELISM_CONFIG_PP_SIZE -u PARALLELISM_CONFIG_DP_SHARD_SIZE
    -u PARALLELISM_CONFIG_DP_REPLICATE_SIZE -u FSDP_SHARDING_STRATEGY -u ACCELERATE_GRADIENT_ACCUMULATION_STEPS
    -u ACCELERATE_MIXED_PRECISION -u ACCEL_AUTO_LAYOUT_MEMORY -u PARALLELISM_CONFIG_PP_SCHEDULE
    -u PARALLELISM_CONFIG_PP_MICROBATCHES -u PARALLELISM_CONFIG_PP_VIRTUAL_STAGES -u PARALLELISM_CONFIG_CP_SIZE)
extra_env=() # NAME=VALUE for the next run_one (after clean_env)

# ---- the memory cgroups (large model) ----------------------------------------------------------------------------
cg_root=""
cg_setup() {
    ((is_root)) || return 1
    if [[ -d /sys/fs/cgroup/memory ]]; then
        cg_root=/sys/fs/cgroup/memory/accel-nd-layouts-$$
        mkdir -p "$cg_root"
    elif [[ -f /sys/fs/cgroup/cgroup.controllers ]] && grep -qw memory /sys/fs/cgroup/cgroup.controllers; then
        cg_root=/sys/fs/cgroup/accel-nd-layouts-$$
        echo +memory >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
        mkdir -p "$cg_root"
        echo +memory >"$cg_root/cgroup.subtree_control" 2>/dev/null || true
    else
        return 1
    fi
}
# The ranks of run directory $1 that the kernel's OOM killer hit (v1 memory.oom_control, v2 memory.events).
cg_oom_ranks() {
    local d r n
    for d in "$1"/rank*; do
        [[ -d $d ]] || continue
        r=${d##*/rank}
        n=0
        if [[ -f $d/memory.oom_control ]]; then
            n=$(awk '$1 == "oom_kill" {print $2}' "$d/memory.oom_control")
        elif [[ -f $d/memory.events ]]; then
            n=$(awk '$1 == "oom_kill" {print $2}' "$d/memory.events")
        fi
        if ((${n:-0} > 0)); then echo "$r"; fi
    done | sort -n | paste -sd, -
}
cg_remove() { # the run directory $1, depth first (a rank's cgroup goes once its process has)
    local i
    for i in $(seq 50); do
        find "$1" -depth -type d -exec rmdir {} \; 2>/dev/null || true
        [[ -d $1 ]] || return 0
        sleep 0.1
    done
}

# ---- the simulated machines -----------------------------------------------------------------------------------
export ACCEL_NETNS_PREFIX=accel-ndl
netns_up=0
netns() { bash "$PWD/scripts/netns-machines.sh" "$@"; }
link_total() { # bytes sent + received over every machine's link so far
    netns status | awk '/^  machine/ {s += $(NF - 4) + $(NF - 1)} END {printf "%.0f\n", s}'
}
cleanup() {
    if ((netns_up)); then netns down >/dev/null 2>&1 || true; fi
    if [[ -n $cg_root && -d $cg_root ]]; then cg_remove "$cg_root"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---- the layouts ----------------------------------------------------------------------------------------------
# Sets the model of size $1: model_flags, n_layer, n_head, d_model, d_ff, global, micro (micro-batches per pipeline
# step), strategies, size_steps.
set_model() {
    case $1 in
        small)
            model_flags=(); n_layer=4; n_head=4; d_model=128; d_ff=512; global=32; micro=8
            strategies="SHARD_OPTIM SHARD_GRAD_OP FULL_SHARD"; size_steps=$steps; params="820 992" ;;
        large)
            model_flags=(--d-model 512 --n-layer 8 --n-head 8 --d-ff 2048); n_layer=8; n_head=8; d_model=512
            d_ff=2048; global=8; micro=4; strategies="SHARD_GRAD_OP FULL_SHARD"; size_steps=$large_steps
            params="25 330 688" ;;
    esac
}
divides() { (($2 % $1 == 0)); }
# Every layout of the model set by set_model into the array $layouts, one "dp_replicate dp_shard tp pp strategy
# schedule" each (strategy - without sharding, schedule - without pp); what the model or the batch rules out, with
# why, into $skipped.
all_layouts() {
    local tp pp dp dps dpr st sc batch m
    layouts=()
    for pp in 1 2 4; do
        for tp in 1 2 4; do
            divides $((tp * pp)) $world || continue
            if ! divides "$tp" "$n_head" || ! divides "$tp" "$d_model" || ! divides "$tp" "$d_ff"; then
                skipped+=("tp $tp (× pp $pp): tp must divide n_head $n_head, d_model $d_model and d_ff $d_ff"); continue
            fi
            ((pp <= n_layer)) || { skipped+=("pp $pp: more stages than the $n_layer layers"); continue; }
            dp=$((world / (tp * pp)))
            for dps in 1 2 4; do
                divides "$dps" "$dp" || continue
                dpr=$((dp / dps))
                batch=$((global / dp))
                if ((pp > 1)) && { ! divides "$micro" "$batch" || ((micro < pp)); }; then
                    skipped+=("dp_replicate $dpr × dp_shard $dps × tp $tp × pp $pp: $micro micro-batches do not split --batch-size $batch")
                    continue
                fi
                for st in $( ((dps > 1)) && echo "$strategies" || echo -); do
                    if ((pp == 1)); then
                        layouts+=("$dpr $dps $tp $pp $st - -")
                        continue
                    fi
                    for sc in GPipe 1F1B Interleaved1F1B; do
                        m=$micro
                        if [[ $sc == Interleaved1F1B ]]; then
                            # 2 stages per rank: 2·pp stages of a layer or more, and at least as many micro-batches
                            # as stages, a multiple of pp (PipelineSchedule::new) — the next such count dividing the
                            # batch where --microbatches' is too small.
                            if ((2 * pp > n_layer)); then
                                skipped+=("dp_replicate $dpr × dp_shard $dps × tp $tp × pp $pp, Interleaved1F1B (every sharding): needs 2 layers per pp rank ($((2 * pp)) stages > $n_layer layers)")
                                continue
                            fi
                            while ((m <= batch)) && { ((m < 2 * pp || m % pp != 0)) || ! divides "$m" "$batch"; }; do
                                m=$((m + 1))
                            done
                            if ((m > batch)); then
                                skipped+=("dp_replicate $dpr × dp_shard $dps × tp $tp × pp $pp, Interleaved1F1B: no micro-batch count ≥ $((2 * pp)), a multiple of $pp, divides --batch-size $batch")
                                continue
                            fi
                        fi
                        layouts+=("$dpr $dps $tp $pp $st $sc $m")
                    done
                done
            done
        done
    done
}
quick_layouts() { # a handful of all_layouts
    all_layouts
    local -a all=("${layouts[@]}")
    local want l
    layouts=()
    for want in "4 1 1 1 - -" "1 4 1 1 FULL_SHARD -" "2 1 2 1 - -" "1 1 4 1 - -" "2 1 1 2 - 1F1B" "1 1 2 2 - Interleaved1F1B"; do
        for l in "${all[@]}"; do [[ ${l% *} == "$want" ]] && layouts+=("$l"); done
    done
    return 0
}

# ---- one run ----------------------------------------------------------------------------------------------------
# run_one MACHINES LABEL LOG BUDGETED CMD... : runs CMD (accel_gpt and its flags; launched with --num_processes 4
# on one machine, or across 2 simulated machines), under the bench lock, optionally each rank in a memory cgroup
# capped at $budget MiB. Sets rc, status ("ok", "oom", "killed", "timeout", "failed"), status_text, load_before,
# load_after, link_per_step.
run_one() {
    local machines=$1 label=$2 log=$3 budgeted=$4
    shift 4
    local -a prog=("$@")
    local cg_dir=""
    if ((budgeted)); then
        cg_dir=$cg_root/${label//[^A-Za-z0-9_-]/_}
        prog=("$PWD/scripts/memory-budget.sh" --join "$cg_dir" "$budget" -- "${prog[@]}")
    fi
    flock "$lock_fd"
    wait_quiet
    load_before=$(load1)
    local busy0 ours0 t0
    busy0=$(machine_busy); ours0=$(children_cpu); t0=$(ticks_now)
    link_per_step=""
    rc=0
    if ((machines == 1)); then
        "${clean_env[@]}" "${extra_env[@]}" timeout -k 10 "$run_timeout" "$accel" launch --num_processes "$world" "${prog[@]}" \
            >"$log" 2>&1 {lock_fd}>&- || rc=$?
    else
        local before after i pids=() r
        before=$(link_total)
        for i in 0 1; do
            "${clean_env[@]}" "${extra_env[@]}" timeout -k 10 "$run_timeout" bash "$PWD/scripts/netns-machines.sh" launch "$i" -- \
                --num_processes "$world" "${prog[@]}" >"$log.machine$i" 2>&1 {lock_fd}>&- &
            pids+=($!)
        done
        for i in 0 1; do
            r=0
            wait "${pids[$i]}" || r=$?
            ((rc == 0)) && rc=$r
        done
        after=$(link_total)
        cat "$log.machine0" "$log.machine1" >"$log"
    fi
    load_after=$(load1)
    others=$(awk -v b="$(( $(machine_busy) - busy0 ))" -v o="$(( $(children_cpu) - ours0 ))" -v t="$(( $(ticks_now) - t0 ))" \
        'BEGIN { x = (t > 0) ? (b - o) / t : 0; if (x < 0) x = 0; printf "%.2f", x }')
    flock -u "$lock_fd"
    local oom=""
    if [[ -n $cg_dir ]]; then
        oom=$(cg_oom_ranks "$cg_dir")
        cg_remove "$cg_dir"
    fi
    if ((rc == 0)) && grep -q 'accel_gpt done:' "$log"; then
        status=ok; status_text="trained"
    elif [[ -n $oom ]]; then
        status=oom; status_text="killed (OOM at $budget MiB; rank $oom)"
    elif ((rc == 124 || rc == 137)) && ! grep -q 'SIGKILL' "$log"; then
        status=timeout; status_text="timed out after $run_timeout s"
    elif grep -q 'SIGKILL' "$log"; then
        status=killed; status_text="killed (SIGKILL, exit $rc)"
    else
        status=failed
        # The first rank's own error, not the peers' reports of its exit.
        local why
        why=$(grep -E '\] Error: ' "$log" | grep -vE 'is gone|aborted the group|failed too' | head -1 || true)
        [[ -n $why ]] || why=$(grep -m1 -iE 'error' "$log" || true)
        status_text="failed (exit $rc): $(sed -E 's/^\[[^]]*\] //; s/\|/\//g' <<<"$why" | cut -c1-200)"
    fi
    if [[ $status == ok && $machines == 2 ]]; then
        link_per_step=$(((after - before) / size_steps))
    fi
}

# parse LOG: the figures of a run (empty where absent) into the TSV fields.
parse() {
    local log=$1 done_line
    done_line=$(grep -m1 'accel_gpt done:' "$log" || true)
    tokens=$(sed -nE 's/.*, ([0-9.]+) tokens\/s.*/\1/p' <<<"$done_line")
    loss=$(sed -nE 's/.*final loss ([0-9.NaNinf]+),.*/\1/p' <<<"$done_line")
    tokens_per_step=$(grep -m1 -oE '= [0-9.]+ tokens per optimizer step' "$log" | awk '{print $2}' || true)
    # "auto_layout predicted: peak 85.6 MiB per rank, step 132.8 ms (compute …)" — ms, s or µs.
    local pred
    pred=$(grep -m1 'auto_layout predicted:' "$log" || true)
    pred_peak=$(sed -nE 's/.*predicted: peak ([0-9.]+) MiB per rank.*/\1/p' <<<"$pred")
    pred_step_ms=$(sed -nE 's/.*per rank, step ([0-9.]+) ([^ ]+).*/\1 \2/p' <<<"$pred" |
        awk '{ f["min"] = 60000; f["s"] = 1000; f["ms"] = 1; f["µs"] = 1e-3; f["us"] = 1e-3; f["ns"] = 1e-6
               if ($2 in f) printf "%.3f", $1 * f[$2] }')
    rss_list=$(sed -nE 's/.*rank ([0-9]+) \(pp [0-9]+ dp [0-9]+ tp [0-9]+\): peak RSS ([0-9.]+) MiB.*/\1 \2/p' "$log" |
        sort -n | awk '{printf "%s%s", sep, $2; sep=" / "}')
    rss_max=$(sed -nE 's/.*\): peak RSS ([0-9.]+) MiB.*/\1/p' "$log" | sort -g | tail -1)
    local held='s/.*rank ([0-9]+): parameters ([0-9.]+) MiB, gradients when it steps ([0-9.]+) MiB, optimizer state ([0-9.]+) MiB.*/\1 \2 \3 \4/p'
    held0=$(sed -nE "$held" "$log" | awk '$1 == 0 {printf "%s / %s / %s", $2, $3, $4; exit}')
    opt_list=$(sed -nE "$held" "$log" | sort -n | awk '{printf "%s%s", sep, $4; sep=" / "}')
    local dp
    dp=$(grep -m1 'data-parallel traffic per optimizer step (rank 0)' "$log" || true)
    dp_payload=$(sed -nE 's/.*: ([0-9]+) B of payload.*/\1/p' <<<"$dp")
    dp_ring=$(sed -nE 's/.*payload, ([0-9]+) B sent.*/\1/p' <<<"$dp")
    dp_psi=$(sed -nE 's/.*= ([0-9.]+) Ψ.*/\1/p' <<<"$dp")
    local tpl
    tpl=$(grep -m1 'tp traffic per optimizer step (rank 0' "$log" || true)
    tp_bytes=$(sed -nE 's/.*\): ([0-9]+) B of all-reduce payload in ([0-9]+) calls.*/\1/p' <<<"$tpl")
    tp_calls=$(sed -nE 's/.*\): ([0-9]+) B of all-reduce payload in ([0-9]+) calls.*/\2/p' <<<"$tpl")
    bubble_list=$(sed -nE 's/.*rank ([0-9]+): pipeline bubble measured ([0-9.]+) % of the step.*/\1 \2/p' "$log" |
        sort -n | awk '{printf "%s%s", sep, $2; sep=" / "}')
    bubble_sched=$(grep -m1 -oE "\(the schedule's [0-9.]+ %\)" "$log" | grep -oE '[0-9.]+' || true)
    auto_chosen=$(grep -m1 -E '\] chosen: ' "$log" | sed -E 's/.*chosen: //' || true)
    auto_flags=$(grep -m1 'auto_layout flags:' "$log" | sed -E 's/.*auto_layout flags: //' || true)
}

# A TSV record of the run just parsed: kind dpr dps tp pp strategy schedule M status status_text tokens
# tokens_per_step pred_step_ms pred_peak rss_list rss_max held0 opt_list dp_payload dp_ring dp_psi tp_bytes tp_calls
# bubble_list bubble_sched loss load_before others link_per_step auto_chosen auto_flags log
record() {
    local f
    local -a fields=("$@" "$status" "$status_text" "$tokens" "$tokens_per_step" "$pred_step_ms" "$pred_peak"
        "$rss_list" "$rss_max" "$held0" "$opt_list" "$dp_payload" "$dp_ring" "$dp_psi" "$tp_bytes" "$tp_calls"
        "$bubble_list" "$bubble_sched" "$loss" "$load_before" "$others" "$link_per_step" "$auto_chosen"
        "$auto_flags" "$(basename "$log")")
    for f in "${fields[@]}"; do printf '%s\t' "${f:--}"; done
    echo
}

# ---- one table --------------------------------------------------------------------------------------------------
# bench SIZE MACHINES: runs every layout and auto, prints the table.
bench() {
    local size=$1 machines=$2 budgeted=0
    set_model "$size"
    local log_every=$((size_steps / 3 > 0 ? size_steps / 3 : 1))
    if [[ $size == large ]]; then
        if ! cg_setup; then
            echo
            echo "**$size model, $machines machine(s)**: skipped — the per-rank memory cgroups need root and the cgroup memory controller."
            return
        fi
        budgeted=1
    fi
    if ((machines == 2)); then
        if ((!is_root)); then
            echo
            echo "**$size model, 2 machines**: skipped — the simulated machines (network namespaces) need root."
            return
        fi
        if ((!netns_up)); then
            netns down >/dev/null 2>&1 || true # one left behind by a killed run of this script
            netns up --machines 2 --rate "$rate" >&2
            netns_up=1
        fi
    fi
    skipped=()
    if ((quick)); then quick_layouts; else all_layouts; fi
    local n_layouts=${#layouts[@]}
    local common=("${model_flags[@]}" --steps "$size_steps" --log-every "$log_every" --data-dir "$data_dir" --sample-len 0)
    local start_date start_load records=$log_dir/$size-m$machines.tsv
    start_date=$(now_utc)
    start_load=$(load3)
    : >"$records"
    local i=0 dpr dps tp pp st sc m flags label
    while read -r dpr dps tp pp st sc m; do
        i=$((i + 1))
        local batch=$((global / (dpr * dps)))
        flags=(--tp-size "$tp" --pp-size "$pp" --dp-shard-size "$dps" --batch-size "$batch")
        [[ $st != - ]] && flags+=(--sharding-strategy "$st")
        [[ $sc != - ]] && flags+=(--pp-schedule "$sc" --microbatches "$m")
        label="$size-m$machines-r${dpr}s${dps}t${tp}p${pp}-${st}-${sc}"
        log=$log_dir/$label.log
        echo ">> [$i/$n_layouts] $size, $machines machine(s): dp_replicate $dpr × dp_shard $dps × tp $tp × pp $pp" \
            "$st $sc$([[ $m != - ]] && echo " M $m") (load $(load1))" >&2
        run_one "$machines" "$label" "$log" "$budgeted" "$gpt" "${common[@]}" "${flags[@]}" --predict
        parse "$log"
        echo "   $status_text${tokens:+, $tokens tokens/s}" >&2
        record layout "$dpr" "$dps" "$tp" "$pp" "$st" "$sc" "$m" >>"$records"
    done < <(printf '%s\n' "${layouts[@]}")

    label="$size-m$machines-auto"
    log=$log_dir/$label.log
    echo ">> $size, $machines machine(s): --parallelism auto --global-batch-size $global (load $(load1))" >&2
    extra_env=()
    ((budgeted)) && extra_env=(ACCEL_AUTO_LAYOUT_MEMORY=${budget}MiB)
    run_one "$machines" "$label" "$log" "$budgeted" "$gpt" "${common[@]}" --parallelism auto --global-batch-size "$global"
    extra_env=()
    parse "$log"
    echo "   auto: ${auto_chosen:-?}: $status_text${tokens:+, $tokens tokens/s}" >&2
    # Its layout, as the layouts' rows have it: "dp_replicate 2 × dp_shard 2 (SHARD_OPTIM) × tp 1 × pp 1, …" and the
    # flags "--tp-size 1 --pp-size 1 --dp-shard-size 2 … --pp-schedule 1F1B --microbatches 4 …".
    local a_dpr a_dps a_tp a_pp a_st a_sc a_m
    a_dpr=$(sed -nE 's/.*dp_replicate ([0-9]+).*/\1/p' <<<"$auto_chosen")
    a_dps=$(sed -nE 's/.*dp_shard ([0-9]+).*/\1/p' <<<"$auto_chosen")
    a_tp=$(sed -nE 's/.*--tp-size ([0-9]+).*/\1/p' <<<"$auto_flags")
    a_pp=$(sed -nE 's/.*--pp-size ([0-9]+).*/\1/p' <<<"$auto_flags")
    a_st=$(sed -nE 's/.*--sharding-strategy ([A-Z_]+).*/\1/p' <<<"$auto_flags")
    a_sc=$(sed -nE 's/.*--pp-schedule ([A-Za-z0-9]+).*/\1/p' <<<"$auto_flags")
    a_m=$(sed -nE 's/.*--microbatches ([0-9]+).*/\1/p' <<<"$auto_flags")
    record auto "$a_dpr" "$a_dps" "$a_tp" "$a_pp" "$a_st" "$a_sc" "$a_m" >>"$records"
    local end_load end_date
    end_load=$(load3)
    end_date=$(now_utc)

    echo
    echo "### ${size^} char-GPT ($params parameters), $machines machine$( ((machines > 1)) && echo "s × 2 processes" || echo " × 4 processes")"
    echo
    local where="one machine (\`accel launch --num_processes 4\`)"
    ((machines == 2)) && where="2 simulated machines × 2 processes (network namespaces, a $rate link each way, \`scripts/netns-machines.sh launch\` per machine; ranks 0-1 on machine 0)"
    local budget_note=""
    ((budgeted)) && budget_note=" Every rank in its own memory cgroup capped at **$budget MiB** (no swap); the auto run also told \`ACCEL_AUTO_LAYOUT_MEMORY=${budget}MiB\`."
    echo "$start_date – ${end_date#* }, $(nproc) CPU cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')), load average (1/5/15 min) $start_load at the start, $end_load at the end; $where; $size_steps optimizer steps, tokens/s over the last $((size_steps - log_every)) (the first $log_every: warm-up); model flags: \`${model_flags[*]:-(defaults)}\` (d_model $d_model, $n_head heads, $n_layer layers, d_ff $d_ff, context 64); **global batch $global sequences** ($((global * 64)) tokens) per optimizer step at every layout, --batch-size = $global / (dp_replicate · dp_shard), $micro micro-batches per pipeline step (Interleaved1F1B: at least 2·pp); dev profile.$budget_note$( ((quick)) && echo " **--quick: $n_layouts layouts only.**")"
    echo
    render "$records" "$machines" "$budgeted"
    if ((${#skipped[@]})); then
        echo
        echo "Not run (the model or the batch does not allow them):"
        printf -- '- %s\n' "${skipped[@]}" | sort -u
    fi
    [[ $size == large ]] && [[ $strategies != *SHARD_OPTIM* ]] &&
        echo && echo "SHARD_OPTIM (ZeRO-1) left out for the large model (time); every other layout is here."
    return 0
}

# render TSV MACHINES BUDGETED: the markdown table, auto's rank, the predicted-vs-measured summary.
render() {
    awk -F'\t' -v machines="$2" -v budgeted="$3" -v budget="$budget" '
    function fmt_int(x,    s, r) { # 1234567 -> 1 234 567
        if (x == "-" || x == "") return "—"
        s = sprintf("%d", x); r = ""
        while (length(s) > 3) { r = " " substr(s, length(s) - 2) r; s = substr(s, 1, length(s) - 3) }
        return s r
    }
    function dash(x) { return (x == "-" || x == "") ? "—" : x }
    function step_ms(i) { return (tok[i] > 0) ? 1000 * tps[i] / tok[i] : 0 }
    function layout_of(i,    s) {
        s = "dp_replicate " dpr[i] " × dp_shard " dps[i] (st[i] != "-" ? " (" st[i] ")" : "") " × tp " tp[i] " × pp " pp[i]
        if (sc[i] != "-") s = s ", " sc[i] " M " m[i]
        return s
    }
    function median(a, n,    i, j, t) {
        for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
        return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    {
        n++
        kind[n] = $1; dpr[n] = $2; dps[n] = $3; tp[n] = $4; pp[n] = $5; st[n] = $6; sc[n] = $7; m[n] = $8
        status[n] = $9; stext[n] = $10; tok[n] = ($11 == "-") ? 0 : $11; tps[n] = $12; pstep[n] = $13
        ppeak[n] = $14; rss[n] = $15; rmax[n] = $16; held[n] = $17; opt[n] = $18; dpp[n] = $19; dpr_[n] = $20
        psi[n] = $21; tpb[n] = $22; tpc[n] = $23; bub[n] = $24; bsch[n] = $25; loss[n] = $26; lb[n] = $27
        la[n] = $28; link[n] = $29; chosen[n] = $30; aflags[n] = $31; logf[n] = $32
    }
    END {
        # Ranks by tokens/s among the layouts that trained.
        nok = 0; best = 0
        for (i = 1; i <= n; i++) if (kind[i] == "layout" && status[i] == "ok") {
            nok++; if (tok[i] > best) { best = tok[i]; besti = i }
        }
        for (i = 1; i <= n; i++) {
            rk[i] = 1
            for (j = 1; j <= n; j++) if (kind[j] == "layout" && status[j] == "ok" && j != i && tok[j] > tok[i]) rk[i]++
        }
        hdr = "| # | dp_r | dp_s | tp | pp | sharding | schedule (M) | tokens/s | rank | step ms measured / predicted (pred ÷ meas) | peak RSS per rank (MiB) | peak MiB: max measured / predicted (pred ÷ meas) | rank 0 params / grads / optimizer (MiB) | optimizer state per rank (MiB) | dp bytes per step, rank 0: payload / ring (× Ψ·(n−1)/n) | tp all-reduce B per step, rank 0 (calls) | bubble % per rank (schedule) | final loss | load before | CPU used by other programs (cores) |"
        sep = "|---:|---:|---:|---:|---:|---|---|---:|---:|---|---|---|---|---|---|---|---|---:|---:|---:|"
        if (machines == 2) { hdr = hdr " link B per step (whole run) |"; sep = sep "---:|" }
        print hdr; print sep
        k = 0
        for (i = 1; i <= n; i++) {
            if (kind[i] == "auto") name = "**auto**"; else { k++; name = k }
            extra = ""
            if (kind[i] == "auto") {
                if (match(aflags[i], /--gradient-accumulation-steps [0-9]+/)) {
                    ga = substr(aflags[i], RSTART + 30, RLENGTH - 30); if (ga + 0 > 1) extra = extra ", GA " ga
                }
                if (index(aflags[i], "--activation-checkpointing")) extra = extra ", activation checkpointing"
                if (match(chosen[i], /[0-9]+ stages per rank/)) extra = extra ", " substr(chosen[i], RSTART, RLENGTH)
                if (match(chosen[i], /layers per stage \[[0-9, ]*\]/)) extra = extra ", " substr(chosen[i], RSTART, RLENGTH)
            }
            lay = "| " dash(dpr[i]) " | " dash(dps[i]) " | " dash(tp[i]) " | " dash(pp[i]) " | " dash(st[i]) " | " (sc[i] == "-" ? "—" : sc[i] " (" m[i] ")") extra " | "
            if (status[i] != "ok") {
                pk = (ppeak[i] != "-") ? "— / " ppeak[i] : "—"
                if (budgeted && ppeak[i] != "-") pk = pk (ppeak[i] + 0 > budget ? " (> budget)" : " (≤ budget)")
                row = "| " name " " lay stext[i] " | — | — | — | " pk " | — | — | — | — | — | — | " lb[i] " | " la[i] " |"
                if (machines == 2) row = row " — |"
                print row; continue
            }
            ms = step_ms(i)
            stepc = sprintf("%.0f / ", ms) (pstep[i] != "-" ? sprintf("%.0f (%.2f×)", pstep[i], pstep[i] / ms) : "—")
            peakc = rmax[i] " / " (ppeak[i] != "-" ? sprintf("%s (%.2f×)", ppeak[i], ppeak[i] / rmax[i]) : "—")
            dpc = (dpp[i] != "-") ? fmt_int(dpp[i]) " / " fmt_int(dpr_[i]) " (" psi[i] ")" : "—"
            tpcol = (tpb[i] != "-") ? fmt_int(tpb[i]) " (" tpc[i] ")" : "—"
            bubc = (bub[i] != "-") ? bub[i] " (" bsch[i] ")" : "—"
            rank = (kind[i] == "auto") ? "(" rk[i] " of " nok + 1 ")" : rk[i]
            row = "| " name " " lay fmt_int(tok[i]) " | " rank " | " stepc " | " rss[i] " | " peakc " | " dash(held[i]) " | " dash(opt[i]) " | " dpc " | " tpcol " | " bubc " | " loss[i] " | " lb[i] " | " la[i] " |"
            if (machines == 2) row = row " " fmt_int(link[i]) " |"
            print row
        }
        print ""
        # auto
        for (i = 1; i <= n; i++) if (kind[i] == "auto") {
            if (status[i] == "ok") {
                same = ""
                plain = index(aflags[i], "--gradient-accumulation-steps 1 ") || aflags[i] ~ /--gradient-accumulation-steps 1$/
                plain = plain && !index(aflags[i], "--activation-checkpointing") && !index(chosen[i], "layers per stage")
                plain = plain && (!index(chosen[i], "stages per rank") || index(chosen[i], " 2 stages per rank"))
                for (j = 1; j <= n; j++)
                    if (plain && kind[j] == "layout" && status[j] == "ok" && dpr[j] == dpr[i] && dps[j] == dps[i] && tp[j] == tp[i] && pp[j] == pp[i] && st[j] == st[i] && sc[j] == sc[i] && m[j] == m[i]) same = j
                printf "**auto** chose %s (`%s`): %s tokens/s, **%d%s of %d** by tokens/s (auto among the %d layouts that trained), **%.2f× the fastest** (%s, %s tokens/s)", \
                    chosen[i], aflags[i], fmt_int(tok[i]), rk[i], (rk[i] % 10 == 1 && rk[i] != 11) ? "st" : (rk[i] % 10 == 2 && rk[i] != 12) ? "nd" : (rk[i] % 10 == 3 && rk[i] != 13) ? "rd" : "th", nok + 1, nok, tok[i] / best, layout_of(besti), fmt_int(best)
                if (same != "") printf "; the same layout measured in its own row: %s tokens/s, rank %d", fmt_int(tok[same]), rk[same]
                printf ". Predicted for it: step %.0f ms (measured %.0f ms, %.2f×), peak %s MiB (measured %s, %.2f×).\n", pstep[i], step_ms(i), pstep[i] / step_ms(i), ppeak[i], rmax[i], ppeak[i] / rmax[i]
            } else {
                printf "**auto** (%s): %s.\n", dash(chosen[i]), stext[i]
            }
        }
        # predicted vs measured over the layouts that trained
        ns = 0; np = 0
        for (i = 1; i <= n; i++) if (kind[i] == "layout" && status[i] == "ok") {
            if (pstep[i] != "-") { rs[++ns] = pstep[i] / step_ms(i) }
            if (ppeak[i] != "-") { rp[++np] = ppeak[i] / rmax[i] }
        }
        if (ns) {
            lo = rs[1]; hi = rs[1]; for (i = 1; i <= ns; i++) { if (rs[i] < lo) lo = rs[i]; if (rs[i] > hi) hi = rs[i] }
            printf "\nPredicted ÷ measured, over the %d layouts that trained: step time median %.2f× (%.2f–%.2f×)", ns, median(rs, ns), lo, hi
        }
        if (np) {
            lo = rp[1]; hi = rp[1]; for (i = 1; i <= np; i++) { if (rp[i] < lo) lo = rp[i]; if (rp[i] > hi) hi = rp[i] }
            printf "; peak memory (largest rank) median %.2f× (%.2f–%.2f×)", median(rp, np), lo, hi
        }
        # Spearman-like check: does the predicted step order the layouts as measured? (pairs in the same order)
        agree = 0; pairs = 0
        for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++)
            if (kind[i] == "layout" && kind[j] == "layout" && status[i] == "ok" && status[j] == "ok" && pstep[i] != "-" && pstep[j] != "-") {
                pairs++; if ((pstep[i] - pstep[j]) * (step_ms(i) - step_ms(j)) > 0) agree++
            }
        if (pairs) printf "; the predicted step times order %d of %d pairs of layouts as measured (%.0f %%)", agree, pairs, 100 * agree / pairs
        if (ns || np) print "."
        if (budgeted) {
            fit_ok = 0; fit_n = 0; kill_ok = 0; kill_n = 0
            for (i = 1; i <= n; i++) if (kind[i] == "layout" && ppeak[i] != "-") {
                if (status[i] == "ok") { fit_n++; if (ppeak[i] + 0 <= budget) fit_ok++ }
                else if (status[i] == "oom" || status[i] == "killed") { kill_n++; if (ppeak[i] + 0 > budget) kill_ok++ }
            }
            printf "\nAgainst the %d MiB budget: the predicted peak was within it for %d of the %d layouts that trained, and above it for %d of the %d killed at the cap.\n", budget, fit_ok, fit_n, kill_ok, kill_n
        }
        nf = 0
        for (i = 1; i <= n; i++) if (status[i] == "failed" || status[i] == "timeout") nf++
        if (nf) {
            printf "\n%d run(s) failed (not the budget):", nf
            for (i = 1; i <= n; i++) if (status[i] == "failed" || status[i] == "timeout") printf " %s;", logf[i]
            print " see their logs."
        }
    }' "$1"
}

echo ">> logs: $log_dir" >&2
echo "## Benchmark of layouts: \`scripts/bench-nd-layouts.sh$( ((quick)) && echo " --quick") --steps $steps --large-steps $large_steps --sizes $sizes --machines $machine_counts --large-machines $large_machine_counts\`"
echo
echo "Started $(now_utc) on $(nproc) CPU cores, $(free -m | awk '/Mem:/ {print $2}') MiB RAM, load average $(load3); accel_gpt $(stat -c '%y' "$gpt" | cut -d. -f1) (dev profile); runs serialised by \`$lock_file\`; logs in \`$log_dir\`."
for size in ${sizes//,/ }; do
    counts=$machine_counts
    [[ $size == large ]] && counts=$large_machine_counts
    for machines in ${counts//,/ }; do
        bench "$size" "$machines"
    done
done
if [[ ,$sizes, == *,large,* && ,$large_machine_counts, != *,2,* && ,$machine_counts, == *,2,* ]]; then
    echo
    echo "The large model ran on one machine only (--large-machines $large_machine_counts); the 2-machine tables are the small model's."
fi
echo
echo "Finished $(now_utc), load average $(load3)."
echo ">> logs: $log_dir" >&2
