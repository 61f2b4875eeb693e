//! A worker's final error, printed once: the worker writes it to the file its launcher names in
//! [`ERROR_FILE_ENV`] (torchelastic's `TORCHELASTIC_ERROR_FILE`, which torchrun's `@record` writes), and the
//! launcher prints the report of the first rank that failed, once, after the group has stopped — not the same
//! text from every rank, the launcher and the top level.
//!
//! A program not started by this launcher (plain `cargo run`, `mpirun`, Slurm) has no such variable: its report
//! goes to stderr as before.
//!
//! Reports carry the error's chain of causes but never a backtrace: candle captures one into its errors when
//! `RUST_BACKTRACE=1` is set (common among Rust users: 80 lines per rank for a collective error). Backtraces are
//! for panics, which Rust's panic handler prints itself.

use std::error::Error;
use std::path::Path;

/// Environment variable: the file a launched worker writes its final error report to ([`report_error`]).
pub const ERROR_FILE_ENV: &str = "ACCEL_ERROR_FILE";

/// `Error: {e}` and one `  caused by: {source}` line per cause, with any captured backtrace left out. A cause
/// whose text the message before it already ends with (an error that displays its source, `"{context}:
/// {source}"`) is not repeated.
pub fn error_report(e: &(dyn Error + 'static)) -> String {
    let mut previous = without_backtrace(&e.to_string());
    let mut out = format!("Error: {previous}");
    let mut source = e.source();
    while let Some(s) = source {
        let text = without_backtrace(&s.to_string());
        if !previous.ends_with(&text) {
            out.push_str(&format!("\n  caused by: {text}"));
        }
        previous = text;
        source = s.source();
    }
    out
}

/// The exit status a program should end with after `e`: 128 + the signal number when a launcher in the chain
/// was interrupted by SIGINT / SIGTERM ([`crate::DdpError::Interrupted`]: 130 for Ctrl-C, as a shell reports a process
/// the signal ended), else 1.
pub fn exit_code(e: &(dyn Error + 'static)) -> u8 {
    let mut next: Option<&(dyn Error + 'static)> = Some(e);
    while let Some(err) = next {
        if let Some(crate::DdpError::Interrupted { signal, .. }) = err.downcast_ref::<crate::DdpError>() {
            return u8::try_from(128 + signal).unwrap_or(1);
        }
        next = err.source();
    }
    1
}

/// Reports a program's final error: into the file named by [`ERROR_FILE_ENV`] when a launcher set it (the
/// launcher prints it once), else to stderr. Falls back to stderr when the file cannot be written.
pub fn report_error(e: &(dyn Error + 'static)) {
    report_text(&error_report(e));
}

/// Reports a program's final words (an error report, a rejected command line): into the file named by
/// [`ERROR_FILE_ENV`] when a launcher set it, else (or when the file cannot be written) to stderr.
pub fn report_text(text: &str) {
    let text = text.trim_end();
    if let Some(path) = std::env::var_os(ERROR_FILE_ENV).filter(|p| !p.is_empty()) {
        if std::fs::write(Path::new(&path), format!("{text}\n")).is_ok() {
            return;
        }
    }
    eprintln!("{text}");
}

/// `text` without the frames of a `std::backtrace::Backtrace` rendered into it (candle's `WithBacktrace`
/// displays as `{inner}\n{backtrace}`): the lines from a `   0: …` frame line through the `N: …` / `at …`
/// lines that follow it.
fn without_backtrace(text: &str) -> String {
    let is_frame = |l: &str| {
        let t = l.trim_start();
        let digits = t.bytes().take_while(u8::is_ascii_digit).count();
        (digits > 0 && t[digits..].starts_with(": ") && l.starts_with(' '))
            || (t.starts_with("at ") && l.starts_with("  "))
    };
    let mut kept: Vec<&str> = Vec::new();
    let mut in_backtrace = false;
    for line in text.lines() {
        let starts = line.trim_start().starts_with("0: ") && line.starts_with(' ');
        if starts || (in_backtrace && is_frame(line)) {
            in_backtrace = true;
            continue;
        }
        in_backtrace = false;
        kept.push(line);
    }
    kept.join("\n").trim_end().to_string()
}

/// The report a worker left in `path`, if it wrote one.
pub(crate) fn read_report(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim_end().to_string()).filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(std::io::Error);
    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("all_reduce on group [0, 1] failed")
        }
    }
    impl Error for Outer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_report_has_the_chain_and_no_backtrace() {
        let e = Outer(std::io::Error::other("peer rank 1 closed the connection"));
        assert_eq!(
            error_report(&e),
            "Error: all_reduce on group [0, 1] failed\n  caused by: peer rank 1 closed the connection"
        );
        // candle's WithBacktrace renders `{inner}\n{backtrace}`, whatever RUST_BACKTRACE said when it was captured.
        let shown =
            "collective failed\n   0: candle_core::error::Error::bt\n             at /src/error.rs:260:25\n   1: \
                     ddp_core::functional::wrap\n  12: main\nafter";
        assert_eq!(without_backtrace(shown), "collective failed\nafter");
        assert_eq!(
            without_backtrace("no frames here\n  indented: but not a frame"),
            "no frames here\n  indented: but not a frame"
        );
        let bt = candle_core::Error::Msg("shape mismatch".into());
        let bt = candle_core::Error::WithBacktrace {
            inner: Box::new(bt),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        };
        assert_eq!(error_report(&bt), "Error: shape mismatch");
        // An error that displays its source does not get it repeated as a cause.
        let io = crate::DdpError::io("reading the shard", std::io::Error::other("disk full"));
        assert_eq!(error_report(&io), "Error: reading the shard: disk full");
    }

    #[test]
    fn an_interrupted_launch_exits_as_the_signal_would() {
        let e = crate::DdpError::Interrupted { signal: 2, context: "launcher interrupted by SIGINT".into() };
        assert_eq!(exit_code(&e), 130);
        assert_eq!(exit_code(&crate::DdpError::InvalidArgument("x".into())), 1);
    }
}
