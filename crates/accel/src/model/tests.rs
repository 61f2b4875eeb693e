//! Every gradient passes through its group's strategy: a counting strategy wrapped around the real one records
//! what each path of the step asks of it — plain backward, overlapped backward, an accumulation window, fp16
//! loss scaling, tensor parallelism — and the parameters after the step are those of the same run without the
//! wrapper, bit for bit (the wrapper only counts).

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
    fn after_optimizer_step(&self, masters: &[Var]) -> crate::Result<()> {
        self.counts.after_step.fetch_add(1, Ordering::SeqCst);
        self.inner.after_optimizer_step(masters)
    }
}

/// Which road a run takes.
#[derive(Clone, Copy, Debug)]
struct Path {
    overlapped: bool,
    accumulation: usize,
    precision: MixedPrecision,
    tp: usize,
    clip: bool,
}

const PLAIN: Path = Path { overlapped: false, accumulation: 1, precision: MixedPrecision::No, tp: 1, clip: false };

/// One optimizer step of a two-layer column/row-parallel MLP (8 → 8 → 4, tanh, a cut between the layers) on
/// `path.tp` ranks as threads, every micro-batch the same fixed batch; returns each rank's full weights after
/// the step and the strategy's counts. `counting: false` runs the real strategy alone.
fn one_step(path: Path, counting: bool) -> Vec<(Vec<Vec<f32>>, [usize; 5])> {
    let cfg = AcceleratorConfig {
        mixed_precision: path.precision,
        gradient_accumulation_steps: path.accumulation,
        seed: Some(3),
        parallelism: ParallelismConfig { tp_size: path.tp, ..ParallelismConfig::default() },
        ..AcceleratorConfig::default()
    };
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(60)));
    let ranks: Vec<_> = (0..path.tp)
        .map(|rank| {
            let (store, cfg) = (store.clone(), cfg.clone());
            std::thread::spawn(move || {
                let pg = if path.tp == 1 {
                    ProcessGroup::single_process().unwrap()
                } else {
                    let opts = GroupOptions { timeout: Duration::from_secs(60), ..Default::default() };
                    ProcessGroup::from_store(store, rank, path.tp, opts).unwrap()
                };
                run_rank(Accelerator::with_process_group(cfg, pg).unwrap(), path, counting).unwrap()
            })
        })
        .collect();
    ranks.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
}

fn run_rank(acc: Accelerator, path: Path, counting: bool) -> crate::Result<(Vec<Vec<f32>>, [usize; 5])> {
    let varmap = VarMap::new();
    let pb = acc.param_builder(&varmap);
    let init = ParallelLinearConfig { init: ParamInit::Normal { std: 0.5 }, ..ParallelLinearConfig::default() };
    let up = ColumnParallelLinear::new(&pb.pp("up"), 8, 8, init)?;
    let down = RowParallelLinear::new(&pb.pp("down"), 8, 4, init)?;
    let counts = Arc::new(Counts::default());
    let wrap = |m: &mut PreparedModel| {
        if counting {
            m.map_strategies(|inner| Box::new(Counting { inner, counts: counts.clone() }));
        }
    };
    let model = acc.prepare_model_then(&varmap, wrap)?;
    let mut opt = acc.prepare_optimizer(&model, Sgd::new(SgdConfig::new(0.1))?)?;
    let x =
        Tensor::arange(0f32, 16.0, &Device::Cpu)?.reshape((2, 8))?.affine(0.1, -0.5)?.to_dtype(acc.compute_dtype())?;
    let forward = || -> crate::Result<Tensor> {
        let h = segments::cut(&up.forward(&x)?.tanh()?)?;
        Ok(down.forward(&h)?.to_dtype(DType::F32)?.sqr()?.mean_all()?)
    };
    for _ in 0..path.accumulation {
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
    assert!(opt.step()?, "{path:?}: the optimizer stepped");
    let weights =
        model.state_dict()?.values().map(|t| t.flatten_all()?.to_vec1::<f32>()).collect::<candle_core::Result<_>>()?;
    Ok((weights, counts.get()))
}

/// [reduce, overlapped, norm, any_rank, after_step] on every rank, and the same weights as without the wrapper.
fn assert_path(path: Path, want: [usize; 5]) {
    let counted = one_step(path, true);
    let reference = one_step(path, false);
    for (rank, ((weights, counts), (plain, _))) in counted.iter().zip(&reference).enumerate() {
        assert_eq!(*counts, want, "{path:?}, rank {rank}: [reduce, overlapped, norm, any_rank, after_step]");
        assert_eq!(weights, plain, "{path:?}, rank {rank}: the counting wrapper changed the result");
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
fn tensor_parallel_gradients_norms_and_overflow_go_through_the_strategy() {
    assert_path(Path { tp: 2, clip: true, ..PLAIN }, [1, 0, 1, 0, 1]);
    assert_path(
        Path { tp: 2, overlapped: true, precision: MixedPrecision::Fp16, clip: true, ..PLAIN },
        [0, 1, 1, 1, 1],
    );
}

#[test]
fn tensor_parallel_step_equals_one_process() {
    // The road through the strategy trains the single-process model: tp = 2 ends where tp = 1 does.
    let single = one_step(Path { clip: true, ..PLAIN }, false);
    let split = one_step(Path { tp: 2, clip: true, ..PLAIN }, false);
    for (a, b) in single[0].0.iter().zip(&split[0].0) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-6 * (1.0 + x.abs()), "{x} vs {y}");
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
                // A replica built by candle, the same on both ranks: prepared, and registered as replicated.
                let replicas = VarMap::new();
                acc.var_builder(&replicas).get_with_hints(3, "ln.weight", candle_nn::Init::Const(1.0)).unwrap();
                acc.prepare_model(&replicas).unwrap();
                let ln = acc.tensor_parallel().registered(&replicas.data().lock().unwrap()["ln.weight"]);
                // A shard made by hand (each rank its own values) beside another replica: refused, named.
                let mixed = VarMap::new();
                let vb = acc.var_builder(&mixed);
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
