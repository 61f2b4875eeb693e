#!/usr/bin/env bash
# bf16 against fp32 on the CPU, accel-rs beside PyTorch: the Accelerator level of the levels benchmark
# (benches/src/bin/levels.rs --level accel) and Accelerate's (scripts/torch_ref/levels.py --level accelerate), each
# with ACCELERATE_MIXED_PRECISION=no and =bf16 (accel-rs: autocast over f32 tensors, accel::ops::autocast; PyTorch:
# Accelerate's torch.autocast("cpu", dtype=torch.bfloat16)), for the MNIST MLP 784-256-10 at batch 64 (the README's
# accel_mnist) and the char-GPT at 16 sequences, one process, --threads threads; the four programs alternate, and
# each row of the table is the median over --repeat runs of each run's median step. Prints the table (markdown) with
# the machine, its CPU flags and the load; docs/benchmarks.md ("bf16 on the CPU") quotes it.
#
#   scripts/bench-bf16.sh [--repeat 3] [--epochs 3] [--steps 100] [--threads "1"] [--model mlp|gpt|all]
#                         [--max-load 0.5] [--max-wait 600]
#
# Python (torch, accelerate from PyPI) goes into ${BENCH_VENV:-${CARGO_TARGET_DIR:-target}/bench-venv} the first
# time, only when this script runs — never in CI. Raw results: ${CARGO_TARGET_DIR:-target}/bench-bf16/runs.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."

repeat=3 epochs=3 steps=100 threads_list="1" model=all max_load=0.5 max_wait=600
source scripts/bench-common.sh
parse_bench_args 2,14 --repeat=repeat --epochs=epochs --steps=steps --threads=threads_list --model=model \
    --max-load=max_load --max-wait=max_wait -- "$@"

bench_dirs bench-bf16
models_from "$model"
ensure_bench_venv "$venv"
levels_bin=$(build_bench levels)

wait_for_quiet "$max_load" "$max_wait"
start_runs
load_start=$(load1)
for i in $(seq "$repeat"); do
    for m in "${models[@]}"; do
        size=(--epochs "$epochs" --hidden 256)
        [[ $m == gpt ]] && size=(--steps "$steps")
        for t in $threads_list; do
            for mp in no bf16; do
                ours=(env ACCELERATE_MIXED_PRECISION="$mp" "$levels_bin" --model "$m" --level accel --threads "$t"
                      "${size[@]}" --tag "$mp")
                theirs=(env ACCELERATE_MIXED_PRECISION="$mp" "$py" scripts/torch_ref/levels.py --model "$m"
                        --level accelerate --threads "$t" "${size[@]}" --tag "$mp")
                # Alternate which framework goes first, so a drift in load hits both alike.
                if (( i % 2 )); then
                    run_and_keep '^{.*"step_ms".*}' "$i accel-rs $m $mp ${t}t" "${ours[@]}"
                    run_and_keep '^{.*"step_ms".*}' "$i pytorch $m $mp ${t}t" "${theirs[@]}"
                else
                    run_and_keep '^{.*"step_ms".*}' "$i pytorch $m $mp ${t}t" "${theirs[@]}"
                    run_and_keep '^{.*"step_ms".*}' "$i accel-rs $m $mp ${t}t" "${ours[@]}"
                fi
            done
        done
    done
done

CPU="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')" \
FLAGS="$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|avx512f|avx512bw|avx512vl|avx512_bf16|avx512_fp16|amx_bf16)$' | tr '\n' ' ')" \
CORES="$(nproc --all)" DATE="$(date -u '+%Y-%m-%d %H:%M UTC')" LOAD_START="$load_start" LOAD_END="$(load1)" \
LOADS="$loads" WAITED="$waited" "$py" - "$runs" <<'PY'
import collections, json, os, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
step = collections.defaultdict(list)
quality = collections.defaultdict(list)
for r in runs:
    key = (r["model"], r["threads"], r["framework"], r["tag"])
    step[key].append(r["step_ms"])
    quality[key].append(r.get("test_accuracy", r.get("val_loss")))
loads = [float(l) for l in open(os.environ["LOADS"]) if l.strip()]
print(f"Machine: {os.environ['CPU']}, {os.environ['CORES']} cores; CPU flags: {os.environ['FLAGS'].strip()}. "
      f"Date: {os.environ['DATE']}. 1-minute load average before each run {min(loads):.2f}–{max(loads):.2f} "
      f"(median {statistics.median(loads):.2f}); {os.environ['WAITED']}, {os.environ['LOAD_END']} at the end.\n")
print("| model | threads | implementation | fp32 step ms | bf16 step ms | **bf16 / fp32** | fp32 / bf16 quality | runs |")
print("|---|---|---|---:|---:|---:|---|---|")
for (m, t, fw) in sorted({k[:3] for k in step}):
    f32, bf = step[(m, t, fw, "no")], step[(m, t, fw, "bf16")]
    q = lambda v: f"{v[0]:.5f}"
    name = "accel-rs (Accelerator)" if fw == "accel-rs" else "PyTorch (Accelerate)"
    a, b = statistics.median(f32), statistics.median(bf)
    print(f"| {m} | {t} | {name} | {a:.3f} | {b:.3f} | **{b / a:.2f}×** | "
          f"{q(quality[(m, t, fw, 'no')])} / {q(quality[(m, t, fw, 'bf16')])} | {len(f32)} + {len(bf)} |")
print("\nQuality: the MLP's test accuracy on t10k, the char-GPT's validation loss (first run of each).")
PY
report_failed
