//! [`ProcessGroup`]: a set of ranks, its store and its backend — the handle every collective goes through
//! (like `torch.distributed.ProcessGroup`).

use crate::backend::{Backend, BackendKind};
use crate::store::Store;
use crate::token::RunToken;
use crate::{DType, DdpError, Element, ReduceOp, Result};
use std::sync::Arc;
use std::time::Duration;

/// Default timeout of a collective: 30 min, as PyTorch's non-NCCL backends.
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Explicit options for [`ProcessGroup::init`]. [`InitOptions::from_env`] fills them from the environment.
#[derive(Debug, Clone)]
pub struct InitOptions {
    /// Global rank of this process.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank on this machine.
    pub local_rank: usize,
    /// Processes on this machine.
    pub local_world_size: usize,
    /// Store address (MASTER_ADDR).
    pub master_addr: String,
    /// Store port (MASTER_PORT). With `host_store` and port 0 a free port is picked.
    pub master_port: u16,
    /// Whether this process hosts the store server (rank 0 when no launcher hosts it).
    pub host_store: bool,
    /// Address the store server binds when hosted here (default: `master_addr`).
    pub store_bind_addr: Option<String>,
    /// Backend.
    pub backend: BackendKind,
    /// Collective timeout (default 30 min); store waits use the same value.
    pub timeout: Duration,
    /// Run token; `None` reads ACCEL_RUN_TOKEN, and a single-machine job without one generates nothing and
    /// fails to connect to a token-checking server — the launcher always sets it.
    pub token: Option<RunToken>,
}

impl InitOptions {
    /// A single-process group (world size 1) that needs no environment: handy for tests and for running a
    /// distributed program as a plain one.
    pub fn single_process() -> Self {
        InitOptions {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: crate::env::DEFAULT_MASTER_ADDR.into(),
            master_port: 0,
            host_store: true,
            store_bind_addr: None,
            backend: BackendKind::Cpu,
            timeout: DEFAULT_COLLECTIVE_TIMEOUT,
            token: None,
        }
    }

    /// Reads the layout with [`crate::DistEnv::from_env`], plus ACCEL_TIMEOUT, ACCEL_BACKEND and ACCEL_RUN_TOKEN.
    pub fn from_env() -> Result<Self> {
        todo!("ddp-core init: InitOptions::from_env")
    }
}

/// A group of processes that run collectives together. Cheap to clone (shared handle); `Send + Sync`.
#[derive(Clone)]
pub struct ProcessGroup {
    pub(crate) inner: Arc<GroupInner>,
}

pub(crate) struct GroupInner {
    pub(crate) backend: Box<dyn Backend>,
    pub(crate) store: Arc<dyn Store>,
    /// Global ranks of the members, indexed by group rank.
    pub(crate) members: Vec<usize>,
    pub(crate) global_rank: usize,
    pub(crate) local_rank: usize,
    pub(crate) local_world_size: usize,
    pub(crate) timeout: Duration,
    /// Keeps a store server alive when this process hosts it.
    pub(crate) _server: Option<Arc<crate::store::TcpStoreServer>>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("backend", &self.backend_name())
            .finish()
    }
}

impl ProcessGroup {
    /// Initialises the default (world) group from the environment (torchrun / Slurm / MPI names).
    pub fn init_from_env() -> Result<Self> {
        Self::init(InitOptions::from_env()?)
    }

    /// Initialises the default group from explicit options.
    pub fn init(opts: InitOptions) -> Result<Self> {
        let _ = opts;
        todo!("ddp-core init: connect/host store, build backend")
    }

    /// A world-size-1 group (no network). Collectives are identities (Avg divides by 1).
    pub fn single_process() -> Result<Self> {
        Self::init(InitOptions::single_process())
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.inner.backend.rank()
    }
    /// Number of processes in the group.
    pub fn world_size(&self) -> usize {
        self.inner.backend.world_size()
    }
    /// Rank in the job (the world group), whatever group this is.
    pub fn global_rank(&self) -> usize {
        self.inner.global_rank
    }
    /// Global ranks of the members, in group-rank order.
    pub fn members(&self) -> &[usize] {
        &self.inner.members
    }
    /// Rank on this machine (LOCAL_RANK).
    pub fn local_rank(&self) -> usize {
        self.inner.local_rank
    }
    /// Processes on this machine (LOCAL_WORLD_SIZE).
    pub fn local_world_size(&self) -> usize {
        self.inner.local_world_size
    }
    /// Whether this is group rank 0.
    pub fn is_main_process(&self) -> bool {
        self.rank() == 0
    }
    /// Backend name ("cpu", "nccl", "mpi").
    pub fn backend_name(&self) -> &'static str {
        self.inner.backend.name()
    }
    /// The group's store (keys already namespaced for sub-groups).
    pub fn store(&self) -> Arc<dyn Store> {
        self.inner.store.clone()
    }
    /// Collective timeout.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }
    /// The raw byte-level backend.
    pub fn backend(&self) -> &dyn Backend {
        self.inner.backend.as_ref()
    }

    /// In place: `buf` becomes `op` over every rank's `buf`. All ranks pass the same length.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.inner.backend.all_reduce(bytemuck::cast_slice_mut(buf), T::DTYPE, op)
    }

    /// In place: every rank's `buf` becomes `root`'s.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_rank(root, "broadcast root")?;
        self.inner.backend.broadcast(bytemuck::cast_slice_mut(buf), root)
    }

    /// `output[r·n .. (r+1)·n]` receives rank r's `input` (n = input.len(); output.len() must be world_size·n).
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        if output.len() != input.len() * self.world_size() {
            return Err(DdpError::InvalidArgument(format!(
                "all_gather: output has {} elements, expected world_size ({}) × input ({}) = {}",
                output.len(),
                self.world_size(),
                input.len(),
                input.len() * self.world_size()
            )));
        }
        self.inner.backend.all_gather(bytemuck::cast_slice(input), bytemuck::cast_slice_mut(output))
    }

    /// `input` (len world_size·n) is reduced with `op` across ranks; rank r gets block r in `output` (len n).
    pub fn reduce_scatter<T: Element>(&self, input: &[T], output: &mut [T], op: ReduceOp) -> Result<()> {
        if input.len() != output.len() * self.world_size() {
            return Err(DdpError::InvalidArgument(format!(
                "reduce_scatter: input has {} elements, expected world_size ({}) × output ({}) = {}",
                input.len(),
                self.world_size(),
                output.len(),
                output.len() * self.world_size()
            )));
        }
        self.inner.backend.reduce_scatter(bytemuck::cast_slice(input), bytemuck::cast_slice_mut(output), T::DTYPE, op)
    }

    /// Sends `buf` to group rank `dst`.
    pub fn send<T: Element>(&self, buf: &[T], dst: usize) -> Result<()> {
        self.check_peer(dst, "send destination")?;
        self.inner.backend.send(bytemuck::cast_slice(buf), dst)
    }

    /// Receives `buf.len()` elements from group rank `src`.
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize) -> Result<()> {
        self.check_peer(src, "recv source")?;
        self.inner.backend.recv(bytemuck::cast_slice_mut(buf), src)
    }

    /// Returns when every rank of the group has reached the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.inner.backend.barrier()
    }

    /// Raw byte all_reduce (used by tensor helpers and DDP buckets).
    pub fn all_reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        self.inner.backend.all_reduce(buf, dtype, op)
    }

    /// Creates a sub-group of the given *group* ranks (like `torch.distributed.new_group`). Every rank of this
    /// group must call it with the same list, in the same order of calls; members get `Some(group)`, the others
    /// `None`. Ranks must be distinct and in range.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let _ = ranks;
        todo!("ddp-core: sub-groups via a PrefixStore and a fresh backend")
    }

    /// Splits the group by colour (like `MPI_Comm_split`): ranks with the same `color` form a group, ordered by
    /// `key` then by current rank; `None` colour opts out. Every rank must call it.
    pub fn split(&self, color: Option<u32>, key: usize) -> Result<Option<ProcessGroup>> {
        let _ = (color, key);
        todo!("ddp-core: split by colour")
    }

    fn check_rank(&self, r: usize, what: &str) -> Result<()> {
        if r >= self.world_size() {
            return Err(DdpError::InvalidArgument(format!(
                "{what} {r} is out of range for a group of {} ranks",
                self.world_size()
            )));
        }
        Ok(())
    }

    fn check_peer(&self, r: usize, what: &str) -> Result<()> {
        self.check_rank(r, what)?;
        if r == self.rank() {
            return Err(DdpError::InvalidArgument(format!("{what} {r} is this rank itself")));
        }
        Ok(())
    }
}
