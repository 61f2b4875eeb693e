//! Causal self-attention in one op: `softmax(q kᵀ · scale + mask) v` per head, with its own backward — what
//! PyTorch's `F.scaled_dot_product_attention(q, k, v, is_causal=True)` computes.
//!
//! Where the composed form splits the heads out (`reshape` + `transpose` + a copy of each of q, k and v), runs two
//! batched products of one small matrix per (sequence, head), the softmax, and copies the heads back side by side
//! (and the backward does the same again in reverse, through candle's transposed-product gradients), the fast path
//! reads each head's columns where the projections wrote them and writes the result where the output projection
//! reads it. Per (sequence, head), with `Q, K, V` the head's `[s, hd]` columns:
//!
//! - forward: `S = Q Kᵀ` (one product), `P = softmax(scale · S)` row by row over the keys up to the query
//!   (masked keys exactly 0, never read), `Y = P V` (one product) into the output's columns of that head;
//! - backward: `P` recomputed as forward, as FlashAttention does (Dao et al. 2022; it also keeps the output and
//!   each row's log-sum-exp, and tiles; here only the inputs are kept, and one head's `[s, s]` matrix is small),
//!   then `dV = Pᵀ dY`, `dP = dY Vᵀ`, `dS = scale · P ⊙ (dP − rowsum(dP ⊙ P))` (softmax's backward), `dQ = dS K`,
//!   `dK = dSᵀ Q` — the transposes are strides handed to the product, never copies.
//!
//! The sequences of a batch run in parallel on rayon's pool (one task each), each product on its task's thread.

use super::cpu::{gemm_into, MatMut, MatRef};
use super::cpu_f32::{fast_path, storage_f32, tensor_f32};
use super::softmax::{softmax_backward_in_place, softmax_in_place};
use crate::{NnError, Result};
use candle_core::{CpuStorage, CustomOp3, Device, Layout, Shape, Tensor};
use rayon::prelude::*;

/// Causal self-attention of `n_head` heads: `q`, `k`, `v` `[b, s, n_head · hd]` (the heads side by side along the
/// last dimension, as the query/key/value projections produce them — head `h` owns columns `h·hd .. (h+1)·hd`) →
/// `[b, s, n_head · hd]` in the same layout, where query `i` of each head attends to keys `0..=i` with weights
/// `softmax(scale · q_i · k_j)` (GPT's decoder self-attention, Radford et al. 2018; `scale = 1/√hd` in Vaswani et
/// al. 2017). Differentiable in all three inputs; any float dtype.
///
/// Fast path (CPU f32, [`super::fused_ops_enabled`]): one custom op (module docs). Elsewhere: the composed form
/// (split heads, `q kᵀ`, [`super::softmax::causal_softmax`], `· v`, merge heads), so the results are the same
/// within f32 rounding.
///
/// Errors ([`NnError::InvalidArgument`]): `q`, `k` or `v` not 3-D or not all of one shape; `n_head` zero or not
/// dividing the last dimension; `scale` not finite in f32 (the fast path's precision). Mixed dtypes or devices
/// come back from candle's ops as [`NnError::Candle`].
pub fn causal_self_attention(q: &Tensor, k: &Tensor, v: &Tensor, n_head: usize, scale: f64) -> Result<Tensor> {
    let dims = q.dims();
    if dims.len() != 3 || k.dims() != dims || v.dims() != dims {
        return Err(NnError::InvalidArgument(format!(
            "causal_self_attention: q {:?}, k {:?}, v {:?}; expected three tensors of one shape [b, s, n_head · head_dim]",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    let d = dims[2];
    if n_head == 0 || !d.is_multiple_of(n_head) {
        return Err(NnError::InvalidArgument(format!(
            "causal_self_attention: n_head = {n_head} does not divide the last dimension {d} (q {dims:?}); \
             it must be the number of heads whose columns lie side by side there"
        )));
    }
    if !(scale as f32).is_finite() {
        return Err(NnError::InvalidArgument(format!(
            "causal_self_attention: scale = {scale}; it must be finite in f32 (attention uses 1/√head_dim)"
        )));
    }
    if fast_path(&[q, k, v]) && q.elem_count() > 0 {
        let op = AttentionOp { n_head, scale: scale as f32 };
        return Ok(q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)?);
    }
    composed(q, k, v, n_head, scale)
}

/// candle's own ops: heads split out, two batched products around the causal softmax, heads merged back.
fn composed(q: &Tensor, k: &Tensor, v: &Tensor, n_head: usize, scale: f64) -> Result<Tensor> {
    let (b, s, d) = q.dims3()?;
    let heads =
        |t: &Tensor| -> Result<Tensor> { Ok(t.reshape((b, s, n_head, d / n_head))?.transpose(1, 2)?.contiguous()?) };
    let (q, k, v) = (heads(q)?, heads(k)?, heads(v)?);
    let att = super::softmax::causal_softmax(&q.matmul(&k.t()?)?, scale)?;
    Ok(att.matmul(&v)?.transpose(1, 2)?.reshape((b, s, d))?)
}

/// The fused op on contiguous `(q, k, v)` `[b, s, d]`.
struct AttentionOp {
    n_head: usize,
    scale: f32,
}

/// One sequence's `[s, d]` slices of q, k and v, and the sizes.
#[derive(Clone, Copy)]
struct Sequence<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    s: usize,
    d: usize,
    hd: usize,
}

impl<'a> Sequence<'a> {
    /// Head `h`'s `[s, hd]` columns of `x` (one of this sequence's q, k, v or the output gradient).
    fn head(&self, x: &'a [f32], h: usize) -> MatRef<'a> {
        MatRef { data: x, offset: h * self.hd, rs: self.d, cs: 1 }
    }

    /// `out`'s columns of head `h` (`[s, hd]`, rows `d` apart) `= a[s×k] · b[k×hd]`, on this thread.
    fn product_into_head(&self, out: &mut [f32], h: usize, a: MatRef<'_>, b: MatRef<'_>, k: usize) {
        let dst = MatMut { data: out, offset: h * self.hd, rs: self.d };
        gemm_into(dst, a, b, self.s, self.hd, k, false);
    }

    /// `out[s×s] = a[s×hd] · b[hd×s]` (one head's scores or their gradient), on this thread.
    fn square(&self, out: &mut [f32], a: MatRef<'_>, b: MatRef<'_>) {
        gemm_into(MatMut { data: out, offset: 0, rs: self.s }, a, b, self.s, self.s, self.hd, false);
    }

    /// `p[s×s] = softmax(scale · Q Kᵀ)` of head `h`, causal: row `i` holds keys `0..=i`, exact zeros after.
    fn probs(&self, h: usize, scale: f32, p: &mut [f32]) {
        self.square(p, self.head(self.q, h), self.head(self.k, h).t());
        for (i, row) in p.chunks_exact_mut(self.s).enumerate() {
            let (seen, masked) = row.split_at_mut(i + 1);
            softmax_in_place(seen, scale);
            masked.fill(0.0);
        }
    }
}

impl AttentionOp {
    fn dims(&self, l: &Layout) -> candle_core::Result<(usize, usize, usize, usize)> {
        let (b, s, d) = l.shape().dims3()?;
        Ok((b, s, d, d / self.n_head))
    }
}

impl CustomOp3 for AttentionOp {
    fn name(&self) -> &'static str {
        "fused-causal-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (q, k, v) =
            (storage_f32(s1, l1, self.name())?, storage_f32(s2, l2, self.name())?, storage_f32(s3, l3, self.name())?);
        let (_, s, d, hd) = self.dims(l1)?;
        let sd = s * d;
        let mut y = vec![0f32; q.len()];
        y.par_chunks_mut(sd).enumerate().for_each(|(i, y)| {
            let seq = Sequence { q: &q[i * sd..][..sd], k: &k[i * sd..][..sd], v: &v[i * sd..][..sd], s, d, hd };
            let mut p = vec![0f32; s * s];
            for h in 0..self.n_head {
                seq.probs(h, self.scale, &mut p);
                // Y = P V into this head's columns of the output.
                seq.product_into_head(y, h, MatRef { data: &p, offset: 0, rs: s, cs: 1 }, seq.head(seq.v, h), s);
            }
        });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let (qs, ql) = q.storage_and_layout();
        let (ks, kl) = k.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let (gs, gl) = grad.storage_and_layout();
        let name = self.name();
        let (qd, kd, vd, gd) = (
            tensor_f32(&qs, ql, name)?,
            tensor_f32(&ks, kl, name)?,
            tensor_f32(&vs, vl, name)?,
            tensor_f32(&gs, gl, name)?,
        );
        let (_, s, d, hd) = self.dims(ql)?;
        let sd = s * d;
        let scale = self.scale;
        let (mut dq, mut dk, mut dv) = (vec![0f32; qd.len()], vec![0f32; qd.len()], vec![0f32; qd.len()]);
        let per_sequence = dq.par_chunks_mut(sd).zip(dk.par_chunks_mut(sd)).zip(dv.par_chunks_mut(sd));
        per_sequence.enumerate().for_each(|(i, ((dq, dk), dv))| {
            let seq = Sequence { q: &qd[i * sd..][..sd], k: &kd[i * sd..][..sd], v: &vd[i * sd..][..sd], s, d, hd };
            let g = &gd[i * sd..][..sd];
            let (mut p, mut ds) = (vec![0f32; s * s], vec![0f32; s * s]);
            for h in 0..self.n_head {
                seq.probs(h, scale, &mut p);
                let p_mat = MatRef { data: &p, offset: 0, rs: s, cs: 1 };
                let dy = seq.head(g, h);
                // dV = Pᵀ dY
                seq.product_into_head(dv, h, p_mat.t(), dy, s);
                // dP = dY Vᵀ (into ds), then dS = scale · P ⊙ (dP − rowsum(dP ⊙ P)) in place; masked keys stay 0.
                seq.square(&mut ds, dy, seq.head(seq.v, h).t());
                for (r, (dsr, pr)) in ds.chunks_exact_mut(s).zip(p.chunks_exact(s)).enumerate() {
                    let (seen, masked) = dsr.split_at_mut(r + 1);
                    softmax_backward_in_place(seen, &pr[..=r], scale);
                    masked.fill(0.0);
                }
                let ds_mat = MatRef { data: &ds, offset: 0, rs: s, cs: 1 };
                // dQ = dS K, dK = dSᵀ Q
                seq.product_into_head(dq, h, ds_mat, seq.head(seq.k, h), s);
                seq.product_into_head(dk, h, ds_mat.t(), seq.head(seq.q, h), s);
            }
        });
        let dev = Device::Cpu;
        let shape = ql.shape().clone();
        Ok((
            Some(Tensor::from_vec(dq, shape.clone(), &dev)?),
            Some(Tensor::from_vec(dk, shape.clone(), &dev)?),
            Some(Tensor::from_vec(dv, shape, &dev)?),
        ))
    }
}
