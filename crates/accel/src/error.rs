//! The one error type of the `accel` crate.
//!
//! Every variant says what went wrong and, where it can, what to do about it. Errors from ddp-core (store,
//! collectives, DDP) and from candle are wrapped unchanged so their own context (rank, op, sequence number) is kept.

use std::path::PathBuf;

/// Result alias used across `accel`.
pub type Result<T> = std::result::Result<T, AccelError>;

/// Errors raised by the Accelerator, its optimizers, data loaders, checkpoint state, trackers and the CLI.
#[derive(Debug, thiserror::Error)]
pub enum AccelError {
    /// A distributed operation failed (store, collective, DDP check); see the wrapped error for rank and op.
    #[error(transparent)]
    Ddp(ddp_core::DdpError),

    /// A pipeline stage's send or receive failed (a dead or stuck stage): the context names the stage, the
    /// micro-batch, the action, this pp rank and the peer; the source is the backend's error (op, peer, timeout).
    #[error("{context}: {source}")]
    Pipeline {
        /// Stage, micro-batch, action, ranks.
        context: String,
        /// The collective's error (boxed: it would make every `Result` of the crate larger).
        #[source]
        source: Box<ddp_core::DdpError>,
    },

    /// An error from candle (shape mismatch, dtype, device, ...).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// A configuration value (from code, the environment or a config file) is invalid.
    #[error("invalid configuration {key} = {value:?}: {reason}")]
    Config {
        /// Field or environment variable name, e.g. `ACCELERATE_MIXED_PRECISION`.
        key: String,
        /// The offending value as given.
        value: String,
        /// What is wrong and which values are accepted.
        reason: String,
    },

    /// A caller passed an argument that cannot work (wrong shape, rank out of range, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The API was used in an order that cannot work (e.g. `backward` before `prepare_model`).
    #[error("{0}")]
    Usage(String),

    /// Data set / data loader problems (unreadable file, bad record, inconsistent sizes).
    #[error("data: {0}")]
    Data(String),

    /// Checkpoint save/load problems (missing file, mismatched tensor, different world size).
    #[error("checkpoint {}: {reason}", path.display())]
    Checkpoint {
        /// The checkpoint directory or file involved.
        path: PathBuf,
        /// What is wrong and how to fix it.
        reason: String,
    },

    /// JSON (de)serialisation failed, with what we were doing.
    #[error("{context}: {source}")]
    Json {
        /// What we were doing.
        context: String,
        /// The serde_json error.
        #[source]
        source: serde_json::Error,
    },

    /// Other I/O errors, with what we were doing.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing (which file).
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// ddp-core's errors arrive as [`AccelError::Ddp`], unchanged.
impl From<ddp_core::DdpError> for AccelError {
    fn from(e: ddp_core::DdpError) -> Self {
        AccelError::Ddp(e)
    }
}

/// accel-nn's errors (the fused ops, the optimizers, their saved state) become the `AccelError` variant of the
/// same name and text, so matching on a configuration, checkpoint, JSON or I/O error sees one variant whichever
/// crate raised it.
impl From<accel_nn::NnError> for AccelError {
    fn from(e: accel_nn::NnError) -> Self {
        use accel_nn::NnError as N;
        match e {
            N::InvalidArgument(m) => AccelError::InvalidArgument(m),
            N::Config { key, value, reason } => AccelError::Config { key, value, reason },
            N::Checkpoint { path, reason } => AccelError::Checkpoint { path, reason },
            N::Json { context, source } => AccelError::Json { context, source },
            N::Candle(e) => AccelError::Candle(e),
            N::Io { context, source } => AccelError::Io { context, source },
        }
    }
}

impl AccelError {
    /// The error for asking for something this build left out: names the cargo `feature` of `krate` to enable.
    pub fn missing_feature(feature: &str, krate: &str) -> Self {
        AccelError::Usage(format!("built without feature `{feature}` of crate {krate}: enable it in Cargo.toml"))
    }

    /// Wraps an I/O error with what we were doing.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        AccelError::Io { context: context.into(), source }
    }

    /// Wraps a JSON error with what we were doing.
    pub fn json(context: impl Into<String>, source: serde_json::Error) -> Self {
        AccelError::Json { context: context.into(), source }
    }
}

/// An accel error inside a function that returns candle's `Result` (a candle `Module`'s `forward`, a model
/// builder written the candle way): candle's own errors come back unwrapped, every other error wrapped whole, so
/// `?` works in both directions and the message is kept.
impl From<AccelError> for candle_core::Error {
    fn from(e: AccelError) -> Self {
        match e {
            AccelError::Candle(e) => e,
            e => candle_core::Error::wrap(e),
        }
    }
}
