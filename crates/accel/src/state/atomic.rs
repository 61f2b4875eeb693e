//! Atomic file writes (the implementation is accel-nn's [`accel_nn::state::write_atomic`], shared with the
//! optimizers' saved state), with accel's error type.

use std::path::Path;

use crate::error::Result;

pub(crate) use accel_nn::state::sync_dir;

/// Writes `bytes` to `path` so that a reader (or a crash) sees either the previous file or the complete new one,
/// never a partial write: the bytes go to a hidden temporary file in the same directory (same file system, so the
/// rename is atomic), which is flushed to disk (`fsync`), renamed over `path`, and the directory entry is flushed
/// too (best effort, Unix only) so the rename survives a power loss.
///
/// Errors: an I/O error naming the file and the step that failed (create, write, sync, rename); the temporary file
/// is removed on failure.
pub fn write_atomic(path: &Path, bytes: impl AsRef<[u8]>) -> Result<()> {
    Ok(accel_nn::state::write_atomic(path, bytes)?)
}
