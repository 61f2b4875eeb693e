//! `Accelerator::save_state` / `load_state` / `register_for_checkpointing` (Accelerate's `save_state`,
//! `load_state`, `register_for_checkpointing`, with its `ProjectConfiguration` automatic naming).
//!
//! `save_state` is collective — every rank calls it. Protocol (see [`super::checkpoint_dir`] for atomicity):
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
use std::sync::{Arc, Mutex};

use ddp_core::ReduceOp;
use serde::{Deserialize, Serialize};

use super::checkpoint_dir::{
    checkpoint_name, commit, newest_checkpoint, next_checkpoint_index, partial_dir, remove_if_exists,
    rotate_checkpoints, CHECKPOINTS_SUBDIR,
};
use super::rng::RngState;
use super::state_dict::{load_safetensors, read_json, save_safetensors, write_json};
use super::{StateDict, Stateful};
use crate::accelerator::{lock, Accelerator, StepCounters};
use crate::error::{AccelError, Result};
use crate::MixedPrecision;

/// A checkpointed object shared between the training loop and the Accelerator.
pub type SharedStateful = Arc<Mutex<dyn Stateful + Send>>;

/// Objects registered with the Accelerator for checkpointing (kept in its extension slots).
#[derive(Default)]
struct CheckpointRegistry {
    schedulers: Vec<SharedStateful>,
    custom: Vec<SharedStateful>,
}

/// Identifies the directory format in `accelerator.json`.
const FORMAT: &str = "accel-checkpoint";
/// Bumped on incompatible layout changes.
const FORMAT_VERSION: u32 = 1;
/// The file every complete checkpoint has; its presence marks a directory as a checkpoint.
pub const ACCELERATOR_FILE: &str = "accelerator.json";

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

impl Accelerator {
    /// Adds `obj` to what [`Accelerator::save_state`] saves (as `custom_checkpoint_{i}.json` /
    /// `.safetensors`, `i` = registration order) and [`Accelerator::load_state`] restores. Register the same
    /// objects in the same order before loading.
    pub fn register_for_checkpointing(&self, obj: SharedStateful) {
        self.with_extension(|r: &mut CheckpointRegistry| r.custom.push(obj));
    }

    /// Adds a learning-rate scheduler to the checkpoint (`scheduler.json`, then `scheduler_1.json`, …), like a
    /// scheduler passed to Accelerate's `prepare`. A `Box<dyn LrScheduler>` works: wrap it as
    /// `Arc::new(Mutex::new(sched))` and pass a clone.
    pub fn register_scheduler(&self, sched: SharedStateful) {
        self.with_extension(|r: &mut CheckpointRegistry| r.schedulers.push(sched));
    }

    /// `project_dir/checkpoints`, where automatically named checkpoints go; `None` without a `project_dir`.
    pub fn checkpoints_dir(&self) -> Option<PathBuf> {
        self.config().project_dir.as_ref().map(|p| p.join(CHECKPOINTS_SUBDIR))
    }

    /// Saves the training state into `dir`, or with `None` into `project_dir/checkpoints/checkpoint_{i}` (needs
    /// `automatic_checkpoint_naming` and `project_dir`; the oldest automatic checkpoints beyond `total_limit` are
    /// then deleted). Collective: every rank must call it. Returns the checkpoint directory.
    ///
    /// Written: fp32 master weights (`model.safetensors`, names = `VarMap` names, readable by Python's
    /// `safetensors`), optimizer state, fp16 scaler, schedulers, data-loader positions, registered objects,
    /// step counters (`accelerator.json`, all by rank 0) and each rank's RNG state (`random_states_{rank}.json`).
    /// The directory appears under its final name only when complete (written as `.{name}.partial`, then
    /// renamed); an existing directory of that name is replaced.
    ///
    /// Differs from Accelerate on purpose: an explicit `dir` is honoured even with automatic naming on.
    ///
    /// Errors: I/O, a registered object failing to produce its state, another rank failing (the temporary
    /// directory is removed and any previous checkpoint is left intact).
    pub fn save_state(&self, dir: Option<&Path>) -> Result<PathBuf> {
        let main = self.is_main_process();
        if self.prepared_models().iter().any(|m| m.gradients().iter().any(Option::is_some)) {
            tracing::warn!(
                "save_state inside a gradient-accumulation window: the window's partial gradients are not saved; \
                 save right after the optimizer step for an exact resume"
            );
        }
        let (final_dir, automatic_root) = self.resolve_save_dir(dir)?;
        let partial = partial_dir(&final_dir);

        let prepared = if main { remove_if_exists(&partial).and_then(|()| create_dir(&partial)) } else { Ok(()) };
        self.agree("preparing", &final_dir, prepared)?;

        let written = create_dir(&partial).and_then(|()| self.write_random_states(&partial)).and_then(|()| {
            if main {
                self.write_shared_files(&partial)
            } else {
                Ok(())
            }
        });
        if let Err(e) = self.agree("writing", &final_dir, written) {
            if main {
                let _ = remove_if_exists(&partial);
            }
            return Err(e);
        }

        let committed = if main {
            commit(&partial, &final_dir).and_then(|()| match (&automatic_root, self.config().total_limit) {
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
        self.agree("committing", &final_dir, committed)?;
        // Ranks on another machine without a shared file system hold their own copy of the directory.
        if !main && partial.exists() {
            commit(&partial, &final_dir)?;
        }
        tracing::info!("saved checkpoint {}", final_dir.display());
        Ok(final_dir)
    }

    /// Restores the state saved by [`Accelerator::save_state`] from `dir`, or with `None` from the newest
    /// `project_dir/checkpoints/checkpoint_{i}`. Prepare the same models, optimizers and data loaders and register
    /// the same objects, in the same order, before calling it. Returns the directory loaded.
    ///
    /// Afterwards the step counters, the RNG and the data-loader positions continue where the checkpoint was
    /// taken: the next iteration of a prepared loader skips the batches already consumed in that epoch.
    ///
    /// Errors (all naming the checkpoint and the fix): no checkpoint found, missing files, a tensor missing or of
    /// another shape (named), a different world size, different numbers of prepared objects.
    pub fn load_state(&self, dir: Option<&Path>) -> Result<PathBuf> {
        let dir = match dir {
            Some(d) => d.to_path_buf(),
            None => {
                let root = self.checkpoints_dir().ok_or_else(|| {
                    AccelError::Usage(
                        "load_state(None) looks for the newest checkpoint under project_dir/checkpoints, but no \
                         project_dir is configured: set AcceleratorConfig::project_dir or pass a directory"
                            .into(),
                    )
                })?;
                newest_checkpoint(&root)?.ok_or_else(|| {
                    checkpoint_err(&root, "no checkpoint_{i} directory found; save one first or pass a directory")
                })?
            }
        };
        if !dir.is_dir() {
            return Err(checkpoint_err(&dir, "does not exist or is not a directory"));
        }
        let meta_path = dir.join(ACCELERATOR_FILE);
        if !meta_path.is_file() {
            return Err(checkpoint_err(
                &dir,
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
        if meta.world_size != self.world_size() {
            return Err(checkpoint_err(
                &dir,
                format!(
                    "written by {} processes but this job has {}; resume with the same number of processes \
                     (data-loader positions and per-rank RNG states depend on it)",
                    meta.world_size,
                    self.world_size()
                ),
            ));
        }
        if meta.gradient_accumulation_steps != self.gradient_accumulation_steps() {
            tracing::warn!(
                "checkpoint {} was written with gradient_accumulation_steps = {}, this run uses {}: the resumed run \
                 will not match the original",
                dir.display(),
                meta.gradient_accumulation_steps,
                self.gradient_accumulation_steps()
            );
        }
        let here = self.contents();
        let check = |what: &str, saved: usize, now: usize, how: &str| -> Result<()> {
            if saved != now {
                return Err(checkpoint_err(
                    &dir,
                    format!("holds {saved} {what} but this Accelerator has {now}; {how} before load_state"),
                ));
            }
            Ok(())
        };
        let c = meta.contents;
        check("models", c.models, here.models, "prepare the same models")?;
        check("optimizers", c.optimizers, here.optimizers, "prepare the same optimizers")?;
        check("schedulers", c.schedulers, here.schedulers, "register the same schedulers")?;
        check("data loaders", c.data_loaders, here.data_loaders, "prepare the same data loaders, in the same order")?;
        check("registered objects", c.custom, here.custom, "register_for_checkpointing the same objects")?;

        let device = self.device().clone();
        for (i, model) in self.prepared_models().iter().enumerate() {
            let file = dir.join(format!("{}.safetensors", stem("model", i)));
            if !file.is_file() {
                return Err(checkpoint_err(&dir, format!("missing {}", file.display())));
            }
            let weights = load_safetensors(&file, &device)?;
            model.load_state_dict(&weights).map_err(restoring(&file, "model weights"))?;
        }
        for (i, opt) in self.prepared_optimizers().iter().enumerate() {
            let s = stem("optimizer", i);
            let sd = StateDict::load(&dir, &s, &device)?;
            lock(opt).load_state_dict(&sd).map_err(restoring(&dir.join(format!("{s}.json")), "optimizer state"))?;
        }
        match (self.grad_scaler(), c.scaler) {
            (Some(scaler), true) => {
                let sd = StateDict::load(&dir, "scaler", &device)?;
                lock(&scaler).load_state_dict(&sd).map_err(restoring(&dir.join("scaler.json"), "fp16 loss scaler"))?;
            }
            (Some(_), false) => tracing::warn!(
                "checkpoint {} has no fp16 loss-scaler state (saved without fp16): starting from the initial scale",
                dir.display()
            ),
            (None, _) => {}
        }
        let registry = self.registry();
        for (i, sched) in registry.schedulers.iter().enumerate() {
            let s = stem("scheduler", i);
            let sd = StateDict::load(&dir, &s, &device)?;
            lock(sched).load_state_dict(&sd).map_err(restoring(&dir.join(format!("{s}.json")), "scheduler"))?;
        }
        for (i, mut handle) in self.prepared_data_loaders().into_iter().enumerate() {
            let s = stem("data_loader", i);
            let sd = StateDict::load(&dir, &s, &device)?;
            handle.load_state_dict(&sd).map_err(restoring(&dir.join(format!("{s}.json")), "data-loader position"))?;
        }
        for (i, obj) in registry.custom.iter().enumerate() {
            let s = format!("custom_checkpoint_{i}");
            let sd = StateDict::load(&dir, &s, &device)?;
            lock(obj).load_state_dict(&sd).map_err(restoring(&dir.join(format!("{s}.json")), "registered object"))?;
        }
        let rng_path = dir.join(format!("random_states_{}.json", self.rank()));
        if !rng_path.is_file() {
            return Err(checkpoint_err(
                &dir,
                format!("missing random_states_{}.json (this rank's RNG state)", self.rank()),
            ));
        }
        let states: RandomStates = serde_json::from_value(read_json(&rng_path)?)
            .map_err(|e| AccelError::json(format!("reading {}", rng_path.display()), e))?;
        *self.rng() = states.accelerator_rng.restore().map_err(restoring(&rng_path, "RNG state"))?;
        self.set_step_counters(meta.counters);
        self.gradient_state().reset();
        tracing::info!("loaded checkpoint {} (optimizer step {})", dir.display(), meta.counters.optimizer_steps);
        Ok(dir)
    }

    /// The final directory of a save, and the automatic-naming root when it applies.
    fn resolve_save_dir(&self, dir: Option<&Path>) -> Result<(PathBuf, Option<PathBuf>)> {
        if let Some(d) = dir {
            return Ok((d.to_path_buf(), None));
        }
        let cfg = self.config();
        let root = match (cfg.automatic_checkpoint_naming, self.checkpoints_dir()) {
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
        let mine = if self.is_main_process() { next_checkpoint_index(&root) } else { Ok(0) };
        let mut index = [mine.as_ref().map_or(-1, |&i| i as i64)];
        if self.world_size() > 1 {
            self.process_group().broadcast(&mut index, 0)?;
        }
        let _ = mine?;
        if index[0] < 0 {
            return Err(checkpoint_err(&root, "rank 0 could not list the existing checkpoints (see its log)"));
        }
        Ok((root.join(checkpoint_name(index[0] as usize)), Some(root)))
    }

    /// All ranks learn whether every rank's `local` step succeeded; returns this rank's error, or an error
    /// naming the phase when another rank failed.
    fn agree(&self, phase: &str, dir: &Path, local: Result<()>) -> Result<()> {
        if self.world_size() > 1 {
            let mut failed = [i32::from(local.is_err())];
            self.process_group().all_reduce(&mut failed, ReduceOp::Max)?;
            local?;
            if failed[0] != 0 {
                return Err(checkpoint_err(
                    dir,
                    format!("another rank failed while {phase} the checkpoint (see its log)"),
                ));
            }
            return Ok(());
        }
        local
    }

    fn registry(&self) -> CheckpointRegistry {
        self.with_extension(|r: &mut CheckpointRegistry| CheckpointRegistry {
            schedulers: r.schedulers.clone(),
            custom: r.custom.clone(),
        })
    }

    fn contents(&self) -> Contents {
        let r = self.registry();
        Contents {
            models: self.prepared_models().len(),
            optimizers: self.prepared_optimizers().len(),
            schedulers: r.schedulers.len(),
            data_loaders: self.prepared_data_loaders().len(),
            custom: r.custom.len(),
            scaler: self.grad_scaler().is_some(),
        }
    }

    fn write_random_states(&self, dir: &Path) -> Result<()> {
        let states = RandomStates {
            rank: self.rank(),
            world_size: self.world_size(),
            accelerator_rng: RngState::capture(&self.rng()),
        };
        let v = serde_json::to_value(&states).map_err(|e| AccelError::json("encoding the RNG state", e))?;
        write_json(&dir.join(format!("random_states_{}.json", self.rank())), &v)
    }

    /// Everything but the per-rank RNG files (rank 0 only).
    fn write_shared_files(&self, dir: &Path) -> Result<()> {
        for (i, model) in self.prepared_models().iter().enumerate() {
            save_safetensors(&model.state_dict(), &dir.join(format!("{}.safetensors", stem("model", i))))?;
        }
        for (i, opt) in self.prepared_optimizers().iter().enumerate() {
            let sd = lock(opt).state_dict()?;
            sd.save(dir, &stem("optimizer", i))?;
        }
        if let Some(scaler) = self.grad_scaler() {
            let sd = lock(&scaler).state_dict()?;
            sd.save(dir, "scaler")?;
        }
        let registry = self.registry();
        for (i, sched) in registry.schedulers.iter().enumerate() {
            let sd = lock(sched).state_dict()?;
            sd.save(dir, &stem("scheduler", i))?;
        }
        for (i, handle) in self.prepared_data_loaders().iter().enumerate() {
            handle.state_dict()?.save(dir, &stem("data_loader", i))?;
        }
        for (i, obj) in registry.custom.iter().enumerate() {
            let sd = lock(obj).state_dict()?;
            sd.save(dir, &format!("custom_checkpoint_{i}"))?;
        }
        let meta = CheckpointMeta {
            format: FORMAT.into(),
            version: FORMAT_VERSION,
            world_size: self.world_size(),
            mixed_precision: self.mixed_precision(),
            gradient_accumulation_steps: self.gradient_accumulation_steps(),
            counters: self.step_counters(),
            contents: self.contents(),
        };
        let v = serde_json::to_value(&meta).map_err(|e| AccelError::json("encoding accelerator.json", e))?;
        // Written last: its presence marks the directory as complete.
        write_json(&dir.join(ACCELERATOR_FILE), &v)
    }
}
