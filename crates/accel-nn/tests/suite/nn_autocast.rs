//! `accel_nn::ops::linear` under bf16 autocast (`accel_nn::ops::autocast`): f32 tensors in and out, every value
//! a bf16 value, forward and backward equal to
//!
//! 1. the autocast reference — candle's `to_dtype(BF16)` casts around `candle_nn::Linear` (what the composed path
//!    computes, written out here so that the process-wide fused-ops switch is never flipped) — within one bf16 ulp
//!    of each element (the two paths sum the f32 products in different orders before rounding), and
//! 2. candle's own bf16 linear on bf16 tensors, within two bf16 ulps of each tensor's largest magnitude (candle's
//!    bf16 product rounds its result once more than the f32 accumulation, and the reference's own gradients pass
//!    through bf16 adds).
//!
//! Each test turns autocast on for its own thread only (the switch is per thread), so the f32 tests of the same
//! binary, which assert exact values, never see it.

use accel_nn::ops::autocast::Bf16Guard;
use accel_nn::ops::linear::{linear, Activation};
use candle_core::{DType, Device, Tensor, Var};

/// Deterministic, irregular values in about [−1, 1] (no exact zeros, so no ReLU ties).
fn data(salt: usize, dims: &[usize]) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((i * 7919 + salt * 104_729) as f32 * 0.618_034).sin() * 0.9 + 0.013).collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
}

fn round(t: &Tensor) -> Tensor {
    t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap()
}

/// `act(bf16(bf16(x) · bf16(w)ᵀ + bf16(b)))` through candle's casts (their backward rounds the gradients).
fn autocast_reference(x: &Tensor, w: &Tensor, b: Option<&Tensor>, act: Activation) -> Tensor {
    let layer = candle_nn::Linear::new(round(w), b.map(round));
    let y = round(&candle_core::Module::forward(&layer, &round(x)).unwrap());
    match act {
        Activation::None => y,
        Activation::Relu => y.relu().unwrap(),
    }
}

/// Every element of `t` is a bf16 value (its low 16 bits are zero).
fn assert_bf16_values(what: &str, t: &Tensor) {
    assert_eq!(t.dtype(), DType::F32, "{what}: autocast keeps f32 tensors");
    for (i, v) in values(t).iter().enumerate() {
        assert_eq!(v.to_bits() & 0xffff, 0, "{what}[{i}] = {v:e} is not a bf16 value");
    }
}

/// `|a − b| ≤ ulps · 2⁻⁷ · m` element by element, `m` = `|b|` (`per_element`) or the tensor's largest `|b|`: one
/// bf16 ulp of a value in [2ᵉ, 2ᵉ⁺¹) is 2ᵉ⁻⁷ ≤ 2⁻⁷·|value|.
fn assert_within_ulps(what: &str, a: &Tensor, b: &Tensor, ulps: f32, per_element: bool) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let (a, b) = (values(a), values(b));
    let max = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(max > 0.0, "{what}: an all-zero reference proves nothing");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let m = if per_element { y.abs() } else { max };
        assert!((x - y).abs() <= ulps * m / 128.0, "{what}[{i}]: {x:e} vs {y:e} (|Δ| {:e})", (x - y).abs());
    }
}

/// One layer: forward and the gradients of x (when tracked), weight and bias under autocast, against
/// [`autocast_reference`] (one ulp per element) and, with `vs_candle_bf16`, candle's bf16 tensors (two ulps of
/// the largest magnitude).
fn check(x_dims: &[usize], out: usize, with_bias: bool, act: Activation, tracked: bool, vs_candle_bf16: bool) {
    let inp = *x_dims.last().unwrap();
    let what = format!("x {x_dims:?} out {out} bias {with_bias} {act:?} tracked {tracked}");
    let _autocast = Bf16Guard::new(true);
    let x_var = Var::from_tensor(&data(3, x_dims)).unwrap();
    // An untracked x is derived from nothing; a tracked one is the variable itself.
    let x = if tracked { x_var.as_tensor().clone() } else { data(3, x_dims) };
    let w = Var::from_tensor(&data(1, &[out, inp]).affine(0.1, 0.0).unwrap()).unwrap();
    let b = with_bias.then(|| Var::from_tensor(&data(2, &[out])).unwrap());
    let bias = b.as_ref().map(|b| b.as_tensor());
    // A loss with distinct bf16 weights per output element, so every gradient entry differs and the incoming
    // gradient is already a bf16 value (both sides then round the same thing).
    let mut out_dims = x_dims.to_vec();
    *out_dims.last_mut().unwrap() = out;
    let r = round(&data(99, &out_dims));

    let ours = linear(&x, w.as_tensor(), bias, act).unwrap();
    let theirs = autocast_reference(&x, w.as_tensor(), bias, act);
    assert_bf16_values(&format!("{what}: y"), &ours);
    assert_within_ulps(&format!("{what}: y vs autocast reference"), &ours, &theirs, 1.0, true);
    let g_ours = ours.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    let g_theirs = theirs.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    let mut grads = vec![("dw", w.as_tensor().clone())];
    grads.extend(b.iter().map(|b| ("db", b.as_tensor().clone())));
    if tracked {
        grads.push(("dx", x_var.as_tensor().clone()));
    }
    for (name, t) in &grads {
        let (g, want) = (g_ours.get(t).unwrap(), g_theirs.get(t).unwrap());
        assert_bf16_values(&format!("{what}: {name}"), g);
        assert_within_ulps(&format!("{what}: {name} vs autocast reference"), g, want, 1.0, true);
    }

    if !vs_candle_bf16 {
        return;
    }
    // candle's bf16 tensors: the same layer with bf16 parameters and input.
    let bf = |t: &Tensor| Var::from_tensor(&t.to_dtype(DType::BF16).unwrap()).unwrap();
    let (xb, wb, bb) = (bf(&x), bf(w.as_tensor()), b.as_ref().map(|b| bf(b.as_tensor())));
    let layer = candle_nn::Linear::new(wb.as_tensor().clone(), bb.as_ref().map(|b| b.as_tensor().clone()));
    let mut yb = candle_core::Module::forward(&layer, xb.as_tensor()).unwrap();
    if act == Activation::Relu {
        yb = yb.relu().unwrap();
    }
    assert_within_ulps(&format!("{what}: y vs candle bf16"), &ours, &yb, 2.0, false);
    let g_bf = yb.mul(&r.to_dtype(DType::BF16).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    let mut pairs = vec![("dw", w.as_tensor(), wb.as_tensor())];
    if let (Some(b), Some(bb)) = (&b, &bb) {
        pairs.push(("db", b.as_tensor(), bb.as_tensor()));
    }
    if tracked {
        pairs.push(("dx", x_var.as_tensor(), xb.as_tensor()));
    }
    for (name, ours_t, theirs_t) in pairs {
        assert_within_ulps(
            &format!("{what}: {name} vs candle bf16"),
            g_ours.get(ours_t).unwrap(),
            g_bf.get(theirs_t).unwrap(),
            2.0,
            false,
        );
    }
}

#[test]
fn autocast_linear_matches_bf16_references_2d_and_3d_with_bias_relu_and_none() {
    for x_dims in [&[5, 7][..], &[2, 3, 7][..]] {
        for with_bias in [false, true] {
            for act in [Activation::None, Activation::Relu] {
                for tracked in [false, true] {
                    check(x_dims, 4, with_bias, act, tracked, true);
                }
            }
        }
    }
}

#[test]
fn autocast_linear_matches_bf16_references_at_mlp_sizes() {
    // Sizes past gemm's blocking: the MNIST MLP's first layer on a batch of 33 rows. With ReLU only against the
    // autocast reference: over 784 terms some outputs land within an ulp of 0, where candle's bf16 product (one
    // rounding more) can take the other side of the ReLU and move a whole row of the weight gradient.
    check(&[33, 784], 256, true, Activation::Relu, true, false);
    check(&[33, 784], 256, true, Activation::None, true, true);
    check(&[33, 256], 10, true, Activation::None, true, true);
}

/// The products really are bf16 ones: an input that bf16 cannot hold gives the bf16 answer, not the f32 one.
#[test]
fn autocast_rounds_the_operands_and_off_gives_f32() {
    let eps = 2f32.powi(-10); // below bf16's resolution at 1 (2⁻⁷)
    let x = Tensor::new(&[[1.0 + eps, 1.0]], &Device::Cpu).unwrap();
    let w = Tensor::new(&[[1.0f32, 1.0]], &Device::Cpu).unwrap();
    let f32_y = linear(&x, &w, None, Activation::None).unwrap().to_vec2::<f32>().unwrap()[0][0];
    assert_eq!(f32_y, 2.0 + eps);
    let bf16_y = {
        let _autocast = Bf16Guard::new(true);
        linear(&x, &w, None, Activation::None).unwrap().to_vec2::<f32>().unwrap()[0][0]
    };
    assert_eq!(bf16_y, 2.0);
    // The guard is gone: f32 again, bit for bit.
    let again = linear(&x, &w, None, Activation::None).unwrap().to_vec2::<f32>().unwrap()[0][0];
    assert_eq!(again.to_bits(), f32_y.to_bits());
}

/// The forward keeps its rounded x for the weight gradient and the backward takes it; a second backward through
/// the same graph rounds x again and gets the same gradients, bit for bit.
#[test]
fn a_second_backward_through_the_same_graph_gives_the_same_gradients() {
    let _autocast = Bf16Guard::new(true);
    let x = Var::from_tensor(&data(3, &[6, 9])).unwrap();
    let w = Var::from_tensor(&data(1, &[5, 9])).unwrap();
    let b = Var::from_tensor(&data(2, &[5])).unwrap();
    let loss = linear(x.as_tensor(), w.as_tensor(), Some(b.as_tensor()), Activation::Relu)
        .unwrap()
        .mul(&round(&data(99, &[6, 5])))
        .unwrap()
        .sum_all()
        .unwrap();
    let (first, second) = (loss.backward().unwrap(), loss.backward().unwrap());
    for v in [&x, &w, &b] {
        let (a, b) = (values(first.get(v.as_tensor()).unwrap()), values(second.get(v.as_tensor()).unwrap()));
        assert_eq!(
            a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert!(a.iter().any(|v| *v != 0.0), "a gradient of zeros proves nothing");
    }
}
