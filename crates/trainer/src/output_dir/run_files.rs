//! One run, one set of files. A run writes, in `output_dir`: its checkpoints, `trainer_state.json`,
//! `training_args.yaml`, `training_curves.{png,svg}` (and `model.safetensors` when the program saves the model there);
//! and its trackers' folder `logging_dir/run_name` (`metrics.jsonl`, which a tracker appends to, and TensorBoard
//! event files). A new run in a directory holding any of them would mix with them — append its metrics to the old
//! run's, or leave the old run's curves beside its own state when it plots nothing — so it is refused unless it
//! resumes that run or `overwrite_output_dir` deletes them first. HF's example scripts refuse a non-empty output
//! directory the same way ("Output directory ... already exists and is not empty. Use --overwrite_output_dir").

use std::path::{Path, PathBuf};

use crate::checkpoint::sorted_checkpoints;
use crate::error::{Result, TrainerError};
use crate::state::TRAINER_STATE_NAME;

/// The files a run writes directly in `output_dir` (besides its checkpoints and its trackers' folder).
pub const RUN_FILES: &[&str] =
    &[TRAINER_STATE_NAME, "training_args.yaml", "training_curves.png", "training_curves.svg", "model.safetensors"];

/// At most this many names in the refusal (the rest are counted).
const NAMED: usize = 8;

/// Another run's files in `output_dir` (and its trackers' folder `tracker_dir`, when not empty): checkpoints first,
/// in step order.
pub fn other_run_files(output_dir: &Path, tracker_dir: &Path) -> Result<Vec<PathBuf>> {
    let mut found = sorted_checkpoints(output_dir, None)?;
    found.extend(RUN_FILES.iter().map(|name| output_dir.join(name)).filter(|p| p.exists()));
    let tracker_used = std::fs::read_dir(tracker_dir).is_ok_and(|mut entries| entries.next().is_some());
    if tracker_used {
        found.push(tracker_dir.to_path_buf());
    }
    Ok(found)
}

/// Refuses to start a new run in an `output_dir` that holds another run's files (see the module documentation),
/// unless the run resumes (`resuming`) or `overwrite` is set; with `overwrite` those files are deleted first and
/// returned. `tracker_dir` is the run's `logging_dir/run_name` ([`crate::TrainingArguments::tracker_dir`]). Main
/// process only.
///
/// Errors: [`TrainerError::InvalidArgument`] (`output_dir`) naming the directory, the files and the ways out
/// (resume when there is a checkpoint, `overwrite_output_dir`, another `output_dir`); [`TrainerError::Accel`]
/// ([`accel::AccelError::Io`]) when a file cannot be listed or deleted.
pub fn check_output_dir(
    output_dir: &Path,
    tracker_dir: &Path,
    resuming: bool,
    overwrite: bool,
) -> Result<Vec<PathBuf>> {
    if resuming {
        return Ok(Vec::new());
    }
    let old = other_run_files(output_dir, tracker_dir)?;
    if old.is_empty() {
        return Ok(Vec::new());
    }
    if !overwrite {
        return Err(TrainerError::invalid("output_dir", refusal(output_dir, tracker_dir, &old)));
    }
    for path in &old {
        let removed = if path.is_dir() { std::fs::remove_dir_all(path) } else { std::fs::remove_file(path) };
        removed.map_err(|e| {
            TrainerError::io(format!("deleting {} of the previous run (overwrite_output_dir)", path.display()), e)
        })?;
    }
    Ok(old)
}

/// The refusal's text: what is there, and what the user can do about it.
fn refusal(output_dir: &Path, tracker_dir: &Path, old: &[PathBuf]) -> String {
    let mut names: Vec<String> = old
        .iter()
        .take(NAMED)
        .map(|p| p.strip_prefix(output_dir).map_or_else(|_| p.display().to_string(), |r| r.display().to_string()))
        .collect();
    if old.len() > NAMED {
        names.push(format!("and {} more", old.len() - NAMED));
    }
    let resumable = old.iter().any(|p| crate::checkpoint::step_of(p).is_some());
    let shared_logging_dir = !tracker_dir.starts_with(output_dir);
    let elsewhere = if shared_logging_dir {
        "; or use another output_dir and another run_name (logging_dir is outside output_dir)"
    } else {
        "; or use another output_dir"
    };
    if resumable {
        format!(
            "{} already holds another run's files ({}); a new run would mix with them. Either resume that run \
             (resume_from_checkpoint = \"latest\", --resume-from-checkpoint latest), or delete them and start over \
             (overwrite_output_dir = true, --overwrite-output-dir true){elsewhere}",
            output_dir.display(),
            names.join(", ")
        )
    } else {
        format!(
            "{} already holds another run's files ({}) and no checkpoint to resume it from; a new run would mix \
             with them (its metrics appended to theirs). Delete them and start over (overwrite_output_dir = true, \
             --overwrite-output-dir true){elsewhere}",
            output_dir.display(),
            names.join(", ")
        )
    }
}
