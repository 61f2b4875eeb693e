//! Shared helpers of the Accelerator tests: ranks as threads over an in-memory store, a tiny deterministic MLP,
//! deterministic data, and tensor comparisons.
#![allow(dead_code)]

use accel::{Accelerator, AcceleratorConfig};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use ddp_core::store::MemoryStore;
use ddp_core::{GroupOptions, ProcessGroup, Store};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Runs `f(accelerator)` on `world` ranks (threads sharing a `MemoryStore`), returning each rank's result in
/// rank order. A panic or error on any rank fails the test.
pub fn run_ranks<R: Send + 'static>(
    world: usize,
    cfg: AcceleratorConfig,
    f: impl Fn(Accelerator) -> anyhow::Result<R> + Send + Sync + 'static,
) -> Vec<R> {
    if world == 1 {
        let acc = Accelerator::with_process_group(cfg, ProcessGroup::single_process().unwrap()).unwrap();
        return vec![f(acc).unwrap()];
    }
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(120)));
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, f, cfg) = (store.clone(), f.clone(), cfg.clone());
            std::thread::spawn(move || -> anyhow::Result<R> {
                let opts = GroupOptions { timeout: Duration::from_secs(120), ..Default::default() };
                let pg = ProcessGroup::from_store(store, rank, world, opts)?;
                let acc = Accelerator::with_process_group(cfg, pg)?;
                f(acc)
            })
        })
        .collect();
    handles
        .into_iter()
        .enumerate()
        .map(|(r, h)| {
            h.join().unwrap_or_else(|_| panic!("rank {r} panicked")).unwrap_or_else(|e| panic!("rank {r}: {e:#}"))
        })
        .collect()
}

/// A two-layer MLP `in → hidden (tanh) → out`, built from a `VarBuilder`.
pub struct TinyMlp {
    l1: candle_nn::Linear,
    l2: candle_nn::Linear,
}

impl TinyMlp {
    pub fn new(vb: VarBuilder, input: usize, hidden: usize, out: usize) -> candle_core::Result<Self> {
        Ok(TinyMlp {
            l1: candle_nn::linear(input, hidden, vb.pp("l1"))?,
            l2: candle_nn::linear(hidden, out, vb.pp("l2"))?,
        })
    }
}

impl Module for TinyMlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // A backward-segment cut between the layers: the identity unless the forward pass is recorded
        // (accel::segments::record, for Accelerator::backward_segments).
        self.l2.forward(&accel::segments::cut(&self.l1.forward(x)?.tanh()?)?)
    }
}

pub const IN: usize = 6;
pub const HIDDEN: usize = 16;
pub const OUT: usize = 3;

/// Builds the tiny MLP on `acc`'s device and dtype with weights drawn from `seed` (the same on every rank and in
/// every run, whatever the dtype), and returns it with its VarMap.
pub fn tiny_model(acc: &Accelerator, seed: u64) -> anyhow::Result<(TinyMlp, VarMap)> {
    let varmap = VarMap::new();
    let model = TinyMlp::new(acc.var_builder(&varmap), IN, HIDDEN, OUT)?;
    init_weights(&varmap, seed)?;
    Ok((model, varmap))
}

/// Overwrites every Var of `varmap` (sorted by name) with N(0, 0.5²) values from a ChaCha8 stream.
pub fn init_weights(varmap: &VarMap, seed: u64) -> anyhow::Result<()> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let data = varmap.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in names {
        let v = &data[name];
        let vals: Vec<f32> = (0..v.elem_count()).map(|_| rng.random_range(-0.8f32..0.8)).collect();
        let t = Tensor::from_vec(vals, v.shape(), v.device())?.to_dtype(v.dtype())?;
        v.set(&t)?;
    }
    Ok(())
}

/// `n` deterministic regression rows: inputs `[n, IN]` and class targets `[n]` (u32 in `0..OUT`).
pub fn dataset(n: usize, seed: u64) -> (Tensor, Tensor) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let x: Vec<f32> = (0..n * IN).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let y: Vec<u32> = (0..n).map(|_| rng.random_range(0..OUT as u32)).collect();
    (Tensor::from_vec(x, (n, IN), &Device::Cpu).unwrap(), Tensor::from_vec(y, n, &Device::Cpu).unwrap())
}

/// Mean cross-entropy of the model on `(x, y)`, computed in F32 whatever the compute dtype.
pub fn loss(acc: &Accelerator, model: &TinyMlp, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    let x = x.to_device(acc.device())?.to_dtype(acc.compute_dtype())?;
    let logits = model.forward(&x)?.to_dtype(DType::F32)?;
    candle_nn::loss::cross_entropy(&logits, &y.to_device(acc.device())?)
}

/// fp32 values of named tensors (for comparing runs).
pub fn to_f32_map(m: &BTreeMap<String, Tensor>) -> BTreeMap<String, Vec<f32>> {
    m.iter()
        .map(|(k, t)| (k.clone(), t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// Largest |a − b| / max(1, |b|) over all entries of two weight maps with the same names.
pub fn max_rel_diff(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f32 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter().flat_map(|(k, va)| va.iter().zip(&b[k]).map(|(x, y)| (x - y).abs() / y.abs().max(1.0))).fold(0.0, f32::max)
}

/// Values of a Var as f32.
pub fn var_values(v: &Var) -> Vec<f32> {
    v.as_tensor().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
}
