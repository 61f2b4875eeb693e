//! Which GPU a rank uses: LOCAL_RANK among the visible devices, and never two ranks on one GPU.
//!
//! `CUDA_VISIBLE_DEVICES` is applied by the driver itself (device ordinals are indices into the visible list), so
//! the local rank indexes the visible devices, as in PyTorch's `torch.cuda.set_device(local_rank)`. NCCL refuses
//! two ranks of one communicator on the same GPU (`ncclInvalidUsage`, after a hang on some versions), so the ranks
//! publish `(host, GPU UUID)` through the store first and a duplicate is an error naming both ranks. The UUID,
//! not the ordinal, is compared because `CUDA_VISIBLE_DEVICES` may renumber devices differently per rank.

use crate::store::Store;
use crate::{DdpError, Result};
use std::time::Duration;

/// Store key prefix under which each rank publishes `host|uuid` of its GPU.
const DEVICE_KEY: &str = "nccl/device";

/// The device ordinal (among visible devices) for `local_rank` when `visible` devices are visible.
///
/// Errors: [`DdpError::BackendUnavailable`] when `local_rank >= visible`, naming both and CUDA_VISIBLE_DEVICES.
pub fn ordinal_for_local_rank(local_rank: usize, visible: usize) -> Result<usize> {
    if local_rank < visible {
        return Ok(local_rank);
    }
    Err(DdpError::BackendUnavailable {
        backend: "nccl",
        reason: format!(
            "LOCAL_RANK {local_rank} needs GPU #{local_rank} but only {visible} GPU(s) are visible \
             (CUDA_VISIBLE_DEVICES={:?}); NCCL needs one GPU per process: start at most {visible} processes \
             per machine, or use the CPU backend",
            std::env::var("CUDA_VISIBLE_DEVICES").ok()
        ),
    })
}

/// Publishes `identity` (host and GPU UUID) for `rank` and checks that no two ranks share a GPU.
///
/// Every rank of the group must call it. Waits up to `timeout` for the others. Errors: a store timeout naming the
/// missing ranks' keys, or [`DdpError::InvalidArgument`] naming the two ranks that map to the same GPU.
pub fn check_unique_devices(
    store: &dyn Store,
    rank: usize,
    world_size: usize,
    identity: &str,
    timeout: Duration,
) -> Result<()> {
    store.set(&format!("{DEVICE_KEY}/{rank}"), identity.as_bytes())?;
    let keys: Vec<String> = (0..world_size).map(|r| format!("{DEVICE_KEY}/{r}")).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    store.wait(&key_refs, timeout)?;
    let mut ids = Vec::with_capacity(world_size);
    for key in &keys {
        ids.push(String::from_utf8_lossy(&store.get(key)?).into_owned());
    }
    find_duplicate(&ids)
}

/// The first pair of ranks with the same device identity, as an error.
pub fn find_duplicate(ids: &[String]) -> Result<()> {
    for (b, id_b) in ids.iter().enumerate() {
        if let Some(a) = ids[..b].iter().position(|id_a| id_a == id_b) {
            return Err(DdpError::InvalidArgument(format!(
                "ranks {a} and {b} both use GPU {id_b}: NCCL needs one GPU per rank. Check LOCAL_RANK and \
                 CUDA_VISIBLE_DEVICES of each process (one machine with N GPUs runs at most N ranks)"
            )));
        }
    }
    Ok(())
}

/// `host|GPU-xxxxxxxx-xxxx-...` for the device of `ctx`.
pub fn identity(ctx: &cudarc::driver::CudaContext) -> Result<String> {
    let uuid = ctx.uuid().map_err(|e| super::error::init_driver("cuDeviceGetUuid", &e))?;
    let hex: String = uuid.bytes.iter().map(|&b| format!("{:02x}", b as u8)).collect();
    Ok(format!("{}|GPU-{}", hostname(), hex))
}

/// Total memory of CUDA device `ordinal` in bytes (`cuDeviceTotalMem`): what the automatic layout plans a rank's
/// memory with on CUDA (`accel::auto_layout`). Errors: the driver cannot be loaded or has no such device.
pub fn total_memory(ordinal: usize) -> Result<u64> {
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| super::error::init_driver("cuCtxCreate", &e))?;
    let bytes = ctx.total_mem().map_err(|e| super::error::init_driver("cuDeviceTotalMem", &e))?;
    Ok(bytes as u64)
}

/// This machine's host name (for the device identity only).
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates on success (truncation is harmless
    // here, the name only has to be the same for ranks on the same machine).
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown-host".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;
    use std::sync::Arc;

    #[test]
    fn local_rank_indexes_visible_devices() {
        assert_eq!(ordinal_for_local_rank(1, 2).unwrap(), 1);
        let err = ordinal_for_local_rank(2, 2).unwrap_err().to_string();
        assert!(err.contains("LOCAL_RANK 2") && err.contains("only 2 GPU"), "{err}");
    }

    #[test]
    fn two_ranks_on_one_gpu_is_an_error_naming_both() {
        let ids = vec!["h|GPU-a".to_string(), "h|GPU-b".to_string(), "h|GPU-a".to_string()];
        let err = find_duplicate(&ids).unwrap_err().to_string();
        assert!(err.contains("ranks 0 and 2") && err.contains("GPU-a"), "{err}");
        // Same GPU UUID on different hosts cannot happen; different GPUs on one host are fine.
        assert!(find_duplicate(&ids[..2]).is_ok());
    }

    #[test]
    fn identities_are_gathered_through_the_store() {
        let store = Arc::new(MemoryStore::new(Duration::from_secs(30)));
        let handles: Vec<_> = (0..3)
            .map(|r| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let id = format!("h|GPU-{}", r % 2); // ranks 0 and 2 collide
                    check_unique_devices(store.as_ref(), r, 3, &id, Duration::from_secs(30))
                })
            })
            .collect();
        for h in handles {
            let err = h.join().unwrap().unwrap_err().to_string();
            assert!(err.contains("ranks 0 and 2"), "{err}");
        }
    }
}
