# Sourced by the benchmark scripts (bench-levels.sh, bench-step.sh, bench-overlap.sh, bench-allreduce.sh): what
# they share, written once. Defines functions only (sourcing it runs nothing).
#
#   parse_bench_args HELP SPEC... -- ARGS...
#                             parses the script's ARGS by SPEC: `--flag=var` sets var to the flag's value,
#                             `--flag=var:value` (a switch) sets var to value. -h/--help prints the lines HELP (a
#                             sed range, e.g. 2,16: the script's header) of $0 and exits 0; an unknown argument
#                             or a flag without its value exits 2.
#   bench_dirs NAME           sets $target (CARGO_TARGET_DIR, else target), $venv (BENCH_VENV, else
#                             $target/bench-venv), $py (the venv's python) and $out ($target/NAME, created).
#   build_bench BIN           builds the accel-benches binary BIN with the dev profile (as the README builds) and
#                             prints its path.
#   ensure_bench_venv DIR     creates the venv DIR with torch, accelerate, transformers and matplotlib from PyPI
#                             unless they import already. Only these scripts call it — never CI. TORCH_INDEX_URL:
#                             install torch from that index instead (e.g. the CPU wheels,
#                             https://download.pytorch.org/whl/cpu).
#   wait_for_quiet MAX_LOAD MAX_WAIT
#                             waits (up to MAX_WAIT s) until the 1-minute load average is below MAX_LOAD; sets
#                             $waited to a sentence saying how long it waited and the load at the start.
#   load1                     the 1-minute load average now.
#   run_and_keep PATTERN LABEL CMD...
#                             runs CMD with its output in $out/LABEL.log, appends the load before it to $loads and
#                             the last line matching the grep -o PATTERN (the run's JSON result; every matching
#                             line with keep=all) to $runs; a failed run or one without a result is added to the
#                             array $failed.
#   start_runs                sets $runs ($out/runs.jsonl) and $loads ($out/loads.txt), both emptied, and an empty
#                             array $failed: what run_and_keep appends to.
#   report_failed             exits 1 naming every failed run, if any.
#   models_from WHICH         sets the array $models from --model's value (mlp, gpt or all), or exits naming them.
#   write_bench_meta PY OUT LOADS QUIET TASK
#                             writes OUT (meta.json for scripts/torch_ref/report.py): the machine (CPU, cores, RAM,
#                             kernel), the date, the loads recorded in the file LOADS, the quiet threshold, $waited,
#                             the venv, TASK and the versions of rustc, torch, accelerate and transformers (PY's
#                             site-packages; "not installed" where one is missing).
parse_bench_args() {
    local _help="$1" _spec _flag
    local -A _value=() _switch=()
    shift
    while [[ $# -gt 0 && $1 != -- ]]; do
        _spec="$1"; _flag="${_spec%%=*}"; shift
        if [[ ${_spec#*=} == *:* ]]; then _switch[$_flag]="${_spec#*=}"; else _value[$_flag]="${_spec#*=}"; fi
    done
    shift # --
    while [[ $# -gt 0 ]]; do
        if [[ $1 == -h || $1 == --help ]]; then
            sed -n "${_help}p" "$0"; exit 0
        elif [[ -n ${_value[$1]+set} ]]; then
            [[ $# -ge 2 ]] || { echo "$1 needs a value (see --help)" >&2; exit 2; }
            printf -v "${_value[$1]}" '%s' "$2"; shift 2
        elif [[ -n ${_switch[$1]+set} ]]; then
            printf -v "${_switch[$1]%%:*}" '%s' "${_switch[$1]#*:}"; shift
        else
            echo "unknown argument $1 (see --help)" >&2; exit 2
        fi
    done
}

bench_dirs() {
    target="${CARGO_TARGET_DIR:-target}"
    venv="${BENCH_VENV:-$target/bench-venv}"
    py="$venv/bin/python"
    out="$target/$1"
    mkdir -p "$out"
}

build_bench() {
    echo ">> building $1 (dev profile)" >&2
    # `|| return`: errexit does not reach into the command substitution this runs in.
    cargo build --quiet -p accel-benches --bin "$1" >&2 || return
    echo "$target/debug/$1"
}

ensure_bench_venv() {
    local venv="$1"
    if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c "import torch, accelerate, transformers, matplotlib" 2>/dev/null; then
        return 0
    fi
    echo ">> installing torch, accelerate, transformers, matplotlib into $venv (first run only)" >&2
    [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --upgrade pip || true
    if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
        "$venv/bin/pip" install --quiet --index-url "$TORCH_INDEX_URL" torch
    else
        "$venv/bin/pip" install --quiet torch
    fi
    "$venv/bin/pip" install --quiet accelerate transformers matplotlib
}

load1() { cut -d' ' -f1 /proc/loadavg; }

wait_for_quiet() {
    local max_load="$1" max_wait="$2" from
    from=$(date +%s)
    while awk -v l="$(load1)" -v m="$max_load" 'BEGIN { exit !(l >= m) }'; do
        if (( $(date +%s) - from >= max_wait )); then
            echo ">> load average still $(load1) after ${max_wait} s; running anyway (the load is recorded)" >&2
            break
        fi
        echo ">> waiting for the 1-minute load average ($(load1)) to drop below $max_load" >&2
        sleep 15
    done
    waited="waited $(( $(date +%s) - from )) s, load $(load1) at the start"
}

write_bench_meta() {
    local py="$1" out="$2" loads="$3" quiet="$4" task="$5"
    CPU="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')" CORES="$(nproc --all)" \
    RAM="$(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)" KERNEL="$(uname -r)" \
    DATE="$(date -u '+%Y-%m-%d %H:%M UTC')" RUSTC="$(rustc --version)" LOADS="$loads" QUIET="$quiet" \
    WAITED="${waited:-not waited}" VENV="$(dirname "$(dirname "$py")")" TASK="$task" \
    "$py" - "$out" <<'PY'
import importlib, json, os, sys
def version(name):
    try:
        return importlib.import_module(name).__version__
    except ImportError:
        return "not installed"
loads = [float(l) for l in open(os.environ["LOADS"]) if l.strip()]
meta = {k.lower(): os.environ[k] for k in ("CPU", "CORES", "RAM", "KERNEL", "DATE", "QUIET", "WAITED", "VENV", "TASK")}
meta["loads"] = loads
meta["versions"] = {"rustc": os.environ["RUSTC"], **{m: version(m) for m in ("torch", "accelerate", "transformers")}}
json.dump(meta, open(sys.argv[1], "w"), indent=1)
PY
}

run_and_keep() {
    local pattern="$1" label="$2"; shift 2
    load1 >> "$loads"
    echo ">> $label (load $(load1))" >&2
    local log="$out/${label// /_}.log"
    if "$@" > "$log" 2>&1; then
        local results
        results=$(grep -o "$pattern" "$log") || { echo "   no result line in $log" >&2; failed+=("$label"); return; }
        if [[ ${keep:-last} == all ]]; then printf '%s\n' "$results" >> "$runs"; else tail -1 <<< "$results" >> "$runs"; fi
    else
        echo "   FAILED (see $log)" >&2; failed+=("$label")
    fi
}

start_runs() {
    runs="$out/runs.jsonl"; loads="$out/loads.txt"; : > "$runs"; : > "$loads"
    failed=()
}

report_failed() {
    if (( ${#failed[@]} )); then
        printf '>> FAILED runs: %s\n' "${failed[@]}" >&2
        exit 1
    fi
}

models_from() {
    case "$1" in mlp) models=(mlp) ;; gpt) models=(gpt) ;; all) models=(mlp gpt) ;;
        *) echo "--model must be mlp, gpt or all, not $1" >&2; exit 2 ;; esac
}
