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

use std::path::{Path, PathBuf};

use candle_core::Device;
use ddp_core::ReduceOp;
use serde::{Deserialize, Serialize};

use crate::accelerator::Prepared;
use crate::error::{AccelError, Result};
use crate::state::checkpoint_dir::{
    checkpoint_name, commit, newest_checkpoint, next_checkpoint_index, partial_dir, remove_if_exists,
    rotate_checkpoints,
};
use crate::state::rng::RngState;
use crate::state::{load_safetensors, read_json, save_safetensors, write_json};
use crate::state::{StateDict, Stateful, ACCELERATOR_FILE};
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

fn create_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| AccelError::io(format!("creating checkpoint directory {}", dir.display()), e))
}

/// `Accelerator::save_state` (see the protocol in the module documentation).
pub(crate) fn save_state(acc: &Accelerator, dir: Option<&Path>) -> Result<PathBuf> {
    let main = acc.is_main_process();
    let (final_dir, automatic_root) = resolve_save_dir(acc, dir)?;
    let partial = partial_dir(&final_dir);

    let prepared = if main { remove_if_exists(&partial).and_then(|()| create_dir(&partial)) } else { Ok(()) };
    if let Err(e) = agree(acc, "preparing", &final_dir, prepared) {
        if main {
            let _ = remove_if_exists(&partial);
        }
        return Err(e);
    }

    // Under tensor parallelism the full tensors are gathered by every tp rank (collective); rank 0 writes them.
    let full = FullState::collect(acc);
    let written = create_dir(&partial).and_then(|()| write_random_states(acc, &partial)).and_then(|()| {
        if main {
            write_shared_files(acc, &partial, full?)
        } else {
            full.map(drop)
        }
    });
    if let Err(e) = agree(acc, "writing", &final_dir, written) {
        if main {
            let _ = remove_if_exists(&partial);
        }
        return Err(e);
    }

    let committed = if main {
        commit(&partial, &final_dir).and_then(|()| match (&automatic_root, acc.config().total_limit) {
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
    agree(acc, "committing", &final_dir, committed)?;
    // Ranks on another machine without a shared file system hold their own copy of the directory.
    if !main && partial.exists() {
        commit(&partial, &final_dir)?;
    }
    tracing::info!("saved checkpoint {}", final_dir.display());
    Ok(final_dir)
}

/// `Accelerator::load_state`: restores everything but the step counters, which it returns for the step
/// owner to restore.
pub(crate) fn load_state(acc: &Accelerator, dir: Option<&Path>) -> Result<(PathBuf, StepCounters, Option<StateDict>)> {
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
/// counted in global samples (it refuses another global batch itself), dropout masks are addressed by the
/// single-process coordinates; only each rank's `Accelerator::rng` is per rank, and it is derived anew
/// ([`restore_rng`]). A checkpoint taken inside an accumulation window holds each rank's partial gradients: it is
/// refused at another process count. Warns when the mesh layout or the gradient accumulation differs.
fn check_layout(acc: &Accelerator, dir: &Path, meta: &CheckpointMeta) -> Result<()> {
    if meta.world_size != acc.world_size() {
        if dir.join("gradients_0.json").is_file() {
            return Err(checkpoint_err(
                dir,
                format!(
                    "written by {} processes inside an accumulation window (each rank's partial gradients), but this \
                     job has {}; resume it with {} processes, or from a checkpoint taken at an optimizer step",
                    meta.world_size,
                    acc.world_size(),
                    meta.world_size
                ),
            ));
        }
        if acc.is_main_process() {
            tracing::warn!(
                "checkpoint {} was written by {} processes, this job has {}: the weights, the optimizer state, the \
                 step counters and the data position load as saved (the position is in global samples: keep the \
                 global batch), and each rank's Accelerator::rng is derived from (seed, rank, optimizer step) \
                 instead of restored",
                dir.display(),
                meta.world_size,
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
        // layout-free (the loader refuses a position whose global batch differs); only the per-rank RNG is not.
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
    // Once, and what it changes: with the global batch kept (a prepared data loader refuses a position saved at
    // another), each optimizer step sees the same samples in other micro-batches.
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
    if acc.world_size() > 1 {
        let mut failed = [i32::from(local.is_err())];
        // A rank lost on the way fails the agreement itself: say which save and which phase it broke.
        acc.process_group().all_reduce(&mut failed, ReduceOp::Max).map_err(|e| {
            checkpoint_err(dir, format!("a rank was lost while {phase} the checkpoint, which is not committed: {e}"))
        })?;
        local?;
        if failed[0] != 0 {
            return Err(checkpoint_err(dir, format!("another rank failed while {phase} the checkpoint (see its log)")));
        }
        return Ok(());
    }
    local
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

fn write_random_states(acc: &Accelerator, dir: &Path) -> Result<()> {
    let states =
        RandomStates { rank: acc.rank(), world_size: acc.world_size(), accelerator_rng: RngState::capture(&acc.rng()) };
    let v = serde_json::to_value(&states).map_err(|e| AccelError::json("encoding the RNG state", e))?;
    write_json(&dir.join(format!("random_states_{}.json", acc.rank())), &v)?;
    // Inside an accumulation window each rank holds its own partial sums: without them the resume would differ.
    if let Some(sd) = acc.gradients_state_dict() {
        sd.save(dir, &format!("gradients_{}", acc.rank()))?;
    }
    Ok(())
}

/// The models' weights and the optimizers' states as a single process would hold them (tp shards gathered).
struct FullState {
    models: Vec<std::collections::BTreeMap<String, candle_core::Tensor>>,
    optimizers: Vec<StateDict>,
}

impl FullState {
    /// Collective over each model's tp group when it has sharded parameters.
    fn collect(acc: &Accelerator) -> Result<Self> {
        let prepared = acc.prepared();
        let models = prepared.models.iter().map(|m| m.checkpoint_state_dict()).collect::<Result<_>>()?;
        let optimizers = prepared
            .optimizers
            .iter()
            .map(|(opt, model)| {
                let sd = lock(opt).state_dict()?;
                model.optimizer_state_to_full(sd)
            })
            .collect::<Result<_>>()?;
        Ok(FullState { models, optimizers })
    }
}

/// Everything but the per-rank RNG files (rank 0 only).
fn write_shared_files(acc: &Accelerator, dir: &Path, full: FullState) -> Result<()> {
    let prepared = acc.prepared();
    for (i, weights) in full.models.iter().enumerate() {
        save_safetensors(weights, &dir.join(format!("{}.safetensors", stem("model", i))))?;
    }
    for (i, sd) in full.optimizers.iter().enumerate() {
        sd.save(dir, &stem("optimizer", i))?;
    }
    if let Some(scaler) = acc.grad_scaler() {
        let sd = lock(&scaler).state_dict()?;
        sd.save(dir, "scaler")?;
    }
    for (i, sched) in prepared.schedulers.iter().enumerate() {
        let sd = lock(sched).state_dict()?;
        sd.save(dir, &stem("scheduler", i))?;
    }
    for (i, handle) in prepared.data_loaders.iter().enumerate() {
        handle.state_dict()?.save(dir, &stem("data_loader", i))?;
    }
    for (i, obj) in prepared.custom.iter().enumerate() {
        let sd = lock(obj).state_dict()?;
        sd.save(dir, &format!("custom_checkpoint_{i}"))?;
    }
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
    let v = serde_json::to_value(&meta).map_err(|e| AccelError::json("encoding accelerator.json", e))?;
    // Written last: its presence marks the directory as complete.
    write_json(&dir.join(ACCELERATOR_FILE), &v)
}
