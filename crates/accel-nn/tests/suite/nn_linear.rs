//! `accel_nn::ops::linear`: forward values and the gradients of x, weight and bias against candle's composed ops
//! (`candle_nn::Linear` + `relu`, called directly so the process-wide switch is never flipped), at a relative
//! tolerance of 1e-5 of each tensor's largest magnitude (the products sum in a different order).

use accel_nn::ops::linear::{linear, Activation, Linear};
use candle_core::{DType, Device, Module, Tensor, Var};

/// Deterministic, irregular values in about [−1, 1] (no exact zeros, so no ReLU ties).
fn data(salt: usize, dims: &[usize]) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((i * 7919 + salt * 104_729) as f32 * 0.618_034).sin() * 0.9 + 0.013).collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// `|a − b| ≤ 1e-5 · max|b|` element by element, with the shapes equal.
fn assert_close(what: &str, a: &Tensor, b: &Tensor) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let (a, b) = (values(a), values(b));
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * scale, "{what}[{i}]: {x} vs {y} (scale {scale})");
    }
}

/// candle-nn's layer (+ relu); a 1-D x as one row (candle-nn's matmul wants ≥ 2-D).
fn reference(x: &Tensor, w: &Tensor, b: Option<&Tensor>, act: Activation) -> Tensor {
    let layer = candle_nn::Linear::new(w.clone(), b.cloned());
    let y = if x.rank() == 1 {
        layer.forward(&x.unsqueeze(0).unwrap()).unwrap().squeeze(0).unwrap()
    } else {
        layer.forward(x).unwrap()
    };
    match act {
        Activation::None => y,
        Activation::Relu => y.relu().unwrap(),
    }
}

/// One case: `x` of `x_dims` (built by `make_x` from a base tensor, e.g. a transpose), weight `[out, in]`.
#[allow(clippy::too_many_arguments)]
fn check(x: &Tensor, x_var: Option<&Var>, w: &Tensor, w_var: &Var, b: Option<&Var>, act: Activation, what: &str) {
    let out_dims = {
        let mut d = x.dims().to_vec();
        *d.last_mut().unwrap() = w.dim(0).unwrap();
        d
    };
    // A loss with distinct weights per output element, so every gradient entry differs.
    let r = data(99, &out_dims);
    let bias = b.map(|b| b.as_tensor());
    let ours = linear(x, w, bias, act).unwrap();
    let theirs = reference(x, w, bias, act);
    assert_close(&format!("{what}: y"), &ours, &theirs);
    let g_ours = ours.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    let g_theirs = theirs.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    assert_close(
        &format!("{what}: dw"),
        g_ours.get(w_var.as_tensor()).unwrap(),
        g_theirs.get(w_var.as_tensor()).unwrap(),
    );
    if let Some(b) = b {
        assert_close(&format!("{what}: db"), g_ours.get(b.as_tensor()).unwrap(), g_theirs.get(b.as_tensor()).unwrap());
    }
    match x_var {
        Some(xv) => assert_close(
            &format!("{what}: dx"),
            g_ours.get(xv.as_tensor()).expect("tracked x has a gradient"),
            g_theirs.get(xv.as_tensor()).unwrap(),
        ),
        // candle's 2-D matmul backward computes the lhs gradient even of an untracked input (it lands in the
        // GradStore); the fused op skips it.
        None if accel_nn::ops::fused_ops_enabled() && !x.track_op() => {
            assert!(g_ours.get(x).is_none(), "{what}: an untracked x must get no gradient");
        }
        None => {}
    }
}

#[test]
fn linear_matches_candle_nn_2d_and_3d_with_and_without_bias_relu_and_none() {
    let (inp, out) = (7, 4);
    for x_dims in [&[5, inp][..], &[2, 3, inp][..], &[inp][..]] {
        for with_bias in [false, true] {
            for act in [Activation::None, Activation::Relu] {
                for tracked in [false, true] {
                    let w = Var::from_tensor(&data(1, &[out, inp])).unwrap();
                    let b = with_bias.then(|| Var::from_tensor(&data(2, &[out])).unwrap());
                    let what = format!("x {x_dims:?} bias {with_bias} {act:?} tracked {tracked}");
                    if tracked {
                        let x = Var::from_tensor(&data(3, x_dims)).unwrap();
                        check(x.as_tensor(), Some(&x), w.as_tensor(), &w, b.as_ref(), act, &what);
                    } else {
                        let x = data(3, x_dims);
                        check(&x, None, w.as_tensor(), &w, b.as_ref(), act, &what);
                    }
                }
            }
        }
    }
}

#[test]
fn linear_matches_candle_nn_at_mlp_sizes() {
    // Sizes past gemm's blocking (a 784-512 layer on a batch of 33 rows), x derived from a variable.
    let x0 = Var::from_tensor(&data(4, &[33, 784])).unwrap();
    let x = x0.as_tensor().affine(0.5, 0.1).unwrap();
    let w = Var::from_tensor(&data(5, &[512, 784]).affine(0.05, 0.0).unwrap()).unwrap();
    let b = Var::from_tensor(&data(6, &[512])).unwrap();
    check(&x, None, w.as_tensor(), &w, Some(&b), Activation::Relu, "mlp sizes");
    let g = linear(&x, w.as_tensor(), Some(b.as_tensor()), Activation::Relu)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g_ref =
        reference(&x, w.as_tensor(), Some(b.as_tensor()), Activation::Relu).sum_all().unwrap().backward().unwrap();
    assert_close(
        "mlp sizes: dx0 through the affine",
        g.get(x0.as_tensor()).unwrap(),
        g_ref.get(x0.as_tensor()).unwrap(),
    );
}

#[test]
fn linear_takes_non_contiguous_x_and_weight() {
    let (inp, out) = (6, 3);
    // 2-D transposed x: strides (1, 5), read in place.
    let xt = Var::from_tensor(&data(7, &[inp, 5])).unwrap();
    let x = xt.as_tensor().t().unwrap();
    assert!(!x.is_contiguous());
    let w = Var::from_tensor(&data(8, &[out, inp])).unwrap();
    let b = Var::from_tensor(&data(9, &[out])).unwrap();
    for act in [Activation::None, Activation::Relu] {
        let ours = linear(&x, w.as_tensor(), Some(b.as_tensor()), act).unwrap();
        let theirs = reference(&x, w.as_tensor(), Some(b.as_tensor()), act);
        assert_close("transposed x: y", &ours, &theirs);
        let r = data(10, ours.dims());
        let g = ours.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
        let g_ref = theirs.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
        assert_close("transposed x: dx", g.get(xt.as_tensor()).unwrap(), g_ref.get(xt.as_tensor()).unwrap());
        assert_close("transposed x: dw", g.get(w.as_tensor()).unwrap(), g_ref.get(w.as_tensor()).unwrap());
    }
    // 3-D x whose leading dims do not merge (a transpose of the first two), and a transposed weight.
    let x3 = Var::from_tensor(&data(11, &[3, 2, inp])).unwrap();
    let x = x3.as_tensor().transpose(0, 1).unwrap();
    let wt = Var::from_tensor(&data(12, &[inp, out])).unwrap();
    let w = wt.as_tensor().t().unwrap();
    let ours = linear(&x, &w, None, Activation::Relu).unwrap();
    let theirs = reference(&x.contiguous().unwrap(), &w, None, Activation::Relu);
    assert_close("permuted 3-D x: y", &ours, &theirs);
    let r = data(13, ours.dims());
    let g = ours.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    let g_ref = theirs.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    assert_close("permuted 3-D x: dx", g.get(x3.as_tensor()).unwrap(), g_ref.get(x3.as_tensor()).unwrap());
    assert_close("transposed w: dw", g.get(wt.as_tensor()).unwrap(), g_ref.get(wt.as_tensor()).unwrap());
}

#[test]
fn linear_layer_builds_like_candle_nn_linear_and_fuses_relu() {
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let layer = Linear::new_vb(5, 3, vb.pp("fc1")).unwrap().with_activation(Activation::Relu);
    let no_bias = Linear::new_vb_no_bias(5, 2, vb.pp("fc2")).unwrap();
    let mut names: Vec<String> = varmap.data().lock().unwrap().keys().cloned().collect();
    names.sort();
    assert_eq!(names, ["fc1.bias", "fc1.weight", "fc2.weight"]);
    assert_eq!(layer.weight().dims(), [3, 5]);
    assert_eq!(layer.bias().unwrap().dims(), [3]);
    assert!(no_bias.bias().is_none());
    // candle_nn's bias init: uniform in ±1/sqrt(in).
    let bound = 1.0 / 5f32.sqrt();
    assert!(values(layer.bias().unwrap()).iter().all(|b| b.abs() <= bound));
    let x = data(14, &[4, 5]);
    let expected = reference(&x, layer.weight(), layer.bias(), Activation::Relu);
    assert_close("Linear::forward", &layer.forward(&x).unwrap(), &expected);
    assert_close("no bias", &no_bias.forward(&x).unwrap(), &reference(&x, no_bias.weight(), None, Activation::None));
}

#[test]
fn linear_falls_back_to_candle_for_other_dtypes() {
    let x = data(15, &[3, 4]).to_dtype(DType::F64).unwrap();
    let w = data(16, &[2, 4]).to_dtype(DType::F64).unwrap();
    let y = linear(&x, &w, None, Activation::Relu).unwrap();
    assert_eq!(y.dtype(), DType::F64);
    let expected = x.matmul(&w.t().unwrap()).unwrap().relu().unwrap();
    let diff = (y - expected).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
    assert!(diff < 1e-12, "{diff}");
}

#[test]
fn linear_bad_shapes_name_the_problem() {
    let x = data(17, &[3, 4]);
    let err = linear(&x, &data(18, &[2, 5]), None, Activation::None).unwrap_err().to_string();
    assert!(err.contains("x [3, 4] must end in the weight's input size 5"), "{err}");
    let err = linear(&x, &data(18, &[2, 4, 1]), None, Activation::None).unwrap_err().to_string();
    assert!(err.contains("weight must be [out, in], got shape [2, 4, 1]"), "{err}");
    let err = linear(&x, &data(18, &[2, 4]), Some(&data(19, &[3])), Activation::None).unwrap_err().to_string();
    assert!(err.contains("bias must be [out] = [2]"), "{err}");
}

#[test]
fn fused_ops_are_on_by_default() {
    if std::env::var(accel_nn::ops::FUSED_OPS_ENV).is_err() {
        assert!(accel_nn::ops::fused_ops_enabled());
    }
}
