//! Callbacks: code that observes the training loop at fixed events and steers it through a [`TrainerControl`]
//! (HF's `TrainerCallback` / `TrainerControl`).
//!
//! Events, in loop order: `on_train_begin`, then per epoch `on_epoch_begin`, per optimizer step `on_step_begin`
//! / `on_step_end`, `on_epoch_end`, and `on_train_end`; plus `on_log`, `on_evaluate` and `on_save` whenever the
//! trainer logs, evaluates or checkpoints. Callbacks run in registration order after the built-in
//! [`DefaultFlowCallback`], which sets `should_log` / `should_evaluate` / `should_save` / `should_training_stop`
//! from the arguments' strategies; a later callback may override what an earlier one decided.
//!
//! Every callback runs on every process. Decisions that change control flow (stop, save, evaluate) must be the
//! same on all ranks — the built-ins decide from values that are identical everywhere (global step, gathered
//! metrics) — or the ranks would stop issuing the same collectives.
//!
//! Built in: [`DefaultFlowCallback`], [`EarlyStoppingCallback`], [`ProgressCallback`] (indicatif bar, rank 0,
//! only on a terminal), [`PrinterCallback`] (log lines, rank 0), [`TrackersCallback`] (JSONL / TensorBoard via the
//! Accelerator's trackers).

mod early_stopping;
mod flow;
mod printer;
mod progress;
mod trackers;

pub use early_stopping::EarlyStoppingCallback;
pub use flow::DefaultFlowCallback;
pub use printer::PrinterCallback;
pub use progress::ConsoleWriter;
#[cfg(feature = "progress")]
#[cfg_attr(docsrs, doc(cfg(feature = "progress")))]
pub use progress::ProgressCallback;
pub use trackers::TrackersCallback;

use crate::args::TrainingArguments;
use crate::error::Result;
use crate::metrics::Metrics;
use crate::state::{CallbackState, LogEntry, TrainerState};

/// Flags callbacks set to steer the loop (HF's `TrainerControl`). The trainer resets `should_log`,
/// `should_evaluate` and `should_save` after acting on them (every step), `should_epoch_stop` at each epoch start
/// and `should_training_stop` at the start of training.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrainerControl {
    /// End training after the current step (early stopping, max_steps reached).
    pub should_training_stop: bool,
    /// End the current epoch after the current step.
    pub should_epoch_stop: bool,
    /// Write a checkpoint after the current step.
    pub should_save: bool,
    /// Evaluate after the current step.
    pub should_evaluate: bool,
    /// Log the running training loss after the current step.
    pub should_log: bool,
}

impl TrainerControl {
    /// Resets the per-step flags (`should_log`, `should_evaluate`, `should_save`).
    pub fn new_step(&mut self) {
        self.should_log = false;
        self.should_evaluate = false;
        self.should_save = false;
    }

    /// Resets `should_epoch_stop`.
    pub fn new_epoch(&mut self) {
        self.should_epoch_stop = false;
    }

    /// HF's `stateful_callbacks["TrainerControl"]` entry.
    pub fn to_state(&self) -> CallbackState {
        let mut st = CallbackState::default();
        for (k, v) in [
            ("should_training_stop", self.should_training_stop),
            ("should_epoch_stop", self.should_epoch_stop),
            ("should_save", self.should_save),
            ("should_evaluate", self.should_evaluate),
            ("should_log", self.should_log),
        ] {
            st.args.insert(k.into(), v.into());
        }
        st
    }

    /// Restores from [`Self::to_state`]'s output (missing flags stay false).
    pub fn from_state(st: &CallbackState) -> Self {
        let flag = |k: &str| st.args.get(k).and_then(|v| v.as_bool()).unwrap_or(false);
        TrainerControl {
            should_training_stop: flag("should_training_stop"),
            should_epoch_stop: flag("should_epoch_stop"),
            should_save: flag("should_save"),
            should_evaluate: flag("should_evaluate"),
            should_log: flag("should_log"),
        }
    }
}

/// What every callback event sees: the run's arguments, its state and where this process stands.
#[derive(Debug, Clone, Copy)]
pub struct CallbackContext<'a> {
    /// The (finalized) training arguments.
    pub args: &'a TrainingArguments,
    /// The state before the event's changes (e.g. `best_metric` is still the previous best in `on_evaluate`).
    pub state: &'a TrainerState,
    /// This process's rank.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
}

impl CallbackContext<'_> {
    /// Whether this is rank 0 (the process that prints and writes shared files).
    pub fn is_world_process_zero(&self) -> bool {
        self.rank == 0
    }
}

/// A training-loop observer. Every method has an empty default; implement the events you need. Errors abort
/// training (on this rank — make failures symmetric across ranks or they will wait on each other).
#[allow(unused_variables)]
pub trait TrainerCallback: Send {
    /// Name used as the key of this callback's state in `trainer_state.json` (`stateful_callbacks`).
    fn name(&self) -> String {
        let full = std::any::type_name::<Self>();
        full.rsplit("::").next().unwrap_or(full).to_string()
    }
    /// Start of training (after a resume has restored the state).
    fn on_train_begin(&mut self, ctx: &CallbackContext, control: &mut TrainerControl) -> Result<()> {
        Ok(())
    }
    /// End of training (before the best model is loaded and the plots are written).
    fn on_train_end(&mut self, ctx: &CallbackContext, control: &mut TrainerControl) -> Result<()> {
        Ok(())
    }
    /// Start of an epoch.
    fn on_epoch_begin(&mut self, ctx: &CallbackContext, control: &mut TrainerControl) -> Result<()> {
        Ok(())
    }
    /// End of an epoch (before the epoch's log / evaluation / checkpoint).
    fn on_epoch_end(&mut self, ctx: &CallbackContext, control: &mut TrainerControl) -> Result<()> {
        Ok(())
    }
    /// Before the first micro-batch of an optimizer step.
    fn on_step_begin(&mut self, ctx: &CallbackContext, control: &mut TrainerControl) -> Result<()> {
        Ok(())
    }
    /// After an optimizer step (`state.global_step` already incremented), before its log / evaluation /
    /// checkpoint.
    fn on_step_end(&mut self, ctx: &CallbackContext, control: &mut TrainerControl) -> Result<()> {
        Ok(())
    }
    /// After an evaluation; `metrics` carry the `eval_` prefix.
    fn on_evaluate(&mut self, ctx: &CallbackContext, control: &mut TrainerControl, metrics: &Metrics) -> Result<()> {
        Ok(())
    }
    /// After a checkpoint was written.
    fn on_save(&mut self, ctx: &CallbackContext, control: &mut TrainerControl) -> Result<()> {
        Ok(())
    }
    /// After a log entry was appended to `state.log_history`.
    fn on_log(&mut self, ctx: &CallbackContext, control: &mut TrainerControl, logs: &LogEntry) -> Result<()> {
        Ok(())
    }
    /// State to save in checkpoints (`None`: nothing to save).
    fn state(&self) -> Option<CallbackState> {
        None
    }
    /// Restores what [`Self::state`] returned (called on resume, before `on_train_begin`).
    fn load_state(&mut self, state: &CallbackState) -> Result<()> {
        Ok(())
    }
}

/// Calls a list of callbacks in order for each event (HF's `CallbackHandler`).
#[derive(Default)]
pub struct CallbackHandler {
    callbacks: Vec<Box<dyn TrainerCallback>>,
}

macro_rules! dispatch {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        pub fn $name(&mut self, ctx: &CallbackContext, control: &mut TrainerControl) -> Result<()> {
            for cb in &mut self.callbacks {
                cb.$name(ctx, control)?;
            }
            Ok(())
        }
    };
}

impl CallbackHandler {
    /// An empty handler.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a callback.
    pub fn push(&mut self, cb: Box<dyn TrainerCallback>) {
        self.callbacks.push(cb);
    }

    /// Names of the callbacks, in order.
    pub fn names(&self) -> Vec<String> {
        self.callbacks.iter().map(|c| c.name()).collect()
    }

    /// Number of callbacks.
    pub fn len(&self) -> usize {
        self.callbacks.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.callbacks.is_empty()
    }

    dispatch!(/// Dispatches `on_train_begin`.
        on_train_begin);
    dispatch!(/// Dispatches `on_train_end`.
        on_train_end);
    dispatch!(/// Dispatches `on_epoch_begin`.
        on_epoch_begin);
    dispatch!(/// Dispatches `on_epoch_end`.
        on_epoch_end);
    dispatch!(/// Dispatches `on_step_begin`.
        on_step_begin);
    dispatch!(/// Dispatches `on_step_end`.
        on_step_end);
    dispatch!(/// Dispatches `on_save`.
        on_save);

    /// Dispatches `on_evaluate`.
    pub fn on_evaluate(&mut self, ctx: &CallbackContext, control: &mut TrainerControl, m: &Metrics) -> Result<()> {
        for cb in &mut self.callbacks {
            cb.on_evaluate(ctx, control, m)?;
        }
        Ok(())
    }

    /// Dispatches `on_log`.
    pub fn on_log(&mut self, ctx: &CallbackContext, control: &mut TrainerControl, logs: &LogEntry) -> Result<()> {
        for cb in &mut self.callbacks {
            cb.on_log(ctx, control, logs)?;
        }
        Ok(())
    }

    /// The saveable states by callback name (for `stateful_callbacks`).
    pub fn states(&self) -> Vec<(String, CallbackState)> {
        self.callbacks.iter().filter_map(|c| c.state().map(|s| (c.name(), s))).collect()
    }

    /// Restores each callback whose name has an entry in `states`.
    pub fn load_states(&mut self, states: &std::collections::BTreeMap<String, CallbackState>) -> Result<()> {
        for cb in &mut self.callbacks {
            if let Some(st) = states.get(&cb.name()) {
                cb.load_state(st)?;
            }
        }
        Ok(())
    }
}
