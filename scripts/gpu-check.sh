#!/usr/bin/env bash
# Runs the prebuilt GPU check on a GPU machine with no Rust toolchain and no network (e.g. one NVIDIA H200,
# driver 580 / CUDA 13.0, PyTorch 2.11 with its NCCL and CUDA libraries in site-packages).
#
# Build the binary first on the dev machine:  scripts/check-cuda-build.sh --build-gpu-check
# (it lands in target/gpu-check/gpu_check; carry that folder and data/mnist to the GPU machine), then here:
#   scripts/gpu-check.sh [gpu_check args, e.g. --epochs 2 | --skip-training]
#
# The binary links the CUDA libraries dynamically (candle's cudarc `dynamic-linking`): libcuda.so.1 (driver),
# libnccl.so.2, libcublas.so.13, libcublasLt.so.13, libcurand.so.10, libnvrtc.so.13, libcudart.so.13. This script
# finds each in the usual places (PyTorch's nvidia-* wheels in site-packages, torch/lib, /usr/local/cuda*),
# links them into one folder put first on LD_LIBRARY_PATH, names whatever is still missing, then runs the check:
# NCCL collectives on a world-size-1 communicator, the conformance suite, MNIST training on CUDA in f32 and bf16
# compared with the CPU, and a table. The output is also saved to target/gpu-check/gpu-check-output.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${GPU_CHECK_BIN:-target/gpu-check/gpu_check}
[ -x "$bin" ] || { echo "no $bin: build it with scripts/check-cuda-build.sh --build-gpu-check and copy target/gpu-check here" >&2; exit 1; }

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>/dev/null \
  || echo "nvidia-smi not available"

# Candidate library folders, most specific first.
dirs=()
for py in python3 python; do
  command -v "$py" >/dev/null 2>&1 || continue
  while IFS= read -r d; do [ -d "$d" ] && dirs+=("$d"); done < <("$py" - <<'PY' 2>/dev/null || true
import glob, os, site, sys
roots = set(site.getsitepackages() + [site.getusersitepackages()] + [p for p in sys.path if p.endswith("-packages")])
for r in sorted(roots):
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))) + [os.path.join(r, "torch", "lib")]:
        print(d)
PY
)
  break
done
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib64 \
         /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/nvidia/lib64; do
  [ -d "$d" ] && dirs+=("$d")
done

links=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-libs.XXXXXX")
trap 'rm -rf "$links"' EXIT
export LD_LIBRARY_PATH="$links${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Link every library the loader cannot find (ldd also lists the dependencies of dependencies, e.g.
# libcublasLt.so.13 behind libcublas.so.13), a few rounds until nothing more can be found.
for _ in 1 2 3 4; do
  missing=$(ldd "$bin" | awk '/not found/ {print $1}' | sort -u)
  found_any=0
  for soname in $missing; do
    for d in "${dirs[@]}"; do
      if [ -e "$d/$soname" ]; then ln -sf "$d/$soname" "$links/$soname"; found_any=1; break; fi
    done
  done
  [ $found_any = 1 ] || break
done
# cudarc also tries the unversioned name for NCCL; PyTorch's wheel has only libnccl.so.2.
nccl2=$(ldd "$bin" | awk '$1 == "libnccl.so.2" {print $3}')
[ -n "$nccl2" ] && [ -e "$nccl2" ] && ln -sf "$(readlink -f "$nccl2")" "$links/libnccl.so"

echo "== libraries"
missing=$(ldd "$bin" | awk '/not found/ {print $1}')
ldd "$bin" | grep -E 'cuda|nccl|cublas|curand|nvrtc|cudart' || true
if [ -n "$missing" ]; then
  echo "missing: $missing" >&2
  case "$missing" in *libcuda.so*) echo "libcuda.so.1 comes with the NVIDIA driver: is it installed (nvidia-smi)?" >&2 ;; esac
  echo "searched: ${dirs[*]}" >&2
  echo "The binary was linked against CUDA 13.0 libraries (sonames .so.13 / libcurand.so.10 / libnccl.so.2)." >&2
  echo "Install PyTorch's CUDA 13 wheels (nvidia-cublas, nvidia-curand, nvidia-cuda-nvrtc, nvidia-cuda-runtime," >&2
  echo "nvidia-nccl-cu13) or a CUDA 13 toolkit, or point LD_LIBRARY_PATH at a folder holding these files." >&2
  exit 2
fi

echo "== gpu_check"
mkdir -p target/gpu-check
data=${GPU_CHECK_DATA:-data/mnist}
set +e
"$bin" --data-dir "$data" "$@" 2>&1 | tee target/gpu-check/gpu-check-output.txt
rc=${PIPESTATUS[0]}
exit "$rc"
