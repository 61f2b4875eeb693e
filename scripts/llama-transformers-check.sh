#!/usr/bin/env bash
# Trains a Llama with accel_llama, saves it as a Hugging Face directory, and checks with
# scripts/llama-transformers-check.py that transformers loads that directory and computes accel_llama's validation
# loss and greedy sample with it.
#
#   scripts/llama-transformers-check.sh [accel_llama flags...]
#
# Default: 10 steps at tp2 x pp2 (--nproc 4 --tp-size 2 --pp-size 2 --microbatches 4). The flags are passed
# through to accel_llama; a layout flag (--nproc, --tp-size, --pp-size, --microbatches, ...) replaces the whole
# default layout, --steps the 10 steps, --output-dir the temporary directory (kept then). --seq-len,
# --eval-batches, --data-dir, --prompt and --sample-tokens are also given to the Python check, and --batch-size
# times the data-parallel size (nproc / (tp x pp)): accel_llama evaluates batches of the global batch's rows.
#
#   1. accel_llama --output-dir DIR ... : its stdout gives `validation loss X` and, at pp 1, its `greedy sample:`.
#   2. Under pp > 1 accel_llama prints no sample: a second, 1-process run reloads DIR (--model-dir DIR --steps 0:
#      no training, the directory's model evaluated and sampled) for it; that this run's validation loss equals
#      run 1's is checked (within --tol).
#   3. python scripts/llama-transformers-check.py DIR --expect X --generate PROMPT --tokens N --expect-sample-log LOG
#
# Prints one summary line on stdout, the rest (progress, the logs of a failed step) on stderr:
#
#   transformers loads DIR: validation loss ours X, transformers Y, |Δ| Z; greedy sample equal: yes|no
#
# and exits non-zero on any failure or mismatch. The loss comparison assumes the saved weights are the trained ones
# (the default --save-dtype f32; bf16/f16 files round them) and float32 compute (no --mixed-precision).
#
# Environment: PYTHON (default /work/venv-llama/bin/python; needs torch, transformers, tokenizers), ACCEL_LLAMA
# (the binary; default $CARGO_TARGET_DIR/debug/accel_llama, else target/debug/accel_llama — build it with
# `cargo build -p accel-examples --bin accel_llama`), TOL (the relative loss tolerance, default 1e-4),
# KEEP=1 (keep the temporary directory).
set -euo pipefail

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 0
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
check_py="$root/scripts/llama-transformers-check.py"
python="${PYTHON:-/work/venv-llama/bin/python}"
bin="${ACCEL_LLAMA:-${CARGO_TARGET_DIR:-$root/target}/debug/accel_llama}"
tol="${TOL:-1e-4}"
say() { echo "llama-transformers-check: $*" >&2; }

[[ -x $bin ]] || { say "no accel_llama binary at $bin (set ACCEL_LLAMA, or build: cargo build -p accel-examples --bin accel_llama)"; exit 2; }
[[ -x $python ]] || command -v "$python" >/dev/null || { say "no python at $python (set PYTHON)"; exit 2; }

# The flags accel_llama is given, and the values of those the check needs (both `--flag value` and `--flag=value`).
args=("$@")
declare -A val=()
has_layout=0
for ((i = 0; i < ${#args[@]}; i++)); do
    a="${args[i]}"
    case "$a" in
        --*=*) name="${a%%=*}"; value="${a#*=}" ;;
        --*) name="$a"; value="${args[i + 1]:-}" ;;
        *) continue ;;
    esac
    case "$name" in
        --nproc | --tp-size | --pp-size | --pp-schedule | --microbatches | --pp-virtual-stages | --dp-shard-size | \
            --sharding-strategy | --layers-per-stage) has_layout=1 ;;
    esac
    case "$name" in
        --steps | --output-dir | --seq-len | --batch-size | --eval-batches | --data-dir | --prompt | --sample-tokens | \
            --save-dtype | --mixed-precision | --nproc | --tp-size | --pp-size) val[$name]="$value" ;;
    esac
done
if [[ $has_layout == 0 ]]; then
    args+=(--nproc 4 --tp-size 2 --pp-size 2 --microbatches 4)
    val[--nproc]=4 val[--tp-size]=2 val[--pp-size]=2
fi
# accel_llama evaluates batches of the global batch's rows: --batch-size (per replica) x dp, dp = nproc / (tp x pp).
dp=$(( ${val[--nproc]:-1} / (${val[--tp-size]:-1} * ${val[--pp-size]:-1}) ))
rows=$(( ${val[--batch-size]:-8} * dp ))
[[ -n ${val[--steps]+set} ]] || args+=(--steps 10)

tmp="$(mktemp -d "${TMPDIR:-/tmp}/llama-transformers-check.XXXXXX")"
if [[ ${KEEP:-0} == 1 ]]; then say "keeping $tmp"; else trap 'rm -rf "$tmp"' EXIT; fi
if [[ -n ${val[--output-dir]+set} ]]; then
    dir="${val[--output-dir]}"
else
    dir="$tmp/model"
    args+=(--output-dir "$dir")
fi
[[ ${val[--save-dtype]:-f32} == f32 ]] || say "warning: --save-dtype ${val[--save-dtype]} rounds the saved weights: the losses may differ by more than float32 noise"

# Run a command with its stdout and stderr in LOG; on failure show the log's tail and exit.
run_logged() {
    local log="$1"; shift
    say "$* > $log"
    local rc=0
    "$@" >"$log" 2>&1 || rc=$?
    if [[ $rc != 0 ]]; then
        say "failed (exit $rc): $*"; tail -n 40 "$log" >&2; exit 1
    fi
}
# accel_llama's `validation loss X` in LOG (the launcher prefixes its workers' lines with `[rank R] `).
loss_in() { sed -n 's/^\(\[rank 0\] \)\{0,1\}validation loss \([0-9.eE+-]*\) .*/\2/p' "$1" | tail -n 1; }
has_sample() { grep -qE '^(\[rank 0\] )?greedy sample:$' "$1"; }

# 1. Train and save.
train_log="$tmp/accel_llama.log"
run_logged "$train_log" "$bin" "${args[@]}"
ours="$(loss_in "$train_log")"
[[ -n $ours ]] || { say "no 'validation loss' line in $train_log (--eval-batches 0?)"; tail -n 20 "$train_log" >&2; exit 1; }
say "accel_llama: validation loss $ours, saved $dir"

# 2. The greedy sample: run 1's, or (pp > 1) a 1-process reload's.
check_flags=(--batch-size "$rows")
for f in --seq-len --eval-batches; do
    [[ -z ${val[$f]+set} ]] || check_flags+=("$f" "${val[$f]}")
done
[[ -z ${val[--data-dir]+set} ]] || check_flags+=(--text "${val[--data-dir]}/shakespeare8.txt")
sample_tokens="${val[--sample-tokens]:-40}"
prompt="${val[--prompt]:-ROMEO:}"
sample_log=""
if [[ $sample_tokens != 0 ]]; then
    if has_sample "$train_log"; then
        sample_log="$train_log"
    else
        # Same data, window and sample flags; 1 process; the saved directory's weights unchanged (see the header).
        reload=(--model-dir "$dir" --steps 0 --output-dir "$tmp/reloaded" --sample-tokens "$sample_tokens"
            --prompt "$prompt" --batch-size "$rows")
        for f in --seq-len --eval-batches --data-dir --mixed-precision; do
            [[ -z ${val[$f]+set} ]] || reload+=("$f" "${val[$f]}")
        done
        sample_log="$tmp/accel_llama-reload.log"
        run_logged "$sample_log" "$bin" "${reload[@]}"
        has_sample "$sample_log" || { say "the 1-process reload printed no greedy sample"; tail -n 20 "$sample_log" >&2; exit 1; }
        again="$(loss_in "$sample_log")"
        if ! "$python" -c 'import sys; a, b, t = map(float, sys.argv[1:]); sys.exit(abs(a - b) > t * abs(a))' \
            "$ours" "$again" "$tol"; then
            say "the 1-process reload's validation loss $again differs from the trained run's $ours: the reload changed the weights or the layouts disagree"
            exit 1
        fi
        say "1-process reload of $dir: validation loss $again (the trained run's: $ours), greedy sample from it"
    fi
    check_flags+=(--generate "$prompt" --tokens "$sample_tokens" --expect-sample-log "$sample_log")
fi

# 3. transformers.
check_log="$tmp/transformers-check.log"
say "$python $check_py $dir --expect $ours --tol $tol ${check_flags[*]} > $check_log"
status=0
"$python" "$check_py" "$dir" --expect "$ours" --tol "$tol" "${check_flags[@]}" >"$check_log" 2>&1 || status=$?
summary="$(grep '^transformers loads ' "$check_log" | tail -n 1 || true)"
if [[ $status != 0 || -z $summary ]]; then
    say "the transformers check failed (exit $status):"
    cat "$check_log" >&2
    [[ -z $summary ]] || echo "$summary"
    exit 1
fi
grep -E '^(transformers warning|FAIL)' "$check_log" >&2 || true
echo "$summary"
