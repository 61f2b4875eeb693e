#!/usr/bin/env bash
# Compile-checks the CUDA build on a machine without a GPU, so CUDA code cannot rot:
#   cargo check -p ddp-core --features cuda,nccl --all-targets     (candle CUDA tensors + NCCL backend)
#   cargo check -p accel-examples --features cuda --bin gpu_check  (the GPU machine check)
# candle's `cuda` feature runs nvcc in build scripts (candle-kernels compiles its kernels to PTX and a static
# library), so this installs nvcc from PyPI's CUDA 13.0 wheels into a venv under the target folder. The wheels
# are pinned to 13.0 because the GPU machine runs driver 580 (CUDA 13.0): newer PTX would not load there. Kernels
# target compute capability 9.0 (H100/H200), override with CUDA_COMPUTE_CAP.
#
#   scripts/check-cuda-build.sh                    compile check only (no CUDA libraries needed)
#   scripts/check-cuda-build.sh --build-gpu-check  also link the gpu_check binary into
#                                                  target/gpu-check/ (downloads the CUDA 13.0 cuBLAS/cuRAND/
#                                                  NVRTC/NCCL wheels to link against; see scripts/gpu-check.sh)
#
# It uses its own cargo target folder (target/cuda-check, or $CUDA_CHECK_TARGET_DIR) so its long build does not
# hold the shared target folder's lock. First run on the 2-core dev machine: see docs/gpu-and-clusters.md.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build_gpu_check=0
[ "${1:-}" = "--build-gpu-check" ] && build_gpu_check=1

base_target=${CARGO_TARGET_DIR:-$root/target}
export CARGO_TARGET_DIR=${CUDA_CHECK_TARGET_DIR:-$base_target/cuda-check}
venv=$base_target/cuda-venv
start=$(date +%s)
step() { printf '\n=== %s (t+%ss)\n' "$*" "$(( $(date +%s) - start ))"; }

# --- nvcc 13.0 from PyPI -------------------------------------------------------------------------------------
# nvidia-cuda-nvcc does not pin its companions: crt (headers) and nvvm (cicc) must be pinned to the same 13.0.
nvcc_pins=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
           nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85)
# Only for linking gpu_check (the GPU machine brings its own copies at run time).
link_pins=(nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-cuda-nvrtc==13.0.88 nvidia-nccl-cu13==2.27.7)

step "nvcc 13.0 in $venv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pins=("${nvcc_pins[@]}")
[ $build_gpu_check = 1 ] && pins+=("${link_pins[@]}")
if ! "$venv/bin/pip" install -q --disable-pip-version-check "${pins[@]}"; then
  echo "pip could not install ${pins[*]} (needs PyPI)" >&2
  exit 1
fi
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cuda=$site/nvidia/cu13
[ -x "$cuda/bin/nvcc" ] || { echo "no nvcc in $cuda/bin after installing ${nvcc_pins[0]}" >&2; exit 1; }
export PATH="$cuda/bin:$PATH"
export CUDA_HOME="$cuda" CUDA_PATH="$cuda" CUDA_ROOT="$cuda"
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
# cudarc takes its CUDA version from this nvcc (13.0) for candle and ddp-core alike. Never set
# CUDARC_CUDA_VERSION here: it would add a second version next to the detected one and break cudarc's build.
unset CUDARC_CUDA_VERSION
# Two cores: let cudaforge (candle-kernels' build) run two nvcc at a time.
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-2}
nvcc --version | tail -2

step "cargo check -p ddp-core --features cuda,nccl --all-targets"
cargo check -p ddp-core --features cuda,nccl --all-targets

step "cargo check -p accel-examples --features cuda --bin gpu_check"
cargo check -p accel-examples --features cuda --bin gpu_check

if [ $build_gpu_check = 1 ]; then
  step "link the gpu_check binary"
  # The linker needs unversioned names (libcublas.so, ...): the wheels ship only the versioned runtime files.
  link=$base_target/cuda-link
  rm -rf "$link" && mkdir -p "$link"
  for lib in cublas cublasLt curand nvrtc cudart nccl; do
    f=$(find "$site/nvidia" -name "lib$lib.so.*" | sort | head -n1)
    [ -n "$f" ] || { echo "lib$lib.so.* not found under $site/nvidia" >&2; exit 1; }
    ln -sf "$f" "$link/lib$lib.so"
  done
  # libcuda comes with the driver, which a GPU-less machine lacks: link against a stub with the driver's
  # soname (libcuda.so.1) that defines every cu* function cudarc declares. At run time the real driver
  # library is loaded by that soname and provides them.
  sys=$(find "$HOME/.cargo/registry/src" -path '*cudarc-0.19.10/src/driver/sys/mod.rs' | head -n1)
  grep -oE 'fn cu[A-Za-z0-9_]+\(' "$sys" | sed -E 's/fn (cu[A-Za-z0-9_]+)\(/\1/' | sort -u \
    | awk '{print "void " $1 "(void) {}"}' > "$link/cuda_stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link/libcuda.so" "$link/cuda_stub.c"
  export LIBRARY_PATH="$link${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export RUSTFLAGS="${RUSTFLAGS:-} -L native=$link"
  # The dev profile optimises every dependency (opt-level 3; our crates 1) and reuses the kernels nvcc compiled
  # for the checks above; a release build would compile them all again (~10 min on 2 cores).
  cargo build -p accel-examples --features cuda --bin gpu_check
  out=$root/target/gpu-check
  mkdir -p "$out"
  cp "$CARGO_TARGET_DIR/debug/gpu_check" "$out/gpu_check"
  strip --strip-debug "$out/gpu_check" 2>/dev/null || true
  echo "needs at run time (scripts/gpu-check.sh finds them):"
  readelf -d "$out/gpu_check" | awk '/NEEDED/ {print "  " $5}' | tr -d '[]'
  ls -la "$out/gpu_check"
fi
step "CUDA build check passed"
