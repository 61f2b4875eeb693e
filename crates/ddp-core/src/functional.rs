//! Differentiable collectives over a tensor-parallel group (Megatron-LM, Shoeybi et al. 2019, §3; picotron's
//! `tp_communications.py`): candle custom ops whose backward is the conjugate collective, so a model written
//! with them trains under `Tensor::backward` like any other.
//!
//! | function | forward | backward |
//! |---|---|---|
//! | [`copy_to_group`] (Megatron's *f*) | identity | all-reduce (sum) |
//! | [`reduce_from_group`] (*g*) | all-reduce (sum) | identity |
//! | [`gather_from_group`] | all-gather along `dim` | keep this rank's chunk |
//! | [`split_to_group`] | keep this rank's chunk along `dim` | all-gather along `dim` |
//!
//! Each backward runs its collective once: an all-reduce whose backward also all-reduced would multiply the
//! gradient by the group size (pytorch#58005). Every rank of the group must call the same functions in the
//! same order with tensors of the same shape and dtype; a one-rank group makes every function the identity.
//!
//! TODO(helper tp-layers): implement.

use crate::{ProcessGroup, Result};
use candle_core::Tensor;

/// *f*: identity forward, all-reduce (sum) of the gradient over `pg` backward. Put it before a column-parallel
/// matmul whose input is replicated. Shape and dtype unchanged.
pub fn copy_to_group(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    let _ = pg;
    todo!("{x:?}")
}

/// *g*: all-reduce (sum) over `pg` forward, identity backward. Put it after a row-parallel matmul whose output
/// is a partial sum. Shape and dtype unchanged.
pub fn reduce_from_group(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    let _ = pg;
    todo!("{x:?}")
}

/// All-gather along `dim` forward (`[.., n, ..] → [.., n·world, ..]`, chunks in group-rank order); backward keeps
/// this rank's chunk of the gradient.
pub fn gather_from_group(x: &Tensor, pg: &ProcessGroup, dim: usize) -> Result<Tensor> {
    let _ = (pg, dim);
    todo!("{x:?}")
}

/// This rank's chunk along `dim` forward (`[.., n·world, ..] → [.., n, ..]`; `n·world` must divide evenly);
/// backward all-gathers the gradient along `dim`.
pub fn split_to_group(x: &Tensor, pg: &ProcessGroup, dim: usize) -> Result<Tensor> {
    let _ = (pg, dim);
    todo!("{x:?}")
}
