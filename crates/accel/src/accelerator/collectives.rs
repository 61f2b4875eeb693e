//! Collectives for users: `gather`, `gather_for_metrics`, `reduce`, `pad_across_processes`, `broadcast` — on
//! candle tensors, over the Accelerator's process group. Every rank must call them in the same order.

use super::Accelerator;
use crate::{AccelError, Result};
use candle_core::{DType, Tensor};
use ddp_core::ReduceOp;

/// Reduction of [`Accelerator::reduce`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceKind {
    /// Element-wise sum over ranks.
    Sum,
    /// Element-wise mean over ranks (integer tensors: truncating division).
    Mean,
    /// Element-wise maximum over ranks.
    Max,
    /// Element-wise minimum over ranks.
    Min,
}

impl ReduceKind {
    fn op(self) -> ReduceOp {
        match self {
            ReduceKind::Sum => ReduceOp::Sum,
            ReduceKind::Mean => ReduceOp::Avg,
            ReduceKind::Max => ReduceOp::Max,
            ReduceKind::Min => ReduceOp::Min,
        }
    }
}

impl Accelerator {
    /// Concatenates every rank's `t` along dim 0, in rank order (`[n_r, ..] → [Σ n_r, ..]`; a scalar counts as
    /// `[1]`). Ranks may hold different numbers of rows; the other dims and the dtype must agree.
    pub fn gather(&self, t: &Tensor) -> Result<Tensor> {
        let (t, rows) = as_rows(t)?;
        let all_rows = self.all_gather_counts(rows)?;
        self.gather_rows(&t, &all_rows, &all_rows)
    }

    /// Like [`Accelerator::gather`] for evaluation: drops the rows that `even_batches` duplicated to fill the last
    /// batch (as reported by the prepared data loader through [`crate::GradientState`]), so over an epoch exactly
    /// `len(dataset)` rows come back.
    pub fn gather_for_metrics(&self, t: &Tensor) -> Result<Tensor> {
        let (t, rows) = as_rows(t)?;
        let padding = self.inner.gradient_state.padding_in_batch().min(rows);
        let counts = self.all_gather_counts2(rows, rows - padding)?;
        let all_rows: Vec<usize> = counts.iter().map(|c| c.0).collect();
        let keep: Vec<usize> = counts.iter().map(|c| c.1).collect();
        self.gather_rows(&t, &all_rows, &keep)
    }

    /// Reduces `t` element-wise over ranks; every rank gets the result (same shape and dtype).
    pub fn reduce(&self, t: &Tensor, op: ReduceKind) -> Result<Tensor> {
        if self.world_size() == 1 {
            return Ok(t.clone());
        }
        let (wire, back) = wire_dtype(t)?;
        let reduced = self.inner.pg.all_reduce_tensor(&wire, op.op())?;
        Ok(back(reduced)?)
    }

    /// Pads `t` along `dim` with `pad_value` to the largest size any rank has there (at the end, or at the start
    /// with `pad_first`), so tensors of different lengths can be gathered. Every rank must pass the same rank of
    /// tensor.
    pub fn pad_across_processes(&self, t: &Tensor, dim: usize, pad_value: f64, pad_first: bool) -> Result<Tensor> {
        if dim >= t.rank() {
            return Err(AccelError::InvalidArgument(format!(
                "pad_across_processes: dim {dim} is out of range for a tensor of shape {:?}",
                t.shape()
            )));
        }
        let size = t.dim(dim)?;
        let max = self.all_gather_counts(size)?.into_iter().max().unwrap_or(size);
        pad_dim(t, dim, max, pad_value, pad_first)
    }

    /// Every rank gets `root`'s `t` (all ranks pass tensors of the same shape and dtype).
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if root >= self.world_size() {
            return Err(AccelError::InvalidArgument(format!(
                "broadcast: root {root} is out of range for {} processes",
                self.world_size()
            )));
        }
        if self.world_size() == 1 {
            return Ok(t.clone());
        }
        let (wire, back) = wire_dtype(t)?;
        Ok(back(self.inner.pg.broadcast_tensor(&wire, root)?)?)
    }

    /// Every rank's `n`, in rank order.
    fn all_gather_counts(&self, n: usize) -> Result<Vec<usize>> {
        Ok(self.all_gather_counts2(n, 0)?.into_iter().map(|c| c.0).collect())
    }

    /// Every rank's pair `(a, b)`, in rank order (one collective).
    fn all_gather_counts2(&self, a: usize, b: usize) -> Result<Vec<(usize, usize)>> {
        if self.world_size() == 1 {
            return Ok(vec![(a, b)]);
        }
        let mut out = vec![0i64; 2 * self.world_size()];
        self.inner.pg.all_gather(&[a as i64, b as i64], &mut out)?;
        Ok(out.chunks(2).map(|c| (c[0] as usize, c[1] as usize)).collect())
    }

    /// Gathers `t` (this rank's `all_rows[rank]` rows) and keeps the first `keep[r]` rows of each rank's part.
    fn gather_rows(&self, t: &Tensor, all_rows: &[usize], keep: &[usize]) -> Result<Tensor> {
        let world = self.world_size();
        let max = all_rows.iter().copied().max().unwrap_or(0);
        let gathered = if world == 1 {
            t.clone()
        } else {
            let (wire, back) = wire_dtype(&pad_dim(t, 0, max, 0.0, false)?)?;
            back(self.inner.pg.all_gather_tensor(&wire)?)?
        };
        if all_rows.iter().all(|&n| n == max) && keep == all_rows {
            return Ok(gathered);
        }
        let mut parts = Vec::with_capacity(world);
        for (r, &k) in keep.iter().enumerate() {
            if k > 0 {
                parts.push(gathered.narrow(0, r * max, k)?);
            }
        }
        if parts.is_empty() {
            return Ok(gathered.narrow(0, 0, 0)?);
        }
        Ok(Tensor::cat(&parts, 0)?)
    }
}

/// The tensor in a dtype the collectives carry (u32, e.g. class labels, travels as i64, losslessly), contiguous,
/// and the conversion back to the caller's dtype.
fn wire_dtype(t: &Tensor) -> Result<(Tensor, impl Fn(Tensor) -> candle_core::Result<Tensor>)> {
    let dtype = t.dtype();
    let wire = if dtype == DType::U32 { t.to_dtype(DType::I64)? } else { t.clone() };
    Ok((wire.contiguous()?, move |r: Tensor| if r.dtype() == dtype { Ok(r) } else { r.to_dtype(dtype) }))
}

/// A tensor as rows along dim 0 (scalars become `[1]`), with its row count.
fn as_rows(t: &Tensor) -> Result<(Tensor, usize)> {
    let t = if t.rank() == 0 { t.reshape(1)? } else { t.clone() };
    let rows = t.dim(0)?;
    Ok((t, rows))
}

/// Pads `t` along `dim` to `target` entries with `value`.
fn pad_dim(t: &Tensor, dim: usize, target: usize, value: f64, pad_first: bool) -> Result<Tensor> {
    let size = t.dim(dim)?;
    if size >= target {
        return Ok(t.clone());
    }
    let mut shape = t.dims().to_vec();
    shape[dim] = target - size;
    let pad = Tensor::ones(shape, DType::F64, t.device())?.affine(value, 0.0)?.to_dtype(t.dtype())?;
    let parts = if pad_first { [&pad, t] } else { [t, &pad] };
    Ok(Tensor::cat(&parts, dim)?)
}
