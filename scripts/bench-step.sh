#!/usr/bin/env bash
# One training step in one process, accel-rs against PyTorch: benches/src/bin/step_time.rs (--ops fused: the fused ops
# of accel_nn::ops; then --ops candle: candle's own ops, in a process of its own, so that its 3x slower steps do not
# disturb the caches and the allocator of the fused run, as they did interleaved step by step) and
# scripts/torch_ref/step.py, for the MLP at batch 128 and the char-GPT at 16 sequences, at 1 and 2 threads, the
# programs alternating (at 2 threads the fused ops once more with CANDLE_NUM_THREADS=1, candle's own elementwise
# pool off); medians of --repeat runs.
# Writes the section between <!-- step:begin/end --> of docs/benchmarks.md.
#
#   scripts/bench-step.sh [--repeat 3] [--steps 200] [--warmup 20] [--threads "1 2"] [--model mlp|gpt|all]
#                         [--max-load 0.5] [--max-wait 900] [--no-report]
#
# Python (torch, accelerate, transformers, matplotlib from PyPI) goes into ${BENCH_VENV:-${CARGO_TARGET_DIR:-target}/bench-venv}
# the first time, only when this script runs — never in CI. Raw results: ${CARGO_TARGET_DIR:-target}/bench-step/runs.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."

repeat=3 steps=200 warmup=20 threads_list="1 2" model=all max_load=0.5 max_wait=900 report=1
source scripts/bench-common.sh
parse_bench_args 2,12 --repeat=repeat --steps=steps --warmup=warmup --threads=threads_list --model=model \
    --max-load=max_load --max-wait=max_wait --no-report=report:0 -- "$@"

bench_dirs bench-step

models_from "$model"
ensure_bench_venv "$venv"

step_bin=$(build_bench step_time)

wait_for_quiet "$max_load" "$max_wait"

start_runs
keep=all # step_time prints one line per variant it runs
run_one() { run_and_keep '^{.*"impl".*}' "$@"; }

for i in $(seq "$repeat"); do
    for m in "${models[@]}"; do
        batch=$([[ $m == mlp ]] && echo 128 || echo 16)
        for t in $threads_list; do
            ours=(env -u CANDLE_NUM_THREADS RAYON_NUM_THREADS="$t" "$step_bin" --model "$m" --batch "$batch" --ops fused
                  --steps "$steps" --warmup "$warmup" --json)
            ours_candle=(env -u CANDLE_NUM_THREADS RAYON_NUM_THREADS="$t" "$step_bin" --model "$m" --batch "$batch"
                         --ops candle --steps "$steps" --warmup "$warmup" --json)
            # At more than one thread, also with candle's own elementwise pool off (what the launcher sets).
            ours_c1=(env CANDLE_NUM_THREADS=1 RAYON_NUM_THREADS="$t" "$step_bin" --model "$m" --batch "$batch" --ops fused
                     --steps "$steps" --warmup "$warmup" --json)
            theirs=(env OMP_NUM_THREADS="$t" "$py" scripts/torch_ref/step.py --model "$m" --batch "$batch" --threads "$t"
                    --steps "$steps" --warmup "$warmup" --json)
            # Alternate which framework goes first, so a drift in load hits both alike.
            if (( (i + t) % 2 == 0 )); then
                run_one "$i accel-rs $m ${t}t" "${ours[@]}"; run_one "$i pytorch $m ${t}t" "${theirs[@]}"
            else
                run_one "$i pytorch $m ${t}t" "${theirs[@]}"; run_one "$i accel-rs $m ${t}t" "${ours[@]}"
            fi
            if (( t > 1 )); then run_one "$i accel-rs CANDLE_NUM_THREADS=1 $m ${t}t" "${ours_c1[@]}"; fi
            run_one "$i accel-rs candle-ops $m ${t}t" "${ours_candle[@]}"
        done
    done
done

meta="$out/meta.json"
write_bench_meta "$py" "$meta" "$loads" "$max_load" "One training step (forward + loss, backward, AdamW) in one \
process: MLP 784-512-512-10 at batch 128, char-GPT (d_model 128, 4 heads, 4 layers, context 64, d_ff 512) at 16 \
sequences; ${steps} timed steps after ${warmup} warm-up steps per run; medians of ${repeat} alternating runs."
echo ">> results: $runs" >&2
if (( report )); then
    "$py" scripts/torch_ref/report.py step --results "$runs" --meta "$meta"
fi
report_failed
