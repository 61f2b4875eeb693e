//! [`NcclBackend`]: the [`crate::Backend`] over one [`NcclComm`], plus the device-slice API.

use super::comm::{NcclComm, NcclElement};
use super::{device, error, probe, unique_id};
use crate::backend::Backend;
use crate::store::Store;
use crate::sync;
use crate::{DType, DdpError, ReduceOp, Result};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// An NCCL process group backend: one GPU per rank, one communicator per (sub-)group.
///
/// The byte-level [`Backend`] methods take *host* buffers: they are copied to the device, reduced by NCCL and
/// copied back (`ProcessGroup::all_reduce(&mut [f32])` works unchanged, at the cost of two PCIe copies). GPU
/// data should use the device-slice methods ([`NcclBackend::with_comm`] and [`NcclComm`]'s methods) or, with
/// feature `cuda`, the candle tensor functions in `nccl::tensor`, which run in place on the device.
pub struct NcclBackend {
    comm: Mutex<NcclComm>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
}

impl std::fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclBackend").field("rank", &self.rank).field("world_size", &self.world_size).finish()
    }
}

impl NcclBackend {
    /// Probes the libraries, picks the GPU of `local_rank` (among the visible devices), checks that no two ranks
    /// share a GPU, shares the unique id through `store` and creates the communicator on a new stream of that GPU.
    ///
    /// Every rank of the group calls it with the same `store` namespace (one communicator per namespace: the
    /// keys `nccl/unique_id` and `nccl/device/{rank}` are written there). Errors:
    /// [`DdpError::BackendUnavailable`] (missing library, no GPU, LOCAL_RANK beyond the visible GPUs, NCCL init
    /// error with its ncclResult name), [`DdpError::InvalidArgument`] when two ranks map to one GPU, store timeouts.
    pub fn new(
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        local_rank: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let found = probe()?;
        let ordinal = device::ordinal_for_local_rank(local_rank, found.device_count)?;
        let ctx = CudaContext::new(ordinal).map_err(|e| error::init_driver("creating the CUDA context", &e))?;
        // A stream of its own, like PyTorch's NCCL streams; device-slice calls order themselves after the
        // slice's stream.
        let stream = ctx.new_stream().map_err(|e| error::init_driver("cuStreamCreate", &e))?;
        tracing::info!(rank, local_rank, gpu = ordinal, nccl = %found.nccl_version, "NCCL backend: using GPU {ordinal}");
        Self::with_stream(store, rank, world_size, stream, timeout)
    }

    /// Like [`NcclBackend::new`] on an existing stream (e.g. candle's `CudaDevice::cuda_stream()`), so collectives
    /// on that stream's tensors need no extra synchronisation. Probes the libraries first.
    pub fn with_stream(
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        stream: Arc<CudaStream>,
        timeout: Duration,
    ) -> Result<Self> {
        probe()?;
        if rank >= world_size {
            return Err(DdpError::InvalidArgument(format!("rank {rank} is out of range for world size {world_size}")));
        }
        let identity = device::identity(stream.context())?;
        device::check_unique_devices(store.as_ref(), rank, world_size, &identity, timeout)?;
        let id = unique_id::share(store.as_ref(), rank, timeout)?;
        let comm = NcclComm::init_rank(stream, rank, world_size, id, timeout)?;
        Ok(NcclBackend { comm: Mutex::new(comm), rank, world_size, timeout })
    }

    /// A communicator for a sub-group on the same GPU and stream: a fresh unique id shared through `store`
    /// (the sub-group's namespace). Only members call it, with their sub-group `rank` of `world_size`.
    pub fn subgroup(&self, store: Arc<dyn Store>, rank: usize, world_size: usize) -> Result<Self> {
        let stream = self.stream();
        Self::with_stream(store, rank, world_size, stream, self.timeout)
    }

    /// The stream NCCL runs on.
    pub fn stream(&self) -> Arc<CudaStream> {
        sync::lock(&self.comm).stream().clone()
    }

    /// The GPU ordinal (among visible devices) of this rank.
    pub fn device_ordinal(&self) -> usize {
        sync::lock(&self.comm).stream().context().ordinal()
    }

    /// Runs `f` with exclusive use of the communicator: the device-slice API (`all_reduce`, `broadcast`,
    /// `all_gather`, `reduce_scatter`, `send`, `recv`, `barrier` on `CudaSlice`s).
    pub fn with_comm<R>(&self, f: impl FnOnce(&mut NcclComm) -> R) -> R {
        f(&mut sync::lock(&self.comm))
    }

    /// In place all_reduce of a device slice (see [`NcclComm::all_reduce`]).
    pub fn all_reduce_slice<T: NcclElement, S: DevicePtrMut<T>>(&self, buf: &mut S, op: ReduceOp) -> Result<()> {
        sync::lock(&self.comm).all_reduce(buf, op)
    }

    /// In place broadcast of a device slice from group rank `root`.
    pub fn broadcast_slice<T: NcclElement, S: DevicePtrMut<T>>(&self, buf: &mut S, root: usize) -> Result<()> {
        sync::lock(&self.comm).broadcast(buf, root)
    }

    /// Copies `host` to a new device buffer on the communicator's stream.
    fn stage_in(comm: &NcclComm, op: &'static str, host: &[u8]) -> Result<CudaSlice<u8>> {
        comm.stream().clone_htod(host).map_err(|e| staging_error(comm, op, "copy to the GPU", &e))
    }

    /// Copies `dev` back into `host` (synchronises the stream; the collective was already waited for).
    fn stage_out(comm: &NcclComm, op: &'static str, dev: &CudaSlice<u8>, host: &mut [u8]) -> Result<()> {
        comm.stream().memcpy_dtoh(dev, host).map_err(|e| staging_error(comm, op, "copy from the GPU", &e))
    }
}

fn staging_error(comm: &NcclComm, op: &'static str, what: &str, e: &cudarc::driver::DriverError) -> DdpError {
    DdpError::Collective {
        op,
        seq: comm.seq(),
        rank: comm.rank(),
        world_size: comm.world_size(),
        peer: None,
        reason: format!("{what} failed: {e:?}"),
    }
}

impl Backend for NcclBackend {
    fn name(&self) -> &'static str {
        "nccl"
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let mut comm = sync::lock(&self.comm);
        let mut dev = Self::stage_in(&comm, "all_reduce", buf)?;
        let stream = comm.stream().clone();
        let divide = {
            let (ptr, _sync) = dev.device_ptr_mut(&stream);
            // SAFETY: `ptr` holds buf.len() bytes = buf.len() / size elements of `dtype` on the comm's device.
            unsafe { comm.all_reduce_raw(ptr, buf.len() / dtype.size_in_bytes(), dtype, op)? }
        };
        Self::stage_out(&comm, "all_reduce", &dev, buf)?;
        if divide {
            crate::dtype::divide_in_place(dtype, buf, self.world_size);
        }
        Ok(())
    }

    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let mut comm = sync::lock(&self.comm);
        let mut dev = Self::stage_in(&comm, "broadcast", buf)?;
        let stream = comm.stream().clone();
        {
            let (ptr, _sync) = dev.device_ptr_mut(&stream);
            // SAFETY: buf.len() bytes on the comm's device.
            unsafe { comm.broadcast_raw(ptr, buf.len(), root)? };
        }
        Self::stage_out(&comm, "broadcast", &dev, buf)
    }

    fn all_gather(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        if input.is_empty() {
            return Ok(());
        }
        let mut comm = sync::lock(&self.comm);
        let src = Self::stage_in(&comm, "all_gather", input)?;
        let stream = comm.stream().clone();
        let mut dst =
            stream.alloc_zeros::<u8>(output.len()).map_err(|e| staging_error(&comm, "all_gather", "cuMemAlloc", &e))?;
        {
            let (s, _ss) = cudarc::driver::DevicePtr::device_ptr(&src, &stream);
            let (d, _ds) = dst.device_ptr_mut(&stream);
            // SAFETY: `s` holds input.len() bytes, `d` world_size × that (checked by ProcessGroup).
            unsafe { comm.all_gather_raw(s, d, input.len())? };
        }
        Self::stage_out(&comm, "all_gather", &dst, output)
    }

    fn reduce_scatter(&self, input: &[u8], output: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        if output.is_empty() {
            return Ok(());
        }
        let mut comm = sync::lock(&self.comm);
        let src = Self::stage_in(&comm, "reduce_scatter", input)?;
        let stream = comm.stream().clone();
        let mut dst = stream
            .alloc_zeros::<u8>(output.len())
            .map_err(|e| staging_error(&comm, "reduce_scatter", "cuMemAlloc", &e))?;
        let divide = {
            let (s, _ss) = cudarc::driver::DevicePtr::device_ptr(&src, &stream);
            let (d, _ds) = dst.device_ptr_mut(&stream);
            // SAFETY: `s` holds world_size × output.len() bytes, `d` output.len() bytes.
            unsafe { comm.reduce_scatter_raw(s, d, output.len() / dtype.size_in_bytes(), dtype, op)? }
        };
        Self::stage_out(&comm, "reduce_scatter", &dst, output)?;
        if divide {
            crate::dtype::divide_in_place(dtype, output, self.world_size);
        }
        Ok(())
    }

    fn send(&self, buf: &[u8], dst: usize) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let mut comm = sync::lock(&self.comm);
        let dev = Self::stage_in(&comm, "send", buf)?;
        let stream = comm.stream().clone();
        let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(&dev, &stream);
        // SAFETY: buf.len() bytes on the comm's device.
        unsafe { comm.p2p_raw(ptr, buf.len(), dst, true) }
    }

    fn recv(&self, buf: &mut [u8], src: usize) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let mut comm = sync::lock(&self.comm);
        let stream = comm.stream().clone();
        let mut dev =
            stream.alloc_zeros::<u8>(buf.len()).map_err(|e| staging_error(&comm, "recv", "cuMemAlloc", &e))?;
        {
            let (ptr, _sync) = dev.device_ptr_mut(&stream);
            // SAFETY: buf.len() bytes on the comm's device.
            unsafe { comm.p2p_raw(ptr, buf.len(), src, false)? };
        }
        Self::stage_out(&comm, "recv", &dev, buf)
    }

    fn barrier(&self) -> Result<()> {
        sync::lock(&self.comm).barrier()
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

// The process group must stay Send + Sync with this backend inside (checked at compile time).
#[allow(dead_code)]
const _: () = {
    fn assert_send_sync<T: Send + Sync>() {}
    fn check() {
        assert_send_sync::<NcclBackend>();
    }
};
