//! [`TensorBoardTracker`]: scalars as TensorBoard event files.

use super::event::Event;
use super::tfrecord::write_record;
use super::{create_dir, finished_error, wall_time_now, Tracker};
use crate::{AccelError, Result};
use prost::Message;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Writes `dir/events.out.tfevents.{unix seconds}.{host name}`: a `file_version` event, then one event per `log`
/// call carrying one `simple_value` per metric (stored as f32, as TensorBoard does; NaN and infinities are kept).
///
/// Load it with `tensorboard --logdir <logging_dir>`. A new file is created per tracker, so restarts add files next
/// to earlier ones (TensorBoard merges the files of a directory). Each event is flushed when written so a running
/// TensorBoard sees it.
pub struct TensorBoardTracker {
    path: PathBuf,
    out: Option<BufWriter<File>>,
}

impl TensorBoardTracker {
    /// Creates `dir` when missing and a new event file in it.
    pub fn new(dir: &Path) -> Result<Self> {
        create_dir(dir)?;
        let secs = wall_time_now() as u64;
        let host = host_name();
        let base = format!("events.out.tfevents.{secs}.{host}");
        // Two trackers created in the same second (tests, restarts) get distinct names; TensorBoard only needs the
        // name to contain "tfevents".
        let mut path = dir.join(&base);
        let mut n = 1u32;
        let file = loop {
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(f) => break f,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    path = dir.join(format!("{base}.{}.{n}", std::process::id()));
                    n += 1;
                }
                Err(e) => return Err(AccelError::io(format!("cannot create event file {}", path.display()), e)),
            }
        };
        let mut tracker = TensorBoardTracker { path, out: Some(BufWriter::new(file)) };
        tracker.write_event(&Event::file_version(wall_time_now()))?;
        Ok(tracker)
    }

    /// The event file written to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event (framed as a TFRecord) and flushes.
    pub fn write_event(&mut self, event: &Event) -> Result<()> {
        let out = self.out.as_mut().ok_or_else(|| finished_error("TensorBoardTracker", &self.path))?;
        write_record(out, &event.encode_to_vec())
            .and_then(|_| out.flush())
            .map_err(|e| AccelError::io(format!("cannot write event file {}", self.path.display()), e))
    }
}

impl Tracker for TensorBoardTracker {
    fn log(&mut self, values: &[(&str, f64)], step: u64) -> Result<()> {
        let step = i64::try_from(step).map_err(|_| AccelError::InvalidArgument(format!("step {step} exceeds i64")))?;
        self.write_event(&Event::scalars(wall_time_now(), step, values))
    }

    fn finish(&mut self) -> Result<()> {
        if let Some(mut out) = self.out.take() {
            out.flush().map_err(|e| AccelError::io(format!("cannot flush {}", self.path.display()), e))?;
        }
        Ok(())
    }
}

impl Drop for TensorBoardTracker {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// This machine's host name (what TensorFlow puts in event file names), `localhost` when it cannot be read.
/// Characters other than `[A-Za-z0-9._-]` are replaced so the file name stays portable.
pub(crate) fn host_name() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::process::Command::new("hostname").output().ok().and_then(|o| String::from_utf8(o.stdout).ok()))
        .unwrap_or_default();
    let name: String = raw
        .trim()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') { c } else { '_' })
        .collect();
    if name.is_empty() {
        "localhost".to_string()
    } else {
        name
    }
}
