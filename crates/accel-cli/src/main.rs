//! The `accel` command: `accel config`, `accel launch`, `accel test`, `accel env`.
//!
//! Thin on purpose: parse the command line, hand it to [`accel_cli::run`], print the error chain and set the exit
//! status (0 success, 1 failure, 2 usage error from clap).

use clap::Parser;
use std::process::ExitCode;

/// Global allocator: mimalloc keeps freed blocks for reuse, where glibc's malloc returns large ones to the kernel
/// and faults them in again on the next step (candle allocates every temporary anew: thousands of page faults per
/// training step). Measured in docs/benchmarks.md ("Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = accel_cli::Cli::parse();
    // Warnings from the libraries (and the config-file reader) reach the user; RUST_LOG overrides the level.
    accel::logging::init_default();
    match accel_cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if std::env::var_os(ddp_core::launcher::ERROR_FILE_ENV).is_some() {
                // A worker of `accel test`: its launcher prints the report once.
                ddp_core::launcher::report_error(&e);
            } else {
                // The chain of causes, no backtrace (those are for panics).
                let report = ddp_core::launcher::error_report(&e);
                eprintln!("accel: {}", report.replacen("Error:", "error:", 1));
            }
            // 130 / 143 when Ctrl-C or SIGTERM stopped the launch (as for a process the signal ended), else 1.
            // (`CliError::Ddp` is transparent: its source is the launcher error's source, so look at the error itself.)
            ExitCode::from(match &e {
                accel_cli::CliError::Ddp(d) => ddp_core::launcher::exit_code(d),
                e => ddp_core::launcher::exit_code(e),
            })
        }
    }
}
