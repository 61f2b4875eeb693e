//! Point-to-point send/recv between ranks of one machine, through the group's shared segment (`shm`).
//!
//! # Layout
//!
//! Every ordered pair (src → dst) has its own single-producer/single-consumer ring of `N` chunks
//! (`CpuTuning::shm_p2p_chunks`, default 8) of `C` payload bytes (`shm_p2p_chunk_bytes`, default 64 KiB), each
//! chunk behind a 64-byte header: the encoded frame header of the message it belongs to (op, per-pair sequence
//! number, size, the sender's collective count — see below — chunk index, chunk length). Two counters per ring,
//! each on its own line: `head` (chunks the sender has published) and `tail` (chunks the receiver has freed).
//! This is the per-pair FIFO design of Open MPI's shared-memory BTL (`sm`/`vader`) and of NCCL's SHM transport:
//! no locks, one writer per counter, and no pair ever waits for traffic between other ranks.
//!
//! # Protocol
//!
//! A message of `n` bytes is `max(1, ⌈n / C⌉)` chunks. For chunk `k` (counting over the ring's life) the sender
//! waits until `tail + N > k` (acquire: the receiver has finished reading the slot's previous use), writes header
//! and payload into slot `k mod N` and publishes `head = k + 1` (release, then the doorbell). The receiver waits
//! until `head > k` (acquire), checks the header against its own call — a different size is a mismatch naming
//! both sizes — copies the payload out and publishes `tail = k + 1`. So a sender runs ahead of its receiver by up
//! to `N` chunks (`N·C` bytes, 512 KiB by default) and then streams in lock step with it: any message size works
//! with bounded memory, and chunk copies on both sides overlap.
//!
//! **Capacity**: a send returns as soon as its last chunk is in the ring. Two ranks that both send before they
//! receive (a pairwise exchange) therefore only proceed if everything each sends before its receive fits in
//! `N` chunks, i.e. messages of at most `N·C` bytes in total per direction (each message, even an empty one,
//! taking at least one chunk). Beyond that, order the calls as for blocking MPI calls (one side sends while the
//! other receives, e.g. even ranks send first). Two ranks blocked on each other like this — both in send, or both
//! in recv — are detected and fail on both ranks with an error saying so, instead of hanging until the timeout
//! (each rank publishes what it waits for in its `p2p_blocked` word; a peer blocked on this rank that only this
//! rank can unblock, while this rank is blocked on it, is a deadlock). Longer cycles (three ranks each sending
//! to the next) end at the collective timeout, as over TCP.
//!
//! **Memory**: P·(P−1) rings of `N·(64 + C)` bytes in the segment's file in `/dev/shm`; tmpfs allocates pages
//! only when first written, so only pairs that exchange messages cost memory (2 × 512 KiB + headers for a pipeline
//! stage boundary with the defaults).
//!
//! # Ordering against collectives
//!
//! Over TCP, point-to-point messages and collectives between two ranks share one ordered connection. Here they
//! do not (collectives use the slot exchange), so the order is checked explicitly, with the same rule on both
//! paths: **a message sent between the sender's collectives `c` and `c + 1` on this group must be received
//! between the receiver's collectives `c` and `c + 1`**. Every message carries its sender's collective count
//! `c` (CallId `param`; TCP frames carry it too), and
//! - a recv whose message has a different count fails (naming both counts);
//! - every collective round, before posting and again after seeing every peer's post, and every wait of a
//!   collective checks that no peer's ring holds a message sent before this collective (`c < seq`);
//! - a send or recv waiting for a peer that has already posted a later exchange round (it is in a collective
//!   this rank has not entered, which it cannot finish without this rank) fails.
//!
//! The rank that detects the violation aborts the group; the other one, if it is waiting, sees the shared abort
//! word within microseconds and fails too, with the same record. As with eager sends anywhere, a send that
//! completed before its receiver noticed a problem returns `Ok`; the sender's next call then fails (every
//! point-to-point call checks the abort word first, every collective waits for the aborted rank).
//!
//! # Faults
//!
//! Waiting uses the channel's `wait` (spin 1 µs — see [`SPIN`] — then yield until 50 µs, then futex sleep on the
//! peer's doorbell in ≤ 1 ms slices), which watches the shared abort word, the peer's TCP connection (a dead
//! process closes it), the store's abort record and the deadline: a dead or stuck peer fails a blocked sender or
//! receiver as fast as any collective, with an error naming the call (`send/recv`), its per-pair sequence number
//! and the peer.

use super::frame::{CallId, Header, Op, HEADER_LEN};
use super::shm::{ShmChannel, WaitCtx, LINE};
use super::transport::Failure;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Bytes before each chunk's payload (an encoded frame header, padded to a cache line).
const CHUNK_HEADER: usize = 64;
/// How long a blocked send or recv spins before it yields (and from 50 µs on sleeps, as collectives do).
/// Shorter than the collectives' 30 µs: in a ping-pong or a pipeline one rank always waits for the other, and
/// when the scheduler puts both on one core (it readily does on a loaded machine, for ranks that keep waking
/// each other) every microsecond spun is one the peer cannot run. A peer on another core still answers within
/// the spin or the first yields (a fraction of a microsecond each while nothing else wants the core). Measured
/// in docs/benchmarks.md: 1 KiB one way, both ranks forced onto one CPU, 38 µs with a 30 µs spin, 3.5 µs with
/// 1 µs; on two CPUs 0.25 µs either way.
const SPIN: Duration = Duration::from_micros(1);
/// Largest group whose point-to-point goes through the segment: P·(P−1) rings and counters grow with P², and
/// the blocked word has 14 bits for a peer.
const MAX_WORLD: usize = 64;

/// Geometry of the point-to-point rings in a segment (every rank computes the same from the same tuning).
#[derive(Debug, Clone, Copy)]
pub(super) struct Rings {
    pub(super) world_size: usize,
    /// Chunks per ring.
    pub(super) chunks: usize,
    /// Payload bytes per chunk (a multiple of 64).
    pub(super) chunk_bytes: usize,
    /// Offset of the rings' counters: per ordered pair, `head` and `tail`, a line each.
    pub(super) counters_offset: usize,
    /// Offset of the first ring (page aligned).
    pub(super) rings_offset: usize,
}

impl Rings {
    /// `(chunks, chunk bytes)` of the rings for this tuning, or `None` when send/recv stay on TCP. Chunks are a
    /// multiple of 64 bytes (every slot cache-line aligned) and at most 1 GiB (a frame header's length is a u32).
    pub(super) fn geometry(world_size: usize, chunks: usize, chunk_bytes: usize) -> Option<(usize, usize)> {
        let chunk_bytes = chunk_bytes.clamp(64, 1 << 30).div_ceil(64) * 64;
        (chunks > 0 && (2..=MAX_WORLD).contains(&world_size)).then_some((chunks, chunk_bytes))
    }

    /// Bytes of the counters of every ring.
    pub(super) fn counter_bytes(world_size: usize) -> usize {
        world_size * (world_size - 1) * 2 * LINE
    }

    /// Bytes of every ring.
    pub(super) fn ring_bytes(&self) -> usize {
        self.world_size * (self.world_size - 1) * self.chunks * self.stride()
    }

    fn stride(&self) -> usize {
        CHUNK_HEADER + self.chunk_bytes
    }

    fn pair(&self, src: usize, dst: usize) -> usize {
        debug_assert!(src != dst && src < self.world_size && dst < self.world_size);
        src * (self.world_size - 1) + dst - usize::from(dst > src)
    }

    fn head(&self, src: usize, dst: usize) -> usize {
        self.counters_offset + self.pair(src, dst) * 2 * LINE
    }

    fn tail(&self, src: usize, dst: usize) -> usize {
        self.head(src, dst) + LINE
    }

    /// Offset of the slot (header first) that carries chunk `k` from `src` to `dst`.
    fn slot(&self, src: usize, dst: usize, k: u64) -> usize {
        let ring = self.rings_offset + self.pair(src, dst) * self.chunks * self.stride();
        ring + (k % self.chunks as u64) as usize * self.stride()
    }

    /// The chunks' byte ranges of an `n`-byte message (one empty chunk for `n = 0`).
    fn pieces(&self, n: usize) -> impl Iterator<Item = Range<usize>> {
        let c = self.chunk_bytes;
        (0..n.div_ceil(c).max(1)).map(move |i| i * c..((i + 1) * c).min(n))
    }

    /// How far a sender can run ahead of its receiver, in words.
    fn capacity(&self) -> String {
        format!("{} chunks of {} bytes", self.chunks, self.chunk_bytes)
    }
}

/// What a rank blocked in a point-to-point call waits for, published in its `p2p_blocked` word so a peer that
/// is blocked on it can tell a deadlock from a slow rank. Encoding: kind (2 bits) | peer (14 bits) | chunk
/// (48 bits); 0 = not blocked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blocked {
    /// In send to `to`, waiting for room for chunk `chunk`.
    Sending { to: usize, chunk: u64 },
    /// In recv from `from`, waiting for chunk `chunk`.
    Receiving { from: usize, chunk: u64 },
}

const CHUNK_BITS: u32 = 48;
const PEER_BITS: u32 = 14;

impl Blocked {
    fn encode(self) -> u64 {
        let (kind, peer, chunk) = match self {
            Blocked::Sending { to, chunk } => (1u64, to, chunk),
            Blocked::Receiving { from, chunk } => (2, from, chunk),
        };
        (kind << (CHUNK_BITS + PEER_BITS)) | ((peer as u64) << CHUNK_BITS) | (chunk & ((1 << CHUNK_BITS) - 1))
    }

    fn decode(w: u64) -> Option<Blocked> {
        let peer = ((w >> CHUNK_BITS) & ((1 << PEER_BITS) - 1)) as usize;
        let chunk = w & ((1 << CHUNK_BITS) - 1);
        match w >> (CHUNK_BITS + PEER_BITS) {
            1 => Some(Blocked::Sending { to: peer, chunk }),
            2 => Some(Blocked::Receiving { from: peer, chunk }),
            _ => None,
        }
    }

    fn peer(self) -> usize {
        match self {
            Blocked::Sending { to, .. } => to,
            Blocked::Receiving { from, .. } => from,
        }
    }
}

/// The point-to-point side of a segment that has rings.
pub(crate) struct PairRings<'a> {
    shm: &'a ShmChannel,
    rings: Rings,
}

impl ShmChannel {
    /// Point-to-point through this segment, when it has rings (`None`: send/recv use TCP).
    pub(crate) fn pair_rings(&self) -> Option<PairRings<'_>> {
        self.rings.map(|rings| PairRings { shm: self, rings })
    }

    /// `Err` if a peer's ring to this rank holds a message sent before collective `call` (module docs, "Ordering
    /// against collectives"): this rank entered `call` without receiving it, which the peer did not expect.
    pub(crate) fn check_no_pending_p2p(&self, call: &CallId) -> Result<(), Failure> {
        let Some(rings) = self.rings else { return Ok(()) };
        let me = self.rank();
        for q in (0..self.world_size()).filter(|&q| q != me) {
            let k = self.atomic(rings.tail(q, me)).load(Ordering::Relaxed); // only this rank writes it
            if self.atomic(rings.head(q, me)).load(Ordering::Acquire) <= k {
                continue;
            }
            // SAFETY: q published chunk k (head > k, acquire above) and rewrites it only after we free it.
            let h = Header::decode(&unsafe { read_header(self, rings.slot(q, me, k)) })
                .map_err(|detail| Failure::Mismatch { peer: q, detail })?;
            if h.call.op == Op::Send && h.call.param < call.seq {
                return Err(Failure::Mismatch {
                    peer: q,
                    detail: format!(
                        "rank {q} sent message {} ({} bytes) to rank {me} after {} collectives on this group, but \
                         rank {me} entered {call} without receiving it; a message must be received between the \
                         same two collectives on both ranks",
                        h.call.seq, h.call.size, h.call.param
                    ),
                });
            }
        }
        Ok(())
    }
}

/// The 40-byte header at `slot`.
///
/// # Safety
/// The slot must hold a published chunk its writer does not rewrite during the call.
unsafe fn read_header(shm: &ShmChannel, slot: usize) -> [u8; HEADER_LEN] {
    let mut raw = [0u8; HEADER_LEN];
    std::ptr::copy_nonoverlapping(shm.shared_ptr(slot), raw.as_mut_ptr(), HEADER_LEN);
    raw
}

impl PairRings<'_> {
    fn head(&self, src: usize, dst: usize) -> &AtomicU64 {
        self.shm.atomic(self.rings.head(src, dst))
    }

    fn tail(&self, src: usize, dst: usize) -> &AtomicU64 {
        self.shm.atomic(self.rings.tail(src, dst))
    }

    /// Chunks this rank has sent to `peer` and received from it through the rings so far (diagnostics).
    pub(crate) fn chunks_moved(&self, peer: usize) -> (u64, u64) {
        let me = self.shm.rank();
        (self.head(me, peer).load(Ordering::Acquire), self.tail(peer, me).load(Ordering::Acquire))
    }

    /// Sends `buf` to `dst` as message `call` (module docs). `rounds_done` is the last slot-exchange round this
    /// rank has run (a peer that posted a later one is in a collective this rank has not entered).
    pub(crate) fn send(
        &self,
        dst: usize,
        buf: &[u8],
        call: CallId,
        rounds_done: u64,
        ctx: &WaitCtx<'_>,
    ) -> Result<(), Failure> {
        let me = self.shm.rank();
        let (head, tail) = (self.head(me, dst), self.tail(me, dst));
        let n = self.rings.chunks as u64;
        for (unit, piece) in self.rings.pieces(buf.len()).enumerate() {
            let k = head.load(Ordering::Relaxed); // only this rank writes it
            if tail.load(Ordering::Acquire) + n <= k {
                let blocked = Blocked::Sending { to: dst, chunk: k };
                self.wait_blocked(ctx, &call, rounds_done, blocked, || tail.load(Ordering::Acquire) + n > k)?;
            }
            let slot = self.rings.slot(me, dst, k);
            let header = Header::data(call, unit as u32, piece.len()).encode();
            // SAFETY: slot k mod N of my ring to dst is mine to write: the receiver freed its previous use
            // (tail > k − N, acquire above) and reads it only after we publish head = k + 1. In bounds by the
            // layout; `piece` is within `buf` and at most one chunk long.
            unsafe {
                std::ptr::copy_nonoverlapping(header.as_ptr(), self.shm.shared_ptr(slot), HEADER_LEN);
                std::ptr::copy_nonoverlapping(
                    buf[piece.clone()].as_ptr(),
                    self.shm.shared_ptr(slot + CHUNK_HEADER),
                    piece.len(),
                );
            }
            self.shm.publish(head, k + 1);
        }
        Ok(())
    }

    /// Receives message `call` from `src` into `buf` (module docs); `rounds_done` as for [`PairRings::send`].
    pub(crate) fn recv(
        &self,
        src: usize,
        buf: &mut [u8],
        call: CallId,
        rounds_done: u64,
        ctx: &WaitCtx<'_>,
    ) -> Result<(), Failure> {
        let me = self.shm.rank();
        let (head, tail) = (self.head(src, me), self.tail(src, me));
        for (unit, piece) in self.rings.pieces(buf.len()).enumerate() {
            let k = tail.load(Ordering::Relaxed); // only this rank writes it
            if head.load(Ordering::Acquire) <= k {
                let blocked = Blocked::Receiving { from: src, chunk: k };
                self.wait_blocked(ctx, &call, rounds_done, blocked, || head.load(Ordering::Acquire) > k)?;
            }
            let slot = self.rings.slot(src, me, k);
            // SAFETY: src published chunk k (head > k, acquire above) and does not rewrite the slot before we
            // publish tail = k + 1.
            let raw = unsafe { read_header(self.shm, slot) };
            check_chunk(src, me, &call, unit, piece.len(), &raw)?;
            // SAFETY: as above; the header said the payload is `piece.len()` bytes, within one chunk.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.shm.shared_ptr(slot + CHUNK_HEADER),
                    buf[piece.clone()].as_mut_ptr(),
                    piece.len(),
                );
            }
            self.shm.publish(tail, k + 1);
        }
        Ok(())
    }

    /// Waits until `ready()`, with this rank's `p2p_blocked` word saying what for, and the ordering and deadlock
    /// checks after every sleep.
    fn wait_blocked(
        &self,
        ctx: &WaitCtx<'_>,
        call: &CallId,
        rounds_done: u64,
        blocked: Blocked,
        ready: impl Fn() -> bool,
    ) -> Result<(), Failure> {
        let peer = blocked.peer();
        let word = self.shm.p2p_blocked(self.shm.rank());
        word.store(blocked.encode(), Ordering::Release);
        let order = || self.check_waiting(call, rounds_done, blocked, &ready);
        let ctx = WaitCtx { order: &order, spin: SPIN, ..*ctx };
        let result = self.shm.wait(&ctx, |q| q != peer || ready());
        word.store(0, Ordering::Release);
        result
    }

    /// `Err` when the peer this rank waits for can never satisfy it: it is in a collective this rank has not
    /// entered, or it is itself blocked on this rank (module docs).
    ///
    /// Each finding is confirmed by `ready()` still being false *after* the peer's state was read: the peer may
    /// have satisfied this wait just before it moved on (posted a later round, blocked on this rank), and it
    /// publishes its counters before that state, so reading the state first (acquire) makes its earlier
    /// counters visible.
    fn check_waiting(
        &self,
        call: &CallId,
        rounds_done: u64,
        blocked: Blocked,
        ready: &dyn Fn() -> bool,
    ) -> Result<(), Failure> {
        let (me, peer) = (self.shm.rank(), blocked.peer());
        let doing = match blocked {
            Blocked::Sending { .. } => format!("send of message {} ({} bytes) to rank {peer}", call.seq, call.size),
            Blocked::Receiving { .. } => {
                format!("recv of message {} ({} bytes) from rank {peer}", call.seq, call.size)
            }
        };
        if self.shm.posted(peer).load(Ordering::Acquire) > rounds_done && !ready() {
            return Err(Failure::Mismatch {
                peer,
                detail: format!(
                    "rank {me} is blocked in its {doing} after {} collectives on this group, but rank {peer} has \
                     already entered collective {}; between two ranks, sends and receives must sit between the \
                     same collectives on both sides",
                    call.param,
                    call.param + 1
                ),
            });
        }
        let theirs = Blocked::decode(self.shm.p2p_blocked(peer).load(Ordering::Acquire));
        // Only this rank can unblock the peer (it frees the peer's ring to us / fills ours to it), and it is
        // blocked: a deadlock, not a slow peer.
        let stuck = match theirs {
            Some(Blocked::Sending { to, chunk }) if to == me => {
                self.tail(peer, me).load(Ordering::Acquire) + self.rings.chunks as u64 <= chunk
            }
            Some(Blocked::Receiving { from, chunk }) if from == me => {
                self.head(me, peer).load(Ordering::Acquire) <= chunk
            }
            _ => false,
        };
        if let (true, Some(theirs), false) = (stuck, theirs, ready()) {
            let what = |b: Blocked, rank: usize| match b {
                Blocked::Sending { .. } => format!("rank {rank} is blocked in send to rank {}", b.peer()),
                Blocked::Receiving { .. } => format!("rank {rank} is blocked in recv from rank {}", b.peer()),
            };
            return Err(Failure::Mismatch {
                peer,
                detail: format!(
                    "deadlock: {} ({doing}) and {}; each direction's ring holds {} ({} bytes), so a pairwise \
                     exchange of more than that must be ordered so that one rank receives while the other sends, \
                     as with blocking MPI calls",
                    what(blocked, me),
                    what(theirs, peer),
                    self.rings.capacity(),
                    self.rings.chunks * self.rings.chunk_bytes
                ),
            });
        }
        Ok(())
    }
}

/// Checks chunk `unit` (of `len` bytes) of the message from `src` against this rank's call.
fn check_chunk(
    src: usize,
    me: usize,
    call: &CallId,
    unit: usize,
    len: usize,
    raw: &[u8; HEADER_LEN],
) -> Result<(), Failure> {
    let h = Header::decode(raw).map_err(|detail| Failure::Mismatch { peer: src, detail })?;
    if h == Header::data(*call, unit as u32, len) {
        return Ok(());
    }
    let theirs = &h.call;
    let detail = if theirs.op == Op::Send && theirs.seq == call.seq && theirs.size != call.size {
        format!(
            "rank {src} sent message {} of {} bytes to rank {me}, but rank {me}'s matching recv (message {} from \
             rank {src}) is for {} bytes; the n-th send from one rank to another is received by the n-th recv \
             there and must have the same size",
            theirs.seq, theirs.size, call.seq, call.size
        )
    } else if theirs.op == Op::Send && theirs.seq == call.seq && theirs.param != call.param {
        format!(
            "rank {src} sent message {} to rank {me} after {} collectives on this group, but rank {me} receives it \
             after {}; a message must be received between the same two collectives on both ranks",
            theirs.seq, theirs.param, call.param
        )
    } else {
        format!(
            "rank {me} expected chunk {unit} ({len} bytes) of {call} from rank {src}, but its ring holds chunk {} \
             ({} bytes) of {}",
            h.unit, h.len, h.call
        )
    };
    Err(Failure::Mismatch { peer: src, detail })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocked_word_round_trip() {
        for b in [
            Blocked::Sending { to: 0, chunk: 0 },
            Blocked::Sending { to: 63, chunk: (1 << 48) - 1 },
            Blocked::Receiving { from: 5, chunk: 12345 },
        ] {
            assert_ne!(b.encode(), 0);
            assert_eq!(Blocked::decode(b.encode()), Some(b));
        }
        assert_eq!(Blocked::decode(0), None);
    }

    #[test]
    fn rings_do_not_overlap_and_pieces_cover_the_message() {
        let r = Rings { world_size: 3, chunks: 4, chunk_bytes: 128, counters_offset: 1024, rings_offset: 8192 };
        let mut slots = std::collections::BTreeSet::new();
        let mut counters = std::collections::BTreeSet::new();
        for (s, d) in [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)] {
            assert!(counters.insert(r.head(s, d)) && counters.insert(r.tail(s, d)));
            for k in 0..4 {
                let at = r.slot(s, d, k);
                assert!(at >= r.rings_offset && at + r.stride() <= r.rings_offset + r.ring_bytes());
                assert!(slots.insert(at));
                assert_eq!(r.slot(s, d, k + 4), at, "chunk k + N reuses slot k");
            }
        }
        assert!(counters.iter().all(|&c| c + LINE <= 1024 + Rings::counter_bytes(3)));
        assert_eq!(r.pieces(0).collect::<Vec<_>>(), vec![0..0]);
        assert_eq!(r.pieces(128).collect::<Vec<_>>(), vec![0..128]);
        assert_eq!(r.pieces(129).collect::<Vec<_>>(), vec![0..128, 128..129]);
        assert_eq!(Rings::geometry(2, 8, 100), Some((8, 128)));
        assert_eq!(Rings::geometry(2, 0, 100), None);
        assert_eq!(Rings::geometry(1, 8, 100), None);
    }
}
