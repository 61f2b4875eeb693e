#!/usr/bin/env bash
# The levels benchmark: accel-rs (plain candle loop, ddp-core, Accelerator, Trainer) against PyTorch (plain loop,
# DDP under torchrun + gloo, Accelerate cpu=True, HF Trainer use_cpu=True) on the same task, at 1 and 2
# processes, interleaved, medians of --repeat runs; writes docs/benchmarks/levels.json, the charts
# docs/benchmarks/levels-{mlp,gpt}.{svg,png} and the section between <!-- levels:begin/end --> of
# docs/benchmarks.md.
#
#   scripts/bench-levels.sh [--model mlp|gpt|all] [--repeat 3] [--epochs 3] [--gpt-steps 100] [--threads 1]
#                           [--nproc "1 2"] [--max-load 0.5] [--max-wait 900] [--no-report]
#
# Python (torch, accelerate, transformers, matplotlib from PyPI) goes into ${BENCH_VENV:-${CARGO_TARGET_DIR:-target}/bench-venv}
# the first time, only when this script runs — never in CI. TORCH_INDEX_URL installs torch from another index
# (e.g. https://download.pytorch.org/whl/cpu). Before starting, the script waits (up to --max-wait s) until the
# 1-minute load average is below --max-load, and records the load before every run. Raw results:
# ${CARGO_TARGET_DIR:-target}/bench-levels/runs.jsonl (one JSON line per run), logs next to it.
set -euo pipefail
cd "$(dirname "$0")/.."

model=all repeat=3 epochs=3 gpt_steps=100 threads=1 nprocs="1 2" max_load=0.5 max_wait=900 report=1
source scripts/bench-common.sh
parse_bench_args 2,16 --model=model --repeat=repeat --epochs=epochs --gpt-steps=gpt_steps --threads=threads \
    --nproc=nprocs --max-load=max_load --max-wait=max_wait --no-report=report:0 -- "$@"

bench_dirs bench-levels

# --- the venv (only here, never in CI) ------------------------------------------------------------------------
models_from "$model"
ensure_bench_venv "$venv"

# --- the Rust side: the dev profile, as the README builds -----------------------------------------------------
levels_bin=$(build_bench levels)

# --- wait for a quiet machine ---------------------------------------------------------------------------------
wait_for_quiet "$max_load" "$max_wait"

# --- the runs, interleaved ------------------------------------------------------------------------------------
start_runs
export OMP_NUM_THREADS="$threads"
# One run: $1 = label, the rest = the command. Keeps the JSON line (the launcher prefixes "[rank 0] ").
# LEVELS_T0_NS: when the run was started, for the programs' wall time (start-up and imports included).
# (Exported, not `env VAR=..`: the commands include the shell functions torch_py and torchrun.)
run_one() { export LEVELS_T0_NS; LEVELS_T0_NS="$(date +%s%N)"; run_and_keep '{.*"framework".*}' "$@"; }
torchrun() { "$py" -m torch.distributed.run --standalone --nproc_per_node "$1" "${@:2}"; }
# `torch_py N LEVEL args...`: a PyTorch level at N processes — torchrun for N > 1, the bare interpreter for 1 (the
# accel-rs side also trains in the process itself at 1). DDP always runs under torchrun (it needs a process group).
torch_py() {
    if [[ $1 == 1 ]]; then "$py" scripts/torch_ref/levels.py --level "$2" "${@:3}"
    else torchrun "$1" scripts/torch_ref/levels.py --level "$2" "${@:3}"; fi
}

for i in $(seq "$repeat"); do
    for m in "${models[@]}"; do
        if [[ $m == mlp ]]; then work=(--epochs "$epochs"); else work=(--steps "$gpt_steps"); fi
        common=(--model "$m" --threads "$threads" "${work[@]}")
        for n in $nprocs; do
            for tier in plain ddp accel trainer; do
                [[ $tier == plain && $n != 1 ]] && continue
                case $tier in
                    plain) ours=candle; theirs=(torch_py "$n" torch) ;;
                    ddp) ours=ddp; theirs=(torchrun "$n" scripts/torch_ref/levels.py --level ddp) ;;
                    accel) ours=accel; theirs=(torch_py "$n" accelerate) ;;
                    trainer) ours=trainer; theirs=(torch_py "$n" trainer) ;;
                esac
                ours_cmd=("$levels_bin" --level "$ours" --nproc "$n" "${common[@]}")
                # Alternate which framework goes first, so a drift in load hits both alike.
                if (( (i + n) % 2 == 0 )); then
                    run_one "$i accel-rs $m $ours ${n}p" "${ours_cmd[@]}"
                    run_one "$i pytorch $m $tier ${n}p" "${theirs[@]}" "${common[@]}"
                else
                    run_one "$i pytorch $m $tier ${n}p" "${theirs[@]}" "${common[@]}"
                    run_one "$i accel-rs $m $ours ${n}p" "${ours_cmd[@]}"
                fi
            done
        done
    done
done


# --- metadata and the report ----------------------------------------------------------------------------------
meta="$out/meta.json"
write_bench_meta "$py" "$meta" "$loads" "$max_load" "MLP 784-512-512-10 on the 10k MNIST training images, \
${epochs} epochs, batch 64 per process; char-GPT (d_model 128, 4 heads, 4 layers, context 64, d_ff 512) on \
Shakespeare, ${gpt_steps} steps of 16 sequences per process; AdamW lr 1e-3; ${threads} thread(s) per process; \
medians of ${repeat} interleaved runs."
echo ">> results: $runs" >&2
if (( report )); then
    "$py" scripts/torch_ref/report.py levels --results "$runs" --meta "$meta"
fi
report_failed
