//! The study file: one JSON object per line (`study.jsonl`), appended as things happen — the study's
//! configuration, each trial's start (number, parameters, output directory), its reports (step, value) and its
//! end (state, value, checkpoint, error). Every record is one `write` of a whole line on a file opened in append
//! mode, then flushed, so the driver and the trial processes can append to the same file (on a local file system
//! appends of a line do not interleave); reading it back rebuilds the study ([`StudyView`]).
//!
//! A kill can leave a torn last line: reading ignores it, and [`Journal::repair`] (called when a study is
//! resumed) cuts it off before anything new is appended. A trial that started but never ended is re-run with
//! its recorded parameters; a later `trial_start` of the same number discards the earlier attempt's reports.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::space::Params;
use super::StudyConfig;
use crate::error::{Result, TrainerError};

/// Where a trial stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrialState {
    /// Started, not ended (or interrupted with the study).
    Running,
    /// Ran to the end; its value counts for the best trial.
    Complete,
    /// Stopped by the pruner; its reports and last value are kept, it never counts as the best.
    Pruned,
    /// The objective failed (error, panic, or its processes exited non-zero).
    Failed,
}

impl std::fmt::Display for TrialState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TrialState::Running => "running",
            TrialState::Complete => "complete",
            TrialState::Pruned => "pruned",
            TrialState::Failed => "failed",
        })
    }
}

/// One line of the study file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Record {
    /// The first line: what is searched and how.
    Study {
        /// Space, direction, metric, sampler, pruner.
        config: StudyConfig,
    },
    /// A trial (re)starts.
    TrialStart {
        /// Trial number (0, 1, ...).
        trial: u64,
        /// Its parameters.
        params: Params,
        /// Its own output directory.
        output_dir: PathBuf,
    },
    /// An intermediate value of a trial (e.g. an evaluation's metric at an optimizer step).
    Report {
        /// Trial number.
        trial: u64,
        /// Step (the Trainer reports its global optimizer step).
        step: u64,
        /// The value; `null` when it was not finite (a diverged run).
        value: Option<f64>,
    },
    /// A trial ends.
    TrialEnd {
        /// Trial number.
        trial: u64,
        /// Complete, pruned or failed.
        state: TrialState,
        /// The objective (complete), the last report (pruned), none (failed).
        value: Option<f64>,
        /// The failure, for failed trials.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
        /// The trial's best (or final) checkpoint / weights, when the objective kept one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        checkpoint: Option<PathBuf>,
        /// MASTER_PORT of the trial's process group (multi-process trials, or any trial run by the launcher).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        master_port: Option<u16>,
        /// Processes that ran the trial.
        world_size: usize,
        /// Wall time of the objective, seconds.
        wall_s: f64,
    },
}

/// A trial rebuilt from the study file.
#[derive(Debug, Clone, PartialEq)]
pub struct TrialRecord {
    /// Trial number.
    pub number: u64,
    /// Its parameters.
    pub params: Params,
    /// Its output directory.
    pub output_dir: PathBuf,
    /// Where it stands.
    pub state: TrialState,
    /// Objective (complete) or last report (pruned).
    pub value: Option<f64>,
    /// Reports in order: (step, value; `None` = not finite).
    pub reports: Vec<(u64, Option<f64>)>,
    /// Failure message.
    pub error: Option<String>,
    /// Kept checkpoint.
    pub checkpoint: Option<PathBuf>,
    /// MASTER_PORT of its process group.
    pub master_port: Option<u16>,
    /// Processes.
    pub world_size: usize,
    /// Wall time, seconds.
    pub wall_s: f64,
}

impl TrialRecord {
    /// The last finite report.
    pub fn last_report(&self) -> Option<f64> {
        self.reports.iter().rev().find_map(|r| r.1)
    }

    /// Whether the trial has ended.
    pub fn is_finished(&self) -> bool {
        self.state != TrialState::Running
    }
}

/// The study as the file describes it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StudyView {
    /// The configuration line, if written.
    pub config: Option<StudyConfig>,
    /// Trials by number.
    pub trials: BTreeMap<u64, TrialRecord>,
    /// Whether the file ended with a torn (unterminated) line, which was ignored.
    pub torn_tail: bool,
    /// Lines that could not be parsed (other than a torn tail), ignored.
    pub bad_lines: usize,
}

impl StudyView {
    /// Rebuilds the study from its records, in file order.
    pub fn from_records(records: impl IntoIterator<Item = Record>) -> Self {
        let mut view = StudyView::default();
        for r in records {
            view.apply(r);
        }
        view
    }

    fn apply(&mut self, r: Record) {
        match r {
            Record::Study { config } => self.config = Some(config),
            Record::TrialStart { trial, params, output_dir } => {
                self.trials.insert(
                    trial,
                    TrialRecord {
                        number: trial,
                        params,
                        output_dir,
                        state: TrialState::Running,
                        value: None,
                        reports: Vec::new(),
                        error: None,
                        checkpoint: None,
                        master_port: None,
                        world_size: 1,
                        wall_s: 0.0,
                    },
                );
            }
            Record::Report { trial, step, value } => {
                if let Some(t) = self.trials.get_mut(&trial).filter(|t| !t.is_finished()) {
                    t.reports.push((step, value));
                }
            }
            Record::TrialEnd { trial, state, value, error, checkpoint, master_port, world_size, wall_s } => {
                // The first end wins: the driver only adds a `failed` end when the trial wrote none.
                if let Some(t) = self.trials.get_mut(&trial).filter(|t| !t.is_finished()) {
                    t.state = state;
                    t.value = value;
                    t.error = error;
                    t.checkpoint = checkpoint;
                    t.master_port = master_port;
                    t.world_size = world_size;
                    t.wall_s = wall_s;
                }
            }
        }
    }

    /// Trials in a state.
    pub fn in_state(&self, state: TrialState) -> impl Iterator<Item = &TrialRecord> {
        self.trials.values().filter(move |t| t.state == state)
    }
}

/// Append-only access to a study file.
#[derive(Debug, Clone)]
pub struct Journal {
    path: PathBuf,
}

impl Journal {
    /// The journal at `path` (created on the first append).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Journal { path: path.into() }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one record as one line (a single write, then flush).
    pub fn append(&self, record: &Record) -> Result<()> {
        let mut line = serde_json::to_string(record).map_err(|e| TrainerError::json("encoding a study record", e))?;
        line.push('\n');
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .map_err(|e| TrainerError::io(format!("opening the study file {}", self.path.display()), e))?;
        f.write_all(line.as_bytes())
            .and_then(|_| f.flush())
            .map_err(|e| TrainerError::io(format!("appending to the study file {}", self.path.display()), e))
    }

    /// Reads the study (an absent file is an empty study). A torn last line and unparseable lines are skipped.
    pub fn load(&self) -> Result<StudyView> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(StudyView::default()),
            Err(e) => return Err(TrainerError::io(format!("reading the study file {}", self.path.display()), e)),
        };
        let text = String::from_utf8_lossy(&bytes);
        let (complete, tail) = match text.rfind('\n') {
            Some(i) => (&text[..i], &text[i + 1..]),
            None => ("", &text[..]),
        };
        let mut bad = 0;
        let records: Vec<Record> = complete
            .lines()
            .filter(|l| !l.trim().is_empty())
            .filter_map(|l| match serde_json::from_str(l) {
                Ok(r) => Some(r),
                Err(e) => {
                    tracing::warn!("study file {}: skipping an unreadable line ({e})", self.path.display());
                    bad += 1;
                    None
                }
            })
            .collect();
        let mut view = StudyView::from_records(records);
        view.torn_tail = !tail.trim().is_empty();
        view.bad_lines = bad;
        Ok(view)
    }

    /// Cuts a torn last line (from a killed study) so that the next record starts on a line of its own; returns
    /// whether something was cut.
    pub fn repair(&self) -> Result<bool> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(TrainerError::io(format!("reading the study file {}", self.path.display()), e)),
        };
        if bytes.is_empty() || bytes.ends_with(b"\n") {
            return Ok(false);
        }
        let keep = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&self.path)
            .map_err(|e| TrainerError::io(format!("opening the study file {}", self.path.display()), e))?;
        f.set_len(keep as u64)
            .map_err(|e| TrainerError::io(format!("truncating the torn line of {}", self.path.display()), e))?;
        Ok(true)
    }
}
