//! `accel_nn::ops::softmax`: `softmax_last_dim` and `causal_softmax` against candle-nn's composed `ops::softmax`
//! (with an explicit −∞ mask for the causal variant), values and gradients; exact zeros above the diagonal; bad
//! arguments.

use super::nn_check::{assert_close, assert_fused_on, uniform, value_and_grads};
use accel_nn::ops::softmax::{causal_softmax, softmax_last_dim};
use candle_core::{DType, Device, Tensor, D};

/// `[s, s]`: 0 where key ≤ query, −∞ above the diagonal (the reference's mask, built here independently).
fn mask(s: usize) -> Tensor {
    let v: Vec<f32> = (0..s * s).map(|k| if k % s <= k / s { 0.0 } else { f32::NEG_INFINITY }).collect();
    Tensor::from_vec(v, (s, s), &Device::Cpu).unwrap()
}

fn reference_causal(x: &Tensor, scale: f64) -> Tensor {
    let s = *x.dims().last().unwrap();
    candle_nn::ops::softmax(&(x * scale).unwrap().broadcast_add(&mask(s)).unwrap(), D::Minus1).unwrap()
}

#[test]
fn softmax_matches_candle() {
    assert_fused_on();
    for (i, shape) in [vec![5], vec![3, 7], vec![2, 3, 33], vec![2, 2, 3, 64], vec![16, 4, 64, 64]].iter().enumerate() {
        let x = uniform(shape, 4.0, i as u64);
        let probe = uniform(shape, 1.0, 100 + i as u64);
        let (y, g) = value_and_grads(&[&x], DType::F32, &probe, |t| softmax_last_dim(&t[0]).unwrap());
        let (y_ref, g_ref) =
            value_and_grads(&[&x], DType::F32, &probe, |t| candle_nn::ops::softmax(&t[0], D::Minus1).unwrap());
        assert_close(&y, &y_ref, 1e-5, &format!("softmax {shape:?}"));
        assert_close(&g[0], &g_ref[0], 1e-5, &format!("softmax grad {shape:?}"));
    }
}

#[test]
fn causal_softmax_matches_scaled_masked_softmax() {
    assert_fused_on();
    for (i, (shape, scale)) in [
        (vec![2, 2], 1.0),
        (vec![5, 5], 0.5),
        (vec![3, 9, 9], 1.0 / 8f64.sqrt()),
        (vec![2, 4, 16, 16], 0.25),
        (vec![16, 4, 64, 64], 1.0 / 32f64.sqrt()),
    ]
    .iter()
    .enumerate()
    {
        let x = uniform(shape, 6.0, 10 + i as u64);
        let probe = uniform(shape, 1.0, 200 + i as u64);
        let (y, g) = value_and_grads(&[&x], DType::F32, &probe, |t| causal_softmax(&t[0], *scale).unwrap());
        let (y_ref, g_ref) = value_and_grads(&[&x], DType::F32, &probe, |t| reference_causal(&t[0], *scale));
        assert_close(&y, &y_ref, 1e-5, &format!("causal {shape:?}"));
        assert_close(&g[0], &g_ref[0], 1e-5, &format!("causal grad {shape:?}"));
    }
}

#[test]
fn masked_entries_are_exactly_zero() {
    assert_fused_on();
    let s = 6;
    let x = uniform(&[2, 3, s, s], 5.0, 3);
    let probe = uniform(&[2, 3, s, s], 1.0, 4);
    let (y, g) = value_and_grads(&[&x], DType::F32, &probe, |t| causal_softmax(&t[0], 0.7).unwrap());
    let y: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
    let g: Vec<f32> = g[0].flatten_all().unwrap().to_vec1().unwrap();
    for (k, (p, d)) in y.iter().zip(&g).enumerate() {
        let (query, key) = ((k / s) % s, k % s);
        if key > query {
            assert_eq!((*p, *d), (0.0, 0.0), "entry {k} (query {query}, key {key}) is masked");
        } else {
            assert!(*p > 0.0, "entry {k} (query {query}, key {key}) is visible: {p}");
        }
    }
    // Each row sums to 1; the first query sees only itself.
    for row in y.chunks(s) {
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6, "{row:?}");
    }
    assert_eq!(y[0], 1.0);
}

#[test]
fn strided_input_matches() {
    assert_fused_on();
    // Scores as the transpose of the last two dims of a contiguous tensor (like k·qᵀ read the other way round).
    let base = uniform(&[2, 8, 8], 3.0, 21);
    let probe = uniform(&[2, 8, 8], 1.0, 22);
    let run = |fused: bool| {
        value_and_grads(&[&base], DType::F32, &probe, |t| {
            let x = t[0].transpose(1, 2).unwrap();
            assert!(!x.is_contiguous());
            if fused {
                causal_softmax(&x, 0.3).unwrap()
            } else {
                reference_causal(&x, 0.3)
            }
        })
    };
    let ((y, g), (y_ref, g_ref)) = (run(true), run(false));
    assert_close(&y, &y_ref, 1e-5, "strided causal");
    assert_close(&g[0], &g_ref[0], 1e-5, "strided causal grad");
    let x = base.transpose(1, 2).unwrap();
    assert_close(
        &softmax_last_dim(&x).unwrap(),
        &candle_nn::ops::softmax(&x, D::Minus1).unwrap(),
        1e-5,
        "strided softmax",
    );
}

#[test]
fn fallback_dtypes_agree_with_the_fused_path() {
    // f64 and bf16 take candle's ops with the cached mask (two calls: the second one reads the cache).
    let x = uniform(&[2, 3, 10, 10], 4.0, 31);
    let probe = uniform(&[2, 3, 10, 10], 1.0, 32);
    let f = |t: &[Tensor]| causal_softmax(&t[0], 0.5).unwrap();
    let (y32, g32) = value_and_grads(&[&x], DType::F32, &probe, f);
    for _ in 0..2 {
        let (y64, g64) = value_and_grads(&[&x], DType::F64, &probe, f);
        assert_close(&y32, &y64, 1e-5, "causal f32 vs f64");
        assert_close(&g32[0], &g64[0], 1e-5, "causal grad f32 vs f64");
    }
    let yb = causal_softmax(&x.to_dtype(DType::BF16).unwrap(), 0.5).unwrap();
    assert_eq!(yb.dtype(), DType::BF16);
    assert_close(&yb, &y32, 1e-2, "causal bf16");
    let y64 = softmax_last_dim(&x.to_dtype(DType::F64).unwrap()).unwrap();
    assert_close(&softmax_last_dim(&x).unwrap(), &y64, 1e-5, "softmax f32 vs f64");
}

#[test]
fn bad_arguments_are_named() {
    let err = |r: accel_nn::Result<Tensor>| r.unwrap_err().to_string();
    let e = err(causal_softmax(&uniform(&[2, 3, 4], 1.0, 0), 1.0));
    assert!(e.contains("shape [2, 3, 4]; expected [.., s, s]"), "{e}");
    let e = err(causal_softmax(&uniform(&[4], 1.0, 0), 1.0));
    assert!(e.contains("shape [4]"), "{e}");
    let e = err(causal_softmax(&uniform(&[4, 4], 1.0, 0), f64::INFINITY));
    assert!(e.contains("scale = inf") && e.contains("must be finite"), "{e}");
    let e = err(softmax_last_dim(&Tensor::new(1f32, &Device::Cpu).unwrap()));
    assert!(e.contains("x is a scalar"), "{e}");
}
