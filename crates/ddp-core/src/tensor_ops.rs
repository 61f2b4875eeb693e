//! Collectives on candle tensors (CPU tensors; CUDA tensors with the `nccl` + `cuda` features).
//!
//! Tensors are values in candle, so these return new tensors rather than mutating in place. Shapes: the result
//! of `all_reduce_tensor` / `broadcast_tensor` has the input's shape and dtype; `all_gather_tensor` concatenates
//! along dim 0 (`[n, ..] → [world_size·n, ..]`); `reduce_scatter_tensor` splits dim 0 (`[world_size·n, ..] → [n, ..]`).
//!
//! Supported dtypes: f32, f64, f16, bf16, i32, i64, u8 (every candle dtype that has a [`crate::DType`]); others
//! are an [`DdpError::InvalidArgument`] naming the dtype. Non-contiguous inputs are made contiguous first (one
//! copy). Every rank must pass tensors of the same shape and dtype (a different size is reported as a
//! collective mismatch). `send_tensor` / `recv_tensor` move one tensor between two ranks (pipeline stages).

use crate::dtype::with_element_type;
use crate::{DType, DdpError, Element, ProcessGroup, ReduceOp, Result};
use candle_core::{Device, Shape, Tensor, WithDType};

/// The tensor's elements as a flat host vector, after checking device and dtype.
fn host_vec<T: Element + WithDType>(t: &Tensor) -> Result<Vec<T>> {
    Ok(t.flatten_all()?.to_vec1::<T>()?)
}

fn check(t: &Tensor, what: &str) -> Result<DType> {
    if !matches!(t.device(), Device::Cpu) {
        return Err(DdpError::InvalidArgument(format!(
            "{what}: the tensor is on {:?}, but the CPU backend takes CPU tensors; move it with \
             `.to_device(&Device::Cpu)` or use the nccl backend for CUDA tensors",
            t.device()
        )));
    }
    DType::from_candle(t.dtype()).ok_or_else(|| {
        DdpError::InvalidArgument(format!(
            "{what}: tensors of dtype {:?} are not supported by collectives (use f32, f64, f16, bf16, i32, i64 or u8)",
            t.dtype()
        ))
    })
}

fn all_reduce_t<T: Element + WithDType>(pg: &ProcessGroup, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
    let mut v = host_vec::<T>(t)?;
    pg.all_reduce(&mut v, op)?;
    Ok(Tensor::from_vec(v, t.shape(), t.device())?)
}

fn broadcast_t<T: Element + WithDType>(pg: &ProcessGroup, t: &Tensor, root: usize) -> Result<Tensor> {
    let mut v = host_vec::<T>(t)?;
    pg.broadcast(&mut v, root)?;
    Ok(Tensor::from_vec(v, t.shape(), t.device())?)
}

fn all_gather_t<T: Element + WithDType>(pg: &ProcessGroup, t: &Tensor, out_shape: Shape) -> Result<Tensor> {
    let v = host_vec::<T>(t)?;
    let mut out = vec![T::zeroed(); v.len() * pg.world_size()];
    pg.all_gather(&v, &mut out)?;
    Ok(Tensor::from_vec(out, out_shape, t.device())?)
}

fn reduce_scatter_t<T: Element + WithDType>(
    pg: &ProcessGroup,
    t: &Tensor,
    op: ReduceOp,
    out_shape: Shape,
) -> Result<Tensor> {
    let v = host_vec::<T>(t)?;
    let mut out = vec![T::zeroed(); v.len() / pg.world_size()];
    pg.reduce_scatter(&v, &mut out, op)?;
    Ok(Tensor::from_vec(out, out_shape, t.device())?)
}

/// Sends `t`'s elements straight from its storage when it is contiguous (no copy), else from a contiguous copy.
fn send_t<T: Element + WithDType>(pg: &ProcessGroup, t: &Tensor, dst: usize) -> Result<()> {
    let (storage, layout) = t.storage_and_layout();
    if let (candle_core::Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
        return pg.send(&cpu.as_slice::<T>()?[start..end], dst);
    }
    drop(storage);
    pg.send(&host_vec::<T>(t)?, dst)
}

fn recv_t<T: Element + WithDType>(pg: &ProcessGroup, shape: Shape, src: usize) -> Result<Tensor> {
    let mut v = vec![T::zeroed(); shape.elem_count()];
    pg.recv(&mut v, src)?;
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

impl ProcessGroup {
    /// Sends a tensor to group rank `dst` (point to point: a pipeline stage's activation or gradient). The
    /// receiver must call [`Self::recv_tensor`] with the same shape and dtype — pipeline stages agree on them once
    /// per run — and messages between two ranks arrive in the order they were sent. A contiguous tensor is sent
    /// from its own storage, without a copy.
    ///
    /// Errors: unsupported dtype or a non-CPU tensor ([`DdpError::InvalidArgument`]), `dst` out of range or this
    /// rank, the backend's (a dead peer is named).
    pub fn send_tensor(&self, t: &Tensor, dst: usize) -> Result<()> {
        let dtype = check(t, "send_tensor")?;
        with_element_type!(dtype, T => send_t::<T>(self, t, dst))
    }

    /// Receives a tensor of `shape` and `dtype` from group rank `src` (what its [`Self::send_tensor`] sent), on
    /// the CPU. The elements land in the new tensor's own storage (no copy after the receive).
    ///
    /// Errors: unsupported dtype ([`DdpError::InvalidArgument`]), `src` out of range or this rank, a sender
    /// whose tensor has another size (reported by the backend), a dead peer.
    pub fn recv_tensor(&self, shape: impl Into<Shape>, dtype: candle_core::DType, src: usize) -> Result<Tensor> {
        let dt = DType::from_candle(dtype).ok_or_else(|| {
            DdpError::InvalidArgument(format!(
                "recv_tensor: tensors of dtype {dtype:?} are not supported (use f32, f64, f16, bf16, i32, i64 or u8)"
            ))
        })?;
        let shape = shape.into();
        with_element_type!(dt, T => recv_t::<T>(self, shape, src))
    }

    /// all_reduce of a tensor; returns the reduced tensor (same shape, dtype, device).
    ///
    /// Errors: unsupported dtype or device ([`DdpError::InvalidArgument`]), collective failures.
    pub fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        #[cfg(all(feature = "nccl", feature = "cuda"))] // CUDA tensor on an NCCL group: on the GPU
        if let Some(r) = crate::nccl::tensor::dispatch(self, t, crate::nccl::tensor::Collective::AllReduce(op)) {
            return r;
        }
        let dtype = check(t, "all_reduce_tensor")?;
        with_element_type!(dtype, T => all_reduce_t::<T>(self, t, op))
    }

    /// Broadcast of a tensor from `root`; every rank must pass a tensor of the same shape and dtype.
    /// Returns root's values with the input's shape.
    pub fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        #[cfg(all(feature = "nccl", feature = "cuda"))] // CUDA tensor on an NCCL group: on the GPU
        if let Some(r) = crate::nccl::tensor::dispatch(self, t, crate::nccl::tensor::Collective::Broadcast(root)) {
            return r;
        }
        let dtype = check(t, "broadcast_tensor")?;
        if root >= self.world_size() {
            return Err(DdpError::InvalidArgument(format!(
                "broadcast_tensor: root {root} is out of range for a group of {} ranks",
                self.world_size()
            )));
        }
        with_element_type!(dtype, T => broadcast_t::<T>(self, t, root))
    }

    /// All-gather along dim 0: `[n, d1, ..] → [world_size·n, d1, ..]`, rank r's rows at `r·n..(r+1)·n`.
    /// A 0-d tensor gathers into shape `[world_size]`.
    pub fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        #[cfg(all(feature = "nccl", feature = "cuda"))] // CUDA tensor on an NCCL group: on the GPU
        if let Some(r) = crate::nccl::tensor::dispatch(self, t, crate::nccl::tensor::Collective::AllGather) {
            return r;
        }
        let dtype = check(t, "all_gather_tensor")?;
        let mut dims = t.dims().to_vec();
        match dims.first_mut() {
            Some(d0) => *d0 *= self.world_size(),
            None => dims.push(self.world_size()),
        }
        with_element_type!(dtype, T => all_gather_t::<T>(self, t, Shape::from(dims)))
    }

    /// Reduce-scatter along dim 0: `[world_size·n, d1, ..] → [n, d1, ..]`, rank r keeps the reduction of rows
    /// `r·n..(r+1)·n`. Dim 0 must be divisible by the world size.
    pub fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        #[cfg(all(feature = "nccl", feature = "cuda"))] // CUDA tensor on an NCCL group: on the GPU
        if let Some(r) = crate::nccl::tensor::dispatch(self, t, crate::nccl::tensor::Collective::ReduceScatter(op)) {
            return r;
        }
        let dtype = check(t, "reduce_scatter_tensor")?;
        let mut dims = t.dims().to_vec();
        let p = self.world_size();
        match dims.first_mut() {
            Some(d0) if *d0 % p == 0 => *d0 /= p,
            Some(d0) => {
                return Err(DdpError::InvalidArgument(format!(
                    "reduce_scatter_tensor: dim 0 of shape {:?} ({d0}) is not divisible by the world size {p}",
                    t.dims()
                )))
            }
            None => {
                return Err(DdpError::InvalidArgument(
                    "reduce_scatter_tensor: a 0-d tensor has no dim 0 to scatter".into(),
                ))
            }
        }
        with_element_type!(dtype, T => reduce_scatter_t::<T>(self, t, op, Shape::from(dims)))
    }
}
