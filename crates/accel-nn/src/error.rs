//! The one error type of accel-nn.
//!
//! Every variant says what went wrong and names the thing involved (the argument and its shape, the
//! hyper-parameter, the checkpoint file), so a user reading a log line knows which call to look at.

/// Result alias used across accel-nn.
pub type Result<T> = std::result::Result<T, NnError>;

/// Errors raised by the fused ops, the optimizers and their saved state.
#[derive(Debug, thiserror::Error)]
pub enum NnError {
    /// A caller passed an argument that cannot work (wrong shape, rank, dtype, length, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// An optimizer hyper-parameter (or another configuration value) is invalid.
    #[error("invalid configuration {key} = {value:?}: {reason}")]
    Config {
        /// Field name, e.g. `AdamWConfig.beta1`.
        key: String,
        /// The offending value as given.
        value: String,
        /// What is wrong and which values are accepted.
        reason: String,
    },

    /// Saved state could not be written or read (missing file, unreadable tensors).
    #[error("checkpoint {}: {reason}", path.display())]
    Checkpoint {
        /// The checkpoint directory or file involved.
        path: std::path::PathBuf,
        /// What is wrong and how to fix it.
        reason: String,
    },

    /// JSON (de)serialisation of saved state failed, with what we were doing.
    #[error("{context}: {source}")]
    Json {
        /// What we were doing.
        context: String,
        /// The serde_json error.
        #[source]
        source: serde_json::Error,
    },

    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// Other I/O errors, with what we were doing.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl NnError {
    /// Wraps an I/O error with what we were doing.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        NnError::Io { context: context.into(), source }
    }

    /// Wraps a JSON error with what we were doing.
    pub fn json(context: impl Into<String>, source: serde_json::Error) -> Self {
        NnError::Json { context: context.into(), source }
    }
}

/// An accel-nn error inside a function that returns candle's `Result` (a candle `Module`'s `forward` calling a
/// fused op): candle's own errors come back unwrapped, every other error wrapped whole, so `?` works.
impl From<NnError> for candle_core::Error {
    fn from(e: NnError) -> Self {
        match e {
            NnError::Candle(e) => e,
            e => candle_core::Error::wrap(e),
        }
    }
}
