//! The one error type of ddp-core.
//!
//! Every variant says what went wrong *and* names the thing involved (key, variable, address, rank, collective),
//! so a user reading a log line of a failed multi-process job knows which rank and which call to look at.

use std::time::Duration;

/// Result alias used across ddp-core.
pub type Result<T> = std::result::Result<T, DdpError>;

/// Errors raised by the store, process groups, collectives, DDP, the sampler and the launcher.
#[derive(Debug, thiserror::Error)]
pub enum DdpError {
    /// A blocking store call (`get`, `wait`) did not see its key(s) in time.
    #[error("store: timed out after {:.1} s waiting for key(s) {keys:?}; another rank may have died or not started (raise the timeout with ACCEL_TIMEOUT=seconds or InitOptions::timeout)", waited.as_secs_f64())]
    StoreTimeout {
        /// The keys that were still missing.
        keys: Vec<String>,
        /// How long the call waited.
        waited: Duration,
    },

    /// A peer proved a different run token than ours, or refused our proof (either side of the handshake).
    #[error("run token mismatch with {peer}: every process of a job must share the same ACCEL_RUN_TOKEN (the launcher sets it; on several machines export the same value on each)")]
    TokenRejected {
        /// Address (or rank) of the other side.
        peer: String,
    },

    /// A collective failed on this rank because of a peer (disconnect, timeout, mismatch, remote abort).
    #[error("{op} (sequence number {seq}, group of {world_size}) failed on rank {rank}: {reason}{}", peer.map(|p| format!(" [peer rank {p}]")).unwrap_or_default())]
    Collective {
        /// Name of the collective, e.g. `"all_reduce"`.
        op: &'static str,
        /// The collective's sequence number in its process group (the same on every rank).
        seq: u64,
        /// This rank (in the group).
        rank: usize,
        /// Size of the group.
        world_size: usize,
        /// The rank that caused the failure, when known (group rank).
        peer: Option<usize>,
        /// What happened, e.g. "rank 2 disconnected (process exited?)" or "timed out after 1800 s".
        reason: String,
    },

    /// An environment variable needed by `init_from_env` is missing or malformed.
    #[error("environment variable {var}: {reason}")]
    Env {
        /// Variable name, e.g. `WORLD_SIZE`.
        var: String,
        /// What is wrong and how to fix it.
        reason: String,
    },

    /// A server could not bind its address.
    #[error("cannot listen on {addr}: {source} (is another job using this port? pick another MASTER_PORT, or 0 for a free one)")]
    Bind {
        /// `host:port` that was asked for.
        addr: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// Could not connect to a server or peer.
    #[error("cannot connect to {addr} after {:.1} s: {reason}", waited.as_secs_f64())]
    Connect {
        /// `host:port`.
        addr: String,
        /// How long we retried.
        waited: Duration,
        /// Last error seen.
        reason: String,
    },

    /// A caller passed an argument that cannot work (wrong length, rank out of range, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// Wire data that does not follow the protocol (wrong magic, oversized frame, ...).
    #[error("protocol error: {0}")]
    Protocol(String),

    /// A requested backend (NCCL, MPI) is not compiled in or its library is missing.
    #[error("backend {backend} unavailable: {reason}")]
    BackendUnavailable {
        /// `"nccl"`, `"mpi"`, ...
        backend: &'static str,
        /// Which library/feature was looked for and how to fix it.
        reason: String,
    },

    /// DDP: parameter names or shapes differ between ranks.
    #[error("parameter mismatch across ranks: {0}")]
    ParameterMismatch(String),

    /// DDP: parameters that received no gradient (and `find_unused_parameters` is off).
    #[error("parameters without a gradient after backward: {names:?}; every parameter must take part in the loss (a forward pass recorded with segments::record needs DistributedDataParallel::backward(&loss, cuts) or Accelerator::backward_segments: a plain backward() stops at the first cut), or set DdpOptions::find_unused_parameters = true if some really take no part")]
    UnusedParameters {
        /// Names of the parameters with no gradient.
        names: Vec<String>,
    },

    /// Launcher: a worker exited with a failure.
    #[error("worker rank {rank} (local rank {local_rank}) failed first: {status}; the other workers were stopped")]
    WorkerFailed {
        /// Global rank of the first failing worker.
        rank: usize,
        /// Local rank on this machine.
        local_rank: usize,
        /// Exit status in words ("exit code 3", "killed by signal 9").
        status: String,
    },

    /// Launcher: the machines of a multi-machine job disagree about the job (world size, machine count, backend,
    /// program, accel-rs version), two machines claim the same machine rank, a peer was refused by the store, or
    /// a machine did not join in time. The message names the values, the machines and the fix.
    #[error("rendezvous: {0}")]
    Rendezvous(String),

    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// Launcher: SIGINT or SIGTERM reached the launcher; its workers were stopped. A program that reports it
    /// exits as a process that signal ended would (128 + the signal number: 130 for Ctrl-C;
    /// [`crate::launcher::exit_code`]).
    #[error("{context}")]
    Interrupted {
        /// The signal number.
        signal: i32,
        /// What was interrupted.
        context: String,
    },

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

impl DdpError {
    /// Wraps an I/O error with what we were doing.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        DdpError::Io { context: context.into(), source }
    }
}
