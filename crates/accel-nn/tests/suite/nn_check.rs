//! Helpers of the fused-op tests (`accel_nn::ops`): deterministic inputs, gradients through a probe, and a
//! scale-relative comparison.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};

/// `shape`-shaped f32 CPU tensor, uniform in `[-range, range)`, the same for a given `seed`.
pub fn uniform(shape: &[usize], range: f32, seed: u64) -> Tensor {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-range..range)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// `f` applied to fresh variables holding `inputs` (converted to `dtype`), and the gradients of
/// `Σ f(inputs) · probe` with respect to each input (as f32). The probe makes every output element matter with its
/// own weight, so a wrong gradient anywhere shows.
pub fn value_and_grads(
    inputs: &[&Tensor],
    dtype: DType,
    probe: &Tensor,
    f: impl Fn(&[Tensor]) -> Tensor,
) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()).collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts);
    let loss = (y.to_dtype(DType::F32).unwrap() * probe).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let g =
        vars.iter().map(|v| grads.get(v).expect("an input without gradient").to_dtype(DType::F32).unwrap()).collect();
    (y.to_dtype(DType::F32).unwrap(), g)
}

/// Asserts `max |a − b| ≤ rtol · max |b|` (tolerance relative to the reference's scale, so entries near 0 are
/// held to the precision of the larger ones), and equal shapes.
pub fn assert_close(a: &Tensor, b: &Tensor, rtol: f64, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let a: Vec<f32> = a.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap();
    let b: Vec<f32> = b.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap();
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
    let (worst, at) = a
        .iter()
        .zip(&b)
        .enumerate()
        .map(|(i, (x, y))| ((*x as f64 - *y as f64).abs(), i))
        .fold((0f64, 0), |m, v| if v.0 > m.0 { v } else { m });
    assert!(scale > 0.0, "{what}: the reference is all zeros, the comparison would prove nothing");
    assert!(
        worst <= rtol * scale,
        "{what}: |a − b| = {worst:e} at {at} (a {}, b {}) exceeds {rtol:e} × max|b| = {:e}",
        a[at],
        b[at],
        rtol * scale
    );
}

/// The fused fast paths are on (the tests below compare them with candle's ops; none of them flips the switch).
pub fn assert_fused_on() {
    assert!(
        accel_nn::ops::fused_ops_enabled(),
        "these tests compare the fused kernels with candle's ops: run them without ACCEL_FUSED_OPS=0"
    );
}
