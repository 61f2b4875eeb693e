#!/usr/bin/env bash
# All-reduce busbw of ddp-core's CPU backend next to the MPI backend (system Open MPI), 2 processes on this
# machine, 1 KiB … 256 MiB (f32 SUM in place), and the ratio CPU / MPI per size. Not run in CI.
#   scripts/bench-allreduce-mpi.sh [extra args for both benches, e.g. --max-bytes 64M]
# Needs openmpi-bin + libopenmpi-dev + libclang-dev (scripts/ci-mpi.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
# The dev profile, like the README (ddp-core is compiled at opt-level 3 there).
cargo build -q -p accel-benches --features mpi --bin allreduce_bw --bin allreduce_bw_mpi
out=$(mktemp -d)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_base_warn_component_unused=0
"$target/debug/allreduce_bw" --nproc 2 "$@" | grep -v '^\[rank [1-9]' | sed 's/^\[rank 0\] //' | tee "$out/cpu.txt"
mpirun -np 2 "$target/debug/allreduce_bw_mpi" "$@" | tee "$out/mpi.txt"
echo
echo "# busbw (GB/s), 2 processes: ddp-core CPU backend vs MPI backend ($(mpirun --version | head -1))"
printf '# %10s %12s %12s %8s\n' size cpu mpi cpu/mpi
# Rows: size is two fields ("1 KiB"), busbw is the last field.
awk 'FNR==NR && $1 !~ /^#/ && NF>=8 {cpu[$1" "$2]=$NF; next}
     $1 !~ /^#/ && NF>=8 {k=$1" "$2; if (k in cpu) printf "  %10s %12.3f %12.3f %8.2f\n", k, cpu[k], $NF, cpu[k]/$NF}' \
  "$out/cpu.txt" "$out/mpi.txt"
rm -rf "$out"
