#!/usr/bin/env bash
# Before/after of a change, interleaved: builds the `levels` benchmark binary at REV (in a git worktree beside the
# checkout, sharing the target directory's dependencies) and at the working tree, then runs both, alternating run by
# run, for each level × model × process count; prints one JSON line per run (tagged "before"/"after") and a table of
# medians (samples/s) with the after/before ratio.
#
#   scripts/bench-ab.sh REV [--rounds 3] [--levels "ddp accel trainer"] [--models "mlp gpt"] [--nproc "1 2"]
#                           [--gpt-steps 60] [--epochs 3]
#
# No Python packages needed (it compares accel-rs with itself). LEVELS_BEFORE and LEVELS_AFTER name binaries built
# already, to skip the builds. Raw results: ${CARGO_TARGET_DIR:-target}/bench-ab/runs.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 1 && $1 != -* ]] || { sed -n '2,10p' "$0"; exit 2; }
rev="$1"; shift
rounds=3 levels="ddp accel trainer" models="mlp gpt" nprocs="1 2" gpt_steps=60 epochs=3
while [[ $# -gt 0 ]]; do
    case "$1" in
        --rounds) rounds="$2"; shift 2 ;;
        --levels) levels="$2"; shift 2 ;;
        --models) models="$2"; shift 2 ;;
        --nproc) nprocs="$2"; shift 2 ;;
        --gpt-steps) gpt_steps="$2"; shift 2 ;;
        --epochs) epochs="$2"; shift 2 ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
target="${CARGO_TARGET_DIR:-target}"
out="$target/bench-ab"; mkdir -p "$out"
wt="$out/worktree-$(git rev-parse --short "$rev")"
[[ -n ${LEVELS_BEFORE:-} || -d $wt ]] || git worktree add --detach "$wt" "$rev" >/dev/null
# One target directory for both builds (the dependencies are built once); each binary is copied out before the
# other build replaces target/debug/levels.
# LEVELS_BEFORE / LEVELS_AFTER: binaries built already (skips both builds).
abs_target="$(cd "$target" && pwd)"
if [[ -n ${LEVELS_BEFORE:-} && -n ${LEVELS_AFTER:-} ]]; then
    cp "$LEVELS_BEFORE" "$out/levels-before"; cp "$LEVELS_AFTER" "$out/levels-after"
else
    ( cd "$wt" && CARGO_TARGET_DIR="$abs_target" cargo build -q -p accel-benches --bin levels )
    cp "$abs_target/debug/levels" "$out/levels-before"
    cargo build -q -p accel-benches --bin levels
    cp "$abs_target/debug/levels" "$out/levels-after"
fi
runs="$out/runs.jsonl"; : > "$runs"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq "$rounds"); do
  for model in $models; do
    for level in $levels; do
      for np in $nprocs; do
        extra=(--epochs "$epochs"); [[ $model == gpt ]] && extra=(--steps "$gpt_steps")
        for which in before after; do
          line=$("$out/levels-$which" --model "$model" --level "$level" --nproc "$np" "${extra[@]}" 2>/dev/null | grep -o '{"batch.*}' | tail -1 || true)
          [[ -n $line ]] || { echo "no result from $which $model $level $np" >&2; continue; }
          echo "{\"build\":\"$which\",\"round\":$round,\"load\":$(cut -d' ' -f1 /proc/loadavg),\"run\":$line}" | tee -a "$runs"
        done
      done
    done
  done
done
python3 - "$runs" <<'PY'
# Medians per build, and the median of the per-round ratios (each after-run against the before-run just before
# it: the pair shares the VM's state, which drifts by tens of % over a session).
import json, statistics, sys, collections
rows = collections.defaultdict(dict)
for l in open(sys.argv[1]):
    r = json.loads(l); run = r["run"]
    key = (run.get("model"), run.get("level"), run.get("nproc"))
    rows[key].setdefault(r["build"], {})[r["round"]] = run.get("samples_per_s") or run.get("tokens_per_s")
print("| model | level | processes | before (median/s) | after (median/s) | per-round after / before | median |")
print("|---|---|---:|---:|---:|---|---:|")
for key in sorted(rows):
    b, a = rows[key].get("before", {}), rows[key].get("after", {})
    pairs = [a[r] / b[r] for r in sorted(a) if r in b]
    if not pairs:
        continue
    each = " ".join(f"{x:.2f}" for x in pairs)
    print(f"| {key[0]} | {key[1]} | {key[2]} | {statistics.median(b.values()):,.0f} | "
          f"{statistics.median(a.values()):,.0f} | {each} | {statistics.median(pairs):.3f} |")
PY
