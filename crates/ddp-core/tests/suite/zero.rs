//! ZeRO: `FlatShards`' reduce-scatter (mean, sum, subsets, hooks, HSDP) and all-gather on several ranks with exact
//! values, and `ZeroRedundancyOptimizer` training like DDP + the same optimizer on whole parameters.
//!
//! Ranks are threads of this process (`common::run_ranks`), each with a CPU-backend group over one in-memory store.
//!
//! Tolerance: on 2 ranks ZeRO and DDP are compared bit for bit — a sum of two gradients is the same in either
//! order and `· ½` (ZeRO) equals DDP's `/ 2`, and AdamW's update is elementwise, so a chunk steps exactly like the
//! same elements of the whole parameter. On 3 and 4 ranks they may differ by rounding: the reduce-scatter adds
//! each element in rank order, DDP's all-reduce paths in their own order (the shared-memory one starts with the
//! reducing rank's own values), and on 3 ranks ZeRO multiplies by the fp32 `1/3` where DDP divides by 3. The bound
//! there is 1e-6 relative per tensor (`max|a − b| ≤ 1e-6 · max|b|`) after 5 AdamW steps; see
//! `zero_adamw_matches_ddp_adamw` for the measured error.

use crate::common::{run_ranks, wave};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarMap};
use ddp_core::zero::{FlatChunk, FlatShards};
use ddp_core::{CommHook, DdpError, DdpOptions, DistributedDataParallel, ProcessGroup, ZeroRedundancyOptimizer};

const IN: usize = 5;
const HIDDEN: usize = 7;
const STEPS: usize = 5;
const ROWS_PER_RANK: usize = 6;

/// A 5-7-1 MLP: `fc1.weight` 35 elements (odd), `fc1.bias` 7, `fc2.weight` 7, `fc2.bias` 1 (fewer than the
/// ranks). Ranks pass different seeds: construction must replace them with rank 0's values.
fn mlp_varmap(seed: f32) -> VarMap {
    let varmap = VarMap::new();
    {
        let mut data = varmap.data().lock().unwrap();
        for (i, (name, shape)) in [
            ("fc1.weight", vec![HIDDEN, IN]),
            ("fc1.bias", vec![HIDDEN]),
            ("fc2.weight", vec![1, HIDDEN]),
            ("fc2.bias", vec![1]),
        ]
        .into_iter()
        .enumerate()
        {
            data.insert(name.to_string(), Var::from_tensor(&wave(seed + i as f32, &shape, 0.5)).unwrap());
        }
    }
    varmap
}

fn param(varmap: &VarMap, name: &str) -> Tensor {
    varmap.data().lock().unwrap()[name].as_tensor().clone()
}

/// Mean squared error of rank `rank`'s rows of step `step` (each step reads `world · ROWS_PER_RANK` new rows).
fn loss(varmap: &VarMap, world: usize, rank: usize, step: usize) -> Tensor {
    let rows = STEPS * world * ROWS_PER_RANK;
    let x = wave(0.3, &[rows, IN], 1.0);
    let y = wave(1.7, &[rows, 1], 0.8);
    let start = (step * world + rank) * ROWS_PER_RANK;
    let fc1 = candle_nn::Linear::new(param(varmap, "fc1.weight"), Some(param(varmap, "fc1.bias")));
    let fc2 = candle_nn::Linear::new(param(varmap, "fc2.weight"), Some(param(varmap, "fc2.bias")));
    let h = fc1.forward(&x.narrow(0, start, ROWS_PER_RANK).unwrap()).unwrap().relu().unwrap();
    let out = fc2.forward(&h).unwrap();
    (out - y.narrow(0, start, ROWS_PER_RANK).unwrap()).unwrap().sqr().unwrap().mean_all().unwrap()
}

fn adamw() -> ParamsAdamW {
    ParamsAdamW { lr: 0.05, weight_decay: 0.1, ..ParamsAdamW::default() }
}

fn values(varmap: &VarMap) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<_> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Largest per-tensor relative difference: `max|a − b| / max|b|`.
fn rel_err(got: &[(String, Vec<f32>)], want: &[(String, Vec<f32>)]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|((gn, g), (wn, w))| {
            assert_eq!(gn, wn);
            let scale = w.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
            g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
        })
        .fold(0f32, f32::max)
}

/// DDP (all-reduce mean) + candle's AdamW on the whole parameters, `STEPS` steps on `world` ranks.
fn ddp_adamw(world: usize) -> Vec<Vec<(String, Vec<f32>)>> {
    run_ranks(world, None, move |pg| {
        let varmap = mlp_varmap(pg.rank() as f32 * 10.0);
        let ddp = DistributedDataParallel::new(&pg, &varmap, DdpOptions::default()).unwrap();
        let mut opt = AdamW::new(varmap.all_vars(), adamw()).unwrap();
        for step in 0..STEPS {
            let mut grads = loss(&varmap, world, pg.rank(), step).backward().unwrap();
            ddp.sync_gradients(&mut grads).unwrap();
            opt.step(&grads).unwrap();
        }
        values(&varmap)
    })
}

/// The same run with `ZeroRedundancyOptimizer` (and no DDP); also returns the shard variables' element counts and
/// the traffic of the training steps (after construction).
#[allow(clippy::type_complexity)]
fn zero_adamw(world: usize) -> Vec<(Vec<(String, Vec<f32>)>, Vec<usize>, ddp_core::TrafficStats)> {
    run_ranks(world, None, move |pg| {
        let varmap = mlp_varmap(pg.rank() as f32 * 10.0);
        let mut zero = ZeroRedundancyOptimizer::new(&pg, &varmap, |chunks| AdamW::new(chunks, adamw())).unwrap();
        let before = pg.traffic();
        for step in 0..STEPS {
            let grads = loss(&varmap, world, pg.rank(), step).backward().unwrap();
            zero.step(&grads).unwrap();
        }
        let after = pg.traffic();
        let mut traffic = after;
        traffic.reduce_scatter.calls -= before.reduce_scatter.calls;
        traffic.reduce_scatter.bytes -= before.reduce_scatter.bytes;
        traffic.all_gather.calls -= before.all_gather.calls;
        traffic.all_gather.bytes -= before.all_gather.bytes;
        traffic.all_reduce.calls -= before.all_reduce.calls;
        traffic.broadcast.calls -= before.broadcast.calls;
        let sizes = zero.shard_vars().iter().map(|v| v.elem_count()).collect();
        (values(&varmap), sizes, traffic)
    })
}

/// 5 AdamW steps under ZeRO on 2, 3 and 4 ranks give DDP + AdamW's parameters: bit for bit on 2 ranks, within
/// 1e-6 relative on 3 and 4 (see the module docs); every rank ends with the same bits; one reduce-scatter and one
/// all-gather per step, nothing else.
#[test]
fn zero_adamw_matches_ddp_adamw() {
    for world in [2, 3, 4] {
        let want = ddp_adamw(world);
        let got = zero_adamw(world);
        for (rank, (g, _, _)) in got.iter().enumerate() {
            assert!(g == &got[0].0, "world {world}: rank {rank}'s parameters differ from rank 0's");
        }
        let err = rel_err(&got[0].0, &want[0]);
        eprintln!("world {world}: ZeRO vs DDP + AdamW after {STEPS} steps: max relative difference {err:e}");
        if world == 2 {
            assert!(got[0].0 == want[0], "world 2: ZeRO and DDP differ (max relative {err:e}), expected bit-equal");
        } else {
            assert!(err <= 1e-6, "world {world}: max relative difference {err:e} > 1e-6");
        }
        // Not vacuous: training moved every parameter.
        let start = values(&mlp_varmap(0.0));
        for ((name, v), (_, v0)) in got[0].0.iter().zip(&start) {
            assert!(v != v0, "world {world}: {name} did not move");
        }
        let per_rank: usize = got[0].1.iter().sum();
        for (_, _, t) in &got {
            assert_eq!((t.reduce_scatter.calls, t.all_gather.calls), (STEPS as u64, STEPS as u64), "world {world}");
            assert_eq!((t.all_reduce.calls, t.broadcast.calls), (0, 0), "world {world}");
            assert_eq!(t.reduce_scatter.bytes, (STEPS * world * per_rank * 4) as u64, "world {world}");
            assert_eq!(t.all_gather.bytes, (STEPS * per_rank * 4) as u64, "world {world}");
        }
    }
}

/// The optimizer state is 1/N: each rank's AdamW holds moments of its shard variables, whose sizes are the padded
/// chunks — on 4 ranks 2 + 9 + 1 + 2 = 14 elements (fc1.bias 7, fc1.weight 35, fc2.bias 1, fc2.weight 7, in name
/// order) instead of the model's 50.
#[test]
fn shard_vars_are_the_padded_chunks() {
    let got = run_ranks(4, None, |pg| {
        let varmap = mlp_varmap(0.0);
        let zero = ZeroRedundancyOptimizer::new(&pg, &varmap, |chunks| AdamW::new(chunks, adamw())).unwrap();
        let names: Vec<String> = zero.named_vars().iter().map(|(n, _)| n.clone()).collect();
        let sizes: Vec<usize> = zero.shard_vars().iter().map(|v| v.elem_count()).collect();
        let dims: Vec<Vec<usize>> = zero.shard_vars().iter().map(|v| v.dims().to_vec()).collect();
        // The shard variables hold this rank's chunks of the (broadcast) parameters.
        let chunks_ok =
            zero.shard_vars().iter().zip(zero.named_vars()).zip(zero.layout().chunks()).all(|((sv, (_, v)), c)| {
                let want = c.slice(v.as_tensor(), pg.rank()).unwrap().to_vec1::<f32>().unwrap();
                sv.as_tensor().to_vec1::<f32>().unwrap() == want
            });
        (names, sizes, dims, zero.layout().per_rank(), chunks_ok)
    });
    for (names, sizes, dims, per_rank, chunks_ok) in got {
        assert_eq!(names, ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]);
        assert_eq!(sizes, [2, 9, 1, 2]);
        assert_eq!(dims, [vec![2], vec![9], vec![1], vec![2]]);
        assert_eq!(per_rank, 14);
        assert!(chunks_ok);
    }
}

/// Rank `rank`'s gradient of a parameter of `n` elements, index `p`: small integers (exact in bf16 and in any sum
/// of 4 of them).
fn int_grad(rank: usize, p: usize, n: usize) -> Tensor {
    let v: Vec<f32> = (0..n).map(|i| ((rank * 7 + p * 5 + i * 3) % 9) as f32 - 4.0).collect();
    Tensor::from_vec(v, n, &Device::Cpu).unwrap()
}

fn vals(ts: &[Tensor]) -> Vec<Vec<f32>> {
    ts.iter().map(|t| t.to_vec1::<f32>().unwrap()).collect()
}

/// Parameters of 5, 1 and 7 elements.
const NUMELS: [usize; 3] = [5, 1, 7];

/// `Σ_ranks` of every parameter's gradient, chunk `rank` of it (padded), from `ranks` ranks' `int_grad`s.
fn expected_chunks(ranks: &[usize], shard_ranks: usize, shard_rank: usize, f: impl Fn(f32) -> f32) -> Vec<Vec<f32>> {
    NUMELS
        .iter()
        .enumerate()
        .map(|(p, &n)| {
            let c = FlatChunk::of(n, shard_ranks);
            let mut sum = vec![0f32; n];
            for &r in ranks {
                for (s, v) in sum.iter_mut().zip(int_grad(r, p, n).to_vec1::<f32>().unwrap()) {
                    *s += v;
                }
            }
            let mut chunk: Vec<f32> = sum[c.range(shard_rank)].iter().map(|&v| f(v)).collect();
            chunk.resize(c.chunk, f(0.0));
            chunk
        })
        .collect()
}

/// On 3 ranks: the sum is the exact sum of the chunks, the mean that sum `· (1/3)` in fp32, `finish_mean` of the
/// sum is the mean bit for bit, a subset's chunks are the whole list's, and the bf16 hook (exact on small
/// integers) gives the same.
#[test]
fn reduce_scatter_sum_mean_and_subsets_are_exact() {
    let got = run_ranks(3, None, |pg| {
        let r = pg.rank();
        let s = FlatShards::new(&NUMELS, 3);
        let grads: Vec<Option<Tensor>> = NUMELS.iter().enumerate().map(|(p, &n)| Some(int_grad(r, p, n))).collect();
        let dev = Device::Cpu;
        let sum = s.reduce_scatter_sum(&pg, None, CommHook::None, &grads, &dev).unwrap();
        let mean = s.reduce_scatter_mean(&pg, None, CommHook::None, &grads, &dev).unwrap();
        let sums: Vec<Option<Tensor>> = sum.iter().cloned().map(Some).collect();
        let finished = s.finish_mean(None, CommHook::None, &sums, &dev).unwrap();
        let bf16 = s.reduce_scatter_mean(&pg, None, CommHook::Bf16, &grads, &dev).unwrap();
        // A bucket of parameters 2 and 0 (a backward segment's), and a rank with no gradient for parameter 1.
        let sub = s.subset(&[2, 0]).unwrap();
        let sub_sum =
            sub.reduce_scatter_sum(&pg, None, CommHook::None, &[grads[2].as_ref(), grads[0].as_ref()], &dev).unwrap();
        let mut holey = grads.clone();
        if r == 1 {
            holey[1] = None;
        }
        let holey = s.reduce_scatter_sum(&pg, None, CommHook::None, &holey, &dev).unwrap();
        (vals(&sum), vals(&mean), vals(&finished), vals(&bf16), vals(&sub_sum), vals(&holey))
    });
    for (r, (sum, mean, finished, bf16, sub_sum, holey)) in got.into_iter().enumerate() {
        assert_eq!(sum, expected_chunks(&[0, 1, 2], 3, r, |v| v), "rank {r}: sum");
        let third = 1.0f32 / 3.0;
        let want_mean = expected_chunks(&[0, 1, 2], 3, r, |v| v * third);
        assert_eq!(mean, want_mean, "rank {r}: mean");
        assert_eq!(finished, want_mean, "rank {r}: finish_mean(sum)");
        assert_eq!(bf16, want_mean, "rank {r}: bf16 hook on small integers");
        assert_eq!(sub_sum, vec![sum[2].clone(), sum[0].clone()], "rank {r}: subset");
        // Parameter 1 (one element: rank 0's chunk) without rank 1's gradient.
        let p1: f32 = [0, 2].iter().map(|&q| int_grad(q, 1, 1).to_vec1::<f32>().unwrap()[0]).sum();
        assert_eq!(holey[1], vec![if r == 0 { p1 } else { 0.0 }], "rank {r}: None counts as zeros");
        assert_eq!((&holey[0], &holey[2]), (&sum[0], &sum[2]));
    }
}

/// HSDP on 4 ranks: shard groups {0, 1} and {2, 3}, replicate groups {0, 2} and {1, 3}. Each rank's chunks are the
/// mean over all 4 ranks (small integers: exact), with every hook, and `finish_mean` of the sums equals the mean bit
/// for bit (the fp16 hook's pre-division included).
#[test]
fn hsdp_averages_over_shard_and_replicate_groups() {
    let got = run_ranks(4, None, |pg| {
        let r = pg.rank();
        let shard = pg.split(Some((r / 2) as u32), r).unwrap().unwrap();
        let replicate = pg.split(Some((r % 2) as u32), r).unwrap().unwrap();
        let s = FlatShards::new(&NUMELS, shard.world_size());
        let grads: Vec<Option<Tensor>> = NUMELS.iter().enumerate().map(|(p, &n)| Some(int_grad(r, p, n))).collect();
        let dev = Device::Cpu;
        let mut out = Vec::new();
        for hook in [CommHook::None, CommHook::Bf16, CommHook::Fp16] {
            let mean = s.reduce_scatter_mean(&shard, Some(&replicate), hook, &grads, &dev).unwrap();
            let sum = s.reduce_scatter_sum(&shard, Some(&replicate), hook, &grads, &dev).unwrap();
            let sums: Vec<Option<&Tensor>> = sum.iter().map(Some).collect();
            let finished = s.finish_mean(Some(&replicate), hook, &sums, &dev).unwrap();
            out.push((hook, shard.rank(), vals(&mean), vals(&finished)));
        }
        out
    });
    for (r, per_hook) in got.into_iter().enumerate() {
        for (hook, shard_rank, mean, finished) in per_hook {
            assert_eq!(shard_rank, r % 2);
            assert_eq!(mean, finished, "rank {r}, {hook:?}: finish_mean(sum) vs mean");
            // Sums of ≤ 4 small integers and · ¼ are exact in fp32, bf16 and fp16 (which divides each value first).
            assert_eq!(mean, expected_chunks(&[0, 1, 2, 3], 2, r % 2, |v| v * 0.25), "rank {r}, {hook:?}");
        }
    }
}

/// The all-gather rebuilds whole parameters of any dtype from each rank's chunk, on 3 ranks; `all_gather` returns
/// them flat in fp32; wrong chunk sizes are named.
#[test]
fn all_gather_rebuilds_whole_parameters() {
    let got = run_ranks(3, None, |pg| {
        let originals = [
            wave(0.5, &[2, 5], 1.0),
            wave(1.5, &[4], 1.0).to_dtype(DType::BF16).unwrap(),
            wave(2.5, &[1], 1.0).to_dtype(DType::F16).unwrap(),
        ];
        let s = FlatShards::new(&originals.iter().map(Tensor::elem_count).collect::<Vec<_>>(), 3);
        let mine: Vec<Var> = originals
            .iter()
            .zip(s.chunks())
            .map(|(t, c)| Var::from_tensor(&c.slice(t, pg.rank()).unwrap()).unwrap())
            .collect();
        let full: Vec<Var> =
            originals.iter().map(|t| Var::zeros(t.shape(), t.dtype(), &Device::Cpu).unwrap()).collect();
        s.all_gather_into(&pg, &mine, &full).unwrap();
        let flat = s.all_gather(&pg, &mine.iter().map(Var::as_tensor).collect::<Vec<_>>()).unwrap();
        let short =
            [mine[0].as_tensor().narrow(0, 0, 1).unwrap(), mine[1].as_tensor().clone(), mine[2].as_tensor().clone()];
        let err = s.all_gather(&pg, &short).unwrap_err().to_string();
        let same = |a: &Tensor, b: &Tensor| {
            a.dtype() == b.dtype()
                && a.dims() == b.dims()
                && a.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
                    == b.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        let whole_ok = full.iter().zip(&originals).all(|(f, o)| same(f.as_tensor(), o));
        let flat_ok = flat
            .iter()
            .zip(&originals)
            .all(|(f, o)| f.dtype() == DType::F32 && same(f, &o.to_dtype(DType::F32).unwrap().flatten_all().unwrap()));
        (whole_ok, flat_ok, err)
    });
    for (r, (whole_ok, flat_ok, err)) in got.into_iter().enumerate() {
        assert!(whole_ok, "rank {r}: all_gather_into");
        assert!(flat_ok, "rank {r}: all_gather");
        assert!(err.contains("chunk 0 has 1 elements, expected 4"), "rank {r}: {err}");
    }
}

/// Construction broadcasts rank 0's values (ranks built from different seeds) and checks the parameters across
/// ranks, failing on every rank when they differ.
#[test]
fn construction_broadcasts_rank_zero_and_checks_shapes() {
    let got = run_ranks(3, None, |pg| {
        let varmap = mlp_varmap(pg.rank() as f32 * 10.0);
        ZeroRedundancyOptimizer::new(&pg, &varmap, |c| AdamW::new(c, adamw())).unwrap();
        values(&varmap)
    });
    let want = values(&mlp_varmap(0.0));
    assert!(got.iter().all(|g| g == &want), "every rank holds rank 0's initial values");

    let errs = run_ranks(2, None, |pg| {
        let n = if pg.rank() == 0 { 3 } else { 4 };
        let vars = vec![("w".to_string(), Var::zeros(n, DType::F32, &Device::Cpu).unwrap())];
        ZeroRedundancyOptimizer::from_named_vars(&pg, vars, |c| AdamW::new(c, adamw())).unwrap_err()
    });
    for e in errs {
        assert!(matches!(e, DdpError::ParameterMismatch(_)), "{e}");
        assert!(e.to_string().contains("`w` [4]"), "{e}");
    }
}

/// Errors name what is wrong and how to fix it, before any communication.
#[test]
fn errors_name_the_parameter_and_the_fix() {
    let pg = ProcessGroup::single_process().unwrap();
    let new = |vars: Vec<(String, Var)>| {
        ZeroRedundancyOptimizer::from_named_vars(&pg, vars, |c| AdamW::new(c, adamw())).unwrap_err().to_string()
    };
    let err = new(vec![]);
    assert!(err.contains("no parameters to shard"), "{err}");
    let err = new(vec![("w64".into(), Var::zeros(3, DType::F64, &Device::Cpu).unwrap())]);
    assert!(err.contains("`w64` has dtype F64") && err.contains("f32, f16 and bf16"), "{err}");

    // A parameter that takes no part in the loss.
    let varmap = mlp_varmap(0.0);
    let mut zero = ZeroRedundancyOptimizer::new(&pg, &varmap, |c| AdamW::new(c, adamw())).unwrap();
    let x = wave(0.1, &[2, IN], 1.0);
    let fc1 = candle_nn::Linear::new(param(&varmap, "fc1.weight"), Some(param(&varmap, "fc1.bias")));
    let grads = fc1.forward(&x).unwrap().sum_all().unwrap().backward().unwrap();
    let err = zero.step(&grads).unwrap_err().to_string();
    assert!(err.contains(r#"no gradient for ["fc2.bias", "fc2.weight"]"#) && err.contains("take part"), "{err}");
    assert_eq!(values(&varmap), values(&mlp_varmap(0.0)), "a failed step changes nothing");
}

/// `step_with` steps any optimizer (here SGD written out, `O = ()`), and `consolidate` gathers per-chunk buffers
/// (here the shard variables themselves) into whole parameters: on 2 ranks the run equals DDP + candle's SGD bit
/// for bit.
#[test]
fn step_with_any_optimizer_and_consolidate() {
    let lr = 0.1;
    let want = run_ranks(2, None, move |pg| {
        let varmap = mlp_varmap(pg.rank() as f32);
        let ddp = DistributedDataParallel::new(&pg, &varmap, DdpOptions::default()).unwrap();
        let mut sgd = candle_nn::SGD::new(varmap.all_vars(), lr).unwrap();
        for step in 0..STEPS {
            let mut grads = loss(&varmap, 2, pg.rank(), step).backward().unwrap();
            ddp.sync_gradients(&mut grads).unwrap();
            sgd.step(&grads).unwrap();
        }
        values(&varmap)
    });
    let got = run_ranks(2, None, move |pg| {
        let varmap = mlp_varmap(pg.rank() as f32);
        let mut zero = ZeroRedundancyOptimizer::new(&pg, &varmap, |_| Ok::<_, DdpError>(())).unwrap();
        for step in 0..STEPS {
            let grads: GradStore = loss(&varmap, 2, pg.rank(), step).backward().unwrap();
            zero.step_with(&grads, |(), vars, grads| -> Result<(), DdpError> {
                for (v, g) in vars.iter().zip(grads) {
                    v.set(&v.sub(&(g.as_ref().unwrap() * lr)?)?)?;
                }
                Ok(())
            })
            .unwrap();
        }
        let whole = zero.consolidate(zero.shard_vars().iter().map(Var::as_tensor).collect::<Vec<_>>().as_slice());
        let consolidated: Vec<(String, Vec<f32>)> = zero
            .named_vars()
            .iter()
            .zip(whole.unwrap())
            .map(|((n, v), t)| {
                assert_eq!(t.dims(), v.dims());
                (n.clone(), t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            })
            .collect();
        (values(&varmap), consolidated)
    });
    for (r, (g, consolidated)) in got.iter().enumerate() {
        assert!(g == &want[0], "rank {r}: ZeRO + SGD differs from DDP + SGD (max rel {:e})", rel_err(g, &want[0]));
        assert_eq!(consolidated, g, "rank {r}: consolidate(shard_vars) is the parameters");
    }
}

/// The model's `Var`s are the parameters: weights written between steps (a checkpoint loaded) are what the next
/// step starts from, not the chunks the optimizer held before.
#[test]
fn weights_set_between_steps_are_what_the_next_step_updates() {
    let got = run_ranks(2, None, |pg| {
        let varmap = mlp_varmap(0.0);
        let mut zero = ZeroRedundancyOptimizer::new(&pg, &varmap, |_| Ok::<_, DdpError>(())).unwrap();
        let step = |zero: &mut ZeroRedundancyOptimizer<()>| {
            let grads = loss(&varmap, 2, pg.rank(), 0).backward().unwrap();
            zero.step_with(&grads, |(), _, _| Ok::<_, DdpError>(())).unwrap(); // an optimizer that changes nothing
        };
        step(&mut zero);
        let loaded = mlp_varmap(3.0);
        for (name, v) in zero.named_vars() {
            v.set(&param(&loaded, name)).unwrap();
        }
        step(&mut zero);
        values(&varmap) == values(&loaded)
    });
    assert_eq!(got, [true, true]);
}
