//! Fused linear layer: `y = act(x · wᵀ + b)` with its own backward pass.
//!
//! Where candle composes `matmul` + `broadcast_add` + `relu` (three outputs allocated forward; backward a
//! transpose node, a bias reduction, a four-op ReLU mask, and the input gradient even of a batch that needs none,
//! each accumulated into a zero-filled buffer), the fast path here is one candle custom op:
//!
//! - forward: one `gemm` (the kernel candle's matmul calls) into the output, then bias + activation in one
//!   in-place pass over it;
//! - backward: one pass that applies the ReLU mask to the incoming gradient and sums its columns (the bias
//!   gradient), then `dw = gᵀ · x` and, only when `x` is tracked, `dx = g · w` — the transposes are strides handed
//!   to `gemm`, never copies.
//!
//! This is PyTorch's `torch.nn.functional.linear` followed by `relu` (the weight is `[out, in]`, as in
//! `torch.nn.Linear` and `candle_nn::Linear`), with the backward of `torch.autograd`'s `addmm` / `threshold`
//! formulas. With [`super::autocast`] on, the operands and results are rounded to bf16 around the same f32 products
//! (that module's docs), on both paths.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Module, Result, Shape, Tensor};
use candle_nn::VarBuilder;

use super::autocast::{round_bf16, round_bf16_in_place, rounded_bf16};
use super::cpu::{gemm_new, has_rows_view, with_f32, MatRef, RowsView};

/// The activation applied to a linear layer's output inside the fused op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activation {
    /// None: `y = x · wᵀ + b`.
    #[default]
    None,
    /// ReLU: `y = max(x · wᵀ + b, 0)` (gradient 0 where the output is 0, as candle's and PyTorch's ReLU at 0).
    Relu,
}

/// `act(x · weightᵀ + bias)`.
///
/// - `x`: `[.., in]`, any number of leading dimensions (they are flattened into rows); f32 for the fused path.
/// - `weight`: `[out, in]` (PyTorch / candle-nn layout); `bias`: `[out]`.
/// - Returns `[.., out]` with `x`'s leading dimensions, in `x`'s dtype.
///
/// Fast path (CPU, all f32, [`super::fused_ops_enabled`]): one custom op forward and backward (module docs); the
/// gradient of `x` is only computed when `x` is tracked (a variable or derived from one). Elsewhere (CUDA, other
/// dtypes, the switch off): `candle_nn::Linear`'s own ops followed by candle's `relu`, so the results are the same
/// within f32 rounding.
///
/// With [`super::autocast::bf16_enabled`] on this thread and f32 CPU tensors, both paths compute
/// `act(bf16(bf16(x) · bf16(w)ᵀ + bf16(b)))` with f32 accumulation and round every gradient to bf16 (the composed
/// path through candle's `to_dtype` casts), still returning f32 tensors.
///
/// Errors: `weight` not 2-D, `x`'s last dimension not `weight`'s second, `bias` not `[out]`, mixed dtypes or
/// devices — each naming the shapes involved.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, activation: Activation) -> Result<Tensor> {
    let (out_dim, in_dim) = match weight.dims() {
        &[o, i] => (o, i),
        d => candle_core::bail!("linear: weight must be [out, in], got shape {d:?}"),
    };
    match x.dims().last() {
        Some(&last) if last == in_dim => {}
        _ => candle_core::bail!(
            "linear: x {:?} must end in the weight's input size {in_dim} (weight [out, in] = [{out_dim}, {in_dim}])",
            x.dims()
        ),
    }
    if let Some(b) = bias {
        if b.dims() != [out_dim] {
            candle_core::bail!(
                "linear: bias must be [out] = [{out_dim}] for weight [{out_dim}, {in_dim}], got {:?}",
                b.dims()
            );
        }
    }
    let all_f32_cpu = x.device().is_cpu()
        && x.dtype() == DType::F32
        && weight.dtype() == DType::F32
        && bias.is_none_or(|b| b.dtype() == DType::F32);
    let all_f32_cpu = all_f32_cpu && weight.device().is_cpu() && bias.is_none_or(|b| b.device().is_cpu());
    let bf16 = all_f32_cpu && super::autocast::bf16_enabled();
    if !(super::fused_ops_enabled() && all_f32_cpu && x.elem_count() > 0) {
        return if bf16 { composed_bf16(x, weight, bias, activation) } else { composed(x, weight, bias, activation) };
    }
    // The kernel reads x as rows; a tensor whose leading dims do not merge is copied once (tracked, so its
    // gradient still flows).
    let x = if has_rows_view(x) { x.clone() } else { x.contiguous()? };
    let op = LinearOp { activation, bf16, rounded_x: Default::default() };
    match bias {
        Some(b) => x.apply_op3(weight, b, op),
        None => x.apply_op2(weight, op),
    }
}

/// candle's own ops: exactly `candle_nn::Linear::forward` (+ `relu`); a 1-D `x` as one row (candle-nn wants ≥ 2-D).
fn composed(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, activation: Activation) -> Result<Tensor> {
    let layer = candle_nn::Linear::new(weight.clone(), bias.cloned());
    let y = if x.rank() == 1 { layer.forward(&x.unsqueeze(0)?)?.squeeze(0)? } else { layer.forward(x)? };
    match activation {
        Activation::None => Ok(y),
        Activation::Relu => y.relu(),
    }
}

/// [`composed`] under bf16 autocast: the operands and the result pass through candle's bf16 casts, whose
/// backward rounds the gradients to bf16 as the fused op does (the reference the fused op is tested against).
fn composed_bf16(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, activation: Activation) -> Result<Tensor> {
    let round = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
    let bias = bias.map(round).transpose()?;
    let y = round(&composed(&round(x)?, &round(weight)?, bias.as_ref(), Activation::None)?)?;
    match activation {
        Activation::None => Ok(y),
        Activation::Relu => y.relu(),
    }
}

/// The fused op; arguments `(x, weight)` or `(x, weight, bias)`.
#[derive(Debug, Clone)]
struct LinearOp {
    activation: Activation,
    /// bf16 autocast was on when the op was applied: operands and results rounded to bf16 (module docs).
    bf16: bool,
    /// Under autocast: the forward's bf16-rounded copy of x, kept for the weight gradient (PyTorch's autocast keeps
    /// its bf16 copy of x for the backward likewise) instead of rounding x again; the backward takes it, and
    /// rounds x itself when it is gone (a second backward through the same graph).
    rounded_x: std::sync::Arc<std::sync::Mutex<Option<Vec<f32>>>>,
}

/// The matrix of `view` over `data` rounded to bf16, as a packed row-major copy `[rows, cols]` (autocast).
fn rounded_rows(data: &[f32], view: &RowsView) -> Vec<f32> {
    if view.is_packed() {
        rounded_bf16(&data[view.offset..view.offset + view.rows * view.cols])
    } else {
        let mut out = Vec::with_capacity(view.rows * view.cols);
        for i in 0..view.rows {
            out.extend((0..view.cols).map(|j| round_bf16(view.at(data, i, j))));
        }
        out
    }
}

impl LinearOp {
    fn forward(
        &self,
        x: (&[f32], &Layout),
        w: (&[f32], &Layout),
        b: Option<(&[f32], &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let xv = RowsView::of(x.1).ok_or_else(|| candle_core::Error::Msg("linear: x rows do not merge".into()))?;
        let wv = RowsView::of(w.1).ok_or_else(|| candle_core::Error::Msg("linear: weight must be 2-D".into()))?;
        let (n, in_dim, out_dim) = (xv.rows, xv.cols, wv.rows);
        // y[n×out] = x[n×in] · wᵀ[in×out]; under autocast on bf16-rounded copies (the rounding is O(n·in +
        // out·in) against the product's O(n·in·out)).
        let mut y = if self.bf16 {
            let (xr, wr) = (rounded_rows(x.0, &xv), rounded_rows(w.0, &wv));
            let (xm, wm) = (
                MatRef { data: &xr, offset: 0, rs: in_dim, cs: 1 },
                MatRef { data: &wr, offset: 0, rs: in_dim, cs: 1 },
            );
            let y = gemm_new(xm, wm.t(), n, out_dim, in_dim);
            *self.rounded_x.lock().unwrap_or_else(|e| e.into_inner()) = Some(xr);
            y
        } else {
            gemm_new(MatRef::rows(x.0, &xv), MatRef::rows(w.0, &wv).t(), n, out_dim, in_dim)
        };
        let bias: Option<Vec<f32>> = b.map(|(data, l)| {
            let (off, s) = (l.start_offset(), l.stride()[0]);
            let at = |j: usize| data[off + j * s];
            if self.bf16 {
                (0..out_dim).map(|j| round_bf16(at(j))).collect()
            } else {
                (0..out_dim).map(at).collect()
            }
        });
        // Bias and activation in one pass over y; under autocast the bf16 rounding of the result too (ReLU commutes
        // with the rounding: both keep the sign, and 0 is exact). Without it `finish` is the identity, which the
        // compiler removes: the f32 path computes exactly what it did before autocast existed.
        if self.bf16 {
            bias_act(&mut y, bias.as_deref(), self.activation, out_dim, round_bf16);
        } else {
            bias_act(&mut y, bias.as_deref(), self.activation, out_dim, |v| v);
        }
        let mut shape = x.1.dims().to_vec();
        *shape.last_mut().expect("x has rank ≥ 1") = out_dim;
        Ok((CpuStorage::F32(y), Shape::from(shape)))
    }

    /// Gradients of `(x, weight, bias)`; each only when that argument is tracked.
    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (out_dim, in_dim) = w.dims2()?;
        let n = res.elem_count() / out_dim.max(1);
        let want_db = b.is_some_and(|b| b.track_op());
        let grad =
            if RowsView::of(grad.layout()).is_some_and(|v| v.is_packed()) { grad.clone() } else { grad.contiguous()? };
        // Under autocast the products below read bf16-rounded copies: the incoming gradient (the output cast's
        // gradient), the weight and the input (what the forward multiplied). The tracked originals still decide
        // which gradients are wanted.
        let (grad, w_data, x_data) = if self.bf16 {
            let saved = self.rounded_x.lock().unwrap_or_else(|e| e.into_inner()).take();
            let x_data = match saved {
                Some(xr) if w.track_op() => Tensor::from_vec(xr, x.shape(), x.device())?,
                _ if w.track_op() => rounded_tensor(x)?,
                _ => x.clone(),
            };
            let w_data = if x.track_op() { rounded_tensor(w)? } else { w.clone() };
            (rounded_tensor(&grad)?, w_data, x_data)
        } else {
            (grad, w.clone(), x.clone())
        };
        // g' = g ⊙ [y > 0] (ReLU) and db = Σ_rows g', in one pass.
        let mut db = if want_db { vec![0f32; out_dim] } else { Vec::new() };
        let masked: Option<Vec<f32>> = with_f32(&grad, "linear backward", "the output gradient", |g, gl| {
            let g = &g[gl.start_offset()..gl.start_offset() + n * out_dim];
            match self.activation {
                Activation::None => {
                    if want_db {
                        for row in g.chunks_exact(out_dim) {
                            for (s, v) in db.iter_mut().zip(row) {
                                *s += v;
                            }
                        }
                    }
                    Ok(None)
                }
                Activation::Relu => with_f32(res, "linear backward", "the output", |y, yl| {
                    let y = &y[yl.start_offset()..yl.start_offset() + n * out_dim];
                    let mut m = vec![0f32; n * out_dim];
                    for ((mrow, grow), yrow) in
                        m.chunks_exact_mut(out_dim).zip(g.chunks_exact(out_dim)).zip(y.chunks_exact(out_dim))
                    {
                        for ((mv, gv), yv) in mrow.iter_mut().zip(grow).zip(yrow) {
                            *mv = if *yv > 0.0 { *gv } else { 0.0 };
                        }
                        if want_db {
                            for (s, v) in db.iter_mut().zip(mrow.iter()) {
                                *s += v;
                            }
                        }
                    }
                    Ok(Some(m))
                }),
            }
        })?;
        let dev = x.device();
        let (dx, dw) = with_f32(&grad, "linear backward", "the output gradient", |g, gl| {
            let g_mat = match &masked {
                Some(m) => MatRef { data: m, offset: 0, rs: out_dim, cs: 1 },
                None => MatRef { data: g, offset: gl.start_offset(), rs: out_dim, cs: 1 },
            };
            with_f32(&w_data, "linear backward", "weight", |wd, wl| {
                let wv = RowsView::of(wl).expect("weight is 2-D");
                let dx = if x.track_op() {
                    // dx[n×in] = g'[n×out] · w[out×in]
                    let mut dx = gemm_new(g_mat, MatRef::rows(wd, &wv), n, in_dim, out_dim);
                    if self.bf16 {
                        round_bf16_in_place(&mut dx);
                    }
                    Some(Tensor::from_vec(dx, x.shape(), dev)?)
                } else {
                    None
                };
                let dw = if w.track_op() {
                    // dw[out×in] = g'ᵀ[out×n] · x[n×in]
                    let mut dw = with_f32(&x_data, "linear backward", "x", |xd, xl| {
                        let xv = RowsView::of(xl).expect("x rows merge (checked forward)");
                        Ok(gemm_new(g_mat.t(), MatRef::rows(xd, &xv), out_dim, in_dim, n))
                    })?;
                    if self.bf16 {
                        round_bf16_in_place(&mut dw);
                    }
                    Some(Tensor::from_vec(dw, (out_dim, in_dim), dev)?)
                } else {
                    None
                };
                Ok((dx, dw))
            })
        })?;
        if self.bf16 {
            round_bf16_in_place(&mut db);
        }
        let db = if want_db { Some(Tensor::from_vec(db, out_dim, dev)?) } else { None };
        Ok((dx, dw, db))
    }
}

/// `y = finish(act(y + b))` row by row over rows of `out_dim` (the bias broadcast over the rows).
#[inline(always)]
fn bias_act(y: &mut [f32], bias: Option<&[f32]>, activation: Activation, out_dim: usize, finish: impl Fn(f32) -> f32) {
    match (bias, activation) {
        (None, Activation::None) => {
            for v in y.iter_mut() {
                *v = finish(*v);
            }
        }
        (Some(b), Activation::None) => {
            for row in y.chunks_exact_mut(out_dim) {
                for (v, b) in row.iter_mut().zip(b) {
                    *v = finish(*v + b);
                }
            }
        }
        (None, Activation::Relu) => {
            for v in y.iter_mut() {
                *v = finish(v.max(0.0));
            }
        }
        (Some(b), Activation::Relu) => {
            for row in y.chunks_exact_mut(out_dim) {
                for (v, b) in row.iter_mut().zip(b) {
                    *v = finish((*v + b).max(0.0));
                }
            }
        }
    }
}

/// `t` (f32, CPU, leading dims merging into rows) as a packed untracked tensor of its shape rounded to bf16.
fn rounded_tensor(t: &Tensor) -> Result<Tensor> {
    let data = with_f32(t, "linear backward", "an operand", |d, l| {
        let view = RowsView::of(l).ok_or_else(|| candle_core::Error::Msg("linear: rows do not merge".into()))?;
        Ok(rounded_rows(d, &view))
    })?;
    Tensor::from_vec(data, t.shape(), t.device())
}

fn cpu_f32<'a>(s: &'a CpuStorage, what: &str) -> Result<&'a [f32]> {
    super::cpu::f32_slice(s, "linear", what)
}

impl CustomOp2 for LinearOp {
    fn name(&self) -> &'static str {
        "fused-linear"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward((cpu_f32(s1, "x")?, l1), (cpu_f32(s2, "weight")?, l2), None)
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.backward(x, w, None, res, grad)?;
        Ok((dx, dw))
    }
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "fused-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.forward((cpu_f32(s1, "x")?, l1), (cpu_f32(s2, "weight")?, l2), Some((cpu_f32(s3, "bias")?, l3)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.backward(x, w, Some(b), res, grad)
    }
}

/// A linear layer (weight `[out, in]`, optional bias `[out]`) with an optional fused activation; its
/// [`Module::forward`] is [`linear`].
///
/// [`Linear::new_vb`] creates the parameters exactly as `candle_nn::linear` does (names `weight` / `bias` under
/// the `VarBuilder`'s prefix, Kaiming-normal weight, uniform `±1/sqrt(in)` bias), so swapping
/// `candle_nn::Linear` for this type changes neither checkpoints nor initialisation.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    activation: Activation,
}

impl Linear {
    /// A layer over existing tensors (weight `[out, in]`, bias `[out]`), no activation. Shapes are checked on
    /// the first forward.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear { weight, bias, activation: Activation::None }
    }

    /// `in_dim → out_dim` with a bias, parameters from `vb` as `candle_nn::linear(in_dim, out_dim, vb)`.
    pub fn new_vb(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Self> {
        let l = candle_nn::linear(in_dim, out_dim, vb)?;
        Ok(Linear::new(l.weight().clone(), l.bias().cloned()))
    }

    /// `in_dim → out_dim` without a bias, as `candle_nn::linear_no_bias(in_dim, out_dim, vb)`.
    pub fn new_vb_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Self> {
        let l = candle_nn::linear_no_bias(in_dim, out_dim, vb)?;
        Ok(Linear::new(l.weight().clone(), None))
    }

    /// The same layer with `activation` fused into its forward.
    pub fn with_activation(mut self, activation: Activation) -> Self {
        self.activation = activation;
        self
    }

    /// The weight, `[out, in]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, `[out]`.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The fused activation.
    pub fn activation(&self) -> Activation {
        self.activation
    }
}

impl Module for Linear {
    /// `x` `[.., in]` → `act(x · wᵀ + b)` `[.., out]` ([`linear`]).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        linear(x, &self.weight, self.bias.as_ref(), self.activation)
    }
}
