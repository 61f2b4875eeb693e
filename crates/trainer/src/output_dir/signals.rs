//! Releasing the output-directory locks this process holds when SIGINT or SIGTERM ends it (Ctrl-C, `kill`, a batch
//! system's stop, ddp-core's launcher forwarding either to its workers).
//!
//! Without this, a killed run leaves `.trainer.lock` behind and the next run has to take over a stale lock. While
//! at least one lock is held (a `Release` alive), SIGINT and SIGTERM run `on_signal`: it deletes every held lock
//! file that still holds this process's content, then re-raises the signal with its default action, so the process
//! ends exactly as it would have without the handler (killed by the signal: a shell shows 130 / 143, a parent's
//! `wait` sees the signal).
//!
//! A process-wide handler is the only way to act on these signals; the Trainer keeps it as narrow as it can:
//! - it is installed for a signal only when that signal's action is the default (terminate) as the first lock is
//!   taken: a program that ignores the signal (`nohup`, a background job) or handles it itself (e.g. to stop
//!   training gracefully) keeps its own behaviour, and its lock is released when `train` returns;
//! - the previous action comes back when the last lock is released (unless the program replaced ours meanwhile).
//!
//! Everything the handler does is async-signal-safe (atomic loads, `open`, `read`, `close`, `unlink`, `signal`,
//! `raise`). What it reads is never freed (a few hundred bytes per lock taken): it may run at any moment on any
//! thread, including while another thread releases a lock.

use std::ffi::CString;
use std::path::Path;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Mutex;

/// The signals whose default action ends the process and that a user or a launcher sends to stop a run.
const RELEASED_ON: [libc::c_int; 2] = [libc::SIGINT, libc::SIGTERM];

/// Locks held at once by one process (more trainers than this in one process keep their locks on a signal,
/// with a warning; the stale-lock takeover still recovers them).
const SLOTS: usize = 64;

/// The handler reads at most this many bytes of a lock file (a lock's JSON is under 400 bytes: the host name is at
/// most 255).
const MAX_CONTENT: usize = 1024;

/// A held lock as the handler sees it: the file and the exact bytes this process wrote into it.
struct HeldLock {
    path: CString,
    content: Box<[u8]>,
}

/// The held locks; null = free slot. A pointer stored here is never freed (see the module documentation).
static HELD: [AtomicPtr<HeldLock>; SLOTS] = [const { AtomicPtr::new(std::ptr::null_mut()) }; SLOTS];

/// How many locks are registered, and the actions `on_signal` replaced (restored when the count returns to 0).
struct Installed {
    count: usize,
    previous: Vec<(libc::c_int, libc::sigaction)>,
}

static INSTALLED: Mutex<Installed> = Mutex::new(Installed { count: 0, previous: Vec::new() });

/// While alive, a SIGINT or SIGTERM that would kill the process first deletes the lock file it was made for (if the
/// file still holds the same content). Dropping it unregisters the lock.
#[derive(Debug)]
pub(super) struct Release {
    slot: Option<usize>,
}

/// Registers the lock file `path` holding exactly `content` (call before creating the file, so there is no moment
/// when the file exists unprotected).
pub(super) fn release_on_signal(path: &Path, content: &[u8]) -> Release {
    let unprotected = |why: &str| {
        tracing::warn!("{}: {why}; the lock is not released if SIGINT/SIGTERM ends this process", path.display());
        Release { slot: None }
    };
    let Ok(c_path) = CString::new(path.as_os_str().as_encoded_bytes()) else {
        return unprotected("the path holds a NUL byte");
    };
    if content.len() > MAX_CONTENT {
        return unprotected("the lock's content is unexpectedly long");
    }
    let mut installed = crate::lock(&INSTALLED);
    let Some(slot) = HELD.iter().position(|s| s.load(Ordering::SeqCst).is_null()) else {
        return unprotected(&format!("this process already holds {SLOTS} output-directory locks"));
    };
    let held = Box::leak(Box::new(HeldLock { path: c_path, content: content.into() }));
    HELD[slot].store(held, Ordering::SeqCst);
    if installed.count == 0 {
        installed.previous = install();
    }
    installed.count += 1;
    Release { slot: Some(slot) }
}

impl Drop for Release {
    fn drop(&mut self) {
        let Some(slot) = self.slot else { return };
        let mut installed = crate::lock(&INSTALLED);
        HELD[slot].store(std::ptr::null_mut(), Ordering::SeqCst);
        installed.count -= 1;
        if installed.count == 0 {
            for (signal, old) in installed.previous.drain(..) {
                // SAFETY: plain sigaction calls on valid structs; `old` is what sigaction returned for this signal.
                unsafe {
                    let mut current: libc::sigaction = std::mem::zeroed();
                    libc::sigaction(signal, std::ptr::null(), &mut current);
                    // Only our own handler is put back: one the program installed since is left alone.
                    if current.sa_sigaction == handler_address() {
                        libc::sigaction(signal, &old, std::ptr::null_mut());
                    }
                }
            }
        }
    }
}

fn handler_address() -> libc::sighandler_t {
    on_signal as *const () as libc::sighandler_t
}

/// Installs `on_signal` for each of [`RELEASED_ON`] whose current action is the default; returns the replaced
/// actions.
fn install() -> Vec<(libc::c_int, libc::sigaction)> {
    let mut replaced = Vec::new();
    for signal in RELEASED_ON {
        // SAFETY: a zeroed sigaction is a valid "no handler, no flags, empty mask" value; `on_signal` is
        // async-signal-safe (module documentation).
        unsafe {
            let mut current: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(signal, std::ptr::null(), &mut current) != 0 || current.sa_sigaction != libc::SIG_DFL {
                continue;
            }
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = handler_address();
            action.sa_flags = libc::SA_RESTART;
            // A SIGTERM arriving while a SIGINT is handled (or the reverse) waits until the locks are gone.
            libc::sigemptyset(&mut action.sa_mask);
            for s in RELEASED_ON {
                libc::sigaddset(&mut action.sa_mask, s);
            }
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(signal, &action, &mut old) == 0 {
                replaced.push((signal, old));
            }
        }
    }
    replaced
}

/// Deletes the held locks, then ends the process by the same signal with its default action.
extern "C" fn on_signal(signal: libc::c_int) {
    for slot in &HELD {
        let held = slot.load(Ordering::SeqCst);
        if !held.is_null() {
            // SAFETY: a registered pointer comes from `Box::leak` and is never freed.
            unsafe { remove_if_ours(&*held) };
        }
    }
    // SAFETY: `signal` and `raise` are async-signal-safe. The raised signal is blocked while this handler runs
    // (no SA_NODEFER) and is delivered, with the default action, as soon as it returns.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        libc::raise(signal);
    }
}

/// Unlinks `held.path` if it still holds `held.content`: another job may have taken over a lock that was deleted
/// by hand. Async-signal-safe: no allocation, only `open`, `read`, `close` and `unlink`.
///
/// # Safety
/// `held.path` is a valid C string (it is a `CString`).
unsafe fn remove_if_ours(held: &HeldLock) {
    let fd = libc::open(held.path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
    if fd < 0 {
        return;
    }
    // One byte more than any registered content: a longer file is not ours.
    let mut buf = [0u8; MAX_CONTENT + 1];
    let mut len = 0usize;
    while len < buf.len() {
        let n = libc::read(fd, buf[len..].as_mut_ptr().cast(), buf.len() - len);
        if n <= 0 {
            break;
        }
        len += n as usize;
    }
    libc::close(fd);
    if buf[..len] == *held.content {
        libc::unlink(held.path.as_ptr());
    }
}
