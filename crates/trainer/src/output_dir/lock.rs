//! `output_dir/.trainer.lock`: one job at a time in an output directory. The main process writes its pid, host and
//! start time there when training starts and deletes the file when training ends, when it fails, and when SIGINT or
//! SIGTERM ends the process ([`super::signals`]). A lock whose process is gone from this host (killed by SIGKILL,
//! a crash, a power cut) is taken over with one warning.

use std::path::{Path, PathBuf};

use super::signals::{release_on_signal, Release};
use crate::error::{Result, TrainerError};

/// Name of the lock file that marks an output directory as used by a running job.
pub const LOCK_NAME: &str = ".trainer.lock";

/// Content of `.trainer.lock`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LockInfo {
    /// Process id of the job's main process.
    pub pid: u32,
    /// Host name of that process.
    pub host: String,
    /// Start time, seconds since the Unix epoch.
    pub started: u64,
}

/// An output directory held by this job: the lock file is removed when this is dropped (end of `train`, also on
/// error) and when SIGINT or SIGTERM ends the process while it is alive (see [`super::signals`]).
#[derive(Debug)]
pub struct OutputDirLock {
    path: PathBuf,
    info: LockInfo,
    /// Dropped after the file is removed (field order), so a signal in between finds nothing to remove.
    _release: Release,
}

impl Drop for OutputDirLock {
    fn drop(&mut self) {
        // Only our own lock: another job may have taken over a lock we lost (e.g. deleted by hand).
        let ours = std::fs::read_to_string(&self.path)
            .ok()
            .and_then(|t| serde_json::from_str::<LockInfo>(&t).ok())
            .is_some_and(|i| i == self.info);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// This machine's host name.
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it on success.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn pid_alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence; EPERM means it exists under another user.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Takes `output_dir/.trainer.lock` for this process (creating `output_dir`). Errors ([`TrainerError::Usage`]) when
/// another job holds it, naming the directory and that job (pid, host), or when the lock cannot be read; a lock left
/// by a process that is no longer running on this host is taken over with one warning (through `tracing`).
/// [`TrainerError::Accel`] ([`accel::AccelError::Io`]) when the directory or the file cannot be created. Main
/// process only.
///
/// While the returned lock is alive, SIGINT and SIGTERM delete the file before they end the process (when their
/// action is the default one; see [`super::signals`]).
pub fn lock_output_dir(output_dir: &Path) -> Result<OutputDirLock> {
    use std::io::Write;
    std::fs::create_dir_all(output_dir)
        .map_err(|e| TrainerError::io(format!("creating output_dir {}", output_dir.display()), e))?;
    let path = output_dir.join(LOCK_NAME);
    let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let info = LockInfo { pid: std::process::id(), host: host_name(), started };
    let text = serde_json::to_string(&info).map_err(|e| TrainerError::json("encoding the lock file", e))?;
    for _ in 0..2 {
        // Registered before the file exists: there is no moment when a signal would leave it behind.
        let release = release_on_signal(&path, text.as_bytes());
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(mut f) => {
                if let Err(e) = f.write_all(text.as_bytes()) {
                    // A half-written lock would read as "cannot be read" to the next job.
                    let _ = std::fs::remove_file(&path);
                    return Err(TrainerError::io(format!("writing {}", path.display()), e));
                }
                return Ok(OutputDirLock { path, info, _release: release });
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                drop(release);
                let held = std::fs::read_to_string(&path).ok().and_then(|t| serde_json::from_str::<LockInfo>(&t).ok());
                match held {
                    Some(other) if other.host == info.host && !pid_alive(other.pid) => {
                        // One warning, through tracing (the binaries print library warnings on stderr).
                        tracing::warn!(
                            "{}: taking over the stale lock of process {} on {}, which is no longer running",
                            output_dir.display(),
                            other.pid,
                            other.host
                        );
                        let _ = std::fs::remove_file(&path);
                    }
                    Some(other) => {
                        return Err(TrainerError::Usage(format!(
                            "output_dir {} is in use by another training job (pid {} on host {}, lock {}); wait \
                             for it to finish or use another output_dir. If that job is gone, delete the lock file",
                            output_dir.display(),
                            other.pid,
                            other.host,
                            path.display()
                        )))
                    }
                    None => {
                        return Err(TrainerError::Usage(format!(
                            "output_dir {} is locked by {} but the lock cannot be read; if no other job uses this \
                             directory, delete the lock file",
                            output_dir.display(),
                            path.display()
                        )))
                    }
                }
            }
            Err(e) => return Err(TrainerError::io(format!("creating {}", path.display()), e)),
        }
    }
    Err(TrainerError::Usage(format!("output_dir {}: could not take the lock {}", output_dir.display(), path.display())))
}
