//! Atomic file writes: the one place that knows the temp-file, fsync, rename, fsync-the-directory sequence.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{NnError, Result};

/// Writes `bytes` to `path` so that a reader (or a crash) sees either the previous file or the complete new one,
/// never a partial write: the bytes go to a hidden temporary file in the same directory (same file system, so the
/// rename is atomic), which is flushed to disk (`fsync`), renamed over `path`, and the directory entry is flushed
/// too (best effort, Unix only) so the rename survives a power loss.
///
/// Errors: [`NnError::Io`] naming the file and the step that failed (create, write, sync, rename); the temporary
/// file is removed on failure.
pub fn write_atomic(path: &Path, bytes: impl AsRef<[u8]>) -> Result<()> {
    let tmp = temp_sibling(path);
    let written = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes.as_ref())?;
        f.sync_all()
    })();
    let renamed = written.map_err(|e| NnError::io(format!("writing {}", tmp.display()), e)).and_then(|()| {
        std::fs::rename(&tmp, path)
            .map_err(|e| NnError::io(format!("renaming {} to {}", tmp.display(), path.display()), e))
    });
    if renamed.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    renamed?;
    sync_dir(path.parent());
    Ok(())
}

/// `.{file name}.tmp` next to `path`.
fn temp_sibling(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp"))
}

/// Flushes a directory entry to disk so a rename into it survives a power loss (best effort; not on every OS).
pub fn sync_dir(dir: Option<&Path>) {
    #[cfg(unix)]
    if let Some(dir) = dir {
        // An empty parent means the current directory.
        let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
        if let Ok(f) = std::fs::File::open(dir) {
            let _ = f.sync_all();
        }
    }
    #[cfg(not(unix))]
    let _ = dir;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        write_atomic(&path, b"old").unwrap();
        write_atomic(&path, "new\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new\n");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["state.json"]);
    }

    #[test]
    fn a_missing_directory_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let e = write_atomic(&dir.path().join("no/such/file.json"), b"x").unwrap_err().to_string();
        assert!(e.contains("writing") && e.contains(".file.json.tmp"), "{e}");
    }
}
