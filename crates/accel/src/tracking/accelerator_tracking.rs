//! `Accelerator::init_trackers`, `log` and `end_training` (Accelerate's tracking API), main process only.

use super::{Tracker, TrackerKind};
use crate::{AccelError, Accelerator, Result};
use std::path::{Path, PathBuf};

/// The trackers of one Accelerator, kept in its extension slots.
#[derive(Default)]
struct TrackerSlot {
    /// Directory the trackers write into (`logging_dir/project`); `None` before `init_trackers`.
    dir: Option<PathBuf>,
    trackers: Vec<Box<dyn Tracker>>,
}

impl Accelerator {
    /// Starts the trackers of `kinds`, writing into `logging_dir/project/` (created when missing).
    ///
    /// Only the main process creates files; on other ranks this records nothing and [`Accelerator::log`] is a
    /// no-op, so training code calls it unconditionally. Calling it again finishes the previous trackers first.
    /// Errors: `project` empty or containing a path separator, directory or file creation failures (naming the
    /// path).
    pub fn init_trackers(&self, project: &str, kinds: &[TrackerKind], logging_dir: &Path) -> Result<()> {
        if project.is_empty() || project.contains(['/', '\\']) || project == "." || project == ".." {
            return Err(AccelError::InvalidArgument(format!(
                "init_trackers: project name {project:?} must be a non-empty directory name without path separators"
            )));
        }
        self.end_training()?;
        if !self.is_main_process() {
            return Ok(());
        }
        let dir = logging_dir.join(project);
        let mut trackers = Vec::with_capacity(kinds.len());
        let mut seen = Vec::new();
        for &kind in kinds {
            if seen.contains(&kind) {
                continue;
            }
            seen.push(kind);
            trackers.push(kind.create(&dir)?);
        }
        self.with_extension(|slot: &mut TrackerSlot| {
            slot.dir = Some(dir);
            slot.trackers = trackers;
        });
        Ok(())
    }

    /// Logs scalar `values` at `step` to every tracker (main process only; elsewhere, and before
    /// `init_trackers`, a no-op). `step` is usually [`Accelerator::optimizer_step_count`] or the trainer's global
    /// step. Errors name the file that could not be written.
    pub fn log(&self, values: &[(&str, f64)], step: u64) -> Result<()> {
        if !self.is_main_process() {
            return Ok(());
        }
        self.with_extension(|slot: &mut TrackerSlot| slot.trackers.iter_mut().try_for_each(|t| t.log(values, step)))
    }

    /// Flushes and closes every tracker (Accelerate's `end_training`). Safe to call more than once.
    pub fn end_training(&self) -> Result<()> {
        let trackers = self.with_extension(|slot: &mut TrackerSlot| {
            slot.dir = None;
            std::mem::take(&mut slot.trackers)
        });
        let mut first_error = None;
        for mut t in trackers {
            if let Err(e) = t.finish() {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The directory the trackers write into (`logging_dir/project`), when `init_trackers` ran on this process.
    pub fn tracker_dir(&self) -> Option<PathBuf> {
        self.with_extension(|slot: &mut TrackerSlot| slot.dir.clone())
    }
}
