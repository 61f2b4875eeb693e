//! The CPU backend: pure Rust, TCP between processes (loopback or across machines).
//!
//! - `mesh`: one TCP connection per pair of ranks, found through the store, run token checked on connect.
//! - `frame`: the 40-byte frame header every piece of data carries (op, sequence number, size, dtype, …).
//! - `transport`: the single-threaded non-blocking progress engine all algorithms run on.
//! - `ring`: bandwidth-optimal segmented ring (all_reduce, reduce_scatter, all_gather).
//! - `small`: latency-optimal direct exchange for small all_reduce.
//! - `broadcast`, `barrier`, `p2p`: the other operations (`p2p`: send/recv over TCP).
//! - `shm`: when every rank is on this machine, a shared segment: the slot exchange (small all_reduce,
//!   broadcast, all_gather, reduce_scatter, barrier), the pipelined all_reduce of large buffers and the
//!   per-pair rings of `shm_p2p` (send/recv).
//! - `fault`: abort propagation so a dead or mismatching rank fails the collective on every rank, fast.
//!
//! When all ranks share a machine (the shared segment could be set up by every rank), everything runs over it:
//! send/recv through a ring per ordered pair (a sender runs ahead of its receiver by up to 8 × 64 KiB, then
//! streams in chunks; `shm_p2p`), all_reduce up to `small_all_reduce_bytes` (64 KiB, and at most `shm_slot_bytes`)
//! through the slot exchange — every rank writes its input into its slot and reduces all slots itself in rank
//! order, microseconds instead of a TCP round trip; broadcast, all_gather, reduce_scatter and barrier through
//! the slot exchange in rounds of at most `shm_slot_bytes` per rank; larger all_reduce (above `shm_min_bytes`,
//! 64 KiB) through the pipelined shared-memory all_reduce, after one empty exchange round that checks every
//! rank's call identity (the segmented TCP ring only between `small_all_reduce_bytes` and `shm_min_bytes` when
//! those are tuned apart). Without shared memory everything uses TCP: all_reduce
//! up to `small_all_reduce_bytes` as a direct exchange, then the ring, and send/recv as frames on the pair's
//! connection. On both paths a message must be received between the same two collectives it was sent between
//! (`p2p`). See `docs/benchmarks.md`.

mod barrier;
mod broadcast;
mod fault;
mod frame;
mod mesh;
mod p2p;
mod ring;
mod shm;
mod shm_p2p;
mod small;
mod transport;

pub use mesh::ADVERTISE_HOST_ENV;

use crate::backend::{Backend, PiecewiseBuffer};
use crate::store::Store;
use crate::sync;
use crate::token::RunToken;
use crate::{DType, DdpError, ReduceOp, Result};
use fault::AbortRecord;
use frame::{CallId, Op};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use transport::{Buffers, Failure, Plan, Watch};

/// Performance knobs of the CPU backend. Every rank of a group must use the same values (they decide how
/// buffers are cut into frames; a difference is reported as a mismatch, never silently mis-reduced).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTuning {
    /// Largest frame of a ring / broadcast / p2p transfer, bytes (default 1 MiB, as Gloo's ring).
    pub segment_bytes: usize,
    /// all_reduce of at most this many bytes takes the direct-exchange path instead of the ring (default 64 KiB).
    pub small_all_reduce_bytes: usize,
    /// Broadcasts of at least this many bytes with more than two ranks use a pipelined chain (default 256 KiB).
    pub chain_broadcast_bytes: usize,
    /// SO_SNDBUF / SO_RCVBUF of peer sockets in bytes; `None` keeps Linux's autotuning (default 4 MiB).
    pub socket_buffer_bytes: Option<usize>,
    /// Use a shared-memory segment for all_reduce of more than `shm_min_bytes` when every rank of the group is
    /// on this machine (default true; falls back to TCP silently when unavailable).
    pub shared_memory: bool,
    /// all_reduce of more than this many bytes uses the pipelined shared-memory all_reduce when available
    /// (default 64 KiB, where the slot exchange ends: at 128–512 KiB it is 3–5× faster than the TCP ring on an
    /// idle 2-core machine and no slower on a loaded one; docs/benchmarks.md, "What the backend
    /// does").
    pub shm_min_bytes: usize,
    /// Pipeline block of the shared-memory all_reduce, bytes (default 1 MiB).
    pub shm_block_bytes: usize,
    /// Blocks in flight per rank in the shared-memory all_reduce (default 4; ≥ 2). The segment holds
    /// depth·(P+1) blocks.
    pub shm_depth: usize,
    /// Payload of one rank's slot in the shared-memory slot exchange, bytes (default 256 KiB; rounded up to a
    /// multiple of 64 and to at least 8 bytes per rank). Broadcast / all_gather / reduce_scatter move at most this
    /// much per rank per round; all_reduce takes the slot path only up to it. The segment holds 2·P slots.
    pub shm_slot_bytes: usize,
    /// Point-to-point over shared memory: payload bytes of one chunk of an ordered pair's ring (default 64 KiB;
    /// rounded up to a multiple of 64). A message takes ⌈size / chunk⌉ chunks (at least one).
    pub shm_p2p_chunk_bytes: usize,
    /// Chunks in each ordered pair's ring (default 8, i.e. 512 KiB per direction and pair): a sender runs ahead of
    /// its receiver by at most this many chunks. 0 keeps send/recv on TCP even when collectives use shared
    /// memory. The segment holds P·(P−1) rings.
    pub shm_p2p_chunks: usize,
}

impl Default for CpuTuning {
    fn default() -> Self {
        CpuTuning {
            segment_bytes: 1 << 20,
            small_all_reduce_bytes: 64 << 10,
            chain_broadcast_bytes: 256 << 10,
            socket_buffer_bytes: Some(4 << 20),
            shared_memory: true,
            shm_min_bytes: 64 << 10,
            shm_block_bytes: 1 << 20,
            shm_depth: 4,
            shm_slot_bytes: 256 << 10,
            shm_p2p_chunk_bytes: 64 << 10,
            shm_p2p_chunks: 8,
        }
    }
}

impl CpuTuning {
    /// Defaults overridden by `ACCEL_CPU_SEGMENT_BYTES`, `ACCEL_CPU_SMALL_BYTES`, `ACCEL_CPU_CHAIN_BYTES` and
    /// `ACCEL_CPU_SOCKET_BUFFER_BYTES` (0 = kernel autotuning), `ACCEL_CPU_SHM` (0 = TCP only),
    /// `ACCEL_CPU_SHM_MIN_BYTES`, `ACCEL_CPU_SHM_BLOCK_BYTES`, `ACCEL_CPU_SHM_DEPTH`, `ACCEL_CPU_SHM_SLOT_BYTES`,
    /// `ACCEL_CPU_SHM_P2P_CHUNK_BYTES` and `ACCEL_CPU_SHM_P2P_CHUNKS` (0 = send/recv over TCP). Malformed values
    /// are errors naming the variable.
    pub fn from_env() -> Result<Self> {
        let mut t = CpuTuning::default();
        let get = |name: &str| -> Result<Option<usize>> {
            match std::env::var(name) {
                Ok(v) => crate::env::parse_var::<usize>(name, &v).map(Some),
                Err(_) => Ok(None),
            }
        };
        if let Some(v) = get("ACCEL_CPU_SEGMENT_BYTES")? {
            t.segment_bytes = v.max(64);
        }
        if let Some(v) = get("ACCEL_CPU_SMALL_BYTES")? {
            t.small_all_reduce_bytes = v;
        }
        if let Some(v) = get("ACCEL_CPU_CHAIN_BYTES")? {
            t.chain_broadcast_bytes = v;
        }
        if let Some(v) = get("ACCEL_CPU_SOCKET_BUFFER_BYTES")? {
            t.socket_buffer_bytes = (v > 0).then_some(v);
        }
        if let Some(v) = get("ACCEL_CPU_SHM")? {
            t.shared_memory = v != 0;
        }
        if let Some(v) = get("ACCEL_CPU_SHM_MIN_BYTES")? {
            t.shm_min_bytes = v;
        }
        if let Some(v) = get("ACCEL_CPU_SHM_SLOT_BYTES")? {
            t.shm_slot_bytes = v;
        }
        if let Some(v) = get("ACCEL_CPU_SHM_P2P_CHUNK_BYTES")? {
            t.shm_p2p_chunk_bytes = v;
        }
        if let Some(v) = get("ACCEL_CPU_SHM_P2P_CHUNKS")? {
            t.shm_p2p_chunks = v;
        }
        if let Some(v) = get("ACCEL_CPU_SHM_DEPTH")? {
            t.shm_depth = v.max(2);
        }
        if let Some(v) = get("ACCEL_CPU_SHM_BLOCK_BYTES")? {
            shm::check_block(v)?;
            t.shm_block_bytes = v;
        }
        Ok(t)
    }
}

/// How to build a [`CpuBackend`].
#[derive(Debug, Clone)]
pub struct CpuOptions {
    /// Timeout of every collective (default 30 min). A dead peer is detected much sooner: see the module docs.
    pub timeout: Duration,
    /// Run token presented to and required from peers. `None`: rank 0 draws one and shares it through the store
    /// (fine when the store itself is trusted: in-process, or a token-checking TCP store).
    pub token: Option<RunToken>,
    /// Address this rank listens on and advertises to peers (default `127.0.0.1`).
    pub advertise_host: String,
    /// Prefix of this group's backend keys in the store (default `ddp/cpu/`; must end with `/`).
    pub key_prefix: String,
    /// Name of the group, checked in the handshake (default `world`).
    pub group_tag: String,
    /// Performance knobs.
    pub tuning: CpuTuning,
}

impl Default for CpuOptions {
    fn default() -> Self {
        CpuOptions {
            timeout: crate::DEFAULT_COLLECTIVE_TIMEOUT,
            token: None,
            advertise_host: "127.0.0.1".into(),
            key_prefix: "ddp/cpu/".into(),
            group_tag: "world".into(),
            tuning: CpuTuning::default(),
        }
    }
}

/// The pure-Rust CPU backend over TCP. See the module docs for the algorithms.
///
/// Collectives of one backend are serialised by an internal lock; every rank must issue them in the same
/// order. On error the group is aborted (see `fault`): the call and every later one fail with a
/// [`DdpError::Collective`] naming the op, its sequence number and the rank held responsible; buffer contents
/// are then unspecified.
pub struct CpuBackend {
    rank: usize,
    world_size: usize,
    peers: Vec<Option<TcpStream>>,
    store: Arc<dyn Store>,
    abort_key: String,
    timeout: Duration,
    tuning: CpuTuning,
    /// Shared-memory all_reduce channel when all ranks are on this machine.
    shm: Option<shm::ShmChannel>,
    /// Set after the store failed once in a fault path (e.g. its host died): later fault handling must not
    /// spend the store client's reconnect time.
    store_broken: AtomicBool,
    state: Mutex<State>,
}

struct State {
    /// Sequence number of the last collective (1-based; the same on every rank).
    seq: u64,
    /// Per-peer counters of point-to-point messages, per direction.
    sent: Vec<u64>,
    received: Vec<u64>,
    /// 8-byte aligned scratch space, reused between calls.
    scratch: Vec<u64>,
    /// A copy of reduce_scatter's input (the ring reduces in place).
    work: Vec<u64>,
    tx_mid_frame: Vec<bool>,
    aborted: Option<AbortRecord>,
    /// Last shared-memory epoch used (epochs count blocks; the same on every rank).
    shm_epoch: u64,
    /// Last round of the shared-memory slot exchange (the same on every rank).
    shm_round: u64,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend").field("rank", &self.rank).field("world_size", &self.world_size).finish()
    }
}

fn grow(v: &mut Vec<u64>, bytes: usize) -> &mut [u8] {
    let words = bytes.div_ceil(8);
    if v.len() < words {
        v.resize(words, 0);
    }
    &mut bytemuck::cast_slice_mut(v.as_mut_slice())[..bytes]
}

impl CpuBackend {
    /// Joins the group: connects the full mesh through `store` (every rank of the group calls this with the
    /// same `world_size`, the same options and distinct ranks). Blocks until all peers are connected or
    /// `opts.timeout` passes.
    ///
    /// Errors: [`DdpError::TokenRejected`] when a peer refuses our run token, [`DdpError::Bind`] when the
    /// advertised host is not a local address, store errors/timeouts when peers never show up.
    pub fn connect(store: Arc<dyn Store>, rank: usize, world_size: usize, opts: &CpuOptions) -> Result<CpuBackend> {
        if world_size == 0 || rank >= world_size {
            return Err(DdpError::InvalidArgument(format!("rank {rank} is out of range for world size {world_size}")));
        }
        let token = match opts.token {
            Some(t) => t,
            None if world_size == 1 => RunToken::generate()?,
            None => shared_token(store.as_ref(), &opts.key_prefix, rank)?,
        };
        let peers = mesh::connect_mesh(&mesh::MeshSpec {
            store: store.as_ref(),
            prefix: &opts.key_prefix,
            rank,
            world_size,
            token,
            group_tag: &opts.group_tag,
            advertise_host: &opts.advertise_host,
            timeout: opts.timeout,
            tuning: mesh::SocketTuning { buffer_bytes: opts.tuning.socket_buffer_bytes },
        })?;
        let shm = if world_size > 1 {
            shm::check_block(opts.tuning.shm_block_bytes)?;
            shm::ShmChannel::establish(store.as_ref(), &opts.key_prefix, rank, world_size, &opts.tuning)?
        } else {
            None
        };
        tracing::debug!(rank, world_size, group = %opts.group_tag, shm = shm.is_some(), "cpu backend connected");
        Ok(CpuBackend {
            rank,
            world_size,
            peers,
            store,
            abort_key: format!("{}abort", opts.key_prefix),
            timeout: opts.timeout,
            tuning: opts.tuning,
            shm,
            store_broken: AtomicBool::new(false),
            state: Mutex::new(State {
                seq: 0,
                sent: vec![0; world_size],
                received: vec![0; world_size],
                scratch: Vec::new(),
                work: Vec::new(),
                tx_mid_frame: vec![false; world_size],
                aborted: None,
                shm_epoch: 0,
                shm_round: 0,
            }),
        })
    }

    /// The performance knobs in use.
    pub fn tuning(&self) -> CpuTuning {
        self.tuning
    }

    /// Whether collectives go through shared memory (all ranks on this machine, see the module docs). Hidden:
    /// an internal of the backend, read by its tests and the bandwidth benchmark only.
    #[doc(hidden)]
    pub fn uses_shared_memory(&self) -> bool {
        self.shm.is_some()
    }

    /// Chunks this rank has sent to `peer` and received from it through the shared-memory rings so far, or
    /// `None` when send/recv with this group go over TCP (no shared segment, or `shm_p2p_chunks = 0`). For tests
    /// and diagnostics: a message of n bytes moves `max(1, ⌈n / shm_p2p_chunk_bytes⌉)` chunks. Hidden: an
    /// internal of the backend, read by its tests and the bandwidth benchmark only.
    #[doc(hidden)]
    pub fn shm_p2p_chunks(&self, peer: usize) -> Option<(u64, u64)> {
        let rings = self.shm.as_ref()?.pair_rings()?;
        (peer < self.world_size && peer != self.rank).then(|| rings.chunks_moved(peer))
    }

    /// Starts a collective: next sequence number, fails at once on an aborted group.
    fn begin(
        &self,
        st: &mut State,
        op: Op,
        size: usize,
        dtype: Option<DType>,
        redop: Option<ReduceOp>,
        param: u64,
    ) -> Result<CallId> {
        st.seq += 1;
        let call = CallId { op, seq: st.seq, size: size as u64, dtype, redop, param };
        if let Some(rec) = &st.aborted {
            return Err(self.error(&call, rec, true));
        }
        Ok(call)
    }

    fn error(&self, call: &CallId, rec: &AbortRecord, earlier: bool) -> DdpError {
        let mut reason = rec.describe(self.rank);
        if earlier {
            reason = format!("the group was aborted by an earlier failure: {reason}");
        }
        DdpError::Collective {
            op: call.op.name(),
            seq: call.seq,
            rank: self.rank,
            world_size: self.world_size,
            peer: rec.blamed,
            reason,
        }
    }

    /// Runs one plan; on failure aborts the group and returns the error.
    fn exec(&self, st: &mut State, plan: &Plan, work: &mut [u8], input: &[u8], scratch_bytes: usize) -> Result<()> {
        let started = Instant::now();
        let check_abort = || self.remote_abort();
        let watch = Watch { started, deadline: started + self.timeout, check_abort: &check_abort };
        let State { scratch, tx_mid_frame, .. } = st;
        let mut bufs = Buffers { work, input, scratch: grow(scratch, scratch_bytes) };
        match transport::execute(plan, &mut bufs, &self.peers, tx_mid_frame, &watch) {
            Ok(()) => Ok(()),
            Err(failure) => Err(self.abort(st, &plan.call, failure)),
        }
    }

    /// Runs a store call unless the store already failed in a fault path; a failure marks it broken.
    fn store_call<T>(&self, f: impl FnOnce(&dyn Store) -> Result<T>) -> Option<T> {
        if self.store_broken.load(Ordering::Relaxed) {
            return None;
        }
        match f(self.store.as_ref()) {
            Ok(v) => Some(v),
            Err(e) => {
                self.store_broken.store(true, Ordering::Relaxed);
                tracing::warn!(rank = self.rank, "cpu backend: store unreachable during fault handling: {e}");
                None
            }
        }
    }

    /// The group's abort record as a failure, if another rank aborted (checked on idle ticks).
    fn remote_abort(&self) -> Option<Failure> {
        let rec = self.store_call(|s| fault::read(s, &self.abort_key)).flatten()?;
        Some(Failure::RemoteAbort { from: Some(rec.by), blamed: rec.blamed, reason: rec.reason })
    }

    fn abort(&self, st: &mut State, call: &CallId, failure: Failure) -> DdpError {
        let lookup = || self.store_call(|s| fault::read(s, &self.abort_key)).flatten();
        let rec = fault::record_for(&failure, self.rank, call, &lookup);
        let rec = self.store_call(|s| fault::publish(s, &self.abort_key, rec.clone())).unwrap_or(rec);
        fault::abort_links(&self.peers, &st.tx_mid_frame, call, &rec);
        if let Some(shm) = &self.shm {
            shm.signal_abort(rec.blamed);
        }
        // Debug, not error: the error returned to the caller carries the same record, and is what gets printed.
        tracing::debug!(rank = self.rank, "cpu backend aborted: {}", rec.describe(self.rank));
        let err = self.error(call, &rec, false);
        st.aborted = Some(rec);
        err
    }
}

/// Rank 0 draws the group's token and shares it through the (trusted) store; the others read it.
fn shared_token(store: &dyn Store, prefix: &str, rank: usize) -> Result<RunToken> {
    let key = format!("{prefix}token");
    if rank == 0 {
        let t = RunToken::generate()?;
        store.set(&key, t.to_hex().as_bytes())?;
        Ok(t)
    } else {
        let raw = store.get(&key)?;
        RunToken::from_hex(&String::from_utf8_lossy(&raw))
    }
}

fn check_len(op: &str, len: usize, dtype: DType) -> Result<()> {
    if !len.is_multiple_of(dtype.size_in_bytes()) {
        return Err(DdpError::InvalidArgument(format!(
            "{op}: {len} bytes is not a whole number of {dtype:?} elements ({} bytes each)",
            dtype.size_in_bytes()
        )));
    }
    Ok(())
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        check_len("all_reduce", buf.len(), dtype)?;
        let mut st = sync::lock(&self.state);
        let call = self.begin(&mut st, Op::AllReduce, buf.len(), Some(dtype), Some(op), 0)?;
        let (p, r, n) = (self.world_size, self.rank, buf.len());
        if p == 1 {
            return Ok(()); // Avg over one rank divides by 1: the identity.
        }
        let started = Instant::now();
        if let Some(shm) = &self.shm {
            if n <= self.tuning.small_all_reduce_bytes && n <= shm.slot_cap() {
                let round = self.shm_exchange(&mut st, shm, call, 0, started, |slot| slot[..n].copy_from_slice(buf))?;
                // Every rank reduces all slots in rank order: the same bits everywhere.
                buf.copy_from_slice(&shm.peer_slot(0, round)[..n]);
                for q in 1..p {
                    crate::dtype::reduce_into(dtype, op, buf, &shm.peer_slot(q, round)[..n]);
                }
                if op == ReduceOp::Avg {
                    crate::dtype::divide_in_place(dtype, buf, p);
                }
                return Ok(());
            }
            // Check every rank's call before taking a path on which a mismatch could strand ranks.
            self.shm_exchange(&mut st, shm, call, 0, started, |_| {})?;
        }
        if n <= self.tuning.small_all_reduce_bytes {
            let plan = small::plan(r, p, n, call);
            let scratch = small::scratch_bytes(p, n);
            self.exec(&mut st, &plan, buf, &[], scratch)?;
            small::combine(r, p, buf, &mut grow(&mut st.scratch, scratch)[..], dtype, op);
            return Ok(());
        }
        if let Some(shm) = self.pipelined_shm(n) {
            return self.shm_all_reduce(&mut st, shm, call, &mut &mut *buf, dtype, op);
        }
        let chunks = ring::split_even(0, n, dtype.size_in_bytes(), p);
        let ring = ring::Ring {
            rank: r,
            world_size: p,
            chunks: &chunks,
            elem: dtype.size_in_bytes(),
            reduce_steps: p - 1,
            gather_steps: p - 1,
            start: r,
            seg: self.segmenting(),
            divide_last_reduce_by: (op == ReduceOp::Avg).then_some(p),
            reduce: Some((dtype, op)),
        };
        let plan = ring.plan(call);
        self.exec(&mut st, &plan, buf, &[], ring.max_segment_bytes())
    }

    fn all_reduce_piecewise(
        &self,
        buf: &mut dyn PiecewiseBuffer,
        scratch: &mut Vec<u64>,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let n = buf.len();
        // Only the pipelined shared-memory all_reduce reads and writes pieces; every other path (and one rank)
        // runs `all_reduce` on the packed buffer, with the same call identity.
        let Some(shm) = self.pipelined_shm(n).filter(|_| self.world_size > 1) else {
            return crate::backend::all_reduce_via_scratch(self, buf, scratch, dtype, op);
        };
        check_len("all_reduce", n, dtype)?;
        let mut st = sync::lock(&self.state);
        let call = self.begin(&mut st, Op::AllReduce, n, Some(dtype), Some(op), 0)?;
        // As in `all_reduce`: check every rank's call before entering the pipelined path.
        self.shm_exchange(&mut st, shm, call, 0, Instant::now(), |_| {})?;
        self.shm_all_reduce(&mut st, shm, call, buf, dtype, op)
    }

    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()> {
        let mut st = sync::lock(&self.state);
        let call = self.begin(&mut st, Op::Broadcast, buf.len(), None, None, root as u64)?;
        if root >= self.world_size {
            return Err(DdpError::InvalidArgument(format!(
                "broadcast root {root} is out of range for a group of {} ranks",
                self.world_size
            )));
        }
        if self.world_size == 1 {
            return Ok(());
        }
        if let Some(shm) = &self.shm {
            let (cap, n, started) = (shm.slot_cap(), buf.len(), Instant::now());
            for i in 0..n.div_ceil(cap).max(1) {
                let range = i * cap..((i + 1) * cap).min(n);
                let len = range.len();
                let mine = self.rank == root;
                let round = self.shm_exchange(&mut st, shm, call, i as u32, started, |slot| {
                    if mine {
                        slot[..len].copy_from_slice(&buf[range.clone()]);
                    }
                })?;
                if !mine {
                    buf[range].copy_from_slice(&shm.peer_slot(root, round)[..len]);
                }
            }
            return Ok(());
        }
        let chain = buf.len() >= self.tuning.chain_broadcast_bytes;
        let plan = broadcast::plan(self.rank, self.world_size, root, buf.len(), self.tuning.segment_bytes, chain, call);
        self.exec(&mut st, &plan, buf, &[], 0)
    }

    fn all_gather(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        let (p, r, n) = (self.world_size, self.rank, input.len());
        if output.len() != n * p {
            return Err(DdpError::InvalidArgument(format!(
                "all_gather: output has {} bytes, expected world_size ({p}) × input ({n}) = {}",
                output.len(),
                n * p
            )));
        }
        let mut st = sync::lock(&self.state);
        let call = self.begin(&mut st, Op::AllGather, n, None, None, 0)?;
        output[r * n..(r + 1) * n].copy_from_slice(input);
        if p == 1 {
            return Ok(());
        }
        if let Some(shm) = &self.shm {
            let (cap, started) = (shm.slot_cap(), Instant::now());
            for i in 0..n.div_ceil(cap).max(1) {
                let range = i * cap..((i + 1) * cap).min(n);
                let len = range.len();
                let round = self.shm_exchange(&mut st, shm, call, i as u32, started, |slot| {
                    slot[..len].copy_from_slice(&input[range.clone()])
                })?;
                for q in (0..p).filter(|&q| q != r) {
                    output[q * n + range.start..q * n + range.end].copy_from_slice(&shm.peer_slot(q, round)[..len]);
                }
            }
            return Ok(());
        }
        let chunks: Vec<_> = (0..p).map(|i| i * n..(i + 1) * n).collect();
        let ring = ring::Ring {
            rank: r,
            world_size: p,
            chunks: &chunks,
            elem: 1,
            reduce_steps: 0,
            gather_steps: p - 1,
            start: r,
            seg: self.segmenting(),
            divide_last_reduce_by: None,
            reduce: None,
        };
        let plan = ring.plan(call);
        self.exec(&mut st, &plan, output, &[], 0)
    }

    fn reduce_scatter(&self, input: &[u8], output: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let (p, r, n) = (self.world_size, self.rank, output.len());
        check_len("reduce_scatter", n, dtype)?;
        if input.len() != n * p {
            return Err(DdpError::InvalidArgument(format!(
                "reduce_scatter: input has {} bytes, expected world_size ({p}) × output ({n}) = {}",
                input.len(),
                n * p
            )));
        }
        let mut st = sync::lock(&self.state);
        let call = self.begin(&mut st, Op::ReduceScatter, n, Some(dtype), Some(op), 0)?;
        if p == 1 {
            output.copy_from_slice(input);
            return Ok(());
        }
        if let Some(shm) = &self.shm {
            // Per round every rank puts one piece of `chunk` bytes per destination rank into its slot.
            let es = dtype.size_in_bytes();
            let chunk = shm.slot_cap() / (p * es) * es;
            let started = Instant::now();
            for i in 0..n.div_ceil(chunk).max(1) {
                let (a, b) = (i * chunk, ((i + 1) * chunk).min(n));
                let round = self.shm_exchange(&mut st, shm, call, i as u32, started, |slot| {
                    for q in 0..p {
                        slot[q * chunk..q * chunk + b - a].copy_from_slice(&input[q * n + a..q * n + b]);
                    }
                })?;
                // My piece from every rank, reduced in rank order (as the reference and the TCP ring's result).
                let piece = r * chunk..r * chunk + b - a;
                output[a..b].copy_from_slice(&shm.peer_slot(0, round)[piece.clone()]);
                for q in 1..p {
                    crate::dtype::reduce_into(dtype, op, &mut output[a..b], &shm.peer_slot(q, round)[piece.clone()]);
                }
                if op == ReduceOp::Avg {
                    crate::dtype::divide_in_place(dtype, &mut output[a..b], p);
                }
            }
            return Ok(());
        }
        let chunks: Vec<_> = (0..p).map(|i| i * n..(i + 1) * n).collect();
        let ring = ring::Ring {
            rank: r,
            world_size: p,
            chunks: &chunks,
            elem: dtype.size_in_bytes(),
            reduce_steps: p - 1,
            gather_steps: 0,
            // Rank r must end holding block r: the last reduce step receives chunk (start − P + 1) = start + 1.
            start: (r + p - 1) % p,
            seg: self.segmenting(),
            divide_last_reduce_by: (op == ReduceOp::Avg).then_some(p),
            reduce: Some((dtype, op)),
        };
        let plan = ring.plan(call);
        let mut work = std::mem::take(&mut st.work);
        let result = {
            let w = grow(&mut work, input.len());
            w.copy_from_slice(input);
            let res = self.exec(&mut st, &plan, w, &[], ring.max_segment_bytes());
            if res.is_ok() {
                output.copy_from_slice(&w[r * n..(r + 1) * n]);
            }
            res
        };
        st.work = work;
        result
    }

    fn send(&self, buf: &[u8], dst: usize) -> Result<()> {
        self.check_peer(dst, "send destination")?;
        let mut st = sync::lock(&self.state);
        st.sent[dst] += 1;
        let call = p2p::call(st.sent[dst], buf.len(), st.seq);
        if let Some(rec) = &st.aborted {
            return Err(self.error(&call, rec, true));
        }
        if let Some(shm) = &self.shm {
            if let Some(rings) = shm.pair_rings() {
                let rounds_done = st.shm_round;
                return self.shm_p2p(&mut st, &call, |ctx| rings.send(dst, buf, call, rounds_done, ctx));
            }
        }
        self.check_shm_abort(&mut st, &call)?;
        let plan = p2p::send_plan(dst, buf.len(), self.tuning.segment_bytes, call);
        self.exec(&mut st, &plan, &mut [], buf, 0)
    }

    fn recv(&self, buf: &mut [u8], src: usize) -> Result<()> {
        self.check_peer(src, "recv source")?;
        let mut st = sync::lock(&self.state);
        st.received[src] += 1;
        let call = p2p::call(st.received[src], buf.len(), st.seq);
        if let Some(rec) = &st.aborted {
            return Err(self.error(&call, rec, true));
        }
        if let Some(shm) = &self.shm {
            if let Some(rings) = shm.pair_rings() {
                let rounds_done = st.shm_round;
                return self.shm_p2p(&mut st, &call, |ctx| rings.recv(src, buf, call, rounds_done, ctx));
            }
        }
        self.check_shm_abort(&mut st, &call)?;
        let plan = p2p::recv_plan(src, buf.len(), self.tuning.segment_bytes, call);
        self.exec(&mut st, &plan, buf, &[], 0)
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn barrier(&self) -> Result<()> {
        let mut st = sync::lock(&self.state);
        let call = self.begin(&mut st, Op::Barrier, 0, None, None, 0)?;
        if self.world_size == 1 {
            return Ok(());
        }
        if let Some(shm) = &self.shm {
            self.shm_exchange(&mut st, shm, call, 0, Instant::now(), |_| {})?;
            return Ok(());
        }
        let plan = barrier::plan(self.rank, self.world_size, call);
        self.exec(&mut st, &plan, &mut [], &[], 0)
    }
}

impl CpuBackend {
    /// One round of the shared-memory slot exchange (see `shm`'s module docs) for `call`; returns the round
    /// number to read the slots with. On failure aborts the group.
    fn shm_exchange(
        &self,
        st: &mut State,
        shm: &shm::ShmChannel,
        call: CallId,
        unit: u32,
        started: Instant,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<u64> {
        st.shm_round += 1;
        let round = st.shm_round;
        self.on_shm(st, &call, started, Some(shm), |ctx| shm.exchange(round, call, unit, fill, ctx))?;
        Ok(round)
    }

    /// Runs `wait_on` (a transfer through the shared segment) with this group's wait context — its peers, the
    /// deadline `timeout` after `started`, remote aborts, and for a collective (`collective_on`: the segment) the
    /// rule that no point-to-point message may be left pending — and aborts the group on failure.
    fn on_shm<R>(
        &self,
        st: &mut State,
        call: &CallId,
        started: Instant,
        collective_on: Option<&shm::ShmChannel>,
        wait_on: impl FnOnce(&shm::WaitCtx<'_>) -> std::result::Result<R, Failure>,
    ) -> Result<R> {
        let check_abort = || self.remote_abort();
        let order = || collective_on.map_or(Ok(()), |shm| shm.check_no_pending_p2p(call));
        let ctx = shm::WaitCtx {
            peers: &self.peers,
            deadline: started + self.timeout,
            started,
            check_abort: &check_abort,
            order: &order,
            spin: shm::SPIN,
        };
        wait_on(&ctx).map_err(|f| self.abort(st, call, f))
    }

    /// The shared segment when an all_reduce of `n` bytes takes the pipelined shared-memory path: above both the
    /// small-message paths (`small_all_reduce_bytes`) and `shm_min_bytes`. The one place that decides it, for
    /// `all_reduce` and `all_reduce_piecewise` alike.
    fn pipelined_shm(&self, n: usize) -> Option<&shm::ShmChannel> {
        self.shm.as_ref().filter(|_| n > self.tuning.small_all_reduce_bytes && n > self.tuning.shm_min_bytes)
    }

    /// The pipelined all_reduce through shared memory. The caller has run an exchange round first, so every
    /// rank is in this same call (a rank in a different collective or size was reported as a mismatch there and
    /// is never left waiting on the shared segment).
    fn shm_all_reduce(
        &self,
        st: &mut State,
        shm: &shm::ShmChannel,
        call: CallId,
        buf: &mut dyn PiecewiseBuffer,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let first_epoch = st.shm_epoch + 1;
        st.shm_epoch += shm.epochs(buf.len());
        self.on_shm(st, &call, Instant::now(), Some(shm), |ctx| shm.all_reduce(buf, dtype, op, first_epoch, ctx))
    }

    /// A send or recv through the shared segment's rings (`shm_p2p`); on failure aborts the group.
    fn shm_p2p(
        &self,
        st: &mut State,
        call: &CallId,
        transfer: impl FnOnce(&shm::WaitCtx<'_>) -> std::result::Result<(), Failure>,
    ) -> Result<()> {
        self.check_shm_abort(st, call)?;
        self.on_shm(st, call, Instant::now(), None, transfer)
    }

    /// Fails a point-to-point call at once when another rank has signalled an abort through the shared segment: a
    /// send that completes without waiting would not notice it otherwise (e.g. after its receiver found a
    /// mismatch in the previous message).
    fn check_shm_abort(&self, st: &mut State, call: &CallId) -> Result<()> {
        match self.shm.as_ref().and_then(|shm| shm.abort_signalled()) {
            Some(f) => Err(self.abort(st, call, f)),
            None => Ok(()),
        }
    }

    fn segmenting(&self) -> ring::Segmenting {
        ring::Segmenting {
            max_segment_bytes: self.tuning.segment_bytes.max(64),
            split_threshold_bytes: (self.tuning.segment_bytes / 4).max(64 << 10),
        }
    }

    fn check_peer(&self, r: usize, what: &str) -> Result<()> {
        if r >= self.world_size || r == self.rank {
            return Err(DdpError::InvalidArgument(format!(
                "{what} {r} must be another rank of this group of {} (this is rank {})",
                self.world_size, self.rank
            )));
        }
        Ok(())
    }
}
