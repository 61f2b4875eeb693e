//! [`Trackers`]: the trackers of one Accelerator, behind `Accelerator::init_trackers`, `log` and `end_training`
//! (Accelerate's tracking API), main process only.

use super::{Tracker, TrackerKind};
use crate::{AccelError, Result};
use std::path::{Path, PathBuf};

/// The trackers of one Accelerator (its `trackers` field).
#[derive(Default)]
pub(crate) struct Trackers {
    /// Directory the trackers write into (`logging_dir/project`); `None` before `init_trackers`.
    dir: Option<PathBuf>,
    trackers: Vec<Box<dyn Tracker>>,
}

impl Trackers {
    /// Starts the trackers of `kinds` in `logging_dir/project/` on the main process (see
    /// `Accelerator::init_trackers`); finishes previous ones first.
    pub(crate) fn init(&mut self, main: bool, project: &str, kinds: &[TrackerKind], logging_dir: &Path) -> Result<()> {
        if project.is_empty() || project.contains(['/', '\\']) || project == "." || project == ".." {
            return Err(AccelError::InvalidArgument(format!(
                "init_trackers: project name {project:?} must be a non-empty directory name without path separators"
            )));
        }
        self.finish()?;
        if !main {
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
        self.dir = Some(dir);
        self.trackers = trackers;
        Ok(())
    }

    /// Logs `values` at `step` to every tracker (none on other ranks or before `init`).
    pub(crate) fn log(&mut self, values: &[(&str, f64)], step: u64) -> Result<()> {
        self.trackers.iter_mut().try_for_each(|t| t.log(values, step))
    }

    /// Flushes and closes every tracker; safe to call more than once.
    pub(crate) fn finish(&mut self) -> Result<()> {
        self.dir = None;
        let mut first_error = None;
        for mut t in std::mem::take(&mut self.trackers) {
            if let Err(e) = t.finish() {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// `logging_dir/project` after `init` on the main process.
    pub(crate) fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }
}
