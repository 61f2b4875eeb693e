//! The TCP store server (like PyTorch's `TCPStore` master): one accept thread plus one thread per client
//! connection. Blocking `get`/`wait` park that connection's thread on a condition variable until the key is set,
//! the client's timeout passes, or the server stops. A job has at most a few hundred clients, so a thread each is
//! simpler than an event loop and costs little.

use super::protocol::{self, ErrorKind, Request, Response};
use crate::sync;
use crate::token::{self, RunToken, MAC_LEN};
use crate::{DdpError, Result};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a freshly accepted peer has to send its hello before it is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// A running store server. Serves until dropped; dropping it stops the accept thread, closes every client
/// connection and wakes every blocked `get`/`wait` (their clients get an error).
///
/// ```no_run
/// use ddp_core::{RunToken, TcpStore, TcpStoreServer, Store};
/// use std::time::Duration;
/// let token = RunToken::generate()?;
/// let server = TcpStoreServer::bind("127.0.0.1:0", token)?;          // port 0: a free port
/// let store = TcpStore::connect(&server.local_addr().to_string(), token, Duration::from_secs(30))?;
/// store.set("hello", b"world")?;
/// # Ok::<(), ddp_core::DdpError>(())
/// ```
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    accept_thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for TcpStoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStoreServer").field("local_addr", &self.local_addr).finish()
    }
}

struct Shared {
    token: RunToken,
    data: Mutex<Data>,
    changed: Condvar,
    /// Set (under the `data` lock, so no waiter misses it) when the server stops.
    stopping: AtomicBool,
    /// Clones of live client sockets, to shut them down when the server stops.
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn_id: AtomicU64,
    /// Peers refused for proving another run token or speaking another protocol version, oldest first (at most
    /// [`MAX_REFUSED`]): a store host's launcher polls it to fail at once instead of waiting for a peer that
    /// will never get in.
    refused: Mutex<Vec<RefusedPeer>>,
}

/// Key the server sets to `"{peer}: {reason}"` when it refuses the first peer for proving another run token or
/// speaking another protocol version (see [`TcpStoreServer::refused_peers`]).
pub const REFUSED_PEER_KEY: &str = "accel/store/refused_peer";

/// How many refused peers [`TcpStoreServer::refused_peers`] remembers.
const MAX_REFUSED: usize = 64;

/// A peer the store refused during the handshake (see [`TcpStoreServer::refused_peers`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedPeer {
    /// The peer's address (`ip:port`).
    pub peer: String,
    /// Why, in words: "run token mismatch" or "protocol version N, we speak M".
    pub reason: String,
}

#[derive(Default)]
struct Data {
    map: HashMap<String, Vec<u8>>,
}

impl TcpStoreServer {
    /// Binds `addr` (`"host:port"`; port 0 picks a free port, see [`Self::local_addr`]) and starts serving.
    /// Every client must present `token` before any request is served.
    ///
    /// Errors: [`DdpError::Bind`] naming `addr` when the address is in use or not local.
    pub fn bind(addr: &str, token: RunToken) -> Result<Self> {
        let listener = TcpListener::bind(addr).map_err(|source| DdpError::Bind { addr: addr.to_string(), source })?;
        let local_addr = listener.local_addr().map_err(|e| DdpError::io(format!("store server on {addr}"), e))?;
        let shared = Arc::new(Shared {
            token,
            data: Mutex::new(Data::default()),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn_id: AtomicU64::new(0),
            refused: Mutex::new(Vec::new()),
        });
        let accept_shared = shared.clone();
        let accept_thread = std::thread::Builder::new()
            .name(format!("store-accept-{}", local_addr.port()))
            .spawn(move || accept_loop(listener, accept_shared))
            .map_err(|e| DdpError::io("starting the store server thread", e))?;
        tracing::debug!(%local_addr, "store server listening");
        Ok(TcpStoreServer { local_addr, shared, accept_thread: Some(accept_thread) })
    }

    /// The bound address (with the actual port when bound with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.local_addr.port()
    }

    /// Number of keys currently stored.
    pub fn num_keys(&self) -> usize {
        sync::lock(&self.shared.data).map.len()
    }

    /// Number of client connections currently open (after a successful handshake).
    pub fn num_connections(&self) -> usize {
        sync::lock(&self.shared.conns).len()
    }

    /// Peers refused so far because they proved another run token or speak another protocol version (oldest
    /// first, the first 64 kept). Peers that are not store clients at all (port scanners, the server's own
    /// wake-up connection) are not recorded.
    pub fn refused_peers(&self) -> Vec<RefusedPeer> {
        sync::lock(&self.shared.refused).clone()
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        {
            let _data = sync::lock(&self.shared.data);
            self.shared.stopping.store(true, Ordering::SeqCst);
        }
        self.shared.changed.notify_all();
        // Wake the accept thread out of `accept()` by connecting to ourselves.
        let wake = wake_addr(self.local_addr);
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
        }
        for (_, conn) in sync::lock(&self.shared.conns).drain() {
            let _ = conn.shutdown(Shutdown::Both);
        }
    }
}

/// The address to connect to in order to reach a listener bound to `addr` (wildcards become loopback).
fn wake_addr(addr: SocketAddr) -> SocketAddr {
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, addr.port())
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for stream in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        match stream {
            Ok(stream) => {
                let shared = shared.clone();
                let spawned = std::thread::Builder::new()
                    .name("store-conn".into())
                    .spawn(move || serve_connection(stream, shared));
                if let Err(e) = spawned {
                    tracing::warn!("store server: cannot start a connection thread: {e}");
                }
            }
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!("store server: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn serve_connection(mut stream: TcpStream, shared: Arc<Shared>) {
    let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
    if !handshake(&mut stream, &shared, &peer) {
        return;
    }
    let id = shared.next_conn_id.fetch_add(1, Ordering::Relaxed);
    match stream.try_clone() {
        Ok(clone) => {
            sync::lock(&shared.conns).insert(id, clone);
        }
        Err(e) => {
            tracing::warn!("store server: cannot track connection from {peer}: {e}");
            return;
        }
    }
    // The server may have begun stopping before we registered; don't serve in that case.
    if !shared.stopping.load(Ordering::SeqCst) {
        if let Err(e) = request_loop(&mut stream, &shared) {
            if !shared.stopping.load(Ordering::SeqCst) {
                tracing::debug!("store server: connection from {peer} closed: {e}");
            }
        }
    }
    sync::lock(&shared.conns).remove(&id);
    let _ = stream.shutdown(Shutdown::Both);
}

/// Runs the server side of the challenge-response handshake (see `protocol.rs`). Returns whether to serve the
/// connection: false for a peer that is not a store client, speaks another version, or proves a different run
/// token (refused at once, logged as a run token mismatch).
fn handshake(stream: &mut TcpStream, shared: &Shared, peer: &str) -> bool {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let mut hello = [0u8; protocol::HELLO_LEN];
    if stream.read_exact(&mut hello).is_err() {
        return false; // includes the accept thread's own wake-up connection
    }
    if hello[..4] != protocol::MAGIC {
        tracing::warn!("store server: refused {peer}: not a store client (bad magic)");
        return false;
    }
    let version = u16::from_le_bytes([hello[4], hello[5]]);
    if version != protocol::VERSION {
        tracing::warn!("store server: refused {peer}: protocol version {version}, we speak {}", protocol::VERSION);
        record_refused(shared, peer, format!("protocol version {version}, we speak {}", protocol::VERSION));
        let mut answer = protocol::SERVER_MAGIC.to_vec();
        answer.push(protocol::HELLO_BAD_VERSION);
        let _ = stream.write_all(&answer);
        return false;
    }
    let client_nonce = &hello[8..];
    let server_nonce = match token::nonce() {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!("store server: refused {peer}: {e}");
            return false;
        }
    };
    if stream.write_all(&protocol::encode_challenge(&shared.token, &server_nonce, client_nonce)).is_err() {
        return false;
    }
    let mut proof = [0u8; MAC_LEN];
    if let Err(e) = stream.read_exact(&mut proof) {
        tracing::warn!("store server: {peer} left during the handshake: {e}");
        return false;
    }
    if !shared.token.verify(protocol::CLIENT_LABEL, &server_nonce, client_nonce, &proof) {
        // Info: the refusal is recorded (`refused_peers`) and the launcher's rendezvous error names it.
        tracing::info!("store server: refused {peer}: run token mismatch");
        record_refused(shared, peer, "run token mismatch".into());
        let _ = stream.write_all(&[protocol::HELLO_BAD_TOKEN]);
        return false;
    }
    if stream.write_all(&[protocol::HELLO_OK]).is_err() {
        return false;
    }
    let _ = stream.set_read_timeout(None);
    true
}

fn record_refused(shared: &Shared, peer: &str, reason: String) {
    // Also under a key, so every rank waiting on this store (not only the process hosting it) can tell that a
    // peer was turned away for good and fail at once instead of waiting for it until the timeout.
    {
        let mut data = sync::lock(&shared.data);
        data.map.entry(REFUSED_PEER_KEY.to_string()).or_insert_with(|| format!("{peer}: {reason}").into_bytes());
        shared.changed.notify_all();
    }
    let mut refused = sync::lock(&shared.refused);
    if refused.len() < MAX_REFUSED {
        refused.push(RefusedPeer { peer: peer.to_string(), reason });
    }
}

fn request_loop(stream: &mut TcpStream, shared: &Shared) -> std::io::Result<()> {
    loop {
        let body = match protocol::read_frame(stream) {
            Ok(Some(b)) => b,
            Ok(None) => return Ok(()),
            Err(e) => {
                if e.kind() == std::io::ErrorKind::InvalidData {
                    // Oversized frame: tell the client why before closing.
                    let resp = Response::Error { kind: ErrorKind::Protocol, message: e.to_string() };
                    if let Ok(frame) = resp.encode_frame() {
                        let _ = protocol::write_frame(stream, &frame);
                    }
                }
                return Err(e);
            }
        };
        let (resp, keep_open) = match Request::decode(&body) {
            Ok(req) => (handle(shared, req), true),
            Err(e) => (Response::Error { kind: ErrorKind::Protocol, message: e.to_string() }, false),
        };
        let frame = resp.encode_frame().unwrap_or_else(|e| {
            Response::Error { kind: ErrorKind::Protocol, message: e.to_string() }
                .encode_frame()
                .expect("short error frames always encode")
        });
        protocol::write_frame(stream, &frame)?;
        if !keep_open {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed request"));
        }
    }
}

fn handle(shared: &Shared, req: Request<'_>) -> Response {
    match req {
        Request::Set { key, value } => {
            sync::lock(&shared.data).map.insert(key.to_string(), value.to_vec());
            shared.changed.notify_all();
            Response::Ok
        }
        Request::Get { key, timeout } => match wait_for(shared, &[key], timeout) {
            Ok(data) => Response::Value(data.map.get(key).cloned().unwrap_or_default()),
            Err(resp) => resp,
        },
        Request::Add { key, delta } => {
            let mut data = sync::lock(&shared.data);
            let current = match data.map.get(key) {
                None => Some(0i64),
                Some(v) => std::str::from_utf8(v).ok().and_then(|s| s.trim().parse::<i64>().ok()),
            };
            let Some(current) = current else {
                return Response::Error {
                    kind: ErrorKind::InvalidArgument,
                    message: format!("store add: key {key:?} does not hold a decimal counter"),
                };
            };
            let Some(new) = current.checked_add(delta) else {
                return Response::Error {
                    kind: ErrorKind::InvalidArgument,
                    message: format!("store add: counter {key:?} would overflow ({current} + {delta})"),
                };
            };
            data.map.insert(key.to_string(), new.to_string().into_bytes());
            drop(data);
            shared.changed.notify_all();
            Response::Int(new)
        }
        Request::CompareSet { key, expected, desired } => {
            let mut data = sync::lock(&shared.data);
            let matches = match data.map.get(key) {
                None => expected.is_empty(),
                Some(v) => v == expected,
            };
            if matches {
                data.map.insert(key.to_string(), desired.to_vec());
                drop(data);
                shared.changed.notify_all();
                Response::Value(desired.to_vec())
            } else {
                Response::Value(data.map.get(key).cloned().unwrap_or_default())
            }
        }
        Request::Wait { keys, timeout } => match wait_for(shared, &keys, timeout) {
            Ok(_) => Response::Ok,
            Err(resp) => resp,
        },
        Request::Check { keys } => {
            let data = sync::lock(&shared.data);
            Response::Bool(keys.iter().all(|k| data.map.contains_key(*k)))
        }
        Request::Delete { key } => Response::Bool(sync::lock(&shared.data).map.remove(key).is_some()),
        Request::NumKeys => Response::Int(sync::lock(&shared.data).map.len() as i64),
    }
}

/// Blocks until every key exists (returning the locked data), or answers Timeout / ShuttingDown.
fn wait_for<'a>(
    shared: &'a Shared,
    keys: &[&str],
    timeout: Duration,
) -> std::result::Result<MutexGuard<'a, Data>, Response> {
    let start = Instant::now();
    let mut data = sync::lock(&shared.data);
    loop {
        if shared.stopping.load(Ordering::SeqCst) {
            return Err(Response::Error {
                kind: ErrorKind::ShuttingDown,
                message: "the store server is shutting down".into(),
            });
        }
        let missing: Vec<String> = keys.iter().filter(|k| !data.map.contains_key(**k)).map(|k| k.to_string()).collect();
        if missing.is_empty() {
            return Ok(data);
        }
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(Response::Timeout { waited, missing });
        }
        data = sync::wait_timeout(&shared.changed, data, timeout - waited).0;
    }
}
