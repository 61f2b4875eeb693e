//! A rank lost under sharded data parallelism (the issue's test list: "a rank killed mid-step leaves the previous
//! checkpoint loadable at any layout"): a FULL_SHARD run on 4 processes (dp_shard 4) checkpoints at step 3; a
//! rank that dies in the middle of step 4, or in the middle of the next `save_state`, fails every surviving rank
//! with an error naming the collective and the dead rank — at once, not after the collective timeout — and
//! leaves the step-3 checkpoint as it was and the newest one: no half-written directory is ever adopted. That
//! checkpoint then resumes on 2 processes (FULL_SHARD dp_shard 2, ZeRO-2 dp_shard 2, DDP dp 2), on 4 as HSDP
//! (dp_replicate 2 × dp_shard 2) and on 1, each taking the step the uninterrupted run takes next.
//!
//! How a rank dies: as in `pipeline_layouts` (ranks are threads), its closure returns, dropping its process group
//! and every object holding it: its connections close, as a killed process's do. A crash inside `save_state`
//! is a panic in a registered object's `state_dict` (called by rank 0 alone, after the weights and the optimizer
//! state are in the temporary directory), caught on that thread, which then drops everything and returns.
//!
//! Method and tolerances: as `sharded_layouts` (the suite's fixed global batch, so every layout reads the same
//! samples at each step; relative 1e-5 on the loss and the clipped norm, 1e-5 absolute on the weights).

use super::nd_equivalence::{assert_close, corpus, max_abs_diff, micro_batches, model_config, run_groups_with_timeout};
use super::sharded_layouts::{config_with, world, Layout};
use accel::state::{StateDict, Stateful};
use accel::{Accelerator, AcceleratorConfig, AdamW, AdamWConfig, ShardingStrategy};
use accel_examples::gpt::CharGpt;
use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The collective timeout of every run here: a survivor that only learnt of the death by it would take this long.
const TIMEOUT: Duration = Duration::from_secs(5);

/// The saving run's layout: FULL_SHARD over dp_shard 4.
const SAVER: Layout = (1, 4, 1, 1);

/// Where the step-3 checkpoint resumes, with which sharding.
const RESUMED_AT: [(Layout, ShardingStrategy); 5] = [
    ((1, 2, 1, 1), ShardingStrategy::FullShard),
    ((1, 2, 1, 1), ShardingStrategy::ShardGradOp),
    ((2, 1, 1, 1), ShardingStrategy::ShardGradOp),
    ((2, 2, 1, 1), ShardingStrategy::FullShard),
    ((1, 1, 1, 1), ShardingStrategy::FullShard),
];

/// `f` on the ranks of `layout` (threads; the collective timeout [`TIMEOUT`]), each with its Accelerator.
fn on_ranks<R: Send + 'static>(
    layout: Layout,
    cfg: AcceleratorConfig,
    f: impl Fn(Accelerator) -> anyhow::Result<R> + Send + Sync + 'static,
) -> Vec<R> {
    run_groups_with_timeout(world(layout), TIMEOUT, move |pg| f(Accelerator::with_process_group(cfg.clone(), pg)?))
}

/// What the training program checkpoints besides the model: the optimizer steps it took. Rank 0 alone asks for its
/// state, after gathering the weights and the optimizer state: with `crash` set, that process dies there.
#[derive(Default)]
struct Progress {
    steps: u64,
    crash: bool,
}

impl Stateful for Progress {
    fn state_dict(&self) -> accel::Result<StateDict> {
        if self.crash {
            panic!("simulated crash of rank 0 in the middle of save_state");
        }
        Ok(StateDict::from_meta(serde_json::json!({ "steps": self.steps })))
    }
    fn load_state_dict(&mut self, sd: &StateDict) -> accel::Result<()> {
        self.steps = sd.meta_field("steps")?;
        Ok(())
    }
}

/// One rank's training program: the char-GPT (built once, on the Accelerator's builder: under FULL_SHARD its layers
/// gather their weights at each use), AdamW, and its registered progress.
struct Program {
    gpt: CharGpt,
    model: accel::PreparedModel,
    opt: accel::AcceleratedOptimizer<AdamW>,
    progress: Arc<Mutex<Progress>>,
}

fn build(acc: &Accelerator, vocab: usize) -> anyhow::Result<Program> {
    let varmap = VarMap::new();
    let cfg = model_config(vocab);
    let gpt = CharGpt::new(cfg, &acc.builder(&varmap, CharGpt::plan(&cfg)))?;
    let model = acc.prepare_model(&varmap)?;
    let opt = acc.prepare_optimizer(&model, AdamW::new(AdamWConfig { lr: 3e-3, ..AdamWConfig::default() })?)?;
    let progress = Arc::new(Mutex::new(Progress::default()));
    acc.register_for_checkpointing(progress.clone());
    Ok(Program { gpt, model, opt, progress })
}

/// One optimizer step on the global batch of `step` (clipped to norm 1): the mean loss over the data-parallel
/// ranks and the norm.
fn one_step(acc: &Accelerator, p: &mut Program, ids: &[u32], step: usize) -> anyhow::Result<(f64, f64)> {
    let micro = micro_batches(acc, ids, step);
    let (mut loss_sum, mut norm) = (0.0, None);
    acc.accumulate_window(micro.len(), |i| -> accel::Result<()> {
        let (x, y) = &micro[i];
        let loss = p.gpt.loss(x, y).map_err(|e| accel::AccelError::Usage(e.to_string()))?;
        loss_sum += loss.to_scalar::<f32>()? as f64;
        acc.backward(&loss)?;
        if acc.sync_gradients() {
            norm = acc.clip_grad_norm(1.0)?;
            p.opt.step()?;
            p.opt.zero_grad();
        }
        Ok(())
    })?;
    p.progress.lock().unwrap().steps += 1;
    let mean = acc.reduce(&Tensor::new(loss_sum / micro.len() as f64, &Device::Cpu)?, accel::ReduceKind::Mean)?;
    Ok((mean.to_scalar::<f64>()?, norm.expect("the window's last micro-batch syncs")))
}

/// Step 4 (index 3) of a run: its loss, clipped norm and the weights after it.
type Next = (f64, f64, BTreeMap<String, Tensor>);

fn three_steps(acc: &Accelerator, vocab: usize, ids: &[u32]) -> anyhow::Result<Program> {
    let mut p = build(acc, vocab)?;
    for step in 0..3 {
        one_step(acc, &mut p, ids, step)?;
    }
    Ok(p)
}

/// How a resumed run finds the step-3 checkpoint.
#[derive(Clone)]
enum Load {
    /// `load_state(Some(dir))`.
    Dir(PathBuf),
    /// `load_state(None)` under this project dir: the newest automatically named checkpoint.
    Newest(PathBuf),
}

/// The step-3 checkpoint resumed at every layout of [`RESUMED_AT`]: each rank loads `expected` (the directory),
/// restores 3 steps of progress and takes step 4 like `reference`.
fn resumes_everywhere(load: Load, expected: &Path, reference: &Next, ids: &Arc<Vec<u32>>, vocab: usize) {
    for (layout, strategy) in RESUMED_AT {
        let mut cfg = config_with(layout, strategy);
        if let Load::Newest(project) = &load {
            cfg = cfg.with_project_dir(project);
        }
        let (i, l) = (ids.clone(), load.clone());
        let got = on_ranks(layout, cfg, move |acc| {
            let mut p = build(&acc, vocab)?;
            let loaded = acc.load_state(match &l {
                Load::Dir(d) => Some(d.as_path()),
                Load::Newest(_) => None,
            })?;
            let steps = p.progress.lock().unwrap().steps;
            let (loss, norm) = one_step(&acc, &mut p, &i, 3)?;
            Ok((loaded, steps, loss, norm, p.model.state_dict()?))
        });
        for (rank, (loaded, steps, loss, norm, weights)) in got.iter().enumerate() {
            let what = format!("resumed at {layout:?} {strategy}, rank {rank}");
            assert_eq!(loaded, expected, "{what}: the checkpoint loaded");
            assert_eq!(*steps, 3, "{what}: the registered progress restored");
            assert_close(&format!("{what}: loss"), &[*loss], &[reference.0]);
            assert_close(&format!("{what}: grad norm"), &[*norm], &[reference.1]);
            let d = max_abs_diff(weights, &reference.2);
            assert!(d <= 1e-5, "{what}: weights after the resumed step differ from the uninterrupted run's by {d:e}");
        }
    }
}

/// Every file of `dir` (not recursive: a checkpoint is flat) with its bytes.
fn contents(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap())
        })
        .collect()
}

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// A survivor's error names the collective that broke, the dead rank, and says it is gone — within the collective
/// timeout, so the death was noticed, not waited out.
fn assert_names_the_dead_rank(what: &str, error: &str, op: &str, dead: usize, took: Duration) {
    assert!(!error.is_empty(), "{what}: finished although rank {dead} never took part");
    assert!(error.contains(op), "{what}: the error does not name the {op}: {error}");
    assert!(error.contains(&format!("rank {dead} is gone")), "{what}: the error does not name rank {dead}: {error}");
    assert!(took < TIMEOUT, "{what}: failed after {took:?}, not at once (timeout {TIMEOUT:?}): {error}");
}

/// 4 processes, FULL_SHARD: 3 steps, a checkpoint, and during step 4 rank 3 dies after its forward pass (every
/// parameter all-gathered with its peers), before the backward. Each survivor fails in the backward's
/// reduce-scatter naming rank 3; the checkpoint resumes at every other layout with the uninterrupted step 4.
#[test]
fn a_rank_killed_mid_step_fails_every_survivor_and_its_last_checkpoint_resumes_at_any_layout() {
    const DEAD: usize = 3;
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let tmp = tempfile::tempdir().unwrap();
    let dir = Arc::new(tmp.path().join("step3"));
    // The uninterrupted run: 3 steps, then step 4.
    let i = ids.clone();
    let reference = on_ranks(SAVER, config_with(SAVER, ShardingStrategy::FullShard), move |acc| {
        let mut p = three_steps(&acc, vocab, &i)?;
        let (loss, norm) = one_step(&acc, &mut p, &i, 3)?;
        Ok((loss, norm, p.model.state_dict()?))
    })
    .remove(0);

    let (i, d) = (ids.clone(), dir.clone());
    let started = Instant::now();
    let outcomes = on_ranks(SAVER, config_with(SAVER, ShardingStrategy::FullShard), move |acc| {
        let mut p = three_steps(&acc, vocab, &i)?;
        acc.save_state(Some(&d))?;
        if acc.rank() == DEAD {
            let (x, y) = &micro_batches(&acc, &i, 3)[0];
            p.gpt.loss(x, y)?;
            return Ok(None); // killed: its process group and connections go with it
        }
        let t = Instant::now();
        let e = one_step(&acc, &mut p, &i, 3).err().map(|e| ddp_core::launcher::error_report(e.as_ref()));
        Ok(Some((e.unwrap_or_default(), t.elapsed())))
    });
    let took = started.elapsed();
    for (rank, outcome) in outcomes.iter().enumerate().filter(|(r, _)| *r != DEAD) {
        let (e, t) = outcome.as_ref().expect("a survivor");
        assert_names_the_dead_rank(&format!("step 4, rank {rank}"), e, "reduce_scatter", DEAD, *t);
    }
    assert!(took < TIMEOUT + Duration::from_secs(10), "the killed run took {took:?}");

    // The checkpoint is complete and resumes everywhere like the run that went on.
    assert!(dir.join("accelerator.json").is_file() && !tmp.path().join(".step3.partial").exists());
    resumes_everywhere(Load::Dir(dir.to_path_buf()), &dir, &reference, &ids, vocab);
}

/// What one rank of the save-fault run saw.
struct SaveFaults {
    /// The step-3 checkpoint's files right after it was saved (rank 0).
    saved: Option<BTreeMap<String, Vec<u8>>>,
    /// Step 4 of this uninterrupted run.
    next: Next,
    /// The save that rank 2 could not write its part of.
    refused: String,
    /// The save rank 0 died in (survivors: the error and how long it took).
    lost: Option<(String, Duration)>,
    /// Rank 0: whether that save did kill it (panicked inside `save_state`).
    died: bool,
}

/// 4 processes, FULL_SHARD, automatic checkpoint names: 3 steps, `checkpoint_0`, step 4, then two saves that fail.
/// First rank 2 cannot write its part (its directory lies under a regular file: a disk that failed) after rank 0
/// has written a complete-looking `.checkpoint_1.partial`: every rank fails and nothing is committed. Then rank 0
/// dies while saving `checkpoint_1` (copying its state, after the weights were gathered): ranks 1-3 fail in the
/// save's agreement naming rank 0, and none of them
/// commits the half-written directory. `checkpoint_0` is left byte for byte and stays the newest:
/// `load_state(None)` resumes it at every other layout with step 4 of the run.
#[test]
fn a_rank_lost_during_a_sharded_save_leaves_the_previous_checkpoint_the_newest() {
    const FAILING: usize = 2;
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let tmp = tempfile::tempdir().unwrap();
    let project = Arc::new(tmp.path().join("project"));
    let checkpoints = project.join("checkpoints");
    let not_a_dir = Arc::new(tmp.path().join("a-file"));
    std::fs::write(&*not_a_dir, "a regular file where rank 2's checkpoint directory should go").unwrap();

    let (i, root, bad) = (ids.clone(), checkpoints.clone(), not_a_dir.clone());
    let cfg = config_with(SAVER, ShardingStrategy::FullShard).with_project_dir(&*project);
    let outcomes = on_ranks(SAVER, cfg, move |acc| {
        let mut p = three_steps(&acc, vocab, &i)?;
        let first = acc.save_state(None)?;
        let saved = (acc.rank() == 0).then(|| contents(&first));
        let (loss, norm) = one_step(&acc, &mut p, &i, 3)?;
        let next = (loss, norm, p.model.state_dict()?);

        let target = if acc.rank() == FAILING { bad.join("checkpoint_1") } else { root.join("checkpoint_1") };
        let refused = match acc.save_state(Some(&target)) {
            Ok(_) => String::new(),
            Err(e) => ddp_core::launcher::error_report(&e),
        };

        if acc.rank() == 0 {
            p.progress.lock().unwrap().crash = true;
            let died = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| acc.save_state(None))).is_err();
            drop(p);
            drop(acc); // dead: its process group and connections go with it
            return Ok(SaveFaults { saved, next, refused, lost: None, died });
        }
        let t = Instant::now();
        let lost = acc.save_state(None).err().map(|e| ddp_core::launcher::error_report(&e)).unwrap_or_default();
        Ok(SaveFaults { saved, next, refused, lost: Some((lost, t.elapsed())), died: false })
    });

    // checkpoint_0 as saved; no checkpoint_1; what rank 0 left of its crash stays hidden and incomplete.
    let saved = outcomes[0].saved.as_ref().unwrap();
    let first = checkpoints.join("checkpoint_0");
    let now = contents(&first);
    let changed: std::collections::BTreeSet<_> =
        now.keys().chain(saved.keys()).filter(|f| now.get(*f) != saved.get(*f)).collect();
    assert!(changed.is_empty(), "checkpoint_0 changed after the failed saves: {changed:?}");
    assert_eq!(names(&checkpoints), [".checkpoint_1.partial", "checkpoint_0"], "no other checkpoint committed");
    let partial = names(&checkpoints.join(".checkpoint_1.partial"));
    assert!(
        !partial.contains(&"accelerator.json".to_string()),
        "rank 0 died while copying the state, before accelerator.json: {partial:?}"
    );
    assert!(outcomes[0].died, "rank 0 was to die inside save_state");
    for (rank, o) in outcomes.iter().enumerate() {
        let e = &o.refused;
        if rank == FAILING {
            assert!(e.contains("creating checkpoint directory") && e.contains("a-file"), "rank {rank}: {e}");
        } else {
            assert!(e.contains("another rank failed while writing the checkpoint"), "rank {rank}: {e}");
        }
        if rank != 0 {
            let (e, t) = o.lost.as_ref().expect("a survivor");
            assert_names_the_dead_rank(&format!("rank 0 dying in save_state, rank {rank}"), e, "all_reduce", 0, *t);
            assert!(
                e.contains("a rank was lost while copying the checkpoint, which is not committed"),
                "rank {rank}: {e}"
            );
        }
    }

    resumes_everywhere(Load::Newest(project.to_path_buf()), &first, &outcomes[1].next, &ids, vocab);
}
