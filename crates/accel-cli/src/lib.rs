//! The internals of the `accel` binary (`src/main.rs` only parses [`Cli`] and calls [`run`]). This library target
//! exists so the crate's integration tests can reach the config-file parser and the launch plan: it is not a public
//! API and is not published. Only this crate of the accel family knows clap and Accelerate's YAML config files.
//!
//!
//! - `accel config` ([`questionnaire`]) / `accel config default`: write Accelerate's YAML config
//!   ([`config_file`]) to `$HF_HOME/accelerate/default_config.yaml` or `--config-file`, atomically.
//! - `accel launch` ([`launch`]): flags > config file > defaults, then [`ddp_core::launch`].
//! - `accel test` ([`self_test`]): distributed self-check with a PASS/FAIL table.
//! - `accel env` ([`env_report`]): versions, hardware, active config.
//!
//! Warnings (unknown config keys, ignored Accelerate features) go to stderr as `accel: warning: ...`; errors are
//! returned as [`CliError`] and printed by the binary, which exits with status 1 (2 for usage errors, from clap).

// Hidden from the documentation: these modules are the binary's internals, not a public API. The library target
// exists only so that the integration tests (tests/) reach them; `src/main.rs` is their one real user.
#[doc(hidden)]
pub mod args;
#[doc(hidden)]
pub mod config_file;
#[doc(hidden)]
pub mod env_report;
#[doc(hidden)]
pub mod error;
#[doc(hidden)]
pub mod hardware;
#[doc(hidden)]
pub mod launch;
/// Accelerate's `parallelism_config` YAML block, to and from accel's `ParallelismConfig`.
pub mod parallelism_block;
#[doc(hidden)]
pub mod questionnaire;
#[doc(hidden)]
pub mod self_test;

pub use args::{Cli, Command, ConfigAction, ConfigArgs, ConfigDefaultArgs, EnvArgs, LaunchArgs, TestArgs};
pub use config_file::{default_config_path, AccelerateConfig, DistributedType, LoadedConfig, ParallelismConfig};
pub use error::{CliError, CliResult};
pub use launch::LaunchPlan;

use accel::config::MixedPrecision;
use questionnaire::MachineDefaults;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Name of the hidden subcommand `accel test` starts its workers with.
pub const SELF_TEST_WORKER_COMMAND: &str = "self-test-worker";

/// Executes a parsed command line. Reads answers from stdin for `accel config`, prints to stdout/stderr.
pub fn run(cli: Cli) -> CliResult<()> {
    match cli.command {
        Command::Config(args) => run_config(args),
        Command::Launch(args) => run_launch(&args),
        Command::Test(args) => {
            let exe =
                std::env::current_exe().map_err(|e| CliError::io("cannot find the path of the accel binary", e))?;
            self_test::run(
                args.num_processes as usize,
                &exe,
                &[SELF_TEST_WORKER_COMMAND.to_string()],
                &mut std::io::stdout(),
            )
        }
        Command::Env(args) => {
            print!("{}", env_report::render(args.config_file.as_deref()));
            Ok(())
        }
        Command::SelfTestWorker => self_test::run_worker(),
    }
}

/// The file `accel config` writes: `--config-file`, else the default path.
fn target_path(explicit: Option<PathBuf>) -> CliResult<PathBuf> {
    explicit.or_else(default_config_path).ok_or_else(|| {
        CliError::Launch("cannot find the default config location: set HF_HOME or HOME, or pass --config-file".into())
    })
}

fn run_config(args: ConfigArgs) -> CliResult<()> {
    let machine = MachineDefaults { gpus: hardware::usable_gpu_count(), cuda_compiled: hardware::CUDA_COMPILED };
    match args.action {
        Some(ConfigAction::Default(d)) => {
            let path = target_path(d.config_file.or(args.config_file))?;
            if path.exists() && !d.force {
                return Err(CliError::ConfigExists { path });
            }
            let mp: MixedPrecision = d.mixed_precision.parse().map_err(|_| {
                CliError::invalid("--mixed-precision", d.mixed_precision.clone(), MixedPrecision::CHOICES)
            })?;
            questionnaire::basic_config(mp, machine).save(&path)?;
            println!("accel config: wrote {}", path.display());
            Ok(())
        }
        None => {
            let path = target_path(args.config_file)?;
            let stdin = std::io::stdin();
            let mut input = stdin.lock();
            let mut out = std::io::stdout();
            let cfg = questionnaire::ask(&mut input, &mut out, machine)?;
            cfg.save(&path)?;
            let _ = writeln!(out, "accel config: wrote {}", path.display());
            Ok(())
        }
    }
}

fn run_launch(args: &LaunchArgs) -> CliResult<()> {
    let file = match config_file::resolve_config_path(args.config_file.as_deref())? {
        Some(path) => Some(AccelerateConfig::load(&path)?),
        None => None,
    };
    let mut plan = LaunchPlan::resolve(args, file.as_ref().map(|l| &l.config))?;
    if plan.num_machines > 1 {
        // A malformed ACCEL_RUN_TOKEN is refused here, before the banner and before machine 0's store starts.
        ddp_core::RunToken::from_env()?;
    }
    // The file's warnings once the launch is sure to go ahead (a refused file gets its error only).
    for w in file.iter().flat_map(|l| &l.warnings) {
        eprintln!("accel: warning: {w}");
    }
    if let Some(loaded) = &file {
        plan.config_source = launch::describe_config(&loaded.path, args.config_file.is_none(), &loaded.config, args);
    }
    for w in &plan.warnings {
        eprintln!("accel: warning: {w}");
    }
    eprintln!("{}", plan.summary());
    launch::run_plan(&plan)
}

/// Loads a config file and prints its warnings to stderr.
pub fn load_and_warn(path: &Path) -> CliResult<LoadedConfig> {
    let loaded = AccelerateConfig::load(path)?;
    for w in &loaded.warnings {
        eprintln!("accel: warning: {w}");
    }
    Ok(loaded)
}
