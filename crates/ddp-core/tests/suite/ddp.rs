//! DistributedDataParallel: multi-rank training equals single-process training, buckets are laid out as
//! documented, mismatches and unused parameters are reported by name, and no_sync accumulates.
//!
//! Ranks are threads of this process, each with a CPU-backend group over one in-memory store (loopback TCP).
//!
//! Tolerance of every comparison: relative, per tensor, `max|a − b| ≤ 1e-5 · max(max|b|, 1e-3)` (f32). The
//! multi-rank and the single-process runs add the same numbers in a different order (two half-batch means
//! averaged vs one full-batch mean), so they agree to a few f32 ulps per step, not bit for bit.

use crate::common::wave;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Optimizer, VarMap, SGD};
use ddp_core::store::MemoryStore;
use ddp_core::{DdpError, DdpOptions, DistributedDataParallel, GroupOptions, ProcessGroup, Store};
use std::sync::Arc;
use std::time::Duration;

const IN: usize = 6;
const HIDDEN: usize = 8;
const CLASSES: usize = 3;
const RTOL: f32 = 1e-5;

/// Runs `f(pg)` on `world` threads, each one rank of a group over a shared MemoryStore; results by rank.
fn run_ranks<T: Send + 'static>(world: usize, f: impl Fn(ProcessGroup) -> T + Send + Sync + 'static) -> Vec<T> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(120)));
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, f) = (store.clone(), f.clone());
            std::thread::spawn(move || {
                let opts = GroupOptions { timeout: Duration::from_secs(120), ..GroupOptions::default() };
                f(ProcessGroup::from_store(store, rank, world, opts).expect("group formation"))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
}

/// A 6-8-3 MLP's parameters in a VarMap, initialised from `seed` (ranks pass different seeds; DDP must
/// replace them with rank 0's).
fn mlp_varmap(seed: f32) -> VarMap {
    let varmap = VarMap::new();
    {
        let mut data = varmap.data().lock().unwrap();
        for (i, (name, shape)) in [
            ("fc1.weight", vec![HIDDEN, IN]),
            ("fc1.bias", vec![HIDDEN]),
            ("fc2.weight", vec![CLASSES, HIDDEN]),
            ("fc2.bias", vec![CLASSES]),
        ]
        .into_iter()
        .enumerate()
        {
            let t = wave(seed + i as f32, &shape, 0.5);
            data.insert(name.to_string(), Var::from_tensor(&t).unwrap());
        }
    }
    varmap
}

fn var(varmap: &VarMap, name: &str) -> Var {
    varmap.data().lock().unwrap()[name].clone()
}

fn forward(varmap: &VarMap, x: &Tensor) -> Tensor {
    let fc1 = candle_nn::Linear::new(
        var(varmap, "fc1.weight").as_tensor().clone(),
        Some(var(varmap, "fc1.bias").as_tensor().clone()),
    );
    let fc2 = candle_nn::Linear::new(
        var(varmap, "fc2.weight").as_tensor().clone(),
        Some(var(varmap, "fc2.bias").as_tensor().clone()),
    );
    fc2.forward(&fc1.forward(x).unwrap().relu().unwrap()).unwrap()
}

/// The data set: 96 rows of inputs and labels.
fn dataset() -> (Tensor, Tensor) {
    let x = wave(0.1, &[96, IN], 1.0);
    let y: Vec<u32> = (0..96).map(|i| ((i * 7 + i / 5) % CLASSES) as u32).collect();
    (x, Tensor::from_vec(y, 96, &Device::Cpu).unwrap())
}

/// Mean cross-entropy of the rows `start..start + len`, scaled by `scale`.
fn loss(varmap: &VarMap, start: usize, len: usize, scale: f64) -> Tensor {
    let (x, y) = dataset();
    let logits = forward(varmap, &x.narrow(0, start, len).unwrap());
    (candle_nn::loss::cross_entropy(&logits, &y.narrow(0, start, len).unwrap()).unwrap() * scale).unwrap()
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

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
    let err = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(err <= RTOL * scale, "{what}: max abs error {err:e} > {RTOL:e} × {scale}");
}

fn assert_all_close(what: &str, got: &[(String, Vec<f32>)], want: &[(String, Vec<f32>)]) {
    assert_eq!(got.len(), want.len());
    for ((gn, g), (wn, w)) in got.iter().zip(want) {
        assert_eq!(gn, wn);
        assert_close(&format!("{what}: {gn}"), g, w);
    }
}

/// Single-process reference: `steps` SGD steps on batches of `batch` consecutive rows.
fn reference_training(batch: usize, steps: usize, lr: f64) -> Vec<(String, Vec<f32>)> {
    let varmap = mlp_varmap(0.0);
    let mut sgd = SGD::new(varmap.all_vars(), lr).unwrap();
    for step in 0..steps {
        let grads = loss(&varmap, step * batch, batch, 1.0).backward().unwrap();
        sgd.step(&grads).unwrap();
    }
    values(&varmap)
}

/// Data-parallel run: rank r of `world` reads rows `step·world·b + r·b ..+b`; rank r starts from seed r.
fn ddp_training(world: usize, b: usize, steps: usize, lr: f64, opts: DdpOptions) -> Vec<Vec<(String, Vec<f32>)>> {
    run_ranks(world, move |pg| {
        let rank = pg.rank();
        let varmap = mlp_varmap(rank as f32 * 10.0);
        let ddp = DistributedDataParallel::new(&pg, &varmap, opts.clone()).unwrap();
        let mut sgd = SGD::new(varmap.all_vars(), lr).unwrap();
        for step in 0..steps {
            let mut grads = loss(&varmap, step * world * b + rank * b, b, 1.0).backward().unwrap();
            ddp.sync_gradients(&mut grads).unwrap();
            sgd.step(&grads).unwrap();
        }
        values(&varmap)
    })
}

/// Tiny caps so the 4 parameters (192 + 32 + 96 + 12 bytes) spread over several buckets and the comm thread
/// pipeline runs.
fn tiny_buckets() -> DdpOptions {
    DdpOptions {
        first_bucket_cap_mb: 40.0 / (1 << 20) as f64,
        bucket_cap_mb: 100.0 / (1 << 20) as f64,
        ..DdpOptions::default()
    }
}

/// 2 ranks × batch b for k steps == 1 rank × batch 2b (and 3 ranks × b == 1 × 3b), one bucket and many.
#[test]
fn data_parallel_sgd_matches_single_process() {
    let (b, steps, lr) = (8, 4, 0.5);
    for world in [2, 3] {
        let want = reference_training(world * b, steps, lr);
        for (label, opts) in [("default buckets", DdpOptions::default()), ("tiny buckets", tiny_buckets())] {
            let got = ddp_training(world, b, steps, lr, opts);
            for (rank, g) in got.iter().enumerate() {
                assert_all_close(&format!("world {world}, {label}, rank {rank}"), g, &want);
            }
            // Ranks hold identical parameters (same reduced gradients, same arithmetic).
            assert!(got.iter().all(|g| g == &got[0]), "world {world}, {label}: ranks diverged");
        }
        // The test is not vacuous: training moved the parameters.
        assert_ne!(want, values(&mlp_varmap(0.0)));
    }
}

#[test]
fn construction_broadcasts_rank_zero_values() {
    let got = run_ranks(3, |pg| {
        let varmap = mlp_varmap(pg.rank() as f32 * 10.0);
        DistributedDataParallel::new(&pg, &varmap, DdpOptions::default()).unwrap();
        values(&varmap)
    });
    let want = values(&mlp_varmap(0.0));
    assert!(got.iter().all(|g| g == &want), "every rank holds rank 0's initial values exactly");
}

#[test]
fn bucket_layout_follows_caps_and_reverse_order() {
    const MIB: usize = 1 << 20;
    let pg = ProcessGroup::from_store(Arc::new(MemoryStore::default()), 0, 1, GroupOptions::default()).unwrap();
    let zeros = |n: usize, dtype: DType| Var::zeros(n, dtype, &Device::Cpu).unwrap();
    // Registration order: a 0.5 MiB, b 0.5 MiB, c 3 MiB, d 100 B (f32), e 64 B (f16).
    let vars = vec![
        ("a".to_string(), zeros(MIB / 8, DType::F32)),
        ("b".to_string(), zeros(MIB / 8, DType::F32)),
        ("c".to_string(), zeros(3 * MIB / 4, DType::F32)),
        ("d".to_string(), zeros(25, DType::F32)),
        ("e".to_string(), zeros(32, DType::F16)),
    ];
    let opts = DdpOptions { first_bucket_cap_mb: 1.0, bucket_cap_mb: 2.0, ..DdpOptions::default() };
    let ddp = DistributedDataParallel::from_named_vars(&pg, vars, opts).unwrap();
    // Visiting e, d, c, b, a: e opens the f16 bucket; d opens the f32 first bucket (cap 1 MiB); c would overflow
    // it, so d's bucket closes and c (≥ the 2 MiB cap) gets its own; b + a fill a 1 MiB bucket.
    assert_eq!(ddp.bucket_layout(), vec![vec![4], vec![3], vec![2], vec![1, 0]]);
    assert_eq!(ddp.bucket_bytes(), vec![64, 100, 3 * MIB, MIB]);

    // Defaults (1 MiB, then 25 MiB) on the MLP: everything fits the first bucket, in reverse name order.
    let ddp = DistributedDataParallel::new(&pg, &mlp_varmap(0.0), DdpOptions::default()).unwrap();
    let names: Vec<&str> = ddp.named_vars().iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"], "VarMap order: sorted by name");
    assert_eq!(ddp.bucket_layout(), vec![vec![3, 2, 1, 0]]);
    let ddp = DistributedDataParallel::new(&pg, &mlp_varmap(0.0), tiny_buckets()).unwrap();
    // fc2.weight 96 B ≥ 40 B: alone; fc2.bias 12 + fc1.weight 192 > 100: split; fc1.weight alone; fc1.bias.
    assert_eq!(ddp.bucket_layout(), vec![vec![3], vec![2], vec![1], vec![0]]);
    assert_eq!(ddp.bucket_bytes(), vec![96, 12, 192, 32]);
}

#[test]
fn different_shapes_fail_on_every_rank_naming_the_parameter() {
    let errors = run_ranks(2, |pg| {
        let varmap = mlp_varmap(0.0);
        if pg.rank() == 1 {
            let t = Tensor::zeros((CLASSES, HIDDEN + 1), DType::F32, &Device::Cpu).unwrap();
            varmap.data().lock().unwrap().insert("fc2.weight".into(), Var::from_tensor(&t).unwrap());
        }
        match DistributedDataParallel::new(&pg, &varmap, DdpOptions::default()) {
            Err(DdpError::ParameterMismatch(msg)) => msg,
            other => panic!("expected ParameterMismatch, got {other:?}"),
        }
    });
    for msg in errors {
        assert!(msg.contains("parameter #3"), "{msg}");
        assert!(msg.contains("rank 0 has `fc2.weight` [3, 8] f32"), "{msg}");
        assert!(msg.contains("rank 1 has `fc2.weight` [3, 9] f32"), "{msg}");
    }
}

#[test]
fn unused_parameter_is_an_error_naming_it() {
    let errors = run_ranks(2, |pg| {
        let varmap = mlp_varmap(0.0);
        let extra = Var::zeros(4, DType::F32, &Device::Cpu).unwrap();
        varmap.data().lock().unwrap().insert("head.unused".into(), extra);
        let ddp = DistributedDataParallel::new(&pg, &varmap, DdpOptions::default()).unwrap();
        let mut grads = loss(&varmap, 0, 8, 1.0).backward().unwrap();
        ddp.sync_gradients(&mut grads).unwrap_err()
    });
    for e in errors {
        match &e {
            DdpError::UnusedParameters { names } => assert_eq!(names, &["head.unused"]),
            other => panic!("expected UnusedParameters, got {other:?}"),
        }
        assert!(e.to_string().contains("find_unused_parameters"), "says how to fix it: {e}");
    }
}

/// With find_unused_parameters: a parameter only rank 0 used gets rank 0's gradient / world size on every
/// rank; one that no rank used gets no gradient at all.
#[test]
fn find_unused_parameters_reduces_zeros_and_skips_globally_unused() {
    let got = run_ranks(2, |pg| {
        let varmap = mlp_varmap(0.0);
        let sometimes = Var::from_tensor(&wave(3.0, &[IN], 1.0)).unwrap();
        let never = Var::zeros(2, DType::F32, &Device::Cpu).unwrap();
        {
            let mut data = varmap.data().lock().unwrap();
            data.insert("extra.sometimes".into(), sometimes.clone());
            data.insert("extra.never".into(), never.clone());
        }
        let opts = DdpOptions { find_unused_parameters: true, ..DdpOptions::default() };
        let ddp = DistributedDataParallel::new(&pg, &varmap, opts).unwrap();
        let mut l = loss(&varmap, pg.rank() * 8, 8, 1.0);
        if pg.rank() == 0 {
            l = (l + sometimes.as_tensor().sqr().unwrap().sum_all().unwrap()).unwrap();
        }
        let mut grads = l.backward().unwrap();
        ddp.sync_gradients(&mut grads).unwrap();
        let g = grads.get(sometimes.as_tensor()).map(|t| t.to_vec1::<f32>().unwrap());
        (g, grads.get(never.as_tensor()).is_none())
    });
    // d/dv Σ v² = 2v on rank 0, nothing on rank 1: the average is v.
    let want = wave(3.0, &[IN], 1.0).to_vec1::<f32>().unwrap();
    for (rank, (g, never_absent)) in got.into_iter().enumerate() {
        assert_close(&format!("rank {rank}: extra.sometimes"), &g.expect("gradient inserted"), &want);
        assert!(never_absent, "rank {rank}: a parameter no rank used gets no gradient");
    }
}

/// Two micro-batches under no_sync, summed, then one sync == the gradient of the whole batch over all ranks.
#[test]
fn no_sync_accumulation_equals_one_big_batch() {
    let b = 6;
    let (world, micro) = (2, 2);
    // Reference: mean loss over world·micro·b rows on one process.
    let reference = {
        let varmap = mlp_varmap(0.0);
        let grads = loss(&varmap, 0, world * micro * b, 1.0).backward().unwrap();
        grad_values(&varmap, &grads)
    };
    let got = run_ranks(world, move |pg| {
        let rank = pg.rank();
        let varmap = mlp_varmap(rank as f32);
        let ddp = DistributedDataParallel::new(&pg, &varmap, tiny_buckets()).unwrap();
        // Rank r's window: rows (r·micro + m)·b .. +b; each micro-loss divided by the window length (as
        // Accelerate does) so the sum is the mean over the rank's rows.
        let mut acc = GradStore::default();
        ddp.no_sync(|| {
            for m in 0..micro - 1 {
                let mut g = loss(&varmap, (rank * micro + m) * b, b, 1.0 / micro as f64).backward().unwrap();
                let before = grad_values(&varmap, &g);
                ddp.sync_gradients(&mut g).unwrap(); // a no-op inside no_sync
                assert_eq!(grad_values(&varmap, &g), before, "sync inside no_sync must not communicate");
                ddp.accumulate_gradients(&mut acc, &g).unwrap();
            }
        });
        assert!(ddp.require_sync(), "no_sync restores sync");
        let last = loss(&varmap, (rank * micro + micro - 1) * b, b, 1.0 / micro as f64).backward().unwrap();
        ddp.accumulate_gradients(&mut acc, &last).unwrap();
        ddp.sync_gradients(&mut acc).unwrap();
        grad_values(&varmap, &acc)
    });
    for (rank, g) in got.iter().enumerate() {
        assert_all_close(&format!("rank {rank}"), g, &reference);
    }
}

#[test]
fn set_require_sync_false_leaves_gradients_local() {
    let got = run_ranks(2, |pg| {
        let varmap = mlp_varmap(0.0);
        let ddp = DistributedDataParallel::new(&pg, &varmap, DdpOptions::default()).unwrap();
        ddp.set_require_sync(false);
        let mut g = loss(&varmap, pg.rank() * 8, 8, 1.0).backward().unwrap();
        let before = grad_values(&varmap, &g);
        ddp.sync_gradients(&mut g).unwrap();
        (before, grad_values(&varmap, &g))
    });
    for (before, after) in &got {
        assert_eq!(before, after);
    }
    assert_ne!(got[0].1, got[1].1, "ranks saw different data, so their local gradients differ");
}

/// Mixed dtypes (f64 and f32 parameters) are bucketed apart and each reduced in its own precision.
#[test]
fn mixed_dtype_gradients_are_averaged() {
    let got = run_ranks(2, |pg| {
        let r = pg.rank() as f64;
        let a = Var::from_tensor(&Tensor::new(&[1.0f64, 2.0, 3.0], &Device::Cpu).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::new(&[1.0f32, -1.0], &Device::Cpu).unwrap()).unwrap();
        let vars = vec![("a".to_string(), a.clone()), ("b".to_string(), b.clone())];
        let ddp = DistributedDataParallel::from_named_vars(&pg, vars, DdpOptions::default()).unwrap();
        assert_eq!(ddp.bucket_layout(), vec![vec![1], vec![0]]);
        // loss = (r+1)·Σa + (r+1)·Σ b²: grads (r+1) and 2(r+1)·b.
        let la = (a.as_tensor().sum_all().unwrap() * (r + 1.0)).unwrap();
        let lb = (b.as_tensor().sqr().unwrap().sum_all().unwrap() * (r + 1.0)).unwrap();
        let mut grads = la.backward().unwrap();
        let gb = lb.backward().unwrap();
        grads.insert(b.as_tensor(), gb.get(b.as_tensor()).unwrap().clone());
        ddp.sync_gradients(&mut grads).unwrap();
        let ga = grads.get(a.as_tensor()).unwrap();
        assert_eq!(ga.dtype(), DType::F64);
        (ga.to_vec1::<f64>().unwrap(), grads.get(b.as_tensor()).unwrap().to_vec1::<f32>().unwrap())
    });
    for (ga, gb) in got {
        assert_eq!(ga, vec![1.5; 3], "mean of 1 and 2");
        assert_eq!(gb, vec![3.0, -3.0], "mean of 2b and 4b");
    }
}

fn grad_values(varmap: &VarMap, grads: &GradStore) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<_> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, var)| {
            let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("no gradient for {k}"));
            (k.clone(), g.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// The bucket all_reduce reads the gradient tensors in place and writes new ones (`all_reduce_piecewise`): the
/// result has the bits of all-reducing the packed bucket, whatever the gradients look like — strided (a
/// transpose), a view into a larger storage, another dtype than the parameter's, of no elements (in the middle and
/// at the end of a bucket), missing on some ranks or on all — on every path (pipelined shared memory in one block
/// and in many, TCP), in one bucket and in many, bucket by bucket and through the communication thread.
#[test]
fn bucket_reduction_has_the_bits_of_the_packed_all_reduce() {
    use crate::common::{tiny_segments, tiny_shm_blocks};
    let tiny = DdpOptions { bucket_cap_mb: 0.004, first_bucket_cap_mb: 0.004, ..DdpOptions::default() };
    for world in [2usize, 3] {
        for tuning in [None, Some(tiny_shm_blocks()), Some(tiny_segments())] {
            // Overlap::On with several buckets: the communication thread's pipeline.
            let pipelined = DdpOptions { overlap: ddp_core::Overlap::On, ..tiny.clone() };
            for opts in [DdpOptions::default(), tiny.clone(), pipelined] {
                let opts = DdpOptions { find_unused_parameters: true, ..opts };
                let several = opts.bucket_cap_mb < 1.0;
                let out = crate::common::run_ranks(world, tuning, move |pg| {
                    let r = pg.rank() as f32;
                    let shapes: [(&str, &[usize]); 8] = [
                        ("last", &[0]),
                        ("w", &[40, 50]),
                        ("b", &[50]),
                        ("empty", &[0]),
                        ("big", &[70_000]),
                        ("sometimes", &[33]),
                        ("never", &[5]),
                        ("view", &[60]),
                    ];
                    let vars: Vec<(String, Var)> = shapes
                        .iter()
                        .map(|(n, s)| (n.to_string(), Var::zeros(*s, DType::F32, &Device::Cpu).unwrap()))
                        .collect();
                    let ddp = DistributedDataParallel::from_named_vars(&pg, vars.clone(), opts.clone()).unwrap();
                    let local: Vec<Option<Tensor>> = vec![
                        Some(wave(r, &[0], 1.0)),
                        Some(wave(r, &[50, 40], 1.0).t().unwrap()),
                        Some(wave(r + 0.5, &[50], 1.0).to_dtype(DType::F64).unwrap()),
                        Some(wave(r, &[0], 1.0)),
                        Some(wave(r + 0.25, &[70_000], 1.0)),
                        (pg.rank() == 0).then(|| wave(7.0, &[33], 1.0)),
                        None,
                        Some(wave(r + 0.75, &[100], 1.0).narrow(0, 10, 60).unwrap()),
                    ];
                    let mut grads = GradStore::default();
                    for ((_, v), g) in vars.iter().zip(&local) {
                        if let Some(g) = g {
                            grads.insert(v.as_tensor(), g.clone());
                        }
                    }
                    ddp.sync_gradients(&mut grads).unwrap();
                    let got: Vec<Option<Vec<f32>>> = vars
                        .iter()
                        .map(|(_, v)| {
                            grads.get(v.as_tensor()).map(|g| {
                                assert_eq!(g.dims(), v.as_tensor().dims());
                                assert_eq!(g.dtype(), DType::F32);
                                g.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                            })
                        })
                        .collect();
                    // Reference: each bucket packed by hand, all-reduced in one contiguous buffer.
                    let mut want: Vec<Option<Vec<f32>>> = vec![None; vars.len()];
                    for bucket in ddp.bucket_layout() {
                        let mut packed = Vec::new();
                        for &p in &bucket {
                            let n = vars[p].1.as_tensor().elem_count();
                            packed.extend(match &local[p] {
                                Some(g) => g.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap(),
                                None => vec![0.0f32; n],
                            });
                        }
                        pg.all_reduce(&mut packed, ddp_core::ReduceOp::Avg).unwrap();
                        let mut at = 0;
                        for &p in &bucket {
                            let n = vars[p].1.as_tensor().elem_count();
                            want[p] = (vars[p].0 != "never").then(|| packed[at..at + n].to_vec());
                            at += n;
                        }
                    }
                    let local: Vec<Option<Vec<f32>>> = local
                        .iter()
                        .map(|g| {
                            g.as_ref()
                                .map(|g| g.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap())
                        })
                        .collect();
                    (got, want, ddp.bucket_layout().len(), local)
                });
                // And, independently of any collective, close to the mean over the ranks (a missing gradient
                // counts as zeros).
                for p in [0usize, 1, 2, 3, 4, 5, 7] {
                    let n = out[0].3[p].as_ref().or(out[1].3[p].as_ref()).map_or(0, Vec::len);
                    for i in 0..n {
                        let sum: f64 = out.iter().filter_map(|o| o.3[p].as_ref()).map(|v| v[i] as f64).sum();
                        let mean = sum / world as f64;
                        let got = out[0].0[p].as_ref().unwrap()[i] as f64;
                        assert!((got - mean).abs() <= 1e-6, "world {world}: parameter {p}[{i}] = {got}, mean {mean}");
                    }
                }
                for (rank, (got, want, buckets, _)) in out.iter().enumerate() {
                    let what = format!("world {world}, {tuning:?}, {buckets} buckets, rank {rank}");
                    for (p, (g, w)) in got.iter().zip(want).enumerate() {
                        let bits = |v: &Option<Vec<f32>>| {
                            v.as_ref().map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                        };
                        assert!(bits(g) == bits(w), "{what}: parameter {p} differs from the packed all_reduce");
                    }
                    assert!(got[6].is_none(), "{what}: a parameter no rank used gets no gradient");
                    for p in [0, 3] {
                        assert_eq!(
                            got[p].as_deref(),
                            Some(&[][..]),
                            "{what}: parameter {p} of no elements keeps its gradient"
                        );
                    }
                }
                assert_eq!(out[0].2 > 1, several, "the tiny caps make several buckets, the default one");
            }
        }
    }
}

/// Gradient compression (`DdpOptions::comm_hook`, PyTorch's fp16 / bf16 compress hooks): on 2 ranks the reduced
/// gradients are the f32 average to the hook's precision (relative 2e-3 for fp16's 11 bits, 1.6e-2 for bf16's 8;
/// of the largest element, per tensor), half the bytes cross the wire, and an unused parameter stays `None`.
#[test]
fn compression_hooks_average_in_sixteen_bits_with_half_the_bytes() {
    use ddp_core::CommHook;
    for (hook, rtol) in [(CommHook::Fp16, 2e-3f32), (CommHook::Bf16, 1.6e-2)] {
        let out = run_ranks(2, move |pg| {
            let varmap = VarMap::new();
            let w = varmap.get((64, 33), "w", candle_nn::Init::Const(0.0), DType::F32, &Device::Cpu).unwrap();
            let b = varmap.get(5, "b", candle_nn::Init::Const(0.0), DType::F32, &Device::Cpu).unwrap();
            let opts = DdpOptions { comm_hook: hook, find_unused_parameters: true, ..DdpOptions::default() };
            let ddp = DistributedDataParallel::new(&pg, &varmap, opts).unwrap();
            let r = pg.rank() as f32;
            let g = wave(1.0 + r, w.dims(), 3.0);
            let mut slots = vec![None, Some(g)]; // names sorted: b (unused), w
            let before = pg.traffic().all_reduce.bytes;
            ddp.reduce_gradients(&mut slots).unwrap();
            let bytes = pg.traffic().all_reduce.bytes - before;
            (slots, bytes, b.elem_count() + w.elem_count())
        });
        let want = ((wave(1.0, &[64, 33], 3.0) + wave(2.0, &[64, 33], 3.0)).unwrap() / 2.0).unwrap();
        for (rank, (slots, bytes, numel)) in out.iter().enumerate() {
            assert!(slots[0].is_none(), "{hook:?}: the unused parameter stays None");
            let got = slots[1].as_ref().unwrap();
            assert_eq!(got.dtype(), DType::F32);
            let diff = (got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(diff <= rtol * scale, "{hook:?} rank {rank}: max error {diff} of {scale}");
            assert!(diff > 0.0, "{hook:?}: the gradients were not rounded (no compression happened)");
            // 2 bytes per element (the usage bitmap goes through the all-reduce counter too: 1 byte each).
            assert_eq!(*bytes, (2 * numel + 2) as u64, "{hook:?} rank {rank}: bytes on the wire");
        }
    }
}
