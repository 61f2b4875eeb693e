//! Shared pieces of the trainer's integration tests: small deterministic data sets and models, ranks as threads
//! over an in-memory store, and exact parameter snapshots.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use accel::data::{Batch, Dataset, TensorDataset};
use accel::dist::MemoryStore;
use accel::dist::{GroupOptions, ProcessGroup, Store};
use candle_core::{DType, Device, Module, ModuleT, Tensor};
use candle_nn::VarBuilder;
use trainer::metrics::IGNORE_INDEX;

/// Features per sample of [`classification_data`].
pub const FEATURES: usize = 6;
/// Classes of [`classification_data`].
pub const CLASSES: usize = 3;

/// `n` samples: inputs `[n, 6]` f32 from a fixed formula, labels `[n]` u32 in 0..3 that depend on the inputs
/// (so a model can learn them).
pub fn classification_data(n: usize) -> TensorDataset {
    let mut xs = Vec::with_capacity(n * FEATURES);
    let mut ys = Vec::with_capacity(n);
    for i in 0..n {
        let row: Vec<f32> = (0..FEATURES).map(|j| ((i as f32) * 0.37 + (j as f32) * 1.3).sin()).collect();
        let label = if row[0] + row[1] > 0.5 {
            0
        } else if row[2] > 0.0 {
            1
        } else {
            2
        };
        xs.extend(row);
        ys.push(label as u32);
    }
    TensorDataset::new(
        Tensor::from_vec(xs, (n, FEATURES), &Device::Cpu).unwrap(),
        Tensor::from_vec(ys, n, &Device::Cpu).unwrap(),
    )
    .unwrap()
}

/// A 6 → 16 → 3 MLP.
pub struct Mlp {
    fc1: candle_nn::Linear,
    fc2: candle_nn::Linear,
}

impl Mlp {
    pub fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Mlp {
            fc1: candle_nn::linear(FEATURES, 16, vb.pp("fc1"))?,
            fc2: candle_nn::linear(16, CLASSES, vb.pp("fc2"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(xs)?.relu()?)
    }
}

/// Vocabulary of [`TokenData`].
pub const VOCAB: usize = 7;
/// Padded sequence length of [`TokenData`].
pub const SEQ: usize = 6;

/// Variable-length token sequences: inputs `[n, 6]` u32 token ids (0-padded), targets `[n, 6]` i64 next tokens
/// with -100 after each sequence's own length (1..=6, varying a lot between samples).
#[derive(Clone)]
pub struct TokenData {
    inputs: Tensor,
    targets: Tensor,
    n: usize,
}

impl TokenData {
    pub fn new(n: usize) -> Self {
        let mut xs = Vec::with_capacity(n * SEQ);
        let mut ys = Vec::with_capacity(n * SEQ);
        for i in 0..n {
            let len = 1 + (i * 5 + i / 3) % SEQ;
            for t in 0..SEQ {
                let tok = ((i * 3 + t * 2) % VOCAB) as u32;
                xs.push(if t < len { tok } else { 0 });
                ys.push(if t < len { ((tok as usize * 2 + 1) % VOCAB) as i64 } else { IGNORE_INDEX });
            }
        }
        TokenData {
            inputs: Tensor::from_vec(xs, (n, SEQ), &Device::Cpu).unwrap(),
            targets: Tensor::from_vec(ys, (n, SEQ), &Device::Cpu).unwrap(),
            n,
        }
    }
}

impl Dataset for TokenData {
    fn len(&self) -> usize {
        self.n
    }
    fn get_batch(&self, indices: &[usize]) -> accel::Result<Batch> {
        let ids: Vec<u32> = indices.iter().map(|&i| i as u32).collect();
        let ids = Tensor::from_vec(ids, indices.len(), &Device::Cpu)?;
        Ok(Batch { inputs: self.inputs.index_select(&ids, 0)?, targets: self.targets.index_select(&ids, 0)? })
    }
}

/// Embedding (7 × 8) → Linear (8 → 7) applied per token: `[b, T]` ids → `[b, T, 7]` logits.
pub struct TokenModel {
    emb: candle_nn::Embedding,
    out: candle_nn::Linear,
}

impl TokenModel {
    pub fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(TokenModel {
            emb: candle_nn::embedding(VOCAB, 8, vb.pp("emb"))?,
            out: candle_nn::linear(8, VOCAB, vb.pp("out"))?,
        })
    }
}

impl Module for TokenModel {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.out.forward(&self.emb.forward(xs)?.tanh()?)
    }
}

/// Runs `f(pg)` on `world` threads, each one rank of a process group over a shared in-memory store; returns
/// the results in rank order. A generous collective timeout keeps a failing rank from hanging the test forever.
pub fn run_ranks<R: Send + 'static>(world: usize, f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static) -> Vec<R> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(120)));
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, f) = (store.clone(), f.clone());
            std::thread::Builder::new()
                .name(format!("rank{rank}"))
                .spawn(move || {
                    let opts = GroupOptions { timeout: Duration::from_secs(120), ..GroupOptions::default() };
                    let pg = ProcessGroup::from_store(store, rank, world, opts).expect("process group");
                    f(pg)
                })
                .unwrap()
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
}

/// Every parameter's raw f32 values by name (sorted): an exact snapshot for bit-for-bit comparisons.
pub fn snapshot<M: ModuleT + 'static, D: Dataset + 'static>(t: &trainer::Trainer<M, D>) -> Vec<(String, Vec<u32>)> {
    let prepared = t.prepared_model().expect("trainer set up");
    prepared
        .state_dict()
        .expect("state_dict")
        .into_iter()
        .map(|(k, v)| {
            let bits = v.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (k, bits.into_iter().map(f32::to_bits).collect())
        })
        .collect()
}

/// Largest relative difference between two snapshots (same names required).
pub fn max_rel_diff(a: &[(String, Vec<u32>)], b: &[(String, Vec<u32>)]) -> f64 {
    assert_eq!(a.iter().map(|p| &p.0).collect::<Vec<_>>(), b.iter().map(|p| &p.0).collect::<Vec<_>>());
    let mut worst = 0.0f64;
    for ((_, x), (_, y)) in a.iter().zip(b) {
        for (p, q) in x.iter().zip(y) {
            let (p, q) = (f32::from_bits(*p) as f64, f32::from_bits(*q) as f64);
            worst = worst.max((p - q).abs() / p.abs().max(q.abs()).max(1e-3));
        }
    }
    worst
}
