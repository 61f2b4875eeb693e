//! Sharing the 128-byte `ncclUniqueId` from rank 0 to the other ranks through the rendezvous store.
//!
//! The id is an opaque `[c_char; 128]` (NCCL_UNIQUE_ID_BYTES). `c_char` is `i8` on x86-64 and `u8` on aarch64, so
//! the bytes are converted with `as` casts on `c_char`, never by naming `i8`.

use crate::store::Store;
use crate::{DdpError, Result};
use cudarc::nccl::sys::ncclUniqueId;
use std::ffi::c_char;
use std::time::Duration;

/// Length of an NCCL unique id in bytes (NCCL_UNIQUE_ID_BYTES).
pub const UNIQUE_ID_BYTES: usize = 128;

/// Store key of the id (inside the group's store namespace).
pub const UNIQUE_ID_KEY: &str = "nccl/unique_id";

/// The id's bytes, for the store.
pub fn to_bytes(id: &ncclUniqueId) -> [u8; UNIQUE_ID_BYTES] {
    let mut out = [0u8; UNIQUE_ID_BYTES];
    for (o, &c) in out.iter_mut().zip(id.internal.iter()) {
        *o = c as u8;
    }
    out
}

/// Rebuilds an id from bytes read from the store. Errors when the length is not 128.
pub fn from_bytes(bytes: &[u8]) -> Result<ncclUniqueId> {
    if bytes.len() != UNIQUE_ID_BYTES {
        return Err(DdpError::Protocol(format!(
            "NCCL unique id in the store has {} bytes, expected {UNIQUE_ID_BYTES} (another program wrote {UNIQUE_ID_KEY}?)",
            bytes.len()
        )));
    }
    let mut internal = [0 as c_char; UNIQUE_ID_BYTES];
    for (c, &b) in internal.iter_mut().zip(bytes) {
        *c = b as c_char;
    }
    Ok(ncclUniqueId { internal })
}

/// Rank 0 creates the id (`ncclGetUniqueId`, needs libnccl) and publishes it; the others wait for it (up to
/// `timeout`) and read it. Every rank of the group calls this once per communicator.
pub fn share(store: &dyn Store, rank: usize, timeout: Duration) -> Result<ncclUniqueId> {
    if rank == 0 {
        let id = cudarc::nccl::result::get_uniqueid().map_err(|e| super::error::init("ncclGetUniqueId", &e))?;
        store.set(UNIQUE_ID_KEY, &to_bytes(&id))?;
        Ok(id)
    } else {
        store.wait(&[UNIQUE_ID_KEY], timeout)?;
        from_bytes(&store.get(UNIQUE_ID_KEY)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_including_high_bit_values() {
        let bytes: Vec<u8> = (0..UNIQUE_ID_BYTES).map(|i| (i * 37 % 256) as u8).collect();
        let id = from_bytes(&bytes).unwrap();
        assert_eq!(to_bytes(&id).to_vec(), bytes);
        assert!(from_bytes(&bytes[..127]).is_err());
    }
}
