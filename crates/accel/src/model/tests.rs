//! Every gradient passes through its group's strategy: a counting strategy wrapped around the real one records
//! what each path of the step asks of it — plain backward, overlapped backward, an accumulation window, fp16
//! loss scaling, data and tensor parallelism, several models — and the parameters after the step are those of the
//! same run without the wrapper, bit for bit (the wrapper only counts). A sabotaging strategy (it zeroes what it
//! reduced) shows that nothing reaches the optimizer around the strategy, and every layout steps like one process.

use super::{AddSegment, GradientStrategy, PreparedModel};
use crate::tensor_parallel::{ColumnParallelLinear, ParallelLinearConfig, ParamInit, ParamLayout, RowParallelLinear};
use crate::{Accelerator, AcceleratorConfig, MixedPrecision, ParallelismConfig, Sgd, SgdConfig};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use ddp_core::segments::{self, BackwardSegments};
use ddp_core::store::MemoryStore;
use ddp_core::{GroupOptions, ProcessGroup, Store};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often each road of a strategy was taken.
#[derive(Debug, Default)]
struct Counts {
    reduce: AtomicUsize,
    overlapped: AtomicUsize,
    norm: AtomicUsize,
    any_rank: AtomicUsize,
    after_step: AtomicUsize,
}

impl Counts {
    fn get(&self) -> [usize; 5] {
        [&self.reduce, &self.overlapped, &self.norm, &self.any_rank, &self.after_step].map(|c| c.load(Ordering::SeqCst))
    }
}

#[derive(Debug)]
struct Counting {
    inner: Box<dyn GradientStrategy>,
    counts: Arc<Counts>,
}

impl GradientStrategy for Counting {
    fn reduce(&self, slots: &mut [Option<Tensor>]) -> crate::Result<()> {
        self.counts.reduce.fetch_add(1, Ordering::SeqCst);
        self.inner.reduce(slots)
    }
    fn overlaps(&self) -> bool {
        self.inner.overlaps()
    }
    fn backward_overlapped(
        &self,
        loss: &Tensor,
        segments: BackwardSegments,
        slots: &mut [Option<Tensor>],
        sync: bool,
        add: &mut AddSegment<'_>,
    ) -> crate::Result<()> {
        self.counts.overlapped.fetch_add(1, Ordering::SeqCst);
        self.inner.backward_overlapped(loss, segments, slots, sync, add)
    }
    fn norm_group(&self) -> &ProcessGroup {
        self.inner.norm_group()
    }
    fn squared_norm(&self, per_param: &[f64], layouts: &[ParamLayout]) -> crate::Result<f64> {
        self.counts.norm.fetch_add(1, Ordering::SeqCst);
        self.inner.squared_norm(per_param, layouts)
    }
    fn any_rank(&self, local: bool, layouts: &[ParamLayout]) -> crate::Result<bool> {
        self.counts.any_rank.fetch_add(1, Ordering::SeqCst);
        self.inner.any_rank(local, layouts)
    }
    fn after_optimizer_step(&self, optimized: &[Var], full: &[Var]) -> crate::Result<()> {
        self.counts.after_step.fetch_add(1, Ordering::SeqCst);
        self.inner.after_optimizer_step(optimized, full)
    }
}

/// Zeroes whatever the real strategy leaves in the slots: if the optimizer received gradients by any other road,
/// the weights would move.
#[derive(Debug)]
struct Sabotage {
    inner: Box<dyn GradientStrategy>,
}

fn zero(slots: &mut [Option<Tensor>]) -> crate::Result<()> {
    for s in slots.iter_mut().flatten() {
        *s = s.zeros_like()?;
    }
    Ok(())
}

impl GradientStrategy for Sabotage {
    fn reduce(&self, slots: &mut [Option<Tensor>]) -> crate::Result<()> {
        self.inner.reduce(slots)?;
        zero(slots)
    }
    fn overlaps(&self) -> bool {
        self.inner.overlaps()
    }
    fn backward_overlapped(
        &self,
        loss: &Tensor,
        segments: BackwardSegments,
        slots: &mut [Option<Tensor>],
        sync: bool,
        add: &mut AddSegment<'_>,
    ) -> crate::Result<()> {
        self.inner.backward_overlapped(loss, segments, slots, sync, add)?;
        if sync {
            zero(slots)?;
        }
        Ok(())
    }
    fn norm_group(&self) -> &ProcessGroup {
        self.inner.norm_group()
    }
}

/// What wraps the real strategy in a run.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Wrapper {
    None,
    Counting,
    Sabotage,
}

/// Which road a run takes.
#[derive(Clone, Copy, Debug)]
struct Path {
    overlapped: bool,
    accumulation: usize,
    precision: MixedPrecision,
    dp: usize,
    tp: usize,
    clip: bool,
    /// A second prepared model (a head after the MLP) in the same loss: `backward_segments` then runs the
    /// segments one after the other and each model's strategy reduces after the pass.
    two_models: bool,
}

const PLAIN: Path = Path {
    overlapped: false,
    accumulation: 1,
    precision: MixedPrecision::No,
    dp: 1,
    tp: 1,
    clip: false,
    two_models: false,
};

/// One rank's result: every prepared model's full weights before and after the step, and the counts.
struct RankResult {
    before: Vec<Vec<f32>>,
    after: Vec<Vec<f32>>,
    counts: [usize; 5],
}

/// One optimizer step of a two-layer column/row-parallel MLP (8 → 8 → 4, tanh, a cut between the layers; with
/// `two_models` a 4 → 2 head prepared as a model of its own) on `dp × tp` ranks as threads. Micro-batch `i` of
/// dp rank `r` is batch `r · accumulation + i` of one fixed sequence, so dp 2 × 1 micro-batch and dp 1 × 2
/// micro-batches see the same data. Returns each rank's result.
fn one_step(path: Path, wrapper: Wrapper) -> Vec<RankResult> {
    let world = path.dp * path.tp;
    let cfg = AcceleratorConfig {
        mixed_precision: path.precision,
        gradient_accumulation_steps: path.accumulation,
        seed: Some(3),
        parallelism: ParallelismConfig { tp_size: path.tp, dp_replicate_size: path.dp, ..ParallelismConfig::default() },
        ..AcceleratorConfig::default()
    };
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(60)));
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            let (store, cfg) = (store.clone(), cfg.clone());
            std::thread::spawn(move || {
                let pg = if world == 1 {
                    ProcessGroup::single_process().unwrap()
                } else {
                    let opts = GroupOptions { timeout: Duration::from_secs(60), ..Default::default() };
                    ProcessGroup::from_store(store, rank, world, opts).unwrap()
                };
                run_rank(Accelerator::with_process_group(cfg, pg).unwrap(), path, wrapper).unwrap()
            })
        })
        .collect();
    ranks.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
}

fn full_weights(model: &PreparedModel) -> crate::Result<Vec<Vec<f32>>> {
    Ok(model.state_dict()?.values().map(|t| t.flatten_all()?.to_vec1::<f32>()).collect::<candle_core::Result<_>>()?)
}

fn run_rank(acc: Accelerator, path: Path, wrapper: Wrapper) -> crate::Result<RankResult> {
    let init = ParallelLinearConfig { init: ParamInit::Normal { std: 0.5 }, ..ParallelLinearConfig::default() };
    let (body, head_vars) = (VarMap::new(), VarMap::new());
    let pb = acc.param_builder(&body);
    let up = ColumnParallelLinear::new(&pb.pp("up"), 8, 8, init)?;
    let down = RowParallelLinear::new(&pb.pp("down"), 8, 4, init)?;
    let head = if path.two_models {
        Some(RowParallelLinear::new(&acc.param_builder(&head_vars).pp("head"), 4, 2, init)?)
    } else {
        None
    };
    let counts = Arc::new(Counts::default());
    let wrap = |m: &mut PreparedModel| match wrapper {
        Wrapper::None => {}
        Wrapper::Counting => m.map_strategies(|inner| Box::new(Counting { inner, counts: counts.clone() })),
        Wrapper::Sabotage => m.map_strategies(|inner| Box::new(Sabotage { inner })),
    };
    let mut models = vec![acc.prepare_model_then(&body, wrap)?];
    if path.two_models {
        models.push(acc.prepare_model_then(&head_vars, wrap)?);
    }
    let mut opts = models
        .iter()
        .map(|m| acc.prepare_optimizer(m, Sgd::new(SgdConfig::new(0.1))?))
        .collect::<crate::Result<Vec<_>>>()?;
    let before = models.iter().map(full_weights).collect::<crate::Result<Vec<_>>>()?.concat();
    for i in 0..path.accumulation {
        let batch = (acc.data_parallel_rank() * path.accumulation + i) as f64;
        let x = Tensor::arange(0f32, 16.0, &Device::Cpu)?
            .reshape((2, 8))?
            .affine(0.1, 0.3 * batch - 0.5)?
            .to_dtype(acc.compute_dtype())?;
        let forward = || -> crate::Result<Tensor> {
            let h = segments::cut(&up.forward(&x)?.tanh()?)?;
            let mut y = down.forward(&h)?;
            if let Some(head) = &head {
                y = head.forward(&segments::cut(&y)?)?;
            }
            Ok(y.to_dtype(DType::F32)?.sqr()?.mean_all()?)
        };
        if path.overlapped {
            let (loss, cuts) = segments::record(forward)?;
            acc.backward_segments(&loss, cuts)?;
        } else {
            acc.backward(&forward()?)?;
        }
    }
    if path.clip {
        assert!(acc.clip_grad_norm(0.01)?.is_some(), "the window synced: clipping ran");
    }
    for opt in &mut opts {
        assert!(opt.step()?, "{path:?}: the optimizer stepped");
    }
    let after = models.iter().map(full_weights).collect::<crate::Result<Vec<_>>>()?.concat();
    Ok(RankResult { before, after, counts: counts.get() })
}

/// [reduce, overlapped, norm, any_rank, after_step] on every rank, and the same weights as without the wrapper.
fn assert_path(path: Path, want: [usize; 5]) {
    let counted = one_step(path, Wrapper::Counting);
    let reference = one_step(path, Wrapper::None);
    for (rank, (c, r)) in counted.iter().zip(&reference).enumerate() {
        assert_eq!(c.counts, want, "{path:?}, rank {rank}: [reduce, overlapped, norm, any_rank, after_step]");
        assert_eq!(c.after, r.after, "{path:?}, rank {rank}: the counting wrapper changed the result");
        assert_ne!(r.after, r.before, "{path:?}, rank {rank}: the step moved the weights");
    }
}

/// Equal within `tol` relative to each value's size.
fn assert_close(a: &[Vec<f32>], b: &[Vec<f32>], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        assert!((x - y).abs() <= tol * (1.0 + x.abs()), "{what}: {x} vs {y}");
    }
}

#[test]
fn plain_backward_reduces_through_the_strategy() {
    assert_path(PLAIN, [1, 0, 0, 0, 1]);
}

#[test]
fn overlapped_backward_reduces_through_the_strategy() {
    assert_path(Path { overlapped: true, ..PLAIN }, [0, 1, 0, 0, 1]);
}

#[test]
fn an_accumulation_window_reduces_once_through_the_strategy() {
    assert_path(Path { accumulation: 3, ..PLAIN }, [1, 0, 0, 0, 1]);
    assert_path(Path { accumulation: 2, overlapped: true, ..PLAIN }, [0, 2, 0, 0, 1]);
}

#[test]
fn fp16_overflow_and_clipping_ask_the_strategy() {
    assert_path(Path { precision: MixedPrecision::Fp16, ..PLAIN }, [1, 0, 0, 1, 1]);
    assert_path(Path { precision: MixedPrecision::Fp16, clip: true, ..PLAIN }, [1, 0, 1, 1, 1]);
}

#[test]
fn data_and_tensor_parallel_gradients_norms_and_overflow_go_through_the_strategy() {
    assert_path(Path { tp: 2, clip: true, ..PLAIN }, [1, 0, 1, 0, 1]);
    assert_path(
        Path { tp: 2, overlapped: true, precision: MixedPrecision::Fp16, clip: true, ..PLAIN },
        [0, 1, 1, 1, 1],
    );
    assert_path(Path { dp: 2, ..PLAIN }, [1, 0, 0, 0, 1]);
    assert_path(Path { dp: 2, tp: 2, overlapped: true, clip: true, ..PLAIN }, [0, 1, 1, 0, 1]);
}

#[test]
fn several_models_each_reduce_through_their_strategy() {
    // Two models: the segmented backward runs without overlap, then each model's strategy reduces.
    assert_path(Path { two_models: true, ..PLAIN }, [2, 0, 0, 0, 2]);
    assert_path(Path { two_models: true, overlapped: true, clip: true, ..PLAIN }, [2, 0, 2, 0, 2]);
}

#[test]
fn the_strategy_is_the_only_road_to_the_optimizer() {
    // A strategy that zeroes what it reduced: no weight may move, on any path.
    for path in [
        PLAIN,
        Path { overlapped: true, ..PLAIN },
        Path { accumulation: 2, ..PLAIN },
        Path { precision: MixedPrecision::Fp16, clip: true, ..PLAIN },
        Path { dp: 2, tp: 2, overlapped: true, ..PLAIN },
        Path { two_models: true, overlapped: true, ..PLAIN },
    ] {
        for (rank, r) in one_step(path, Wrapper::Sabotage).iter().enumerate() {
            assert_eq!(
                r.after, r.before,
                "{path:?}, rank {rank}: a gradient reached the optimizer around the strategy"
            );
        }
    }
}

#[test]
fn every_layout_steps_like_one_process_on_the_whole_batch() {
    // dp 1 × 2 micro-batches ≡ dp 2 × 1 ≡ dp 2 × tp 2, with clipping (the global norm) and the overlapped path.
    for overlapped in [false, true] {
        let base = Path { overlapped, clip: true, ..PLAIN };
        let single = one_step(Path { accumulation: 2, ..base }, Wrapper::None);
        for layout in [Path { dp: 2, ..base }, Path { dp: 2, tp: 2, ..base }, Path { tp: 2, accumulation: 2, ..base }] {
            for (rank, r) in one_step(layout, Wrapper::None).iter().enumerate() {
                assert_close(&single[0].after, &r.after, 1e-6, &format!("{layout:?}, rank {rank}"));
            }
        }
    }
}

#[test]
fn a_parameter_built_outside_the_param_builder_must_be_the_same_on_every_tp_rank() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(60)));
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let opts = GroupOptions { timeout: Duration::from_secs(60), ..Default::default() };
                let pg = ProcessGroup::from_store(store, rank, 2, opts).unwrap();
                let cfg = AcceleratorConfig {
                    parallelism: ParallelismConfig { tp_size: 2, ..ParallelismConfig::default() },
                    ..AcceleratorConfig::default()
                };
                let acc = Accelerator::with_process_group(cfg, pg).unwrap();
                // A replica built by candle beside a tensor-parallel model (ParamBuilder::var_builder, for layers
                // with no parallel form), the same on both ranks: prepared, and registered as replicated.
                let replicas = VarMap::new();
                let pb = acc.param_builder(&replicas);
                pb.var_builder().get_with_hints(3, "ln.weight", candle_nn::Init::Const(1.0)).unwrap();
                acc.prepare_model(&replicas).unwrap();
                let ln = acc.tensor_parallel().registered(&replicas.data().lock().unwrap()["ln.weight"]);
                // A shard made by hand (each rank its own values) beside another replica: refused, named.
                let mixed = VarMap::new();
                let vb = acc.param_builder(&mixed).var_builder();
                vb.get_with_hints(3, "ln2.weight", candle_nn::Init::Const(1.0)).unwrap();
                vb.get_with_hints((2, 3), "w_local", candle_nn::Init::Const(rank as f64)).unwrap();
                let err = acc.prepare_model(&mixed).unwrap_err().to_string();
                (err, ln)
            })
        })
        .collect();
    for h in ranks {
        let (err, ln) = h.join().unwrap();
        assert!(err.contains("[\"w_local\"]") && err.contains("ParamBuilder::sharded"), "{err}");
        assert!(!err.contains("ln2.weight"), "{err}");
        assert_eq!(ln, Some(ParamLayout::Replicated));
    }
}
