//! The Trainer under a launcher that restarts its workers: `max_restarts`, or an elastic job
//! (`accel launch --nnodes MIN:MAX`) that re-forms at another size when a machine is lost or arrives.
//!
//! Such a launch runs the same command line every time, so `resume_from_checkpoint: latest` must mean "the
//! newest checkpoint if there is one" (torchtitan's rule; the first attempt has none yet), and files the
//! launch's earlier attempt left in `output_dir` before its first checkpoint are its own — proven by a marker
//! holding a digest of the launch's run token (never the token), so that a run still never adopts another run's
//! files. An elastic job also keeps its global batch across sizes: the checkpoint's global batch is kept by
//! changing the gradient accumulation (the per-device batch, which has to fit in memory, stays), else the
//! per-device batch, else the restart is refused naming the data-parallel sizes that keep it (as DeepSpeed's
//! elasticity computes the valid sizes of a global batch).

use crate::{Result, TrainerError};
use accel::dist::launcher::{ELASTIC_NNODES_ENV, MAX_RESTARTS_ENV};
use sha2::{Digest, Sha256};
use std::path::Path;

/// The file in `output_dir` naming the launch that wrote it (a digest of its run token).
pub const LAUNCH_MARKER_NAME: &str = ".accel-launch";

/// Whether this process was started by a launcher that may start it again: `max_restarts` > 0, or elastic.
pub fn restarts_possible() -> bool {
    let restarts = std::env::var(MAX_RESTARTS_ENV).ok().and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(0);
    restarts > 0 || elastic_nnodes().is_some()
}

/// An elastic launch's `MIN:MAX` machines ([`ELASTIC_NNODES_ENV`]), when this process is in one.
pub fn elastic_nnodes() -> Option<String> {
    std::env::var(ELASTIC_NNODES_ENV).ok().filter(|v| !v.trim().is_empty())
}

/// The marker's content for this launch: a digest of its run token, or `None` outside a launcher.
fn launch_digest() -> Option<String> {
    let token = accel::dist::RunToken::from_env().ok()??;
    let digest = Sha256::new().chain_update(b"accel-rs launch marker\n").chain_update(token.as_bytes()).finalize();
    Some(digest.iter().map(|b| format!("{b:02x}")).collect())
}

/// Whether `output_dir`'s files were written by this launch (an earlier attempt of it).
pub fn written_by_this_launch(output_dir: &Path) -> bool {
    let Some(ours) = launch_digest() else { return false };
    std::fs::read_to_string(output_dir.join(LAUNCH_MARKER_NAME)).is_ok_and(|theirs| theirs.trim() == ours)
}

/// Marks `output_dir` as this launch's (main process; after the directory was claimed).
pub fn mark_output_dir(output_dir: &Path) -> Result<()> {
    let Some(ours) = launch_digest() else { return Ok(()) };
    let path = output_dir.join(LAUNCH_MARKER_NAME);
    std::fs::write(&path, ours).map_err(|e| TrainerError::io(format!("writing {}", path.display()), e))
}

/// The per-device batch and gradient accumulation that keep a checkpoint's global batch `saved` at `dp`
/// data-parallel processes, starting from this run's `per_device` and `accumulation`: the accumulation changed
/// first, then the per-device batch. `Err` names the data-parallel sizes (up to `max_dp`) that would keep it.
pub fn keep_global_batch(
    saved: u64,
    dp: usize,
    per_device: usize,
    accumulation: usize,
    max_dp: usize,
) -> std::result::Result<(usize, usize), String> {
    let (dp64, pd, ga) = (dp as u64, per_device as u64, accumulation as u64);
    if pd * dp64 * ga == saved {
        return Ok((per_device, accumulation));
    }
    if pd * dp64 > 0 && saved.is_multiple_of(pd * dp64) {
        return Ok((per_device, (saved / (pd * dp64)) as usize));
    }
    if dp64 * ga > 0 && saved.is_multiple_of(dp64 * ga) {
        return Ok(((saved / (dp64 * ga)) as usize, accumulation));
    }
    let valid = valid_data_parallel_sizes(saved, per_device, accumulation, max_dp);
    Err(format!(
        "the checkpoint's global batch of {saved} samples cannot be kept with {dp} data-parallel processes: neither \
         the gradient accumulation (per-device batch {per_device}) nor the per-device batch (accumulation \
         {accumulation}) makes it. Data-parallel sizes that keep it: {}",
        if valid.is_empty() { "none up to this job's largest".to_string() } else { list(&valid) }
    ))
}

/// The data-parallel sizes `1..=max_dp` at which `global` is kept by an accumulation (at `per_device`) or a
/// per-device batch (at `accumulation`).
pub fn valid_data_parallel_sizes(global: u64, per_device: usize, accumulation: usize, max_dp: usize) -> Vec<usize> {
    (1..=max_dp)
        .filter(|dp| {
            let d = *dp as u64;
            global.is_multiple_of(per_device as u64 * d) || global.is_multiple_of(accumulation as u64 * d)
        })
        .collect()
}

fn list(items: &[usize]) -> String {
    items.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_global_batch_is_kept_by_accumulation_first_then_the_per_device_batch() {
        // (saved global, dp, per-device, accumulation) -> (per-device, accumulation)
        for (saved, dp, pd, ga, kept) in [
            (16, 2, 8, 1, (8, 1)), // unchanged
            (16, 1, 8, 1, (8, 2)), // a machine lost: accumulate twice
            (16, 4, 8, 1, (4, 1)), // a machine more: 8 × 4 > 16, the per-device batch halves
            (24, 3, 8, 1, (8, 1)),
            (24, 2, 8, 1, (12, 1)),
            (24, 4, 2, 1, (2, 3)),
        ] {
            assert_eq!(keep_global_batch(saved, dp, pd, ga, 8), Ok(kept), "{saved} at dp {dp}");
        }
        let e = keep_global_batch(12, 8, 1, 1, 8).unwrap_err();
        assert!(e.contains("cannot be kept with 8 data-parallel processes"), "{e}");
        assert!(e.ends_with("Data-parallel sizes that keep it: 1, 2, 3, 4, 6"), "{e}");
    }

    #[test]
    fn the_valid_data_parallel_sizes_of_a_global_batch() {
        assert_eq!(valid_data_parallel_sizes(16, 8, 1, 8), vec![1, 2, 4, 8]);
        assert_eq!(valid_data_parallel_sizes(24, 4, 1, 8), vec![1, 2, 3, 4, 6, 8]);
        assert_eq!(valid_data_parallel_sizes(10, 2, 1, 8), vec![1, 2, 5]);
        assert_eq!(valid_data_parallel_sizes(7, 2, 2, 8), Vec::<usize>::new());
    }
}
