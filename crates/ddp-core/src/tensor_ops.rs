//! Collectives on candle tensors (CPU tensors; CUDA tensors with the `nccl` + `cuda` features).
//!
//! Tensors are values in candle, so these return new tensors rather than mutating in place. Shapes: the result
//! of `all_reduce_tensor` / `broadcast_tensor` has the input's shape and dtype; `all_gather_tensor` concatenates
//! along dim 0 (`[n, ..] → [world_size·n, ..]`); `reduce_scatter_tensor` splits dim 0 (`[world_size·n, ..] → [n, ..]`).

use crate::{ProcessGroup, ReduceOp, Result};
use candle_core::Tensor;

impl ProcessGroup {
    /// all_reduce of a tensor; returns the reduced tensor (same shape, dtype, device).
    pub fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let _ = (t, op);
        todo!("tensor all_reduce")
    }
    /// Broadcast of a tensor from `root`; every rank must pass a tensor of the same shape and dtype.
    pub fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let _ = (t, root);
        todo!("tensor broadcast")
    }
    /// All-gather along dim 0.
    pub fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        let _ = t;
        todo!("tensor all_gather")
    }
    /// Reduce-scatter along dim 0 (dim 0 must be divisible by world_size).
    pub fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let _ = (t, op);
        todo!("tensor reduce_scatter")
    }
}
