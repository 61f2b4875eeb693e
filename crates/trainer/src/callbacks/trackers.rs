//! [`TrackersCallback`]: sends every log entry to the Accelerator's experiment trackers (JSONL, TensorBoard),
//! which write on the main process only.

use std::path::PathBuf;

use accel::tracking::TrackerKind;
use accel::Accelerator;

use super::{CallbackContext, TrainerCallback, TrainerControl};
use crate::error::Result;
use crate::state::LogEntry;

/// Starts the trackers at `on_train_begin` (`Accelerator::init_trackers(project, kinds, logging_dir)`), logs each
/// entry's values plus `epoch` at its global step, and finishes them at `on_train_end`.
pub struct TrackersCallback {
    accelerator: Accelerator,
    project: String,
    kinds: Vec<TrackerKind>,
    logging_dir: PathBuf,
    started: bool,
}

impl TrackersCallback {
    /// Trackers of `kinds` writing under `logging_dir`, named `project`.
    pub fn new(accelerator: Accelerator, project: String, kinds: Vec<TrackerKind>, logging_dir: PathBuf) -> Self {
        TrackersCallback { accelerator, project, kinds, logging_dir, started: false }
    }
}

impl TrainerCallback for TrackersCallback {
    fn on_train_begin(&mut self, _ctx: &CallbackContext, _control: &mut TrainerControl) -> Result<()> {
        if !self.kinds.is_empty() && !self.started {
            self.accelerator.init_trackers(&self.project, &self.kinds, &self.logging_dir)?;
            self.started = true;
        }
        Ok(())
    }

    fn on_log(&mut self, _ctx: &CallbackContext, _control: &mut TrainerControl, logs: &LogEntry) -> Result<()> {
        if self.started {
            let mut values: Vec<(&str, f64)> = logs.values.iter().map(|(k, v)| (k.as_str(), *v)).collect();
            values.push(("epoch", logs.epoch));
            self.accelerator.log(&values, logs.step)?;
        }
        Ok(())
    }

    fn on_train_end(&mut self, _ctx: &CallbackContext, _control: &mut TrainerControl) -> Result<()> {
        if self.started {
            self.accelerator.end_training()?;
            self.started = false;
        }
        Ok(())
    }
}
