//! A worker's exit status in words, as the launcher reports it ("exit code 3", "killed by signal 9 (SIGKILL)").

/// How a worker process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerExit {
    /// `exit(code)` or a return from `main`.
    Code(i32),
    /// Terminated by a signal; `core_dumped` when the kernel wrote a core file.
    Signal {
        /// Signal number.
        signal: i32,
        /// Whether a core file was written.
        core_dumped: bool,
    },
}

impl WorkerExit {
    /// Whether the worker succeeded (exit code 0).
    pub fn success(&self) -> bool {
        matches!(self, WorkerExit::Code(0))
    }

    /// From the `siginfo_t` filled in by `waitid` for an exited child.
    pub(crate) fn from_siginfo(info: &libc::siginfo_t) -> Self {
        // SAFETY: `waitid` with WEXITED filled `info` for a child state change, so the SIGCHLD fields are valid.
        let status = unsafe { info.si_status() };
        match info.si_code {
            libc::CLD_EXITED => WorkerExit::Code(status),
            libc::CLD_DUMPED => WorkerExit::Signal { signal: status, core_dumped: true },
            _ => WorkerExit::Signal { signal: status, core_dumped: false },
        }
    }
}

impl std::fmt::Display for WorkerExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerExit::Code(c) => write!(f, "exit code {c}"),
            WorkerExit::Signal { signal, core_dumped } => {
                write!(f, "killed by signal {signal}")?;
                match (signal_name(*signal), core_dumped) {
                    (Some(name), false) => write!(f, " ({name})"),
                    (Some(name), true) => write!(f, " ({name}, core dumped)"),
                    (None, true) => write!(f, " (core dumped)"),
                    (None, false) => Ok(()),
                }
            }
        }
    }
}

/// The conventional name of a signal number (`SIGKILL` for 9), for the signals a worker commonly dies of.
pub fn signal_name(signal: i32) -> Option<&'static str> {
    Some(match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_in_words() {
        assert_eq!(WorkerExit::Code(3).to_string(), "exit code 3");
        assert_eq!(WorkerExit::Signal { signal: 9, core_dumped: false }.to_string(), "killed by signal 9 (SIGKILL)");
        assert_eq!(
            WorkerExit::Signal { signal: libc::SIGSEGV, core_dumped: true }.to_string(),
            format!("killed by signal {} (SIGSEGV, core dumped)", libc::SIGSEGV)
        );
        assert_eq!(WorkerExit::Signal { signal: 64, core_dumped: false }.to_string(), "killed by signal 64");
        assert!(WorkerExit::Code(0).success() && !WorkerExit::Code(1).success());
    }
}
