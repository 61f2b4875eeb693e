#!/usr/bin/env bash
# What a checkpoint costs the training loop, written in place or in the background (async_checkpointing):
# benches/src/bin/checkpoint_save.rs in one process — a 25.2 M-parameter stack of linear layers with AdamW, a save
# every 10 of 40 steps — in the modes sync, async and none (no checkpoint), interleaved, --repeat runs each; prints
# the medians per mode of the time save_state blocks the loop, the step right after a save, the other steps and the
# whole run, with the machine and the load.
#
#   scripts/bench-checkpoint.sh [--repeat 3] [--max-load 0.5] [--max-wait 600]
set -euo pipefail
cd "$(dirname "$0")/.."

repeat=3 max_load=0.5 max_wait=600
source scripts/bench-common.sh
parse_bench_args 2,7 --repeat=repeat --max-load=max_load --max-wait=max_wait -- "$@"
bench_dirs bench-checkpoint
bin=$(build_bench checkpoint_save)
wait_for_quiet "$max_load" "$max_wait"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc --all) cores; $waited"
: > "$out/runs.txt"
for ((i = 1; i <= repeat; i++)); do
    for mode in sync async none; do
        "$bin" --mode "$mode" --dir "$out/checkpoints" | tee -a "$out/runs.txt"
    done
done
# Medians per mode of each figure.
python3 - "$out/runs.txt" <<'PY'
import re, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    mode, rest = line.split(":", 1)
    for name, value in re.findall(r"(\w+_(?:ms|s)) (\S+?)(?:,|$)", rest.strip()):
        runs.setdefault(mode, {}).setdefault(name, []).append(float(value))
for mode, figures in runs.items():
    print(f"{mode} (medians of {len(next(iter(figures.values())))}): " + ", ".join(
        f"{name} {statistics.median(values):.1f}" for name, values in figures.items()))
PY
