//! `accel_nn::ops::attention::causal_self_attention` against attention written out in candle's ops (heads split,
//! `q kᵀ`, an explicit −∞ mask, candle-nn's softmax, `· v`, heads merged): values and the gradients of q, k and v,
//! for several shapes (one sequence, one head, one position, the char-GPT's); strided inputs; the fallback dtypes;
//! causality; bad arguments.

use super::nn_check::{assert_close, assert_fused_on, uniform, value_and_grads};
use accel_nn::ops::attention::causal_self_attention;
use candle_core::{DType, Device, Tensor, D};

/// Attention in candle's composed ops, built here independently of the library.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, n_head: usize, scale: f64) -> Tensor {
    let (b, s, d) = q.dims3().unwrap();
    let heads =
        |t: &Tensor| t.reshape((b, s, n_head, d / n_head)).unwrap().transpose(1, 2).unwrap().contiguous().unwrap();
    let (q, k, v) = (heads(q), heads(k), heads(v));
    let scores = (q.matmul(&k.t().unwrap()).unwrap() * scale).unwrap();
    let mask: Vec<f32> = (0..s * s).map(|i| if i % s <= i / s { 0.0 } else { f32::NEG_INFINITY }).collect();
    let mask = Tensor::from_vec(mask, (s, s), &Device::Cpu).unwrap().to_dtype(scores.dtype()).unwrap();
    let att = candle_nn::ops::softmax(&scores.broadcast_add(&mask).unwrap(), D::Minus1).unwrap();
    att.matmul(&v).unwrap().transpose(1, 2).unwrap().reshape((b, s, d)).unwrap()
}

#[test]
fn matches_attention_in_candle_ops() {
    assert_fused_on();
    // (b, s, n_head, head_dim): small; one sequence (no parallel split); one head; one position; the char-GPT's.
    for (i, &(b, s, h, hd)) in
        [(2, 5, 2, 4), (1, 9, 3, 8), (3, 7, 1, 16), (2, 1, 2, 4), (16, 64, 4, 32)].iter().enumerate()
    {
        let shape = [b, s, h * hd];
        let (q, k, v) =
            (uniform(&shape, 1.5, i as u64), uniform(&shape, 1.5, 50 + i as u64), uniform(&shape, 1.0, 90 + i as u64));
        let probe = uniform(&shape, 1.0, 130 + i as u64);
        let scale = 1.0 / (hd as f64).sqrt();
        let (y, g) = value_and_grads(&[&q, &k, &v], DType::F32, &probe, |t| {
            causal_self_attention(&t[0], &t[1], &t[2], h, scale).unwrap()
        });
        let (y_ref, g_ref) =
            value_and_grads(&[&q, &k, &v], DType::F32, &probe, |t| reference(&t[0], &t[1], &t[2], h, scale));
        let what = format!("b {b}, s {s}, {h} heads of {hd}");
        assert_close(&y, &y_ref, 1e-5, &format!("{what}: output"));
        for (name, (a, r)) in ["q", "k", "v"].iter().zip(g.iter().zip(&g_ref)) {
            if s == 1 && *name != "v" {
                // One key: the softmax is the constant 1, so q and k get exactly no gradient.
                let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
                assert!(a.iter().all(|x| *x == 0.0), "{what}: gradient of {name} should be 0: {a:?}");
                continue;
            }
            assert_close(a, r, 1e-5, &format!("{what}: gradient of {name}"));
        }
    }
}

#[test]
fn a_query_never_sees_later_keys() {
    assert_fused_on();
    // Changing the keys and values of positions after t leaves outputs 0..=t exactly as they were.
    let (b, s, h, hd) = (2, 8, 2, 4);
    let shape = [b, s, h * hd];
    let (q, k, v) = (uniform(&shape, 1.0, 1), uniform(&shape, 1.0, 2), uniform(&shape, 1.0, 3));
    let y = causal_self_attention(&q, &k, &v, h, 0.5).unwrap();
    let t = 4;
    let later = |x: &Tensor, seed| {
        let noise = uniform(&[b, s - t - 1, h * hd], 5.0, seed);
        Tensor::cat(&[&x.narrow(1, 0, t + 1).unwrap(), &noise], 1).unwrap()
    };
    let y2 = causal_self_attention(&q, &later(&k, 10), &later(&v, 11), h, 0.5).unwrap();
    let (a, c): (Vec<f32>, Vec<f32>) = (
        y.narrow(1, 0, t + 1).unwrap().flatten_all().unwrap().to_vec1().unwrap(),
        y2.narrow(1, 0, t + 1).unwrap().flatten_all().unwrap().to_vec1().unwrap(),
    );
    assert_eq!(a, c, "outputs up to position {t} moved when only later keys/values changed");
    let last = |y: &Tensor| -> Vec<f32> { y.narrow(1, s - 1, 1).unwrap().flatten_all().unwrap().to_vec1().unwrap() };
    assert_ne!(last(&y), last(&y2), "the last position does see the changed keys");
    // The first position attends to itself only: its output is its own value.
    assert_close(&y.narrow(1, 0, 1).unwrap(), &v.narrow(1, 0, 1).unwrap(), 1e-6, "position 0 = its value");
}

#[test]
fn strided_inputs_match() {
    assert_fused_on();
    // q, k, v as three column blocks of one fused projection [b, s, 3d] (not contiguous).
    let (b, s, h, hd) = (2, 6, 2, 4);
    let d = h * hd;
    let qkv = uniform(&[b, s, 3 * d], 1.0, 7);
    let probe = uniform(&[b, s, d], 1.0, 8);
    let run = |fused: bool| {
        value_and_grads(&[&qkv], DType::F32, &probe, |t| {
            let part = |i| t[0].narrow(2, i * d, d).unwrap();
            let (q, k, v) = (part(0), part(1), part(2));
            assert!(!q.is_contiguous());
            if fused {
                causal_self_attention(&q, &k, &v, h, 0.3).unwrap()
            } else {
                reference(&q, &k, &v, h, 0.3)
            }
        })
    };
    let ((y, g), (y_ref, g_ref)) = (run(true), run(false));
    assert_close(&y, &y_ref, 1e-5, "strided output");
    assert_close(&g[0], &g_ref[0], 1e-5, "strided gradient of the fused projection");
}

#[test]
fn fallback_dtypes_agree_with_the_fused_path() {
    let shape = [2, 5, 6];
    let (q, k, v) = (uniform(&shape, 1.0, 21), uniform(&shape, 1.0, 22), uniform(&shape, 1.0, 23));
    let probe = uniform(&shape, 1.0, 24);
    let f = |t: &[Tensor]| causal_self_attention(&t[0], &t[1], &t[2], 3, 0.6).unwrap();
    let (y32, g32) = value_and_grads(&[&q, &k, &v], DType::F32, &probe, f);
    let (y64, g64) = value_and_grads(&[&q, &k, &v], DType::F64, &probe, f);
    assert_close(&y32, &y64, 1e-5, "f32 vs f64 output");
    for (a, r) in g32.iter().zip(&g64) {
        assert_close(a, r, 1e-5, "f32 vs f64 gradient");
    }
    let yb = f(&[q.to_dtype(DType::BF16).unwrap(), k.to_dtype(DType::BF16).unwrap(), v.to_dtype(DType::BF16).unwrap()]);
    assert_eq!(yb.dtype(), DType::BF16);
    assert_close(&yb, &y32, 2e-2, "bf16 output");
}

#[test]
fn bad_arguments_are_named() {
    let err = |r: accel_nn::Result<Tensor>| r.unwrap_err().to_string();
    let x = uniform(&[2, 3, 8], 1.0, 0);
    let e = err(causal_self_attention(&x, &x, &uniform(&[2, 3, 4], 1.0, 0), 2, 1.0));
    assert!(e.contains("v [2, 3, 4]") && e.contains("[b, s, n_head · head_dim]"), "{e}");
    let e = err(causal_self_attention(&uniform(&[3, 8], 1.0, 0), &x, &x, 2, 1.0));
    assert!(e.contains("q [3, 8]"), "{e}");
    let e = err(causal_self_attention(&x, &x, &x, 3, 1.0));
    assert!(e.contains("n_head = 3 does not divide the last dimension 8"), "{e}");
    let e = err(causal_self_attention(&x, &x, &x, 0, 1.0));
    assert!(e.contains("n_head = 0"), "{e}");
    let e = err(causal_self_attention(&x, &x, &x, 2, f64::NAN));
    assert!(e.contains("scale = NaN") && e.contains("must be finite"), "{e}");
    // Finite in f64 but not in the f32 the kernel computes in: refused rather than an output of NaN.
    let e = err(causal_self_attention(&x, &x, &x, 2, 1e300));
    assert!(e.contains("finite in f32"), "{e}");
}
