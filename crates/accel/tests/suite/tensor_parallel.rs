//! Tensor-parallel layers against the dense single-process computation.
//!
//! Every test runs tp = 1, 2 and 4 (ranks as threads, tp = the whole world group). The dense reference is built
//! once, in f32, from the same seed and parameter names through a tp = 1 [`ParamBuilder`] (whose values do not
//! depend on the tp size, checked below), with `candle_nn::Linear` / `Embedding` / `loss::cross_entropy`. Each
//! rank's output, input gradient and parameter gradients must equal the dense ones (the rank's chunk of them
//! for sharded tensors) within `TOL`: `|a − b| ≤ 1e-5 · max(1, max |b|)`, i.e. 1e-5 relative to the tensor's
//! scale (the sharded matmuls sum in another order, so results differ in the last bits).

use accel::tensor_parallel::{
    vocab_parallel_cross_entropy, ColumnParallelLinear, ParallelLinearConfig, RowParallelLinear, VocabParallelEmbedding,
};
use accel::{ParamBuilder, ParamInit, ParamLayout, TensorParallel};
use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_nn::VarMap;
use ddp_core::store::MemoryStore;
use ddp_core::{GroupOptions, ProcessGroup, Store};
use std::sync::Arc;
use std::time::Duration;

const SEED: u64 = 1234;
const TOL: f32 = 1e-5;
const TPS: [usize; 3] = [1, 2, 4];

/// Runs `f(tp)` on `world` rank threads, tp = the world group; results in rank order.
fn run_tp<R: Send + 'static>(world: usize, f: impl Fn(TensorParallel) -> R + Send + Sync + 'static) -> Vec<R> {
    if world == 1 {
        return vec![f(TensorParallel::new(ProcessGroup::single_process().unwrap()))];
    }
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(60)));
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, f) = (store.clone(), f.clone());
            std::thread::spawn(move || {
                let opts = GroupOptions { timeout: Duration::from_secs(60), ..Default::default() };
                let pg = ProcessGroup::from_store(store, rank, world, opts).unwrap();
                f(TensorParallel::new(pg))
            })
        })
        .collect();
    handles.into_iter().enumerate().map(|(r, h)| h.join().unwrap_or_else(|_| panic!("rank {r} panicked"))).collect()
}

fn single() -> TensorParallel {
    TensorParallel::new(ProcessGroup::single_process().unwrap())
}

/// A tp = 1 builder (the dense reference's parameters) over a fresh VarMap.
fn dense_builder() -> ParamBuilder {
    ParamBuilder::new(&VarMap::new(), &single(), SEED, DType::F32, &Device::Cpu)
}

/// Deterministic values of shape `dims` in [-1, 1) (the inputs, and the weights of the probe loss).
fn det(dims: &[usize], salt: u64) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n as u64)
        .map(|i| {
            let h = (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)) >> 40;
            (h % 2000) as f32 / 1000.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

/// A tensor's values and shape, to carry out of a rank thread.
#[derive(Debug, Clone)]
struct Vals {
    dims: Vec<usize>,
    v: Vec<f32>,
}

fn vals(t: &Tensor) -> Vals {
    Vals { dims: t.dims().to_vec(), v: t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap() }
}

/// Asserts `got` equals `want` within `TOL` (relative to `want`'s scale).
fn assert_close(got: &Vals, want: &Tensor, what: &str) {
    let w = vals(want);
    assert_eq!(got.dims, w.dims, "{what}: shape");
    let scale = w.v.iter().fold(1.0f32, |m, x| m.max(x.abs()));
    let worst = got.v.iter().zip(&w.v).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(worst <= TOL * scale, "{what}: max |diff| {worst:e} > {TOL:e} × {scale}\n got {:?}\nwant {:?}", got.v, w.v);
}

/// Chunk `r` of `t` split `world` ways along `dim`.
fn chunk(t: &Tensor, dim: usize, r: usize, world: usize) -> Tensor {
    let len = t.dim(dim).unwrap() / world;
    t.narrow(dim, r * len, len).unwrap()
}

/// Sets a parameter of `varmap` to this rank's part of `full` (sliced by its registered layout), so tests can
/// give biases non-zero values.
fn set_full(varmap: &VarMap, tp: &TensorParallel, name: &str, full: &Tensor) {
    let data = varmap.data().lock().unwrap();
    let var = &data[name];
    let value = match tp.layout(var) {
        ParamLayout::Replicated => full.clone(),
        layout @ ParamLayout::Sharded { dim, full: size, padded } => {
            let padded_t = full.pad_with_zeros(dim, 0, padded - size).unwrap();
            let range = layout.shard_range(tp.rank(), tp.size()).unwrap();
            padded_t.narrow(dim, range.start, range.len()).unwrap()
        }
    };
    var.set(&value).unwrap();
}

fn linear_cfg(bias: bool) -> ParallelLinearConfig {
    ParallelLinearConfig { bias, init: ParamInit::Normal { std: 0.5 }, ..Default::default() }
}

const IN: usize = 6;
const HID: usize = 8;
const OUT: usize = 4;

/// Dense full weight and bias of linear layer `prefix` (`[out, in]`, `[out]`), the bias set to `det(.., salt)`.
fn dense_linear(prefix: &str, in_dim: usize, out_dim: usize, salt: u64) -> (Var, Var) {
    let pb = dense_builder().pp(prefix);
    let w = pb.replicated("weight", (out_dim, in_dim), ParamInit::Normal { std: 0.5 }).unwrap();
    let w = Var::from_tensor(&w).unwrap();
    let b = Var::from_tensor(&det(&[out_dim], salt)).unwrap();
    (w, b)
}

#[test]
fn column_parallel_linear_matches_dense() {
    for gather_output in [false, true] {
        for tp_size in TPS {
            let out = run_tp(tp_size, move |tp| {
                let varmap = VarMap::new();
                let pb = ParamBuilder::new(&varmap, &tp, SEED, DType::F32, &Device::Cpu);
                let cfg = ParallelLinearConfig { gather_output, ..linear_cfg(true) };
                let layer = ColumnParallelLinear::new(&pb.pp("fc"), IN, HID, cfg).unwrap();
                set_full(&varmap, &tp, "fc.bias", &det(&[HID], 7));
                let x = Var::from_tensor(&det(&[2, 3, IN], 1)).unwrap();
                let y = layer.forward(x.as_tensor()).unwrap();
                // Probe loss Σ y ⊙ P: with a gathered output every rank holds all of it; otherwise its chunk.
                let probe = det(&[2, 3, HID], 2);
                let probe = if gather_output { probe } else { chunk(&probe, 2, tp.rank(), tp.size()) };
                let g = y.mul(&probe).unwrap().sum_all().unwrap().backward().unwrap();
                let gw = g.get(layer.weight()).unwrap();
                let gb = g.get(layer.bias().unwrap()).unwrap();
                (vals(&y), vals(g.get(&x).unwrap()), vals(gw), vals(gb))
            });
            let (w, b) = dense_linear("fc", IN, HID, 7);
            let x = Var::from_tensor(&det(&[2, 3, IN], 1)).unwrap();
            let y = candle_nn::Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone())).forward(&x).unwrap();
            let g = y.mul(&det(&[2, 3, HID], 2)).unwrap().sum_all().unwrap().backward().unwrap();
            for (r, (yr, gx, gw, gb)) in out.iter().enumerate() {
                let what = format!("column (gather_output {gather_output}) tp {tp_size} rank {r}");
                let y_want = if gather_output { y.clone() } else { chunk(&y, 2, r, tp_size) };
                assert_close(yr, &y_want, &format!("{what}: output"));
                assert_close(gx, g.get(&x).unwrap(), &format!("{what}: input gradient"));
                assert_close(gw, &chunk(g.get(&w).unwrap(), 0, r, tp_size), &format!("{what}: weight gradient"));
                assert_close(gb, &chunk(g.get(&b).unwrap(), 0, r, tp_size), &format!("{what}: bias gradient"));
            }
        }
    }
}

#[test]
fn row_parallel_linear_matches_dense() {
    for tp_size in TPS {
        let out = run_tp(tp_size, move |tp| {
            let varmap = VarMap::new();
            let pb = ParamBuilder::new(&varmap, &tp, SEED, DType::F32, &Device::Cpu);
            let layer = RowParallelLinear::new(&pb.pp("proj"), HID, OUT, linear_cfg(true)).unwrap();
            set_full(&varmap, &tp, "proj.bias", &det(&[OUT], 8));
            // The input is split by features, as a column-parallel layer leaves it.
            let x = Var::from_tensor(&chunk(&det(&[2, 3, HID], 3), 2, tp.rank(), tp.size())).unwrap();
            let y = layer.forward(x.as_tensor()).unwrap();
            let g = y.mul(&det(&[2, 3, OUT], 4)).unwrap().sum_all().unwrap().backward().unwrap();
            let gw = g.get(layer.weight()).unwrap();
            let gb = g.get(layer.bias().unwrap()).unwrap();
            (vals(&y), vals(g.get(&x).unwrap()), vals(gw), vals(gb))
        });
        let (w, b) = dense_linear("proj", HID, OUT, 8);
        let x = Var::from_tensor(&det(&[2, 3, HID], 3)).unwrap();
        let y = candle_nn::Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone())).forward(&x).unwrap();
        let g = y.mul(&det(&[2, 3, OUT], 4)).unwrap().sum_all().unwrap().backward().unwrap();
        for (r, (yr, gx, gw, gb)) in out.iter().enumerate() {
            let what = format!("row tp {tp_size} rank {r}");
            assert_close(yr, &y, &format!("{what}: output (bias added once)"));
            assert_close(gx, &chunk(g.get(&x).unwrap(), 2, r, tp_size), &format!("{what}: input gradient"));
            assert_close(gw, &chunk(g.get(&w).unwrap(), 1, r, tp_size), &format!("{what}: weight gradient"));
            assert_close(gb, g.get(&b).unwrap(), &format!("{what}: bias gradient"));
        }
    }
}

/// Megatron's MLP: column-parallel (no gather) → gelu → row-parallel; one all-reduce forward (g), one backward (f).
#[test]
fn column_gelu_row_mlp_matches_dense() {
    for tp_size in TPS {
        let out = run_tp(tp_size, move |tp| {
            let varmap = VarMap::new();
            let pb = ParamBuilder::new(&varmap, &tp, SEED, DType::F32, &Device::Cpu).pp("mlp");
            let fc = ColumnParallelLinear::new(&pb.pp("fc"), IN, HID, linear_cfg(true)).unwrap();
            let proj = RowParallelLinear::new(&pb.pp("proj"), HID, IN, linear_cfg(true)).unwrap();
            set_full(&varmap, &tp, "mlp.fc.bias", &det(&[HID], 7));
            set_full(&varmap, &tp, "mlp.proj.bias", &det(&[IN], 8));
            let x = Var::from_tensor(&det(&[5, IN], 5)).unwrap();
            let y = proj.forward(&fc.forward(x.as_tensor()).unwrap().gelu().unwrap()).unwrap();
            let g = y.mul(&det(&[5, IN], 6)).unwrap().sum_all().unwrap().backward().unwrap();
            let grads =
                [fc.weight(), fc.bias().unwrap(), proj.weight(), proj.bias().unwrap()].map(|p| vals(g.get(p).unwrap()));
            (vals(&y), vals(g.get(&x).unwrap()), grads)
        });
        let (w1, b1) = dense_linear("mlp.fc", IN, HID, 7);
        let (w2, b2) = dense_linear("mlp.proj", HID, IN, 8);
        let fc = candle_nn::Linear::new(w1.as_tensor().clone(), Some(b1.as_tensor().clone()));
        let proj = candle_nn::Linear::new(w2.as_tensor().clone(), Some(b2.as_tensor().clone()));
        let x = Var::from_tensor(&det(&[5, IN], 5)).unwrap();
        let y = proj.forward(&fc.forward(&x).unwrap().gelu().unwrap()).unwrap();
        let g = y.mul(&det(&[5, IN], 6)).unwrap().sum_all().unwrap().backward().unwrap();
        for (r, (yr, gx, grads)) in out.iter().enumerate() {
            let what = format!("mlp tp {tp_size} rank {r}");
            assert_close(yr, &y, &format!("{what}: output"));
            assert_close(gx, g.get(&x).unwrap(), &format!("{what}: input gradient (all-reduced once by f)"));
            assert_close(&grads[0], &chunk(g.get(&w1).unwrap(), 0, r, tp_size), &format!("{what}: fc.weight"));
            assert_close(&grads[1], &chunk(g.get(&b1).unwrap(), 0, r, tp_size), &format!("{what}: fc.bias"));
            assert_close(&grads[2], &chunk(g.get(&w2).unwrap(), 1, r, tp_size), &format!("{what}: proj.weight"));
            assert_close(&grads[3], g.get(&b2).unwrap(), &format!("{what}: proj.bias"));
        }
    }
}

const VOCAB: usize = 65;
const EMB: usize = 4;

/// Ids covering both ends of the vocabulary and every shard (65 at tp 4 pads to 68: rank 3 holds 51..68).
fn ids() -> Tensor {
    let v: Vec<u32> = vec![0, 64, 16, 17, 33, 34, 50, 51, 63, 1, 32, 64];
    Tensor::from_vec(v, (2, 6), &Device::Cpu).unwrap()
}

#[test]
fn vocab_parallel_embedding_matches_dense_with_padding() {
    for tp_size in TPS {
        let out = run_tp(tp_size, move |tp| {
            let varmap = VarMap::new();
            let pb = ParamBuilder::new(&varmap, &tp, SEED, DType::F32, &Device::Cpu);
            let emb = VocabParallelEmbedding::new(&pb.pp("wte"), VOCAB, EMB, ParamInit::Normal { std: 1.0 }).unwrap();
            let y = emb.forward(&ids()).unwrap();
            let g = y.mul(&det(&[2, 6, EMB], 9)).unwrap().sum_all().unwrap().backward().unwrap();
            (vals(&y), vals(emb.weight()), vals(g.get(emb.weight()).unwrap()))
        });
        let w = dense_builder().pp("wte").replicated("weight", (VOCAB, EMB), ParamInit::Normal { std: 1.0 }).unwrap();
        let w = Var::from_tensor(&w).unwrap();
        let y = candle_nn::Embedding::new(w.as_tensor().clone(), EMB).forward(&ids()).unwrap();
        let g = y.mul(&det(&[2, 6, EMB], 9)).unwrap().sum_all().unwrap().backward().unwrap();
        let padded = VOCAB.div_ceil(tp_size) * tp_size;
        let pad = |t: &Tensor| t.pad_with_zeros(0, 0, padded - VOCAB).unwrap();
        for (r, (yr, wr, gw)) in out.iter().enumerate() {
            let what = format!("embedding vocab {VOCAB} tp {tp_size} rank {r}");
            assert_close(yr, &y, &format!("{what}: output"));
            assert_close(wr, &chunk(&pad(&w), 0, r, tp_size), &format!("{what}: weight shard (padding rows zero)"));
            assert_close(gw, &chunk(&pad(g.get(&w).unwrap()), 0, r, tp_size), &format!("{what}: weight gradient"));
        }
    }
}

/// Full logits `[n, VOCAB]` and targets of the loss tests.
fn ce_inputs() -> (Tensor, Tensor) {
    let logits = (det(&[6, VOCAB], 11) * 4.0).unwrap();
    let targets = Tensor::from_vec(vec![0u32, 64, 31, 32, 50, 17], 6, &Device::Cpu).unwrap();
    (logits, targets)
}

#[test]
fn vocab_parallel_cross_entropy_matches_candle_and_masks_padding() {
    for tp_size in TPS {
        let out = run_tp(tp_size, move |tp| {
            let (logits, targets) = ce_inputs();
            // Padding columns hold large garbage: the loss must ignore them, not rely on them being zero.
            let padded = VOCAB.div_ceil(tp.size()) * tp.size();
            let garbage = Tensor::full(30f32, (6, padded - VOCAB), &Device::Cpu).unwrap();
            let full = Tensor::cat(&[&logits, &garbage], 1).unwrap();
            let local = Var::from_tensor(&chunk(&full, 1, tp.rank(), tp.size())).unwrap();
            let losses = vocab_parallel_cross_entropy(local.as_tensor(), &targets, &tp, VOCAB).unwrap();
            let g = losses.mean_all().unwrap().backward().unwrap();
            (vals(&losses), vals(g.get(&local).unwrap()))
        });
        let (logits, targets) = ce_inputs();
        let logits = Var::from_tensor(&logits).unwrap();
        let mean = candle_nn::loss::cross_entropy(&logits, &targets).unwrap();
        let g = mean.backward().unwrap();
        let per_token = candle_nn::ops::log_softmax(&logits, D::Minus1)
            .unwrap()
            .gather(&targets.unsqueeze(1).unwrap(), 1)
            .unwrap()
            .squeeze(1)
            .unwrap()
            .neg()
            .unwrap();
        let padded = VOCAB.div_ceil(tp_size) * tp_size;
        let g_full = g.get(&logits).unwrap().pad_with_zeros(1, 0, padded - VOCAB).unwrap();
        for (r, (losses, gl)) in out.iter().enumerate() {
            let what = format!("cross entropy vocab {VOCAB} tp {tp_size} rank {r}");
            assert_close(losses, &per_token, &format!("{what}: per-token losses"));
            let mean_got = losses.v.iter().sum::<f32>() / losses.v.len() as f32;
            let mean_want = mean.to_scalar::<f32>().unwrap();
            assert!(
                (mean_got - mean_want).abs() <= TOL * mean_want.abs().max(1.0),
                "{what}: mean {mean_got} vs {mean_want}"
            );
            assert_close(gl, &chunk(&g_full, 1, r, tp_size), &format!("{what}: logit gradient"));
            // The padding columns' gradient is exactly zero (and finite).
            let cols = padded / tp_size;
            for (i, v) in gl.v.iter().enumerate() {
                if r * cols + i % cols >= VOCAB {
                    assert_eq!(*v, 0.0, "{what}: padding column {} gradient", r * cols + i % cols);
                }
            }
        }
    }
}

/// The parameters' full values do not depend on the tp size nor on the order in which they are created: the
/// shards of every tp size, concatenated, equal the tp = 1 tensors bit for bit (padding rows are zero).
#[test]
fn param_builder_draws_the_same_full_tensors_whatever_the_tp_size_and_order() {
    fn build(pb: &ParamBuilder, reverse: bool) -> Vec<(String, Tensor)> {
        let mut specs: Vec<(&str, usize)> =
            vec![("a.weight", 0), ("b.weight", 1), ("vocab.weight", 0), ("ln.gamma", 9)];
        if reverse {
            specs.reverse();
        }
        specs
            .into_iter()
            .map(|(name, dim)| {
                let t = match (name, dim) {
                    ("vocab.weight", _) => pb.sharded_padded(name, (65, 4), 0, ParamInit::Normal { std: 1.0 }),
                    ("ln.gamma", _) => pb.replicated(name, 8, ParamInit::Uniform { bound: 0.3 }),
                    _ => pb.sharded(name, (8, 12), dim, ParamInit::Normal { std: 0.02 }),
                };
                (name.to_string(), t.unwrap())
            })
            .collect()
    }
    let bits = |t: &Tensor| -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    };
    let reference: std::collections::BTreeMap<String, Vec<u32>> =
        build(&dense_builder().pp("m"), false).into_iter().map(|(n, t)| (n, bits(&t))).collect();
    for tp_size in TPS {
        for reverse in [false, true] {
            let shards = run_tp(tp_size, move |tp| {
                let pb = ParamBuilder::new(&VarMap::new(), &tp, SEED, DType::F32, &Device::Cpu).pp("m");
                build(&pb, reverse).into_iter().map(|(n, t)| (n, t.dims().to_vec(), vals(&t).v)).collect::<Vec<_>>()
            });
            for (i, (name, _, _)) in shards[0].iter().enumerate() {
                let parts: Vec<Tensor> = shards
                    .iter()
                    .map(|s| Tensor::from_vec(s[i].2.clone(), s[i].1.as_slice(), &Device::Cpu).unwrap())
                    .collect();
                let full = match name.as_str() {
                    "ln.gamma" => parts[0].clone(),
                    "b.weight" => Tensor::cat(&parts, 1).unwrap(),
                    _ => Tensor::cat(&parts, 0).unwrap(),
                };
                let full = if name == "vocab.weight" {
                    let padded = 65usize.div_ceil(tp_size) * tp_size;
                    assert!(bits(&full.narrow(0, 65, padded - 65).unwrap()).iter().all(|b| *b == 0), "padding rows");
                    full.narrow(0, 0, 65).unwrap()
                } else {
                    full
                };
                assert_eq!(bits(&full), reference[name], "{name} at tp {tp_size} (reverse order: {reverse})");
            }
        }
    }
    // A different seed or name gives different values (the streams are really keyed by both).
    let other_seed = ParamBuilder::new(&VarMap::new(), &single(), SEED + 1, DType::F32, &Device::Cpu).pp("m");
    let t = other_seed.sharded("a.weight", (8, 12), 0, ParamInit::Normal { std: 0.02 }).unwrap();
    assert_ne!(bits(&t), reference["a.weight"]);
    let other_name = dense_builder().pp("m").sharded("c.weight", (8, 12), 0, ParamInit::Normal { std: 0.02 }).unwrap();
    assert_ne!(bits(&other_name), reference["a.weight"]);
}

#[test]
fn param_builder_registers_layouts_casts_and_var_builder_shares_the_varmap() {
    let out = run_tp(2, |tp| {
        let varmap = VarMap::new();
        let pb = ParamBuilder::new(&varmap, &tp, SEED, DType::BF16, &Device::Cpu).pp("h").pp("0");
        let w = pb.sharded_padded("wte", (65, 4), 0, ParamInit::Ones).unwrap();
        let r = pb.replicated("ln", 4, ParamInit::Zeros).unwrap();
        let lin = candle_nn::linear(3, 2, pb.var_builder().pp("dense")).unwrap();
        let data = varmap.data().lock().unwrap();
        let mut names: Vec<String> = data.keys().cloned().collect();
        names.sort();
        let layout_w = tp.layout(&data["h.0.wte"]);
        let layout_r = tp.layout(&data["h.0.ln"]);
        (names, layout_w, layout_r, w.dims().to_vec(), w.dtype(), r.dtype(), lin.weight().dtype())
    });
    for (rank, (names, lw, lr, wdims, wdt, rdt, ldt)) in out.into_iter().enumerate() {
        assert_eq!(names, ["h.0.dense.bias", "h.0.dense.weight", "h.0.ln", "h.0.wte"]);
        assert_eq!(lw, ParamLayout::Sharded { dim: 0, full: 65, padded: 66 });
        assert_eq!(lw.shard_range(rank, 2), Some(rank * 33..(rank + 1) * 33));
        assert_eq!(lr, ParamLayout::Replicated);
        assert_eq!(wdims, [33, 4]);
        assert_eq!((wdt, rdt, ldt), (DType::BF16, DType::BF16, DType::BF16));
    }
}

#[test]
fn errors_name_the_parameter_the_sizes_and_what_would_fit() {
    let out = run_tp(4, |tp| {
        let varmap = VarMap::new();
        let pb = ParamBuilder::new(&varmap, &tp, SEED, DType::F32, &Device::Cpu).pp("blk");
        let sharded = pb.sharded("qkv.weight", (6, 3), 0, ParamInit::Zeros).unwrap_err().to_string();
        let head = ColumnParallelLinear::new(&pb.pp("head"), 4, 65, ParallelLinearConfig::default())
            .err()
            .unwrap()
            .to_string();
        let row =
            RowParallelLinear::new(&pb.pp("proj"), 10, 4, ParallelLinearConfig::default()).err().unwrap().to_string();
        pb.replicated("ln", 3, ParamInit::Ones).unwrap();
        let dup = pb.replicated("ln", 3, ParamInit::Ones).unwrap_err().to_string();
        let emb = VocabParallelEmbedding::new(&pb.pp("wte"), 65, 2, ParamInit::Zeros).unwrap();
        let bad_id = Tensor::from_vec(vec![3u32, 65], 2, &Device::Cpu).unwrap();
        let id_err = emb.forward(&bad_id).err().unwrap().to_string();
        let logits = Tensor::zeros((2, 16), DType::F32, &Device::Cpu).unwrap();
        let targets = Tensor::from_vec(vec![0u32, 1], 2, &Device::Cpu).unwrap();
        let ce_cols = vocab_parallel_cross_entropy(&logits, &targets, &tp, 65).unwrap_err().to_string();
        let logits = Tensor::zeros((2, 17), DType::F32, &Device::Cpu).unwrap();
        let bad_t = Tensor::from_vec(vec![0u32, 70], 2, &Device::Cpu).unwrap();
        let ce_target = vocab_parallel_cross_entropy(&logits, &bad_t, &tp, 65).unwrap_err().to_string();
        [sharded, head, row, dup, id_err, ce_cols, ce_target]
    });
    let [sharded, head, row, dup, id_err, ce_cols, ce_target] = &out[0];
    for (msg, parts) in [
        (sharded, &["`blk.qkv.weight`", "[6, 3]", "dim 0", "size 6", "tp size 4", "1, 2, 3, 6"][..]),
        (head, &["`blk.head.weight`", "size 65", "tp size 4", "1, 5, 13, 65", "pad_output"][..]),
        (row, &["`blk.proj.weight`", "dim 1", "size 10", "tp size 4", "1, 2, 5, 10"][..]),
        (dup, &["`blk.ln`", "already exists"][..]),
        (id_err, &["VocabParallelEmbedding", "id 65", "vocabulary of 65"][..]),
        (ce_cols, &["16 columns", "vocabulary of 65", "tp size 4", "17 per rank", "68 padded"][..]),
        (ce_target, &["id 70", "vocabulary of 65"][..]),
    ] {
        for p in parts {
            assert!(msg.contains(p), "{msg:?} should mention {p:?}");
        }
    }
}

/// A vocabulary head of 65 outputs with `pad_output` and `gather_output`: every rank gets the dense `[.., 65]`
/// logits (the padding columns cut off) and its chunk of the weight gradient, padding rows zero.
#[test]
fn padded_head_with_gather_output_matches_dense() {
    for tp_size in TPS {
        let out = run_tp(tp_size, move |tp| {
            let varmap = VarMap::new();
            let pb = ParamBuilder::new(&varmap, &tp, SEED, DType::F32, &Device::Cpu);
            let cfg = ParallelLinearConfig { pad_output: true, gather_output: true, ..linear_cfg(true) };
            let head = ColumnParallelLinear::new(&pb.pp("head"), IN, VOCAB, cfg).unwrap();
            set_full(&varmap, &tp, "head.bias", &det(&[VOCAB], 12));
            let x = Var::from_tensor(&det(&[3, IN], 13)).unwrap();
            let y = head.forward(x.as_tensor()).unwrap();
            let g = y.mul(&det(&[3, VOCAB], 14)).unwrap().sum_all().unwrap().backward().unwrap();
            let gw = g.get(head.weight()).unwrap();
            let gb = g.get(head.bias().unwrap()).unwrap();
            (vals(&y), vals(g.get(&x).unwrap()), vals(gw), vals(gb))
        });
        let (w, b) = dense_linear("head", IN, VOCAB, 12);
        let x = Var::from_tensor(&det(&[3, IN], 13)).unwrap();
        let y = candle_nn::Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone())).forward(&x).unwrap();
        let g = y.mul(&det(&[3, VOCAB], 14)).unwrap().sum_all().unwrap().backward().unwrap();
        let padded = VOCAB.div_ceil(tp_size) * tp_size;
        let pad = |t: &Tensor| t.pad_with_zeros(0, 0, padded - VOCAB).unwrap();
        for (r, (yr, gx, gw, gb)) in out.iter().enumerate() {
            let what = format!("padded head tp {tp_size} rank {r}");
            assert_close(yr, &y, &format!("{what}: gathered output"));
            assert_close(gx, g.get(&x).unwrap(), &format!("{what}: input gradient"));
            assert_close(gw, &chunk(&pad(g.get(&w).unwrap()), 0, r, tp_size), &format!("{what}: weight gradient"));
            assert_close(gb, &chunk(&pad(g.get(&b).unwrap()), 0, r, tp_size), &format!("{what}: bias gradient"));
        }
    }
}

/// The whole chain a tensor-parallel language model runs: vocab-parallel embedding → column → gelu → row →
/// padded column-parallel head (no gather) → vocab-parallel cross entropy; the mean loss and every parameter
/// gradient equal the dense model's (`Embedding`, `Linear`s, `loss::cross_entropy`).
#[test]
fn embedding_mlp_head_cross_entropy_chain_matches_dense() {
    const D_MODEL: usize = 8;
    const D_FF: usize = 16;
    let ids = || Tensor::from_vec(vec![5u32, 64, 33, 0, 51, 17, 40, 63], (2, 4), &Device::Cpu).unwrap();
    let targets = || Tensor::from_vec(vec![64u32, 33, 0, 51, 17, 40, 63, 2], 8, &Device::Cpu).unwrap();
    let emb_init = ParamInit::Normal { std: 1.0 };
    for tp_size in TPS {
        let out = run_tp(tp_size, move |tp| {
            let varmap = VarMap::new();
            let pb = ParamBuilder::new(&varmap, &tp, SEED, DType::F32, &Device::Cpu);
            let wte = VocabParallelEmbedding::new(&pb.pp("wte"), VOCAB, D_MODEL, emb_init).unwrap();
            let fc = ColumnParallelLinear::new(&pb.pp("fc"), D_MODEL, D_FF, linear_cfg(true)).unwrap();
            let proj = RowParallelLinear::new(&pb.pp("proj"), D_FF, D_MODEL, linear_cfg(true)).unwrap();
            let head_cfg = ParallelLinearConfig { pad_output: true, ..linear_cfg(false) };
            let head = ColumnParallelLinear::new(&pb.pp("head"), D_MODEL, VOCAB, head_cfg).unwrap();
            set_full(&varmap, &tp, "fc.bias", &det(&[D_FF], 21));
            set_full(&varmap, &tp, "proj.bias", &det(&[D_MODEL], 22));
            let h = wte.forward(&ids()).unwrap();
            let h = (&h + proj.forward(&fc.forward(&h).unwrap().gelu().unwrap()).unwrap()).unwrap();
            let logits = head.forward(&h).unwrap().flatten_to(1).unwrap();
            let losses = vocab_parallel_cross_entropy(&logits, &targets(), &tp, VOCAB).unwrap();
            let loss = losses.mean_all().unwrap();
            let g = loss.backward().unwrap();
            let params = [wte.weight(), fc.weight(), fc.bias().unwrap(), proj.weight(), proj.bias().unwrap()];
            let grads = params.map(|p| vals(g.get(p).unwrap()));
            (loss.to_scalar::<f32>().unwrap(), grads, vals(g.get(head.weight()).unwrap()))
        });
        let pb = dense_builder();
        let wte = Var::from_tensor(&pb.pp("wte").replicated("weight", (VOCAB, D_MODEL), emb_init).unwrap()).unwrap();
        let (w1, b1) = dense_linear("fc", D_MODEL, D_FF, 21);
        let (w2, b2) = dense_linear("proj", D_FF, D_MODEL, 22);
        let wh = pb.pp("head").replicated("weight", (VOCAB, D_MODEL), ParamInit::Normal { std: 0.5 }).unwrap();
        let wh = Var::from_tensor(&wh).unwrap();
        let lin = |w: &Var, b: &Var| candle_nn::Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()));
        let h = candle_nn::Embedding::new(wte.as_tensor().clone(), D_MODEL).forward(&ids()).unwrap();
        let h = (&h + lin(&w2, &b2).forward(&lin(&w1, &b1).forward(&h).unwrap().gelu().unwrap()).unwrap()).unwrap();
        let logits = candle_nn::Linear::new(wh.as_tensor().clone(), None).forward(&h).unwrap().flatten_to(1).unwrap();
        let loss = candle_nn::loss::cross_entropy(&logits, &targets()).unwrap();
        let g = loss.backward().unwrap();
        let loss = loss.to_scalar::<f32>().unwrap();
        let padded = VOCAB.div_ceil(tp_size) * tp_size;
        let pad = |t: &Tensor| t.pad_with_zeros(0, 0, padded - VOCAB).unwrap();
        for (r, (loss_r, grads, g_head)) in out.iter().enumerate() {
            let what = format!("chain tp {tp_size} rank {r}");
            assert!((loss_r - loss).abs() <= TOL * loss.abs().max(1.0), "{what}: loss {loss_r} vs dense {loss}");
            let want = [
                chunk(&pad(g.get(&wte).unwrap()), 0, r, tp_size),
                chunk(g.get(&w1).unwrap(), 0, r, tp_size),
                chunk(g.get(&b1).unwrap(), 0, r, tp_size),
                chunk(g.get(&w2).unwrap(), 1, r, tp_size),
                g.get(&b2).unwrap().clone(),
            ];
            for (name, (got, want)) in
                ["wte", "fc.weight", "fc.bias", "proj.weight", "proj.bias"].iter().zip(grads.iter().zip(&want))
            {
                assert_close(got, want, &format!("{what}: {name} gradient"));
            }
            assert_close(g_head, &chunk(&pad(g.get(&wh).unwrap()), 0, r, tp_size), &format!("{what}: head gradient"));
        }
    }
}

/// A vocabulary of 5 over tp 4 pads to 8: rank 3 holds only padding columns (its max is −inf, every target
/// lookup lands on a −inf column). The losses and gradients stay finite and equal the dense ones; bf16 logits
/// are computed in f32 and give the same losses as their f32 values.
#[test]
fn cross_entropy_with_a_rank_holding_only_padding_and_bf16_logits() {
    const V: usize = 5;
    let logits = || (det(&[4, V], 31) * 3.0).unwrap();
    let targets = || Tensor::from_vec(vec![0u32, 4, 2, 3], 4, &Device::Cpu).unwrap();
    let out = run_tp(4, move |tp| {
        let full = logits().pad_with_zeros(1, 0, 8 - V).unwrap();
        let local = Var::from_tensor(&chunk(&full, 1, tp.rank(), 4)).unwrap();
        let losses = vocab_parallel_cross_entropy(local.as_tensor(), &targets(), &tp, V).unwrap();
        let g = losses.sum_all().unwrap().backward().unwrap();
        let bf16 = local.as_tensor().to_dtype(DType::BF16).unwrap();
        let losses_bf16 = vocab_parallel_cross_entropy(&bf16, &targets(), &tp, V).unwrap();
        let as_f32 = bf16.to_dtype(DType::F32).unwrap();
        let losses_as_f32 = vocab_parallel_cross_entropy(&as_f32, &targets(), &tp, V).unwrap();
        (vals(&losses), vals(g.get(&local).unwrap()), vals(&losses_bf16), losses_as_f32, losses_bf16.dtype())
    });
    let x = Var::from_tensor(&logits()).unwrap();
    let dense = candle_nn::ops::log_softmax(&x, D::Minus1)
        .unwrap()
        .gather(&targets().unsqueeze(1).unwrap(), 1)
        .unwrap()
        .squeeze(1)
        .unwrap()
        .neg()
        .unwrap();
    let g = dense.sum_all().unwrap().backward().unwrap();
    let g_full = g.get(&x).unwrap().pad_with_zeros(1, 0, 8 - V).unwrap();
    for (r, (losses, gl, losses_bf16, losses_as_f32, dt)) in out.iter().enumerate() {
        let what = format!("vocab {V} tp 4 rank {r}");
        assert!(gl.v.iter().all(|v| v.is_finite()), "{what}: gradient not finite: {:?}", gl.v);
        assert_close(losses, &dense, &format!("{what}: losses"));
        assert_close(gl, &chunk(&g_full, 1, r, 4), &format!("{what}: gradient"));
        assert_eq!(*dt, DType::F32, "{what}: losses are f32 whatever the logits' dtype");
        assert_close(losses_bf16, losses_as_f32, &format!("{what}: bf16 logits"));
    }
}
