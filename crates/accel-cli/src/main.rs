//! The `accel` command: `accel config`, `accel launch`, `accel test`, `accel env`.
//!
//! Thin on purpose: parse the command line, hand it to [`accel_cli::run`], print the error chain and set the exit
//! status (0 success, 1 failure, 2 usage error from clap).

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = accel_cli::Cli::parse();
    match accel_cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("accel: error: {e}");
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                eprintln!("  caused by: {s}");
                source = s.source();
            }
            ExitCode::FAILURE
        }
    }
}
