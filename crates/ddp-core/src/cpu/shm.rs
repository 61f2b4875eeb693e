//! Shared memory for groups whose ranks all run on one machine: the pipelined all_reduce of large buffers
//! (below), the slot exchange every other collective uses (see "Slot exchange") and the per-pair rings that carry
//! send/recv (see "Point-to-point").
//!
//! Why: on loopback every byte crosses the kernel's TCP stack twice (copy in, copy out) and its packet
//! processing runs in softirq context, which the kernel defers to `ksoftirqd` under CPU pressure, so on a busy
//! machine the transfer stalls (docs/benchmarks.md, section "What the backend does").
//! Through shared memory the same all_reduce is plain memory copies and reductions done by the ranks themselves.
//!
//! Setup (once per group, through the store): rank 0 creates a file in `/dev/shm` (O_EXCL, random name),
//! sizes and maps it, writes a random nonce at its start and publishes `name + nonce`; every other rank opens
//! and maps it and checks the nonce (ranks that see a different `/dev/shm`, e.g. other machines or containers,
//! fail the check). Every rank publishes whether it succeeded; only if all did is the channel used (the
//! decision is the same on every rank), and rank 0 then unlinks the file so nothing is left behind even if the
//! job is killed. Otherwise the group silently uses TCP only.
//!
//! Algorithm (per block of at most `block_bytes`, double-buffered so consecutive blocks overlap): the block is
//! split into P element-aligned parts; rank r owns part r.
//! 1. copy-in: rank r copies the parts *other* ranks own from its input into its slot;
//! 2. reduce: rank r reduces its own part — its input first, then the other ranks' slots in rank order —
//!    straight into the shared result buffer (Avg: divided in the last combine), and publishes it;
//! 3. copy-out: rank r copies the whole block of the result buffer into its output.
//!
//! Each part is reduced by exactly one rank, so all ranks get the same bits. The input and output are a
//! [`PiecewiseBuffer`]: for DDP's buckets the gradient tensors themselves, so a bucket is never packed into or
//! unpacked from a contiguous buffer. Memory traffic per rank for P = 2, counting reads and writes, is 4.5×
//! the buffer (copy-in 1, reduce 1.5, copy-out 2; vs ≥ 5.5× through TCP, plus 4× there for packing and unpacking
//! a bucket around it). Progress is signalled with per-rank epoch counters
//! (acquire/release atomics, one cache line each); waiters spin briefly, then yield, then sleep in short steps,
//! and while waiting watch the shared abort word, the peers' TCP connections (a dead process closes them), the
//! store's abort record and the deadline — so a failure is still reported on every rank, quickly.
//!
//! # Slot exchange
//!
//! Every collective (all_reduce, broadcast, all_gather, reduce_scatter, barrier) on a group with a channel runs
//! one or more *rounds*, numbered alike on every rank (`State::shm_round`). Each rank owns two slots (round
//! parity picks one), each a 64-byte header and `slot_cap` payload bytes. In round k rank r
//! 1. writes its payload into its slot k mod 2 and the call's identity (an encoded frame header: op, sequence
//!    number, size, dtype, reduction, root, round index within the call) into the slot's header;
//! 2. publishes `posted[r] = k` (release) and rings its doorbell;
//! 3. waits until every rank posted ≥ k (acquire), checks every peer's header against its own call — a rank in
//!    a different collective, size or order is reported as a mismatch naming both calls, on every rank — and
//!    reads what it needs from the slots (e.g. small all_reduce: every rank reduces *all* slots itself in rank
//!    order `((x0 ⊕ x1) ⊕ x2) ⊕ …`, so every rank gets the same bits).
//!
//! Why two slots and one counter suffice: rank w rewrites slot k mod 2 only in round k + 2, which it enters after
//! finishing round k + 1, i.e. after seeing `posted[q] ≥ k + 1` for every q; and q posts k + 1 only after it has
//! finished reading round k. So no reader can still be reading a slot when it is rewritten, and a reader waiting
//! for round k never sees round k + 2's data (which needs its own `posted ≥ k + 1` first). Collectives that take
//! another path (TCP ring, pipelined all_reduce) still run one empty round first: every rank then has checked
//! every other rank's call identity before anyone enters a path where a mismatch could leave ranks waiting on
//! different channels.
//!
//! # Point-to-point
//!
//! The same segment holds, after the slots, one single-producer/single-consumer ring per ordered pair of ranks
//! (src → dst; `shm_p2p_chunks` chunks of `shm_p2p_chunk_bytes`, default 8 × 64 KiB), with a `head` / `tail`
//! counter pair per ring among the counters, and every rank has a `p2p_blocked` word saying what a blocked send
//! or recv of it waits for. A send copies its message chunk by chunk into its ring to the receiver (each chunk
//! behind a frame header with the message's identity), running ahead by up to the ring's capacity; the receiver
//! checks every header and copies the chunks out. Since send/recv no longer share an ordered connection with the
//! collectives, the order between them is checked explicitly: every message carries the sender's collective
//! count, every exchange round checks (before posting and after its wait) that no peer left a message from before
//! this collective in the rings, and a send/recv waiting for a peer that is already in a later collective, or
//! that is blocked on this rank itself, fails instead of hanging. Waits are the ones below, with a shorter spin.
//! Protocol, capacity and rules: `shm_p2p`. Setup is the segment's (same nonce check, same unlink); with
//! `shm_p2p_chunks = 0`, or more than 64 ranks, there are no rings and send/recv use TCP.

use super::frame::{CallId, Header, HEADER_LEN};
use super::ring::split_even;
use super::shm_p2p::Rings;
use super::transport::Failure;
use crate::backend::PiecewiseBuffer;
use crate::store::Store;
use crate::token::RunToken;
use crate::{DType, DdpError, ReduceOp, Result};
use memmap2::MmapMut;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Two cache lines: adjacent-line prefetch must not couple two counters.
pub(super) const LINE: usize = 128;
const PAGE: usize = 4096;
const NONCE_LEN: usize = 16;
const ABORT_OFFSET: usize = LINE;
const COUNTERS_OFFSET: usize = 2 * LINE;
/// Per rank: `arrived`, `reduced`, `consumed` (u64 each), the doorbell line (u32 futex word + u32 sleepers),
/// `posted` (the slot exchange's round counter) and `p2p_blocked` (what a point-to-point call waits for, see
/// `shm_p2p`).
const LINES_PER_RANK: usize = 6;
/// Bytes before each exchange slot's payload (an encoded frame header, padded to a cache line).
const SLOT_HEADER: usize = 64;

/// One group's shared segment, mapped in this process.
pub(crate) struct ShmChannel {
    map: MmapMut,
    rank: usize,
    world_size: usize,
    block_bytes: usize,
    /// Blocks in flight per rank (buffers of each slot / of the result area).
    depth: usize,
    data_offset: usize,
    /// Payload bytes of one exchange slot.
    slot_cap: usize,
    /// Offset of the exchange slots (2 per rank).
    slots_offset: usize,
    /// Where the point-to-point rings are, when send/recv go through this segment (see `shm_p2p`).
    pub(super) rings: Option<Rings>,
}

/// Where everything lives in the segment.
struct Layout {
    data_offset: usize,
    slots_offset: usize,
    rings: Option<Rings>,
    total: usize,
}

// SAFETY: the mapping is only accessed through atomics (counters, abort word) and through byte copies of
// regions whose ownership is handed over by those counters (see the module docs); `MmapMut` itself is Send.
unsafe impl Sync for ShmChannel {}

/// What waiting needs to detect failures.
pub(crate) struct WaitCtx<'a> {
    pub peers: &'a [Option<TcpStream>],
    pub deadline: Instant,
    pub started: Instant,
    pub check_abort: &'a dyn Fn() -> Option<Failure>,
    /// Checked after every sleep: `Err` when the ranks' calls can no longer match (a point-to-point message left
    /// behind by a collective, two ranks blocked on each other; see `shm_p2p`).
    pub order: &'a dyn Fn() -> std::result::Result<(), Failure>,
    /// How long to spin before yielding: [`SPIN`] for collectives, less for point-to-point (`shm_p2p`).
    pub spin: Duration,
}

impl ShmChannel {
    /// The segment: nonce, abort word, per-rank counters, the rings' counters (all atomics, before
    /// `data_offset`), then the all_reduce blocks, the exchange slots and the point-to-point rings (page aligned).
    fn layout(
        world_size: usize,
        block_bytes: usize,
        depth: usize,
        slot_cap: usize,
        p2p: Option<(usize, usize)>,
    ) -> Layout {
        let rank_counters_end = COUNTERS_OFFSET + world_size * LINES_PER_RANK * LINE;
        let header = rank_counters_end + p2p.map_or(0, |_| Rings::counter_bytes(world_size));
        let data_offset = header.div_ceil(PAGE) * PAGE;
        let slots_offset = data_offset + depth * (world_size + 1) * block_bytes;
        let slots_end = slots_offset + 2 * world_size * (SLOT_HEADER + slot_cap);
        let rings_offset = slots_end.div_ceil(PAGE) * PAGE;
        let rings = p2p.map(|(chunks, chunk_bytes)| Rings {
            world_size,
            chunks,
            chunk_bytes,
            counters_offset: rank_counters_end,
            rings_offset,
        });
        let total = rings.as_ref().map_or(slots_end, |r| rings_offset + r.ring_bytes());
        Layout { data_offset, slots_offset, rings, total }
    }

    /// Payload bytes of an exchange slot for `slot_bytes` asked: a multiple of 64 (alignment of every slot) and at
    /// least 8 bytes per rank (reduce_scatter puts one piece per rank in a slot).
    pub(crate) fn slot_capacity(world_size: usize, slot_bytes: usize) -> usize {
        slot_bytes.max(8 * world_size).max(64).div_ceil(64) * 64
    }

    /// Sets up the channel through the store (collective over the group). `Ok(None)` when shared memory is not
    /// usable by every rank (then nobody uses it).
    pub(crate) fn establish(
        store: &dyn Store,
        prefix: &str,
        rank: usize,
        world_size: usize,
        tuning: &super::CpuTuning,
    ) -> Result<Option<ShmChannel>> {
        let (block_bytes, depth, slot_bytes, enabled) =
            (tuning.shm_block_bytes, tuning.shm_depth, tuning.shm_slot_bytes, tuning.shared_memory);
        let slot_cap = Self::slot_capacity(world_size, slot_bytes);
        let p2p = Rings::geometry(world_size, tuning.shm_p2p_chunks, tuning.shm_p2p_chunk_bytes);
        let Layout { data_offset, slots_offset, rings, total } =
            Self::layout(world_size, block_bytes, depth, slot_cap, p2p);
        let key = format!("{prefix}shm/segment");
        let mut path = None;
        let attempt: std::result::Result<MmapMut, String> = if !enabled {
            // Still take part in the vote, so ranks with shared memory enabled do not wait for us.
            if rank == 0 {
                store.set(&key, b"-\ndisabled on rank 0")?;
            }
            Err("disabled (ACCEL_CPU_SHM=0)".into())
        } else if rank == 0 {
            let nonce = RunToken::generate()?;
            let name = format!("/dev/shm/accel-rs-{}-{}", std::process::id(), &RunToken::generate()?.to_hex()[..16]);
            let made = (|| -> std::io::Result<MmapMut> {
                let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&name)?;
                file.set_len(total as u64)?;
                // SAFETY: a fresh file only this job knows about; other processes access it per the protocol.
                let mut map = unsafe { memmap2::MmapOptions::new().len(total).map_mut(&file)? };
                map[..NONCE_LEN].copy_from_slice(nonce.as_bytes());
                Ok(map)
            })();
            path = Some(name.clone());
            let value = match &made {
                Ok(_) => format!("{name}\n{}", nonce.to_hex()),
                Err(e) => format!("-\n{e}"),
            };
            store.set(&key, value.as_bytes())?;
            made.map_err(|e| format!("creating {name}: {e}"))
        } else {
            let raw = store.get(&key)?;
            let text = String::from_utf8_lossy(&raw).into_owned();
            let (name, nonce) = text.split_once('\n').unwrap_or(("-", ""));
            if name == "-" {
                Err(format!("rank 0 could not create the segment: {nonce}"))
            } else {
                (|| -> std::result::Result<MmapMut, String> {
                    let file = std::fs::OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open(name)
                        .map_err(|e| format!("opening {name}: {e}"))?;
                    let len = file.metadata().map_err(|e| e.to_string())?.len();
                    if len != total as u64 {
                        return Err(format!("{name} has {len} bytes, expected {total}"));
                    }
                    // SAFETY: the segment rank 0 created for this group; accessed per the protocol.
                    let map = unsafe { memmap2::MmapOptions::new().len(total).map_mut(&file) }
                        .map_err(|e| format!("mapping {name}: {e}"))?;
                    let want = RunToken::from_hex(nonce).map_err(|e| e.to_string())?;
                    if !want.matches(&map[..NONCE_LEN]) {
                        return Err(format!("{name} is not rank 0's segment (another machine or /dev/shm?)"));
                    }
                    Ok(map)
                })()
            }
        };
        store.set(&format!("{prefix}shm/ok/{rank}"), if attempt.is_ok() { b"1" } else { b"0" })?;
        let mut all_ok = true;
        for q in 0..world_size {
            all_ok &= store.get(&format!("{prefix}shm/ok/{q}"))? == b"1";
        }
        if rank == 0 {
            if let Some(p) = &path {
                // Everyone has opened it (or given up): the name is no longer needed.
                let _ = std::fs::remove_file(p);
            }
        }
        match attempt {
            Ok(map) if all_ok => {
                tracing::debug!(
                    rank,
                    world_size,
                    block_bytes,
                    p2p = rings.is_some(),
                    "cpu backend: shared-memory collectives enabled"
                );
                Ok(Some(ShmChannel {
                    map,
                    rank,
                    world_size,
                    block_bytes,
                    depth,
                    data_offset,
                    slot_cap,
                    slots_offset,
                    rings,
                }))
            }
            Ok(_) => Ok(None),
            Err(reason) => {
                tracing::debug!(rank, "cpu backend: shared memory unavailable, using TCP only: {reason}");
                Ok(None)
            }
        }
    }

    pub(super) fn rank(&self) -> usize {
        self.rank
    }
    pub(super) fn world_size(&self) -> usize {
        self.world_size
    }

    pub(super) fn atomic(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset.is_multiple_of(8) && offset + 8 <= self.data_offset);
        // SAFETY: in bounds, 8-byte aligned (mappings are page aligned), and only ever accessed atomically.
        unsafe { &*(self.map.as_ptr().add(offset) as *const AtomicU64) }
    }

    fn arrived(&self, r: usize) -> &AtomicU64 {
        self.atomic(COUNTERS_OFFSET + r * LINES_PER_RANK * LINE)
    }
    fn reduced(&self, r: usize) -> &AtomicU64 {
        self.atomic(COUNTERS_OFFSET + r * LINES_PER_RANK * LINE + LINE)
    }
    fn consumed(&self, r: usize) -> &AtomicU64 {
        self.atomic(COUNTERS_OFFSET + r * LINES_PER_RANK * LINE + 2 * LINE)
    }
    pub(super) fn posted(&self, r: usize) -> &AtomicU64 {
        self.atomic(COUNTERS_OFFSET + r * LINES_PER_RANK * LINE + 4 * LINE)
    }
    /// Rank r's point-to-point wait word (`shm_p2p::Blocked`, 0 when not blocked).
    pub(super) fn p2p_blocked(&self, r: usize) -> &AtomicU64 {
        self.atomic(COUNTERS_OFFSET + r * LINES_PER_RANK * LINE + 5 * LINE)
    }
    /// Rank r's doorbell: a futex word bumped on every counter update, and how many ranks sleep on it.
    fn bell(&self, r: usize) -> (&AtomicU32, &AtomicU32) {
        let off = COUNTERS_OFFSET + r * LINES_PER_RANK * LINE + 3 * LINE;
        // SAFETY: in bounds, 4-byte aligned, only accessed atomically (and by the futex syscall).
        unsafe {
            (&*(self.map.as_ptr().add(off) as *const AtomicU32), &*(self.map.as_ptr().add(off + 4) as *const AtomicU32))
        }
    }

    /// Publishes one of my counters and wakes ranks sleeping on my doorbell.
    pub(super) fn publish(&self, counter: &AtomicU64, e: u64) {
        counter.store(e, Ordering::Release);
        let (bell, sleepers) = self.bell(self.rank);
        bell.fetch_add(1, Ordering::SeqCst);
        // Dekker with the waiter: it bumps `sleepers` then re-reads `bell`; one of us sees the other.
        if sleepers.load(Ordering::SeqCst) > 0 {
            futex_wake(bell);
        }
    }
    fn abort_word(&self) -> &AtomicU64 {
        self.atomic(ABORT_OFFSET)
    }

    /// Byte offset of rank `r`'s slot, buffer `b` (< depth).
    fn slot(&self, r: usize, b: usize) -> usize {
        self.data_offset + (self.depth * r + b) * self.block_bytes
    }
    fn result(&self, b: usize) -> usize {
        self.data_offset + (self.depth * self.world_size + b) * self.block_bytes
    }

    pub(super) fn shared_ptr(&self, offset: usize) -> *mut u8 {
        // The mapping is writable; writes go through raw pointers to regions this rank owns at the time.
        self.map.as_ptr().wrapping_add(offset) as *mut u8
    }

    /// Tells the other ranks to stop waiting (they then read the abort record from the store or TCP).
    pub(crate) fn signal_abort(&self, blamed: Option<usize>) {
        self.abort_word().store(blamed.map_or(u64::MAX, |b| b as u64 + 1), Ordering::Release);
    }

    /// The failure another rank signalled through the abort word, if any.
    pub(crate) fn abort_signalled(&self) -> Option<Failure> {
        let abort = self.abort_word().load(Ordering::Acquire);
        if abort == 0 {
            return None;
        }
        let blamed = (abort != u64::MAX).then(|| (abort - 1) as usize);
        // The aborting rank's full record may be unreachable (the store's host may be the dead rank), so the
        // reason names the blamed rank itself: every survivor then names the culprit.
        let reason = match blamed {
            Some(b) => format!("rank {b} is gone or failed (another rank aborted the group)"),
            None => "another rank aborted the group".into(),
        };
        Some(Failure::RemoteAbort { from: None, blamed, reason })
    }

    /// Payload bytes of one exchange slot (the most one rank contributes to one round).
    pub(crate) fn slot_cap(&self) -> usize {
        self.slot_cap
    }

    /// Byte offset of rank `q`'s exchange slot (header first) for `round`.
    fn exchange_slot(&self, q: usize, round: u64) -> usize {
        self.slots_offset + (2 * q + (round % 2) as usize) * (SLOT_HEADER + self.slot_cap)
    }

    /// One round of the slot exchange (module docs): `fill` writes this rank's payload into its slot, then the
    /// round is posted and every peer's post awaited and its header checked against `call` / `unit`. Afterwards
    /// [`ShmChannel::peer_slot`] reads any rank's payload of this round.
    pub(crate) fn exchange(
        &self,
        round: u64,
        call: CallId,
        unit: u32,
        fill: impl FnOnce(&mut [u8]),
        ctx: &WaitCtx<'_>,
    ) -> std::result::Result<(), Failure> {
        let me = self.exchange_slot(self.rank, round);
        let header = Header::data(call, unit, 0).encode();
        // SAFETY: my slot for this round's parity is mine to write: every rank finished reading it (round − 2)
        // before posting round − 1, which this rank saw before starting this round (module docs).
        unsafe {
            fill(std::slice::from_raw_parts_mut(self.shared_ptr(me + SLOT_HEADER), self.slot_cap));
            std::ptr::copy_nonoverlapping(header.as_ptr(), self.shared_ptr(me), HEADER_LEN);
        }
        // A point-to-point message a peer sent before this collective must have been received before it
        // (`shm_p2p`, "Ordering against collectives"): checked before posting, so the sender, waiting for our
        // post, fails in this call too, and again once every peer's post (which follows its sends) is visible.
        self.check_no_pending_p2p(&call)?;
        self.publish(self.posted(self.rank), round);
        self.wait(ctx, |q| self.posted(q).load(Ordering::Acquire) >= round)?;
        self.check_no_pending_p2p(&call)?;
        for q in (0..self.world_size).filter(|&q| q != self.rank) {
            let mut raw = [0u8; HEADER_LEN];
            // SAFETY: q posted ≥ round (acquire in `wait`) and rewrites this slot only after we post round + 1.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.shared_ptr(self.exchange_slot(q, round)),
                    raw.as_mut_ptr(),
                    HEADER_LEN,
                )
            };
            let h = Header::decode(&raw).map_err(|detail| Failure::Mismatch { peer: q, detail })?;
            if h.call != call || h.unit != unit {
                return Err(Failure::Mismatch {
                    peer: q,
                    detail: format!(
                        "this rank is in {call} (part {unit}), but rank {q} is in {} (part {}); every rank must call \
                         the same collectives in the same order with the same sizes",
                        h.call, h.unit
                    ),
                });
            }
        }
        Ok(())
    }

    /// Rank `q`'s payload in `round` (all `slot_cap` bytes; callers take the prefix the protocol filled). Only
    /// valid after [`ShmChannel::exchange`] of that round returned `Ok` and before this rank's next exchange.
    pub(crate) fn peer_slot(&self, q: usize, round: u64) -> &[u8] {
        // SAFETY: in bounds; q does not rewrite it before this rank posts round + 1 (module docs).
        unsafe {
            std::slice::from_raw_parts(self.shared_ptr(self.exchange_slot(q, round) + SLOT_HEADER), self.slot_cap)
        }
    }

    /// Epochs an all_reduce of `n` bytes uses.
    pub(crate) fn epochs(&self, n: usize) -> u64 {
        n.div_ceil(self.block_bytes).max(1) as u64
    }

    /// All_reduce of `buf` through shared memory: its input is read piece by piece into this rank's slot (the
    /// parts other ranks own) and straight into the reduction (its own part), and the result is written back
    /// from the shared result buffer, block by block in order (the [`PiecewiseBuffer`] contract). `first_epoch`
    /// is this call's first epoch (epochs count blocks across calls and are the same on every rank).
    ///
    /// While waiting for the other ranks, a rank stages (copies in) up to `depth` blocks ahead, so a rank
    /// that runs while its peers are descheduled gets work done for later.
    pub(crate) fn all_reduce(
        &self,
        buf: &mut dyn PiecewiseBuffer,
        dtype: DType,
        op: ReduceOp,
        first_epoch: u64,
        ctx: &WaitCtx<'_>,
    ) -> std::result::Result<(), Failure> {
        let es = dtype.size_in_bytes();
        let block = (self.block_bytes / es) * es;
        let len = buf.len();
        let n_blocks = len.div_ceil(block).max(1);
        let bounds = |i: usize| (i * block, ((i + 1) * block).min(len));
        let (p, r, depth) = (self.world_size, self.rank, self.depth);
        let parts = |i: usize| {
            let (a, b) = bounds(i);
            split_even(a, b - a, es, p)
        };
        let epoch = |i: usize| first_epoch + i as u64;
        let others_all = |f: &dyn Fn(usize) -> bool| (0..p).filter(|&q| q != r).all(f);
        let slot_free = |k: usize| others_all(&|q| self.reduced(q).load(Ordering::Acquire) + depth as u64 >= epoch(k));
        let others: Vec<usize> = (0..p).filter(|&q| q != r).collect();

        let mut staged = 0usize;
        for i in 0..n_blocks {
            let e = epoch(i);
            let b = (e % depth as u64) as usize;
            let mine = parts(i)[r].clone();
            let (base, end) = bounds(i);
            while staged <= i {
                self.copy_in(&*buf, &parts(staged), bounds(staged).0, epoch(staged), ctx)?;
                staged += 1;
            }
            // 2. reduce my part into the result buffer: my values, then the others' in rank order (Avg: divided
            // in the last combine).
            let arrived = |q: usize| self.arrived(q).load(Ordering::Acquire) >= e;
            while staged < n_blocks && staged < i + depth && !others_all(&arrived) && slot_free(staged) {
                self.copy_in(&*buf, &parts(staged), bounds(staged).0, epoch(staged), ctx)?;
                staged += 1;
            }
            self.wait(ctx, arrived)?;
            // The result buffer's previous use must have been read by every rank before it is overwritten.
            self.wait(ctx, |q| self.consumed(q).load(Ordering::Acquire) + depth as u64 >= e)?;
            // SAFETY: result buffer b, part r is ours to write until we publish `reduced ≥ e` (every rank
            // consumed its previous use, awaited above), and slot (q, b) holds block e's data: q published
            // `arrived ≥ e` (acquire above) and will not write it again before we publish `reduced ≥ e` (what
            // `theirs` reads). The regions are disjoint, and none overlaps `buf`, which is this process's own memory.
            let out = unsafe {
                std::slice::from_raw_parts_mut(self.shared_ptr(self.result(b) + mine.start - base), mine.len())
            };
            let theirs = |q: usize, at: usize, n: usize| unsafe {
                std::slice::from_raw_parts(self.shared_ptr(self.slot(q, b) + at - base), n)
            };
            let divide_first = (op == ReduceOp::Avg && p == 2).then_some(p);
            buf.read(mine.clone(), &mut |at, piece| {
                let o = &mut out[at - mine.start..at - mine.start + piece.len()];
                crate::dtype::combine_into(dtype, op, o, piece, theirs(others[0], at, piece.len()), divide_first);
            });
            for &q in &others[1..] {
                crate::dtype::reduce_into(dtype, op, out, theirs(q, mine.start, mine.len()));
            }
            if op == ReduceOp::Avg && p > 2 {
                crate::dtype::divide_in_place(dtype, out, p);
            }
            self.publish(self.reduced(r), e);
            // 3. write the whole block's result back (staging later blocks while the others finish reducing).
            let reduced = |q: usize| self.reduced(q).load(Ordering::Acquire) >= e;
            while staged < n_blocks && staged < i + depth && !others_all(&reduced) && slot_free(staged) {
                self.copy_in(&*buf, &parts(staged), bounds(staged).0, epoch(staged), ctx)?;
                staged += 1;
            }
            self.wait(ctx, reduced)?;
            // SAFETY: every part of result buffer b was published by its owner (`reduced ≥ e`, acquire above;
            // ours by us) and is not rewritten before every rank publishes `consumed ≥ e`.
            let result = unsafe { std::slice::from_raw_parts(self.shared_ptr(self.result(b)), end - base) };
            buf.write(base, result);
            self.publish(self.consumed(r), e);
        }
        Ok(())
    }

    /// 1. copy-in of block epoch `e`: the parts other ranks own go from `buf` to my slot.
    fn copy_in(
        &self,
        buf: &dyn PiecewiseBuffer,
        part: &[std::ops::Range<usize>],
        base: usize,
        e: u64,
        ctx: &WaitCtx<'_>,
    ) -> std::result::Result<(), Failure> {
        let depth = self.depth as u64;
        let b = (e % depth) as usize;
        // My slot b was last read during epoch e − depth: wait until every rank has reduced that epoch.
        self.wait(ctx, |q| self.reduced(q).load(Ordering::Acquire) + depth >= e)?;
        let slot = self.shared_ptr(self.slot(self.rank, b));
        for (q, range) in part.iter().enumerate() {
            if q == self.rank {
                continue;
            }
            buf.read(range.clone(), &mut |at, piece| {
                // SAFETY: my slot b is mine to write until I publish `arrived ≥ e`; `at - base + piece.len()` is
                // within the block, so within the slot.
                unsafe { std::ptr::copy_nonoverlapping(piece.as_ptr(), slot.add(at - base), piece.len()) }
            });
        }
        self.publish(self.arrived(self.rank), e);
        Ok(())
    }

    /// Waits until `ready(q)` holds for every other rank q, watching for failures.
    ///
    /// Spins for up to `ctx.spin` ([`SPIN`] for collectives: the peer normally runs on another core, microseconds
    /// behind), yields until [`SPIN_AND_YIELD`], then sleeps on
    /// the doorbell of a rank it waits for (a futex in the shared segment, rung by every publish) in slices of
    /// at most 1 ms. Sleeping matters on a loaded machine: when both ranks share a core, spinning would only
    /// burn the time the peer needs.
    pub(super) fn wait(&self, ctx: &WaitCtx<'_>, ready: impl Fn(usize) -> bool) -> std::result::Result<(), Failure> {
        let others = || (0..self.world_size).filter(|&q| q != self.rank);
        if others().all(&ready) {
            return Ok(());
        }
        let start = Instant::now();
        let mut last_tick = start;
        loop {
            for _ in 0..32 {
                if others().all(&ready) {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
            if let Some(f) = self.abort_signalled() {
                return Err(f);
            }
            let now = Instant::now();
            if now - start < ctx.spin {
                continue;
            }
            if now - start < SPIN_AND_YIELD {
                // The peer may be runnable on this core (2-core machine, other builds): give it the CPU.
                std::thread::yield_now();
                continue;
            }
            let Some(q) = others().find(|&q| !ready(q)) else { return Ok(()) };
            let (bell, sleepers) = self.bell(q);
            let seen = bell.load(Ordering::SeqCst);
            sleepers.fetch_add(1, Ordering::SeqCst);
            if !ready(q) && bell.load(Ordering::SeqCst) == seen {
                futex_wait(bell, seen, Duration::from_millis(1));
            }
            sleepers.fetch_sub(1, Ordering::SeqCst);
            if ready(q) {
                continue;
            }
            // Still waiting after a sleep: is q alive, can the calls still match, are we out of time, did someone
            // abort?
            peer_alive(ctx.peers, q)?;
            (ctx.order)()?;
            let now = Instant::now();
            if now >= ctx.deadline {
                return Err(Failure::Timeout { peer: Some(q), waited: now - ctx.started });
            }
            if now - last_tick >= super::transport::TICK {
                last_tick = now;
                if let Some(f) = (ctx.check_abort)() {
                    return Err(f);
                }
            }
        }
    }
}

/// How long a waiter spins before yielding (a peer on another core answers within microseconds).
pub(crate) const SPIN: Duration = Duration::from_micros(30);
/// How long a waiter spins and yields before it sleeps on the peer's doorbell (bounded: spinning ranks must not
/// starve a peer that shares their core).
const SPIN_AND_YIELD: Duration = Duration::from_micros(50);

/// Sleeps while `*word == seen`, at most `limit` (spurious wake-ups are fine: callers re-check).
fn futex_wait(word: &AtomicU32, seen: u32, limit: Duration) {
    let ts = libc::timespec { tv_sec: 0, tv_nsec: limit.as_nanos().min(999_999_999) as libc::c_long };
    // SAFETY: FUTEX_WAIT (shared, not _PRIVATE: the word lives in a segment mapped by several processes) on a
    // valid aligned u32 with a valid relative timeout; it only reads the word.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
            0usize,
            0u32,
        );
    }
}

/// Wakes every sleeper on `word`.
fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid aligned u32; no memory is written.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32);
    }
}

/// Whether peer `q`'s TCP connection is still open. We only ask about a peer we are waiting for, i.e. one that
/// has not finished the current collective, so a closed write side (FIN, possibly after data of a later call)
/// or a reset means it died or aborted.
fn peer_alive(peers: &[Option<TcpStream>], q: usize) -> std::result::Result<(), Failure> {
    let Some(s) = &peers[q] else { return Ok(()) };
    let mut pfd = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    if n > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
        return Err(Failure::PeerLost {
            peer: q,
            detail: "connection closed (process exited, was killed, or aborted)".into(),
        });
    }
    Ok(())
}

/// `Err` if the block size cannot work.
pub(crate) fn check_block(block_bytes: usize) -> Result<()> {
    if block_bytes < 4096 || !block_bytes.is_multiple_of(64) {
        return Err(DdpError::InvalidArgument(format!(
            "shared-memory block of {block_bytes} bytes: use a multiple of 64 of at least 4096"
        )));
    }
    Ok(())
}
