//! [`JsonlTracker`]: one JSON object per `log` call.

use super::{create_dir, finished_error, wall_time_now, Tracker};
use crate::{AccelError, Result};
use serde_json::{Map, Value};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// File name inside the tracker directory.
pub const JSONL_FILE_NAME: &str = "metrics.jsonl";

/// Appends `{"step": 3, "wall_time": 1732990000.25, "values": {"loss": 0.5}}` lines (JSON Lines) to
/// `dir/metrics.jsonl`.
///
/// The file is opened in append mode, so a resumed run continues the same file (filter by `step` when reading).
/// `wall_time` is seconds since the Unix epoch. JSON has no NaN or infinity: such values are written as the strings
/// `"NaN"`, `"Infinity"` and `"-Infinity"` (what Python's `json` module would print, quoted), so a diverging loss
/// stays visible. Each line is flushed when written: a crash loses nothing already logged.
pub struct JsonlTracker {
    path: PathBuf,
    out: Option<BufWriter<File>>,
}

impl JsonlTracker {
    /// Opens (creating `dir` and the file when missing) `dir/metrics.jsonl` for appending.
    pub fn new(dir: &Path) -> Result<Self> {
        create_dir(dir)?;
        let path = dir.join(JSONL_FILE_NAME);
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| AccelError::io(format!("cannot open {}", path.display()), e))?;
        Ok(JsonlTracker { path, out: Some(BufWriter::new(file)) })
    }

    /// The file written to.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A finite number, or its name as a string.
fn json_number(v: f64) -> Value {
    match serde_json::Number::from_f64(v) {
        Some(n) => Value::Number(n),
        None if v.is_nan() => Value::String("NaN".into()),
        None if v > 0.0 => Value::String("Infinity".into()),
        None => Value::String("-Infinity".into()),
    }
}

impl Tracker for JsonlTracker {
    fn log(&mut self, values: &[(&str, f64)], step: u64) -> Result<()> {
        let out = self.out.as_mut().ok_or_else(|| finished_error("JsonlTracker", &self.path))?;
        let mut obj = Map::new();
        obj.insert("step".into(), Value::from(step));
        obj.insert("wall_time".into(), json_number(wall_time_now()));
        let values: Map<String, Value> = values.iter().map(|(k, v)| (k.to_string(), json_number(*v))).collect();
        obj.insert("values".into(), Value::Object(values));
        let mut line = serde_json::to_vec(&Value::Object(obj))
            .map_err(|e| AccelError::json(format!("cannot encode a metrics line for {}", self.path.display()), e))?;
        line.push(b'\n');
        out.write_all(&line)
            .and_then(|_| out.flush())
            .map_err(|e| AccelError::io(format!("cannot write {}", self.path.display()), e))
    }

    fn finish(&mut self) -> Result<()> {
        if let Some(mut out) = self.out.take() {
            out.flush().map_err(|e| AccelError::io(format!("cannot flush {}", self.path.display()), e))?;
        }
        Ok(())
    }
}

impl Drop for JsonlTracker {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}
