//! `accel_nn::ops::cross_entropy`: values and logits gradients against `candle_nn::loss::cross_entropy` (called
//! directly, so the process-wide switch is never flipped), the summed form with ignored rows, and the errors.

use accel_nn::ops::cross_entropy::{cross_entropy, cross_entropy_sum};
use candle_core::{DType, Device, Tensor, Var};

fn data(salt: usize, dims: &[usize]) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((i * 7919 + salt * 104_729) as f32 * 0.618_034).sin() * 3.0).collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn assert_close(what: &str, a: &Tensor, b: &Tensor) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let (a, b) = (values(a), values(b));
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * scale, "{what}[{i}]: {x} vs {y}");
    }
}

/// Loss times 3 (so the incoming gradient is not 1) and its logits gradient.
fn loss_and_grad(logits: &Var, f: impl Fn(&Tensor) -> Tensor) -> (Tensor, Tensor) {
    let loss = f(logits.as_tensor());
    let grads = loss.affine(3.0, 0.0).unwrap().backward().unwrap();
    (loss, grads.get(logits.as_tensor()).unwrap().clone())
}

#[test]
fn cross_entropy_matches_candle_nn_for_every_target_dtype() {
    let targets = [3u32, 0, 4, 1, 1, 2];
    for dtype in [DType::U32, DType::U8, DType::I64] {
        let t = Tensor::new(&targets, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let logits = Var::from_tensor(&data(1, &[6, 5])).unwrap();
        let (ours, g) = loss_and_grad(&logits, |l| cross_entropy(l, &t).unwrap());
        let (theirs, g_ref) = loss_and_grad(&logits, |l| candle_nn::loss::cross_entropy(l, &t).unwrap());
        assert_close(&format!("{dtype:?}: loss"), &ours, &theirs);
        assert_close(&format!("{dtype:?}: dlogits"), &g, &g_ref);
    }
}

#[test]
fn cross_entropy_takes_3d_and_non_contiguous_logits() {
    let t = Tensor::new(&[[1u32, 0, 3], [2, 2, 0]], &Device::Cpu).unwrap();
    let logits = Var::from_tensor(&data(2, &[2, 3, 4])).unwrap();
    let (ours, g) = loss_and_grad(&logits, |l| cross_entropy(l, &t).unwrap());
    let flat_t = t.flatten_all().unwrap();
    let (theirs, g_ref) =
        loss_and_grad(&logits, |l| candle_nn::loss::cross_entropy(&l.reshape((6, 4)).unwrap(), &flat_t).unwrap());
    assert_close("3-D: loss", &ours, &theirs);
    assert_close("3-D: dlogits", &g, &g_ref);
    // Transposed logits [5, 4] read in place.
    let lt = Var::from_tensor(&data(3, &[4, 5])).unwrap();
    let t = Tensor::new(&[0u32, 3, 1, 2, 3], &Device::Cpu).unwrap();
    let (ours, g) = loss_and_grad(&lt, |l| cross_entropy(&l.t().unwrap(), &t).unwrap());
    let (theirs, g_ref) =
        loss_and_grad(&lt, |l| candle_nn::loss::cross_entropy(&l.t().unwrap().contiguous().unwrap(), &t).unwrap());
    assert_close("transposed: loss", &ours, &theirs);
    assert_close("transposed: dlogits", &g, &g_ref);
}

#[test]
fn cross_entropy_sum_skips_ignored_rows_and_counts_the_rest() {
    let logits = Var::from_tensor(&data(4, &[5, 4])).unwrap();
    let t = Tensor::new(&[2i64, -100, 0, 3, -100], &Device::Cpu).unwrap();
    let (ours, g) = loss_and_grad(&logits, |l| {
        let (sum, count) = cross_entropy_sum(l, &t, Some(-100)).unwrap();
        assert_eq!(count, 3);
        sum
    });
    // Reference: candle-nn's mean over the kept rows 0, 2, 3, times 3 rows.
    let keep = Tensor::new(&[0u32, 2, 3], &Device::Cpu).unwrap();
    let kept_t = Tensor::new(&[2u32, 0, 3], &Device::Cpu).unwrap();
    let (theirs, g_ref) = loss_and_grad(&logits, |l| {
        candle_nn::loss::cross_entropy(&l.index_select(&keep, 0).unwrap(), &kept_t).unwrap().affine(3.0, 0.0).unwrap()
    });
    assert_close("ignore: sum", &ours, &theirs);
    assert_close("ignore: dlogits", &g, &g_ref);
    let gv = values(&g);
    assert!(gv[4..8].iter().chain(&gv[16..20]).all(|&v| v == 0.0), "ignored rows get no gradient: {gv:?}");
    // No ignore index: every row counts, sum = n · mean.
    let t = Tensor::new(&[2u32, 1, 0, 3, 1], &Device::Cpu).unwrap();
    let (sum, count) = cross_entropy_sum(logits.as_tensor(), &t, Some(-100)).unwrap();
    assert_eq!(count, 5);
    let mean = candle_nn::loss::cross_entropy(logits.as_tensor(), &t).unwrap();
    assert_close("sum = 5 mean", &sum, &mean.affine(5.0, 0.0).unwrap());
}

#[test]
fn cross_entropy_bad_inputs_name_the_problem() {
    let logits = data(5, &[3, 4]);
    let err = cross_entropy(&logits, &Tensor::new(&[1u32, 4, 0], &Device::Cpu).unwrap()).unwrap_err().to_string();
    assert!(err.contains("target 4 of row 1 is out of range: targets must be in 0..4"), "{err}");
    let t = Tensor::new(&[1i64, 0, -1], &Device::Cpu).unwrap();
    let err = cross_entropy_sum(&logits, &t, Some(-100)).unwrap_err().to_string();
    assert!(
        err.contains("target -1 of row 2 is out of range: targets must be in 0..4 or the ignore index -100"),
        "{err}"
    );
    let err = cross_entropy(&logits, &Tensor::new(&[1u32, 0], &Device::Cpu).unwrap()).unwrap_err().to_string();
    assert!(err.contains("targets [2] must have the logits' leading dimensions [3]"), "{err}");
    let err = cross_entropy(&logits, &Tensor::new(&[1f32, 0., 2.], &Device::Cpu).unwrap()).unwrap_err().to_string();
    assert!(err.contains("targets must be class indices of dtype u8, u32 or i64, got F32"), "{err}");
    let err = cross_entropy(&data(6, &[4]), &Tensor::new(&[1u32], &Device::Cpu).unwrap()).unwrap_err().to_string();
    assert!(err.contains("logits must be [rows.., classes] (rank ≥ 2), got shape [4]"), "{err}");
}
