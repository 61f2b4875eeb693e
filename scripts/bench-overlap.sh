#!/usr/bin/env bash
# Communication overlapped with the backward pass: 2-process vs 1-process throughput of the levels benchmark's
# tasks (benches/src/bin/levels.rs) with the gradient all-reduce after the backward pass (`--overlap off`) and
# overlapped with it (`--overlap on`: the forward recorded, DistributedDataParallel::backward /
# Accelerator::backward_segments with DdpOptions::overlap On), at the ddp and accel levels (and the Trainer with its
# default, Auto), for the
# MLP and the char-GPT; runs interleaved, medians of --repeat. Each round also starts two 1-process runs of each
# level side by side, with no communication between them: what this machine gives two processes at all (the
# ceiling any 2-process scaling is measured against). Writes the section between <!-- overlap:begin/end -->
# of docs/benchmarks.md. Needs no PyTorch.
#
#   scripts/bench-overlap.sh [--repeat 3] [--epochs 2] [--gpt-steps 100] [--model mlp|gpt|all] [--max-load 0.5]
#                            [--max-wait 900] [--no-report]
set -euo pipefail
cd "$(dirname "$0")/.."

repeat=3 epochs=2 gpt_steps=100 model=all max_load=0.5 max_wait=900 report=1
source scripts/bench-common.sh
parse_bench_args 2,13 --repeat=repeat --epochs=epochs --gpt-steps=gpt_steps --model=model --max-load=max_load \
    --max-wait=max_wait --no-report=report:0 -- "$@"

bench_dirs bench-overlap
models_from "$model"

levels_bin=$(build_bench levels)
wait_for_quiet "$max_load" "$max_wait"

start_runs
run_one() { run_and_keep '{.*"framework".*}' "$@"; }
# `side_by_side CMD...`: CMD twice at once (both outputs in the log); fails if either fails. An interrupt stops
# the background run too (a non-interactive shell's background jobs ignore SIGINT).
side_by_side() {
    local rc=0 pid
    "$@" & pid=$!
    trap 'kill "$pid" 2>/dev/null; exit 130' INT TERM
    "$@" || rc=1
    wait "$pid" || rc=1
    trap - INT TERM
    return $rc
}
for i in $(seq "$repeat"); do
    for m in "${models[@]}"; do
        if [[ $m == mlp ]]; then work=(--epochs "$epochs"); else work=(--steps "$gpt_steps"); fi
        for level in ddp accel trainer; do
            run_one "$i $m $level 1p" "$levels_bin" --model "$m" --level "$level" --nproc 1 "${work[@]}"
            keep=all run_one "$i $m $level 1p side by side" side_by_side "$levels_bin" --model "$m" \
                --level "$level" --nproc 1 --tag "side-by-side $i" "${work[@]}"
            if [[ $level == trainer ]]; then
                run_one "$i $m $level 2p" "$levels_bin" --model "$m" --level "$level" --nproc 2 "${work[@]}"
                continue
            fi
            # Alternate which variant goes first, so a drift in load hits both alike.
            for ov in $( (( i % 2 )) && echo "on off" || echo "off on"); do
                run_one "$i $m $level 2p overlap=$ov" "$levels_bin" --model "$m" --level "$level" --nproc 2 \
                    --overlap "$ov" "${work[@]}"
            done
        done
    done
done

meta="$out/meta.json"
write_bench_meta python3 "$meta" "$loads" "$max_load" "levels benchmark tasks (MLP 784-512-512-10, batch 64 per \
process, ${epochs} epochs; char-GPT, 16 sequences per process, ${gpt_steps} steps), 1 thread per process; medians of \
${repeat} interleaved runs."
if (( report )); then
    python3 scripts/torch_ref/report.py overlap --results "$runs" --meta "$meta"
fi
report_failed
