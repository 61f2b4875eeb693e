//! Fused cross entropy: the negative log-likelihood of `log_softmax(logits)` at the targets, forward in one pass
//! over each row (max, log-sum-exp, the target's logit) and backward `(softmax − onehot(target)) · g · scale` in one
//! pass, without the `[n, c]` log-probabilities, the gather and its scatter-add gradient that candle composes.
//!
//! The formulas are PyTorch's `torch.nn.functional.cross_entropy` (`reduction="mean"` / `"sum"`, `ignore_index`);
//! the log-sum-exp subtracts the row maximum first (the standard stable form, as `torch.logsumexp`).

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, D};

use super::cpu::{f32_slice, has_rows_view, with_f32, RowsView};
use super::cpu_f32::exp;

/// Mean cross entropy over all rows: `logits` `[.., c]` (float), `targets` `[..]` class indices (u8, u32 or i64;
/// the logits' leading dimensions) → scalar `−(1/n) Σ_i log softmax(logits_i)[targets_i]`, `n` the number of
/// rows. The same value as `candle_nn::loss::cross_entropy` (which takes rank-2 logits only).
///
/// Fast path (CPU, f32 logits, [`super::fused_ops_enabled`]): one custom op (module docs). Elsewhere: candle's
/// `log_softmax` + gather, as candle-nn.
///
/// Errors: logits of rank < 2, targets whose shape is not the logits' leading dimensions, a target dtype other
/// than u8/u32/i64, and (fast path and CPU) a target outside `0..c` — naming the row and the value.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (n, c) = check_shapes(logits, targets)?;
    if use_fast_path(logits, n) {
        return fast(logits, targets, 1.0 / n as f32, None);
    }
    check_targets_on_cpu(targets, c, None)?;
    let flat = logits.reshape((n, c))?;
    let t = targets.reshape(n)?;
    candle_nn::loss::cross_entropy(&flat, &t)
}

/// Summed cross entropy over the rows whose target is not `ignore_index`, and how many such rows there are:
/// `logits` `[.., c]`, `targets` `[..]` (u8, u32 or i64) → (scalar `−Σ_{i: t_i ≠ ignore} log softmax(logits_i)[t_i]`,
/// count). What a loss normalised over a whole accumulation window needs (divide the summed sums by the summed
/// counts): PyTorch's `cross_entropy(.., reduction="sum", ignore_index=..)` plus the item count. Ignored rows get
/// a zero gradient. `ignore_index` `None`: every row counts (PyTorch's default is −100, for i64 targets).
///
/// Errors: as [`cross_entropy`]; a negative target that is not `ignore_index` is out of range.
pub fn cross_entropy_sum(logits: &Tensor, targets: &Tensor, ignore_index: Option<i64>) -> Result<(Tensor, usize)> {
    let (n, c) = check_shapes(logits, targets)?;
    // Only i64 targets can hold a negative ignore index; others count every row unless the index is a class.
    let count = match ignore_index {
        Some(ignore) if ignore >= 0 || targets.dtype() == DType::I64 => {
            n - host_targets(targets)?.iter().filter(|&&t| t == ignore).count()
        }
        _ => n,
    };
    if use_fast_path(logits, n) {
        return Ok((fast(logits, targets, 1.0, ignore_index)?, count));
    }
    check_targets_on_cpu(targets, c, ignore_index)?;
    let flat = logits.reshape((n, c))?;
    let flat_targets = targets.reshape(n)?;
    let log_p = candle_nn::ops::log_softmax(&flat, D::Minus1)?;
    let sum = match ignore_index {
        None => log_p.gather(&flat_targets.unsqueeze(1)?, 1)?.sum_all()?.neg()?,
        Some(ignore) => {
            let as_i64 = flat_targets.to_dtype(DType::I64)?;
            let mask = as_i64.ne(&Tensor::full(ignore, n, targets.device())?)?;
            // Ignored positions look up class 0 (any valid index) and are then zeroed by the mask.
            let safe = mask.where_cond(&as_i64, &as_i64.zeros_like()?)?;
            let picked = log_p.gather(&safe.unsqueeze(1)?, 1)?.squeeze(1)?;
            (picked * mask.to_dtype(log_p.dtype())?)?.sum_all()?.neg()?
        }
    };
    Ok((sum, count))
}

/// Rows `n` and classes `c`, or an error naming what does not fit.
fn check_shapes(logits: &Tensor, targets: &Tensor) -> Result<(usize, usize)> {
    let dims = logits.dims();
    if dims.len() < 2 {
        candle_core::bail!("cross_entropy: logits must be [rows.., classes] (rank ≥ 2), got shape {dims:?}");
    }
    if targets.dims() != &dims[..dims.len() - 1] {
        candle_core::bail!(
            "cross_entropy: targets {:?} must have the logits' leading dimensions {:?} (logits {dims:?}: one class \
             index per row)",
            targets.dims(),
            &dims[..dims.len() - 1]
        );
    }
    if !matches!(targets.dtype(), DType::U8 | DType::U32 | DType::I64) {
        candle_core::bail!(
            "cross_entropy: targets must be class indices of dtype u8, u32 or i64, got {:?} (convert with \
             to_dtype(DType::I64))",
            targets.dtype()
        );
    }
    if !logits.dtype().is_float() {
        candle_core::bail!("cross_entropy: logits must be floating point, got {:?}", logits.dtype());
    }
    Ok((dims[..dims.len() - 1].iter().product(), dims[dims.len() - 1]))
}

fn use_fast_path(logits: &Tensor, n: usize) -> bool {
    super::fused_ops_enabled() && logits.device().is_cpu() && logits.dtype() == DType::F32 && n > 0
}

fn fast(logits: &Tensor, targets: &Tensor, scale: f32, ignore_index: Option<i64>) -> Result<Tensor> {
    let logits = if has_rows_view(logits) { logits.clone() } else { logits.contiguous()? };
    let targets = targets.contiguous()?;
    logits.apply_op2(&targets, CrossEntropyOp { scale, ignore_index })
}

/// The composed path's range check where it is free (targets already on the host): candle's gather would reject
/// a bad index with a message that names neither the row nor the class count. Other devices are not synced.
fn check_targets_on_cpu(targets: &Tensor, c: usize, ignore_index: Option<i64>) -> Result<()> {
    if targets.device().is_cpu() {
        let op = CrossEntropyOp { scale: 1.0, ignore_index };
        for (i, t) in host_targets(targets)?.into_iter().enumerate() {
            op.target(t, i, c)?;
        }
    }
    Ok(())
}

/// The targets as i64 on the host, in row order.
fn host_targets(targets: &Tensor) -> Result<Vec<i64>> {
    targets.flatten_all()?.to_dtype(DType::I64)?.to_vec1::<i64>()
}

/// Contiguous CPU targets from `offset`, `n` of them, as i64.
fn targets_i64(s: &CpuStorage, offset: usize, n: usize) -> Result<Vec<i64>> {
    Ok(match s {
        CpuStorage::U8(v) => v[offset..offset + n].iter().map(|&t| t as i64).collect(),
        CpuStorage::U32(v) => v[offset..offset + n].iter().map(|&t| t as i64).collect(),
        CpuStorage::I64(v) => v[offset..offset + n].to_vec(),
        other => candle_core::bail!(
            "cross_entropy: targets must be u8, u32 or i64, got {:?}",
            candle_core::backend::BackendStorage::dtype(other)
        ),
    })
}

/// The fused op over `(logits, targets)`: `scale · Σ_{valid rows} (lse_i − logits[i, t_i])`.
#[derive(Debug, Clone, Copy)]
struct CrossEntropyOp {
    /// `1/n` for the mean, 1 for the sum.
    scale: f32,
    ignore_index: Option<i64>,
}

impl CrossEntropyOp {
    /// The target of row `i`, `None` when ignored; an error when outside `0..c`.
    fn target(&self, t: i64, i: usize, c: usize) -> Result<Option<usize>> {
        if self.ignore_index == Some(t) {
            return Ok(None);
        }
        if t < 0 || t as usize >= c {
            let ignore = match self.ignore_index {
                Some(ig) => format!(" or the ignore index {ig}"),
                None => String::new(),
            };
            candle_core::bail!(
                "cross_entropy: target {t} of row {i} is out of range: targets must be in 0..{c}{ignore}"
            );
        }
        Ok(Some(t as usize))
    }
}

/// Row maximum and `log Σ exp(row − max) + max` of row `i`.
#[inline]
fn row_lse(data: &[f32], v: &RowsView, i: usize) -> f32 {
    let mut max = f32::NEG_INFINITY;
    for j in 0..v.cols {
        max = max.max(v.at(data, i, j));
    }
    let mut sum = 0f32;
    for j in 0..v.cols {
        sum += exp(v.at(data, i, j) - max);
    }
    max + sum.ln()
}

impl CustomOp2 for CrossEntropyOp {
    fn name(&self) -> &'static str {
        "fused-cross-entropy"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let data = f32_slice(s1, "cross_entropy", "logits")?;
        let v = RowsView::of(l1)
            .ok_or_else(|| candle_core::Error::Msg("cross_entropy: logits rows do not merge".into()))?;
        let targets = targets_i64(s2, l2.start_offset(), v.rows)?;
        let mut total = 0f64;
        for (i, &t) in targets.iter().enumerate() {
            if let Some(t) = self.target(t, i, v.cols)? {
                total += (row_lse(data, &v, i) - v.at(data, i, t)) as f64;
            }
        }
        Ok((CpuStorage::F32(vec![(total * self.scale as f64) as f32]), Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if !logits.track_op() {
            return Ok((None, None));
        }
        let g = grad.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?[0] * self.scale;
        let targets = {
            let (s, l) = targets.storage_and_layout();
            match &*s {
                candle_core::Storage::Cpu(s) => targets_i64(s, l.start_offset(), targets.elem_count())?,
                _ => candle_core::bail!("cross_entropy backward: targets must be on the CPU"),
            }
        };
        let d = with_f32(logits, "cross_entropy backward", "logits", |data, l| {
            let v = RowsView::of(l).expect("logits rows merge (checked forward)");
            let mut d = vec![0f32; v.rows * v.cols];
            for (i, (&t, drow)) in targets.iter().zip(d.chunks_exact_mut(v.cols)).enumerate() {
                let Some(t) = self.target(t, i, v.cols)? else { continue };
                let lse = row_lse(data, &v, i);
                for (j, dv) in drow.iter_mut().enumerate() {
                    *dv = exp(v.at(data, i, j) - lse) * g;
                }
                drow[t] -= g;
            }
            Ok(d)
        })?;
        Ok((Some(Tensor::from_vec(d, logits.shape(), logits.device())?), None))
    }
}
