//! [`ProcessGroup`]: a set of ranks, its store and its backend — the handle every collective goes through
//! (like `torch.distributed.ProcessGroup`).

use crate::backend::{Backend, BackendKind, PiecewiseBuffer};
use crate::cpu::{CpuBackend, CpuOptions, CpuTuning};
use crate::store::{MemoryStore, PrefixStore, Store, TcpStore, TcpStoreServer};
use crate::token::RunToken;
use crate::traffic::{Op, TrafficCounters, TrafficStats};
use crate::{DType, DdpError, Element, ReduceOp, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use crate::env::DEFAULT_COLLECTIVE_TIMEOUT;

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
        crate::env::init_options_from_env()
    }
}

/// A group of processes that run collectives together. Cheap to clone (shared handle); `Send + Sync`.
#[derive(Clone)]
pub struct ProcessGroup {
    pub(crate) inner: Arc<GroupInner>,
}

pub(crate) struct GroupInner {
    pub(crate) backend: Box<dyn Backend>,
    /// Reused by [`ProcessGroup::all_reduce_piecewise`] on backends that pack the pieces into one buffer; never
    /// grown on the shared-memory path, which reads and writes the pieces itself.
    pub(crate) piecewise_scratch: Mutex<Vec<u64>>,
    pub(crate) store: Arc<dyn Store>,
    /// Global ranks of the members, indexed by group rank.
    pub(crate) members: Vec<usize>,
    pub(crate) global_rank: usize,
    pub(crate) local_rank: usize,
    pub(crate) local_world_size: usize,
    pub(crate) timeout: Duration,
    /// Keeps a store server alive when this process hosts it.
    pub(crate) _server: Option<Arc<crate::store::TcpStoreServer>>,
    /// How sub-groups are built (same backend kind, token, host and tuning as this group).
    pub(crate) spawn: SpawnInfo,
    /// Store key namespace of this group: `ddp/attempt{restart}/world{gen}/` for a world group, empty for a
    /// sub-group (whose store is already a [`PrefixStore`]).
    pub(crate) namespace: String,
    /// Sub-groups created so far (every rank creates them in the same order, so the count names them).
    pub(crate) subgroups: AtomicU64,
    /// Calls and payload bytes per operation ([`ProcessGroup::traffic`]).
    pub(crate) traffic: TrafficCounters,
}

/// What a group remembers to build sub-groups like itself.
#[derive(Debug, Clone)]
pub(crate) struct SpawnInfo {
    pub(crate) kind: BackendKind,
    pub(crate) token: Option<RunToken>,
    pub(crate) advertise_host: String,
    pub(crate) cpu_tuning: CpuTuning,
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
    ///
    /// - World size 1: an in-process [`MemoryStore`] and no sockets at all.
    /// - Otherwise: when `host_store`, binds a [`TcpStoreServer`] at `store_bind_addr` (default `master_addr`)
    ///   on `master_port` (0 = a free port) and keeps it alive as long as the group; then connects a
    ///   [`TcpStore`] client to `master_addr:master_port` with the run token (`opts.token`, else
    ///   ACCEL_RUN_TOKEN) and builds the backend (`opts.backend`; `Auto` picks NCCL when available, else CPU,
    ///   and logs why). The CPU backend listens on the local IP of the store connection (override with
    ///   ACCEL_CPU_HOST).
    ///
    /// Errors: [`DdpError::Env`] when no run token is available for a multi-process group,
    /// [`DdpError::Bind`] naming host:port when the store port is taken, [`DdpError::Connect`] /
    /// [`DdpError::TokenRejected`] from the store, [`DdpError::BackendUnavailable`] for a backend not compiled in.
    pub fn init(opts: InitOptions) -> Result<Self> {
        if opts.world_size == 0 || opts.rank >= opts.world_size {
            return Err(DdpError::InvalidArgument(format!(
                "rank {} is out of range for world size {}",
                opts.rank, opts.world_size
            )));
        }
        #[cfg(feature = "mpi")]
        if opts.backend == BackendKind::Mpi {
            // Under mpirun/srun the layout and the store come from MPI itself (see crate::mpi::init).
            return crate::mpi::init_world(opts, true);
        }
        let group_opts = |advertise_host: String, token: Option<RunToken>| -> Result<GroupOptions> {
            Ok(GroupOptions {
                backend: opts.backend,
                timeout: opts.timeout,
                token,
                local_rank: Some(opts.local_rank),
                local_world_size: Some(opts.local_world_size),
                advertise_host: Some(advertise_host),
                cpu_tuning: Some(CpuTuning::from_env()?),
            })
        };
        if opts.world_size == 1 {
            // No peers: nothing to rendezvous with, so no sockets (and no token) are needed.
            let store: Arc<dyn Store> = Arc::new(MemoryStore::new(opts.timeout));
            return Self::build_world(store, None, 0, 1, group_opts("127.0.0.1".into(), opts.token)?);
        }
        if opts.master_port == 0 {
            return Err(DdpError::Env {
                var: "MASTER_PORT".into(),
                reason: "0 (\"pick a free port\") only works when a launcher hosts the store and tells the \
                         workers the port it got; for a multi-process job started by hand set a real port"
                    .into(),
            });
        }
        let token = match opts.token {
            Some(t) => t,
            None => RunToken::from_env()?.ok_or_else(|| DdpError::Env {
                var: crate::RUN_TOKEN_ENV.into(),
                reason: "not set, but a multi-process group needs the job's run token; launch with `accel launch` / \
                         ddp_core::launch (they set it), or export the same 32-hex-digit value on every rank"
                    .into(),
            })?,
        };
        let mut server = None;
        let mut addr = host_port(&opts.master_addr, opts.master_port);
        if opts.host_store {
            let bind_host = opts.store_bind_addr.clone().unwrap_or_else(|| opts.master_addr.clone());
            let s = TcpStoreServer::bind(&host_port(&bind_host, opts.master_port), token)?;
            if opts.master_port == 0 {
                addr = host_port(&opts.master_addr, s.port());
            }
            tracing::info!(addr = %s.local_addr(), "rank {} hosts the store", opts.rank);
            server = Some(Arc::new(s));
        }
        // A request the store leaves unanswered for half the collective timeout counts as failed: a collective that
        // asks the store whether a peer aborted (a cut link) then ends within 1.5 × the timeout, not the store's
        // default grace (60 s) past it.
        let tcp = TcpStore::connect(&addr, token, opts.timeout)?
            .with_answer_grace((opts.timeout / 2).min(Duration::from_secs(60)));
        let advertise = match std::env::var(crate::cpu::ADVERTISE_HOST_ENV) {
            Ok(h) if !h.trim().is_empty() => h.trim().to_string(),
            _ => tcp.local_ip().to_string(),
        };
        let store: Arc<dyn Store> = Arc::new(tcp);
        Self::build_world(store, server, opts.rank, opts.world_size, group_opts(advertise, Some(token))?)
    }

    /// A group over an existing store: every rank of the group calls it with its own `rank`, the same
    /// `world_size` and a store shared by all of them — a [`MemoryStore`] for threads-as-ranks in one process
    /// (tests), a [`TcpStore`] across processes. Blocks until every rank has joined (or `opts.timeout`).
    ///
    /// Several groups may be built one after another on the same store (their keys are namespaced by an
    /// arrival counter). Without `opts.token`, rank 0 draws the mesh's run token and shares it through the
    /// store. Example, two threads as ranks:
    ///
    /// ```
    /// use ddp_core::{store::MemoryStore, process_group::GroupOptions, ProcessGroup, ReduceOp, Store};
    /// use std::sync::Arc;
    /// let store: Arc<dyn Store> = Arc::new(MemoryStore::default());
    /// let handles: Vec<_> = (0..2)
    ///     .map(|rank| {
    ///         let store = store.clone();
    ///         std::thread::spawn(move || {
    ///             let pg = ProcessGroup::from_store(store, rank, 2, GroupOptions::default()).unwrap();
    ///             let mut v = [rank as f32 + 1.0, 10.0];
    ///             pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
    ///             v
    ///         })
    ///     })
    ///     .collect();
    /// for h in handles {
    ///     assert_eq!(h.join().unwrap(), [3.0, 20.0]);
    /// }
    /// ```
    pub fn from_store(store: Arc<dyn Store>, rank: usize, world_size: usize, opts: GroupOptions) -> Result<Self> {
        Self::build_world(store, None, rank, world_size, opts)
    }

    pub(crate) fn build_world(
        store: Arc<dyn Store>,
        server: Option<Arc<TcpStoreServer>>,
        rank: usize,
        world_size: usize,
        opts: GroupOptions,
    ) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(DdpError::InvalidArgument(format!("rank {rank} is out of range for world size {world_size}")));
        }
        // Every rank of a world arrives before any rank of the next world on the same store can (forming a
        // group blocks until all its ranks are there), so arrival order numbers the worlds consistently.
        // A restarted worker group (launcher `max_restarts`) reuses the store: count its worlds afresh.
        let attempt = std::env::var(crate::env::RESTART_COUNT_ENV).ok().and_then(|v| v.trim().parse::<u64>().ok());
        let base = format!("ddp/attempt{}/", attempt.unwrap_or(0));
        let arrival = store.add(&format!("{base}world_arrivals"), 1)?;
        let generation = (arrival - 1).max(0) as usize / world_size;
        let namespace = format!("{base}world{generation}/");
        let spawn = SpawnInfo {
            kind: opts.backend,
            token: opts.token,
            advertise_host: opts.advertise_host.clone().unwrap_or_else(|| "127.0.0.1".into()),
            cpu_tuning: match opts.cpu_tuning {
                Some(t) => t,
                None => CpuTuning::from_env()?,
            },
        };
        let local_rank = opts.local_rank.unwrap_or(rank);
        let local_world_size = opts.local_world_size.unwrap_or(world_size);
        let ctx = BackendContext {
            store: store.clone(),
            key_prefix: format!("{namespace}backend/"),
            rank,
            world_size,
            local_rank,
            local_world_size,
            timeout: opts.timeout,
            token: spawn.token,
            advertise_host: spawn.advertise_host.clone(),
            group_tag: format!("world{generation}"),
            cpu_tuning: spawn.cpu_tuning,
        };
        let backend = build_backend(spawn.kind, &ctx)?;
        Ok(ProcessGroup {
            inner: Arc::new(GroupInner {
                backend,
                store,
                members: (0..world_size).collect(),
                global_rank: rank,
                local_rank,
                local_world_size,
                timeout: opts.timeout,
                _server: server,
                spawn,
                namespace,
                subgroups: AtomicU64::new(0),
                traffic: TrafficCounters::default(),
                piecewise_scratch: Mutex::new(Vec::new()),
            }),
        })
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
        self.inner.traffic.add(Op::AllReduce, std::mem::size_of_val(buf));
        self.globally_named(self.inner.backend.all_reduce(bytemuck::cast_slice_mut(buf), T::DTYPE, op))
    }

    /// In place: every rank's `buf` becomes `root`'s.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_rank(root, "broadcast root")?;
        self.inner.traffic.add(Op::Broadcast, std::mem::size_of_val(buf));
        self.globally_named(self.inner.backend.broadcast(bytemuck::cast_slice_mut(buf), root))
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
        self.inner.traffic.add(Op::AllGather, std::mem::size_of_val(input));
        self.globally_named(
            self.inner.backend.all_gather(bytemuck::cast_slice(input), bytemuck::cast_slice_mut(output)),
        )
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
        self.inner.traffic.add(Op::ReduceScatter, std::mem::size_of_val(input));
        self.globally_named(self.inner.backend.reduce_scatter(
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
            T::DTYPE,
            op,
        ))
    }

    /// Sends `buf` to group rank `dst`.
    pub fn send<T: Element>(&self, buf: &[T], dst: usize) -> Result<()> {
        self.check_peer(dst, "send destination")?;
        self.inner.traffic.add(Op::Send, std::mem::size_of_val(buf));
        self.globally_named(self.inner.backend.send(bytemuck::cast_slice(buf), dst))
    }

    /// Receives `buf.len()` elements from group rank `src`.
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize) -> Result<()> {
        self.check_peer(src, "recv source")?;
        self.inner.traffic.add(Op::Recv, std::mem::size_of_val(buf));
        self.globally_named(self.inner.backend.recv(bytemuck::cast_slice_mut(buf), src))
    }

    /// This group's collective calls and payload bytes so far, per operation (see [`crate::traffic`]). Sub-groups
    /// count their own traffic.
    pub fn traffic(&self) -> TrafficStats {
        self.inner.traffic.snapshot()
    }

    /// Returns when every rank of the group has reached the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.globally_named(self.inner.backend.barrier())
    }

    /// Raw byte all_reduce (used by tensor helpers and DDP buckets).
    pub fn all_reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        self.inner.traffic.add(Op::AllReduce, buf.len());
        self.globally_named(self.inner.backend.all_reduce(buf, dtype, op))
    }

    /// [`Self::all_reduce_bytes`] of a buffer held in pieces (read before, written after; see
    /// [`Backend::all_reduce_piecewise`]): what DDP uses for its buckets, so that on one machine the gradient
    /// tensors go straight into shared memory and the results straight into new tensors. Backends that need one
    /// contiguous buffer pack into a scratch buffer this group keeps (as large as the largest such call).
    /// Collective, like `all_reduce_bytes`, and the same call as far as the other ranks are concerned.
    pub fn all_reduce_piecewise(&self, buf: &mut dyn PiecewiseBuffer, dtype: DType, op: ReduceOp) -> Result<()> {
        self.inner.traffic.add(Op::AllReduce, buf.len());
        let mut scratch = crate::sync::lock(&self.inner.piecewise_scratch);
        self.globally_named(self.inner.backend.all_reduce_piecewise(buf, &mut scratch, dtype, op))
    }

    /// A sub-group's collective errors name its group ranks (the backend's numbering); when those are not the
    /// job's ranks, the error says which processes they are, so a message read next to other groups' names the
    /// process that failed (under a device mesh the dp group of ranks 2 and 3 calls them 0 and 1).
    fn globally_named<R>(&self, r: Result<R>) -> Result<R> {
        let members = &self.inner.members;
        if members.iter().enumerate().all(|(i, &g)| i == g) {
            return r;
        }
        r.map_err(|e| match e {
            DdpError::Collective { op, seq, rank, world_size, peer, reason } => {
                let list = |v: &mut dyn Iterator<Item = String>| v.collect::<Vec<_>>().join(", ");
                let reason = format!(
                    "{reason} (this group's ranks {} are the job's ranks {})",
                    list(&mut (0..members.len()).map(|i| i.to_string())),
                    list(&mut members.iter().map(|g| g.to_string()))
                );
                DdpError::Collective { op, seq, rank, world_size, peer, reason }
            }
            e => e,
        })
    }

    /// Creates a sub-group of the given *group* ranks (like `torch.distributed.new_group`). Every rank of this
    /// group must call it with the same list, in the same order of calls; members get `Some(group)`, the others
    /// `None`. Ranks must be distinct and in range.
    ///
    /// As in PyTorch the list is sorted: group rank i is the i-th smallest of `ranks`. The call is collective
    /// over this group (it all-gathers a fingerprint of the list, so ranks passing different lists get an
    /// [`DdpError::InvalidArgument`] naming the first disagreeing rank instead of a hang). The new group has
    /// its own store namespace ([`PrefixStore`]) and its own backend connections.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        if sorted.is_empty() {
            return Err(DdpError::InvalidArgument("new_group: the rank list is empty".into()));
        }
        for &r in &sorted {
            self.check_rank(r, "new_group: rank")?;
        }
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(DdpError::InvalidArgument(format!("new_group: rank {} is listed twice in {ranks:?}", w[0])));
        }
        let mut hash = crate::fingerprint::Fnv1a::default();
        sorted.iter().for_each(|&r| std::hash::Hasher::write_u64(&mut hash, r as u64));
        let fingerprint = std::hash::Hasher::finish(&hash) as i64;
        let mut all = vec![0i64; self.world_size()];
        self.all_gather(&[fingerprint], &mut all)?;
        if let Some(other) = all.iter().position(|&f| f != fingerprint) {
            return Err(DdpError::InvalidArgument(format!(
                "new_group: rank {other} passed a different rank list than rank {} ({ranks:?}); every rank must \
                 call new_group with the same list",
                self.rank()
            )));
        }
        self.make_subgroup(&sorted, "")
    }

    /// Splits the group by colour (like `MPI_Comm_split`): ranks with the same `color` form a group, ordered by
    /// `key` then by current rank; `None` colour opts out. Every rank must call it.
    ///
    /// Collective over this group (one all_gather of `(color, key)`); each rank gets its colour's group, or
    /// `None` for a `None` colour.
    pub fn split(&self, color: Option<u32>, key: usize) -> Result<Option<ProcessGroup>> {
        let mine = [color.map_or(-1, i64::from), key as i64];
        let mut all = vec![0i64; 2 * self.world_size()];
        self.all_gather(&mine, &mut all)?;
        let Some(c) = color else {
            // Keep the sub-group counter in step with the ranks that do join a group.
            self.inner.subgroups.fetch_add(1, Ordering::SeqCst);
            return Ok(None);
        };
        let mut members: Vec<(i64, usize)> =
            (0..self.world_size()).filter(|&r| all[2 * r] == i64::from(c)).map(|r| (all[2 * r + 1], r)).collect();
        members.sort_unstable();
        let ranks: Vec<usize> = members.into_iter().map(|(_, r)| r).collect();
        self.make_subgroup(&ranks, &format!("c{c}"))
    }

    /// Builds the sub-group of the given group ranks (in group-rank order); `None` for non-members. Every rank
    /// of this group calls it (the counter that names sub-groups must stay in step).
    fn make_subgroup(&self, ranks: &[usize], suffix: &str) -> Result<Option<ProcessGroup>> {
        let n = self.inner.subgroups.fetch_add(1, Ordering::SeqCst);
        let Some(my_rank) = ranks.iter().position(|&r| r == self.rank()) else {
            return Ok(None);
        };
        let name = format!("{}group{n}{suffix}", self.inner.namespace);
        let store: Arc<dyn Store> = Arc::new(PrefixStore::new(name.clone(), self.inner.store.clone()));
        let spawn = self.inner.spawn.clone();
        let ctx = BackendContext {
            store: store.clone(),
            key_prefix: "backend/".into(),
            rank: my_rank,
            world_size: ranks.len(),
            local_rank: self.local_rank(),
            local_world_size: self.local_world_size(),
            timeout: self.timeout(),
            token: spawn.token,
            advertise_host: spawn.advertise_host.clone(),
            group_tag: name,
            cpu_tuning: spawn.cpu_tuning,
        };
        let backend = build_backend(spawn.kind, &ctx)?;
        Ok(Some(ProcessGroup {
            inner: Arc::new(GroupInner {
                backend,
                store,
                members: ranks.iter().map(|&r| self.inner.members[r]).collect(),
                global_rank: self.inner.global_rank,
                local_rank: self.inner.local_rank,
                local_world_size: self.inner.local_world_size,
                timeout: self.inner.timeout,
                _server: self.inner._server.clone(),
                spawn,
                namespace: String::new(),
                subgroups: AtomicU64::new(0),
                traffic: TrafficCounters::default(),
                piecewise_scratch: Mutex::new(Vec::new()),
            }),
        }))
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

/// Options of [`ProcessGroup::from_store`]. `Default`: CPU backend, 30 min timeout, token shared through the
/// store, local rank = rank, listening on 127.0.0.1 (or ACCEL_CPU_HOST), tuning from the environment.
#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// Backend to build.
    pub backend: BackendKind,
    /// Collective timeout.
    pub timeout: Duration,
    /// Run token of the backend's peer connections; `None`: rank 0 draws one and shares it through the store.
    pub token: Option<RunToken>,
    /// LOCAL_RANK (default: the rank).
    pub local_rank: Option<usize>,
    /// LOCAL_WORLD_SIZE (default: the world size).
    pub local_world_size: Option<usize>,
    /// Address the CPU backend listens on and advertises (default: ACCEL_CPU_HOST, else 127.0.0.1).
    pub advertise_host: Option<String>,
    /// CPU backend knobs (default: [`CpuTuning::from_env`]).
    pub cpu_tuning: Option<CpuTuning>,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            backend: BackendKind::Cpu,
            timeout: DEFAULT_COLLECTIVE_TIMEOUT,
            token: None,
            local_rank: None,
            local_world_size: None,
            advertise_host: std::env::var(crate::cpu::ADVERTISE_HOST_ENV).ok().filter(|h| !h.trim().is_empty()),
            cpu_tuning: None,
        }
    }
}

/// Everything a backend constructor gets: the group's store (keys of this backend go under `key_prefix`),
/// its layout, timeout, token and transport hints.
pub(crate) struct BackendContext {
    pub(crate) store: Arc<dyn Store>,
    /// Prefix for this backend's own keys in `store`, ending in `/`.
    pub(crate) key_prefix: String,
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    #[allow(dead_code)] // read by device backends (NCCL picks the GPU from it)
    pub(crate) local_rank: usize,
    #[allow(dead_code)]
    pub(crate) local_world_size: usize,
    pub(crate) timeout: Duration,
    pub(crate) token: Option<RunToken>,
    pub(crate) advertise_host: String,
    /// Unique name of the group (checked in the CPU backend's handshake).
    pub(crate) group_tag: String,
    pub(crate) cpu_tuning: CpuTuning,
}

/// The backend registry: builds the backend of `kind` for one group (world or sub-group).
///
/// Hook for feature backends: add a `#[cfg(feature = "nccl")]` / `#[cfg(feature = "mpi")]` arm before the
/// fallback arms below (and make `Auto` try NCCL first when it is compiled in and a GPU + libnccl are present).
pub(crate) fn build_backend(kind: BackendKind, ctx: &BackendContext) -> Result<Box<dyn Backend>> {
    match kind {
        BackendKind::Cpu => {
            let opts = CpuOptions {
                timeout: ctx.timeout,
                token: ctx.token,
                advertise_host: ctx.advertise_host.clone(),
                key_prefix: ctx.key_prefix.clone(),
                group_tag: ctx.group_tag.clone(),
                tuning: ctx.cpu_tuning,
            };
            Ok(Box::new(CpuBackend::connect(ctx.store.clone(), ctx.rank, ctx.world_size, &opts)?))
        }
        BackendKind::Auto => {
            #[cfg(feature = "nccl")]
            match crate::nccl::probe() {
                Ok(found) if ctx.local_rank < found.device_count => return build_backend(BackendKind::Nccl, ctx),
                Ok(found) => tracing::info!(
                    "backend auto: using the CPU backend: local rank {} but only {} GPU(s) visible",
                    ctx.local_rank,
                    found.device_count
                ),
                Err(e) => tracing::info!("backend auto: using the CPU backend because NCCL is unavailable: {e}"),
            }
            #[cfg(not(feature = "nccl"))]
            if ctx.rank == 0 {
                tracing::info!("backend auto: using the CPU backend (ddp-core was built without the `nccl` feature)");
            }
            build_backend(BackendKind::Cpu, ctx)
        }
        #[cfg(feature = "nccl")]
        BackendKind::Nccl => {
            let store: Arc<dyn Store> = Arc::new(PrefixStore::new(ctx.key_prefix.clone(), ctx.store.clone()));
            Ok(Box::new(crate::nccl::NcclBackend::new(store, ctx.rank, ctx.world_size, ctx.local_rank, ctx.timeout)?))
        }
        #[cfg(feature = "mpi")]
        BackendKind::Mpi => {
            let store = PrefixStore::new(ctx.key_prefix.clone(), ctx.store.clone());
            Ok(Box::new(crate::mpi::MpiBackend::for_group(&store, ctx.rank, ctx.world_size, ctx.timeout)?))
        }
        #[cfg(not(feature = "nccl"))]
        BackendKind::Nccl => Err(DdpError::BackendUnavailable {
            backend: "nccl",
            reason: "ddp-core was built without the `nccl` feature; rebuild with `--features nccl` (libnccl is \
                     loaded at run time), or use the cpu backend"
                .into(),
        }),
        #[cfg(not(feature = "mpi"))]
        BackendKind::Mpi => Err(DdpError::BackendUnavailable {
            backend: "mpi",
            reason: "ddp-core was built without the `mpi` feature; rebuild with `--features mpi` and run under \
                     mpirun/srun, or use the cpu backend"
                .into(),
        }),
    }
}

/// `host:port`, bracketing IPv6 literals.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}
