#!/usr/bin/env bash
# Side-by-side all-reduce bandwidth: ddp-core's CPU backend vs PyTorch gloo, same sizes, same method.
#
#   scripts/bench-allreduce.sh [--nproc 2] [--pin] [extra allreduce_bw / gloo flags...]
#
# Installs torch (CPU build) into a venv under target/bench-venv the first time it runs — only when run,
# never in CI. TORCH_SPEC overrides the pip requirement (default "torch"); TORCH_INDEX_URL an index
# (e.g. https://download.pytorch.org/whl/cpu to skip the CUDA wheels). Prints both tables and, per size,
# ours/gloo busbw ratio. Results also land in target/bench-allreduce/{ddp,gloo}.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
venv="$target/bench-venv"
out="$target/bench-allreduce"
mkdir -p "$out"

if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo ">> installing torch into $venv (first run only)" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --upgrade pip || true
    if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
        "$venv/bin/pip" install --quiet --index-url "$TORCH_INDEX_URL" "${TORCH_SPEC:-torch}"
    elif ! "$venv/bin/pip" install --quiet "${TORCH_SPEC:-torch}"; then
        # The PyPI wheel pulls large nvidia-* packages; gloo needs none of them.
        echo ">> full install failed; trying torch --no-deps plus its pure-Python dependencies" >&2
        "$venv/bin/pip" install --quiet --no-deps "${TORCH_SPEC:-torch}"
        "$venv/bin/pip" install --quiet filelock typing-extensions sympy networkx jinja2 fsspec numpy
    fi
fi

echo ">> building allreduce_bw (release)" >&2
cargo build --quiet --release -p accel-benches --bin allreduce_bw

echo ">> ddp-core CPU backend" >&2
"$target/release/allreduce_bw" "$@" | sed -u 's/^\[rank 0\] //' | tee "$out/ddp.txt"
echo ">> PyTorch gloo" >&2
"$venv/bin/python" scripts/bench_allreduce_gloo.py "$@" | tee "$out/gloo.txt"

echo
echo "# busbw ratio ddp-core / gloo (same sizes)"
printf "# %10s %14s %14s %8s\n" size "ddp-core GB/s" "gloo GB/s" ratio
join -j1 -t$'\t' \
    <(grep -v '^#' "$out/ddp.txt" | awk '{printf "%s %s\t%s\t%s\n", $1, $2, $8, $6}' | sort -t$'\t' -k1,1) \
    <(grep -v '^#' "$out/gloo.txt" | awk '{printf "%s %s\t%s\t%s\n", $1, $2, $8, $6}' | sort -t$'\t' -k1,1) \
    | awk -F'\t' '{ split($1, s, " "); bytes = s[1] * (s[2] == "KiB" ? 1024 : s[2] == "MiB" ? 1048576 : s[2] == "GiB" ? 1073741824 : 1);
                    printf "%d\t  %10s %14.3f %14.3f %8.2f   (time %s us vs %s us)\n", bytes, $1, $2, $4, ($4 > 0 ? $2 / $4 : 0), $3, $5 }' \
    | sort -n | cut -f2-
