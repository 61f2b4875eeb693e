//! Experiment trackers: where `Accelerator::log` sends scalars (loss, learning rate, metrics).
//!
//! - [`JsonlTracker`]: one JSON object per `log` call in `metrics.jsonl` (always available, easy to `jq`/pandas).
//! - `TensorBoardTracker`: TensorBoard event files (`events.out.tfevents.{secs}.{host}`), written by a small
//!   writer of TFRecord framing (`tfrecord`) and the `Event` protobuf (`event`); there is no maintained Rust
//!   crate for it. Behind the cargo feature `tensorboard`; without it, creating one is an error naming the feature.
//!
//! Both write into `logging_dir/project/`, as Accelerate's `init_trackers(project_name)` does. The Accelerator
//! creates them on the main process only ([`crate::Accelerator::init_trackers`]), so other ranks never touch the
//! files; the trackers themselves are plain writers and can be used without an Accelerator.

#[cfg(feature = "tensorboard")]
#[cfg_attr(docsrs, doc(cfg(feature = "tensorboard")))]
pub mod event;
mod jsonl;
#[cfg(feature = "tensorboard")]
mod tensorboard;
#[cfg(feature = "tensorboard")]
#[cfg_attr(docsrs, doc(cfg(feature = "tensorboard")))]
pub mod tfrecord;
mod trackers;

pub use jsonl::{JsonlTracker, JSONL_FILE_NAME};
#[cfg(feature = "tensorboard")]
#[cfg_attr(docsrs, doc(cfg(feature = "tensorboard")))]
pub use tensorboard::TensorBoardTracker;
pub(crate) use trackers::Trackers;

use crate::{AccelError, Result};
use std::fmt;
use std::path::Path;
use std::str::FromStr;

/// The trackers accel ships.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TrackerKind {
    /// [`JsonlTracker`] (`jsonl`).
    Jsonl,
    /// `TensorBoardTracker` (`tensorboard`); creating it needs the cargo feature `tensorboard`.
    TensorBoard,
}

impl TrackerKind {
    /// All kinds this build can create, for "log with everything".
    #[cfg(feature = "tensorboard")]
    pub const ALL: [TrackerKind; 2] = [TrackerKind::Jsonl, TrackerKind::TensorBoard];
    /// All kinds this build can create, for "log with everything" (`TensorBoard` needs the feature `tensorboard`).
    #[cfg(not(feature = "tensorboard"))]
    pub const ALL: [TrackerKind; 1] = [TrackerKind::Jsonl];

    /// The name used on command lines and in configs: `jsonl` or `tensorboard`.
    pub fn as_str(self) -> &'static str {
        match self {
            TrackerKind::Jsonl => "jsonl",
            TrackerKind::TensorBoard => "tensorboard",
        }
    }

    /// Creates this tracker writing into `dir` (created if missing).
    ///
    /// Errors: [`AccelError::Usage`] for `TensorBoard` in a build without the cargo feature `tensorboard`; I/O
    /// errors creating the directory or file.
    pub fn create(self, dir: &Path) -> Result<Box<dyn Tracker>> {
        Ok(match self {
            TrackerKind::Jsonl => Box::new(JsonlTracker::new(dir)?),
            #[cfg(feature = "tensorboard")]
            TrackerKind::TensorBoard => Box::new(TensorBoardTracker::new(dir)?),
            #[cfg(not(feature = "tensorboard"))]
            TrackerKind::TensorBoard => return Err(AccelError::missing_feature("tensorboard", "accel")),
        })
    }
}

impl fmt::Display for TrackerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TrackerKind {
    type Err = AccelError;

    /// `jsonl` / `json` or `tensorboard` / `tb` (case-insensitive).
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "jsonl" | "json" => Ok(TrackerKind::Jsonl),
            "tensorboard" | "tb" => Ok(TrackerKind::TensorBoard),
            _ => Err(AccelError::Config {
                key: "tracker".into(),
                value: s.to_string(),
                reason: "unknown tracker; choose \"jsonl\" or \"tensorboard\"".into(),
            }),
        }
    }
}

/// A sink for scalar metrics.
pub trait Tracker: Send {
    /// Records `values` (name, value) at `step` (the global step, or any monotone counter the caller uses).
    /// Values are written as given; non-finite values are kept (see each tracker for how).
    fn log(&mut self, values: &[(&str, f64)], step: u64) -> Result<()>;

    /// Flushes and closes the output. Further `log` calls are errors.
    fn finish(&mut self) -> Result<()>;
}

/// Seconds since the Unix epoch, as TensorBoard's `wall_time` (a clock before 1970 reads as 0).
pub(crate) fn wall_time_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Creates `dir` and all missing parents, naming it on error.
pub(crate) fn create_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| AccelError::io(format!("cannot create tracker directory {}", dir.display()), e))
}

/// The error of a `log` after `finish`.
pub(crate) fn finished_error(what: &str, path: &Path) -> AccelError {
    AccelError::Usage(format!("{what} for {} was already finished; create a new one to log again", path.display()))
}
