//! Mapping cudarc's NCCL and CUDA driver errors into [`DdpError`].
//!
//! cudarc's `NcclError(pub ncclResult_t)` implements neither `Display` nor `std::error::Error` (and its `Debug`
//! prints only "NcclError"), so `#[from]` cannot work: the result code's name (`ncclSystemError`, ...) is taken
//! from `ncclResult_t`'s derived `Debug`, with NCCL's own one-line explanation.

use crate::DdpError;
use cudarc::driver::DriverError;
use cudarc::nccl::result::NcclError;

/// The ncclResult_t name of an error, e.g. `"ncclRemoteError"`.
pub(crate) fn result_name(e: &NcclError) -> String {
    format!("{:?}", e.0)
}

/// What the NCCL documentation says each result means, with the usual next step.
pub(crate) fn explain(e: &NcclError) -> &'static str {
    use cudarc::nccl::sys::ncclResult_t as R;
    match e.0 {
        R::ncclUnhandledCudaError => "a CUDA call failed inside NCCL (see the CUDA error in NCCL_DEBUG=WARN output)",
        R::ncclSystemError => "a system call failed (socket, shared memory, /dev/shm too small?); set NCCL_DEBUG=INFO",
        R::ncclInternalError => "NCCL internal error (version mismatch between ranks, or a bug); set NCCL_DEBUG=INFO",
        R::ncclInvalidArgument => "invalid argument (device pointer on another GPU, count or rank out of range)",
        R::ncclInvalidUsage => {
            "invalid usage (e.g. two ranks on one GPU, mismatched collectives between ranks); set NCCL_DEBUG=WARN"
        }
        R::ncclRemoteError => "a remote rank failed or disconnected (network error or a dead process)",
        _ => "see NCCL_DEBUG=INFO output",
    }
}

/// An NCCL error during a collective, in the same shape as the CPU backend's collective errors.
pub(crate) fn collective(op: &'static str, seq: u64, rank: usize, world_size: usize, e: &NcclError) -> DdpError {
    DdpError::Collective {
        op,
        seq,
        rank,
        world_size,
        peer: None,
        reason: format!("NCCL returned {}: {}", result_name(e), explain(e)),
    }
}

/// A CUDA driver error during a collective (copying to/from the device, polling the stream).
pub(crate) fn driver_in_collective(
    op: &'static str,
    seq: u64,
    rank: usize,
    world_size: usize,
    e: &DriverError,
) -> DdpError {
    DdpError::Collective { op, seq, rank, world_size, peer: None, reason: format!("CUDA driver call failed: {e:?}") }
}

/// An NCCL error while creating the communicator.
pub(crate) fn init(what: &str, e: &NcclError) -> DdpError {
    DdpError::BackendUnavailable {
        backend: "nccl",
        reason: format!("{what} failed with {}: {}", result_name(e), explain(e)),
    }
}

/// A CUDA driver error while setting up the device.
pub(crate) fn init_driver(what: &str, e: &DriverError) -> DdpError {
    DdpError::BackendUnavailable { backend: "nccl", reason: format!("{what} failed with {e:?}") }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::nccl::sys::ncclResult_t;

    #[test]
    fn names_come_from_the_result_code() {
        let e = NcclError(ncclResult_t::ncclRemoteError);
        assert_eq!(result_name(&e), "ncclRemoteError");
        let msg = collective("all_reduce", 7, 1, 4, &e).to_string();
        assert!(
            msg.contains("all_reduce") && msg.contains("sequence number 7") && msg.contains("ncclRemoteError"),
            "{msg}"
        );
    }
}
