//! The interface a communication backend implements (CPU/TCP, NCCL, MPI).
//!
//! Backends move and reduce *bytes* tagged with a [`DType`]; [`crate::ProcessGroup`] gives users typed slices and
//! candle tensors on top. Every rank of a group must call the same collectives in the same order; each call gets
//! the next sequence number, which errors carry.

use crate::{DType, ReduceOp, Result};
use std::ops::Range;

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
    /// [`Backend::all_reduce`] of a buffer the caller holds in pieces (DDP's bucket: one gradient tensor per
    /// parameter): the input is read from `buf` and the result written back to it, so a backend that moves data
    /// through memory of its own (the CPU backend's shared segment) copies the pieces straight into it and
    /// straight out of it, never through one contiguous buffer. Same call identity, algorithm and result bits
    /// as `all_reduce` of the concatenated pieces; ranks may mix the two calls.
    ///
    /// `scratch` is reused from call to call: the default implementation grows it to `buf.len()` bytes, packs the
    /// input into it, calls `all_reduce` and unpacks; the CPU backend's shared-memory path leaves it alone.
    ///
    /// Errors: those of `all_reduce`.
    fn all_reduce_piecewise(
        &self,
        buf: &mut dyn PiecewiseBuffer,
        scratch: &mut Vec<u64>,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        all_reduce_via_scratch(self, buf, scratch, dtype, op)
    }
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

/// The input and the output of [`Backend::all_reduce_piecewise`]: `len()` bytes of `dtype` elements that need not
/// be contiguous in memory, read before the reduction and written after it.
///
/// Contract (what backends guarantee and implementations may rely on): every byte of `0..len()` is read exactly
/// once and written exactly once, and the writes come in increasing offset order with no gaps, each range
/// element-aligned. Reads may come in any order (a backend stages later blocks while it waits).
pub trait PiecewiseBuffer {
    /// Total bytes (a whole number of elements).
    fn len(&self) -> usize;
    /// Whether the buffer holds no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Calls `f(offset, bytes)` for consecutive pieces that together are exactly bytes `range` of this rank's
    /// input, in order (`offset`: where `bytes` starts in `0..len()`).
    fn read(&self, range: Range<usize>, f: &mut dyn FnMut(usize, &[u8]));
    /// Takes `src` as the result's bytes `offset..offset + src.len()`.
    fn write(&mut self, offset: usize, src: &[u8]);
}

/// A contiguous buffer, reduced in place (`&mut &mut [u8]` coerces to `&mut dyn PiecewiseBuffer`).
impl PiecewiseBuffer for &mut [u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
    fn read(&self, range: Range<usize>, f: &mut dyn FnMut(usize, &[u8])) {
        let start = range.start;
        f(start, &self[range]);
    }
    fn write(&mut self, offset: usize, src: &[u8]) {
        self[offset..offset + src.len()].copy_from_slice(src);
    }
}

/// [`Backend::all_reduce_piecewise`]'s default: packs `buf` into `scratch` (grown to `buf.len()` bytes; 8-byte
/// words, so aligned for every dtype), all-reduces it, unpacks.
pub(crate) fn all_reduce_via_scratch<B: Backend + ?Sized>(
    backend: &B,
    buf: &mut dyn PiecewiseBuffer,
    scratch: &mut Vec<u64>,
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let len = buf.len();
    if scratch.len() < len.div_ceil(8) {
        scratch.resize(len.div_ceil(8), 0);
    }
    let packed = &mut bytemuck::cast_slice_mut::<u64, u8>(scratch)[..len];
    buf.read(0..len, &mut |offset, piece| packed[offset..offset + piece.len()].copy_from_slice(piece));
    backend.all_reduce(packed, dtype, op)?;
    buf.write(0, packed);
    Ok(())
}
