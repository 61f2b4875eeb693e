//! What this machine has: CPU, memory, GPUs, and whether CUDA / NCCL support is compiled in.
//!
//! Probing never panics and never needs CUDA libraries: GPUs are listed with `nvidia-smi` when it is on PATH (the
//! driver's own tool), CPU and memory come from `/proc` on Linux. Anything that cannot be read is reported as
//! unknown.

use std::process::Command;

/// One GPU as `nvidia-smi` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Device index (CUDA ordinal).
    pub index: usize,
    /// Product name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Total memory as printed by nvidia-smi, e.g. `143771 MiB`.
    pub memory: String,
}

/// GPUs and driver found by `nvidia-smi`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuProbe {
    /// The GPUs, in index order (empty when none or no driver).
    pub gpus: Vec<GpuInfo>,
    /// NVIDIA driver version, when nvidia-smi ran.
    pub driver_version: Option<String>,
    /// Why nothing was found, e.g. `nvidia-smi not found`.
    pub note: Option<String>,
}

/// Lists GPUs with `nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader`.
pub fn probe_gpus() -> GpuProbe {
    let out = Command::new("nvidia-smi")
        .args(["--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"])
        .output();
    match out {
        Err(_) => GpuProbe {
            note: Some("nvidia-smi not found (is an NVIDIA driver installed?)".into()),
            ..Default::default()
        },
        Ok(o) if !o.status.success() => GpuProbe {
            note: Some(format!("nvidia-smi failed: {}", String::from_utf8_lossy(&o.stderr).trim())),
            ..Default::default()
        },
        Ok(o) => parse_nvidia_smi(&String::from_utf8_lossy(&o.stdout)),
    }
}

/// Parses `nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader` output.
pub fn parse_nvidia_smi(text: &str) -> GpuProbe {
    let mut probe = GpuProbe::default();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if fields.len() < 4 {
            continue;
        }
        let Ok(index) = fields[0].parse() else { continue };
        probe.gpus.push(GpuInfo { index, name: fields[1].to_string(), memory: fields[2].to_string() });
        probe.driver_version.get_or_insert_with(|| fields[3].to_string());
    }
    if probe.gpus.is_empty() {
        probe.note = Some("nvidia-smi lists no GPU".into());
    }
    probe
}

/// Whether this build can run on CUDA GPUs (the `cuda` feature).
pub const CUDA_COMPILED: bool = cfg!(feature = "cuda");
/// Whether this build has the NCCL backend (the `nccl` feature).
pub const NCCL_COMPILED: bool = cfg!(feature = "nccl");

/// GPUs this build can use: the number nvidia-smi lists when CUDA is compiled in, else 0.
pub fn usable_gpu_count() -> usize {
    if CUDA_COMPILED {
        probe_gpus().gpus.len()
    } else {
        0
    }
}

/// The CPU model name (`model name` in /proc/cpuinfo), when readable.
pub fn cpu_model() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines()
        .find(|l| l.starts_with("model name") || l.starts_with("Model") || l.starts_with("Hardware"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// Logical CPUs this process may use (respects affinity masks and cgroup quotas).
pub fn cpu_cores() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// Total memory (`MemTotal` of /proc/meminfo) in bytes, when readable.
pub fn total_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Operating system in words: `PRETTY_NAME` of /etc/os-release plus the kernel release, else the OS family.
pub fn os_description() -> String {
    let pretty = std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|t| t.lines().find_map(|l| l.strip_prefix("PRETTY_NAME=")).map(|v| v.trim_matches('"').to_string()));
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|s| s.trim().to_string());
    let family = format!("{} {}", std::env::consts::OS, std::env::consts::ARCH);
    match (pretty, kernel) {
        (Some(p), Some(k)) => format!("{p} (kernel {k}, {family})"),
        (Some(p), None) => format!("{p} ({family})"),
        (None, Some(k)) => format!("{family} (kernel {k})"),
        (None, None) => family,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvidia_smi_csv_is_parsed() {
        let p = parse_nvidia_smi("0, NVIDIA H200, 143771 MiB, 570.86.15\n1, NVIDIA H200, 143771 MiB, 570.86.15\n");
        assert_eq!(p.gpus.len(), 2);
        assert_eq!(p.gpus[1], GpuInfo { index: 1, name: "NVIDIA H200".into(), memory: "143771 MiB".into() });
        assert_eq!(p.driver_version.as_deref(), Some("570.86.15"));
        assert!(p.note.is_none());
        let empty = parse_nvidia_smi("No devices were found\n");
        assert!(empty.gpus.is_empty() && empty.note.is_some());
    }

    #[test]
    fn probes_do_not_panic() {
        let _ = probe_gpus();
        let _ = cpu_model();
        assert!(cpu_cores() >= 1);
        let _ = total_memory_bytes();
        assert!(!os_description().is_empty());
    }
}
