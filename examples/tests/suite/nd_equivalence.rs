//! Every parallel layout of the char-GPT trains like the single-process model: the same
//! losses and gradient norms step by step at tp2, tp4 and dp2×tp2 — with and without gradient accumulation —
//! and a tp2 checkpoint loads into one process and into dp2 with the same next-step loss.
//!
//! Method (torchtitan's `loss_compare.py`, nanotron's `test_clip_grads.py`): f32, no dropout, the same seed on the
//! full model (each rank slices its shard), the global batch held fixed — step `s` uses the same 8 windows of the
//! shipped Shakespeare text in every layout, each data-parallel rank taking its contiguous share and splitting it
//! into `ga` micro-batches. Ranks are threads over loopback. Tolerance: relative 1e-5 (summation order differs:
//! tp sums partial matmuls across ranks, dp averages per-rank gradients).

use accel::data::CharVocab;
use accel::{Accelerator, AcceleratorConfig, AdamW, AdamWConfig, ParallelismConfig};
use accel_examples::gpt::{CharGpt, GptConfig};
use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use ddp_core::store::MemoryStore;
use ddp_core::{GroupOptions, ProcessGroup, Store};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

pub(super) const GLOBAL_BATCH: usize = 8;
pub(super) const SEQ: usize = 16;
const STEPS: usize = 5;
pub(super) const SEED: u64 = 1234;
pub(super) const RTOL: f64 = 1e-5;

/// The first 20 000 characters of the shipped text and their vocabulary.
pub(super) fn corpus() -> (Vec<u32>, usize) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/shakespeare/shakespeare8.txt");
    let text: String =
        std::fs::read_to_string(path).expect("the shipped Shakespeare text").chars().take(20_000).collect();
    let vocab = CharVocab::from_text(&text);
    let ids = vocab.encode(&text).expect("every character is in its own vocabulary");
    // An odd vocabulary (one unused id when the text's is even), so tp 2 and 4 pad the embedding and the head.
    let vocab_size = vocab.len() | 1;
    (ids, vocab_size)
}

pub(super) fn model_config(vocab_size: usize) -> GptConfig {
    GptConfig {
        vocab_size,
        block_size: SEQ,
        n_layer: 2,
        n_head: 4,
        d_model: 32,
        d_ff: 64,
        tie_embeddings: false,
        dropout: 0.0,
    }
}

/// The global batch of step `step`: `GLOBAL_BATCH` windows (inputs, next-character targets), deterministic.
pub(super) fn global_batch(ids: &[u32], step: usize) -> Vec<Window> {
    (0..GLOBAL_BATCH)
        .map(|i| {
            let start = (step * 7919 + i * 1013) % (ids.len() - SEQ - 1);
            (ids[start..start + SEQ].to_vec(), ids[start + 1..start + SEQ + 1].to_vec())
        })
        .collect()
}

/// One training window: input ids and next-character targets.
pub(super) type Window = (Vec<u32>, Vec<u32>);

pub(super) fn to_tensors(rows: &[Window], device: &Device) -> (Tensor, Tensor) {
    let inputs: Vec<u32> = rows.iter().flat_map(|r| r.0.clone()).collect();
    let targets: Vec<u32> = rows.iter().flat_map(|r| r.1.clone()).collect();
    let x = Tensor::from_vec(inputs, (rows.len(), SEQ), device).unwrap();
    let y = Tensor::from_vec(targets, (rows.len(), SEQ), device).unwrap();
    (x, y)
}

/// What one rank saw: per step, the global mean loss and the gradient norm.
#[derive(Debug, Clone, PartialEq)]
struct Trace {
    losses: Vec<f64>,
    grad_norms: Vec<f64>,
    /// The bits of every tp-replicated parameter after training (layer norms, position embedding, row-parallel
    /// biases): tp peers must hold exactly the same values, or they would drift apart.
    replicated: Vec<u32>,
}

fn config(tp: usize, dp: usize, ga: usize) -> AcceleratorConfig {
    let mut cfg = AcceleratorConfig::default().with_seed(SEED).with_gradient_accumulation_steps(ga);
    cfg.parallelism = ParallelismConfig { tp_size: tp, dp_replicate_size: dp, ..ParallelismConfig::default() };
    cfg
}

/// Runs `f` on `world` ranks (threads over an in-memory store) with `cfg`, returning each rank's result.
pub(super) fn run<R: Send + 'static>(
    world: usize,
    cfg: AcceleratorConfig,
    f: impl Fn(Accelerator) -> anyhow::Result<R> + Send + Sync + 'static,
) -> Vec<R> {
    run_groups(world, move |pg| f(Accelerator::with_process_group(cfg.clone(), pg)?))
}

/// Runs `f` on `world` ranks (threads over an in-memory store, one process group each), returning each rank's
/// result; a rank's error or panic fails the test naming the rank.
pub(super) fn run_groups<R: Send + 'static>(
    world: usize,
    f: impl Fn(ProcessGroup) -> anyhow::Result<R> + Send + Sync + 'static,
) -> Vec<R> {
    run_groups_with_timeout(world, Duration::from_secs(120), f)
}

/// [`run_groups`] with the groups' collective timeout.
pub(super) fn run_groups_with_timeout<R: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(ProcessGroup) -> anyhow::Result<R> + Send + Sync + 'static,
) -> Vec<R> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(120)));
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, f) = (store.clone(), f.clone());
            std::thread::spawn(move || -> anyhow::Result<R> {
                let pg = if world == 1 {
                    ProcessGroup::single_process()?
                } else {
                    let opts = GroupOptions { timeout, ..Default::default() };
                    ProcessGroup::from_store(store, rank, world, opts)?
                };
                f(pg)
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

/// The model and its optimizer on `acc`, from `SEED`.
pub(super) fn build(
    acc: &Accelerator,
    vocab_size: usize,
) -> anyhow::Result<(CharGpt, accel::PreparedModel, accel::AcceleratedOptimizer<AdamW>)> {
    let varmap = VarMap::new();
    let cfg = model_config(vocab_size);
    let gpt = CharGpt::new(cfg, &acc.builder(&varmap, CharGpt::plan(&cfg)))?;
    let model = acc.prepare_model(&varmap)?;
    let opt = acc.prepare_optimizer(&model, AdamW::new(AdamWConfig { lr: 3e-3, ..AdamWConfig::default() })?)?;
    Ok((gpt, model, opt))
}

/// This data-parallel rank's micro-batches of step `step`.
pub(super) fn micro_batches(acc: &Accelerator, ids: &[u32], step: usize) -> Vec<(Tensor, Tensor)> {
    let (dp_rank, dp) = (acc.mesh().dp().rank(), acc.mesh().dp().world_size());
    let ga = acc.gradient_accumulation_steps();
    let batch = global_batch(ids, step);
    let share = GLOBAL_BATCH / dp;
    let mine = &batch[dp_rank * share..(dp_rank + 1) * share];
    mine.chunks(share / ga).map(|rows| to_tensors(rows, acc.device())).collect()
}

/// `STEPS` optimizer steps; every rank returns the trace (the loss averaged over micro-batches and dp ranks).
fn train(acc: &Accelerator, ids: &[u32], vocab_size: usize, steps: usize) -> anyhow::Result<Trace> {
    let (gpt, model, mut opt) = build(acc, vocab_size)?;
    let mut trace = Trace { losses: Vec::new(), grad_norms: Vec::new(), replicated: Vec::new() };
    for step in 0..steps {
        let micro = micro_batches(acc, ids, step);
        let n = micro.len();
        let mut loss_sum = 0.0;
        let mut norm = None;
        acc.accumulate_window(n, |i| -> accel::Result<()> {
            let (x, y) = &micro[i];
            let loss = gpt.loss(x, y)?;
            loss_sum += loss.to_scalar::<f32>()? as f64;
            acc.backward(&loss)?;
            if acc.sync_gradients() {
                norm = acc.clip_grad_norm(1e9)?;
                opt.step()?;
                opt.zero_grad();
            }
            Ok(())
        })?;
        let mean = acc.reduce(&Tensor::new(loss_sum / n as f64, &Device::Cpu)?, accel::ReduceKind::Mean)?;
        trace.losses.push(mean.to_scalar::<f64>()?);
        trace.grad_norms.push(norm.expect("the window's last micro-batch syncs"));
    }
    for (w, layout) in model.master_weights().iter().zip(model.layouts()) {
        if *layout == accel::ParamLayout::Replicated {
            trace.replicated.extend(w.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits));
        }
    }
    Ok(trace)
}

/// The largest absolute difference between two state dicts with the same names.
pub(super) fn max_abs_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f32 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "the gathered names differ");
    a.iter()
        .map(|(k, t)| {
            let d = (t - &b[k]).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap();
            d.to_scalar::<f32>().unwrap()
        })
        .fold(0.0, f32::max)
}

pub(super) fn assert_close(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let rel = (g - w).abs() / w.abs().max(1e-12);
        assert!(rel <= RTOL, "{what}: step {i}: {g} vs single-process {w} (relative difference {rel:.2e} > {RTOL:e})");
    }
}

fn reference(ids: &Arc<Vec<u32>>, vocab: usize) -> Trace {
    let ids = ids.clone();
    run(1, config(1, 1, 1), move |acc| train(&acc, &ids, vocab, STEPS)).remove(0)
}

/// tp2, tp4 and dp2×tp2, each with gradient accumulation 1 and 2, against one process with the whole batch.
#[test]
fn every_layout_matches_the_single_process_losses_and_gradient_norms() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let want = reference(&ids, vocab);
    // The model learns: the comparison is not between constants.
    assert!(want.losses[STEPS - 1] < want.losses[0] - 0.05, "single-process losses {:?}", want.losses);
    for (tp, dp, ga) in [(2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2), (4, 1, 2)] {
        let ids = ids.clone();
        let traces = run(tp * dp, config(tp, dp, ga), move |acc| train(&acc, &ids, vocab, STEPS));
        for (rank, t) in traces.iter().enumerate() {
            let what = format!("tp{tp} dp{dp} ga{ga} rank {rank}");
            assert_close(&format!("{what} loss"), &t.losses, &want.losses);
            assert_close(&format!("{what} grad norm"), &t.grad_norms, &want.grad_norms);
            // Same tp group ⇒ same replicated parameters, bit for bit.
            let peer = &traces[rank - rank % tp];
            assert!(t.replicated == peer.replicated, "{what}: replicated parameters differ from tp rank 0's");
            assert!(!t.replicated.is_empty());
        }
    }
}

/// One more step's loss from a model loaded from `dir`'s `model.safetensors`.
fn next_loss_after_loading(
    acc: &Accelerator,
    ids: &[u32],
    vocab: usize,
    file: &std::path::Path,
) -> anyhow::Result<f64> {
    let (gpt, model, _opt) = build(acc, vocab)?;
    model.load_state_dict(&accel::state::load_safetensors(file, acc.device())?)?;
    let micro = micro_batches(acc, ids, STEPS);
    let local =
        micro.iter().map(|(x, y)| Ok(gpt.loss(x, y)?.to_scalar::<f32>()? as f64)).sum::<anyhow::Result<f64>>()?;
    let mean = acc.reduce(&Tensor::new(local / micro.len() as f64, &Device::Cpu)?, accel::ReduceKind::Mean)?;
    Ok(mean.to_scalar::<f64>()?)
}

/// A tp2 run's `save_state` holds the full single-process tensors: one process and dp2 load them and compute
/// the same next-step loss as the tp2 run itself, and a fresh tp2 run's `load_state` resumes it bit for bit.
#[test]
fn a_tp2_checkpoint_loads_into_one_process_and_into_dp2() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let tmp = tempfile::tempdir().unwrap();
    let dir = Arc::new(tmp.path().join("ckpt"));
    // Three steps at tp2, save, and the loss of the next batch.
    let (i, d) = (ids.clone(), dir.clone());
    let saved = run(2, config(2, 1, 1), move |acc| {
        let (gpt, _model, mut opt) = build(&acc, vocab)?;
        for step in 0..3 {
            let (x, y) = &micro_batches(&acc, &i, step)[0];
            acc.backward(&gpt.loss(x, y)?)?;
            opt.step()?;
            opt.zero_grad();
        }
        acc.save_state(Some(&d))?;
        let (x, y) = &micro_batches(&acc, &i, STEPS)[0];
        Ok(gpt.loss(x, y)?.to_scalar::<f32>()? as f64)
    });
    let next = saved[0];
    // A fresh tp2 run resumes: the same loss, bit for bit.
    let (i, d) = (ids.clone(), dir.clone());
    let resumed = run(2, config(2, 1, 1), move |acc| {
        let (gpt, _model, _opt) = build(&acc, vocab)?;
        acc.load_state(Some(&d))?;
        let (x, y) = &micro_batches(&acc, &i, STEPS)[0];
        Ok(gpt.loss(x, y)?.to_scalar::<f32>()? as f64)
    });
    for (rank, r) in resumed.iter().enumerate() {
        assert_eq!(r.to_bits(), next.to_bits(), "tp2 rank {rank}: resumed loss {r} vs saved run's {next}");
    }
    let file = Arc::new(dir.join("model.safetensors"));
    let (i, f) = (ids.clone(), file.clone());
    let one = run(1, config(1, 1, 1), move |acc| next_loss_after_loading(&acc, &i, vocab, &f)).remove(0);
    let (i, f) = (ids.clone(), file.clone());
    let dp2 = run(2, config(1, 2, 1), move |acc| next_loss_after_loading(&acc, &i, vocab, &f));
    for (what, got) in [("one process", one), ("dp2 rank 0", dp2[0]), ("dp2 rank 1", dp2[1])] {
        let rel = (got - next).abs() / next.abs();
        assert!(rel <= RTOL, "{what}: next-step loss {got} vs tp2's {next} (relative {rel:.2e})");
    }
}

/// bf16 and fp16 compute (fp32 masters; fp16 with its loss scaler, whose overflow verdict the tp ranks share)
/// train at tp2 and dp2×tp2 as in one process, within the half-precision tolerance (relative 2e-2: the tp ranks
/// round partial sums to 16 bits before adding them).
#[test]
fn mixed_precision_trains_under_tensor_parallelism_like_one_process() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    for mp in [accel::MixedPrecision::Bf16, accel::MixedPrecision::Fp16] {
        let with_mp = |tp, dp| config(tp, dp, 1).with_mixed_precision(mp);
        let i = ids.clone();
        let want = run(1, with_mp(1, 1), move |acc| train(&acc, &i, vocab, 3)).remove(0);
        for (tp, dp) in [(2, 1), (2, 2)] {
            let i = ids.clone();
            let got = run(tp * dp, with_mp(tp, dp), move |acc| train(&acc, &i, vocab, 3));
            for (rank, t) in got.iter().enumerate() {
                for (step, (g, w)) in t.losses.iter().zip(&want.losses).enumerate() {
                    let rel = (g - w).abs() / w.abs();
                    assert!(rel <= 2e-2, "{mp:?} tp{tp} dp{dp} rank {rank} step {step}: loss {g} vs {w} ({rel:.2e})");
                }
                assert!(t.losses[2] < t.losses[0], "{mp:?} tp{tp} dp{dp}: the loss does not go down: {:?}", t.losses);
            }
        }
    }
}
