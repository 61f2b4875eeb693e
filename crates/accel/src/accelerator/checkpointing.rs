//! `Accelerator::save_state` / `load_state` / `register_for_checkpointing` (Accelerate's `save_state`,
//! `load_state`, `register_for_checkpointing`, with its `ProjectConfiguration` automatic naming).
//!
//! `save_state` is collective — every rank calls it. Protocol (see [`crate::state::checkpoint_dir`] for atomicity):
//! 1. the target is resolved (automatic naming: rank 0 picks `checkpoint_{i}` and broadcasts `i`);
//! 2. rank 0 creates the temporary `.{name}.partial` next to the target (removing a stale one from a crash);
//! 3. every rank writes its `random_states_{rank}.json`; rank 0 writes the shared files;
//! 4. all ranks agree that every write succeeded (the `wait_for_everyone` before the rename), rank 0 renames
//!    the directory to its final name and applies `total_limit`; all ranks agree again (the one after).
//!
//! Each agreement is an all-reduce of a failure flag rather than a bare barrier, so one rank's error makes every
//! rank return an error instead of waiting for a timeout. On failure the temporary directory is removed and the
//! previous checkpoint is untouched.
//!
//! In the background (`AcceleratorConfig::async_checkpointing`, torchtitan's asynchronous checkpointing): steps
//! 1–2 and a copy of everything the checkpoint holds ([`Snapshot`], collective under tp) run on the caller's thread;
//! steps 3–4 run on a writer thread, whose agreements go over a process group of their own (the checkpoint group,
//! made at the first background save) so they never interleave with training's collectives. The next save, a
//! load, `wait_for_checkpoint` and the Accelerator's end wait for it; a crash while it writes leaves only the
//! hidden temporary directory, and the previous checkpoint the newest complete one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;

use candle_core::{Device, Tensor};
use ddp_core::{ProcessGroup, ReduceOp};
use serde::{Deserialize, Serialize};

use crate::accelerator::Prepared;
use crate::error::{AccelError, Result};
use crate::state::checkpoint_dir::{
    checkpoint_name, commit, newest_checkpoint, next_checkpoint_index, partial_dir, remove_if_exists,
    rotate_checkpoints,
};
use crate::state::rng::RngState;
use crate::state::{load_safetensors, read_json, save_safetensors, write_json};
use crate::state::{SharedStateful, StateDict, Stateful, ACCELERATOR_FILE};
use crate::step::StepCounters;
use crate::MixedPrecision;
use crate::{lock, Accelerator};

/// Identifies the directory format in `accelerator.json`.
const FORMAT: &str = "accel-checkpoint";
/// Bumped on incompatible layout changes.
const FORMAT_VERSION: u32 = 1;

/// How many objects of each kind a checkpoint holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Contents {
    models: usize,
    optimizers: usize,
    schedulers: usize,
    data_loaders: usize,
    custom: usize,
    scaler: bool,
}

/// `accelerator.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct CheckpointMeta {
    format: String,
    version: u32,
    world_size: usize,
    mixed_precision: MixedPrecision,
    gradient_accumulation_steps: usize,
    counters: StepCounters,
    contents: Contents,
    /// The mesh sizes `[pp, dp_replicate, dp_shard, tp]` of the run that wrote it (absent before tensor
    /// parallelism existed: pure data parallelism).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mesh: Option<[usize; 4]>,
}

fn mesh_sizes(acc: &Accelerator) -> [usize; 4] {
    let s = acc.mesh().shape();
    [s.pp, s.dp_replicate, s.dp_shard, s.tp]
}

/// `random_states_{rank}.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct RandomStates {
    rank: usize,
    world_size: usize,
    /// The Accelerator's RNG (`Accelerator::rng`).
    accelerator_rng: RngState,
}

/// `base` for the first object of a kind, `base_{i}` for the next ones (Accelerate's naming).
fn stem(base: &str, i: usize) -> String {
    if i == 0 {
        base.to_string()
    } else {
        format!("{base}_{i}")
    }
}

fn checkpoint_err(path: &Path, reason: impl Into<String>) -> AccelError {
    AccelError::Checkpoint { path: path.to_path_buf(), reason: reason.into() }
}

/// Re-labels an error raised while restoring `what` from `file`, keeping its message (which names the tensor).
fn restoring(file: &Path, what: &str) -> impl FnOnce(AccelError) -> AccelError {
    let file = file.to_path_buf();
    let what = what.to_string();
    move |e| match e {
        AccelError::Checkpoint { .. } => e,
        e => checkpoint_err(&file, format!("restoring the {what}: {e}")),
    }
}

/// `1 process`, `4 processes`.
fn processes(n: usize) -> String {
    format!("{n} process{}", if n == 1 { "" } else { "es" })
}

fn create_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| AccelError::io(format!("creating checkpoint directory {}", dir.display()), e))
}

/// What runs on the main process once a checkpoint is committed (the Trainer's checksums and state file).
pub(crate) type OnCommitted = Box<dyn FnOnce(&Path) -> Result<()> + Send>;

/// `Accelerator::save_state` (see the protocol in the module documentation): in the background under
/// `async_checkpointing`, else here.
pub(crate) fn save_state(acc: &Accelerator, dir: Option<&Path>, on_committed: Option<OnCommitted>) -> Result<PathBuf> {
    wait_for_save(acc)?;
    let background = acc.config().async_checkpointing;
    // The writer's agreements go over a group of their own (made collectively, at the first background save).
    let group = match background {
        true => acc.inner.saves.checkpoint_group(acc.process_group())?,
        false => (acc.world_size() > 1).then(|| acc.process_group().clone()),
    };
    let (save, snapshot) = begin_save(acc, dir, background, group)?;
    if !background {
        return save.finish(snapshot, on_committed);
    }
    let final_dir = save.final_dir.clone();
    let writer = std::thread::Builder::new()
        .name("accel-checkpoint-writer".into())
        .spawn(move || save.finish(snapshot, on_committed))
        .map_err(|e| AccelError::io("starting the checkpoint writer thread", e))?;
    acc.inner.saves.hold(final_dir.clone(), writer);
    Ok(final_dir)
}

/// Waits for the save in the background, if one is in flight; its error, naming the checkpoint, if it failed.
pub(crate) fn wait_for_save(acc: &Accelerator) -> Result<Option<PathBuf>> {
    acc.inner.saves.wait()
}

/// Steps 1–2 of the protocol and the snapshot: the directory resolved and its temporary made (agreed), then
/// everything the checkpoint holds copied out of the training state (agreed). `detach`: deep copies, so training
/// may change the state while the copy is written.
fn begin_save(
    acc: &Accelerator,
    dir: Option<&Path>,
    detach: bool,
    group: Option<ProcessGroup>,
) -> Result<(PendingCommit, Snapshot)> {
    let main = acc.is_main_process();
    let (final_dir, automatic_root) = resolve_save_dir(acc, dir)?;
    let partial = partial_dir(&final_dir);
    let prepared = if main { remove_if_exists(&partial).and_then(|()| create_dir(&partial)) } else { Ok(()) };
    let abandon = |e: AccelError| {
        if main {
            let _ = remove_if_exists(&partial);
        }
        e
    };
    agree(acc, "preparing", &final_dir, prepared).map_err(abandon)?;
    let snapshot = match Snapshot::take(acc, detach) {
        Ok(snapshot) => agree(acc, "copying", &final_dir, Ok(())).map(|()| snapshot),
        Err(e) => agree(acc, "copying", &final_dir, Err(e)).map(|()| unreachable!("agree returns the error")),
    }
    .map_err(abandon)?;
    let total_limit = acc.config().total_limit;
    Ok((PendingCommit { group, main, final_dir, partial, automatic_root, total_limit }, snapshot))
}

/// Steps 3–4 of a save whose directory is prepared: what they need, without the Accelerator (a writer thread
/// holds it).
struct PendingCommit {
    /// The group the agreements run over (`None` for one process).
    group: Option<ProcessGroup>,
    main: bool,
    final_dir: PathBuf,
    partial: PathBuf,
    automatic_root: Option<PathBuf>,
    total_limit: Option<usize>,
}

impl PendingCommit {
    /// Writes the snapshot into the temporary directory, agrees, renames it (rank 0, then `total_limit`), agrees
    /// again, and runs `on_committed` on rank 0.
    fn finish(self, snapshot: Snapshot, on_committed: Option<OnCommitted>) -> Result<PathBuf> {
        let (main, group) = (self.main, self.group.as_ref());
        let written = create_dir(&self.partial).and_then(|()| snapshot.write(&self.partial));
        drop(snapshot); // the copy's memory goes as soon as it is on disk
        if let Err(e) = agree_over(group, "writing", &self.final_dir, written) {
            if main {
                let _ = remove_if_exists(&self.partial);
            }
            return Err(e);
        }
        let committed = if main {
            commit(&self.partial, &self.final_dir).and_then(|()| match (&self.automatic_root, self.total_limit) {
                (Some(root), Some(limit)) => rotate_checkpoints(root, limit).map(|removed| {
                    for r in removed {
                        tracing::info!("removed old checkpoint {} (total_limit {limit})", r.display());
                    }
                }),
                _ => Ok(()),
            })
        } else {
            Ok(())
        };
        agree_over(group, "committing", &self.final_dir, committed)?;
        // Ranks on another machine without a shared file system hold their own copy of the directory.
        if !main && self.partial.exists() {
            commit(&self.partial, &self.final_dir)?;
        }
        if let (true, Some(then)) = (main, on_committed) {
            then(&self.final_dir)?;
        }
        tracing::info!("saved checkpoint {}", self.final_dir.display());
        Ok(self.final_dir)
    }
}

/// The background save in flight, and the process group background saves agree over.
#[derive(Default)]
pub(crate) struct BackgroundSaves {
    writer: Mutex<Option<(PathBuf, JoinHandle<Result<PathBuf>>)>>,
    group: OnceLock<Option<ProcessGroup>>,
}

impl BackgroundSaves {
    /// The checkpoint group over every rank of `pg` (made collectively the first time; `None` for one process).
    fn checkpoint_group(&self, pg: &ProcessGroup) -> Result<Option<ProcessGroup>> {
        if let Some(group) = self.group.get() {
            return Ok(group.clone());
        }
        let ranks: Vec<usize> = (0..pg.world_size()).collect();
        let group = if ranks.len() > 1 { pg.new_group(&ranks)? } else { None };
        Ok(self.group.get_or_init(|| group).clone())
    }

    fn hold(&self, dir: PathBuf, writer: JoinHandle<Result<PathBuf>>) {
        *lock(&self.writer) = Some((dir, writer));
    }

    fn wait(&self) -> Result<Option<PathBuf>> {
        let Some((dir, writer)) = lock(&self.writer).take() else { return Ok(None) };
        match writer.join() {
            Ok(done) => done.map(Some),
            Err(_) => {
                Err(checkpoint_err(&dir, "the checkpoint writer thread panicked; the checkpoint is not committed"))
            }
        }
    }
}

impl Drop for BackgroundSaves {
    /// The Accelerator's end waits for a save in flight (every rank's does, so its agreements complete).
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            tracing::error!("{e}");
            eprintln!("accel: {e}");
        }
    }
}

/// `Accelerator::load_state`: restores everything but the step counters, which it returns for the step
/// owner to restore.
pub(crate) fn load_state(acc: &Accelerator, dir: Option<&Path>) -> Result<(PathBuf, StepCounters, Option<StateDict>)> {
    // A save in flight first: the newest checkpoint may be the one it writes.
    wait_for_save(acc)?;
    let dir = resolve_load_dir(acc, dir)?;
    let meta = read_meta(&dir)?;
    check_layout(acc, &dir, &meta)?;
    check_contents(acc, &dir, &meta.contents)?;
    let device = acc.device().clone();
    let prepared = acc.prepared();
    restore_models(&dir, &prepared, &device)?;
    restore_optimizers(&dir, &prepared, &device)?;
    restore_scaler(acc, &dir, meta.contents.scaler, &device)?;
    restore_registered(&dir, prepared, &device)?;
    restore_rng(acc, &dir, &meta)?;
    let gradients = load_gradients(acc, &dir, &device)?;
    Ok((dir, meta.counters, gradients))
}

/// The directory to load: the one given, else the newest automatically named checkpoint under `project_dir`.
fn resolve_load_dir(acc: &Accelerator, dir: Option<&Path>) -> Result<PathBuf> {
    if let Some(d) = dir {
        return Ok(d.to_path_buf());
    }
    let root = acc.checkpoints_dir().ok_or_else(|| {
        AccelError::Usage(
            "load_state(None) looks for the newest checkpoint under project_dir/checkpoints, but no \
             project_dir is configured: set AcceleratorConfig::project_dir or pass a directory"
                .into(),
        )
    })?;
    newest_checkpoint(&root)?
        .ok_or_else(|| checkpoint_err(&root, "no checkpoint_{i} directory found; save one first or pass a directory"))
}

/// Reads `accelerator.json` of the checkpoint `dir`, refusing a directory that is not a complete checkpoint or
/// a format this version cannot read.
fn read_meta(dir: &Path) -> Result<CheckpointMeta> {
    if !dir.is_dir() {
        return Err(checkpoint_err(dir, "does not exist or is not a directory"));
    }
    let meta_path = dir.join(ACCELERATOR_FILE);
    if !meta_path.is_file() {
        return Err(checkpoint_err(
            dir,
            format!("no {ACCELERATOR_FILE}: not a checkpoint written by save_state (or an incomplete copy)"),
        ));
    }
    let meta: CheckpointMeta = serde_json::from_value(read_json(&meta_path)?)
        .map_err(|e| AccelError::json(format!("reading {}", meta_path.display()), e))?;
    if meta.format != FORMAT || meta.version > FORMAT_VERSION {
        return Err(checkpoint_err(
            &meta_path,
            format!(
                "format {:?} version {} is not readable by this version (expects {FORMAT:?} ≤ {FORMAT_VERSION})",
                meta.format, meta.version
            ),
        ));
    }
    Ok(meta)
}

/// Checks that the checkpoint fits this job. Another number of processes is accepted at an optimizer-step boundary:
/// the weights and the optimizer state are whole tensors, the step counters global, a prepared loader's position is
/// counted in global samples (at another global batch it continues only from a whole number of the new batches, and
/// warns), dropout masks are addressed by the
/// single-process coordinates; only each rank's `Accelerator::rng` is per rank, and it is derived anew
/// ([`restore_rng`]). A checkpoint taken inside an accumulation window holds each rank's partial gradients: it is
/// refused at another process count. Warns when the mesh layout or the gradient accumulation differs.
fn check_layout(acc: &Accelerator, dir: &Path, meta: &CheckpointMeta) -> Result<()> {
    if meta.world_size != acc.world_size() {
        if dir.join("gradients_0.json").is_file() {
            return Err(checkpoint_err(
                dir,
                format!(
                    "written by {} inside an accumulation window (each rank's partial gradients), but this job has \
                     {}; resume it with {}, or from a checkpoint taken at an optimizer step",
                    processes(meta.world_size),
                    acc.world_size(),
                    processes(meta.world_size)
                ),
            ));
        }
        if acc.is_main_process() {
            tracing::warn!(
                "checkpoint {} was written by {}, this job has {}: the weights, the optimizer state, the \
                 step counters and the data position load as saved (the position is in global samples: keep the \
                 global batch), and each rank's Accelerator::rng is derived from (seed, rank, optimizer step) \
                 instead of restored",
                dir.display(),
                processes(meta.world_size),
                acc.world_size()
            );
        }
    }
    let saved_mesh = meta.mesh.unwrap_or([1, meta.world_size, 1, 1]);
    // A rank plays the same part when the pp, data-parallel (dp_replicate × dp_shard) and tp sizes are the same:
    // trading dp_replicate for dp_shard changes no rank's role.
    let roles = |m: [usize; 4]| [m[0], m[1] * m[2], m[3]];
    // (At another process count the warning above already says how the RNG is handled.)
    if meta.world_size == acc.world_size() && roles(saved_mesh) != roles(mesh_sizes(acc)) {
        // Weights and optimizer states are full tensors and load into any layout; what is per rank is not.
        // Once (the main process), and what it means: weights, optimizer state and the data position are
        // layout-free (the loader places its position in samples); only the per-rank RNG is not.
        if acc.is_main_process() {
            tracing::warn!(
                "checkpoint {} was written by the layout [pp, dp_replicate, dp_shard, tp] = {saved_mesh:?}, this \
                 run uses {:?}: the weights, the optimizer state and the data position load as saved, but each \
                 rank's Accelerator::rng state goes to the rank of the same number, which now plays another part: \
                 a program drawing from it draws other numbers than the original run",
                dir.display(),
                mesh_sizes(acc)
            );
        }
    }
    // Once, and what it changes: with the global batch kept, each optimizer step sees the same samples in other
    // micro-batches (at another global batch the loader says the steps differ).
    if meta.gradient_accumulation_steps != acc.gradient_accumulation_steps() && acc.is_main_process() {
        tracing::warn!(
            "checkpoint {} was written with gradient_accumulation_steps = {}, this run uses {}: with the same global \
             batch per optimizer step the updates are the original's up to floating-point summation order, except \
             what is drawn per micro-batch (dropout masks); with another global batch, another run",
            dir.display(),
            meta.gradient_accumulation_steps,
            acc.gradient_accumulation_steps()
        );
    }
    Ok(())
}

/// Refuses a checkpoint that holds another number of models, optimizers, schedulers, data loaders or registered
/// objects than this Accelerator (each would load into the wrong object).
fn check_contents(acc: &Accelerator, dir: &Path, c: &Contents) -> Result<()> {
    let here = contents(acc);
    let check = |what: &str, saved: usize, now: usize, how: &str| -> Result<()> {
        if saved != now {
            return Err(checkpoint_err(
                dir,
                format!("holds {saved} {what} but this Accelerator has {now}; {how} before load_state"),
            ));
        }
        Ok(())
    };
    check("models", c.models, here.models, "prepare the same models")?;
    check("optimizers", c.optimizers, here.optimizers, "prepare the same optimizers")?;
    check("schedulers", c.schedulers, here.schedulers, "register the same schedulers")?;
    check("data loaders", c.data_loaders, here.data_loaders, "prepare the same data loaders, in the same order")?;
    check("registered objects", c.custom, here.custom, "register_for_checkpointing the same objects")
}

/// Loads each prepared model's weights from `model*.safetensors`.
fn restore_models(dir: &Path, prepared: &Prepared, device: &Device) -> Result<()> {
    for (i, model) in prepared.models.iter().enumerate() {
        let file = dir.join(format!("{}.safetensors", stem("model", i)));
        if !file.is_file() {
            return Err(checkpoint_err(dir, format!("missing {}", file.display())));
        }
        let weights = load_safetensors(&file, device)?;
        model.load_state_dict(&weights).map_err(restoring(&file, "model weights"))?;
    }
    Ok(())
}

/// Loads each optimizer's state, laid out for its model's local shards.
fn restore_optimizers(dir: &Path, prepared: &Prepared, device: &Device) -> Result<()> {
    for (i, (opt, model)) in prepared.optimizers.iter().enumerate() {
        let s = stem("optimizer", i);
        let restoring_it = || restoring(&dir.join(format!("{s}.json")), "optimizer state");
        let sd = model.optimizer_state_to_local(StateDict::load(dir, &s, device)?).map_err(restoring_it())?;
        lock(opt).load_state_dict(&sd).map_err(AccelError::from).map_err(restoring_it())?;
    }
    Ok(())
}

/// Loads the fp16 loss scaler's state when both the run and the checkpoint have one (a run with a scaler but a
/// checkpoint without starts from the initial scale, with a warning).
fn restore_scaler(acc: &Accelerator, dir: &Path, saved: bool, device: &Device) -> Result<()> {
    match (acc.grad_scaler(), saved) {
        (Some(scaler), true) => {
            let sd = StateDict::load(dir, "scaler", device)?;
            lock(&scaler).load_state_dict(&sd).map_err(restoring(&dir.join("scaler.json"), "fp16 loss scaler"))?;
        }
        (Some(_), false) => tracing::warn!(
            "checkpoint {} has no fp16 loss-scaler state (saved without fp16): starting from the initial scale",
            dir.display()
        ),
        (None, _) => {}
    }
    Ok(())
}

/// Loads the schedulers, the data-loader positions and the objects registered for checkpointing.
fn restore_registered(dir: &Path, prepared: Prepared, device: &Device) -> Result<()> {
    for (i, sched) in prepared.schedulers.iter().enumerate() {
        let s = stem("scheduler", i);
        let sd = StateDict::load(dir, &s, device)?;
        lock(sched).load_state_dict(&sd).map_err(restoring(&dir.join(format!("{s}.json")), "scheduler"))?;
    }
    for (i, mut handle) in prepared.data_loaders.into_iter().enumerate() {
        let s = stem("data_loader", i);
        let sd = StateDict::load(dir, &s, device)?;
        handle.load_state_dict(&sd).map_err(restoring(&dir.join(format!("{s}.json")), "data-loader position"))?;
    }
    for (i, obj) in prepared.custom.iter().enumerate() {
        let s = format!("custom_checkpoint_{i}");
        let sd = StateDict::load(dir, &s, device)?;
        lock(obj).load_state_dict(&sd).map_err(restoring(&dir.join(format!("{s}.json")), "registered object"))?;
    }
    Ok(())
}

/// Restores the Accelerator's RNG from this rank's `random_states_{rank}.json`; at another process count (a rank
/// plays another part, and there may be no file of its number) derives it from the run's seed, the rank and the
/// optimizer step instead: ChaCha8 keyed by the seed on stream `step · 2^20 + rank` — the same stream for the same
/// rank and step at any layout and on any resume.
fn restore_rng(acc: &Accelerator, dir: &Path, meta: &CheckpointMeta) -> Result<()> {
    if meta.world_size != acc.world_size() {
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(acc.config().seed.unwrap_or(0));
        rng.set_stream((meta.counters.optimizer_steps << 20) | acc.rank() as u64);
        *acc.rng() = rng;
        return Ok(());
    }
    let rng_path = dir.join(format!("random_states_{}.json", acc.rank()));
    if !rng_path.is_file() {
        return Err(checkpoint_err(dir, format!("missing random_states_{}.json (this rank's RNG state)", acc.rank())));
    }
    let states: RandomStates = serde_json::from_value(read_json(&rng_path)?)
        .map_err(|e| AccelError::json(format!("reading {}", rng_path.display()), e))?;
    *acc.rng() = states.accelerator_rng.restore().map_err(restoring(&rng_path, "RNG state"))?;
    Ok(())
}

/// This rank's partial gradients, when the checkpoint was saved inside an accumulation window.
fn load_gradients(acc: &Accelerator, dir: &Path, device: &Device) -> Result<Option<StateDict>> {
    let grads_stem = format!("gradients_{}", acc.rank());
    Ok(if dir.join(format!("{grads_stem}.json")).is_file() {
        Some(StateDict::load(dir, &grads_stem, device)?)
    } else {
        None
    })
}

/// The final directory of a save, and the automatic-naming root when it applies.
fn resolve_save_dir(acc: &Accelerator, dir: Option<&Path>) -> Result<(PathBuf, Option<PathBuf>)> {
    if let Some(d) = dir {
        return Ok((d.to_path_buf(), None));
    }
    let cfg = acc.config();
    let root = match (cfg.automatic_checkpoint_naming, acc.checkpoints_dir()) {
        (true, Some(root)) => root,
        _ => {
            return Err(AccelError::Usage(
                "save_state(None) names checkpoints automatically, which needs AcceleratorConfig::project_dir \
                 and automatic_checkpoint_naming = true; set both or pass a directory"
                    .into(),
            ))
        }
    };
    // Rank 0 decides the index so every rank writes into the same directory; -1 carries its failure.
    let mine = if acc.is_main_process() { next_checkpoint_index(&root) } else { Ok(0) };
    let mut index = [mine.as_ref().map_or(-1, |&i| i as i64)];
    if acc.world_size() > 1 {
        acc.process_group().broadcast(&mut index, 0)?;
    }
    let _ = mine?;
    if index[0] < 0 {
        return Err(checkpoint_err(&root, "rank 0 could not list the existing checkpoints (see its log)"));
    }
    Ok((root.join(checkpoint_name(index[0] as usize)), Some(root)))
}

/// All ranks learn whether every rank's `local` step succeeded; returns this rank's error, or an error
/// naming the phase when another rank failed.
pub(crate) fn agree(acc: &Accelerator, phase: &str, dir: &Path, local: Result<()>) -> Result<()> {
    let group = (acc.world_size() > 1).then(|| acc.process_group());
    agree_over(group, phase, dir, local)
}

/// [`agree`] over `group` (`None`: one process, nothing to agree with).
fn agree_over(group: Option<&ProcessGroup>, phase: &str, dir: &Path, local: Result<()>) -> Result<()> {
    let Some(group) = group else { return local };
    let mut failed = [i32::from(local.is_err())];
    // A rank lost on the way fails the agreement itself: say which save and which phase it broke.
    group.all_reduce(&mut failed, ReduceOp::Max).map_err(|e| {
        checkpoint_err(dir, format!("a rank was lost while {phase} the checkpoint, which is not committed: {e}"))
    })?;
    local?;
    if failed[0] != 0 {
        return Err(checkpoint_err(dir, format!("another rank failed while {phase} the checkpoint (see its log)")));
    }
    Ok(())
}

fn contents(acc: &Accelerator) -> Contents {
    let r = acc.prepared();
    Contents {
        models: r.models.len(),
        optimizers: r.optimizers.len(),
        schedulers: r.schedulers.len(),
        data_loaders: r.data_loaders.len(),
        custom: r.custom.len(),
        scaler: acc.grad_scaler().is_some(),
    }
}

/// Everything a checkpoint holds, copied out of the training state: this rank's own files (its RNG, its partial
/// gradients inside an accumulation window) and, on rank 0, the shared ones — the models' weights and the
/// optimizers' states as a single process would hold them (tp shards gathered), the scaler, schedulers, data-loader
/// positions, registered objects and `accelerator.json`.
struct Snapshot {
    rank: usize,
    random_states: serde_json::Value,
    gradients: Option<StateDict>,
    shared: Option<SharedFiles>,
}

/// Rank 0's part of a [`Snapshot`].
struct SharedFiles {
    models: Vec<BTreeMap<String, Tensor>>,
    optimizers: Vec<StateDict>,
    scaler: Option<StateDict>,
    schedulers: Vec<StateDict>,
    data_loaders: Vec<StateDict>,
    custom: Vec<StateDict>,
    meta: serde_json::Value,
}

impl Snapshot {
    /// Collective over each model's tp group when it has sharded parameters (every rank gathers; rank 0 keeps).
    /// `detach`: every tensor copied into storage of its own (a parameter or a moment shares its storage with the
    /// training state, which the next optimizer step overwrites in place).
    fn take(acc: &Accelerator, detach: bool) -> Result<Self> {
        let own = |t: Tensor| if detach { t.copy() } else { Ok(t) };
        let own_dict = |sd: StateDict| -> Result<StateDict> {
            let tensors = sd.tensors.into_iter().map(|(n, t)| Ok((n, own(t)?))).collect::<Result<_>>()?;
            Ok(StateDict { tensors, meta: sd.meta })
        };
        let prepared = acc.prepared();
        let models: Vec<BTreeMap<String, Tensor>> =
            prepared.models.iter().map(|m| m.checkpoint_state_dict()).collect::<Result<_>>()?;
        let optimizers: Vec<StateDict> = prepared
            .optimizers
            .iter()
            .map(|(opt, model)| {
                let sd = lock(opt).state_dict()?;
                model.optimizer_state_to_full(sd)
            })
            .collect::<Result<_>>()?;
        let states = RandomStates {
            rank: acc.rank(),
            world_size: acc.world_size(),
            accelerator_rng: RngState::capture(&acc.rng()),
        };
        let random_states = serde_json::to_value(&states).map_err(|e| AccelError::json("encoding the RNG state", e))?;
        // Inside an accumulation window each rank holds its own partial sums: without them the resume would differ.
        let gradients = acc.gradients_state_dict().map(own_dict).transpose()?;
        if !acc.is_main_process() {
            return Ok(Snapshot { rank: acc.rank(), random_states, gradients, shared: None });
        }
        let dicts = |objects: &[SharedStateful]| -> Result<Vec<StateDict>> {
            objects.iter().map(|o| own_dict(lock(o).state_dict()?)).collect()
        };
        let meta = CheckpointMeta {
            format: FORMAT.into(),
            version: FORMAT_VERSION,
            world_size: acc.world_size(),
            mixed_precision: acc.mixed_precision(),
            gradient_accumulation_steps: acc.gradient_accumulation_steps(),
            counters: acc.step_counters(),
            contents: contents(acc),
            mesh: Some(mesh_sizes(acc)),
        };
        let shared = SharedFiles {
            models: models
                .into_iter()
                .map(|m| m.into_iter().map(|(n, t)| Ok((n, own(t)?))).collect::<Result<_>>())
                .collect::<Result<_>>()?,
            optimizers: optimizers.into_iter().map(own_dict).collect::<Result<_>>()?,
            scaler: acc.grad_scaler().map(|s| lock(&s).state_dict()).transpose()?,
            schedulers: dicts(&prepared.schedulers)?,
            data_loaders: prepared.data_loaders.iter().map(|h| h.state_dict()).collect::<Result<_>>()?,
            custom: dicts(&prepared.custom)?,
            meta: serde_json::to_value(&meta).map_err(|e| AccelError::json("encoding accelerator.json", e))?,
        };
        Ok(Snapshot { rank: acc.rank(), random_states, gradients, shared: Some(shared) })
    }

    /// Writes the snapshot's files into `dir`; `accelerator.json` last (its presence marks the directory complete).
    fn write(&self, dir: &Path) -> Result<()> {
        write_json(&dir.join(format!("random_states_{}.json", self.rank)), &self.random_states)?;
        if let Some(sd) = &self.gradients {
            sd.save(dir, &format!("gradients_{}", self.rank))?;
        }
        let Some(shared) = &self.shared else { return Ok(()) };
        for (i, weights) in shared.models.iter().enumerate() {
            save_safetensors(weights, &dir.join(format!("{}.safetensors", stem("model", i))))?;
        }
        for (i, sd) in shared.optimizers.iter().enumerate() {
            sd.save(dir, &stem("optimizer", i))?;
        }
        if let Some(sd) = &shared.scaler {
            sd.save(dir, "scaler")?;
        }
        for (i, sd) in shared.schedulers.iter().enumerate() {
            sd.save(dir, &stem("scheduler", i))?;
        }
        for (i, sd) in shared.data_loaders.iter().enumerate() {
            sd.save(dir, &stem("data_loader", i))?;
        }
        for (i, sd) in shared.custom.iter().enumerate() {
            sd.save(dir, &format!("custom_checkpoint_{i}"))?;
        }
        write_json(&dir.join(ACCELERATOR_FILE), &shared.meta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AcceleratorConfig, AdamW, AdamWConfig};

    /// Values of every tensor of a snapshot's shared files, by file and name.
    fn values(s: &Snapshot) -> Vec<Vec<f32>> {
        let shared = s.shared.as_ref().expect("rank 0's files");
        let dicts = shared.optimizers.iter().map(|sd| &sd.tensors);
        shared
            .models
            .iter()
            .chain(dicts)
            .flat_map(|m| m.values())
            .map(|t| t.flatten_all().and_then(|t| t.to_vec1::<f32>()).unwrap())
            .collect()
    }

    /// A detached snapshot (what a background save writes) keeps the state at the save while optimizer steps
    /// overwrite the weights and AdamW's moments in place; an attached one (what a synchronous save, which writes
    /// before training goes on, takes) shares their storage.
    #[test]
    fn a_detached_snapshot_keeps_the_state_at_the_save() {
        let acc =
            Accelerator::with_process_group(AcceleratorConfig::default(), ProcessGroup::single_process().unwrap())
                .unwrap();
        let varmap = candle_nn::VarMap::new();
        let layer = candle_nn::linear(8, 4, acc.var_builder(&varmap).pp("fc")).unwrap();
        let prepared = acc.prepare_model(&varmap).unwrap();
        let mut opt = acc.prepare_optimizer(&prepared, AdamW::new(AdamWConfig::new(0.1)).unwrap()).unwrap();
        let step = |opt: &mut crate::AcceleratedOptimizer<AdamW>| {
            let x = Tensor::ones((2, 8), candle_core::DType::F32, acc.device()).unwrap();
            let loss = candle_core::Module::forward(&layer, &x).unwrap().sqr().unwrap().mean_all().unwrap();
            acc.backward(&loss).unwrap();
            opt.step().unwrap();
        };
        step(&mut opt);
        let (detached, attached) = (Snapshot::take(&acc, true).unwrap(), Snapshot::take(&acc, false).unwrap());
        let at_save = values(&detached);
        assert_eq!(values(&attached), at_save);
        step(&mut opt);
        assert_eq!(values(&detached), at_save, "the detached snapshot moved with the training state");
        assert_ne!(values(&attached), at_save, "in place: the attached snapshot shares the training state's storage");
    }
}
