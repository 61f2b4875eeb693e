//! Catching SIGINT/SIGTERM sent to the launcher (Ctrl-C, `kill`, a batch system) so it can stop its workers
//! before returning, instead of dying and leaving them running.
//!
//! The handler only bumps an atomic counter (async-signal-safe); the launcher's wait loop polls it. Handlers are
//! installed while at least one `launch` runs in the process and the previous ones restored after the last.

use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::Mutex;

static RECEIVED: AtomicU64 = AtomicU64::new(0);
static LAST_SIGNAL: AtomicI32 = AtomicI32::new(0);

const CAUGHT: [libc::c_int; 2] = [libc::SIGINT, libc::SIGTERM];

/// Handlers that were in place before ours, and how many launches need ours.
struct Installed {
    users: usize,
    previous: Vec<(libc::c_int, libc::sigaction)>,
}

static INSTALLED: Mutex<Installed> = Mutex::new(Installed { users: 0, previous: Vec::new() });

extern "C" fn on_signal(signal: libc::c_int) {
    LAST_SIGNAL.store(signal, Ordering::SeqCst);
    RECEIVED.fetch_add(1, Ordering::SeqCst);
}

/// While alive, SIGINT and SIGTERM are caught; [`SignalGuard::received`] tells whether one arrived since the
/// guard was made.
pub(crate) struct SignalGuard {
    baseline: u64,
}

impl SignalGuard {
    /// Installs the handlers (first user) and starts counting from now.
    pub(crate) fn install() -> std::io::Result<Self> {
        let mut installed = crate::sync::lock(&INSTALLED);
        if installed.users == 0 {
            let mut previous = Vec::new();
            for signal in CAUGHT {
                // SAFETY: a zeroed sigaction is a valid "no flags, empty mask" value; `on_signal` is
                // async-signal-safe (two atomic stores).
                unsafe {
                    let mut action: libc::sigaction = std::mem::zeroed();
                    action.sa_sigaction = on_signal as *const () as libc::sighandler_t;
                    action.sa_flags = libc::SA_RESTART;
                    libc::sigemptyset(&mut action.sa_mask);
                    let mut old: libc::sigaction = std::mem::zeroed();
                    if libc::sigaction(signal, &action, &mut old) != 0 {
                        let err = std::io::Error::last_os_error();
                        for (s, old) in &previous {
                            libc::sigaction(*s, old, std::ptr::null_mut());
                        }
                        return Err(err);
                    }
                    previous.push((signal, old));
                }
            }
            installed.previous = previous;
        }
        installed.users += 1;
        Ok(SignalGuard { baseline: RECEIVED.load(Ordering::SeqCst) })
    }

    /// How many signals arrived since the guard was made (0 = none).
    pub(crate) fn count(&self) -> u64 {
        RECEIVED.load(Ordering::SeqCst) - self.baseline
    }

    /// The last signal received, if any arrived since the guard was made.
    pub(crate) fn received(&self) -> Option<libc::c_int> {
        (self.count() > 0).then(|| LAST_SIGNAL.load(Ordering::SeqCst))
    }
}

impl Drop for SignalGuard {
    fn drop(&mut self) {
        let mut installed = crate::sync::lock(&INSTALLED);
        installed.users -= 1;
        if installed.users == 0 {
            for (signal, old) in installed.previous.drain(..) {
                // SAFETY: restoring the action `sigaction` returned for this signal.
                unsafe {
                    libc::sigaction(signal, &old, std::ptr::null_mut());
                }
            }
        }
    }
}
