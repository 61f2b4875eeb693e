#!/usr/bin/env bash
# The MPI backend in CI (called by .ci/run): installs Open MPI and what rsmpi's build needs (Debian packages
# libopenmpi-dev openmpi-bin clang libclang-dev), then runs ddp-core's tests with `--features mpi,nccl`:
#   - tests/conformance_mpi.rs: the shared collective conformance suite under `mpirun -np 2`, `-np 3` and `-np 4`
#     (it starts mpirun itself, with --allow-run-as-root --oversubscribe as CI runs as root on 2 cores), the
#     init_from_env path (ACCEL_BACKEND=mpi) and the watchdog aborting a job with a stuck rank;
#   - the nccl_unavailable tests of the suite binary + the nccl/mpi unit tests: without a GPU, NCCL is a clean
#     error, never a panic.
# One build with both features saves a second compile of ddp-core. Measured on the 2-core dev machine: apt install
# ≈ 40 s (first time), rsmpi's build (bindgen + mpi-sys + mpi) ≈ 60 s of the first compile, the tests ≈ 25 s.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
command -v mpicc >/dev/null 2>&1 || need+=(libopenmpi-dev)
command -v clang >/dev/null 2>&1 || need+=(clang)
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || need+=(libclang-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]}"
  if [ "$(id -u)" -eq 0 ]; then SUDO=(); else SUDO=(sudo); fi
  "${SUDO[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends \
    libopenmpi-dev openmpi-bin clang libclang-dev >/dev/null
fi
mpirun --version | head -1
echo "MPI toolchain ready after $(( $(date +%s) - start )) s"

# Open MPI refuses root without these (the test also passes --allow-run-as-root), and warns about missing
# high-speed networks in containers: keep the log readable.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_base_warn_component_unused=0 OMPI_MCA_btl="^openib"

cargo test -p ddp-core --features mpi,nccl --lib -- mpi:: nccl::
cargo test -p ddp-core --features mpi,nccl --test suite -- nccl_unavailable::
# Harness-less: it runs mpirun -np 2/3/4 itself and ends with its own `test result:` line.
cargo test -p ddp-core --features mpi,nccl --test conformance_mpi
echo "ci-mpi.sh done in $(( $(date +%s) - start )) s"
