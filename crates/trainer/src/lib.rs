//! # trainer — level 3 of accel-rs (like the Hugging Face `Trainer`)
//!
//! The training loop disappears: hand over a model builder, data, a loss function and [`TrainingArguments`];
//! [`Trainer::train`] runs epochs with HF's step arithmetic on one process or many (through the Accelerator),
//! evaluates, logs, checkpoints (`output_dir/checkpoint-{step}`, HF's `trainer_state.json`), resumes bit for bit,
//! stops early, reloads the best model and plots the curves.
//!
//! ```no_run
//! use trainer::{EarlyStoppingCallback, Trainer, TrainingArguments, losses, metrics};
//! # fn data() -> accel::data::TensorDataset { unimplemented!() }
//! # fn main() -> trainer::Result<()> {
//! let args = TrainingArguments::from_yaml_and_cli("train.yaml")?;     // file, then --learning-rate 3e-4 ...
//! let mut trainer = Trainer::new(args, |vb| candle_nn::linear(784, 10, vb.pp("fc")), data(), Some(data()),
//!                                losses::cross_entropy)
//!     .compute_metrics(metrics::classification)
//!     .callback(EarlyStoppingCallback::new(3, 0.0));
//! let result = trainer.train()?;        // epochs, eval, checkpoints, resume, logs, plot
//! # Ok(()) }
//! ```
//!
//! Modules, one concept each: [`args`] (TrainingArguments, CLI), [`trainer`] (the loop), [`evaluation`]
//! (evaluate / predict), [`losses`] (sum + item count losses), [`metrics`] (accuracy, macro P/R/F1,
//! perplexity), [`callbacks`] (control object, early stopping, progress bar, printer, trackers), [`checkpoint`]
//! (naming, rotation, resume lookup), [`output_dir`] (one job and one run per output directory: the lock, released
//! on SIGINT/SIGTERM too, and the refusal of another run's files), [`state`] (TrainerState / trainer_state.json),
//! `plot` (PNG + SVG curves), [`init`] (seeded model initialisation), [`optimizer`] (AdamW / SGD from the arguments),
//! [`hpsearch`] (hyperparameter search: samplers, pruners, parallel trials, resumable study).
//!
//! Cargo features (all off by default, as in burn-train; the examples turn them on): `plots` (the `plot` module,
//! `save_plots`), `progress` (`ProgressCallback`, the terminal bar), `tensorboard` (`report_to: tensorboard`), and
//! `nccl` / `mpi` / `cuda` (forwarded to accel). Asking for a left-out part is an argument error naming the feature.

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod args;
pub mod callbacks;
pub mod checkpoint;
mod config_file;
pub mod error;
pub mod evaluation;
pub mod hpsearch;
pub mod init;
pub mod losses;
pub mod metrics;
pub mod optimizer;
pub mod output_dir;
#[cfg(feature = "plots")]
#[cfg_attr(docsrs, doc(cfg(feature = "plots")))]
pub mod plot;
pub mod restarts;
pub mod state;
pub mod trainer;

pub use args::{
    FsdpPlan, IntervalStrategy, NonFiniteLoss, OptimizerKind, ReportTo, SaveStrategy, TrainingArguments,
    TrainingArgumentsCli,
};
// What a `TrainingArguments { .. }` literal names, so a Trainer user need not depend on accel.
pub use accel::config::MixedPrecision;
pub use accel::scheduler::SchedulerKind;
#[cfg(feature = "progress")]
#[cfg_attr(docsrs, doc(cfg(feature = "progress")))]
pub use callbacks::ProgressCallback;
pub use callbacks::{
    CallbackContext, DefaultFlowCallback, EarlyStoppingCallback, PrinterCallback, TrainerCallback, TrainerControl,
};
pub use error::{Result, TrainerError};
pub use evaluation::PredictionOutput;
pub use hpsearch::{Direction, HyperparameterSearch, StudySummary, Trial};
pub use losses::LossOutput;
pub use metrics::{EvalPrediction, Metrics};
pub use state::{CallbackState, LogEntry, LossTallyState, TrainerState};
pub use trainer::{TrainOutput, Trainer};

/// Locks `mutex`, ignoring poisoning: a panic while a lock was held ends the run anyway (the launcher stops every
/// rank), and every critical section here leaves its data consistent, so no second panic is added to the first.
pub(crate) fn lock<T: ?Sized>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
