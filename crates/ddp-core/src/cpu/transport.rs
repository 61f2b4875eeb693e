//! The progress engine: runs a [`Plan`] of frame sends and receives over the mesh's non-blocking sockets in one
//! thread, so sending, receiving and reducing overlap without extra threads (each rank of a 2-core machine has one
//! core to itself; a thread per direction would only add context switches).
//!
//! A plan lists send units (a byte range of a buffer to one peer, optionally gated on a receive having completed
//! first — that is how a ring forwards what it just reduced) and receive units (a byte range to fill from one
//! peer, optionally reduced into the work buffer on arrival). Units to/from one peer are framed and matched in
//! list order; the engine writes whatever the kernel accepts, reads whatever has arrived, and sleeps in `poll(2)`
//! only when neither side can move. While asleep it wakes every [`TICK`] to check the collective's deadline and
//! whether another rank aborted the group.

use super::frame::{CallId, FrameKind, Header, HEADER_LEN, MAX_ABORT_PAYLOAD};
use crate::dtype::{divide_in_place, reduce_into};
use crate::{DType, ReduceOp};
use std::net::TcpStream;
use std::ops::Range;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

/// How often a blocked collective wakes up to check its deadline and the group's abort flag.
pub(crate) const TICK: Duration = Duration::from_millis(500);

/// Which buffer a unit reads from / writes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Buf {
    /// The collective's in/out buffer.
    Work,
    /// A read-only input (reduce_scatter's input).
    Input,
    /// Backend-owned scratch space.
    Scratch,
}

/// One frame to send.
#[derive(Debug, Clone)]
pub(crate) struct SendUnit {
    pub peer: usize,
    pub buf: Buf,
    pub range: Range<usize>,
    /// Index (in `Plan::recvs`) of a receive that must have completed before this can be sent.
    pub after_recv: Option<usize>,
}

/// What to do with a received frame.
#[derive(Debug, Clone)]
pub(crate) enum OnRecv {
    /// Nothing: the bytes are where they belong.
    Keep,
    /// `work[into] = op(work[into], scratch[range])`, then divide by `divide_by` (the last step of Avg).
    ReduceInto { into: Range<usize>, divide_by: Option<usize> },
}

/// One frame to receive.
#[derive(Debug, Clone)]
pub(crate) struct RecvUnit {
    pub peer: usize,
    pub buf: Buf,
    pub range: Range<usize>,
    pub on_recv: OnRecv,
}

/// Everything one collective sends and receives.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub call: CallId,
    pub sends: Vec<SendUnit>,
    pub recvs: Vec<RecvUnit>,
    /// Type and operator used by [`OnRecv::ReduceInto`].
    pub reduce: Option<(DType, ReduceOp)>,
}

impl Plan {
    pub(crate) fn new(call: CallId) -> Plan {
        Plan { call, sends: Vec::new(), recvs: Vec::new(), reduce: None }
    }
}

/// The buffers a plan's ranges refer to.
pub(crate) struct Buffers<'a> {
    pub work: &'a mut [u8],
    pub input: &'a [u8],
    pub scratch: &'a mut [u8],
}

/// Why a plan could not complete.
#[derive(Debug, Clone)]
pub(crate) enum Failure {
    /// The connection to `peer` closed or broke (the process exited, was killed, or aborted).
    PeerLost { peer: usize, detail: String },
    /// `peer` sent a frame of a different collective / size / type.
    Mismatch { peer: usize, detail: String },
    /// Nothing moved before the deadline; `peer` is the rank we were waiting for.
    Timeout { peer: Option<usize>, waited: Duration },
    /// A peer (`from`) aborted the group, blaming `blamed`.
    RemoteAbort { from: Option<usize>, blamed: Option<usize>, reason: String },
}

/// Deadline and abort check of one collective.
pub(crate) struct Watch<'a> {
    pub started: Instant,
    pub deadline: Instant,
    /// Called on every idle tick; `Some` aborts the plan (e.g. the store's abort key is set).
    pub check_abort: &'a dyn Fn() -> Option<Failure>,
}

struct Tx {
    queue: Vec<usize>,
    next: usize,
    active: bool,
    header: [u8; HEADER_LEN],
    written: usize,
}

struct Rx {
    queue: Vec<usize>,
    next: usize,
    header: [u8; HEADER_LEN],
    got: usize,
    checked: bool,
}

/// Runs `plan` to completion. `tx_mid_frame[p]` is kept true while a frame to `p` is partly written, so the abort
/// path knows whether an abort frame can still be inserted into that stream.
pub(crate) fn execute(
    plan: &Plan,
    bufs: &mut Buffers<'_>,
    peers: &[Option<TcpStream>],
    tx_mid_frame: &mut [bool],
    watch: &Watch<'_>,
) -> Result<(), Failure> {
    let world = peers.len();
    let mut run = Streams {
        tx: (0..world)
            .map(|_| Tx { queue: Vec::new(), next: 0, active: false, header: [0; HEADER_LEN], written: 0 })
            .collect(),
        rx: (0..world)
            .map(|_| Rx { queue: Vec::new(), next: 0, header: [0; HEADER_LEN], got: 0, checked: false })
            .collect(),
        recv_done: vec![false; plan.recvs.len()],
        left: plan.sends.len() + plan.recvs.len(),
    };
    for (i, s) in plan.sends.iter().enumerate() {
        run.tx[s.peer].queue.push(i);
    }
    for (i, r) in plan.recvs.iter().enumerate() {
        run.rx[r.peer].queue.push(i);
    }
    let fd = |p: usize| -> RawFd { peers[p].as_ref().expect("plans only name connected peers").as_raw_fd() };
    let mut pollfds: Vec<libc::pollfd> = Vec::with_capacity(world);
    while run.left > 0 {
        // Sends first: a just-completed receive may have unblocked a forward.
        let sent = run.send(plan, bufs, &fd, tx_mid_frame)?;
        let received = run.receive(plan, bufs, &fd)?;
        if run.left == 0 || sent || received {
            continue;
        }
        run.wait(plan, &fd, &mut pollfds, watch)?;
    }
    Ok(())
}

/// Where each stream of a running plan is: the frames queued per peer, how far each is written or read, which
/// receives are done (a send may wait on one), and how many units are left.
struct Streams {
    tx: Vec<Tx>,
    rx: Vec<Rx>,
    recv_done: Vec<bool>,
    left: usize,
}

impl Streams {
    /// Writes what each peer's socket takes now, in queue order (a send gated on a receive waits for it).
    /// Returns whether any byte went out.
    fn send(
        &mut self,
        plan: &Plan,
        bufs: &Buffers<'_>,
        fd: &dyn Fn(usize) -> RawFd,
        tx_mid_frame: &mut [bool],
    ) -> Result<bool, Failure> {
        let mut progressed = false;
        for (p, t) in self.tx.iter_mut().enumerate() {
            while let Some(&u) = t.queue.get(t.next) {
                let unit = &plan.sends[u];
                if !t.active {
                    if unit.after_recv.is_some_and(|d| !self.recv_done[d]) {
                        break;
                    }
                    t.header = Header::data(plan.call, t.next as u32, unit.range.len()).encode();
                    t.written = 0;
                    t.active = true;
                }
                let payload = match unit.buf {
                    Buf::Work => &bufs.work[unit.range.clone()],
                    Buf::Input => &bufs.input[unit.range.clone()],
                    Buf::Scratch => &bufs.scratch[unit.range.clone()],
                };
                let n = write_frame(fd(p), &t.header, payload, t.written)
                    .map_err(|e| Failure::PeerLost { peer: p, detail: describe_io(&e, "sending to") })?;
                t.written += n;
                progressed |= n > 0;
                if t.written == HEADER_LEN + payload.len() {
                    t.active = false;
                    t.next += 1;
                    self.left -= 1;
                    tx_mid_frame[p] = false;
                } else {
                    tx_mid_frame[p] = t.written > 0;
                    break;
                }
            }
        }
        Ok(progressed)
    }

    /// Reads what each peer's socket holds now, checks each frame's header once, and reduces a completed
    /// receive into the work buffer when the plan says so. Returns whether any byte came in.
    fn receive(&mut self, plan: &Plan, bufs: &mut Buffers<'_>, fd: &dyn Fn(usize) -> RawFd) -> Result<bool, Failure> {
        let mut progressed = false;
        for (p, r) in self.rx.iter_mut().enumerate() {
            while let Some(&u) = r.queue.get(r.next) {
                let unit = &plan.recvs[u];
                let dest = match unit.buf {
                    Buf::Work => &mut bufs.work[unit.range.clone()],
                    Buf::Scratch => &mut bufs.scratch[unit.range.clone()],
                    Buf::Input => unreachable!("receives never target the read-only input"),
                };
                let want = HEADER_LEN + dest.len();
                let n = read_frame(fd(p), &mut r.header, r.got, dest)
                    .map_err(|e| Failure::PeerLost { peer: p, detail: describe_io(&e, "receiving from") })?;
                r.got += n;
                progressed |= n > 0;
                if !r.checked && r.got >= HEADER_LEN {
                    r.checked = true;
                    check_header(plan.call, p, r.next, &r.header, dest, r.got - HEADER_LEN, fd(p))?;
                }
                if r.got < want {
                    break;
                }
                if let OnRecv::ReduceInto { into, divide_by } = &unit.on_recv {
                    let (dtype, op) = plan.reduce.expect("a reducing plan names its dtype and operator");
                    let src = match unit.buf {
                        Buf::Scratch => &bufs.scratch[unit.range.clone()],
                        _ => unreachable!("reductions read scratch"),
                    };
                    reduce_into(dtype, op, &mut bufs.work[into.clone()], src);
                    if let Some(n) = divide_by {
                        divide_in_place(dtype, &mut bufs.work[into.clone()], *n);
                    }
                }
                self.recv_done[u] = true;
                r.next += 1;
                r.got = 0;
                r.checked = false;
                self.left -= 1;
            }
        }
        Ok(progressed)
    }

    /// Nothing moved: sleeps until a socket is ready, waking on ticks for the deadline and the abort check.
    fn wait(
        &self,
        plan: &Plan,
        fd: &dyn Fn(usize) -> RawFd,
        pollfds: &mut Vec<libc::pollfd>,
        watch: &Watch<'_>,
    ) -> Result<(), Failure> {
        let world = self.tx.len();
        pollfds.clear();
        for p in 0..world {
            let mut events: libc::c_short = 0;
            if let Some(&u) = self.tx[p].queue.get(self.tx[p].next) {
                if self.tx[p].active || plan.sends[u].after_recv.is_none_or(|d| self.recv_done[d]) {
                    events |= libc::POLLOUT;
                }
            }
            if self.rx[p].next < self.rx[p].queue.len() {
                events |= libc::POLLIN;
            }
            if events != 0 {
                pollfds.push(libc::pollfd { fd: fd(p), events, revents: 0 });
            }
        }
        if pollfds.is_empty() {
            // Unreachable for well-formed plans: every gated send waits on a receive that is still pending.
            return Err(Failure::RemoteAbort {
                from: None,
                blamed: None,
                reason: "internal error: collective plan stalled with nothing to wait for".into(),
            });
        }
        let now = Instant::now();
        if now >= watch.deadline {
            let peer = (0..world)
                .find(|&p| self.rx[p].next < self.rx[p].queue.len())
                .or_else(|| (0..world).find(|&p| self.tx[p].next < self.tx[p].queue.len()));
            return Err(Failure::Timeout { peer, waited: now - watch.started });
        }
        let wait = TICK.min(watch.deadline - now);
        // SAFETY: `pollfds` is a live, correctly sized array of pollfd for the duration of the call.
        let rc = unsafe {
            libc::poll(pollfds.as_mut_ptr(), pollfds.len() as libc::nfds_t, wait.as_millis().max(1) as libc::c_int)
        };
        if rc == 0 {
            if let Some(f) = (watch.check_abort)() {
                return Err(f);
            }
        }
        Ok(())
    }
}

/// Validates a received header against what this rank expects; turns abort frames into failures.
fn check_header(
    call: CallId,
    peer: usize,
    unit: usize,
    raw: &[u8; HEADER_LEN],
    dest: &[u8],
    payload_read: usize,
    fd: RawFd,
) -> Result<(), Failure> {
    let h = Header::decode(raw).map_err(|detail| Failure::Mismatch { peer, detail })?;
    if h.kind == FrameKind::Abort {
        // The reason text may already sit (partly) in `dest` because header and payload are read together.
        let len = (h.len as usize).min(MAX_ABORT_PAYLOAD);
        let mut reason = dest[..payload_read.min(len).min(dest.len())].to_vec();
        read_rest_blocking(fd, &mut reason, len, Duration::from_secs(2));
        let blamed = usize::try_from(h.call.size).ok().filter(|&b| h.call.size != u64::MAX && b < 1 << 20);
        return Err(Failure::RemoteAbort {
            from: Some(peer),
            blamed,
            reason: String::from_utf8_lossy(&reason).into_owned(),
        });
    }
    let want = Header::data(call, unit as u32, dest.len());
    if h != want {
        return Err(Failure::Mismatch {
            peer,
            detail: format!(
                "this rank is in {} and expected frame {} of {} bytes, but rank {peer} sent frame {} of {} bytes of {}; \
                 every rank must call the same collectives in the same order with the same sizes",
                call, unit, want.len, h.unit, h.len, h.call
            ),
        });
    }
    Ok(())
}

fn read_rest_blocking(fd: RawFd, out: &mut Vec<u8>, len: usize, limit: Duration) {
    let end = Instant::now() + limit;
    let mut chunk = [0u8; 512];
    while out.len() < len && Instant::now() < end {
        let want = (len - out.len()).min(chunk.len());
        // SAFETY: reading into a live stack buffer of at least `want` bytes.
        let n = unsafe { libc::recv(fd, chunk.as_mut_ptr().cast(), want, libc::MSG_DONTWAIT) };
        if n > 0 {
            out.extend_from_slice(&chunk[..n as usize]);
        } else if n == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock {
            break;
        } else {
            let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut p, 1, 50) };
        }
    }
}

fn describe_io(e: &std::io::Error, verb: &str) -> String {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "connection closed (process exited, was killed, or aborted)".to_string(),
        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe => {
            format!("connection reset while {verb} it (process exited, was killed, or aborted): {e}")
        }
        _ => format!("socket error while {verb} it: {e}"),
    }
}

/// Writes as much of `header[written..] ++ payload[..]` as the socket takes without blocking; returns the count.
pub(crate) fn write_frame(
    fd: RawFd,
    header: &[u8; HEADER_LEN],
    payload: &[u8],
    written: usize,
) -> std::io::Result<usize> {
    let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 2];
    let mut n_iov = 0;
    if written < HEADER_LEN {
        iov[0] = libc::iovec { iov_base: header[written..].as_ptr() as *mut _, iov_len: HEADER_LEN - written };
        n_iov = 1;
    }
    let off = written.saturating_sub(HEADER_LEN);
    if off < payload.len() {
        iov[n_iov] = libc::iovec { iov_base: payload[off..].as_ptr() as *mut _, iov_len: payload.len() - off };
        n_iov += 1;
    }
    if n_iov == 0 {
        return Ok(0);
    }
    loop {
        // SAFETY: a zeroed msghdr pointing at `n_iov` iovecs over live buffers; sendmsg only reads them.
        let rc = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = n_iov as _;
            // MSG_NOSIGNAL: a dead peer must become an error, never a SIGPIPE that kills this process.
            libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
        };
        if rc >= 0 {
            return Ok(rc as usize);
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return Ok(0),
            _ => return Err(e),
        }
    }
}

/// Reads what has arrived of `header[got..] ++ dest` without blocking; returns the count. A closed connection
/// before the frame is complete is `UnexpectedEof`.
pub(crate) fn read_frame(
    fd: RawFd,
    header: &mut [u8; HEADER_LEN],
    got: usize,
    dest: &mut [u8],
) -> std::io::Result<usize> {
    let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 2];
    let mut n_iov = 0;
    if got < HEADER_LEN {
        iov[0] = libc::iovec { iov_base: header[got..].as_mut_ptr().cast(), iov_len: HEADER_LEN - got };
        n_iov = 1;
    }
    let off = got.saturating_sub(HEADER_LEN);
    if off < dest.len() {
        iov[n_iov] = libc::iovec { iov_base: dest[off..].as_mut_ptr().cast(), iov_len: dest.len() - off };
        n_iov += 1;
    }
    if n_iov == 0 {
        return Ok(0);
    }
    loop {
        // SAFETY: a zeroed msghdr pointing at `n_iov` iovecs over live, exclusively borrowed buffers.
        let rc = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = n_iov as _;
            libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT)
        };
        if rc > 0 {
            return Ok(rc as usize);
        }
        if rc == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return Ok(0),
            _ => return Err(e),
        }
    }
}
