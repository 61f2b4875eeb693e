//! The error type of the `trainer` crate: every variant says what is wrong and, where it can, how to fix it.

use std::path::PathBuf;

/// Result alias used across `trainer`.
pub type Result<T> = std::result::Result<T, TrainerError>;

/// Errors raised by [`crate::TrainingArguments`] parsing/validation, the training loop, evaluation, checkpoints and
/// callbacks.
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    /// A training argument has a value that cannot work; `field` is its HF name (also the YAML key and, with `-`
    /// for `_`, the CLI flag).
    #[error("invalid training argument `{field}`: {reason}")]
    InvalidArgument {
        /// The argument's name, e.g. `per_device_train_batch_size`.
        field: String,
        /// What is wrong and how to fix it.
        reason: String,
    },

    /// A configuration file (training arguments, a hyperparameter search) could not be read or parsed.
    #[error("config file {}: {reason}", path.display())]
    ConfigFile {
        /// The YAML/JSON file.
        path: PathBuf,
        /// The parser's message (with line and column when the parser gives them).
        reason: String,
    },

    /// A checkpoint cannot be used for resuming (missing, incomplete, other world size...).
    #[error("checkpoint {}: {reason}", path.display())]
    Checkpoint {
        /// The checkpoint directory (or the output directory searched for one).
        path: PathBuf,
        /// What is wrong and how to fix it.
        reason: String,
    },

    /// The trainer was used in a way that cannot work (e.g. `evaluate` without an eval dataset).
    #[error("{0}")]
    Usage(String),

    /// A metric asked for (e.g. `metric_for_best_model`) is not among the evaluation's metrics.
    #[error("metric {name:?} not found among the evaluation metrics {available:?}; set metric_for_best_model to one of them (with or without the \"eval_\" prefix)")]
    MissingMetric {
        /// The metric asked for.
        name: String,
        /// The metric names the evaluation produced.
        available: Vec<String>,
    },

    /// An error from the Accelerator level (collectives and other distributed operations, optimizer, data,
    /// checkpoint state, file I/O and JSON); a [`accel::dist::DdpError`] arrives here as [`accel::AccelError::Ddp`].
    #[error(transparent)]
    Accel(#[from] accel::AccelError),

    /// An error from candle (shape, dtype, device) in the model, the loss or a metric.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// Training diverged: the loss or the gradient norm became NaN or infinite (the message names the global
    /// step, the rank(s) and the last finite loss). Nothing from that step on was saved.
    #[error("{0}")]
    NonFinite(String),

    /// A user callback or `compute_metrics` function failed.
    #[error("{context}: {message}")]
    Callback {
        /// Which hook or function.
        context: String,
        /// Its error, as text.
        message: String,
    },

    /// Plotting the training curves failed.
    #[error("plotting {}: {reason}", path.display())]
    Plot {
        /// The image being written.
        path: PathBuf,
        /// The plotting backend's message.
        reason: String,
    },
}

impl TrainerError {
    /// An [`TrainerError::InvalidArgument`] for `field`.
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        TrainerError::InvalidArgument { field: field.into(), reason: reason.into() }
    }

    /// Wraps an I/O error with what we were doing (as [`accel::AccelError::Io`]: one variant for both crates).
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        TrainerError::Accel(accel::AccelError::io(context, source))
    }

    /// Wraps a JSON error with what we were doing (as [`accel::AccelError::Json`]).
    pub fn json(context: impl Into<String>, source: serde_json::Error) -> Self {
        TrainerError::Accel(accel::AccelError::json(context, source))
    }

    /// A [`TrainerError::Checkpoint`] error.
    pub fn checkpoint(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        TrainerError::Checkpoint { path: path.into(), reason: reason.into() }
    }
}

/// A ddp-core error takes the one path through the Accelerator's error ([`accel::AccelError::Ddp`]), so callers
/// match distributed failures in one place whichever level raised them.
impl From<accel::dist::DdpError> for TrainerError {
    fn from(e: accel::dist::DdpError) -> Self {
        TrainerError::Accel(e.into())
    }
}

/// accel-nn's errors (optimizers, their state) take the same path, as the `AccelError` variant of the same name.
impl From<accel::optim::NnError> for TrainerError {
    fn from(e: accel::optim::NnError) -> Self {
        TrainerError::Accel(e.into())
    }
}
