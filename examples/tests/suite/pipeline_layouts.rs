//! Pipeline parallelism through the Accelerator: the char-GPT trained with
//! `Accelerator::pipeline_stages` + `pipeline_backward` at pp2 (GPipe, 1F1B, interleaved), pp4, dp2×pp2 and
//! tp2×pp2, with and without gradient accumulation, gives the single-process losses and clipped-gradient norms
//! step by step for 5 AdamW steps, and the same weights after them; a pp2 checkpoint loads into one process and
//! resumes a pp2 run bit for bit, inside an accumulation window too; programs that do not split their model are
//! refused.
//!
//! Method: as `nd_equivalence` (f32, no dropout, the same seed on the full model: each stage builds only its own
//! parameters from the same per-name streams; the global batch fixed: each data-parallel rank takes its share and
//! splits it into `ga` accumulation steps, each of which the pipeline splits into `m` micro-batches). The
//! reference is one process calling the same `pipeline_backward` (at pp 1: forward, loss, backward on the whole
//! accumulation step). Tolerance: relative 1e-5 on losses and norms (the summation order differs: micro-batch
//! gradients are summed, tp sums partial matmuls, dp averages), absolute 1e-4 on the weights after 5 steps.

use super::nd_equivalence::{
    assert_close, corpus, global_batch, max_abs_diff, run, run_groups, run_groups_with_timeout, to_tensors,
    GLOBAL_BATCH, SEED, SEQ,
};
use accel::pipeline::ScheduleKind;
use accel::{Accelerator, AcceleratorConfig, AdamW, AdamWConfig, ParallelismConfig};
use accel_examples::gpt::{CharGpt, GptConfig};
use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

const STEPS: usize = 5;

fn model_config(vocab_size: usize) -> GptConfig {
    GptConfig {
        vocab_size,
        block_size: SEQ,
        n_layer: 4,
        n_head: 4,
        d_model: 32,
        d_ff: 64,
        tie_embeddings: false,
        dropout: 0.0,
    }
}

/// A layout: `(pp, tp, dp, ga, schedule, micro-batches)`.
type Layout = (usize, usize, usize, usize, ScheduleKind, usize);

fn config((pp, tp, dp, ga, kind, m): Layout) -> AcceleratorConfig {
    let mut cfg = AcceleratorConfig::default().with_seed(SEED).with_gradient_accumulation_steps(ga);
    cfg.parallelism = ParallelismConfig::default()
        .with_pp_size(pp)
        .with_tp_size(tp)
        .with_dp_replicate_size(dp)
        .with_pp_schedule(kind)
        .with_pp_microbatches(m);
    cfg
}

struct Trained {
    losses: Vec<f64>,
    grad_norms: Vec<f64>,
    weights: BTreeMap<String, Tensor>,
    /// The bits of this rank's own copy of `wte.weight`, if it holds one (tied embeddings: the first and the
    /// last stage both do).
    wte: Option<Vec<u32>>,
}

/// The stages of this rank, prepared, with AdamW.
fn build(
    acc: &Accelerator,
    cfg: GptConfig,
) -> anyhow::Result<(CharGpt, accel::PreparedModel, accel::AcceleratedOptimizer<AdamW>)> {
    let varmap = VarMap::new();
    let gpt = CharGpt::new(cfg, &acc.builder(&varmap, CharGpt::plan(&cfg)))?;
    let model = acc.prepare_model(&varmap)?;
    let opt = acc.prepare_optimizer(&model, AdamW::new(AdamWConfig { lr: 3e-3, ..AdamWConfig::default() })?)?;
    Ok((gpt, model, opt))
}

/// This data-parallel rank's accumulation steps of global step `step` (each split by the pipeline itself).
fn accumulation_steps(acc: &Accelerator, ids: &[u32], step: usize) -> Vec<(Tensor, Tensor)> {
    let (dp_rank, dp) = (acc.mesh().dp().rank(), acc.mesh().dp().world_size());
    let ga = acc.gradient_accumulation_steps();
    let batch = global_batch(ids, step);
    let share = GLOBAL_BATCH / dp;
    batch[dp_rank * share..(dp_rank + 1) * share].chunks(share / ga).map(|r| to_tensors(r, acc.device())).collect()
}

/// One optimizer step over `steps[from..]`; returns the mean loss of those and the gradient norm.
fn one_step(
    acc: &Accelerator,
    gpt: &CharGpt,
    opt: &mut accel::AcceleratedOptimizer<AdamW>,
    steps: &[(Tensor, Tensor)],
) -> anyhow::Result<(f64, Option<f64>)> {
    let (mut loss_sum, mut norm) = (0.0, None);
    for (x, y) in steps {
        let loss = acc.accumulate(|| acc.pipeline_backward(gpt, x, y, |logits, t| gpt.loss_of(logits, t)))?;
        loss_sum += loss.to_scalar::<f32>()? as f64;
        if acc.sync_gradients() {
            norm = acc.clip_grad_norm(1.0)?;
            opt.step()?;
            opt.zero_grad();
        }
    }
    Ok((loss_sum / steps.len() as f64, norm))
}

fn train(acc: &Accelerator, ids: &[u32], cfg: GptConfig) -> anyhow::Result<Trained> {
    let (gpt, model, mut opt) = build(acc, cfg)?;
    let mut t = Trained { losses: Vec::new(), grad_norms: Vec::new(), weights: BTreeMap::new(), wte: None };
    for step in 0..STEPS {
        let (local, norm) = one_step(acc, &gpt, &mut opt, &accumulation_steps(acc, ids, step))?;
        let mean = acc.reduce(&Tensor::new(local, &Device::Cpu)?, accel::ReduceKind::Mean)?;
        t.losses.push(mean.to_scalar::<f64>()?);
        t.grad_norms.push(norm.expect("the window's last step syncs"));
    }
    t.weights = model.state_dict()?; // every stage's, gathered
    if let Some(i) = model.names().iter().position(|n| n == "wte.weight") {
        let w = model.master_weights()[i].flatten_all()?.to_vec1::<f32>()?;
        t.wte = Some(w.into_iter().map(f32::to_bits).collect());
    }
    Ok(t)
}

/// Every rank of a layout's run against one process: the losses and gradient norms step by step (relative 1e-5)
/// and the weights after them (1e-4 absolute).
fn assert_trains_like(what: &str, got: &[Trained], want: &Trained) {
    for (rank, t) in got.iter().enumerate() {
        let what = format!("{what} rank {rank}");
        assert_close(&format!("{what} loss"), &t.losses, &want.losses);
        assert_close(&format!("{what} grad norm"), &t.grad_norms, &want.grad_norms);
        let d = max_abs_diff(&t.weights, &want.weights);
        assert!(d <= 1e-4, "{what}: weights after {STEPS} steps differ from one process's by {d:e}");
    }
}

#[test]
fn every_pipeline_layout_trains_like_one_process() {
    use ScheduleKind::{GPipe, Interleaved1F1B, OneFOneB};
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let mut wants: BTreeMap<usize, Trained> = BTreeMap::new();
    let layouts: [Layout; 7] = [
        (2, 1, 1, 1, OneFOneB, 2),
        (2, 1, 1, 2, GPipe, 4),
        (2, 1, 1, 1, Interleaved1F1B, 4),
        (4, 1, 1, 1, OneFOneB, 4),
        (4, 1, 1, 2, GPipe, 4),
        (2, 1, 2, 1, OneFOneB, 2),
        (2, 2, 1, 2, OneFOneB, 2),
    ];
    for layout in layouts {
        let (pp, tp, dp, ga, kind, m) = layout;
        // The reference: one process, the same accumulation.
        let want = wants.entry(ga).or_insert_with(|| {
            let i = ids.clone();
            run(1, config((1, 1, 1, ga, OneFOneB, 1)), move |acc| train(&acc, &i, model_config(vocab))).remove(0)
        });
        assert!(want.losses[STEPS - 1] < want.losses[0] - 0.05, "single-process losses {:?}", want.losses);
        let i = ids.clone();
        let got = run(pp * tp * dp, config(layout), move |acc| train(&acc, &i, model_config(vocab)));
        assert_trains_like(&format!("pp{pp} tp{tp} dp{dp} ga{ga} {kind} m{m}"), &got, &*want);
    }
}

/// GPT-2's tied embedding across stages (`tie_embeddings`: the first stage's `wte.weight` is the last stage's
/// head): pp2, interleaved pp2 (first stage on pp rank 0, last on pp rank 1), dp2 × pp2 and tp2 × pp2 train like
/// one process holding a single tied weight, and the two copies stay bit-identical.
#[test]
fn tied_embeddings_across_stages_train_like_one_process_and_stay_equal() {
    use ScheduleKind::{Interleaved1F1B, OneFOneB};
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let tied = GptConfig { tie_embeddings: true, ..model_config(vocab) };
    let i = ids.clone();
    let want = run(1, config((1, 1, 1, 1, OneFOneB, 1)), move |acc| train(&acc, &i, tied)).remove(0);
    assert!(!want.weights.contains_key("lm_head.weight") && want.weights.contains_key("wte.weight"));
    assert!(want.losses[STEPS - 1] < want.losses[0] - 0.05, "single-process losses {:?}", want.losses);
    for layout in [
        (2, 1, 1, 1, OneFOneB, 2),
        (2, 1, 1, 1, Interleaved1F1B, 4),
        (2, 1, 2, 1, OneFOneB, 2),
        (2, 2, 1, 1, OneFOneB, 2),
    ] {
        let (pp, tp, dp, ..) = layout;
        let i = ids.clone();
        let got = run(pp * tp * dp, config(layout), move |acc| train(&acc, &i, tied));
        assert_trains_like(&format!("tied {layout:?}"), &got, &want);
        // Both stages hold a copy (rank r and its pp peer r + world / pp: pp is outermost): the same bits.
        let peer = tp * dp;
        for r in 0..peer {
            let (a, b) = (got[r].wte.as_ref(), got[r + peer].wte.as_ref());
            assert!(a.is_some() && a == b, "tied {layout:?}: rank {r}'s and rank {}'s wte.weight differ", r + peer);
        }
    }
}

/// Dropout (p 0.2, nanoGPT's Shakespeare setting) draws the single-process masks at every layout — the same
/// coordinates hashed: tp peers alike in replicated regions and each its own part of the MLP's sharded hidden
/// activation, each dp replica its rows, each pipeline micro-batch its rows — so tp2, dp2, pp2 (also with
/// accumulation), tp2 × pp2 and dp2 × pp2 give one process's losses, norms and weights with dropout on (the
/// tolerance of the runs without it: the arithmetic, not the masks, differs). Not bit for bit: the micro-batches'
/// gradients are summed where one process computes the batch at once, and tp / dp add partial sums in another
/// order. Not with dp × accumulation: replicas take contiguous shares of the global batch and split *them* into
/// accumulation steps, so a sample sits at another micro-step than in one process (the gradient sum does not
/// mind; a mask addressed by micro-step does). The masks matter: the losses differ from the run without dropout.
#[test]
fn dropout_draws_the_single_process_masks_at_every_layout() {
    use ScheduleKind::{GPipe, OneFOneB};
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let with_dropout = GptConfig { dropout: 0.2, ..model_config(vocab) };
    for ga in [1, 2] {
        let i = ids.clone();
        let want = run(1, config((1, 1, 1, ga, OneFOneB, 1)), move |acc| train(&acc, &i, with_dropout)).remove(0);
        let i = ids.clone();
        let off = run(1, config((1, 1, 1, ga, OneFOneB, 1)), move |acc| train(&acc, &i, model_config(vocab))).remove(0);
        assert!(
            want.losses.iter().zip(&off.losses).skip(1).all(|(a, b)| (a - b).abs() > 1e-3),
            "dropout changes the losses: {:?} vs {:?}",
            want.losses,
            off.losses
        );
        let layouts: &[Layout] = if ga == 1 {
            &[
                (1, 2, 1, 1, OneFOneB, 1),
                (1, 1, 2, 1, OneFOneB, 1),
                (2, 1, 1, 1, OneFOneB, 2),
                (2, 2, 1, 1, OneFOneB, 2),
                (2, 1, 2, 1, OneFOneB, 2),
            ]
        } else {
            &[(2, 1, 1, 2, GPipe, 2), (1, 2, 1, 2, OneFOneB, 1)]
        };
        for &layout in layouts {
            let (pp, tp, dp, ..) = layout;
            let i = ids.clone();
            let got = run(pp * tp * dp, config(layout), move |acc| train(&acc, &i, with_dropout));
            assert_trains_like(&format!("dropout {layout:?}"), &got, &want);
        }
    }
}

/// bf16 (autocast on the CPU) and fp16 (fp16 parameters and activations between the stages, fp32 masters, the
/// loss scaler whose overflow verdict the stages share) train at pp2 and tp2 × pp2 as in one process, within the
/// half-precision tolerance of the tp tests (relative 2e-2), and the loss goes down.
#[test]
fn mixed_precision_trains_through_the_pipeline_like_one_process() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    for mp in [accel::MixedPrecision::Bf16, accel::MixedPrecision::Fp16] {
        let with_mp = move |layout: Layout| config(layout).with_mixed_precision(mp);
        let i = ids.clone();
        let want =
            run(1, with_mp((1, 1, 1, 1, ScheduleKind::OneFOneB, 1)), move |acc| train(&acc, &i, model_config(vocab)))
                .remove(0);
        for layout in [(2, 1, 1, 1, ScheduleKind::OneFOneB, 2), (2, 2, 1, 2, ScheduleKind::GPipe, 2)] {
            let (pp, tp, dp, ..) = layout;
            let i = ids.clone();
            let got = run(pp * tp * dp, with_mp(layout), move |acc| train(&acc, &i, model_config(vocab)));
            for (rank, t) in got.iter().enumerate() {
                for (step, (g, w)) in t.losses.iter().zip(&want.losses).enumerate() {
                    let rel = (g - w).abs() / w.abs();
                    assert!(rel <= 2e-2, "{mp:?} {layout:?} rank {rank} step {step}: loss {g} vs {w} ({rel:.2e})");
                }
                assert!(
                    t.losses[STEPS - 1] < t.losses[0],
                    "{mp:?} {layout:?}: the loss does not go down: {:?}",
                    t.losses
                );
            }
        }
    }
}

/// A pp2 run saved inside an accumulation window (after the first of two accumulation steps) resumes bit for bit
/// in a fresh pp2 run, and its `model.safetensors` (every stage's tensors, single-process names) loads into one
/// process, which computes the same loss.
#[test]
fn a_pp2_checkpoint_resumes_exactly_and_loads_into_one_process() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let tmp = tempfile::tempdir().unwrap();
    let dir = Arc::new(tmp.path().join("ckpt"));
    let layout = (2, 1, 1, 2, ScheduleKind::OneFOneB, 2);
    // With dropout too: a resumed run draws the masks the original would have (they are addressed by the
    // micro-step, which the checkpoint restores).
    for p in [0.0, 0.2] {
        let cfg = GptConfig { dropout: p, ..model_config(vocab) };
        let sub = Arc::new(dir.join(format!("p{p}")));
        // Two optimizer steps, the first accumulation step of the third, save, then the rest of the third step.
        let (i, d) = (ids.clone(), sub.clone());
        let saved = run(2, config(layout), move |acc| {
            let (gpt, _model, mut opt) = build(&acc, cfg)?;
            for step in 0..2 {
                one_step(&acc, &gpt, &mut opt, &accumulation_steps(&acc, &i, step))?;
            }
            let third = accumulation_steps(&acc, &i, 2);
            one_step(&acc, &gpt, &mut opt, &third[..1])?;
            acc.save_state(Some(&d))?;
            let (loss, norm) = one_step(&acc, &gpt, &mut opt, &third[1..])?;
            Ok((loss, norm.expect("syncs")))
        });
        let (i, d) = (ids.clone(), sub.clone());
        let resumed = run(2, config(layout), move |acc| {
            let (gpt, _model, mut opt) = build(&acc, cfg)?;
            acc.load_state(Some(&d))?;
            let third = accumulation_steps(&acc, &i, 2);
            let (loss, norm) = one_step(&acc, &gpt, &mut opt, &third[1..])?;
            Ok((loss, norm.expect("syncs")))
        });
        for rank in 0..2 {
            assert_eq!(resumed[rank].0.to_bits(), saved[rank].0.to_bits(), "dropout {p}, rank {rank}: resumed loss");
            assert_eq!(resumed[rank].1.to_bits(), saved[rank].1.to_bits(), "dropout {p}, rank {rank}: resumed norm");
        }
    }
    let dir = Arc::new(dir.join("p0"));
    // The single-process model from the pp2 file: the loss of the saved run's next batch.
    let file = dir.join("model.safetensors");
    let (i, d) = (ids.clone(), dir.clone());
    let pp_loss = run(2, config(layout), move |acc| {
        let (gpt, _model, _opt) = build(&acc, model_config(vocab))?;
        acc.load_state(Some(&d))?;
        let (x, y) = &accumulation_steps(&acc, &i, 2)[0];
        Ok(acc.no_sync(|| acc.pipeline_backward(&gpt, x, y, |l, t| gpt.loss_of(l, t)))?.to_scalar::<f32>()?)
    });
    let i = ids.clone();
    let one = run(1, config((1, 1, 1, 2, ScheduleKind::OneFOneB, 1)), move |acc| {
        let (gpt, model, _opt) = build(&acc, model_config(vocab))?;
        model.load_state_dict(&accel::state::load_safetensors(&file, acc.device())?)?;
        let (x, y) = &accumulation_steps(&acc, &i, 2)[0];
        Ok(gpt.loss(x, y)?.to_scalar::<f32>()?)
    })
    .remove(0);
    let rel = ((one - pp_loss[0]) / pp_loss[0]).abs();
    assert!(rel <= 1e-5, "one process from the pp2 checkpoint: loss {one} vs pp2's {} ({rel:.2e})", pp_loss[0]);
}

/// The optimizer state is saved as one process holds it (each stage's AdamW moments renumbered to the whole
/// model's parameters): a pp2 checkpoint taken at an optimizer step resumes at tp2 and at dp2 (the same 2
/// processes, another layout), whose next step gives the pp2 run's loss and gradient norm, and whose weights
/// after it are pp2's (relative 1e-5; 1e-5 absolute: the moments steer that step).
#[test]
fn a_pp2_checkpoint_resumes_at_another_layout() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let tmp = tempfile::tempdir().unwrap();
    let dir = Arc::new(tmp.path().join("ckpt"));
    let pp2 = (2, 1, 1, 1, ScheduleKind::OneFOneB, 2);
    let next_step = move |acc: &Accelerator,
                          ids: &[u32],
                          load: Option<&std::path::Path>|
          -> anyhow::Result<(f64, f64, BTreeMap<String, Tensor>)> {
        let (gpt, model, mut opt) = build(acc, model_config(vocab))?;
        match load {
            Some(d) => {
                acc.load_state(Some(d))?;
            }
            None => {
                for step in 0..3 {
                    one_step(acc, &gpt, &mut opt, &accumulation_steps(acc, ids, step))?;
                }
            }
        }
        let (loss, norm) = one_step(acc, &gpt, &mut opt, &accumulation_steps(acc, ids, 3))?;
        let mean = acc.reduce(&Tensor::new(loss, &Device::Cpu)?, accel::ReduceKind::Mean)?.to_scalar::<f64>()?;
        Ok((mean, norm.expect("syncs"), model.state_dict()?))
    };
    // The pp2 run: 3 steps, save, the 4th.
    let (i, d) = (ids.clone(), dir.clone());
    run(2, config(pp2), move |acc| {
        let (gpt, _model, mut opt) = build(&acc, model_config(vocab))?;
        for step in 0..3 {
            one_step(&acc, &gpt, &mut opt, &accumulation_steps(&acc, &i, step))?;
        }
        Ok(acc.save_state(Some(&d))?)
    });
    let i = ids.clone();
    let reference = run(2, config(pp2), move |acc| next_step(&acc, &i, None)).remove(0);
    for layout in [(1, 2, 1, 1, ScheduleKind::OneFOneB, 1), (1, 1, 2, 1, ScheduleKind::OneFOneB, 1), pp2] {
        let (i, d) = (ids.clone(), dir.clone());
        let got = run(2, config(layout), move |acc| next_step(&acc, &i, Some(&d)));
        for (rank, (loss, norm, weights)) in got.iter().enumerate() {
            let what = format!("pp2 checkpoint resumed at {layout:?}, rank {rank}");
            assert_close(&format!("{what}: loss"), &[*loss], &[reference.0]);
            assert_close(&format!("{what}: grad norm"), &[*norm], &[reference.1]);
            let d = max_abs_diff(weights, &reference.2);
            assert!(d <= 1e-5, "{what}: weights after the resumed step differ from pp2's by {d:e}");
        }
    }
}

/// A stage that dies or stalls in its second step fails every other rank of a dp2 × pp2 job with an error, never
/// a hang: the waiting stage names the stage, the micro-batch, the op and the peer's pp rank; the data-parallel
/// peers name the collective that broke. A dead peer is noticed at once, a stalled one within the collective
/// timeout (3 s here).
#[test]
fn a_dead_or_stalled_stage_fails_every_rank_naming_stage_micro_batch_and_op() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    for stall in [false, true] {
        let i = ids.clone();
        let started = std::time::Instant::now();
        let timeout = std::time::Duration::from_secs(3);
        let outcomes = run_groups_with_timeout(4, timeout, move |pg| {
            let acc = Accelerator::with_process_group(config((2, 1, 2, 1, ScheduleKind::OneFOneB, 2)), pg)?;
            let (gpt, _model, mut opt) = build(&acc, model_config(vocab))?;
            one_step(&acc, &gpt, &mut opt, &accumulation_steps(&acc, &i, 0))?;
            if acc.rank() == 3 {
                // pp rank 1 of dp replica 1: gone (its connections close), or stuck past the timeout.
                if stall {
                    std::thread::sleep(timeout + std::time::Duration::from_secs(2));
                }
                return Ok(None);
            }
            let e = one_step(&acc, &gpt, &mut opt, &accumulation_steps(&acc, &i, 1)).err();
            Ok(Some(e.map(|e| ddp_core::launcher::error_report(e.as_ref())).unwrap_or_default()))
        });
        let what = if stall { "stalled" } else { "dead" };
        for (rank, e) in outcomes.iter().enumerate().take(3) {
            let e = e.as_ref().expect("a survivor");
            assert!(!e.is_empty(), "{what}: rank {rank} finished a step its peer never took part in");
        }
        // Rank 1 (pp rank 0 of replica 1) waits for the gradient of its micro-batch 0 from pp rank 1.
        let e1 = outcomes[1].as_ref().unwrap();
        assert!(
            e1.contains(
                "pipeline stage 0, micro-batch 0 (0RECV_B0) on pp rank 0 (rank 1): receiving the output gradient from \
                 pp rank 1 (rank 3)"
            ),
            "{what}: {e1}"
        );
        // Rank 2 (pp rank 1 of replica 0) waits in the dp all-reduce for rank 3.
        let e2 = outcomes[2].as_ref().unwrap();
        // Its dp group holds ranks 2 and 3, which the backend calls 0 and 1: the error says so.
        assert!(
            e2.contains("all_reduce") && e2.contains("(this group's ranks 0, 1 are the job's ranks 2, 3)"),
            "{what}: {e2}"
        );
        let limit = if stall { timeout * 3 } else { timeout };
        assert!(started.elapsed() < limit + std::time::Duration::from_secs(10), "{what}: took {:?}", started.elapsed());
    }
}

/// Programs without pipeline support are refused, with what to do; a batch that does not split into the
/// micro-batches is named.
#[test]
fn programs_that_do_not_split_their_model_are_refused() {
    let (_, vocab) = corpus();
    let layout = (2, 1, 1, 1, ScheduleKind::OneFOneB, 2);
    let errors = run(2, config(layout), move |acc| {
        // A model on every rank whole, never asking for stages.
        let varmap = VarMap::new();
        acc.param_builder(&varmap).replicated("weight", (4, 4), accel::ParamInit::Zeros)?;
        let not_split = acc.prepare_model(&varmap).unwrap_err().to_string();
        // Asked, built, prepared: backward on a loss is refused, an odd batch named.
        let (gpt, _model, _opt) = build(&acc, model_config(vocab))?;
        let x = Tensor::zeros((3, SEQ), candle_core::DType::U32, &Device::Cpu)?;
        let backward = acc.backward(&x.sum_all()?.to_dtype(candle_core::DType::F32)?).unwrap_err().to_string();
        let odd = acc.pipeline_backward(&gpt, &x, &x, |l, t| gpt.loss_of(l, t)).unwrap_err().to_string();
        Ok((not_split, backward, odd))
    });
    let (not_split, backward, odd) = &errors[0];
    assert!(
        not_split.contains("pp_size 2 (pipeline parallelism) but the program did not ask which stages this rank holds")
            && not_split.contains("accelerator.pipeline_stages"),
        "{not_split}"
    );
    assert!(
        backward.contains("backward: this job has pp_size 2") && backward.contains("pipeline_backward"),
        "{backward}"
    );
    assert!(
        odd.contains("the inputs have 3 rows (dim 0), which do not split into the 2 micro-batches")
            && odd.contains("a multiple of 2 (e.g. 4)"),
        "{odd}"
    );
}

/// `n` windows of the corpus (from `start`) as a data set.
fn windows(ids: &[u32], start: usize, n: usize) -> accel::TensorDataset {
    let rows: Vec<_> = (0..n)
        .map(|i| {
            let s = start + i * 37;
            (ids[s..s + SEQ].to_vec(), ids[s + 1..s + SEQ + 1].to_vec())
        })
        .collect();
    let (x, y) = to_tensors(&rows, &Device::Cpu);
    accel::TensorDataset::new(x, y).unwrap()
}

/// What a Trainer run logged: the training losses, the gradient norms and the final eval loss.
type Logged = (Vec<f64>, Vec<f64>, f64);

/// The Trainer (`Trainer::with_plan`) on `world` ranks laid out as `layout` (None: no parallelism config), 6 steps of
/// a global batch of 16 sequences (`16 / dp` per replica), logging every 2, evaluating every 3.
fn trainer_run(world: usize, layout: Option<Layout>, ids: Arc<Vec<u32>>, vocab: usize) -> Vec<Logged> {
    run_groups(world, move |pg| {
        let dir = tempfile::tempdir()?;
        let (pp, tp, dp, ga, kind, m) = layout.unwrap_or((1, 1, 1, 1, ScheduleKind::OneFOneB, 1));
        let args = trainer::TrainingArguments {
            output_dir: dir.path().to_path_buf(),
            max_steps: 6,
            per_device_train_batch_size: 16 / dp / ga,
            gradient_accumulation_steps: ga,
            per_device_eval_batch_size: 12,
            learning_rate: 3e-3,
            max_grad_norm: 1.0,
            eval_strategy: trainer::IntervalStrategy::Steps,
            eval_steps: Some(3.0),
            save_strategy: trainer::SaveStrategy::No,
            logging_steps: 2.0,
            report_to: trainer::ReportTo(vec!["none".into()]),
            save_plots: false,
            disable_tqdm: true,
            seed: SEED,
            ..Default::default()
        };
        let cfg = model_config(vocab);
        let (train, eval) = (windows(&ids, 0, 64), windows(&ids, 5000, 20));
        let loss = trainer::losses::VocabParallelCrossEntropy { vocab_size: vocab };
        let to_candle = accel_examples::gpt::to_candle;
        let parallelism = ParallelismConfig::default()
            .with_pp_size(pp)
            .with_tp_size(tp)
            .with_dp_replicate_size(dp)
            .with_pp_schedule(kind)
            .with_pp_microbatches(m.max(pp));
        let mut t = trainer::Trainer::with_plan(
            args,
            CharGpt::plan(&cfg),
            move |vb| CharGpt::new(cfg, &vb).map_err(to_candle),
            train,
            Some(eval),
            loss,
        )
        .process_group(pg);
        if layout.is_some() {
            t = t.parallelism_config(parallelism);
        }
        t.train()?;
        let state = t.state().clone();
        let get = |k: &str| -> Vec<f64> { state.log_history.iter().filter_map(|e| e.get(k)).collect() };
        let evals = get("eval_loss");
        Ok((get("loss"), get("grad_norm"), *evals.last().expect("evaluated")))
    })
}

/// The Trainer drives the pipeline over the stages the model declared (`Trainer::with_plan`): at pp 1 it logs exactly
/// what the trainer without a parallelism config logs, and pp2 (1F1B, interleaved), dp2 × pp2 and tp2 × pp2 with accumulation log the
/// single process's training losses, gradient norms and eval loss (relative 1e-5).
#[test]
fn the_trainer_trains_every_pipeline_layout_like_one_process() {
    use ScheduleKind::{Interleaved1F1B, OneFOneB};
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let classic = trainer_run(1, None, ids.clone(), vocab).remove(0);
    let one = trainer_run(1, Some((1, 1, 1, 1, OneFOneB, 1)), ids.clone(), vocab).remove(0);
    assert_eq!((classic.0.len(), classic.1.len()), (3, 3), "{classic:?}");
    assert!(classic.0[2] < classic.0[0], "the model learns: {:?}", classic.0);
    assert_eq!(one, classic, "pp 1 vs no parallelism config");
    for layout in [
        (2, 1, 1, 1, OneFOneB, 2),
        (2, 1, 1, 2, Interleaved1F1B, 4),
        (2, 1, 2, 1, OneFOneB, 4),
        (2, 2, 1, 2, OneFOneB, 2),
    ] {
        let (pp, tp, dp, ..) = layout;
        for (rank, got) in trainer_run(pp * tp * dp, Some(layout), ids.clone(), vocab).iter().enumerate() {
            let what = format!("{layout:?} rank {rank}");
            assert_close(&format!("{what} loss"), &got.0, &one.0);
            assert_close(&format!("{what} grad norm"), &got.1, &one.1);
            assert_close(&format!("{what} eval loss"), &[got.2], &[one.2]);
        }
    }
}

/// The Trainer at `layout` (pp, tp, dp) in `out`: 6 steps of a global batch of 16, a checkpoint every 3 steps;
/// `resume` resumes from the newest checkpoint there. Returns the run's `training_loss` and its logged losses.
fn trainer_checkpointed(
    layout: (usize, usize, usize),
    out: PathBuf,
    resume: bool,
    ids: Arc<Vec<u32>>,
    vocab: usize,
) -> Vec<(f64, Vec<f64>)> {
    let (pp, tp, dp) = layout;
    run_groups(pp * tp * dp, move |pg| {
        let args = trainer::TrainingArguments {
            output_dir: out.clone(),
            max_steps: 6,
            per_device_train_batch_size: 16 / dp,
            learning_rate: 3e-3,
            eval_strategy: trainer::IntervalStrategy::No,
            save_strategy: trainer::SaveStrategy::Steps,
            save_steps: 3.0,
            logging_steps: 2.0,
            report_to: trainer::ReportTo(vec!["none".into()]),
            save_plots: false,
            disable_tqdm: true,
            seed: SEED,
            resume_from_checkpoint: resume.then(|| "latest".to_string()),
            ..Default::default()
        };
        let cfg = model_config(vocab);
        let to_candle = accel_examples::gpt::to_candle;
        let mut t = trainer::Trainer::with_plan(
            args,
            CharGpt::plan(&cfg),
            move |vb| CharGpt::new(cfg, &vb).map_err(to_candle),
            windows(&ids, 0, 64),
            None,
            trainer::losses::VocabParallelCrossEntropy { vocab_size: vocab },
        )
        .process_group(pg)
        .parallelism_config(ParallelismConfig::default().with_pp_size(pp).with_tp_size(tp).with_dp_replicate_size(dp));
        let out = t.train()?;
        let losses = t.state().log_history.iter().filter_map(|e| e.get("loss")).collect();
        Ok((out.training_loss, losses))
    })
}

/// A Trainer checkpoint resumes at another layout of the same processes (pp2 → dp2, dp2 → pp2, pp2 → tp2) with
/// the uninterrupted run's logged losses and its `train_loss` over the whole run: the loss tally saved per rank
/// is shared out for the new layout (pp and tp ranks hold copies of one replica's sums).
#[test]
fn a_trainer_checkpoint_resumes_at_another_layout_with_the_whole_runs_train_loss() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let tmp = tempfile::tempdir().unwrap();
    let whole = trainer_checkpointed((1, 1, 1), tmp.path().join("whole"), false, ids.clone(), vocab).remove(0);
    for (from, to) in [((2, 1, 1), (1, 1, 2)), ((1, 1, 2), (2, 1, 1)), ((2, 1, 1), (1, 2, 1))] {
        let out = tmp.path().join(format!("{from:?}-{to:?}"));
        trainer_checkpointed(from, out.clone(), false, ids.clone(), vocab);
        // Only the first checkpoint: the resumed run trains steps 4-6 again.
        std::fs::remove_dir_all(out.join("checkpoint-6")).unwrap();
        for (rank, (train_loss, losses)) in
            trainer_checkpointed(to, out, true, ids.clone(), vocab).into_iter().enumerate()
        {
            let what = format!("{from:?} → {to:?} rank {rank}");
            assert_close(&format!("{what}: train_loss"), &[train_loss], &[whole.0]);
            assert_close(
                &format!("{what}: logged losses after the resume"),
                &losses,
                &whole.1[whole.1.len() - losses.len()..],
            );
        }
    }
}

/// A trainer whose model is not cut into stages is refused under pp, and so is compute_metrics (the outputs
/// live on the last stage).
/// One quick Trainer step's arguments in `dir` (evaluating after it).
fn one_step_args(dir: &std::path::Path) -> trainer::TrainingArguments {
    trainer::TrainingArguments {
        output_dir: dir.to_path_buf(),
        max_steps: 1,
        per_device_train_batch_size: 4,
        report_to: trainer::ReportTo(vec!["none".into()]),
        save_plots: false,
        disable_tqdm: true,
        eval_strategy: trainer::IntervalStrategy::Steps,
        eval_steps: Some(1.0),
        ..Default::default()
    }
}

#[test]
fn the_trainer_refuses_what_a_pipeline_cannot_do() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let to_candle = accel_examples::gpt::to_candle;
    let pp2 = ParallelismConfig::default().with_pp_size(2);
    let (i, p) = (ids.clone(), pp2.clone());
    let errors = run_groups(2, move |pg| {
        let dir = tempfile::tempdir()?;
        // A model on the builder not declared as stages (no accel::nn::staged).
        let bigram = move |vb: accel::nn::VarBuilder| -> candle_core::Result<candle_nn::Sequential> {
            let wte = accel::nn::embedding(vocab, 8, vb.pp("wte"))?;
            Ok(candle_nn::seq().add(wte).add(accel::nn::linear(8, vocab, vb.pp("head"))?))
        };
        let mut whole = trainer::Trainer::with_plan(
            one_step_args(dir.path()),
            accel::plan::ParallelPlan::default(),
            bigram,
            windows(&i, 0, 8),
            None,
            trainer::losses::VocabParallelCrossEntropy { vocab_size: vocab },
        )
        .process_group(pg)
        .parallelism_config(p.clone());
        Ok(whole.train().unwrap_err().to_string())
    });
    for e in errors {
        assert!(e.contains("pp_size 2 (pipeline parallelism) but this trainer's model is not cut into stages"), "{e}");
        assert!(e.contains("accel::nn::staged"), "{e}");
    }
    let errors = run_groups(2, move |pg| {
        let dir = tempfile::tempdir()?;
        let cfg = model_config(vocab);
        let mut t = trainer::Trainer::with_plan(
            one_step_args(dir.path()),
            CharGpt::plan(&cfg),
            move |vb| CharGpt::new(cfg, &vb).map_err(to_candle),
            windows(&ids, 0, 8),
            Some(windows(&ids, 100, 4)),
            trainer::losses::VocabParallelCrossEntropy { vocab_size: vocab },
        )
        .process_group(pg)
        .parallelism_config(pp2.clone())
        .compute_metrics(trainer::metrics::classification);
        Ok(t.train().unwrap_err().to_string())
    });
    for e in errors {
        assert!(e.contains("cut into 2 pipeline stages: evaluation reports the loss only"), "{e}");
    }
}

/// The examples as a user runs them: `accel_gpt --pp-size 2` (1F1B) and `--pp-size 2 --tp-size 2` on 4 processes
/// print the single process's losses (4 decimals) and a sample from the gathered model; `train_gpt --pp-size 2`
/// trains and evaluates; sizes that cannot run are refused before any worker starts, naming what fits.
#[test]
fn the_gpt_examples_run_pipelined_from_the_command_line() {
    use super::gpt_tp::{logged_losses, run_example, small_accel_gpt_args};
    let small = small_accel_gpt_args("2");
    let bin = env!("CARGO_BIN_EXE_accel_gpt");
    let single = run_example(bin, &[&["--nproc", "1"], &small[..]].concat());
    let pp2 = run_example(bin, &[&["--nproc", "2", "--pp-size", "2"], &small[..]].concat());
    let tp2pp2 = run_example(
        bin,
        &[&["--nproc", "4", "--pp-size", "2", "--tp-size", "2", "--microbatches", "4"], &small[..]].concat(),
    );
    let want = logged_losses(&single);
    assert_eq!(want.len(), 2, "{single}");
    assert_eq!(logged_losses(&pp2), want, "pp2:\n{pp2}");
    assert_eq!(logged_losses(&tp2pp2), want, "tp2 × pp2:\n{tp2pp2}");
    assert!(pp2.contains("× pp 2 (1F1B, 2 micro-batches) |"), "the banner names the schedule:\n{pp2}");
    assert!(pp2.contains("1F1B over 2 micro-batches, stages 0 (block 0), 1 (block 1), rank 0 holds stage 0"), "{pp2}");
    assert!(pp2.contains("[rank 0] sample (temperature 0.8):\n[rank 0] HAMLET:"), "{pp2}");
    assert!(tp2pp2.contains("rank 3 (pp 1 dp 0 tp 1): peak RSS"), "{tp2pp2}");

    let out_dir = tempfile::tempdir().unwrap();
    let text = run_example(
        env!("CARGO_BIN_EXE_train_gpt"),
        &[
            "--nproc",
            "2",
            "--pp-size",
            "2",
            "--max-steps",
            "4",
            "--logging-steps",
            "2",
            "--eval-steps",
            "4",
            "--per-device-train-batch-size",
            "4",
            "--block-size",
            "16",
            "--sample-len",
            "10",
            "--save-plots",
            "false",
            "--disable-tqdm",
            "true",
            "--output-dir",
            out_dir.path().to_str().unwrap(),
        ],
    );
    assert!(
        text.contains("process(es) = pp 2 × dp 1 × tp 1; 4 optimizer steps") && text.contains("validation loss"),
        "{text}"
    );
    assert!(text.contains("sample (temperature 0.8)"), "{text}");

    for (args, expect) in [
        (&["--nproc", "4", "--pp-size", "3"][..], "--pp-size 3 × --tp-size 1 must divide --nproc 4"),
        (
            &["--nproc", "2", "--pp-size", "2", "--batch-size", "6", "--microbatches", "4"][..],
            "--batch-size 6 does not split into the 4 micro-batches",
        ),
        (&["--nproc", "2", "--pp-size", "2", "--microbatches", "1"][..], "pipeline_parallel_microbatches"),
        (
            &["--nproc", "4", "--pp-size", "4", "--n-layer", "2"][..],
            "the model has 2 layers but the pipeline cuts it into 4 stages (--pp-size 4 × 1 per rank)",
        ),
    ] {
        let out = std::process::Command::new(bin).args(args).env_remove("RANK").output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success() && text.contains(expect), "{args:?}:\n{text}");
        assert!(!text.contains("[rank"), "refused before any worker starts: {args:?}\n{text}");
    }
}
