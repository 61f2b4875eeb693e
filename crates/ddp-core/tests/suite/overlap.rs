//! Backward segments and DDP's overlapped backward: a segmented backward pass gives `loss.backward()`'s
//! gradients bit for bit (cuts between layers, a skip connection across cuts, a parameter used in two segments);
//! `DistributedDataParallel::backward` on 2 and 3 ranks gives the same averages as `sync_gradients`, bit for
//! bit, learns its plan on the first call (buckets rebuilt in the order gradients become final, none spanning
//! a cut) and overlaps from the second; gradient accumulation through `backward_accumulated`; a changed model
//! and ranks that cut differently are errors naming what is wrong.
//!
//! Ranks are threads of this process (one CPU-backend group over an in-memory store, loopback TCP and shared
//! memory).

use crate::common::{run_ranks, wave};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::VarMap;
use ddp_core::segments::{self, BackwardSegments};
use ddp_core::{DdpError, DdpOptions, DistributedDataParallel, Overlap, ProcessGroup};

const WIDTHS: [usize; 5] = [6, 8, 8, 8, 3];

/// A 6-8-8-8-3 MLP's parameters (`fc{i}.weight`, `fc{i}.bias`), from `seed`.
fn mlp_varmap(seed: f32) -> VarMap {
    let varmap = VarMap::new();
    {
        let mut data = varmap.data().lock().unwrap();
        for (i, w) in WIDTHS.windows(2).enumerate() {
            let weight = wave(seed + i as f32, &[w[1], w[0]], 0.6);
            let bias = wave(seed + 0.5 + i as f32, &[w[1]], 0.2);
            data.insert(format!("fc{}.weight", i + 1), Var::from_tensor(&weight).unwrap());
            data.insert(format!("fc{}.bias", i + 1), Var::from_tensor(&bias).unwrap());
        }
    }
    varmap
}

fn param(varmap: &VarMap, name: &str) -> Tensor {
    varmap.data().lock().unwrap()[name].as_tensor().clone()
}

fn linear(varmap: &VarMap, i: usize, x: &Tensor) -> Tensor {
    let w = param(varmap, &format!("fc{i}.weight"));
    let b = param(varmap, &format!("fc{i}.bias"));
    x.matmul(&w.t().unwrap()).unwrap().broadcast_add(&b).unwrap()
}

/// How the forward pass is wired.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Wiring {
    /// fc1 → cut → fc2 → cut → fc3 → cut → fc4.
    Chain,
    /// As Chain, plus fc1's output added to fc3's input (a skip connection across a cut).
    Skip,
    /// As Chain, with fc2's weight also applied (again) after the last cut (a parameter in two segments).
    Shared,
    /// As Chain, with no cut between fc3 and fc4 (one segment fewer).
    FewerCuts,
}

/// The loss of rows `start..start + len`: mean of squares of the logits minus a target pattern.
fn loss(varmap: &VarMap, wiring: Wiring, start: usize, len: usize) -> Tensor {
    let x = wave(0.1, &[96, WIDTHS[0]], 1.0).narrow(0, start, len).unwrap();
    let h1 = segments::cut(&linear(varmap, 1, &x).tanh().unwrap()).unwrap();
    let mut h2 = linear(varmap, 2, &h1).tanh().unwrap();
    h2 = segments::cut(&h2).unwrap();
    let mut h3_in = h2.clone();
    if wiring == Wiring::Skip {
        h3_in = (h3_in + &h1).unwrap();
    }
    let mut h3 = linear(varmap, 3, &h3_in).tanh().unwrap();
    if wiring != Wiring::FewerCuts {
        h3 = segments::cut(&h3).unwrap();
    }
    if wiring == Wiring::Shared {
        h3 = linear(varmap, 2, &h3).tanh().unwrap();
    }
    let out = linear(varmap, 4, &h3);
    let target = wave(3.0, &[len, WIDTHS[4]], 0.5);
    (out - target).unwrap().sqr().unwrap().mean_all().unwrap()
}

fn names(varmap: &VarMap) -> Vec<String> {
    let mut n: Vec<String> = varmap.data().lock().unwrap().keys().cloned().collect();
    n.sort();
    n
}

/// Every parameter's gradient in `grads`, by name, as f32 vectors.
fn gradient_values(varmap: &VarMap, grads: &GradStore) -> Vec<(String, Vec<f32>)> {
    names(varmap)
        .into_iter()
        .map(|n| {
            let g = grads.get(&param(varmap, &n)).unwrap_or_else(|| panic!("no gradient for {n}"));
            (n, g.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        })
        .collect()
}

/// Bits of every value (to compare exactly; −0.0 and +0.0 compare equal as floats).
fn bits(v: &[(String, Vec<f32>)]) -> Vec<(String, Vec<u32>)> {
    v.iter().map(|(n, g)| (n.clone(), g.iter().map(|x| if *x == 0.0 { 0 } else { x.to_bits() }).collect())).collect()
}

/// The gradients of a plain `loss.backward()` (no recording: the cuts are the identity).
fn plain_gradients(varmap: &VarMap, wiring: Wiring, start: usize, len: usize) -> Vec<(String, Vec<f32>)> {
    gradient_values(varmap, &loss(varmap, wiring, start, len).backward().unwrap())
}

/// The loss with its forward pass recorded.
fn recorded(varmap: &VarMap, wiring: Wiring, start: usize, len: usize) -> (Tensor, BackwardSegments) {
    segments::record(|| Ok::<_, DdpError>(loss(varmap, wiring, start, len))).unwrap()
}

#[test]
fn cuts_outside_a_recording_are_the_identity() {
    let varmap = mlp_varmap(0.0);
    let x = param(&varmap, "fc1.weight");
    assert_eq!(segments::cut(&x).unwrap().id(), x.id(), "outside record: the same tensor");
    let (_, segs) = segments::record(|| {
        let input = wave(0.0, &[2, 2], 1.0); // carries no gradient
        assert_eq!(segments::cut(&input).unwrap().id(), input.id());
        let h = (x.clone() * 2.0)?;
        let cut = segments::cut(&h)?;
        assert_ne!(cut.id(), h.id(), "inside record: a new leaf");
        assert_eq!(cut.to_vec2::<f32>()?, h.to_vec2::<f32>()?, "holding the same values");
        Ok::<_, candle_core::Error>(())
    })
    .unwrap();
    assert_eq!(segs.num_cuts(), 1);
    assert_eq!(segs.num_segments(), 2);
}

#[test]
fn segmented_backward_equals_one_backward_bit_for_bit() {
    let varmap = mlp_varmap(0.0);
    for wiring in [Wiring::Chain, Wiring::Skip, Wiring::Shared] {
        let want = plain_gradients(&varmap, wiring, 0, 16);
        let (l, segs) = recorded(&varmap, wiring, 0, 16);
        assert_eq!(segs.num_segments(), 4, "{wiring:?}");
        let mut total: Option<GradStore> = None;
        let mut seen_per_segment = Vec::new();
        segs.backward(&l, |k, store| {
            assert_eq!(k, seen_per_segment.len());
            seen_per_segment
                .push(names(&varmap).into_iter().filter(|n| store.get(&param(&varmap, n)).is_some()).count());
            match &mut total {
                None => total = Some(store),
                Some(t) => t.extend(store)?,
            }
            Ok::<_, DdpError>(())
        })
        .unwrap();
        let got = gradient_values(&varmap, &total.unwrap());
        assert_eq!(bits(&got), bits(&want), "{wiring:?}: segmented gradients differ from loss.backward()'s");
        // Each segment reached its own layer's two parameters (fc2's weight twice under Shared).
        let expect = if wiring == Wiring::Shared { vec![4, 2, 2, 2] } else { vec![2, 2, 2, 2] };
        assert_eq!(seen_per_segment, expect, "{wiring:?}");
    }
    // The gradients are not trivial.
    assert!(plain_gradients(&varmap, Wiring::Chain, 0, 16).iter().all(|(_, g)| g.iter().any(|v| v.abs() > 1e-6)));
}

#[test]
fn an_unused_cut_is_an_error_naming_it() {
    let varmap = mlp_varmap(0.0);
    let (l, segs) = segments::record(|| {
        let _unused = segments::cut(&param(&varmap, "fc1.bias").affine(2.0, 0.0)?)?;
        param(&varmap, "fc4.bias").sum_all()
    })
    .unwrap();
    let err = segs.backward(&l, |_, _| Ok::<_, DdpError>(())).unwrap_err();
    assert!(err.to_string().contains("does not depend on cut 1 of 1"), "{err}");
}

/// One rank's run: `steps` steps of `ddp.backward` on its own rows; per step, the averaged gradients.
fn overlapped_run(pg: ProcessGroup, wiring: Wiring, steps: usize, opts: DdpOptions) -> Vec<Vec<(String, Vec<f32>)>> {
    let (rank, world) = (pg.rank(), pg.world_size());
    let varmap = mlp_varmap(0.0);
    let ddp = DistributedDataParallel::new(&pg, &varmap, opts).unwrap();
    (0..steps)
        .map(|step| {
            let (l, segs) = recorded(&varmap, wiring, (step * world + rank) * 8, 8);
            gradient_values(&varmap, &ddp.backward(&l, segs).unwrap())
        })
        .collect()
}

/// The same with a backward pass and `sync_gradients` (no overlap).
fn synced_run(pg: ProcessGroup, wiring: Wiring, steps: usize, opts: DdpOptions) -> Vec<Vec<(String, Vec<f32>)>> {
    let (rank, world) = (pg.rank(), pg.world_size());
    let varmap = mlp_varmap(0.0);
    let ddp = DistributedDataParallel::new(&pg, &varmap, opts).unwrap();
    (0..steps)
        .map(|step| {
            let mut grads = loss(&varmap, wiring, (step * world + rank) * 8, 8).backward().unwrap();
            ddp.sync_gradients(&mut grads).unwrap();
            gradient_values(&varmap, &grads)
        })
        .collect()
}

/// Overlap on whatever the machine (`Overlap::Auto` would turn it off on a machine with fewer spare cores than
/// ranks, which is how these tests usually run).
fn on() -> DdpOptions {
    DdpOptions { overlap: Overlap::On, ..DdpOptions::default() }
}

/// Caps small enough that the 8 parameters spread over several buckets (fc4 = 3·8·4 + 12 bytes).
fn tiny_buckets() -> DdpOptions {
    DdpOptions { first_bucket_cap_mb: 100.0 / (1 << 20) as f64, bucket_cap_mb: 300.0 / (1 << 20) as f64, ..on() }
}

#[test]
fn overlapped_ddp_equals_sync_gradients_on_2_and_3_ranks() {
    for world in [2, 3] {
        for wiring in [Wiring::Chain, Wiring::Skip, Wiring::Shared] {
            for (label, opts) in [("default buckets", on()), ("tiny buckets", tiny_buckets())] {
                let o = opts.clone();
                let got = run_ranks(world, None, move |pg| overlapped_run(pg, wiring, 3, o.clone()));
                let o = opts.clone();
                let want = run_ranks(world, None, move |pg| synced_run(pg, wiring, 3, o.clone()));
                for (rank, steps) in got.iter().enumerate() {
                    for (step, grads) in steps.iter().enumerate() {
                        assert_eq!(
                            bits(grads),
                            bits(&want[0][step]),
                            "world {world}, {wiring:?}, {label}, rank {rank}, step {step}"
                        );
                    }
                }
                // Not vacuous: ranks saw different rows, so the average differs from rank 0's own gradient.
                let varmap = mlp_varmap(0.0);
                assert_ne!(bits(&plain_gradients(&varmap, wiring, 0, 8)), bits(&want[0][0]));
            }
        }
    }
}

#[test]
fn the_first_call_rebuilds_buckets_in_gradient_order_without_spanning_a_cut() {
    let got = run_ranks(2, None, |pg| {
        let varmap = mlp_varmap(0.0);
        let ddp = DistributedDataParallel::new(&pg, &varmap, on()).unwrap();
        let before = ddp.bucket_layout();
        let (l, segs) = recorded(&varmap, Wiring::Chain, pg.rank() * 8, 8);
        ddp.backward(&l, segs).unwrap();
        (before, ddp.bucket_layout(), names(&varmap))
    });
    let (before, after, names) = &got[0];
    assert_eq!(got[1].1, *after, "both ranks rebuilt alike");
    // Registration (name) order: fc1.bias, fc1.weight, fc2.bias, ...: one bucket of everything before.
    assert_eq!(*before, vec![vec![7, 6, 5, 4, 3, 2, 1, 0]]);
    // After: one bucket per segment, fc4's first (final after backward segment 0), fc1's last.
    let named: Vec<Vec<&str>> = after.iter().map(|b| b.iter().map(|&i| names[i].as_str()).collect()).collect();
    assert_eq!(
        named,
        vec![
            vec!["fc4.weight", "fc4.bias"],
            vec!["fc3.weight", "fc3.bias"],
            vec!["fc2.weight", "fc2.bias"],
            vec!["fc1.weight", "fc1.bias"],
        ]
    );
    // A parameter used in two segments is final after the later one: fc2 travels with fc2's own segment.
    let shared = run_ranks(2, None, |pg| {
        let varmap = mlp_varmap(0.0);
        let ddp = DistributedDataParallel::new(&pg, &varmap, on()).unwrap();
        let (l, segs) = recorded(&varmap, Wiring::Shared, pg.rank() * 8, 8);
        ddp.backward(&l, segs).unwrap();
        ddp.bucket_layout()
    });
    assert_eq!(shared[0], vec![vec![7, 6], vec![5, 4], vec![3, 2], vec![1, 0]], "fc2 = indices 2, 3 in its own bucket");
}

#[test]
fn gradient_accumulation_through_backward_accumulated() {
    // 2 ranks × 2 micro-batches of 8 rows == synced sum of both micro-batches' gradients (same arithmetic:
    // micro-batch sums added in the same order, then one average).
    let got = run_ranks(2, None, |pg| {
        let rank = pg.rank();
        let varmap = mlp_varmap(0.0);
        let ddp = DistributedDataParallel::new(&pg, &varmap, on()).unwrap();
        let mut results = Vec::new();
        for step in 0..2 {
            let base = step * 32 + rank * 16;
            let mut acc = GradStore::default();
            ddp.no_sync(|| {
                let (l, segs) = recorded(&varmap, Wiring::Chain, base, 8);
                let g = ddp.backward(&l, segs).unwrap();
                ddp.accumulate_gradients(&mut acc, &g).unwrap();
            });
            let (l, segs) = recorded(&varmap, Wiring::Chain, base + 8, 8);
            results.push(gradient_values(&varmap, &ddp.backward_accumulated(&l, segs, acc).unwrap()));
        }
        results
    });
    let want = run_ranks(2, None, |pg| {
        let rank = pg.rank();
        let varmap = mlp_varmap(0.0);
        let ddp = DistributedDataParallel::new(&pg, &varmap, on()).unwrap();
        let mut results = Vec::new();
        for step in 0..2 {
            let base = step * 32 + rank * 16;
            let mut acc = loss(&varmap, Wiring::Chain, base, 8).backward().unwrap();
            let last = loss(&varmap, Wiring::Chain, base + 8, 8).backward().unwrap();
            ddp.accumulate_gradients(&mut acc, &last).unwrap();
            ddp.sync_gradients(&mut acc).unwrap();
            results.push(gradient_values(&varmap, &acc));
        }
        results
    });
    for (rank, steps) in got.iter().enumerate() {
        assert_eq!(bits(&steps[0]), bits(&want[0][0]), "rank {rank}, step 0 (learning)");
        assert_eq!(bits(&steps[1]), bits(&want[0][1]), "rank {rank}, step 1 (overlapped)");
    }
}

#[test]
fn a_parameter_used_after_its_bucket_went_out_is_an_error_naming_it() {
    let got = run_ranks(2, None, |pg| {
        let varmap = mlp_varmap(0.0);
        let ddp = DistributedDataParallel::new(&pg, &varmap, tiny_buckets()).unwrap();
        let (l, segs) = recorded(&varmap, Wiring::Chain, pg.rank() * 8, 8);
        // The plan: fc4 final after backward segment 0, fc1 after segment 3.
        ddp.backward(&l, segs).unwrap();
        // fc4's weight now also used before two cuts: a gradient for it arrives in backward segment 2, after its
        // bucket went out.
        let (l, segs) = segments::record(|| {
            let x = wave(0.1, &[8, WIDTHS[0]], 1.0);
            let h1 = segments::cut(&linear(&varmap, 1, &x).tanh()?)?;
            let fc4w = param(&varmap, "fc4.weight");
            // fc4's weight in segment 1 of the forward (backward segment 2): a late gradient for its bucket.
            let h2 = (linear(&varmap, 2, &h1).tanh()? + fc4w.sum_all()?.broadcast_as((8, 8))?)?;
            let h2 = segments::cut(&h2)?;
            let h3 = segments::cut(&linear(&varmap, 3, &h2).tanh()?)?;
            linear(&varmap, 4, &h3).sqr()?.mean_all()
        })
        .unwrap();
        ddp.backward(&l, segs).unwrap_err().to_string()
    });
    for msg in got {
        assert!(msg.contains("parameter `fc4.weight` got a gradient in backward segment 2"), "{msg}");
        assert!(msg.contains("final after segment 0"), "{msg}");
    }
}

#[test]
fn ranks_that_cut_differently_fail_together_naming_both_counts() {
    let got = run_ranks(2, None, |pg| {
        let varmap = mlp_varmap(0.0);
        let ddp = DistributedDataParallel::new(&pg, &varmap, on()).unwrap();
        let wiring = if pg.rank() == 0 { Wiring::Chain } else { Wiring::FewerCuts };
        let (l, segs) = recorded(&varmap, wiring, 0, 8);
        ddp.backward(&l, segs).unwrap_err().to_string()
    });
    for msg in got {
        assert!(msg.contains("different numbers of segments (3 to 4"), "{msg}");
    }
}

#[test]
fn one_rank_and_no_sync_are_a_plain_backward() {
    let varmap = mlp_varmap(0.0);
    let pg = ProcessGroup::single_process().unwrap();
    let ddp = DistributedDataParallel::new(&pg, &varmap, on()).unwrap();
    let (l, segs) = recorded(&varmap, Wiring::Skip, 0, 8);
    let got = gradient_values(&varmap, &ddp.backward(&l, segs).unwrap());
    assert_eq!(bits(&got), bits(&plain_gradients(&varmap, Wiring::Skip, 0, 8)));
    assert_eq!(ddp.bucket_layout(), vec![vec![7, 6, 5, 4, 3, 2, 1, 0]], "one rank plans nothing");
}

#[test]
fn a_parameter_without_a_gradient_by_its_planned_segment_is_named_before_its_bucket_goes_out() {
    let got = run_ranks(2, None, |pg| {
        let varmap = mlp_varmap(0.0);
        let ddp = DistributedDataParallel::new(&pg, &varmap, on()).unwrap();
        let (l, segs) = recorded(&varmap, Wiring::Chain, pg.rank() * 8, 8);
        ddp.backward(&l, segs).unwrap();
        // The same cuts, but fc4's bias left out of the loss.
        let (l, segs) = segments::record(|| {
            let x = wave(0.1, &[8, WIDTHS[0]], 1.0);
            let h1 = segments::cut(&linear(&varmap, 1, &x).tanh()?)?;
            let h2 = segments::cut(&linear(&varmap, 2, &h1).tanh()?)?;
            let h3 = segments::cut(&linear(&varmap, 3, &h2).tanh()?)?;
            h3.matmul(&param(&varmap, "fc4.weight").t()?)?.sqr()?.mean_all()
        })
        .unwrap();
        ddp.backward(&l, segs).unwrap_err().to_string()
    });
    for msg in got {
        assert!(msg.contains(r#"parameters ["fc4.bias"] have no gradient after backward segment 0"#), "{msg}");
        assert!(msg.contains("every step must cut the same way and use every parameter"), "{msg}");
    }
}

#[test]
fn overlap_off_reduces_after_the_backward_pass_with_the_same_results() {
    let off = DdpOptions { overlap: Overlap::Off, ..DdpOptions::default() };
    let o = off.clone();
    let got = run_ranks(2, None, move |pg| {
        let varmap = mlp_varmap(0.0);
        let ddp = DistributedDataParallel::new(&pg, &varmap, o.clone()).unwrap();
        assert!(!ddp.overlaps());
        let before = ddp.bucket_layout();
        let steps = overlapped_run(pg, Wiring::Skip, 2, o.clone());
        (steps, before == ddp.bucket_layout())
    });
    let want = run_ranks(2, None, move |pg| synced_run(pg, Wiring::Skip, 2, off.clone()));
    for (rank, (steps, unchanged)) in got.iter().enumerate() {
        assert!(unchanged, "rank {rank}: Overlap::Off keeps the construction layout");
        for (step, grads) in steps.iter().enumerate() {
            assert_eq!(bits(grads), bits(&want[0][step]), "rank {rank}, step {step}");
        }
    }
    // Auto follows the machine: on iff every local rank has a spare core for its communication thread.
    let pg = ProcessGroup::single_process().unwrap();
    let ddp = DistributedDataParallel::new(&pg, &mlp_varmap(0.0), DdpOptions::default()).unwrap();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    assert_eq!(ddp.overlaps(), cores >= pg.local_world_size().max(1) * (rayon::current_num_threads() + 1));
}

#[test]
fn a_plain_backward_of_a_recorded_forward_is_an_error_that_says_why() {
    let errs = run_ranks(2, None, |pg| {
        let varmap = mlp_varmap(0.0);
        let ddp = DistributedDataParallel::new(&pg, &varmap, on()).unwrap();
        let (l, _cuts) = recorded(&varmap, Wiring::Chain, pg.rank() * 8, 8);
        let mut grads = l.backward().unwrap(); // stops at the last cut
        ddp.sync_gradients(&mut grads).unwrap_err().to_string()
    });
    for msg in errs {
        assert!(msg.contains("fc1.weight") && msg.contains("fc3.bias") && !msg.contains("fc4"), "{msg}");
        assert!(msg.contains("needs DistributedDataParallel::backward(&loss, cuts)"), "{msg}");
    }
}

/// Two pipeline stages on two ranks: rank 0 runs fc1–fc2 and sends its output; rank 1 runs fc3–fc4 and the loss
/// on what it received, and sends back the gradient of that input; rank 0's backward starts from it
/// (`segments::backward_from`). Every parameter's gradient is `loss.backward()`'s in one process, bit for bit.
#[test]
fn a_backward_from_the_gradient_of_the_next_stage_equals_one_backward() {
    let (len, start) = (16, 8);
    let stage_grads = run_ranks(2, None, move |pg| {
        let varmap = mlp_varmap(0.3);
        let x = wave(0.1, &[96, WIDTHS[0]], 1.0).narrow(0, start, len).unwrap();
        if pg.rank() == 0 {
            let h2 = linear(&varmap, 2, &linear(&varmap, 1, &x).tanh().unwrap()).tanh().unwrap();
            pg.send_tensor(&h2, 1).unwrap();
            let grad = pg.recv_tensor(h2.shape(), h2.dtype(), 1).unwrap();
            let store = segments::backward_from(&h2, &grad).unwrap();
            let wrong = segments::backward_from(&h2, &grad.narrow(0, 0, 1).unwrap()).unwrap_err().to_string();
            assert!(wrong.contains("the gradient is [1, 8] F32 but the output is [16, 8] F32"), "{wrong}");
            ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
                .map(|n| {
                    (
                        n.to_string(),
                        store.get(&param(&varmap, n)).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    )
                })
                .to_vec()
        } else {
            let input =
                Var::from_tensor(&pg.recv_tensor((len, WIDTHS[2]), candle_core::DType::F32, 0).unwrap()).unwrap();
            let h3 = linear(&varmap, 3, input.as_tensor()).tanh().unwrap();
            let target = wave(3.0, &[len, WIDTHS[4]], 0.5);
            let loss = (linear(&varmap, 4, &h3) - target).unwrap().sqr().unwrap().mean_all().unwrap();
            let store = loss.backward().unwrap();
            pg.send_tensor(store.get(input.as_tensor()).unwrap(), 0).unwrap();
            ["fc3.bias", "fc3.weight", "fc4.bias", "fc4.weight"]
                .map(|n| {
                    (
                        n.to_string(),
                        store.get(&param(&varmap, n)).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    )
                })
                .to_vec()
        }
    });
    let pipelined: Vec<(String, Vec<f32>)> = stage_grads.into_iter().flatten().collect();
    let one_process = plain_gradients(&mlp_varmap(0.3), Wiring::Chain, start, len);
    assert_eq!(bits(&pipelined), bits(&one_process));
}
