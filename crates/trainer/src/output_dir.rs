//! Ownership of an output directory. One job at a time: [`lock_output_dir`] (`.trainer.lock`, released when training
//! ends, fails, or SIGINT / SIGTERM ends the process: [`signals`]). One run per directory: [`check_output_dir`]
//! refuses a new run over another run's files (checkpoints, `trainer_state.json`, curves, the trackers' folder of
//! its run name) unless it resumes that run or `overwrite_output_dir` deletes them first.

mod lock;
mod run_files;
pub mod signals;

pub use lock::{host_name, lock_output_dir, LockInfo, OutputDirLock, LOCK_NAME};
pub use run_files::{check_output_dir, other_run_files, RUN_FILES};
