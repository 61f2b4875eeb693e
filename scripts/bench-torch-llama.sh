#!/usr/bin/env bash
# Our Llama against transformers' LlamaForCausalLM under PyTorch's N-D stack on the same CPU: the Llama trained by
# `accel_llama --nproc N` at each layout, and transformers' LlamaForCausalLM of the same config, data, optimizer and
# global batch trained by scripts/torch_ref/nd_llama.py under `torchrun --nproc_per_node N` on gloo (DDP, FSDP2
# fully_shard, HSDP, transformers' own tensor parallelism, torch.distributed.pipelining), at 2 and at 4 processes.
# Accelerate's ND-parallel front end (ParallelismConfig + the FSDP2 plugin) gets a row of its own: it refuses the CPU.
# Prints one markdown table per process count: tokens/s over all replicas (the first logged interval excluded as
# warm-up, on both sides), their ratio, every rank's peak RSS (VmHWM), the final and the first logged loss of each
# side. Not run in CI. The GPT's twin: scripts/bench-torch-nd.sh.
#
#   scripts/bench-torch-llama.sh [steps (default 30)] [--nproc 2|4|2,4] [--layouts a,b,...] [--global-batch G]
#                                [--microbatches M] [--attn-implementation sdpa|eager (torch only)]
#                                [model flags, passed to both: --seq-len, --hidden-size, --intermediate-size,
#                                 --num-hidden-layers, --num-attention-heads, --num-key-value-heads,
#                                 --tie-word-embeddings, --attention-dropout, --lr, --max-grad-norm, --seed]
#
#   scripts/bench-torch-llama.sh 30                         # both process counts, the default 11 015 040-parameter Llama
#   scripts/bench-torch-llama.sh 30 --nproc 4 --layouts tp4,tp2-dp2 --num-attention-heads 8 --num-key-value-heads 4
#
# The model is accel_llama's default (hidden 384, MLP 1024, 6 layers, 6 heads over 2 key/value heads, vocabulary 2048,
# sequences of 128 tokens). The global batch (default 16 sequences: accel_llama's 8 per replica at dp 2) is the same
# for every layout and both frameworks: accel_llama's --batch-size is per data-parallel replica, so it gets G / dp.
# Pipeline layouts split each replica's batch into M micro-batches (default 4; interleaved 1F1B at least its 2·pp).
# Layouts (default, by process count):
#   2: ddp fsdp-full fsdp-grad-op tp2 pp2-gpipe pp2-1f1b accelerate
#   4: ddp fsdp-full fsdp-grad-op hsdp hsdp-full tp2-dp2 pp2-dp2-1f1b pp4-1f1b accelerate
# also: tpN[-dpD], ppP[-dpD]-gpipe|1f1b|interleaved, hsdp* at 2. tp4 is left out: the default 2 key/value heads do not
# split over 4 ranks, which accel_llama refuses and transformers' tp plan fails on (the second example above changes
# the model for every row of that run). The accelerate row reuses the fsdp-full row's run of ours.
# Threads: ours 1 rayon thread per rank (the launcher's cores / nproc), torch cores / nproc (at least 1).
#
# Environment: ACCEL_LLAMA (our binary: skips the cargo build; default: build $target/debug/accel_llama),
# CARGO_TARGET_DIR (the venv goes under it, see bench-common.sh), BENCH_VENV (a venv that imports torch,
# transformers and tokenizers is used as it is; accelerate is needed for its row), TORCH_INDEX_URL, BENCH_BUILD_LOCK
# (a file: the cargo build runs under `flock` on it), BENCH_LOG_DIR (each run's output; default
# $target/bench-torch-llama/<date>), RUN_TIMEOUT (seconds per run, default 900), BENCH_MAX_LOAD (wait up to
# BENCH_MAX_WAIT s, default 600, for the 1-minute load average to fall below it before the first run).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench-common.sh
bench_dirs bench-torch-llama

steps=30
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then steps=$1; shift; fi
global_batch=16
microbatches=4
nprocs="2,4"
layouts=""
torch_flags=()
model_flags=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help) sed -n '2,37p' "$0"; exit 0 ;;
        --global-batch) global_batch=$2; shift 2 ;;
        --microbatches) microbatches=$2; shift 2 ;;
        --layouts) layouts=$2; shift 2 ;;
        --nproc) nprocs=$2; shift 2 ;;
        --attn-implementation) torch_flags+=("$1" "$2"); shift 2 ;;
        --tie-word-embeddings) model_flags+=("$1"); shift ;;
        --*) [[ $# -ge 2 ]] || { echo "$1 needs a value" >&2; exit 2; }; model_flags+=("$1" "$2"); shift 2 ;;
        *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
for n in ${nprocs//,/ }; do
    [[ $n =~ ^[1-9][0-9]*$ ]] || { echo "--nproc: $n is not a process count" >&2; exit 2; }
done
log_every=$((steps / 3 > 0 ? steps / 3 : 1))
log_dir=${BENCH_LOG_DIR:-$out/$(date -u +%Y%m%d-%H%M%S)}
# Measured runs never overlap with another benchmark's (bench-torch-nd.sh and bench-nd-layouts.sh take the same lock).
bench_lock=${ACCEL_BENCH_LOCK:-/tmp/accel-bench.lock}
mkdir -p "$log_dir"

if [[ -n ${ACCEL_LLAMA:-} ]]; then
    ours_bin=$ACCEL_LLAMA
else
    echo ">> building accel_llama (dev profile)" >&2
    if [[ -n ${BENCH_BUILD_LOCK:-} ]]; then
        flock "$BENCH_BUILD_LOCK" cargo build -q -p accel-examples --bin accel_llama
    else
        cargo build -q -p accel-examples --bin accel_llama
    fi
    ours_bin="$target/debug/accel_llama"
fi
[[ -x $ours_bin ]] || { echo "no accel_llama at $ours_bin" >&2; exit 2; }
if ! [[ -x $py ]] || ! "$py" -c "import torch, transformers, tokenizers" 2>/dev/null; then
    ensure_bench_venv "$venv"
fi
venv_abs=$(cd "$venv" && pwd)
versions=$("$py" -c '
import importlib
def v(m):
    try:
        return importlib.import_module(m).__version__
    except Exception:
        return "not installed"
print(", ".join(f"{m} {v(m)}" for m in ("torch", "transformers", "accelerate")))' 2>/dev/null)
import_rss=$("$py" -c "
def peak():
    for l in open('/proc/self/status'):
        if l.startswith('VmHWM:'): return int(l.split()[1]) / 1024
import torch
t = peak()
from transformers import LlamaForCausalLM
print(f'{t:.0f} {peak():.0f}')" 2>/dev/null)

# default_layouts N: the layouts run at N processes unless --layouts names them.
default_layouts() {
    case "$1" in
        2) echo "ddp,fsdp-full,fsdp-grad-op,tp2,pp2-gpipe,pp2-1f1b,accelerate" ;;
        4) echo "ddp,fsdp-full,fsdp-grad-op,hsdp,hsdp-full,tp2-dp2,pp2-dp2-1f1b,pp4-1f1b,accelerate" ;;
        *) echo "ddp,fsdp-full,fsdp-grad-op,accelerate" ;;
    esac
}

# micro LAYOUT: the micro-batches of a pipeline layout — M, or for interleaved 1F1B (2 stages per rank) at least
# its 2·pp stages, as accel_llama requires (the same on both sides).
micro() {
    local pp
    case "$1" in
        pp*-interleaved) pp=${1#pp}; pp=${pp%%-*}; echo $((microbatches > 2 * pp ? microbatches : 2 * pp)) ;;
        *) echo "$microbatches" ;;
    esac
}

# ours_flags LAYOUT N: accel_llama's flags for LAYOUT at N processes (global batch G → --batch-size G / dp).
ours_flags() {
    local layout=$1 n=$2 g=$global_batch m sched tp pp dp
    m=$(micro "$layout")
    case "$layout" in
        ddp) echo "--batch-size $((g / n))" ;;
        fsdp-full | accelerate) echo "--dp-shard-size $n --sharding-strategy FULL_SHARD --batch-size $((g / n))" ;;
        fsdp-grad-op) echo "--dp-shard-size $n --sharding-strategy SHARD_GRAD_OP --batch-size $((g / n))" ;;
        hsdp) echo "--dp-shard-size 2 --sharding-strategy SHARD_GRAD_OP --batch-size $((g / n))" ;;
        hsdp-full) echo "--dp-shard-size 2 --sharding-strategy FULL_SHARD --batch-size $((g / n))" ;;
        tp*)
            [[ $layout =~ ^tp([0-9]+)(-dp([0-9]+))?$ ]] || { echo "unknown layout $layout" >&2; return 1; }
            tp=${BASH_REMATCH[1]}; dp=${BASH_REMATCH[3]:-1}
            echo "--tp-size $tp --batch-size $((g / dp))" ;;
        pp*)
            [[ $layout =~ ^pp([0-9]+)(-dp([0-9]+))?-(gpipe|1f1b|interleaved)$ ]] || { echo "unknown layout $layout" >&2; return 1; }
            pp=${BASH_REMATCH[1]}; dp=${BASH_REMATCH[3]:-1}
            case "${BASH_REMATCH[4]}" in gpipe) sched=GPipe ;; 1f1b) sched=1F1B ;; *) sched=Interleaved1F1B ;; esac
            echo "--pp-size $pp --pp-schedule $sched --microbatches $m --batch-size $((g / dp))" ;;
        *) echo "unknown layout $layout" >&2; return 1 ;;
    esac
}

# label LAYOUT N: what the row compares, in words.
label() {
    local layout=$1 n=$2
    case "$layout" in
        ddp) echo "DDP ×$n · DistributedDataParallel" ;;
        fsdp-full) echo "dp_shard $n FULL_SHARD · FSDP2 fully_shard per decoder layer, reshard_after_forward=True" ;;
        fsdp-grad-op) echo "dp_shard $n SHARD_GRAD_OP · FSDP2 fully_shard per decoder layer, reshard_after_forward=False" ;;
        hsdp) echo "HSDP $((n / 2))×2 SHARD_GRAD_OP · FSDP2 2-D mesh, reshard_after_forward=False" ;;
        hsdp-full) echo "HSDP $((n / 2))×2 FULL_SHARD · FSDP2 2-D mesh, reshard_after_forward=True" ;;
        tp*-dp*) local t=${layout#tp}; t=${t%%-*}
            echo "dp ${layout##*-dp} × tp $t · transformers' TP + its FSDP2 replicate over dp (DistributedConfig(tp_size=$t, dp_replicate_size=${layout##*-dp}))" ;;
        tp*) echo "tp ${layout#tp} · transformers' TP (DistributedConfig(tp_size=${layout#tp}))" ;;
        pp*-dp*) local p=${layout#pp}; p=${p%%-*}; local d=${layout#*-dp}; d=${d%%-*}
            echo "pp $p × dp $d ${layout##*-} · pipelining (decoder layers cut into stages) + DDP per stage" ;;
        pp*) local p=${layout#pp}; p=${p%%-*}; echo "pp $p ${layout##*-} · pipelining (decoder layers cut into stages)" ;;
        accelerate) echo "dp_shard $n FULL_SHARD · Accelerate ParallelismConfig(dp_shard_size=$n) + FSDP2 plugin" ;;
        *) echo "$layout" ;;
    esac
}

# 12345 → "12 345"; "—" stays.
fmt_k() { if [[ $1 == — ]]; then echo —; else printf '%.0f' "$1" | sed -E ':a; s/^([0-9]+)([0-9]{3})/\1 \2/; ta'; fi; }

if [[ -n ${BENCH_MAX_LOAD:-} ]]; then
    wait_for_quiet "$BENCH_MAX_LOAD" "${BENCH_MAX_WAIT:-600}"
    echo ">> $waited" >&2
fi
ours_out=$(mktemp -d "${TMPDIR:-/tmp}/bench-torch-llama.XXXXXX")
trap 'rm -rf "$ours_out"' EXIT
declare -A ours_tokens=() ours_loss=() ours_rss=() ours_first=() ours_params=() ours_log=()
tables=()
for nproc in ${nprocs//,/ }; do
    load_start=$(cut -d' ' -f1-3 /proc/loadavg)
    rows=()
    notes=()
    list=${layouts:-$(default_layouts "$nproc")}
    for layout in ${list//,/ }; do
        flags=$(ours_flags "$layout" "$nproc")
        # ---- ours (one run per distinct flag set: the accelerate row reuses the fsdp-full row's run)
        key="$nproc $flags"
        if [[ -z ${ours_log[$key]+set} ]]; then
            log="$log_dir/ours-$nproc-$layout.log"
            echo ">> ours  $layout: accel_llama --nproc $nproc $flags (load $(load1))" >&2
            # shellcheck disable=SC2086
            if flock "$bench_lock" timeout "${RUN_TIMEOUT:-900}" env -u RANK "$ours_bin" --nproc "$nproc" $flags \
                --steps "$steps" --log-every "$log_every" --sample-tokens 0 --eval-batches 0 \
                --output-dir "$ours_out/model" --data-dir "$PWD/data/shakespeare" "${model_flags[@]}" \
                >"$log" 2>&1 && grep -q 'accel_llama done:' "$log"; then
                done_line=$(grep -m1 'accel_llama done:' "$log")
                ours_tokens[$key]=$(sed -E 's/.*, ([0-9.]+) tokens\/s.*/\1/' <<<"$done_line")
                ours_loss[$key]=$(sed -E 's/.*final loss ([0-9.NaN]+),.*/\1/' <<<"$done_line")
                ours_first[$key]=$(grep -m1 -oE 'step [0-9]+/[0-9]+: loss [0-9.]+' "$log" | sed -E 's/.*loss //')
                ours_params[$key]=$(grep -m1 -oE 'Llama of [0-9]+ parameters' "$log" | grep -oE '[0-9]+')
                ours_rss[$key]=$(grep -E 'rank [0-9]+ \(pp [0-9]+ dp [0-9]+ tp [0-9]+\): peak RSS' "$log" \
                    | sed -E 's/.*rank ([0-9]+) \(pp.*peak RSS ([0-9.]+) MiB.*/\1 \2/' | sort -n \
                    | awk '{printf "%s%.0f", sep, $2; sep=" / "}')
            else
                reason=$(grep -vE '^\s*$' "$log" | tail -1 | cut -c1-300)
                ours_tokens[$key]="—"; ours_loss[$key]="—"; ours_rss[$key]="—"; ours_first[$key]="—"; ours_params[$key]=""
                notes+=("ours, $layout: did not run: $reason")
            fi
            rm -rf "$ours_out/model"
            ours_log[$key]=$log
        fi
        # ---- theirs
        tlog="$log_dir/torch-$nproc-$layout.log"
        targs=(--layout "$layout" --steps "$steps" --log-every "$log_every" --global-batch "$global_batch"
            --microbatches "$(micro "$layout")" "${torch_flags[@]}" "${model_flags[@]}")
        [[ -n ${ours_params[$key]} ]] && targs+=(--expect-parameters "${ours_params[$key]}")
        t_tokens="—"; t_loss="—"; t_rss="—"; t_first="—"; fallback=""; unsupported=""; first_reason=""
        for attempt in native fallback; do
            extra=()
            if [[ $attempt == fallback ]]; then
                # DDP around pipeline stages fails under some schedules: average the gradients by hand instead.
                [[ $layout == pp*-dp* && -n $unsupported ]] || break
                extra=(--pp-dp allreduce); fallback=" ¹"; tlog="$log_dir/torch-$nproc-$layout-allreduce.log"
            fi
            echo ">> torch $layout${extra[*]:+ ${extra[*]}} (load $(load1))" >&2
            PATH="$venv_abs/bin:$PATH" flock "$bench_lock" timeout "${RUN_TIMEOUT:-900}" \
                "$py" -m torch.distributed.run --standalone --nproc_per_node "$nproc" scripts/torch_ref/nd_llama.py \
                "${targs[@]}" "${extra[@]}" >"$tlog" 2>&1 || true
            # The first rank's reason, preferring a cause to its peers' "connection closed" echoes.
            unsupported=$( { grep '^unsupported:' "$tlog" | grep -vE 'Connection closed by peer|Timed out|timed out' \
                || grep '^unsupported:' "$tlog"; } | head -1 | sed -E "s/^unsupported: [^:]+: //" || true)
            result=$(grep -m1 '^nd_llama result: ' "$tlog" | sed 's/^nd_llama result: //' || true)
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
                unsupported="no result (see $tlog): $( { grep -m1 '^error:' "$tlog" || grep -vE '^\s*$' "$tlog" | tail -1; } | cut -c1-300)"
                notes+=("torch, $layout: FAILED: $unsupported")
                break
            fi
            [[ $attempt == native ]] && first_reason=$unsupported
            if [[ $attempt == fallback || $layout != pp*-dp* ]]; then
                notes+=("torch, $layout: unsupported: $unsupported")
                break
            fi
        done
        ratio=$(awk -v a="${ours_tokens[$key]}" -v b="$t_tokens" \
            'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2f×", a / b; else printf "—" }')
        row_label=$(label "$layout" "$nproc")
        [[ -n $fallback ]] && row_label="${row_label/DDP per stage/gradients all-reduced after the schedule}"
        rows+=("| $row_label | $(fmt_k "${ours_tokens[$key]}") | $(fmt_k "$t_tokens")$fallback | $ratio | ${ours_rss[$key]} | $t_rss | ${ours_loss[$key]} / $t_loss | ${ours_first[$key]} / $t_first |")
    done
    load_end=$(cut -d' ' -f1-3 /proc/loadavg)
    table="Llama, ours (accel_llama) vs transformers' LlamaForCausalLM under PyTorch's N-D stack (nd_llama.py),"
    table+=" $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPU cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')),"
    table+=" nproc $nproc per layout, load average $load_start at the start, $load_end at the end;"
    table+=" $(rustc --version 2>/dev/null | cut -d' ' -f1-2), $versions; $steps optimizer steps (throughput over the last"
    table+=" $((steps - log_every))), global batch $global_batch sequences, $microbatches micro-batches under pp (interleaved: at least 2·pp);"
    default_model="none (accel_llama's default 11 015 040-parameter Llama, sequences of 128 tokens)"
    table+=" model flags: ${model_flags[*]:-$default_model};"
    table+=" torch flags: ${torch_flags[*]:-none (attention sdpa)}."
    table+=" Peak RSS per process of importing torch alone: ${import_rss% *} MiB, torch + transformers' LlamaForCausalLM: ${import_rss#* } MiB."
    table+=$'\n\n'"| layout · PyTorch implementation | ours tokens/s | torch tokens/s | ours/torch | ours peak RSS per rank (MiB) | torch peak RSS per rank (MiB) | final loss ours / torch | first logged loss ours / torch |"
    table+=$'\n'"|---|---:|---:|---:|---|---|---|---|"
    table+=$'\n'"$(printf '%s\n' "${rows[@]}")"
    if (( ${#notes[@]} )); then
        table+=$'\n\n'"$(printf -- '- %s\n' "${notes[@]}")"
    fi
    tables+=("$table")
    echo >&2
    echo "$table" >&2 # as it comes, in case a later run hangs
done

echo
printf '%s\n\n' "${tables[@]}"
echo "logs: $log_dir" >&2
