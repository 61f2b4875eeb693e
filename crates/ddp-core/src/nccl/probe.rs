//! Looking for the CUDA driver and NCCL libraries before anything calls into them.
//!
//! cudarc (with `dynamic-loading`) opens `libcuda`/`libnccl` lazily and *panics* on the first call when a library
//! is missing. So the backend asks `is_culib_present()` first and turns "absent" into
//! [`DdpError::BackendUnavailable`] with the names looked for and the fix. With feature `cuda`, candle links
//! cudarc dynamically (`dynamic-linking`): the libraries are then load-time dependencies of the binary, which
//! would not have started without them, and only `cuInit` and the device count are checked here.

use crate::{DdpError, Result};

/// What the probe found: enough to pick a backend and to print in `accel env`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclAvailability {
    /// Number of CUDA devices visible to this process (after `CUDA_VISIBLE_DEVICES`).
    pub device_count: usize,
    /// NCCL version as `major.minor.patch`, from `ncclGetVersion`.
    pub nccl_version: String,
}

/// How the fix reads for the usual runtime-only NCCL installs.
const NCCL_FIX: &str = "NCCL 2 runtime packages ship only `libnccl.so.2`, a name cudarc does not try: \
     make a `libnccl.so` link and put its folder on LD_LIBRARY_PATH. For PyTorch's pip package \
     nvidia-nccl-cu12 / nvidia-nccl-cu13: `d=$(python -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))')/lib; \
     mkdir -p ~/.local/nccl && ln -sf $d/libnccl.so.2 ~/.local/nccl/libnccl.so && export LD_LIBRARY_PATH=~/.local/nccl:$LD_LIBRARY_PATH`. \
     For Debian/Ubuntu `libnccl2`: install `libnccl-dev` (it provides the libnccl.so link) or link \
     /usr/lib/x86_64-linux-gnu/libnccl.so.2 the same way. Or use the CPU backend (ACCEL_BACKEND=cpu / --backend cpu)";

/// Checks that the CUDA driver and NCCL can be loaded and that at least one GPU is visible.
///
/// Errors: [`DdpError::BackendUnavailable`] naming the library looked for (with the candidate file names) and
/// how to fix it, or `cuInit`'s error (e.g. `CUDA_ERROR_NO_DEVICE`). Never panics.
pub fn probe() -> Result<NcclAvailability> {
    check_libraries_present()?;
    // From here on the libraries exist, so cudarc's lazy loading cannot panic.
    cudarc::driver::result::init().map_err(|e| {
        unavailable(format!("cuInit failed with {e:?}: is an NVIDIA driver loaded and a GPU present (nvidia-smi)?"))
    })?;
    let count = cudarc::driver::result::device::get_count()
        .map_err(|e| unavailable(format!("cuDeviceGetCount failed with {e:?}")))?;
    if count <= 0 {
        return Err(unavailable(format!(
            "no CUDA device is visible (CUDA_VISIBLE_DEVICES={:?})",
            std::env::var("CUDA_VISIBLE_DEVICES").ok()
        )));
    }
    let version = cudarc::nccl::result::get_nccl_version()
        .map_err(|e| unavailable(format!("ncclGetVersion failed with {}", super::error::result_name(&e))))?;
    Ok(NcclAvailability { device_count: count as usize, nccl_version: format_nccl_version(version) })
}

/// `ncclGetVersion` encodes 2.21.5 as 22105 (NCCL ≥ 2.9: major·10000 + minor·100 + patch).
fn format_nccl_version(code: i32) -> String {
    if code >= 10000 {
        format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100)
    }
}

fn unavailable(reason: String) -> DdpError {
    DdpError::BackendUnavailable { backend: "nccl", reason }
}

#[cfg(not(feature = "cuda"))]
fn check_libraries_present() -> Result<()> {
    // SAFETY: `is_culib_present` only tries `dlopen` on candidate names and closes what it opened.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    if !driver {
        return Err(unavailable(format!(
            "the CUDA driver library was not found (looked for {:?} on the loader path): install the NVIDIA driver \
             (it provides libcuda.so.1), or use the CPU backend (ACCEL_BACKEND=cpu / --backend cpu)",
            cudarc::get_lib_name_candidates("cuda")
        )));
    }
    // SAFETY: as above.
    let nccl = unsafe { cudarc::nccl::sys::is_culib_present() };
    if !nccl {
        return Err(unavailable(format!(
            "libnccl was not found (looked for {:?} on the loader path: LD_LIBRARY_PATH, ldconfig). {NCCL_FIX}",
            cudarc::get_lib_name_candidates("nccl")
        )));
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn check_libraries_present() -> Result<()> {
    // Linked at load time (candle's `dynamic-linking`): present, or the process would not be running.
    let _ = NCCL_FIX;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_decode() {
        assert_eq!(format_nccl_version(22105), "2.21.5");
        assert_eq!(format_nccl_version(2804), "2.8.4");
    }

    /// On a machine without libnccl or a driver (this one, CI) the probe is a clean error, never a panic.
    #[test]
    fn probe_never_panics() {
        match probe() {
            Ok(a) => assert!(a.device_count > 0),
            Err(DdpError::BackendUnavailable { backend, reason }) => {
                assert_eq!(backend, "nccl");
                assert!(reason.contains("libcuda") || reason.contains("libnccl") || reason.contains("cu"), "{reason}");
            }
            Err(e) => panic!("unexpected error kind: {e}"),
        }
    }
}
