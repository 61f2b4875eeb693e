//! The connection mesh: one TCP connection between every pair of ranks, found through the store.
//!
//! Each rank listens on `advertise_host:0` (the address peers can reach it at: loopback on one machine, the IP of
//! the interface that routes to the store across machines), publishes `host:port` under `{prefix}addr/{rank}`,
//! then connects to every *lower* rank and accepts every *higher* one. Rank j's connects only need lower ranks to
//! be accepting, and rank 0 only accepts, so the order cannot deadlock.
//!
//! Handshake (version 2): the run token never goes on the wire; both sides prove they know it with an
//! HMAC-SHA256 over both sides' fresh nonces (RFC 2104, [`RunToken::prove`]), as the store's handshake does.
//! 1. Client → server: magic `b"ACLH"`, version u16, rank u32, world size u32, a fresh 16-byte client nonce `cn`,
//!    group tag length u16 + bytes.
//! 2. Server → client: status byte and its rank u32; with status `4` (challenge) also a fresh server nonce `sn`
//!    and the server's proof `HMAC(token, "accel-mesh v2 server" ‖ sn ‖ cn)`; `3` refuses (another world size or
//!    group, or not this protocol).
//! 3. Client → server: its proof `HMAC(token, "accel-mesh v2 client" ‖ sn ‖ cn)` — sent even when the server's
//!    proof was wrong, so both sides fail at once.
//! 4. Server → client: status `1` (accepted) or `2` (token refused) and its rank u32.
//!
//! A connection with a wrong token is refused, closed and logged; the listener keeps waiting for the real peer. A
//! listener on a peer's published address learns only MACs over nonces it cannot reuse.

use crate::store::Store;
use crate::token::{self, RunToken, MAC_LEN, NONCE_LEN};
use crate::{DdpError, Result};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

const HELLO_MAGIC: [u8; 4] = *b"ACLH";
const VERSION: u16 = 2;
const ACCEPTED: u8 = 1;
const TOKEN_REFUSED: u8 = 2;
const OTHER_REFUSED: u8 = 3;
const CHALLENGE: u8 = 4;
const SERVER_LABEL: &[u8] = b"accel-mesh v2 server";
const CLIENT_LABEL: &[u8] = b"accel-mesh v2 client";
/// How long one handshake may take once TCP is connected (a silent client must not stall the listener forever).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_TAG: usize = 1024;

/// Socket tuning for mesh connections.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SocketTuning {
    /// SO_SNDBUF / SO_RCVBUF in bytes; `None` leaves Linux's autotuning on.
    pub buffer_bytes: Option<usize>,
}

/// Everything needed to build one group's mesh.
pub(crate) struct MeshSpec<'a> {
    pub store: &'a dyn Store,
    /// Store key prefix of this group's backend keys (ends with `/`).
    pub prefix: &'a str,
    pub rank: usize,
    pub world_size: usize,
    pub token: RunToken,
    /// Distinguishes groups formed at the same time (e.g. `world`, `sub3`).
    pub group_tag: &'a str,
    pub advertise_host: &'a str,
    pub timeout: Duration,
    pub tuning: SocketTuning,
}

/// Connects the full mesh; returns the connections indexed by peer rank (`None` at our own rank).
pub(crate) fn connect_mesh(spec: &MeshSpec<'_>) -> Result<Vec<Option<TcpStream>>> {
    let mut peers: Vec<Option<TcpStream>> = (0..spec.world_size).map(|_| None).collect();
    if spec.world_size <= 1 {
        return Ok(peers);
    }
    let bind = format!("{}:0", spec.advertise_host);
    let listener = TcpListener::bind(&bind).map_err(|source| DdpError::Bind { addr: bind.clone(), source })?;
    let local = listener.local_addr().map_err(|e| DdpError::io("reading the CPU backend listener address", e))?;
    let advertised = format!("{}:{}", spec.advertise_host, local.port());
    spec.store.set(&format!("{}addr/{}", spec.prefix, spec.rank), advertised.as_bytes())?;
    tracing::debug!(rank = spec.rank, addr = %advertised, group = spec.group_tag, "cpu backend listening");

    let deadline = Instant::now() + spec.timeout;
    for (peer, slot) in peers.iter_mut().enumerate().take(spec.rank) {
        let raw = spec.store.get(&format!("{}addr/{}", spec.prefix, peer))?;
        let addr = String::from_utf8_lossy(&raw).into_owned();
        *slot = Some(connect_to(spec, peer, &addr, deadline)?);
    }
    accept_higher(spec, &listener, &mut peers, deadline)?;
    for s in peers.iter().flatten() {
        tune(s, spec.tuning)?;
    }
    Ok(peers)
}

fn connect_to(spec: &MeshSpec<'_>, peer: usize, addr: &str, deadline: Instant) -> Result<TcpStream> {
    let start = Instant::now();
    let target: SocketAddr = addr
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| DdpError::Protocol(format!("rank {peer} published an unusable address {addr:?}")))?;
    let mut last_err;
    loop {
        match TcpStream::connect_timeout(&target, Duration::from_secs(5)) {
            Ok(mut s) => {
                s.set_nodelay(true).map_err(|e| DdpError::io("setting TCP_NODELAY", e))?;
                s.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(|e| DdpError::io("setting a read timeout", e))?;
                let client_nonce = token::nonce()?;
                let mut hello = Vec::with_capacity(32 + spec.group_tag.len());
                hello.extend_from_slice(&HELLO_MAGIC);
                hello.extend_from_slice(&VERSION.to_le_bytes());
                hello.extend_from_slice(&(spec.rank as u32).to_le_bytes());
                hello.extend_from_slice(&(spec.world_size as u32).to_le_bytes());
                hello.extend_from_slice(&client_nonce);
                hello.extend_from_slice(&(spec.group_tag.len() as u16).to_le_bytes());
                hello.extend_from_slice(spec.group_tag.as_bytes());
                let io = |what: &str| {
                    let what = format!("{what} rank {peer} at {addr}");
                    move |e| DdpError::io(what, e)
                };
                s.write_all(&hello).map_err(io("sending the handshake to"))?;
                let mut reply = [0u8; 5];
                s.read_exact(&mut reply).map_err(io("reading the handshake reply of"))?;
                let their_rank = u32::from_le_bytes(reply[1..5].try_into().expect("4 bytes")) as usize;
                if reply[0] != CHALLENGE {
                    return Err(DdpError::Protocol(format!(
                        "rank {peer} at {addr} refused our handshake (different world size or group, or another \
                         accel-rs version; see its log)"
                    )));
                }
                let mut challenge = [0u8; NONCE_LEN + MAC_LEN];
                s.read_exact(&mut challenge).map_err(io("reading the challenge of"))?;
                let (server_nonce, server_proof) = challenge.split_at(NONCE_LEN);
                let server_ok = spec.token.verify(SERVER_LABEL, server_nonce, &client_nonce, server_proof);
                // Our proof goes out even when theirs is wrong: the peer then fails at once instead of timing out.
                s.write_all(&spec.token.prove(CLIENT_LABEL, server_nonce, &client_nonce))
                    .map_err(io("sending our proof to"))?;
                if !server_ok {
                    return Err(DdpError::TokenRejected { peer: format!("rank {peer} at {addr}") });
                }
                s.read_exact(&mut reply).map_err(io("reading the handshake result of"))?;
                return match reply[0] {
                    ACCEPTED if their_rank == peer => {
                        s.set_read_timeout(None).map_err(|e| DdpError::io("clearing a read timeout", e))?;
                        Ok(s)
                    }
                    ACCEPTED => Err(DdpError::Protocol(format!(
                        "{addr} was published as rank {peer} but answered as rank {their_rank} (two jobs sharing a store?)"
                    ))),
                    TOKEN_REFUSED => Err(DdpError::TokenRejected { peer: format!("rank {peer} at {addr}") }),
                    _ => Err(DdpError::Protocol(format!(
                        "rank {peer} at {addr} refused our handshake (different world size or group; see its log)"
                    ))),
                };
            }
            Err(e) => last_err = e.to_string(),
        }
        if Instant::now() >= deadline {
            return Err(DdpError::Connect { addr: addr.to_string(), waited: start.elapsed(), reason: last_err });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Environment variable: seconds between rank 0's "waiting for ranks ..." lines while it forms a CPU group
/// (default 15).
pub(crate) const PROGRESS_INTERVAL_ENV: &str = "ACCEL_PROGRESS_INTERVAL";

fn progress_interval() -> Duration {
    std::env::var(PROGRESS_INTERVAL_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map_or(Duration::from_secs(15), Duration::from_secs_f64)
}

fn accept_higher(
    spec: &MeshSpec<'_>,
    listener: &TcpListener,
    peers: &mut [Option<TcpStream>],
    deadline: Instant,
) -> Result<()> {
    let start = Instant::now();
    listener.set_nonblocking(true).map_err(|e| DdpError::io("making the listener non-blocking", e))?;
    let missing = |peers: &[Option<TcpStream>]| -> Vec<usize> {
        (spec.rank + 1..spec.world_size).filter(|&r| peers[r].is_none()).collect()
    };
    // Rank 0 accepts every other rank, so it alone can say who is missing; it does, so that nobody stares at a
    // silent terminal until the timeout.
    let progress = (spec.rank == 0).then(progress_interval);
    let mut last_progress = Instant::now();
    loop {
        let waiting = missing(peers);
        if waiting.is_empty() {
            return Ok(());
        }
        if progress.is_some_and(|every| last_progress.elapsed() >= every) {
            last_progress = Instant::now();
            let ranks = waiting.iter().map(usize::to_string).collect::<Vec<_>>().join(", ");
            let line = format!(
                "rank 0: waiting for ranks {ranks} ({}/{} connected) at {} ({})",
                spec.world_size - waiting.len(),
                spec.world_size,
                listener.local_addr().map_or_else(|_| "?".into(), |a| a.to_string()),
                spec.group_tag
            );
            // On the console once (tracing may be off; a subscriber would print it a second time).
            eprintln!("{line}");
        }
        match listener.accept() {
            Ok((stream, from)) => match serve_handshake(spec, stream, from) {
                Ok((rank, stream)) => {
                    if rank <= spec.rank || rank >= spec.world_size || peers[rank].is_some() {
                        tracing::warn!(%from, rank, "cpu backend: unexpected connection for rank {rank}; ignored");
                    } else {
                        peers[rank] = Some(stream);
                    }
                }
                Err(reason) => tracing::warn!(%from, "cpu backend: refused a connection: {reason}"),
            },
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let not_connected = |reason: String| DdpError::Collective {
                    op: "init",
                    seq: 0,
                    rank: spec.rank,
                    world_size: spec.world_size,
                    peer: waiting.first().copied(),
                    reason,
                };
                if let Some(refused) = refused_peer(spec.store) {
                    return Err(not_connected(format!(
                        "ranks {waiting:?} did not connect, and the store refused a peer ({refused}), which cannot \
                         join this job; every process must use the same ACCEL_RUN_TOKEN and accel-rs build"
                    )));
                }
                if Instant::now() >= deadline {
                    return Err(not_connected(format!(
                        "ranks {waiting:?} did not connect within {:.0} s (did they start? same run token?)",
                        start.elapsed().as_secs_f64()
                    )));
                }
                wait_readable(listener.as_raw_fd(), Duration::from_millis(100));
            }
            Err(e) => return Err(DdpError::io("accepting a peer connection", e)),
        }
    }
}

/// What the store recorded about a peer it turned away ([`crate::store::REFUSED_PEER_KEY`]), if any.
fn refused_peer(store: &dyn Store) -> Option<String> {
    let key = crate::store::REFUSED_PEER_KEY;
    store.check(&[key]).ok().filter(|&set| set)?;
    store.get(key).ok().map(|v| String::from_utf8_lossy(&v).into_owned())
}

/// Reads and checks a client's hello; answers it. Returns the client's rank.
fn serve_handshake(
    spec: &MeshSpec<'_>,
    mut s: TcpStream,
    from: SocketAddr,
) -> std::result::Result<(usize, TcpStream), String> {
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(|e| e.to_string())?;
    let mut fixed = [0u8; 4 + 2 + 4 + 4 + NONCE_LEN + 2];
    s.read_exact(&mut fixed).map_err(|e| format!("reading the handshake from {from}: {e}"))?;
    let reply = |s: &mut TcpStream, code: u8| {
        let mut r = [0u8; 5];
        r[0] = code;
        r[1..5].copy_from_slice(&(spec.rank as u32).to_le_bytes());
        let _ = s.write_all(&r);
    };
    if fixed[0..4] != HELLO_MAGIC || u16::from_le_bytes([fixed[4], fixed[5]]) != VERSION {
        reply(&mut s, OTHER_REFUSED);
        return Err(format!("{from} is not an accel-rs CPU backend peer of this version"));
    }
    let rank = u32::from_le_bytes(fixed[6..10].try_into().expect("4 bytes")) as usize;
    let world = u32::from_le_bytes(fixed[10..14].try_into().expect("4 bytes")) as usize;
    let client_nonce = &fixed[14..14 + NONCE_LEN];
    let tag_len = u16::from_le_bytes([fixed[30], fixed[31]]) as usize;
    if tag_len > MAX_TAG {
        reply(&mut s, OTHER_REFUSED);
        return Err(format!("{from}: group tag of {tag_len} bytes is too long"));
    }
    let mut tag = vec![0u8; tag_len];
    s.read_exact(&mut tag).map_err(|e| format!("reading the handshake from {from}: {e}"))?;
    if world != spec.world_size || tag != spec.group_tag.as_bytes() {
        reply(&mut s, OTHER_REFUSED);
        return Err(format!(
            "{from} (rank {rank}) belongs to group {:?} of {world} ranks, we are {:?} of {}",
            String::from_utf8_lossy(&tag),
            spec.group_tag,
            spec.world_size
        ));
    }
    let server_nonce = token::nonce().map_err(|e| e.to_string())?;
    let mut challenge = Vec::with_capacity(5 + NONCE_LEN + MAC_LEN);
    challenge.push(CHALLENGE);
    challenge.extend_from_slice(&(spec.rank as u32).to_le_bytes());
    challenge.extend_from_slice(&server_nonce);
    challenge.extend_from_slice(&spec.token.prove(SERVER_LABEL, &server_nonce, client_nonce));
    s.write_all(&challenge).map_err(|e| format!("sending the challenge to {from}: {e}"))?;
    let mut proof = [0u8; MAC_LEN];
    s.read_exact(&mut proof).map_err(|e| format!("reading the proof of {from}: {e}"))?;
    if !spec.token.verify(CLIENT_LABEL, &server_nonce, client_nonce, &proof) {
        reply(&mut s, TOKEN_REFUSED);
        return Err(format!("{from} (claiming rank {rank}): run token mismatch"));
    }
    reply(&mut s, ACCEPTED);
    s.set_read_timeout(None).map_err(|e| e.to_string())?;
    Ok((rank, s))
}

fn tune(s: &TcpStream, tuning: SocketTuning) -> Result<()> {
    s.set_nodelay(true).map_err(|e| DdpError::io("setting TCP_NODELAY", e))?;
    if let Some(bytes) = tuning.buffer_bytes {
        let v = bytes.min(i32::MAX as usize) as libc::c_int;
        for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
            // SAFETY: setsockopt on a valid fd with a pointer to a live c_int of the size we pass.
            let rc = unsafe {
                libc::setsockopt(
                    s.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&v as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if rc != 0 {
                return Err(DdpError::io("setting socket buffer sizes", std::io::Error::last_os_error()));
            }
        }
    }
    s.set_nonblocking(true).map_err(|e| DdpError::io("making a peer socket non-blocking", e))
}

fn wait_readable(fd: std::os::fd::RawFd, timeout: Duration) {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut p, 1, timeout.as_millis() as libc::c_int) };
}

/// Environment variable: the address this rank's CPU backend listens on and advertises (default: the local IP
/// of the store connection — loopback on one machine — or 127.0.0.1 for groups built on an in-process store).
pub const ADVERTISE_HOST_ENV: &str = "ACCEL_CPU_HOST";
