//! Checkpoint directories on disk: automatic names (`checkpoint_{i}`, Accelerate's `ProjectConfiguration`
//! scheme), finding the newest, rotation to a total limit, and the atomic commit of a directory written under a
//! temporary name.
//!
//! Atomicity: a checkpoint is written into `.{name}.partial` next to its final place and renamed to `{name}` only
//! once complete. `rename(2)` within one file system is atomic, so a crash leaves either the previous state or
//! the complete new one under the final name, never a half-written directory. Replacing an existing directory
//! takes two renames (old → `.{name}.old`, partial → `{name}`); a crash between them leaves the previous
//! checkpoint complete under `.{name}.old`.

use std::path::{Path, PathBuf};

use crate::error::{AccelError, Result};

/// Sub-directory of `project_dir` that holds automatically named checkpoints.
pub const CHECKPOINTS_SUBDIR: &str = "checkpoints";
/// The file every complete checkpoint has; its presence marks a directory as a checkpoint.
pub const ACCELERATOR_FILE: &str = "accelerator.json";
/// Prefix of automatically named checkpoints: `checkpoint_0`, `checkpoint_1`, …
pub const CHECKPOINT_PREFIX: &str = "checkpoint_";

/// `checkpoint_{index}`.
pub fn checkpoint_name(index: usize) -> String {
    format!("{CHECKPOINT_PREFIX}{index}")
}

/// The automatically named checkpoints under `root`, sorted by index (oldest first). A missing `root` has none;
/// temporary (`.…partial`) and unrelated entries are ignored.
pub fn list_checkpoints(root: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(AccelError::io(format!("listing checkpoints in {}", root.display()), e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| AccelError::io(format!("listing checkpoints in {}", root.display()), e))?;
        let name = entry.file_name();
        let Some(index) = name.to_str().and_then(|n| n.strip_prefix(CHECKPOINT_PREFIX)).and_then(|i| i.parse().ok())
        else {
            continue;
        };
        if entry.path().is_dir() {
            found.push((index, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// The checkpoint with the highest index under `root`, if any.
pub fn newest_checkpoint(root: &Path) -> Result<Option<PathBuf>> {
    Ok(list_checkpoints(root)?.pop().map(|(_, p)| p))
}

/// The index the next automatic checkpoint gets: one past the highest existing, or 0.
pub fn next_checkpoint_index(root: &Path) -> Result<usize> {
    Ok(list_checkpoints(root)?.last().map_or(0, |(i, _)| i + 1))
}

/// Deletes the oldest automatic checkpoints under `root` until at most `total_limit` remain; returns the deleted
/// directories.
pub fn rotate_checkpoints(root: &Path, total_limit: usize) -> Result<Vec<PathBuf>> {
    let all = list_checkpoints(root)?;
    let excess = all.len().saturating_sub(total_limit);
    let mut removed = Vec::new();
    for (_, path) in all.into_iter().take(excess) {
        std::fs::remove_dir_all(&path)
            .map_err(|e| AccelError::io(format!("removing old checkpoint {} (total_limit)", path.display()), e))?;
        removed.push(path);
    }
    Ok(removed)
}

/// Where the checkpoint for `final_dir` is written before the commit: `.{name}.partial` in the same parent (the
/// same file system, so the rename is atomic).
pub fn partial_dir(final_dir: &Path) -> PathBuf {
    sibling(final_dir, "partial")
}

fn sibling(final_dir: &Path, suffix: &str) -> PathBuf {
    let name = final_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "checkpoint".into());
    final_dir.with_file_name(format!(".{name}.{suffix}"))
}

/// Removes a directory tree if it exists.
pub(crate) fn remove_if_exists(dir: &Path) -> Result<()> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(AccelError::io(format!("removing {}", dir.display()), e)),
    }
}

/// Gives the complete directory `partial` its final name `final_dir`, replacing an existing one.
pub(crate) fn commit(partial: &Path, final_dir: &Path) -> Result<()> {
    let ctx = |what: &str, e| AccelError::io(format!("{what} while committing checkpoint {}", final_dir.display()), e);
    if final_dir.exists() {
        let old = sibling(final_dir, "old");
        remove_if_exists(&old)?;
        std::fs::rename(final_dir, &old).map_err(|e| ctx("moving the previous checkpoint aside", e))?;
        std::fs::rename(partial, final_dir).map_err(|e| ctx("renaming the new checkpoint", e))?;
        remove_if_exists(&old)?;
    } else {
        std::fs::rename(partial, final_dir).map_err(|e| ctx("renaming the new checkpoint", e))?;
    }
    super::atomic::sync_dir(final_dir.parent());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn naming_listing_and_rotation() {
        let root = tempfile::tempdir().unwrap();
        assert_eq!(next_checkpoint_index(root.path()).unwrap(), 0);
        for i in [0, 1, 2, 10] {
            std::fs::create_dir(root.path().join(checkpoint_name(i))).unwrap();
        }
        std::fs::create_dir(root.path().join(".checkpoint_11.partial")).unwrap();
        std::fs::write(root.path().join("checkpoint_12"), "a file, not a checkpoint").unwrap();
        assert_eq!(next_checkpoint_index(root.path()).unwrap(), 11);
        assert_eq!(newest_checkpoint(root.path()).unwrap().unwrap(), root.path().join("checkpoint_10"));
        let removed = rotate_checkpoints(root.path(), 2).unwrap();
        assert_eq!(removed, vec![root.path().join("checkpoint_0"), root.path().join("checkpoint_1")]);
        let left: Vec<usize> = list_checkpoints(root.path()).unwrap().into_iter().map(|(i, _)| i).collect();
        assert_eq!(left, vec![2, 10]);
    }

    #[test]
    fn commit_replaces_an_existing_directory() {
        let root = tempfile::tempdir().unwrap();
        let fin = root.path().join("ckpt");
        std::fs::create_dir(&fin).unwrap();
        std::fs::write(fin.join("old.txt"), "old").unwrap();
        let part = partial_dir(&fin);
        assert_eq!(part, root.path().join(".ckpt.partial"));
        std::fs::create_dir(&part).unwrap();
        std::fs::write(part.join("new.txt"), "new").unwrap();
        commit(&part, &fin).unwrap();
        assert!(fin.join("new.txt").is_file() && !fin.join("old.txt").exists());
        assert!(!part.exists() && !root.path().join(".ckpt.old").exists());
    }
}
