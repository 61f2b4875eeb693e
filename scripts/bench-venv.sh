# Sourced by the PyTorch comparison scripts (bench-levels.sh, bench-step.sh): `ensure_bench_venv DIR` creates the
# venv DIR with torch, accelerate, transformers and matplotlib from PyPI unless they import already. Only these
# scripts call it — never CI. TORCH_INDEX_URL: install torch from that index instead (e.g. the CPU wheels,
# https://download.pytorch.org/whl/cpu).
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
