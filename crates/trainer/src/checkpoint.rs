//! Trainer checkpoints: `output_dir/checkpoint-{global_step}/` directories, finding the newest one, and
//! `save_total_limit` rotation that never deletes the best checkpoint (HF's `_sorted_checkpoints` /
//! `_rotate_checkpoints`).
//!
//! A checkpoint directory holds what `Accelerator::save_state` writes (model, optimizer, scheduler, scaler,
//! data-loader position, per-rank RNG; itself written to a temporary directory and renamed) plus
//! `trainer_state.json`, written last and atomically. A directory without `trainer_state.json` is an
//! interrupted save: it is never resumed from ("latest" skips it) and rotation deletes it like any other old one.
//!
//! Layout: a checkpoint records the global batch of one optimizer step and the optimizer steps per epoch
//! ([`TrainerState::global_batch_size`], [`TrainerState::steps_per_epoch`]); a resume at any number of processes,
//! per-device batch, accumulation or tp/pp layout that keeps both finds the same place in the data
//! ([`check_compatible`], which refuses anything else naming the per-device batch that keeps it). Everything a
//! Trainer checkpoint holds is layout-free: it is taken at an optimizer step (never inside an accumulation window,
//! so no rank holds partial gradients), the weights and optimizer state are whole, the loss tallies are shared
//! out over the new ranks, the Accelerator derives each rank's RNG, and the Accelerator's loader takes a position
//! saved for another micro-batch as the same number of samples of the epoch's order.
//!
//! Integrity: `checksums.json` lists the sha256 of every other file of the checkpoint; it is written just before
//! `trainer_state.json` (whose digest it already holds), so a complete checkpoint always has it.
//! [`verify_checksums`] checks it before anything is loaded: a truncated or flipped weight file is an error naming
//! the file, never a silent resume.
//!
//! Ownership of an output directory (the lock, and the refusal of another run's files) is [`crate::output_dir`]'s;
//! its items are re-exported here, where they used to live.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Result, TrainerError};
use crate::state::{TrainerState, TRAINER_STATE_NAME};

/// Prefix of checkpoint directory names (HF's `PREFIX_CHECKPOINT_DIR`).
pub const CHECKPOINT_PREFIX: &str = "checkpoint";

/// `output_dir/checkpoint-{global_step}`.
pub fn checkpoint_dir(output_dir: &Path, global_step: u64) -> PathBuf {
    output_dir.join(format!("{CHECKPOINT_PREFIX}-{global_step}"))
}

/// The global step in a checkpoint directory's name (`checkpoint-120` → 120).
pub fn step_of(dir: &Path) -> Option<u64> {
    dir.file_name()?.to_str()?.strip_prefix(&format!("{CHECKPOINT_PREFIX}-"))?.parse().ok()
}

/// Whether `dir` is a complete checkpoint (its `trainer_state.json` exists).
pub fn is_complete(dir: &Path) -> bool {
    dir.join(TRAINER_STATE_NAME).is_file()
}

/// Every `checkpoint-N` directory under `output_dir` in increasing step order, with the best one (if among them)
/// moved to the second-to-last place so rotation, which deletes from the front, reaches it last (HF's
/// `_sorted_checkpoints`).
pub fn sorted_checkpoints(output_dir: &Path, best: Option<&Path>) -> Result<Vec<PathBuf>> {
    let mut found: Vec<(u64, PathBuf)> = Vec::new();
    let entries = match std::fs::read_dir(output_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(TrainerError::io(format!("listing {}", output_dir.display()), e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| TrainerError::io(format!("listing {}", output_dir.display()), e))?;
        let path = entry.path();
        if path.is_dir() {
            if let Some(step) = step_of(&path) {
                found.push((step, path));
            }
        }
    }
    found.sort();
    let mut sorted: Vec<PathBuf> = found.into_iter().map(|(_, p)| p).collect();
    if let Some(best) = best {
        if let Some(i) = sorted.iter().position(|p| same_dir(p, best)) {
            // Bubble the best towards the end, stopping before the newest (HF's loop to len - 2).
            for j in i..sorted.len().saturating_sub(2) {
                sorted.swap(j, j + 1);
            }
        }
    }
    Ok(sorted)
}

fn same_dir(a: &Path, b: &Path) -> bool {
    a == b
        || (a.file_name() == b.file_name()
            && a.parent().map(std::fs::canonicalize).and_then(|r| r.ok())
                == b.parent().map(std::fs::canonicalize).and_then(|r| r.ok()))
}

/// The newest complete checkpoint under `output_dir` (highest step with a `trainer_state.json`), if any.
pub fn latest_checkpoint(output_dir: &Path) -> Result<Option<PathBuf>> {
    Ok(sorted_checkpoints(output_dir, None)?.into_iter().rev().find(|p| is_complete(p)))
}

/// Deletes the oldest checkpoints beyond `limit`, never the best (HF's `_rotate_checkpoints`): with limit 1 and
/// a best checkpoint that is not the newest, two are kept (the best and the newest, so training can resume).
/// Returns the deleted directories. Call on the main process only.
pub fn rotate_checkpoints(output_dir: &Path, limit: Option<usize>, best: Option<&Path>) -> Result<Vec<PathBuf>> {
    let Some(limit) = limit.filter(|l| *l > 0) else { return Ok(Vec::new()) };
    let sorted = sorted_checkpoints(output_dir, best)?;
    if sorted.len() <= limit {
        return Ok(Vec::new());
    }
    let mut keep = limit;
    if let (Some(best), Some(newest)) = (best, sorted.last()) {
        if limit == 1 && !same_dir(newest, best) {
            keep = 2;
        }
    }
    let n_delete = sorted.len().saturating_sub(keep);
    let doomed: Vec<PathBuf> = sorted.into_iter().take(n_delete).collect();
    for dir in &doomed {
        std::fs::remove_dir_all(dir)
            .map_err(|e| TrainerError::io(format!("deleting old checkpoint {}", dir.display()), e))?;
    }
    Ok(doomed)
}

/// Resolves `resume_from_checkpoint` ("latest"/"true" or a path) to a complete checkpoint directory.
/// Errors: "latest" with no checkpoint under `output_dir`; a path that is not a directory or has no
/// `trainer_state.json`.
pub fn resolve_resume(spec: &str, output_dir: &Path) -> Result<PathBuf> {
    if matches!(spec.trim(), "latest" | "true" | "True") {
        return latest_checkpoint(output_dir)?.ok_or_else(|| {
            TrainerError::checkpoint(
                output_dir,
                "resume_from_checkpoint is \"latest\" but there is no complete checkpoint-N directory here; \
                 train without resuming first, or pass the checkpoint's path",
            )
        });
    }
    let dir = PathBuf::from(spec);
    if !dir.is_dir() {
        return Err(TrainerError::checkpoint(&dir, "resume_from_checkpoint: no such directory"));
    }
    if !is_complete(&dir) {
        return Err(TrainerError::checkpoint(
            &dir,
            format!("has no {TRAINER_STATE_NAME}: the save was interrupted or this is not a trainer checkpoint"),
        ));
    }
    Ok(dir)
}

/// The layout of the run that resumes, as [`check_compatible`] compares it with a checkpoint's [`TrainerState`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunLayout {
    /// Processes in the job.
    pub world_size: usize,
    /// Data-parallel processes (`Accelerator::data_parallel_size`: tensor- and pipeline-parallel peers read the
    /// same batch, so they do not count).
    pub data_parallel_size: usize,
    /// Samples of one micro-batch on each data-parallel process.
    pub per_device_batch: usize,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Optimizer steps per epoch.
    pub steps_per_epoch: u64,
    /// `split_batches`: `per_device_train_batch_size` then names the micro-batch of all data-parallel processes,
    /// and the messages suggest a value of it in that sense.
    pub split_batches: bool,
}

impl RunLayout {
    /// Samples of one optimizer step over all processes: per-device batch × data-parallel size × accumulation.
    pub fn global_batch(&self) -> u64 {
        (self.per_device_batch * self.data_parallel_size * self.gradient_accumulation_steps) as u64
    }

    /// The `per_device_train_batch_size` that gives `per_device` samples per data-parallel process here.
    fn per_device_flag(&self, per_device: u64) -> u64 {
        if self.split_batches {
            per_device * self.data_parallel_size as u64
        } else {
            per_device
        }
    }
}

/// `8 per device × 2 data-parallel processes × GA 2`.
fn breakdown(per_device: u64, dp: u64, ga: u64) -> String {
    let processes = if dp == 1 { "process" } else { "processes" };
    format!("{per_device} per device × {dp} data-parallel {processes} × GA {ga}")
}

/// How the checkpoint's global batch was made up, when it recorded its data-parallel size and accumulation.
fn saved_breakdown(state: &TrainerState) -> Option<String> {
    let (global, dp, ga) = (state.global_batch_size?, state.data_parallel_size?, state.gradient_accumulation_steps?);
    (dp > 0 && ga > 0 && global.is_multiple_of(dp * ga)).then(|| breakdown(global / (dp * ga), dp, ga))
}

/// Refuses to resume a checkpoint when its global step would be another place in the data here, naming the
/// fix; the resume arithmetic (`global_step / steps_per_epoch` epochs done, then `(global_step % steps_per_epoch)
/// · GA` micro-batches) then finds the samples the checkpoint had reached.
///
/// - A checkpoint that records its global batch ([`TrainerState::global_batch_size`]) resumes at any number of
///   processes, per-device batch, accumulation and tp/pp layout that keep the global batch of one optimizer step
///   and the optimizer steps per epoch: the loader cuts every epoch's order into the same global steps.
/// - One written before that field existed resumes at its world size and gradient accumulation only (as then).
pub fn check_compatible(dir: &Path, state: &TrainerState, here: &RunLayout) -> Result<()> {
    let Some(saved) = state.global_batch_size else {
        return check_same_world_and_accumulation(dir, state, here.world_size, here.gradient_accumulation_steps);
    };
    let (dp, ga, per_device) =
        (here.data_parallel_size as u64, here.gradient_accumulation_steps as u64, here.per_device_batch as u64);
    let global = here.global_batch();
    let written = saved_breakdown(state).map(|b| format!(" ({b})")).unwrap_or_default();
    if saved != global {
        let mut ways = Vec::new();
        if dp * ga > 0 && saved.is_multiple_of(dp * ga) {
            ways.push(format!("--per-device-train-batch-size {}", here.per_device_flag(saved / (dp * ga))));
        }
        if per_device * dp > 0 && saved.is_multiple_of(per_device * dp) {
            ways.push(format!("--gradient-accumulation-steps {}", saved / (per_device * dp)));
        }
        let fix = match ways.as_slice() {
            [] => format!(
                "No per-device batch or accumulation alone keeps it with {dp} data-parallel {}: choose the \
                 data-parallel processes, the per-device batch and gradient_accumulation_steps so that their \
                 product is {saved}",
                if dp == 1 { "process" } else { "processes" }
            ),
            [one] => format!("To keep it, use {one} on this layout"),
            [one, other, ..] => format!("To keep it, use {one} on this layout (or {other})"),
        };
        return Err(TrainerError::checkpoint(
            dir,
            format!(
                "was written with a global batch of {saved} samples per optimizer step{written}; this run's is \
                 {global} ({}): the same global step would be another place in the data. {fix}; or start a \
                 new run in another output_dir",
                breakdown(per_device, dp, ga)
            ),
        ));
    }
    if let Some(saved_upe) = state.steps_per_epoch.filter(|u| *u != here.steps_per_epoch) {
        // The same global batch cut into other epochs: drop_last drops another tail when the micro-batch of all
        // processes changes (whole micro-batches are dropped), or the data set changed.
        let micro = state.gradient_accumulation_steps.filter(|g| *g > 0 && saved.is_multiple_of(*g)).map(|g| {
            let m = saved / g;
            let flags = match dp > 0 && m.is_multiple_of(dp) {
                true => format!(
                    "--per-device-train-batch-size {} --gradient-accumulation-steps {g} on this layout",
                    here.per_device_flag(m / dp)
                ),
                false => format!("gradient_accumulation_steps {g}, per-device batch × data-parallel processes = {m}"),
            };
            format!("Keep the checkpoint's micro-batch of all processes, {m} samples ({flags}), or start")
        });
        return Err(TrainerError::checkpoint(
            dir,
            format!(
                "was written with the same global batch, {saved} samples per optimizer step{written}, but {saved_upe} \
                 optimizer steps per epoch; this run's epochs have {}: the epochs are cut into steps \
                 differently (another data set, or dataloader_drop_last dropping another tail when the micro-batch \
                 of all processes changes), so the same global step would be another place in the data. {} a new \
                 run in another output_dir",
                here.steps_per_epoch,
                micro.unwrap_or_else(|| "Start".into())
            ),
        ));
    }
    Ok(())
}

/// The rule for a checkpoint without a recorded global batch: the same world size and gradient accumulation.
fn check_same_world_and_accumulation(
    dir: &Path,
    state: &TrainerState,
    world_size: usize,
    grad_accum: usize,
) -> Result<()> {
    if let Some(ws) = state.world_size {
        if ws != world_size as u64 {
            return Err(TrainerError::checkpoint(
                dir,
                format!(
                    "was written by {ws} processes but this run has {world_size}; resume with {ws} processes \
                     (e.g. `--nproc {ws}`), or start a new run in another output_dir"
                ),
            ));
        }
    }
    if let Some(ga) = state.gradient_accumulation_steps {
        if ga != grad_accum as u64 {
            return Err(TrainerError::checkpoint(
                dir,
                format!(
                    "was written with gradient_accumulation_steps {ga} but this run uses {grad_accum}; resume with \
                     --gradient-accumulation-steps {ga}"
                ),
            ));
        }
    }
    Ok(())
}

/// Name of the checksum index inside a checkpoint directory.
pub const CHECKSUMS_NAME: &str = "checksums.json";

/// `checksums.json`: the sha256 (lower-case hex) of each file of a checkpoint, by path relative to it.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct Checksums {
    /// Always "sha256".
    pub algorithm: String,
    /// Relative path (`/`-separated) → digest.
    pub files: BTreeMap<String, String>,
}

/// Lower-case hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn sha256_file(path: &Path) -> Result<String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| TrainerError::io(format!("reading {}", path.display()), e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| TrainerError::io(format!("reading {}", path.display()), e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Every regular file under `dir` (recursively), as `/`-separated relative paths, sorted.
fn files_under(dir: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let abs = dir.join(&rel);
        let entries = std::fs::read_dir(&abs).map_err(|e| TrainerError::io(format!("listing {}", abs.display()), e))?;
        for entry in entries {
            let entry = entry.map_err(|e| TrainerError::io(format!("listing {}", abs.display()), e))?;
            let r = rel.join(entry.file_name());
            let ft = entry.file_type().map_err(|e| TrainerError::io(format!("listing {}", abs.display()), e))?;
            if ft.is_dir() {
                stack.push(r);
            } else if ft.is_file() {
                out.push(r.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Writes `dir/checksums.json` (atomically) with the sha256 of every file now in `dir` (except the index itself)
/// plus `extra` files given by content that are written afterwards (`trainer_state.json`). Main process only.
pub fn write_checksums(dir: &Path, extra: &[(&str, &[u8])]) -> Result<()> {
    let mut files = BTreeMap::new();
    for rel in files_under(dir)? {
        if rel != CHECKSUMS_NAME && !rel.ends_with(".tmp") {
            files.insert(rel.clone(), sha256_file(&dir.join(&rel))?);
        }
    }
    for (name, bytes) in extra {
        files.insert((*name).to_string(), sha256_hex(bytes));
    }
    let index = Checksums { algorithm: "sha256".into(), files };
    let text = serde_json::to_string_pretty(&index).map_err(|e| TrainerError::json("encoding checksums", e))?;
    Ok(accel::state::write_atomic(&dir.join(CHECKSUMS_NAME), text)?)
}

/// Checks every file listed in `dir/checksums.json`. Errors (naming the file): a listed file missing, or its
/// content not matching (truncated, flipped bytes, replaced). A checkpoint written before checksums existed
/// (no index) is accepted with a warning.
pub fn verify_checksums(dir: &Path) -> Result<()> {
    let path = dir.join(CHECKSUMS_NAME);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::warn!(
                "checkpoint {} has no {CHECKSUMS_NAME} (older format): its files are not verified",
                dir.display()
            );
            return Ok(());
        }
        Err(e) => return Err(TrainerError::io(format!("reading {}", path.display()), e)),
    };
    let index: Checksums =
        serde_json::from_str(&text).map_err(|e| TrainerError::json(format!("parsing {}", path.display()), e))?;
    if index.algorithm != "sha256" {
        return Err(TrainerError::checkpoint(
            dir,
            format!("{CHECKSUMS_NAME} uses {:?}; this version verifies sha256 only", index.algorithm),
        ));
    }
    for (rel, expected) in &index.files {
        let file = dir.join(rel);
        if !file.is_file() {
            return Err(TrainerError::checkpoint(
                dir,
                format!(
                    "{rel} is listed in {CHECKSUMS_NAME} but missing: the checkpoint is incomplete; resume from \
                         another checkpoint-N"
                ),
            ));
        }
        let actual = sha256_file(&file)?;
        if &actual != expected {
            return Err(TrainerError::checkpoint(
                dir,
                format!(
                    "{rel} is damaged: its sha256 is {actual} but {CHECKSUMS_NAME} recorded {expected} at save time \
                     (truncated or modified since); resume from another checkpoint-N or restore the file"
                ),
            ));
        }
    }
    Ok(())
}

// Ownership of an output directory moved to `crate::output_dir`; kept at its old paths.
pub use crate::output_dir::{check_output_dir, host_name, lock_output_dir, LockInfo, OutputDirLock, LOCK_NAME};

#[cfg(test)]
mod tests {
    use super::*;

    fn make(out: &Path, steps: &[u64]) {
        for s in steps {
            let d = checkpoint_dir(out, *s);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join(TRAINER_STATE_NAME), "{}").unwrap();
        }
    }

    fn remaining(out: &Path) -> Vec<u64> {
        sorted_checkpoints(out, None).unwrap().iter().filter_map(|p| step_of(p)).collect()
    }

    #[test]
    fn rotation_keeps_best_and_newest_for_limits_1_2_3() {
        for (limit, best, expected) in [
            (1, Some(20), vec![20, 50]), // limit 1 but best != newest: keep both
            (1, Some(50), vec![50]),     // best is the newest
            (1, None, vec![50]),
            (2, Some(10), vec![10, 50]), // oldest is best: survives with the newest
            (2, Some(30), vec![30, 50]),
            (2, None, vec![40, 50]),
            (3, Some(10), vec![10, 40, 50]),
            (3, Some(40), vec![30, 40, 50]),
            (3, None, vec![30, 40, 50]),
        ] {
            let dir = tempfile::tempdir().unwrap();
            make(dir.path(), &[10, 20, 30, 40, 50]);
            let best_dir = best.map(|b| checkpoint_dir(dir.path(), b));
            rotate_checkpoints(dir.path(), Some(limit), best_dir.as_deref()).unwrap();
            assert_eq!(remaining(dir.path()), expected, "limit {limit}, best {best:?}");
        }
    }

    #[test]
    fn numeric_order_latest_and_incomplete_dirs() {
        let dir = tempfile::tempdir().unwrap();
        make(dir.path(), &[9, 100, 20]);
        std::fs::create_dir_all(checkpoint_dir(dir.path(), 200)).unwrap(); // interrupted: no trainer_state.json
        std::fs::create_dir_all(dir.path().join("checkpoint-x")).unwrap();
        assert_eq!(remaining(dir.path()), vec![9, 20, 100, 200]);
        assert_eq!(latest_checkpoint(dir.path()).unwrap(), Some(checkpoint_dir(dir.path(), 100)));
        assert_eq!(resolve_resume("latest", dir.path()).unwrap(), checkpoint_dir(dir.path(), 100));
        let e = resolve_resume(checkpoint_dir(dir.path(), 200).to_str().unwrap(), dir.path()).unwrap_err();
        assert!(e.to_string().contains("trainer_state.json"), "{e}");
        let empty = tempfile::tempdir().unwrap();
        let e = resolve_resume("latest", empty.path()).unwrap_err().to_string();
        assert!(e.contains("no complete checkpoint"), "{e}");
        assert_eq!(rotate_checkpoints(dir.path(), None, None).unwrap(), Vec::<PathBuf>::new());
    }

    fn layout(world: usize, dp: usize, per_device: usize, ga: usize, upe: u64) -> RunLayout {
        RunLayout {
            world_size: world,
            data_parallel_size: dp,
            per_device_batch: per_device,
            gradient_accumulation_steps: ga,
            steps_per_epoch: upe,
            split_batches: false,
        }
    }

    #[test]
    fn a_checkpoint_without_a_global_batch_resumes_at_its_world_size_and_accumulation_only() {
        let st = TrainerState { world_size: Some(2), gradient_accumulation_steps: Some(1), ..Default::default() };
        let e = check_compatible(Path::new("out/checkpoint-5"), &st, &layout(4, 4, 4, 1, 6)).unwrap_err().to_string();
        assert!(e.contains("2 processes") && e.contains("has 4") && e.contains("--nproc 2"), "{e}");
        check_compatible(Path::new("x"), &st, &layout(2, 2, 8, 1, 6)).unwrap();
        let e = check_compatible(Path::new("x"), &st, &layout(2, 2, 8, 3, 2)).unwrap_err().to_string();
        assert!(e.contains("gradient_accumulation_steps 1"), "{e}");
    }

    #[test]
    fn the_same_global_batch_resumes_at_any_layout_another_is_refused_naming_the_fix() {
        // 8 per device × 2 data-parallel processes × GA 2 = 32 samples per step, 6 steps per epoch.
        let st = TrainerState {
            world_size: Some(4), // tp 2: four processes, two of them data parallel
            data_parallel_size: Some(2),
            gradient_accumulation_steps: Some(2),
            global_batch_size: Some(32),
            steps_per_epoch: Some(6),
            ..Default::default()
        };
        let dir = Path::new("out/checkpoint-5");
        for here in [layout(1, 1, 32, 1, 6), layout(1, 1, 8, 4, 6), layout(4, 4, 4, 2, 6), layout(8, 2, 16, 1, 6)] {
            check_compatible(dir, &st, &here).unwrap_or_else(|e| panic!("{here:?}: {e}"));
        }
        let e = check_compatible(dir, &st, &layout(1, 1, 8, 2, 6)).unwrap_err().to_string();
        assert!(
            e.contains(
                "global batch of 32 samples per optimizer step (8 per device × 2 data-parallel processes × GA 2)"
            ) && e.contains("this run's is 16 (8 per device × 1 data-parallel process × GA 2)")
                && e.contains(
                    "use --per-device-train-batch-size 16 on this layout (or --gradient-accumulation-steps 4)"
                ),
            "{e}"
        );
        // Only the accumulation can keep it (32 / (3 · 2) is no whole batch) — or nothing can.
        let e = check_compatible(dir, &st, &layout(3, 3, 2, 2, 6)).unwrap_err().to_string();
        assert!(e.contains("No per-device batch or accumulation alone keeps it with 3 data-parallel processes"), "{e}");
        let e = check_compatible(dir, &st, &layout(2, 2, 4, 1, 6)).unwrap_err().to_string();
        assert!(e.contains("use --per-device-train-batch-size 16 on this layout (or --gradient-accumulation-steps 4)"));
        // split_batches: the flag is the micro-batch of all processes.
        let split = RunLayout { split_batches: true, ..layout(2, 2, 4, 1, 6) };
        let e = check_compatible(dir, &st, &split).unwrap_err().to_string();
        assert!(e.contains("use --per-device-train-batch-size 32 on this layout"), "{e}");
        // The same global batch cut into other epochs (drop_last with another micro-batch).
        let e = check_compatible(dir, &st, &layout(1, 1, 8, 4, 7)).unwrap_err().to_string();
        assert!(
            e.contains("32 samples per optimizer step (8 per device × 2 data-parallel processes × GA 2), but 6")
                && e.contains("6 optimizer steps per epoch; this run's epochs have 7")
                && e.contains(
                    "micro-batch of all processes, 16 samples (--per-device-train-batch-size 16 \
                     --gradient-accumulation-steps 2 on this layout)"
                ),
            "{e}"
        );
    }
}
