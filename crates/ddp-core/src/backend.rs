//! The interface a communication backend implements (CPU/TCP, NCCL, MPI).
//!
//! Backends move and reduce *bytes* tagged with a [`DType`]; [`crate::ProcessGroup`] gives users typed slices and
//! candle tensors on top. Every rank of a group must call the same collectives in the same order; each call gets
//! the next sequence number, which errors carry.

use crate::{DType, ReduceOp, Result};

/// Which backend a process group runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// Pure-Rust CPU backend over TCP (and shared memory between processes on one machine when faster).
    #[default]
    Cpu,
    /// NVIDIA NCCL through cudarc (feature `nccl`).
    Nccl,
    /// MPI (feature `mpi`).
    Mpi,
    /// NCCL when compiled in and a GPU + libnccl are present, else CPU (the reason is logged).
    Auto,
}

impl std::str::FromStr for BackendKind {
    type Err = crate::DdpError;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "cpu" | "gloo" | "tcp" => Ok(BackendKind::Cpu),
            "nccl" => Ok(BackendKind::Nccl),
            "mpi" => Ok(BackendKind::Mpi),
            "auto" => Ok(BackendKind::Auto),
            other => Err(crate::DdpError::InvalidArgument(format!(
                "unknown backend {other:?}; expected one of cpu, nccl, mpi, auto"
            ))),
        }
    }
}

/// A communicator over one group of processes.
///
/// Buffers are byte views of typed slices: `buf.len()` is a multiple of `dtype.size_in_bytes()`.
/// Ranks here are *group* ranks in `0..world_size()`.
pub trait Backend: Send + Sync {
    /// Short name for logs ("cpu", "nccl", "mpi").
    fn name(&self) -> &'static str;
    /// This process's rank in the group.
    fn rank(&self) -> usize;
    /// Number of processes in the group.
    fn world_size(&self) -> usize;
    /// In place: every rank ends with `op` over all ranks' `buf`.
    fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()>;
    /// In place: every rank ends with `root`'s `buf`.
    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()>;
    /// `output` (len = world_size · input.len()) receives rank r's `input` at block r.
    fn all_gather(&self, input: &[u8], output: &mut [u8]) -> Result<()>;
    /// `input` (len = world_size · output.len()) is reduced across ranks; rank r keeps block r in `output`.
    fn reduce_scatter(&self, input: &[u8], output: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()>;
    /// Sends `buf` to `dst` (blocks until handed to the transport).
    fn send(&self, buf: &[u8], dst: usize) -> Result<()>;
    /// Receives exactly `buf.len()` bytes from `src`.
    fn recv(&self, buf: &mut [u8], src: usize) -> Result<()>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<()>;
    /// The concrete backend, for backend-specific APIs (e.g. `ProcessGroup::nccl()` for device buffers).
    /// Default: `None`.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
}
