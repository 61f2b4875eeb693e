//! The NCCL backend (feature `nccl`): NVIDIA's collective library through cudarc, one GPU per process.
//!
//! What happens at [`NcclBackend::new`] (the same steps as PyTorch's `ProcessGroupNCCL`):
//! 1. [`probe()`]: the CUDA driver (`libcuda.so`) and `libnccl.so` are looked for first; an absent library is a
//!    [`crate::DdpError::BackendUnavailable`] naming it and the fix, never a panic (cudarc loads symbols lazily
//!    and panics on first use of a missing library, so nothing else is called before the probe passes).
//! 2. [`device`]: the GPU is chosen from LOCAL_RANK among the devices `CUDA_VISIBLE_DEVICES` leaves visible; the
//!    ranks publish `(host, GPU UUID)` through the store and two ranks on one GPU are an error naming both.
//! 3. [`unique_id`]: rank 0 creates the 128-byte `ncclUniqueId` and shares it through the store.
//! 4. [`NcclComm::init_rank`]: `ncclCommInitRank` on the device's stream — one communicator per process group
//!    (sub-groups get a fresh id in their own store namespace).
//!
//! Collectives run on the communicator's stream. The byte-level [`crate::Backend`] implementation copies host
//! buffers to the device and back (so `ProcessGroup::all_reduce(&mut [f32])` works unchanged); [`NcclComm`] has a
//! direct API on cudarc device slices, and with feature `cuda` `tensor` runs collectives on candle CUDA tensors
//! in place. Every wait polls the stream and `ncclCommGetAsyncError` with the group's timeout: a timeout or a
//! remote failure aborts the communicator (`ncclCommAbort`) and fails the collective with
//! [`crate::DdpError::Collective`], like the CPU backend.
//!
//! Reference: NCCL user guide (docs.nvidia.com/deeplearning/nccl), "Creating a communicator" and "Fault tolerance".

mod backend;
mod comm;
pub mod device;
mod error;
pub mod probe;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod tensor;
pub mod unique_id;

pub use backend::NcclBackend;
pub use comm::{NcclComm, NcclElement};
pub use probe::{probe, NcclAvailability};

/// The [`crate::ProcessGroup`] handle of an NCCL group, for the device-slice and tensor APIs.
impl crate::ProcessGroup {
    /// The NCCL backend of this group, or `None` when the group runs on another backend.
    #[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
    pub fn nccl(&self) -> Option<&NcclBackend> {
        self.backend().as_any()?.downcast_ref::<NcclBackend>()
    }
}
