//! The error type of the `accel` command line: every variant names the file, flag or value involved and how to fix it.

use std::path::PathBuf;

/// Result alias of the CLI library.
pub type CliResult<T> = std::result::Result<T, CliError>;

/// What can go wrong in `accel config`, `accel launch`, `accel test` and `accel env`.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The config file is not valid YAML or a key has a value of the wrong type.
    #[error("config file {}: line {line}, column {column}: {message}", path.display())]
    ConfigSyntax {
        /// The file that was read.
        path: PathBuf,
        /// 1-based line of the problem.
        line: u64,
        /// 1-based column of the problem.
        column: u64,
        /// The parser's message (with a source snippet).
        message: String,
    },

    /// The config file parses but a value cannot work (e.g. an unknown distributed_type).
    #[error("config file {}: {message}", path.display())]
    ConfigValue {
        /// The file that was read.
        path: PathBuf,
        /// What is wrong and how to fix it.
        message: String,
    },

    /// `--config-file` names a file that does not exist.
    #[error("config file {} does not exist; write one with `accel config` (or `accel config default`), or drop --config-file to use the defaults", path.display())]
    ConfigMissing {
        /// The path that was given.
        path: PathBuf,
    },

    /// `accel config default` refuses to overwrite an existing file.
    #[error("config file {} already exists; not overwriting it (pass --force to replace it, or --config-file to write elsewhere)", path.display())]
    ConfigExists {
        /// The existing file.
        path: PathBuf,
    },

    /// A flag, answer or config value is out of range or not one of the choices.
    #[error("invalid {what} {value:?}: {expected}")]
    InvalidValue {
        /// Which setting, e.g. "--mixed-precision" or "num_processes".
        what: String,
        /// The value that was given.
        value: String,
        /// What is accepted.
        expected: String,
    },

    /// The launch settings are inconsistent (e.g. num_processes not divisible by num_machines).
    #[error("{0}")]
    Launch(String),

    /// The store port of the main machine is already taken.
    #[error("port {port} on {addr} is already in use (another job or an earlier run still holding it?); pick another with --main-process-port, or 0 for a free one on a single machine")]
    PortInUse {
        /// Address the store binds.
        addr: String,
        /// The busy port.
        port: u16,
    },

    /// The questionnaire could not complete (input ended, or too many invalid answers).
    #[error("accel config: {0}; no config file was written")]
    Questionnaire(String),

    /// An error from ddp-core (launcher, process group, collectives), e.g. a worker that failed first.
    #[error(transparent)]
    Ddp(#[from] ddp_core::DdpError),

    /// An error from the Accelerator (self-test training run).
    #[error(transparent)]
    Accel(#[from] accel::AccelError),

    /// An error from candle while running the self-test.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// `accel test` found results that do not match the expected values.
    #[error("self-test: {failed} of {total} checks FAILED (see the table above)")]
    SelfTestFailed {
        /// Number of failed checks.
        failed: usize,
        /// Number of checks run.
        total: usize,
    },

    /// Other I/O errors, with what we were doing.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing, naming the file.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl CliError {
    /// Wraps an I/O error with what we were doing.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        CliError::Io { context: context.into(), source }
    }

    /// An out-of-range or unknown value.
    pub fn invalid(what: impl Into<String>, value: impl Into<String>, expected: impl Into<String>) -> Self {
        CliError::InvalidValue { what: what.into(), value: value.into(), expected: expected.into() }
    }
}

/// accel-nn's errors (the self-test's optimizer) arrive as the Accelerator's variant of the same name.
impl From<accel::optim::NnError> for CliError {
    fn from(e: accel::optim::NnError) -> Self {
        CliError::Accel(e.into())
    }
}
