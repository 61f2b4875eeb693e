//! [`NcclComm`]: the one owner of an `ncclComm_t`, its CUDA stream, its sequence numbers and its timeout.
//!
//! Why not cudarc's `nccl::Comm`: it hides the raw communicator, so it cannot poll `ncclCommGetAsyncError`
//! (needed to notice a dead peer instead of hanging until the timeout), and its `Drop` calls `ncclCommAbort`
//! with `.expect(..)` (a panic on error). This type makes the same `ncclCommInitRank` / collective calls through
//! `cudarc::nccl::result`, frees with `ncclCommFinalize` + `ncclCommDestroy` after a clean run and with
//! `ncclCommAbort` after a failure, and never panics.
//!
//! Every collective is enqueued on the communicator's stream and then *waited for* with a deadline: the stream's
//! event is polled together with the communicator's asynchronous error. A timeout or a remote error aborts the
//! communicator (which makes the stuck kernels return) and the group is unusable afterwards, as in PyTorch's
//! `TORCH_NCCL_ASYNC_ERROR_HANDLING`.

use super::error;
use crate::{DType, DdpError, Element, ReduceOp, Result};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys::{self, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A type NCCL reduces natively: f32, f64, f16, bf16, i32, i64, u8.
pub trait NcclElement: Element + DeviceRepr {
    /// Its NCCL data type.
    const NCCL: ncclDataType_t;
}

macro_rules! nccl_element {
    ($t:ty, $n:ident) => {
        impl NcclElement for $t {
            const NCCL: ncclDataType_t = ncclDataType_t::$n;
        }
    };
}
nccl_element!(f32, ncclFloat32);
nccl_element!(f64, ncclFloat64);
nccl_element!(half::f16, ncclFloat16);
nccl_element!(half::bf16, ncclBfloat16);
nccl_element!(i32, ncclInt32);
nccl_element!(i64, ncclInt64);
nccl_element!(u8, ncclUint8);

/// NCCL's data type for a ddp-core dtype.
pub(crate) fn nccl_dtype(dtype: DType) -> ncclDataType_t {
    match dtype {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F64 => ncclDataType_t::ncclFloat64,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::I32 => ncclDataType_t::ncclInt32,
        DType::I64 => ncclDataType_t::ncclInt64,
        DType::U8 => ncclDataType_t::ncclUint8,
    }
}

/// NCCL's operator for `op` on `dtype`, and whether the caller must still divide by the world size.
///
/// `ncclAvg` is used for floating types. For integer types ddp-core's `Avg` is a truncating division of the sum
/// (as the CPU backend does), so those run `ncclSum` and divide afterwards.
pub(crate) fn nccl_op(op: ReduceOp, dtype: DType) -> (ncclRedOp_t, bool) {
    let float = matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16);
    match op {
        ReduceOp::Sum => (ncclRedOp_t::ncclSum, false),
        ReduceOp::Avg if float => (ncclRedOp_t::ncclAvg, false),
        ReduceOp::Avg => (ncclRedOp_t::ncclSum, true),
        ReduceOp::Product => (ncclRedOp_t::ncclProd, false),
        ReduceOp::Max => (ncclRedOp_t::ncclMax, false),
        ReduceOp::Min => (ncclRedOp_t::ncclMin, false),
    }
}

/// An NCCL communicator over one group: one GPU (the stream's device) per rank.
///
/// Not `Sync`: NCCL communicators must not be used by two threads at once. [`super::NcclBackend`] keeps it in a
/// `Mutex`.
#[derive(Debug)]
pub struct NcclComm {
    raw: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    seq: u64,
    /// Set once the communicator was aborted; every later call fails with this reason.
    aborted: Option<String>,
}

// SAFETY: `NcclComm` is `!Send` only because it holds the raw `ncclComm_t` pointer. NCCL allows a communicator
// to be used from any host thread as long as no two threads use it at the same time (NCCL user guide, "Thread
// safety"); every method here takes `&mut self` and the backend keeps the communicator in a `Mutex`, so one
// thread at a time uses it. The CUDA context is bound to the calling thread before each call. `Sync` is not
// implemented.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// `ncclCommInitRank` for `rank` of `world_size` on `stream`'s device with the id rank 0 shared.
    ///
    /// Blocks until every rank joined (NCCL has no timeout for a blocking init; the backend gathers every rank's
    /// device through the store first, so all ranks are known to be alive when this starts). Errors:
    /// [`DdpError::BackendUnavailable`] with the ncclResult name.
    pub fn init_rank(
        stream: Arc<CudaStream>,
        rank: usize,
        world_size: usize,
        id: ncclUniqueId,
        timeout: Duration,
    ) -> Result<Self> {
        let (nranks, r) = (to_c_int(world_size, "world size")?, to_c_int(rank, "rank")?);
        stream.context().bind_to_thread().map_err(|e| error::init_driver("binding the CUDA context", &e))?;
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the id came from ncclGetUniqueId on rank 0.
        unsafe { nccl::comm_init_rank(&mut raw, nranks, id, r) }.map_err(|e| error::init("ncclCommInitRank", &e))?;
        Ok(NcclComm { raw, stream, rank, world_size, timeout, seq: 0, aborted: None })
    }

    /// This rank in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }
    /// The stream collectives are enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// Sequence number of the last collective (0 before the first).
    pub fn seq(&self) -> u64 {
        self.seq
    }
    /// Whether the communicator was aborted after a failure.
    pub fn is_aborted(&self) -> bool {
        self.aborted.is_some()
    }

    /// Starts a collective: next sequence number, refuses when aborted, binds the context.
    fn begin(&mut self, op: &'static str) -> Result<u64> {
        self.seq += 1;
        let seq = self.seq;
        if let Some(why) = &self.aborted {
            return Err(self.fail(
                op,
                seq,
                format!("the NCCL communicator was aborted earlier ({why}); create a new process group"),
            ));
        }
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| error::driver_in_collective(op, seq, self.rank, self.world_size, &e))?;
        Ok(seq)
    }

    fn fail(&self, op: &'static str, seq: u64, reason: String) -> DdpError {
        DdpError::Collective { op, seq, rank: self.rank, world_size: self.world_size, peer: None, reason }
    }

    /// Maps an enqueue error; a failed enqueue leaves the communicator in an unknown state, so it is aborted.
    fn enqueue_failed(&mut self, op: &'static str, seq: u64, e: &nccl::NcclError) -> DdpError {
        let err = error::collective(op, seq, self.rank, self.world_size, e);
        self.abort(format!("{op} #{seq}: {}", error::result_name(e)));
        err
    }

    /// Waits for everything enqueued so far, polling the stream and NCCL's asynchronous error until the timeout.
    fn wait(&mut self, op: &'static str, seq: u64) -> Result<()> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| error::driver_in_collective(op, seq, self.rank, self.world_size, &e))?;
        let start = Instant::now();
        let mut nap = Duration::from_micros(20);
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    let err = error::driver_in_collective(op, seq, self.rank, self.world_size, &e);
                    self.abort(format!("{op} #{seq}: CUDA error {e:?}"));
                    return Err(err);
                }
            }
            if let Some(e) = self.async_error() {
                let err = error::collective(op, seq, self.rank, self.world_size, &e);
                self.abort(format!("{op} #{seq}: {}", error::result_name(&e)));
                return Err(err);
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                let reason = format!(
                    "timed out after {:.1} s waiting for the GPU (a rank is dead, stuck, or called a different \
                     collective); the NCCL communicator was aborted",
                    waited.as_secs_f64()
                );
                self.abort(format!("{op} #{seq} timed out"));
                return Err(self.fail(op, seq, reason));
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(2));
        }
    }

    /// `ncclCommGetAsyncError`: `Some` when the communicator hit an error in the background (e.g. a peer died).
    fn async_error(&self) -> Option<nccl::NcclError> {
        let mut state = ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is a live communicator (not yet aborted: callers check `aborted` first) and `state` a
        // valid out-pointer.
        let rc = unsafe { sys::ncclCommGetAsyncError(self.raw, &mut state) };
        if rc != ncclResult_t::ncclSuccess {
            return Some(nccl::NcclError(rc));
        }
        match state {
            ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress => None,
            other => Some(nccl::NcclError(other)),
        }
    }

    /// `ncclCommAbort`: frees the communicator, making pending kernels return. Later calls fail with `why`.
    pub fn abort(&mut self, why: String) {
        if self.aborted.is_some() || self.raw.is_null() {
            return;
        }
        // SAFETY: `raw` is live; after this it is never used again (`aborted` is set and `raw` nulled).
        let rc = unsafe { nccl::comm_abort(self.raw) };
        if let Err(e) = rc {
            tracing::warn!(rank = self.rank, "ncclCommAbort failed with {}", error::result_name(&e));
        }
        self.raw = std::ptr::null_mut();
        tracing::error!(rank = self.rank, "NCCL communicator aborted: {why}");
        self.aborted = Some(why);
    }

    fn cu_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    /// One collective, the same way every time: next sequence number, `enqueue` on this communicator and stream
    /// (a failed enqueue aborts the communicator), then wait for completion, the async error or the timeout.
    fn run(
        &mut self,
        op: &'static str,
        enqueue: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> std::result::Result<(), nccl::NcclError>,
    ) -> Result<()> {
        let seq = self.begin(op)?;
        if let Err(e) = enqueue(self.raw, self.cu_stream()) {
            return Err(self.enqueue_failed(op, seq, &e));
        }
        self.wait(op, seq)
    }

    // ---- raw-pointer collectives (device pointers on this communicator's device) -------------------------------

    /// In place (`ptr` is both source and destination): all_reduce of `count` elements of `dtype`.
    ///
    /// # Safety
    /// `ptr` must point to `count` elements of `dtype` on this communicator's device, valid until the call returns.
    pub(crate) unsafe fn all_reduce_raw(&mut self, ptr: u64, count: usize, dtype: DType, op: ReduceOp) -> Result<bool> {
        let (nop, divide) = nccl_op(op, dtype);
        self.run("all_reduce", |comm, stream| {
            nccl::all_reduce(ptr as *const c_void, ptr as *mut c_void, count, nccl_dtype(dtype), nop, comm, stream)
                .map(|_| ())
        })?;
        Ok(divide)
    }

    /// In place broadcast of `bytes` bytes from group rank `root`.
    ///
    /// # Safety
    /// `ptr` must point to `bytes` bytes on this communicator's device.
    pub(crate) unsafe fn broadcast_raw(&mut self, ptr: u64, bytes: usize, root: usize) -> Result<()> {
        let root = to_c_int(root, "root")?;
        self.run("broadcast", |comm, stream| {
            nccl::broadcast(
                ptr as *const c_void,
                ptr as *mut c_void,
                bytes,
                ncclDataType_t::ncclUint8,
                root,
                comm,
                stream,
            )
            .map(|_| ())
        })
    }

    /// all_gather: `recv` (world_size · `bytes`) receives each rank's `send` (`bytes`) at block r.
    ///
    /// # Safety
    /// Both pointers must be on this device with the sizes above.
    pub(crate) unsafe fn all_gather_raw(&mut self, send: u64, recv: u64, bytes: usize) -> Result<()> {
        self.run("all_gather", |comm, stream| {
            nccl::all_gather(send as *const c_void, recv as *mut c_void, bytes, ncclDataType_t::ncclUint8, comm, stream)
                .map(|_| ())
        })
    }

    /// reduce_scatter: `send` has world_size · `recv_count` elements, rank r keeps reduced block r in `recv`.
    ///
    /// # Safety
    /// Both pointers must be on this device with the sizes above.
    pub(crate) unsafe fn reduce_scatter_raw(
        &mut self,
        send: u64,
        recv: u64,
        recv_count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<bool> {
        let (nop, divide) = nccl_op(op, dtype);
        self.run("reduce_scatter", |comm, stream| {
            let dt = nccl_dtype(dtype);
            nccl::reduce_scatter(send as *const c_void, recv as *mut c_void, recv_count, dt, nop, comm, stream)
                .map(|_| ())
        })?;
        Ok(divide)
    }

    /// Point-to-point: sends (`is_send`) or receives `bytes` bytes to/from group rank `peer`, inside an NCCL
    /// group (`ncclGroupStart`/`ncclGroupEnd`, both checked; cudarc's `Group` guard would panic on an error).
    ///
    /// # Safety
    /// `ptr` must point to `bytes` bytes on this device.
    pub(crate) unsafe fn p2p_raw(&mut self, ptr: u64, bytes: usize, peer: usize, is_send: bool) -> Result<()> {
        let op = if is_send { "send" } else { "recv" };
        let peer = to_c_int(peer, "peer")?;
        self.run(op, |comm, stream| {
            nccl::group_start()?;
            let rc = if is_send {
                nccl::send(ptr as *const c_void, bytes, ncclDataType_t::ncclUint8, peer, comm, stream).map(|_| ())
            } else {
                nccl::recv(ptr as *mut c_void, bytes, ncclDataType_t::ncclUint8, peer, comm, stream).map(|_| ())
            };
            // The group must be closed even when the enqueue failed.
            let end = nccl::group_end();
            rc.and(end.map(|_| ()))
        })
    }

    // ---- typed device-slice API ---------------------------------------------------------------------------------

    /// Makes this communicator's stream wait for work queued on `other` (the slice's stream), so a slice written
    /// by candle kernels on its own stream is complete before NCCL reads it.
    fn after(&self, other: &Arc<CudaStream>) -> Result<()> {
        if !Arc::ptr_eq(other, &self.stream) {
            self.stream.join(other).map_err(|e| error::init_driver("cuStreamWaitEvent", &e))?;
        }
        Ok(())
    }

    /// Refuses an operand (`what`, on `other`'s stream) that lives on another GPU than this communicator.
    fn check_device(&self, other: &Arc<CudaStream>, what: &str) -> Result<()> {
        let (a, b) = (other.context().ordinal(), self.stream.context().ordinal());
        if a != b {
            return Err(DdpError::InvalidArgument(format!(
                "{what} lives on GPU {a} but this NCCL communicator uses GPU {b}"
            )));
        }
        Ok(())
    }

    /// The preamble every device-slice collective shares, in this order: each operand (its stream and what it
    /// is) must live on this communicator's GPU; then the collective's own argument checks (`args`); then, for
    /// empty operands, nothing to do (`None`). Otherwise this communicator's stream is ordered after the
    /// operands' streams and returned, for borrowing the device pointers on it.
    fn prepare(
        &self,
        operands: &[(&Arc<CudaStream>, &str)],
        args: Result<()>,
        empty: bool,
    ) -> Result<Option<Arc<CudaStream>>> {
        for (stream, what) in operands {
            self.check_device(stream, what)?;
        }
        args?;
        if empty {
            return Ok(None);
        }
        for (stream, _) in operands {
            self.after(stream)?;
        }
        Ok(Some(self.stream.clone()))
    }

    /// In place all_reduce of a device buffer (`CudaSlice` or `CudaViewMut`, on any stream of this device;
    /// ordered after the buffer's pending work). Returns when the result is complete.
    ///
    /// `Avg` on integer slices is not supported on the device (it needs a division kernel): use `Sum` and divide.
    pub fn all_reduce<T: NcclElement, S: DevicePtrMut<T>>(&mut self, buf: &mut S, op: ReduceOp) -> Result<()> {
        let args = native_op("all_reduce", op, T::DTYPE, "use Sum and divide by the world size");
        let Some(stream) = self.prepare(&[(buf.stream(), "all_reduce buffer")], args, buf.is_empty())? else {
            return Ok(());
        };
        let count = buf.len();
        let (ptr, _sync) = buf.device_ptr_mut(&stream);
        // SAFETY: `ptr` points to `count` elements of T on this device and `_sync` keeps it borrowed.
        unsafe { self.all_reduce_raw(ptr, count, T::DTYPE, op)? };
        Ok(())
    }

    /// In place broadcast of a device slice from group rank `root`.
    pub fn broadcast<T: NcclElement, S: DevicePtrMut<T>>(&mut self, buf: &mut S, root: usize) -> Result<()> {
        let Some(stream) = self.prepare(&[(buf.stream(), "broadcast buffer")], Ok(()), buf.is_empty())? else {
            return Ok(());
        };
        let bytes = buf.num_bytes();
        let (ptr, _sync) = buf.device_ptr_mut(&stream);
        // SAFETY: as above, `bytes` bytes.
        unsafe { self.broadcast_raw(ptr, bytes, root) }
    }

    /// all_gather of device slices: `output.len()` must be world_size · `input.len()`.
    pub fn all_gather<T: NcclElement, I: DevicePtr<T>, O: DevicePtrMut<T>>(
        &mut self,
        input: &I,
        output: &mut O,
    ) -> Result<()> {
        let args = if output.len() != input.len() * self.world_size {
            Err(DdpError::InvalidArgument(format!(
                "all_gather: output has {} elements, expected world_size ({}) × input ({})",
                output.len(),
                self.world_size,
                input.len()
            )))
        } else {
            Ok(())
        };
        let operands = [(input.stream(), "all_gather input"), (output.stream(), "all_gather output")];
        let Some(stream) = self.prepare(&operands, args, input.is_empty())? else { return Ok(()) };
        let bytes = input.num_bytes();
        let (src, _s) = input.device_ptr(&stream);
        let (dst, _d) = output.device_ptr_mut(&stream);
        // SAFETY: both pointers are on this device with the checked sizes.
        unsafe { self.all_gather_raw(src, dst, bytes) }
    }

    /// reduce_scatter of device slices: `input.len()` must be world_size · `output.len()`.
    pub fn reduce_scatter<T: NcclElement, I: DevicePtr<T>, O: DevicePtrMut<T>>(
        &mut self,
        input: &I,
        output: &mut O,
        op: ReduceOp,
    ) -> Result<()> {
        let args = if input.len() != output.len() * self.world_size {
            Err(DdpError::InvalidArgument(format!(
                "reduce_scatter: input has {} elements, expected world_size ({}) × output ({})",
                input.len(),
                self.world_size,
                output.len()
            )))
        } else {
            native_op("reduce_scatter", op, T::DTYPE, "use Sum and divide")
        };
        let operands = [(input.stream(), "reduce_scatter input"), (output.stream(), "reduce_scatter output")];
        let Some(stream) = self.prepare(&operands, args, output.is_empty())? else { return Ok(()) };
        let n = output.len();
        let (src, _s) = input.device_ptr(&stream);
        let (dst, _d) = output.device_ptr_mut(&stream);
        // SAFETY: both pointers are on this device with the checked sizes.
        unsafe { self.reduce_scatter_raw(src, dst, n, T::DTYPE, op)? };
        Ok(())
    }

    /// Sends a device slice to group rank `peer`.
    pub fn send<T: NcclElement, S: DevicePtr<T>>(&mut self, buf: &S, peer: usize) -> Result<()> {
        let Some(stream) = self.prepare(&[(buf.stream(), "send buffer")], Ok(()), buf.is_empty())? else {
            return Ok(());
        };
        let bytes = buf.num_bytes();
        let (ptr, _sync) = buf.device_ptr(&stream);
        // SAFETY: `bytes` bytes on this device.
        unsafe { self.p2p_raw(ptr, bytes, peer, true) }
    }

    /// Receives into a device slice from group rank `peer`.
    pub fn recv<T: NcclElement, S: DevicePtrMut<T>>(&mut self, buf: &mut S, peer: usize) -> Result<()> {
        let Some(stream) = self.prepare(&[(buf.stream(), "recv buffer")], Ok(()), buf.is_empty())? else {
            return Ok(());
        };
        let bytes = buf.num_bytes();
        let (ptr, _sync) = buf.device_ptr_mut(&stream);
        // SAFETY: `bytes` bytes on this device.
        unsafe { self.p2p_raw(ptr, bytes, peer, false) }
    }

    /// Returns once every rank reached the barrier: an all_reduce of one `f32` (as PyTorch's NCCL barrier).
    pub fn barrier(&mut self) -> Result<()> {
        let stream = self.stream.clone();
        let mut one = stream.alloc_zeros::<f32>(1).map_err(|e| error::init_driver("cuMemAlloc (barrier)", &e))?;
        let (ptr, _sync) = one.device_ptr_mut(&stream);
        // SAFETY: one f32 on this device.
        let seq_before = self.seq;
        let r = unsafe { self.all_reduce_raw(ptr, 1, DType::F32, ReduceOp::Sum) };
        r.map(|_| ()).map_err(|e| rename_op(e, "barrier", seq_before + 1))
    }
}

/// Refuses `Avg` where NCCL has no native operator (integer device buffers: the division would need a kernel);
/// `hint` says what to do instead.
fn native_op(what: &str, op: ReduceOp, dtype: DType, hint: &str) -> Result<()> {
    if nccl_op(op, dtype).1 {
        return Err(DdpError::InvalidArgument(format!(
            "{what} Avg on {dtype:?} device buffers is not supported: {hint}"
        )));
    }
    Ok(())
}

/// Reports a collective error under another op name (the barrier is an all_reduce inside).
fn rename_op(e: DdpError, op: &'static str, seq: u64) -> DdpError {
    match e {
        DdpError::Collective { rank, world_size, peer, reason, .. } => {
            DdpError::Collective { op, seq, rank, world_size, peer, reason }
        }
        other => other,
    }
}

fn to_c_int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| DdpError::InvalidArgument(format!("{what} {v} does not fit NCCL's int")))
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return;
        }
        let _ = self.stream.context().bind_to_thread();
        // Clean shutdown: finalize flushes pending operations, destroy frees; on any error fall back to abort.
        // SAFETY: `raw` is live and not used after this.
        unsafe {
            if nccl::comm_finalize(self.raw).is_ok() {
                let _ = nccl::comm_destroy(self.raw);
            } else {
                let _ = nccl::comm_abort(self.raw);
            }
        }
        self.raw = std::ptr::null_mut();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_avg_is_native_integer_avg_divides_after() {
        assert_eq!(nccl_op(ReduceOp::Avg, DType::BF16), (ncclRedOp_t::ncclAvg, false));
        assert_eq!(nccl_op(ReduceOp::Avg, DType::I64), (ncclRedOp_t::ncclSum, true));
        assert_eq!(nccl_op(ReduceOp::Product, DType::F32), (ncclRedOp_t::ncclProd, false));
        assert_eq!(nccl_dtype(DType::BF16), ncclDataType_t::ncclBfloat16);
    }
}
