//! The work behind the Accelerator's collectives (`gather`, `gather_for_metrics`, `reduce`,
//! `pad_across_processes`, `broadcast`): candle tensors over a process group. Every rank must call them in the
//! same order.

use crate::{AccelError, Result};
use candle_core::{DType, Tensor};
use ddp_core::{ProcessGroup, ReduceOp};

/// Reduction of [`crate::Accelerator::reduce`].
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

/// Concatenates every rank's `t` along dim 0 in rank order, dropping the last `padding` rows of this rank's part
/// (`even_batches` duplicates; 0 for a plain gather). One collective for the row counts, one for the data.
pub(crate) fn gather(pg: &ProcessGroup, t: &Tensor, padding: usize) -> Result<Tensor> {
    let (t, rows) = as_rows(t)?;
    let counts = all_gather_pairs(pg, rows, rows - padding.min(rows))?;
    let all_rows: Vec<usize> = counts.iter().map(|c| c.0).collect();
    let keep: Vec<usize> = counts.iter().map(|c| c.1).collect();
    gather_rows(pg, &t, &all_rows, &keep)
}

/// Element-wise reduction over ranks; every rank gets the result.
pub(crate) fn reduce(pg: &ProcessGroup, t: &Tensor, op: ReduceKind) -> Result<Tensor> {
    if pg.world_size() == 1 {
        return Ok(t.clone());
    }
    let (wire, back) = wire_dtype(t)?;
    let reduced = pg.all_reduce_tensor(&wire, op.op())?;
    Ok(back(reduced)?)
}

/// Pads `t` along `dim` to the largest size any rank has there.
pub(crate) fn pad_across_processes(
    pg: &ProcessGroup,
    t: &Tensor,
    dim: usize,
    pad_value: f64,
    pad_first: bool,
) -> Result<Tensor> {
    if dim >= t.rank() {
        return Err(AccelError::InvalidArgument(format!(
            "pad_across_processes: dim {dim} is out of range for a tensor of shape {:?}",
            t.shape()
        )));
    }
    let size = t.dim(dim)?;
    let max = all_gather_pairs(pg, size, 0)?.into_iter().map(|c| c.0).max().unwrap_or(size);
    pad_dim(t, dim, max, pad_value, pad_first)
}

/// Every rank gets `root`'s `t`.
pub(crate) fn broadcast(pg: &ProcessGroup, t: &Tensor, root: usize) -> Result<Tensor> {
    if root >= pg.world_size() {
        return Err(AccelError::InvalidArgument(format!(
            "broadcast: root {root} is out of range for {} processes",
            pg.world_size()
        )));
    }
    if pg.world_size() == 1 {
        return Ok(t.clone());
    }
    let (wire, back) = wire_dtype(t)?;
    Ok(back(pg.broadcast_tensor(&wire, root)?)?)
}

/// Every rank's pair `(a, b)`, in rank order (one collective).
fn all_gather_pairs(pg: &ProcessGroup, a: usize, b: usize) -> Result<Vec<(usize, usize)>> {
    if pg.world_size() == 1 {
        return Ok(vec![(a, b)]);
    }
    let mut out = vec![0i64; 2 * pg.world_size()];
    pg.all_gather(&[a as i64, b as i64], &mut out)?;
    Ok(out.chunks(2).map(|c| (c[0] as usize, c[1] as usize)).collect())
}

/// Gathers `t` (this rank's `all_rows[rank]` rows) and keeps the first `keep[r]` rows of each rank's part.
fn gather_rows(pg: &ProcessGroup, t: &Tensor, all_rows: &[usize], keep: &[usize]) -> Result<Tensor> {
    let world = pg.world_size();
    let max = all_rows.iter().copied().max().unwrap_or(0);
    let gathered = if world == 1 {
        t.clone()
    } else {
        let (wire, back) = wire_dtype(&pad_dim(t, 0, max, 0.0, false)?)?;
        back(pg.all_gather_tensor(&wire)?)?
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

/// `[start, end)` of rank `rank`'s share of `len` items over `world` ranks.
pub(crate) fn split_range(len: usize, rank: usize, world: usize) -> (usize, usize) {
    let base = len / world;
    let extra = len % world;
    let start = rank * base + rank.min(extra);
    let end = start + base + usize::from(rank < extra);
    (start, end)
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
#[cfg(test)]
mod tests {
    use super::split_range;

    #[test]
    fn split_covers_everything_in_order() {
        for len in 0..20 {
            for world in 1..6 {
                let mut next = 0;
                for r in 0..world {
                    let (s, e) = split_range(len, r, world);
                    assert_eq!(s, next);
                    assert!(e - s == len / world || e - s == len / world + 1);
                    next = e;
                }
                assert_eq!(next, len);
            }
        }
        assert_eq!(split_range(5, 0, 2), (0, 3));
        assert_eq!(split_range(5, 1, 2), (3, 5));
    }
}
