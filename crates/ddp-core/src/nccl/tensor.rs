//! Collectives on candle CUDA tensors through NCCL, on the GPU without host copies (features `nccl` + `cuda`).
//!
//! candle tensors are values, so the in-place functions (`all_reduce_`, `broadcast_`) are for tensors the
//! caller owns (e.g. a gradient buffer); the [`crate::ProcessGroup`] tensor methods return new tensors and use
//! these through [`dispatch`]. Implemented as candle `InplaceOp1/2` custom ops: `cuda_fwd` gets the tensor's
//! `CudaStorage`, takes its `CudaSlice` and runs the NCCL call on the contiguous range of the layout. Shapes:
//! `all_gather` `[n, ..] → [world_size·n, ..]`, `reduce_scatter` `[world_size·n, ..] → [n, ..]`. Dtypes: f32, f64,
//! f16, bf16, i32, i64, u8 (integer `Avg` is not supported on the GPU: use `Sum`).

use super::NcclBackend;
use crate::{DdpError, ProcessGroup, ReduceOp, Result};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, InplaceOp1, InplaceOp2, Layout, Tensor};
use std::sync::Mutex;

/// Keeps the first [`DdpError`] raised inside a candle op, so callers get it back unwrapped.
#[derive(Default)]
struct ErrorSlot(Mutex<Option<DdpError>>);

impl ErrorSlot {
    fn keep(&self, e: DdpError) -> candle_core::Error {
        let msg = e.to_string();
        *crate::sync::lock(&self.0) = Some(e);
        candle_core::Error::Msg(msg)
    }
    fn finish(&self, r: candle_core::Result<()>) -> Result<()> {
        match r {
            Ok(()) => Ok(()),
            Err(e) => Err(crate::sync::lock(&self.0).take().unwrap_or(DdpError::Candle(e))),
        }
    }
}

fn contiguous_range(l: &Layout, what: &str) -> candle_core::Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{what}: the tensor must be contiguous (call .contiguous())")))
}

fn cpu_tensor(name: &str) -> candle_core::Result<()> {
    Err(candle_core::Error::Msg(format!("{name}: NCCL collectives take CUDA tensors (this one is on the CPU)")))
}

/// Calls `$body` with `$T` bound to the Rust type of a candle dtype, or returns an unsupported-dtype error. The
/// dispatch table is the crate's one ([`crate::dtype::with_element_type`]); this only maps candle's dtype onto it.
macro_rules! with_cuda_type {
    ($dtype:expr, $what:expr, $T:ident => $body:expr) => {
        match crate::DType::from_candle($dtype) {
            Some(d) => crate::dtype::with_element_type!(d, $T => $body),
            None => Err(candle_core::Error::Msg(format!(
                "{}: dtype {:?} is not supported by NCCL collectives",
                $what, $dtype
            ))),
        }
    };
}

struct AllReduce<'a> {
    backend: &'a NcclBackend,
    op: ReduceOp,
    error: ErrorSlot,
}

impl InplaceOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-reduce"
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        cpu_tensor(self.name())
    }
    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let (start, end) = contiguous_range(l, "all_reduce")?;
        with_cuda_type!(s.dtype(), "all_reduce", T => {
            let mut view = s.as_cuda_slice_mut::<T>()?.slice_mut(start..end);
            self.backend.with_comm(|c| c.all_reduce::<T, _>(&mut view, self.op)).map_err(|e| self.error.keep(e))
        })
    }
}

struct Broadcast<'a> {
    backend: &'a NcclBackend,
    root: usize,
    error: ErrorSlot,
}

impl InplaceOp1 for Broadcast<'_> {
    fn name(&self) -> &'static str {
        "nccl-broadcast"
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        cpu_tensor(self.name())
    }
    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let (start, end) = contiguous_range(l, "broadcast")?;
        with_cuda_type!(s.dtype(), "broadcast", T => {
            let mut view = s.as_cuda_slice_mut::<T>()?.slice_mut(start..end);
            self.backend.with_comm(|c| c.broadcast::<T, _>(&mut view, self.root)).map_err(|e| self.error.keep(e))
        })
    }
}

/// all_gather (`reduce: None`) or reduce_scatter (`Some(op)`) from the second operand into the first.
struct Gather<'a> {
    backend: &'a NcclBackend,
    reduce: Option<ReduceOp>,
    error: ErrorSlot,
}

impl InplaceOp2 for Gather<'_> {
    fn name(&self) -> &'static str {
        if self.reduce.is_some() {
            "nccl-reduce-scatter"
        } else {
            "nccl-all-gather"
        }
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> candle_core::Result<()> {
        cpu_tensor(self.name())
    }
    fn cuda_fwd(&self, out: &mut CudaStorage, lo: &Layout, inp: &CudaStorage, li: &Layout) -> candle_core::Result<()> {
        let (o0, o1) = contiguous_range(lo, self.name())?;
        let (i0, i1) = contiguous_range(li, self.name())?;
        with_cuda_type!(out.dtype(), self.name(), T => {
            let src = inp.as_cuda_slice::<T>()?.slice(i0..i1);
            let mut dst = out.as_cuda_slice_mut::<T>()?.slice_mut(o0..o1);
            let r = match self.reduce {
                None => self.backend.with_comm(|c| c.all_gather::<T, _, _>(&src, &mut dst)),
                Some(op) => self.backend.with_comm(|c| c.reduce_scatter::<T, _, _>(&src, &mut dst, op)),
            };
            r.map_err(|e| self.error.keep(e))
        })
    }
}

/// In place all_reduce of a CUDA tensor this caller owns (every view of its storage sees the result).
pub fn all_reduce_(backend: &NcclBackend, t: &Tensor, op: ReduceOp) -> Result<()> {
    let c = AllReduce { backend, op, error: ErrorSlot::default() };
    c.error.finish(t.inplace_op1(&c))
}

/// In place broadcast of a CUDA tensor from group rank `root`.
pub fn broadcast_(backend: &NcclBackend, t: &Tensor, root: usize) -> Result<()> {
    let c = Broadcast { backend, root, error: ErrorSlot::default() };
    c.error.finish(t.inplace_op1(&c))
}

/// all_gather along dim 0: `[n, ..] → [world_size·n, ..]` (a new tensor on the same device).
pub fn all_gather(backend: &NcclBackend, t: &Tensor) -> Result<Tensor> {
    let t = t.contiguous()?;
    let mut dims = t.dims().to_vec();
    if dims.is_empty() {
        dims.push(1);
    }
    dims[0] *= crate::Backend::world_size(backend);
    let out = Tensor::zeros(dims, t.dtype(), t.device())?;
    let c = Gather { backend, reduce: None, error: ErrorSlot::default() };
    c.error.finish(out.inplace_op2(&t, &c))?;
    Ok(out)
}

/// reduce_scatter along dim 0: `[world_size·n, ..] → [n, ..]` (dim 0 must be divisible by world_size).
pub fn reduce_scatter(backend: &NcclBackend, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
    let t = t.contiguous()?;
    let world = crate::Backend::world_size(backend);
    let mut dims = t.dims().to_vec();
    if dims.is_empty() || dims[0] % world != 0 {
        return Err(DdpError::InvalidArgument(format!(
            "reduce_scatter: dim 0 of shape {dims:?} must be divisible by the world size {world}"
        )));
    }
    dims[0] /= world;
    let out = Tensor::zeros(dims, t.dtype(), t.device())?;
    let c = Gather { backend, reduce: Some(op), error: ErrorSlot::default() };
    c.error.finish(out.inplace_op2(&t, &c))?;
    Ok(out)
}

/// A fresh contiguous copy (collectives write into it, the caller's tensor stays as it was).
fn owned_copy(t: &Tensor) -> Result<Tensor> {
    Ok(if t.is_contiguous() { t.copy()? } else { t.contiguous()? })
}

/// What [`crate::ProcessGroup`]'s tensor methods call first: `Some(result)` for a CUDA tensor on an NCCL
/// group (computed on the GPU), `None` otherwise (the caller's host path applies).
pub enum Collective {
    /// all_reduce with this operator.
    AllReduce(ReduceOp),
    /// broadcast from this group rank.
    Broadcast(usize),
    /// all_gather along dim 0.
    AllGather,
    /// reduce_scatter along dim 0 with this operator.
    ReduceScatter(ReduceOp),
}

/// Runs `what` on the GPU when `t` is a CUDA tensor and `pg` an NCCL group; `None` otherwise.
pub fn dispatch(pg: &ProcessGroup, t: &Tensor, what: Collective) -> Option<Result<Tensor>> {
    if !t.device().is_cuda() {
        return None;
    }
    let backend = pg.nccl()?;
    Some(match what {
        Collective::AllReduce(op) => owned_copy(t).and_then(|o| all_reduce_(backend, &o, op).map(|_| o)),
        Collective::Broadcast(root) => owned_copy(t).and_then(|o| broadcast_(backend, &o, root).map(|_| o)),
        Collective::AllGather => all_gather(backend, t),
        Collective::ReduceScatter(op) => reduce_scatter(backend, t, op),
    })
}
