//! [`MpiBackend`]: the [`crate::Backend`] over one MPI communicator.

use super::ops::{byte_type, datatype, MpiOp};
use super::runtime::{error_string, runtime, MpiRuntime};
use super::watchdog;
use crate::backend::Backend;
use crate::store::Store;
use crate::sync;
use crate::{DType, DdpError, ReduceOp, Result};
use mpi::ffi;
use std::ffi::{c_int, c_void};
use std::sync::Mutex;
use std::time::Duration;

/// Tag of point-to-point messages on our communicators (they are private to ddp-core, so one tag suffices).
const P2P_TAG: c_int = 7;

/// An MPI communicator handle we own (`MPI_Comm_free` on drop).
struct MpiComm {
    raw: ffi::MPI_Comm,
    seq: u64,
}

// SAFETY: `MpiComm` is `!Send` only because Open MPI's `MPI_Comm` is a pointer. MPI handles are process-wide
// and valid on every thread; MPI forbids only *concurrent* use of one communicator without
// MPI_THREAD_MULTIPLE. The backend keeps the communicator in a `Mutex` (one thread at a time uses it) and takes
// the runtime's process-wide lock around every call when the library is not thread-multiple. `Sync` is not
// implemented.
unsafe impl Send for MpiComm {}

impl Drop for MpiComm {
    fn drop(&mut self) {
        let mut finalized = 0;
        // SAFETY: MPI_Finalized may always be called; the communicator is ours and no call is in flight (we
        // hold `&mut self`). After MPI_Finalize freeing is neither needed nor allowed.
        unsafe {
            ffi::MPI_Finalized(&mut finalized);
            if finalized == 0 {
                let _serial = runtime().ok().and_then(|r| r.serialize());
                ffi::MPI_Comm_free(&mut self.raw);
            }
        }
    }
}

/// A process group backend over MPI (Open MPI or MPICH through rsmpi's `mpi-sys`).
///
/// Every collective is the blocking MPI call (the library's tuned algorithms: shared memory within a node,
/// its network transports across nodes), watched by [`watchdog`] for the group's timeout. `Avg` is `MPI_SUM`
/// then a division on each rank; f16/bf16 reduce with user operators. Communicators are created with
/// `MPI_ERRORS_RETURN`, so MPI errors come back as [`DdpError::Collective`] with `MPI_Error_string`.
pub struct MpiBackend {
    comm: Mutex<MpiComm>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    runtime: &'static MpiRuntime,
}

impl std::fmt::Debug for MpiBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiBackend").field("rank", &self.rank).field("world_size", &self.world_size).finish()
    }
}

/// Store key under which each member publishes its MPI world rank.
const WORLD_RANK_KEY: &str = "mpi/world_rank";

impl MpiBackend {
    /// The communicator of a group whose members find each other through `store`: every member publishes its
    /// `MPI_COMM_WORLD` rank, then the members call `MPI_Comm_create_group` (collective over the members only)
    /// with the group in `rank` order. Works for the world group and any sub-group.
    ///
    /// Errors: [`DdpError::BackendUnavailable`] when MPI cannot be initialised, [`DdpError::InvalidArgument`]
    /// when two ranks are the same MPI process (threads-as-ranks cannot use MPI), store timeouts, MPI errors.
    pub fn for_group(store: &dyn Store, rank: usize, world_size: usize, timeout: Duration) -> Result<Self> {
        let rt = runtime()?;
        let (world_rank, mpi_world_size) = world_rank_and_size(rt)?;
        if world_size > mpi_world_size {
            return Err(DdpError::InvalidArgument(format!(
                "a group of {world_size} ranks needs as many MPI processes, but MPI_COMM_WORLD has {mpi_world_size}: \
                 start the program with `mpirun -np {world_size}` (or srun -n {world_size})"
            )));
        }
        store.set(&format!("{WORLD_RANK_KEY}/{rank}"), world_rank.to_string().as_bytes())?;
        let keys: Vec<String> = (0..world_size).map(|r| format!("{WORLD_RANK_KEY}/{r}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        store.wait(&refs, timeout)?;
        let mut members = Vec::with_capacity(world_size);
        for key in &keys {
            let v = store.get(key)?;
            let r: c_int = String::from_utf8_lossy(&v)
                .parse()
                .map_err(|_| DdpError::Protocol(format!("store key {key} does not hold an MPI rank")))?;
            if let Some(first) = members.iter().position(|&m| m == r) {
                return Err(DdpError::InvalidArgument(format!(
                    "group ranks {first} and {} are the same MPI process (world rank {r}): the MPI backend needs \
                     one process per rank (threads-as-ranks only work with the CPU backend)",
                    members.len()
                )));
            }
            members.push(r);
        }
        let comm = create_group_comm(rt, &members, timeout)?;
        Self::from_raw(rt, comm, timeout)
    }

    /// A backend over a duplicate of `MPI_COMM_WORLD` (rank and size from MPI itself). Collective over all MPI
    /// processes.
    pub fn world(timeout: Duration) -> Result<Self> {
        let rt = runtime()?;
        let mut comm = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
        let rc = {
            let _serial = rt.serialize();
            let _watch = watchdog::watch("MPI_Comm_dup", 0, 0, 0, timeout);
            // SAFETY: MPI is initialised; `comm` is a valid out-pointer.
            unsafe { ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, comm.as_mut_ptr()) }
        };
        check_setup(rc, "MPI_Comm_dup(MPI_COMM_WORLD)")?;
        // SAFETY: initialised by the successful MPI_Comm_dup.
        Self::from_raw(rt, unsafe { comm.assume_init() }, timeout)
    }

    fn from_raw(rt: &'static MpiRuntime, raw: ffi::MPI_Comm, timeout: Duration) -> Result<Self> {
        let comm = MpiComm { raw, seq: 0 };
        let (mut rank, mut size) = (0, 0);
        {
            let _serial = rt.serialize();
            // SAFETY: `raw` is a valid communicator; out-pointers are valid.
            unsafe {
                check_setup(ffi::MPI_Comm_set_errhandler(raw, ffi::RSMPI_ERRORS_RETURN), "MPI_Comm_set_errhandler")?;
                check_setup(ffi::MPI_Comm_rank(raw, &mut rank), "MPI_Comm_rank")?;
                check_setup(ffi::MPI_Comm_size(raw, &mut size), "MPI_Comm_size")?;
            }
        }
        Ok(MpiBackend { comm: Mutex::new(comm), rank: rank as usize, world_size: size as usize, timeout, runtime: rt })
    }

    /// The MPI library in use (first line of `MPI_Get_library_version`).
    pub fn library(&self) -> &str {
        &self.runtime.library
    }

    /// Runs one blocking MPI call on the communicator with the next sequence number, under the watchdog.
    fn call(&self, op: &'static str, f: impl FnOnce(ffi::MPI_Comm) -> c_int) -> Result<()> {
        let mut comm = sync::lock(&self.comm);
        comm.seq += 1;
        let seq = comm.seq;
        let rc = {
            let _serial = self.runtime.serialize();
            let _watch = watchdog::watch(op, seq, self.rank, self.world_size, self.timeout);
            f(comm.raw)
        };
        if rc != 0 {
            return Err(DdpError::Collective {
                op,
                seq,
                rank: self.rank,
                world_size: self.world_size,
                peer: None,
                reason: format!("MPI returned {}", error_string(rc)),
            });
        }
        Ok(())
    }

    fn count(&self, op: &'static str, n: usize) -> Result<c_int> {
        c_int::try_from(n).map_err(|_| {
            DdpError::InvalidArgument(format!(
                "{op}: {n} elements exceed MPI's int count; split the buffer into pieces of at most {} elements",
                c_int::MAX
            ))
        })
    }

    fn op(&self, op_name: &'static str, op: ReduceOp, dtype: DType) -> Result<MpiOp> {
        let _serial = self.runtime.serialize();
        MpiOp::new(op, dtype).map_err(|rc| DdpError::Collective {
            op: op_name,
            seq: sync::lock(&self.comm).seq + 1,
            rank: self.rank,
            world_size: self.world_size,
            peer: None,
            reason: format!("MPI_Op_create failed: {}", error_string(rc)),
        })
    }

    fn peer(&self, r: usize, what: &str) -> Result<c_int> {
        if r >= self.world_size {
            return Err(DdpError::InvalidArgument(format!("{what} {r} is out of range for {} ranks", self.world_size)));
        }
        Ok(r as c_int)
    }
}

fn world_rank_and_size(rt: &MpiRuntime) -> Result<(c_int, usize)> {
    let (mut rank, mut size) = (0, 0);
    let _serial = rt.serialize();
    // SAFETY: MPI is initialised; out-pointers are valid.
    unsafe {
        check_setup(ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank), "MPI_Comm_rank")?;
        check_setup(ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut size), "MPI_Comm_size")?;
    }
    Ok((rank, size as usize))
}

/// `MPI_Comm_create_group` over the given world ranks (in new-rank order). Collective over those ranks only.
fn create_group_comm(rt: &MpiRuntime, members: &[c_int], timeout: Duration) -> Result<ffi::MPI_Comm> {
    let _serial = rt.serialize();
    let _watch = watchdog::watch("MPI_Comm_create_group", 0, 0, members.len(), timeout);
    let mut world_group = std::mem::MaybeUninit::<ffi::MPI_Group>::uninit();
    let mut group = std::mem::MaybeUninit::<ffi::MPI_Group>::uninit();
    let mut comm = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
    // SAFETY: MPI is initialised, out-pointers are valid, `members` holds members.len() distinct world ranks.
    unsafe {
        check_setup(ffi::MPI_Comm_group(ffi::RSMPI_COMM_WORLD, world_group.as_mut_ptr()), "MPI_Comm_group")?;
        let mut world_group = world_group.assume_init();
        let rc = ffi::MPI_Group_incl(world_group, members.len() as c_int, members.as_ptr(), group.as_mut_ptr());
        ffi::MPI_Group_free(&mut world_group);
        check_setup(rc, "MPI_Group_incl")?;
        let mut group = group.assume_init();
        // Tag 0: a process creates its groups one after another, in the same order as its peers.
        let rc = ffi::MPI_Comm_create_group(ffi::RSMPI_COMM_WORLD, group, 0, comm.as_mut_ptr());
        ffi::MPI_Group_free(&mut group);
        check_setup(rc, "MPI_Comm_create_group")?;
        Ok(comm.assume_init())
    }
}

fn check_setup(rc: c_int, what: &str) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(DdpError::BackendUnavailable { backend: "mpi", reason: format!("{what} failed: {}", error_string(rc)) })
    }
}

impl Backend for MpiBackend {
    fn name(&self) -> &'static str {
        "mpi"
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
        let n = self.count("all_reduce", buf.len() / dtype.size_in_bytes())?;
        let mop = self.op("all_reduce", op, dtype)?;
        let dt = datatype(dtype);
        match self.runtime.in_place {
            Some(in_place) => {
                let dst = buf.as_mut_ptr() as *mut c_void;
                // SAFETY: MPI_IN_PLACE as send buffer; `dst` holds n elements of `dt`; the call is blocking.
                self.call("all_reduce", |c| unsafe {
                    ffi::MPI_Allreduce(in_place as *const c_void, dst, n, dt, mop.raw(), c)
                })?;
            }
            None => {
                let src = buf.to_vec();
                let dst = buf.as_mut_ptr() as *mut c_void;
                // SAFETY: `src` and `dst` hold n elements each; blocking call.
                self.call("all_reduce", |c| unsafe {
                    ffi::MPI_Allreduce(src.as_ptr() as *const c_void, dst, n, dt, mop.raw(), c)
                })?;
            }
        }
        if op == ReduceOp::Avg {
            crate::dtype::divide_in_place(dtype, buf, self.world_size);
        }
        Ok(())
    }

    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let n = self.count("broadcast", buf.len())?;
        let root = self.peer(root, "broadcast root")?;
        let ptr = buf.as_mut_ptr() as *mut c_void;
        // SAFETY: `ptr` holds n bytes; blocking call.
        self.call("broadcast", |c| unsafe { ffi::MPI_Bcast(ptr, n, byte_type(), root, c) })
    }

    fn all_gather(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        if input.is_empty() {
            return Ok(());
        }
        let n = self.count("all_gather", input.len())?;
        self.count("all_gather", output.len())?;
        let (src, dst) = (input.as_ptr() as *const c_void, output.as_mut_ptr() as *mut c_void);
        // SAFETY: `src` holds n bytes, `dst` world_size · n (checked by ProcessGroup); blocking call.
        self.call("all_gather", |c| unsafe { ffi::MPI_Allgather(src, n, byte_type(), dst, n, byte_type(), c) })
    }

    fn reduce_scatter(&self, input: &[u8], output: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        if output.is_empty() {
            return Ok(());
        }
        let n = self.count("reduce_scatter", output.len() / dtype.size_in_bytes())?;
        self.count("reduce_scatter", input.len() / dtype.size_in_bytes())?;
        let mop = self.op("reduce_scatter", op, dtype)?;
        let dt = datatype(dtype);
        let (src, dst) = (input.as_ptr() as *const c_void, output.as_mut_ptr() as *mut c_void);
        // SAFETY: `src` holds world_size · n elements, `dst` n; blocking call.
        self.call("reduce_scatter", |c| unsafe { ffi::MPI_Reduce_scatter_block(src, dst, n, dt, mop.raw(), c) })?;
        if op == ReduceOp::Avg {
            crate::dtype::divide_in_place(dtype, output, self.world_size);
        }
        Ok(())
    }

    fn send(&self, buf: &[u8], dst: usize) -> Result<()> {
        let n = self.count("send", buf.len())?;
        let dst = self.peer(dst, "send destination")?;
        let ptr = buf.as_ptr() as *const c_void;
        // SAFETY: `ptr` holds n bytes; blocking call.
        self.call("send", |c| unsafe { ffi::MPI_Send(ptr, n, byte_type(), dst, P2P_TAG, c) })
    }

    fn recv(&self, buf: &mut [u8], src: usize) -> Result<()> {
        let n = self.count("recv", buf.len())?;
        let src = self.peer(src, "recv source")?;
        let ptr = buf.as_mut_ptr() as *mut c_void;
        let mut status = std::mem::MaybeUninit::<ffi::MPI_Status>::zeroed();
        let status_ptr = status.as_mut_ptr();
        // SAFETY: `ptr` holds n bytes, `status_ptr` is valid; blocking call.
        self.call("recv", |c| unsafe { ffi::MPI_Recv(ptr, n, byte_type(), src, P2P_TAG, c, status_ptr) })?;
        let mut got: c_int = 0;
        // SAFETY: `status` was filled by the successful MPI_Recv.
        unsafe { ffi::MPI_Get_count(status_ptr, byte_type(), &mut got) };
        if got != n {
            return Err(DdpError::Collective {
                op: "recv",
                seq: sync::lock(&self.comm).seq,
                rank: self.rank,
                world_size: self.world_size,
                peer: Some(src as usize),
                reason: format!("expected {n} bytes but rank {src} sent {got}"),
            });
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        // SAFETY: blocking call on our communicator.
        self.call("barrier", |c| unsafe { ffi::MPI_Barrier(c) })
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}
