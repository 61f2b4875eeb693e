//! `Accelerator::backward_segments` (the gradient all-reduce overlapped with the backward pass) trains exactly
//! like `Accelerator::backward`: the same weights bit for bit on 2 ranks, with and without gradient accumulation,
//! in fp32 and under bf16 and fp16 mixed precision (fp32 masters, loss scaling), with clipping.

use crate::ranks::*;
use accel::{segments, AcceleratorConfig, AdamW, AdamWConfig, MixedPrecision};
use std::collections::BTreeMap;

const ROWS: usize = 64;

/// Trains 2 ranks over ROWS rows, 4 rows per rank per micro-batch, `ga` micro-batches per step; `overlap` picks
/// `backward_segments` over `backward`. Returns rank 0's weights and every step's gradient norm (both ranks equal).
fn train(ga: usize, mixed_precision: MixedPrecision, overlap: bool) -> (BTreeMap<String, Vec<f32>>, Vec<f64>) {
    // Overlap forced on: Overlap::Auto would reduce after the backward pass on a machine without spare cores.
    let ddp = ddp_core::DdpOptions { overlap: ddp_core::Overlap::On, ..Default::default() };
    let cfg = AcceleratorConfig { gradient_accumulation_steps: ga, mixed_precision, ddp, ..Default::default() };
    let out = run_ranks(2, cfg, move |acc| {
        let (model, varmap) = tiny_model(&acc, 7)?;
        let prepared = acc.prepare_model(&varmap)?;
        let mut opt = acc.prepare_optimizer(&prepared, AdamW::new(AdamWConfig { lr: 1e-2, ..Default::default() })?)?;
        let (x, y) = dataset(ROWS, 11);
        let mut norms = Vec::new();
        for m in 0..ROWS / 8 {
            let start = m * 8 + acc.rank() * 4;
            let (xb, yb) = (x.narrow(0, start, 4)?, y.narrow(0, start, 4)?);
            if overlap {
                let (l, cuts) = segments::record(|| loss(&acc, &model, &xb, &yb))?;
                assert_eq!(cuts.num_cuts(), 1);
                acc.backward_segments(&l, cuts)?;
            } else {
                acc.backward(&loss(&acc, &model, &xb, &yb)?)?;
            }
            if let Some(norm) = acc.clip_grad_norm(0.5)? {
                norms.push(norm);
            }
            opt.step()?;
            opt.zero_grad();
        }
        assert_eq!(norms.len(), ROWS / 8 / ga);
        Ok((to_f32_map(&prepared.state_dict()?), norms))
    });
    assert_eq!(out[0], out[1], "ranks hold the same weights and norms");
    out.into_iter().next().unwrap()
}

#[test]
fn backward_segments_trains_exactly_like_backward() {
    for ga in [1, 2] {
        for mp in [MixedPrecision::No, MixedPrecision::Bf16, MixedPrecision::Fp16] {
            let (w_plain, n_plain) = train(ga, mp, false);
            let (w_overlap, n_overlap) = train(ga, mp, true);
            assert_eq!(n_overlap, n_plain, "GA {ga}, {mp:?}: gradient norms");
            assert_eq!(w_overlap, w_plain, "GA {ga}, {mp:?}: weights");
            // Not vacuous: training moved the weights and clipping was active at least once.
            let (model_w0, _) = run_ranks(1, AcceleratorConfig::default(), |acc| {
                let (_, varmap) = tiny_model(&acc, 7)?;
                Ok((to_f32_map(&acc.prepare_model(&varmap)?.state_dict()?), ()))
            })
            .remove(0);
            assert_ne!(w_plain, model_w0, "GA {ga}, {mp:?}");
            assert!(n_plain.iter().any(|&n| n > 0.5), "GA {ga}, {mp:?}: clipping never engaged: {n_plain:?}");
        }
    }
}

#[test]
fn a_parameter_left_out_of_the_loss_is_named() {
    let errs = run_ranks(2, AcceleratorConfig::default(), |acc| {
        let (model, varmap) = tiny_model(&acc, 7)?;
        acc.prepare_model(&varmap)?;
        let (x, _) = dataset(8, 1);
        // Only l1 is used: l2's weight and bias get no gradient.
        let (l, cuts) = segments::record(|| -> candle_core::Result<_> {
            let _ = &model;
            let w = varmap.data().lock().unwrap()["l1.weight"].as_tensor().clone();
            segments::cut(&x.narrow(0, 0, 4)?.matmul(&w.t()?)?)?.sum_all()
        })?;
        Ok(acc.backward_segments(&l, cuts).unwrap_err().to_string())
    });
    for e in errs {
        assert!(e.contains("l1.bias") && e.contains("l2.bias") && e.contains("l2.weight"), "{e}");
    }
}
