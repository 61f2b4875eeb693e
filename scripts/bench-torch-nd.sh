#!/usr/bin/env bash
# Our N-D layouts against PyTorch's native N-D stack on the same CPU: the char-GPT trained by `accel_gpt --nproc 4`
# at each layout, and the same model, data, optimizer and global batch trained by scripts/torch_ref/nd_gpt.py under
# `torchrun --nproc_per_node 4` on gloo (DDP, FSDP2 fully_shard, HSDP, DTensor tensor parallelism with
# loss_parallel, torch.distributed.pipelining, and DeepSpeed ZeRO 1/2/3 on its CPU accelerator when it installs).
# Prints a markdown table: tokens/s over all replicas (the first logged interval excluded as warm-up, on both
# sides), their ratio, every rank's peak RSS (VmHWM) and the final loss of each side. Not run in CI.
#
#   scripts/bench-torch-nd.sh [steps (default 30)] [--global-batch G] [--microbatches M] [--layouts a,b,...]
#                             [model flags, passed to both: --d-model, --n-layer, --n-head, --d-ff, --block-size,
#                              --dropout, --tie-embeddings, --lr, --max-grad-norm, --seed]
#
#   scripts/bench-torch-nd.sh 30                                                     # the default 820 992-parameter GPT
#   scripts/bench-torch-nd.sh 9 --global-batch 8 --d-model 512 --n-layer 8 --n-head 8 --d-ff 2048   # the 25.3M GPT
#
# The global batch (default 64 sequences of --block-size characters; 8 suits the 25.3M model, as bench-sharded.sh's
# 2 per process) is the same for every layout and both frameworks: accel_gpt's --batch-size is per data-parallel
# replica, so it gets G / dp. Pipeline layouts split each replica's batch into M micro-batches (default 4; interleaved
# 1F1B at least its 2·pp stages).
# Layouts (default: all): ddp fsdp-full fsdp-grad-op hsdp hsdp-full tp4 tp2-dp2 pp2-dp2-gpipe pp2-dp2-1f1b
# pp2-dp2-interleaved pp4-gpipe pp4-1f1b pp4-interleaved ds-zero1 ds-zero2 ds-zero3 (ds-*: ours is ZeRO-1 /
# SHARD_GRAD_OP / FULL_SHARD at dp_shard 4; the fsdp rows' runs of ours are reused). 4 processes on each side;
# threads: ours 1 rayon thread per rank (the launcher's cores / nproc), torch cores / 4 (at least 1).
#
# Environment: CARGO_TARGET_DIR (the venv goes under it, see bench-common.sh), BENCH_VENV, TORCH_INDEX_URL (torch
# from that index), BENCH_DEEPSPEED=0 (do not install / run DeepSpeed), BENCH_BUILD_LOCK (a file: the cargo build
# runs under `flock` on it), BENCH_LOG_DIR (each run's output; default $target/bench-torch-nd/<date>),
# RUN_TIMEOUT (seconds per run, default 900), BENCH_MAX_LOAD (wait up to BENCH_MAX_WAIT s, default 600, for the
# 1-minute load average to fall below it before the first run; the loads are printed either way).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench-common.sh
bench_dirs bench-torch-nd

steps=30
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then steps=$1; shift; fi
global_batch=64
microbatches=4
layouts="ddp,fsdp-full,fsdp-grad-op,hsdp,hsdp-full,tp4,tp2-dp2,pp2-dp2-gpipe,pp2-dp2-1f1b,pp2-dp2-interleaved,pp4-gpipe,pp4-1f1b,pp4-interleaved,ds-zero1,ds-zero2,ds-zero3"
model_flags=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help) sed -n '2,29p' "$0"; exit 0 ;;
        --global-batch) global_batch=$2; shift 2 ;;
        --microbatches) microbatches=$2; shift 2 ;;
        --layouts) layouts=$2; shift 2 ;;
        --tie-embeddings) model_flags+=("$1"); shift ;;
        --*) [[ $# -ge 2 ]] || { echo "$1 needs a value" >&2; exit 2; }; model_flags+=("$1" "$2"); shift 2 ;;
        *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
nproc=4
log_every=$((steps / 3 > 0 ? steps / 3 : 1))
log_dir=${BENCH_LOG_DIR:-$out/$(date -u +%Y%m%d-%H%M%S)}
# Measured runs never overlap with another benchmark's (scripts/bench-nd-layouts.sh takes the same lock).
bench_lock=${ACCEL_BENCH_LOCK:-/tmp/accel-bench.lock}
mkdir -p "$log_dir"

echo ">> building accel_gpt (dev profile)" >&2
if [[ -n ${BENCH_BUILD_LOCK:-} ]]; then
    flock "$BENCH_BUILD_LOCK" cargo build -q -p accel-examples --bin accel_gpt
else
    cargo build -q -p accel-examples --bin accel_gpt
fi
ours_bin="$target/debug/accel_gpt"
ensure_bench_venv "$venv"
venv_abs=$(cd "$venv" && pwd)
deepspeed_version="not installed"
if [[ ${BENCH_DEEPSPEED:-1} != 0 && $layouts == *ds-* ]]; then
    if ! DS_ACCELERATOR=cpu "$py" -c "import deepspeed" >/dev/null 2>&1; then
        echo ">> installing deepspeed into $venv (first run only)" >&2
        "$venv/bin/pip" install --quiet deepspeed ninja >"$log_dir/pip-deepspeed.log" 2>&1 \
            || echo ">> pip install deepspeed failed (see $log_dir/pip-deepspeed.log); the ds-* rows will say so" >&2
    fi
fi
deepspeed_version=$(DS_ACCELERATOR=cpu "$py" -c "import deepspeed; print(deepspeed.__version__)" 2>/dev/null | tail -1) \
    || deepspeed_version="not installed"
torch_version=$("$py" -c "import torch; print(torch.__version__)")
torch_import_rss=$("$py" -c "
import torch
for l in open('/proc/self/status'):
    if l.startswith('VmHWM:'): print(f'{int(l.split()[1]) / 1024:.0f}')")

# micro LAYOUT: the micro-batches of a pipeline layout — M, or for interleaved 1F1B (2 stages per rank) at least
# its 2·pp stages, as accel_gpt requires (the same on both sides).
micro() {
    local pp
    case "$1" in
        pp*-interleaved) pp=${1#pp}; pp=${pp%%-*}; echo $((microbatches > 2 * pp ? microbatches : 2 * pp)) ;;
        *) echo "$microbatches" ;;
    esac
}

# ours_flags LAYOUT: accel_gpt's flags for LAYOUT (global batch G → --batch-size G / dp).
ours_flags() {
    local g=$global_batch m
    m=$(micro "$1")
    case "$1" in
        ddp) echo "--batch-size $((g / 4))" ;;
        fsdp-full | ds-zero3) echo "--dp-shard-size 4 --sharding-strategy FULL_SHARD --batch-size $((g / 4))" ;;
        fsdp-grad-op | ds-zero2) echo "--dp-shard-size 4 --sharding-strategy SHARD_GRAD_OP --batch-size $((g / 4))" ;;
        ds-zero1) echo "--dp-shard-size 4 --sharding-strategy SHARD_OPTIM --batch-size $((g / 4))" ;;
        hsdp) echo "--dp-shard-size 2 --sharding-strategy SHARD_GRAD_OP --batch-size $((g / 4))" ;;
        hsdp-full) echo "--dp-shard-size 2 --sharding-strategy FULL_SHARD --batch-size $((g / 4))" ;;
        tp4) echo "--tp-size 4 --batch-size $g" ;;
        tp2-dp2) echo "--tp-size 2 --batch-size $((g / 2))" ;;
        pp2-dp2-gpipe) echo "--pp-size 2 --pp-schedule GPipe --microbatches $m --batch-size $((g / 2))" ;;
        pp2-dp2-1f1b) echo "--pp-size 2 --pp-schedule 1F1B --microbatches $m --batch-size $((g / 2))" ;;
        pp2-dp2-interleaved) echo "--pp-size 2 --pp-schedule Interleaved1F1B --microbatches $m --batch-size $((g / 2))" ;;
        pp4-gpipe) echo "--pp-size 4 --pp-schedule GPipe --microbatches $m --batch-size $g" ;;
        pp4-1f1b) echo "--pp-size 4 --pp-schedule 1F1B --microbatches $m --batch-size $g" ;;
        pp4-interleaved) echo "--pp-size 4 --pp-schedule Interleaved1F1B --microbatches $m --batch-size $g" ;;
        *) echo "unknown layout $1" >&2; return 1 ;;
    esac
}

# What each row compares, in words.
label() {
    case "$1" in
        ddp) echo "DDP ×4 · DistributedDataParallel" ;;
        fsdp-full) echo "dp_shard 4 FULL_SHARD · FSDP2 reshard_after_forward=True" ;;
        fsdp-grad-op) echo "dp_shard 4 SHARD_GRAD_OP · FSDP2 reshard_after_forward=False" ;;
        hsdp) echo "HSDP 2×2 SHARD_GRAD_OP · FSDP2 2-D mesh, reshard_after_forward=False" ;;
        hsdp-full) echo "HSDP 2×2 FULL_SHARD · FSDP2 2-D mesh, reshard_after_forward=True" ;;
        tp4) echo "tp 4 · DTensor Colwise/Rowwise + loss_parallel" ;;
        tp2-dp2) echo "dp 2 × tp 2 · DTensor TP + DDP(device_mesh)" ;;
        pp2-dp2-*) echo "pp 2 × dp 2 ${1##*-} · pipelining + DDP per stage" ;;
        pp4-*) echo "pp 4 ${1##*-} · pipelining" ;;
        ds-zero1) echo "dp_shard 4 SHARD_OPTIM · DeepSpeed ZeRO-1" ;;
        ds-zero2) echo "dp_shard 4 SHARD_GRAD_OP · DeepSpeed ZeRO-2" ;;
        ds-zero3) echo "dp_shard 4 FULL_SHARD · DeepSpeed ZeRO-3" ;;
    esac
}

# 12345 → "12 345"; "—" stays.
fmt_k() { if [[ $1 == — ]]; then echo —; else printf '%.0f' "$1" | sed -E ':a; s/^([0-9]+)([0-9]{3})/\1 \2/; ta'; fi; }

if [[ -n ${BENCH_MAX_LOAD:-} ]]; then
    wait_for_quiet "$BENCH_MAX_LOAD" "${BENCH_MAX_WAIT:-600}"
    echo ">> $waited" >&2
fi
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
declare -A ours_tokens=() ours_loss=() ours_rss=() ours_first=() ours_params=() ours_log=()
rows=()
notes=()
for layout in ${layouts//,/ }; do
    flags=$(ours_flags "$layout")
    # ---- ours (one run per distinct flag set: the ds-* rows reuse the fsdp rows' runs)
    key="$flags"
    if [[ -z ${ours_log[$key]+set} ]]; then
        log="$log_dir/ours-$layout.log"
        echo ">> ours  $layout: accel_gpt --nproc $nproc $flags (load $(load1))" >&2
        # shellcheck disable=SC2086
        if flock "$bench_lock" timeout "${RUN_TIMEOUT:-900}" env -u RANK "$ours_bin" --nproc "$nproc" $flags --steps "$steps" \
            --log-every "$log_every" --sample-len 0 --data-dir "$PWD/data/shakespeare" "${model_flags[@]}" \
            >"$log" 2>&1 && grep -q 'accel_gpt done:' "$log"; then
            done_line=$(grep -m1 'accel_gpt done:' "$log")
            ours_tokens[$key]=$(sed -E 's/.*, ([0-9.]+) tokens\/s.*/\1/' <<<"$done_line")
            ours_loss[$key]=$(sed -E 's/.*final loss ([0-9.NaN]+),.*/\1/' <<<"$done_line")
            ours_first[$key]=$(grep -m1 -oE 'step [0-9]+/[0-9]+: loss [0-9.]+' "$log" | sed -E 's/.*loss //')
            ours_params[$key]=$(grep -m1 -oE 'model [0-9]+ parameters' "$log" | grep -oE '[0-9]+')
            ours_rss[$key]=$(grep -E 'rank [0-9]+ \(pp [0-9]+ dp [0-9]+ tp [0-9]+\): peak RSS' "$log" \
                | sed -E 's/.*rank ([0-9]+) \(pp.*peak RSS ([0-9.]+) MiB.*/\1 \2/' | sort -n \
                | awk '{printf "%s%.0f", sep, $2; sep=" / "}')
        else
            reason=$(grep -vE '^\s*$' "$log" | tail -1 | cut -c1-200)
            ours_tokens[$key]="—"; ours_loss[$key]="—"; ours_rss[$key]="—"; ours_first[$key]="—"; ours_params[$key]=""
            notes+=("ours, $layout: did not run: $reason")
        fi
        ours_log[$key]=$log
    fi
    # ---- theirs
    tlog="$log_dir/torch-$layout.log"
    targs=(--layout "$layout" --steps "$steps" --log-every "$log_every" --global-batch "$global_batch"
        --microbatches "$(micro "$layout")" "${model_flags[@]}")
    [[ -n ${ours_params[$key]} ]] && targs+=(--expect-parameters "${ours_params[$key]}")
    t_tokens="—"; t_loss="—"; t_rss="—"; t_first="—"; fallback=""; unsupported=""; first_reason=""
    if [[ $layout == ds-* && ${BENCH_DEEPSPEED:-1} == 0 ]]; then
        notes+=("torch, $layout: skipped (BENCH_DEEPSPEED=0)")
    else
        for attempt in native fallback; do
            extra=()
            if [[ $attempt == fallback ]]; then
                # DDP around pipeline stages fails under some schedules: average the gradients by hand instead.
                [[ $layout == pp*-dp* && -n $unsupported ]] || break
                extra=(--pp-dp allreduce); fallback=" ¹"; tlog="$log_dir/torch-$layout-allreduce.log"
            fi
            echo ">> torch $layout${extra[*]:+ ${extra[*]}} (load $(load1))" >&2
            PATH="$venv_abs/bin:$PATH" DS_ACCELERATOR=cpu flock "$bench_lock" timeout "${RUN_TIMEOUT:-900}" \
                "$py" -m torch.distributed.run --standalone --nproc_per_node "$nproc" scripts/torch_ref/nd_gpt.py \
                "${targs[@]}" "${extra[@]}" >"$tlog" 2>&1 || true
            # The first rank's reason, preferring a cause to its peers' "connection closed" echoes.
            unsupported=$( { grep '^unsupported:' "$tlog" | grep -vE 'Connection closed by peer|Timed out|timed out' \
                || grep '^unsupported:' "$tlog"; } | head -1 | sed -E "s/^unsupported: [^:]+: //" || true)
            result=$(grep -m1 '^nd_gpt result: ' "$tlog" | sed 's/^nd_gpt result: //' || true)
            if [[ -n $result ]]; then
                read -r t_tokens t_loss t_first t_rss < <("$py" -c '
import json, sys
r = json.loads(sys.argv[1])
rss = "_/_".join("%.0f" % v for v in r["peak_rss_mib"])
print("%.0f %.4f %.4f %s" % (r["tokens_per_s"], r["final_loss"], r["first_loss"], rss))' "$result")
                t_rss=${t_rss//_/ }
                [[ $attempt == fallback ]] && notes+=("¹ torch, $layout: DDP around the stages failed ($first_reason); gradients averaged by one all-reduce after the schedule instead (--pp-dp allreduce)")
                break
            fi
            if [[ -z $unsupported ]]; then
                unsupported="no result (see $tlog): $( { grep -m1 '^error:' "$tlog" || grep -vE '^\s*$' "$tlog" | tail -1; } | cut -c1-200)"
                notes+=("torch, $layout: FAILED: $unsupported")
                break
            fi
            [[ $attempt == native ]] && first_reason=$unsupported
            if [[ $attempt == fallback || $layout != pp*-dp* ]]; then
                notes+=("torch, $layout: unsupported: $unsupported")
                break
            fi
        done
    fi
    ratio=$(awk -v a="${ours_tokens[$key]}" -v b="$t_tokens" \
        'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2f×", a / b; else printf "—" }')
    row_label=$(label "$layout")
    [[ -n $fallback ]] && row_label="${row_label/DDP per stage/gradients all-reduced after the schedule}"
    rows+=("| $row_label | $(fmt_k "${ours_tokens[$key]}") | $(fmt_k "$t_tokens")$fallback | $ratio | ${ours_rss[$key]} | $t_rss | ${ours_loss[$key]} / $t_loss | ${ours_first[$key]} / $t_first |")
done
load_end=$(cut -d' ' -f1-3 /proc/loadavg)

echo
echo "char-GPT, ours (accel_gpt) vs PyTorch's N-D stack, $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPU cores" \
    "($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')), nproc $nproc per layout," \
    "load average $load_start at the start, $load_end at the end; $(rustc --version | cut -d' ' -f1-2)," \
    "torch $torch_version, deepspeed $deepspeed_version; $steps optimizer steps (throughput over the last" \
    "$((steps - log_every))), global batch $global_batch sequences, $microbatches micro-batches under pp (interleaved: at least 2·pp);" \
    "model flags: ${model_flags[*]:-none (the default 820 992-parameter GPT)}." \
    "importing torch alone: $torch_import_rss MiB peak RSS per process."
echo
echo "| layout · PyTorch implementation | ours tokens/s | torch tokens/s | ours/torch | ours peak RSS per rank (MiB) | torch peak RSS per rank (MiB) | final loss ours / torch | first logged loss ours / torch |"
echo "|---|---:|---:|---:|---|---|---|---|"
printf '%s\n' "${rows[@]}"
if (( ${#notes[@]} )); then
    echo
    printf -- '- %s\n' "${notes[@]}"
fi
echo
echo "logs: $log_dir" >&2
