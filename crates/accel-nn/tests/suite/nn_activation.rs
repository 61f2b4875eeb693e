//! `accel_nn::ops::activation::gelu`: value and gradient against candle's `Tensor::gelu` (the same tanh formula, evaluated as `x·σ(2u)`)
//! and against the f64 formula; strided input; fallback dtypes.

use super::nn_check::{assert_close, assert_fused_on, uniform, value_and_grads};
use accel_nn::ops::activation::gelu;
use candle_core::{DType, Device, Tensor};

#[test]
fn matches_candle_gelu() {
    assert_fused_on();
    // Sizes below and above the kernels' parallel split, and not multiples of its block.
    for (i, shape) in [vec![7], vec![3, 5, 11], vec![2, 3, 4, 5], vec![16, 64, 512], vec![70001]].iter().enumerate() {
        let x = uniform(shape, 6.0, i as u64);
        let probe = uniform(shape, 1.0, 50 + i as u64);
        let (y, g) = value_and_grads(&[&x], DType::F32, &probe, |t| gelu(&t[0]).unwrap());
        let (y_ref, g_ref) = value_and_grads(&[&x], DType::F32, &probe, |t| t[0].gelu().unwrap());
        assert_close(&y, &y_ref, 1e-5, &format!("gelu {shape:?}"));
        // candle's backward uses 6-digit constants (0.797885, 0.0356774, ...): equal within 1e-5 of the scale.
        assert_close(&g[0], &g_ref[0], 1e-5, &format!("gelu grad {shape:?}"));
        // And the exact derivative, in f64 (candle's gelu on f64 takes the fallback).
        let (y64, g64) = value_and_grads(&[&x], DType::F64, &probe, |t| gelu(&t[0]).unwrap());
        assert_close(&y, &y64, 1e-5, &format!("gelu f64 {shape:?}"));
        assert_close(&g[0], &g64[0], 1e-5, &format!("gelu grad f64 {shape:?}"));
    }
}

#[test]
fn known_values() {
    // gelu(0) = 0, gelu'(0) = 0.5; gelu(1) = 0.5·(1 + tanh(√(2/π)·1.044715)) = 0.841192 (PyTorch's tanh GELU).
    let x = Tensor::new(&[0f32, 1.0, -1.0], &Device::Cpu).unwrap();
    let y: Vec<f32> = gelu(&x).unwrap().to_vec1().unwrap();
    assert_eq!(y[0], 0.0);
    assert!((y[1] - 0.841_192).abs() < 1e-6 && (y[2] + 0.158_808).abs() < 1e-6, "{y:?}");
    let probe = Tensor::ones(3, DType::F32, &Device::Cpu).unwrap();
    let (_, g) = value_and_grads(&[&x], DType::F32, &probe, |t| gelu(&t[0]).unwrap());
    assert_eq!(g[0].to_vec1::<f32>().unwrap()[0], 0.5);
}

#[test]
fn strided_input_and_bf16() {
    assert_fused_on();
    let base = uniform(&[12, 5], 3.0, 9);
    let probe = uniform(&[5, 12], 1.0, 10);
    let (y, g) = value_and_grads(&[&base], DType::F32, &probe, |t| gelu(&t[0].t().unwrap()).unwrap());
    let (y_ref, g_ref) = value_and_grads(&[&base], DType::F32, &probe, |t| t[0].t().unwrap().gelu().unwrap());
    assert_close(&y, &y_ref, 1e-5, "strided gelu");
    assert_close(&g[0], &g_ref[0], 1e-5, "strided gelu grad");
    let yb = gelu(&base.to_dtype(DType::BF16).unwrap()).unwrap();
    assert_eq!(yb.dtype(), DType::BF16);
    assert_close(&yb, &base.gelu().unwrap(), 1e-2, "bf16 gelu");
}
