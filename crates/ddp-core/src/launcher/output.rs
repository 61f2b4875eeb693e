//! Worker output: one reader thread per worker stream turns bytes into whole lines, prefixes them with the
//! rank for the console (`[rank 3] loss 0.1`), and appends them unprefixed to the rank's log file.
//!
//! Each console line is written with one `write_all` under the stdout/stderr lock, so lines of different ranks
//! never interleave mid-line (as torchrun's `--tee` with line prefixes).

use crate::{DdpError, Result};
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Which console stream a worker stream is copied to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stream {
    Stdout,
    Stderr,
}

/// Where one rank's output goes.
#[derive(Clone)]
pub(crate) struct RankSink {
    rank: usize,
    prefix: Vec<u8>,
    console: bool,
    file: Option<Arc<Mutex<File>>>,
}

/// The per-rank sinks of a launch (log files are opened once and kept across restarts).
pub(crate) struct Sinks {
    ranks: Vec<RankSink>,
}

impl Sinks {
    /// Sinks for global ranks `first_rank..first_rank + n`. With `log_dir`, creates it and truncates
    /// `log_dir/rank{r}.log` (appends instead when `append`: an elastic job's later rounds, whose ranks may have
    /// been another machine's before); the console gets the output when there is no `log_dir` or `tee` is set.
    pub(crate) fn open(first_rank: usize, n: usize, log_dir: Option<&Path>, tee: bool, append: bool) -> Result<Self> {
        if let Some(dir) = log_dir {
            std::fs::create_dir_all(dir)
                .map_err(|e| DdpError::io(format!("creating the log directory {}", dir.display()), e))?;
        }
        let ranks = (first_rank..first_rank + n)
            .map(|rank| {
                let file = match log_dir {
                    None => None,
                    Some(dir) => {
                        let path = log_path(dir, rank);
                        let f = std::fs::OpenOptions::new()
                            .create(true)
                            .write(true)
                            .append(append)
                            .truncate(!append)
                            .open(&path)
                            .map_err(|e| DdpError::io(format!("creating the log file {}", path.display()), e))?;
                        Some(Arc::new(Mutex::new(f)))
                    }
                };
                Ok(RankSink {
                    rank,
                    prefix: format!("[rank {rank}] ").into_bytes(),
                    console: log_dir.is_none() || tee,
                    file,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Sinks { ranks })
    }

    /// The sink of local rank `local_rank`.
    pub(crate) fn rank(&self, local_rank: usize) -> &RankSink {
        &self.ranks[local_rank]
    }

    /// Number of ranks.
    pub(crate) fn len(&self) -> usize {
        self.ranks.len()
    }

    /// Writes a launcher note (e.g. a restart marker) into every log file.
    pub(crate) fn note(&self, text: &str) {
        for sink in &self.ranks {
            if let Some(f) = &sink.file {
                let _ = writeln!(crate::sync::lock(f), "[launcher] {text}");
            }
        }
    }
}

impl RankSink {
    /// The global rank this sink is for.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// Writes a worker's error report (or a line about it): to the console's stderr, prefixed with the rank, when
    /// `console` (even when the worker's output goes to its log file only: this is the one copy the user must
    /// see), and unprefixed to the rank's log file when `file` and there is one.
    pub(crate) fn write_report(&self, text: &str, console: bool, file: bool) {
        if console {
            let mut block = Vec::new();
            for line in text.lines() {
                block.extend_from_slice(&self.prefix);
                block.extend_from_slice(line.as_bytes());
                block.push(b'\n');
            }
            let _ = std::io::stderr().lock().write_all(&block);
        }
        if let (true, Some(f)) = (file, &self.file) {
            let _ = writeln!(crate::sync::lock(f), "{text}");
        }
    }
}

/// `log_dir/rank{rank}.log`: one file per rank with its stdout and stderr lines in arrival order.
pub fn log_path(log_dir: &Path, rank: usize) -> PathBuf {
    log_dir.join(format!("rank{rank}.log"))
}

/// Reader threads of one worker group; [`Pumps::finish`] waits for them to drain.
pub(crate) struct Pumps {
    done_tx: Sender<()>,
    done_rx: Receiver<()>,
    running: usize,
}

impl Pumps {
    pub(crate) fn new() -> Self {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        Pumps { done_tx, done_rx, running: 0 }
    }

    /// Starts a thread copying `reader` line by line to `sink`.
    pub(crate) fn start(&mut self, reader: impl Read + Send + 'static, sink: RankSink, stream: Stream) -> Result<()> {
        let done = self.done_tx.clone();
        std::thread::Builder::new()
            .name(format!("launcher-{}", String::from_utf8_lossy(&sink.prefix).trim()))
            .spawn(move || {
                pump(reader, &sink, stream);
                let _ = done.send(());
            })
            .map_err(|e| DdpError::io("starting a worker output thread", e))?;
        self.running += 1;
        Ok(())
    }

    /// Waits until every stream reached end-of-file, at most `limit`: a grandchild that escaped the worker's
    /// process group may keep a pipe open forever, and the launcher must not hang on it.
    pub(crate) fn finish(mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.running > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if self.done_rx.recv_timeout(left).is_err() {
                tracing::warn!("launcher: {} worker output stream(s) still open; not waiting for them", self.running);
                return;
            }
            self.running -= 1;
        }
    }
}

fn pump(reader: impl Read, sink: &RankSink, stream: Stream) {
    let mut reader = BufReader::with_capacity(64 << 10, reader);
    let mut line = Vec::with_capacity(256);
    let mut out = Vec::with_capacity(256);
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        }
        if !line.ends_with(b"\n") {
            line.push(b'\n'); // last line without a newline
        }
        if let Some(f) = &sink.file {
            let _ = crate::sync::lock(f).write_all(&line);
        }
        if sink.console {
            out.clear();
            out.extend_from_slice(&sink.prefix);
            out.extend_from_slice(&line);
            // A closed console (e.g. `| head`) must not stop the workers: errors are ignored.
            let _ = match stream {
                Stream::Stdout => std::io::stdout().lock().write_all(&out),
                Stream::Stderr => std::io::stderr().lock().write_all(&out),
            };
        }
    }
}
