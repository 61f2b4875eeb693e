//! The MPI backend (feature `mpi`): collectives through the system's MPI library (Open MPI or MPICH) via rsmpi's
//! `mpi-sys` bindings, for CPU clusters that already run MPI jobs.
//!
//! - Start: under `mpirun -np N prog` / `srun -n N prog`, call [`crate::ProcessGroup::init_mpi`] (or
//!   `ProcessGroup::init_from_env()` with ACCEL_BACKEND=mpi): rank, world size and local rank come from MPI,
//!   the rendezvous store is set up through MPI ([`init`]).
//! - Communicators: every group (world and sub-groups from `new_group` / `split`) gets its own communicator
//!   from `MPI_Comm_create_group`, so our traffic never mixes with the program's own MPI calls.
//! - Collectives: the blocking MPI calls, so the library's tuned algorithms (shared memory inside a node) are
//!   used as they are; `Avg` = `MPI_SUM` then a division; f16/bf16 use user-defined operators ([`ops`]).
//! - Failures: MPI errors come back as [`crate::DdpError::Collective`] (communicators use
//!   `MPI_ERRORS_RETURN`); a timeout aborts the job ([`watchdog`]); a dead rank makes `mpirun` stop the job.
//! - Lifetime: MPI is initialised once (MPI_THREAD_MULTIPLE requested) and finalised at process exit
//!   ([`runtime`]).
//!
//! Reference: MPI 3.1 standard, chapters 5 (collectives) and 6 (groups and communicators).

mod backend;
pub mod init;
mod ops;
pub mod runtime;
mod watchdog;

pub use backend::MpiBackend;
pub use init::{init_world, MpiLayout};
pub use runtime::{runtime, MpiRuntime};
