//! `accel env`: versions, hardware and the active config, as plain text a user pastes into a bug report.

use crate::config_file::{resolve_config_path, AccelerateConfig};
use crate::hardware::{self, CUDA_COMPILED, NCCL_COMPILED};
use std::fmt::Write as _;
use std::path::Path;

/// accel's version (this crate).
pub const ACCEL_VERSION: &str = env!("CARGO_PKG_VERSION");
/// candle-core's version, read from Cargo.lock at build time (`unknown` when built without a lock file).
pub const CANDLE_VERSION: &str = env!("ACCEL_BUILD_CANDLE_VERSION");
/// `rustc --version` of the compiler that built accel.
pub const RUSTC_VERSION: &str = env!("ACCEL_BUILD_RUSTC_VERSION");
/// The build profile (`debug` or `release`).
pub const BUILD_PROFILE: &str = if cfg!(debug_assertions) { "debug" } else { "release" };

/// Builds the report. `config_file` is `--config-file` (else the default path is used when it exists). Never
/// fails: problems (unreadable config, no nvidia-smi) are written into the report.
pub fn render(config_file: Option<&Path>) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "Copy-and-paste the text below in your GitHub issue\n");
    let _ = writeln!(s, "- accel version: {ACCEL_VERSION} ({BUILD_PROFILE} build)");
    let _ = writeln!(s, "- candle version: {CANDLE_VERSION}");
    let _ = writeln!(s, "- rustc: {RUSTC_VERSION}");
    let features: Vec<&str> =
        [("cuda", CUDA_COMPILED), ("nccl", NCCL_COMPILED)].iter().filter(|(_, on)| *on).map(|(n, _)| *n).collect();
    let _ =
        writeln!(s, "- features: {}", if features.is_empty() { "none (CPU only)".into() } else { features.join(", ") });
    let _ = writeln!(s, "- platform: {}", hardware::os_description());
    let _ = writeln!(s, "- CPU: {}", hardware::cpu_model().unwrap_or_else(|| "unknown model".into()));
    let _ = writeln!(s, "- CPU cores available: {}", hardware::cpu_cores());
    let _ = writeln!(
        s,
        "- memory: {}",
        hardware::total_memory_bytes()
            .map_or("unknown".to_string(), |b| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64))
    );
    let gpus = hardware::probe_gpus();
    let _ = writeln!(
        s,
        "- CUDA support: {}",
        if CUDA_COMPILED { "compiled in" } else { "not compiled in (build with --features cuda)" }
    );
    let _ = writeln!(s, "- NCCL support: {}", nccl_status());
    match &gpus.driver_version {
        Some(v) => {
            let _ = writeln!(s, "- NVIDIA driver: {v}");
        }
        None => {
            let _ = writeln!(s, "- NVIDIA driver: none found: {}", gpus.note.as_deref().unwrap_or("no GPU"));
        }
    }
    let _ = writeln!(s, "- GPUs: {}", gpus.gpus.len());
    for g in &gpus.gpus {
        let _ = writeln!(s, "    {}: {} ({})", g.index, g.name, g.memory);
    }
    // The variables that change what a worker does or how fast (the thread pools and the allocator's purge are
    // the launcher's defaults when unset: see ddp_core::launcher::LaunchConfig::worker_env).
    for var in [
        "CUDA_VISIBLE_DEVICES",
        "OMP_NUM_THREADS",
        "RAYON_NUM_THREADS",
        "CANDLE_NUM_THREADS",
        "MIMALLOC_PURGE_DELAY",
        "ACCEL_FUSED_OPS",
        "HF_HOME",
        "ACCEL_BACKEND",
        "ACCEL_TIMEOUT",
    ] {
        if let Ok(v) = std::env::var(var) {
            let _ = writeln!(s, "- {var}: {v}");
        }
    }
    match resolve_config_path(config_file) {
        Ok(Some(path)) => match AccelerateConfig::load(&path) {
            Ok(loaded) => {
                let _ = writeln!(s, "- config file: {}", path.display());
                for w in &loaded.warnings {
                    let _ = writeln!(s, "  warning: {w}");
                }
                let _ = writeln!(s, "- config:");
                for line in loaded.text.lines() {
                    let _ = writeln!(s, "    {line}");
                }
            }
            Err(e) => {
                // `e` starts with "config file <path>: ..." already.
                let _ = writeln!(s, "- {e} (accel launch refuses this file until it is fixed)");
            }
        },
        Ok(None) => {
            let where_ = crate::config_file::default_config_path()
                .map_or("(no HOME / HF_HOME set)".to_string(), |p| p.display().to_string());
            let _ = writeln!(s, "- config file: none ({where_} does not exist; `accel config` writes it)");
        }
        Err(e) => {
            let _ = writeln!(s, "- config file: {e}");
        }
    }
    s
}

/// NCCL in words: not compiled in, or what ddp-core's probe finds (version and devices, or why it is unusable).
fn nccl_status() -> String {
    #[cfg(feature = "nccl")]
    {
        match ddp_core::nccl::probe() {
            Ok(a) => format!("compiled in; NCCL {} with {} visible CUDA device(s)", a.nccl_version, a.device_count),
            Err(e) => format!("compiled in but unusable here: {e}"),
        }
    }
    #[cfg(not(feature = "nccl"))]
    {
        "not compiled in (build with --features nccl)".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_names_versions_hardware_and_config() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.yaml");
        std::fs::write(&path, "distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: bf16\n").unwrap();
        let r = render(Some(&path));
        assert!(r.contains(&format!("accel version: {ACCEL_VERSION}")), "{r}");
        assert!(r.contains("candle version: 0.") || r.contains("candle version: unknown"), "{r}");
        assert!(r.contains("rustc"), "{r}");
        assert!(r.contains("CPU cores available:"), "{r}");
        if !CUDA_COMPILED {
            assert!(r.contains("CUDA support: not compiled in"), "{r}");
        }
        assert!(r.contains(&format!("config file: {}", path.display())), "{r}");
        assert!(r.contains("    mixed_precision: bf16"), "{r}");
        let r = render(Some(&dir.path().join("missing.yaml")));
        assert!(r.contains("does not exist"), "{r}");
    }
}
