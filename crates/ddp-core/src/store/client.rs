//! The TCP store client every rank holds (like PyTorch's `TCPStore` in client mode).
//!
//! Thread safety: the client keeps a small pool of authenticated connections. Each call takes an idle connection
//! (or opens a new one when every connection is busy), sends one request, reads one answer and puts the
//! connection back. So a thread parked in a blocking `get`/`wait` never starves other threads of the same
//! client; single-threaded use needs exactly one connection.

use super::protocol::{self, ErrorKind, Request, Response};
use super::Store;
use crate::token::{self, RunToken, MAC_LEN, NONCE_LEN};
use crate::{DdpError, Result};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Extra time a client waits for an answer beyond the time the server may legitimately hold the request,
/// so that a vanished server machine (no RST) still ends in an error instead of a hang.
const ANSWER_GRACE: Duration = Duration::from_secs(60);
/// How long to keep retrying when the pool needs an extra connection to a server that is already up.
const EXTRA_CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// Client of a [`super::TcpStoreServer`]. `Send + Sync`; share it with `Arc`.
pub struct TcpStore {
    /// The address as given by the caller (`host:port`), for error messages and reconnects.
    addr: String,
    token: RunToken,
    timeout: Duration,
    /// How long past its own wait a request may take to be answered before the server counts as unreachable.
    answer_grace: Duration,
    local_ip: IpAddr,
    server_addr: SocketAddr,
    idle: Mutex<Vec<TcpStream>>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore").field("addr", &self.addr).field("timeout", &self.timeout).finish()
    }
}

impl TcpStore {
    /// Connects to the server at `addr` (`"host:port"`) and proves knowledge of `token` (challenge-response: the
    /// token itself is never sent, see the [`crate::store`] docs). While the server is not up yet
    /// (connection refused, name not resolvable) it retries with back-off until `timeout` passes. `timeout` is
    /// also the timeout of blocking calls ([`Store::get`]); change it with [`Self::with_timeout`].
    ///
    /// Errors: [`DdpError::Connect`] naming `addr` after `timeout`; [`DdpError::TokenRejected`] at once when the
    /// server and we hold different tokens ("run token mismatch"); [`DdpError::Protocol`] within `timeout` when the
    /// peer is not an accel store (says what it answered) or a store server of another version.
    pub fn connect(addr: &str, token: RunToken, timeout: Duration) -> Result<Self> {
        let stream = open_connection(addr, &token, timeout, true)?;
        let local_ip = stream.local_addr().map_err(|e| DdpError::io(format!("store connection to {addr}"), e))?.ip();
        let server_addr = stream.peer_addr().map_err(|e| DdpError::io(format!("store connection to {addr}"), e))?;
        Ok(TcpStore {
            addr: addr.to_string(),
            token,
            timeout,
            answer_grace: ANSWER_GRACE,
            local_ip,
            server_addr,
            idle: Mutex::new(vec![stream]),
        })
    }

    /// The same client with another timeout for blocking calls.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The same client, failing a request that the server has not answered within `grace` past the request's
    /// own wait (default 60 s): an unreachable server (a cut link) then fails it within `grace`.
    pub fn with_answer_grace(mut self, grace: Duration) -> Self {
        self.answer_grace = grace;
        self
    }

    /// A second, independent client of the same server (its own connections), with the same token and timeout.
    pub fn try_clone_connection(&self) -> Result<TcpStore> {
        TcpStore::connect(&self.addr, self.token, EXTRA_CONNECTION_TIMEOUT)
            .map(|s| s.with_timeout(self.timeout).with_answer_grace(self.answer_grace))
    }

    /// The address this client was asked to connect to (`host:port`).
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The server's resolved socket address.
    pub fn server_addr(&self) -> SocketAddr {
        self.server_addr
    }

    /// This machine's IP address on the route to the store server: the address peers on other machines can
    /// reach us at (loopback for a single-machine job). The CPU backend listens there.
    pub fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    fn take_connection(&self) -> Result<TcpStream> {
        if let Some(s) = crate::sync::lock(&self.idle).pop() {
            return Ok(s);
        }
        // The server was up when we first connected: a refused connection now means it is gone, so fail at
        // once instead of retrying as `connect` does for a server that is still starting.
        open_connection(&self.addr, &self.token, EXTRA_CONNECTION_TIMEOUT, false)
    }

    fn request(&self, req: Request<'_>) -> Result<Response> {
        let frame = req.encode_frame()?;
        let mut conn = self.take_connection()?;
        let answer_timeout = req.server_wait().saturating_add(self.answer_grace);
        let result = (|| -> std::io::Result<Option<Vec<u8>>> {
            conn.set_read_timeout(Some(answer_timeout))?;
            protocol::write_frame(&mut conn, &frame)?;
            protocol::read_frame(&mut conn)
        })();
        let body = match result {
            Ok(Some(body)) => body,
            // The connection is dropped (not returned to the pool) on any failure: its state is unknown.
            Ok(None) => {
                return Err(DdpError::io(
                    format!("store {} to {}", req.name(), self.addr),
                    std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the store server closed the connection"),
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => return Err(DdpError::Protocol(e.to_string())),
            Err(e) => return Err(DdpError::io(format!("store {} to {}", req.name(), self.addr), e)),
        };
        let resp = Response::decode(&body)?;
        if let Response::Error { kind: ErrorKind::Protocol | ErrorKind::ShuttingDown, .. } = resp {
            // The server closes the connection after these.
        } else {
            crate::sync::lock(&self.idle).push(conn);
        }
        match resp {
            Response::Error { kind: ErrorKind::InvalidArgument, message } => Err(DdpError::InvalidArgument(message)),
            Response::Error { kind: ErrorKind::Protocol, message } => {
                Err(DdpError::Protocol(format!("store server {} refused {}: {message}", self.addr, req.name())))
            }
            Response::Error { kind: ErrorKind::ShuttingDown, message } => Err(DdpError::io(
                format!("store {} to {}", req.name(), self.addr),
                std::io::Error::new(std::io::ErrorKind::ConnectionAborted, message),
            )),
            Response::Timeout { waited, missing } => Err(DdpError::StoreTimeout { keys: missing, waited }),
            other => Ok(other),
        }
    }

    fn unexpected(&self, op: &str, resp: Response) -> DdpError {
        DdpError::Protocol(format!("store server {} answered {op} with {resp:?}", self.addr))
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        match self.request(Request::Set { key, value })? {
            Response::Ok => Ok(()),
            r => Err(self.unexpected("set", r)),
        }
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        match self.request(Request::Get { key, timeout: self.timeout })? {
            Response::Value(v) => Ok(v),
            r => Err(self.unexpected("get", r)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        match self.request(Request::Add { key, delta })? {
            Response::Int(v) => Ok(v),
            r => Err(self.unexpected("add", r)),
        }
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        match self.request(Request::CompareSet { key, expected, desired })? {
            Response::Value(v) => Ok(v),
            r => Err(self.unexpected("compare_set", r)),
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        match self.request(Request::Wait { keys: keys.to_vec(), timeout })? {
            Response::Ok => Ok(()),
            r => Err(self.unexpected("wait", r)),
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        match self.request(Request::Check { keys: keys.to_vec() })? {
            Response::Bool(b) => Ok(b),
            r => Err(self.unexpected("check", r)),
        }
    }

    fn delete_key(&self, key: &str) -> Result<bool> {
        match self.request(Request::Delete { key })? {
            Response::Bool(b) => Ok(b),
            r => Err(self.unexpected("delete_key", r)),
        }
    }

    fn num_keys(&self) -> Result<usize> {
        match self.request(Request::NumKeys)? {
            Response::Int(n) if n >= 0 => Ok(n as usize),
            r => Err(self.unexpected("num_keys", r)),
        }
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// Connects and authenticates one connection, retrying while the server is not reachable yet (a refused
/// connection is retried only when `retry_refused`).
fn open_connection(addr: &str, token: &RunToken, timeout: Duration, retry_refused: bool) -> Result<TcpStream> {
    let start = Instant::now();
    let mut backoff = Duration::from_millis(10);
    loop {
        let last_error = match try_connect_once(addr, start + timeout) {
            Ok(mut stream) => return handshake(&mut stream, addr, token, start + timeout).map(|()| stream),
            Err(e) => e,
        };
        let (last_error, refused) = last_error;
        let waited = start.elapsed();
        if waited >= timeout || (refused && !retry_refused) {
            return Err(DdpError::Connect { addr: addr.to_string(), waited, reason: last_error });
        }
        std::thread::sleep(backoff.min(timeout - waited));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// One round of connection attempts to every address `addr` resolves to.
/// Errors carry whether the last attempt was refused (nothing listening).
fn try_connect_once(addr: &str, deadline: Instant) -> std::result::Result<TcpStream, (String, bool)> {
    let addrs: Vec<SocketAddr> =
        addr.to_socket_addrs().map_err(|e| (format!("cannot resolve {addr}: {e}"), false))?.collect();
    let mut last = (format!("{addr} resolved to no address"), false);
    for sa in addrs {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(100), Duration::from_secs(10));
        match TcpStream::connect_timeout(&sa, left) {
            Ok(s) => return Ok(s),
            Err(e) => last = (format!("{sa}: {e}"), e.kind() == std::io::ErrorKind::ConnectionRefused),
        }
    }
    Err(last)
}

/// Client side of the challenge-response handshake (see `protocol.rs`). A peer that does not answer like a
/// store server before `deadline` (the end of the connect timeout) is reported as not being an accel store.
fn handshake(stream: &mut TcpStream, addr: &str, token: &RunToken, deadline: Instant) -> Result<()> {
    let io_err = |e: std::io::Error| DdpError::io(format!("store handshake with {addr}"), e);
    stream.set_nodelay(true).map_err(io_err)?;
    let left = deadline.saturating_duration_since(Instant::now()).max(MIN_HANDSHAKE_WAIT);
    stream.set_read_timeout(Some(left)).map_err(io_err)?;
    let client_nonce = token::nonce()?;
    stream.write_all(&protocol::encode_hello(&client_nonce)).map_err(io_err)?;

    let mut head = Vec::with_capacity(protocol::ANSWER_HEAD_LEN);
    let silence = read_up_to(stream, &mut head, protocol::ANSWER_HEAD_LEN);
    if head.len() == 1 && head[0] == protocol::HELLO_BAD_VERSION {
        // A version-1 server answers a version mismatch with this one byte.
        return Err(version_mismatch(addr));
    }
    if head.len() < protocol::ANSWER_HEAD_LEN || head[..4] != protocol::SERVER_MAGIC {
        if head.len() == protocol::ANSWER_HEAD_LEN {
            // Quote a little more of what the peer says (e.g. an HTTP status line).
            let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
            let _ = read_up_to(stream, &mut head, QUOTE_BYTES + 1);
        }
        return Err(not_a_store(addr, &head, silence, left));
    }
    // From here on the peer is a store server: its answers come at once.
    stream.set_read_timeout(Some(left.max(ANSWER_GRACE))).map_err(io_err)?;
    match head[4] {
        protocol::HELLO_CHALLENGE => {}
        protocol::HELLO_BAD_VERSION => return Err(version_mismatch(addr)),
        other => {
            return Err(DdpError::Protocol(format!(
                "store server {addr} answered the handshake with status {other}; run the same accel-rs build on \
                 every machine"
            )))
        }
    }
    let mut challenge = [0u8; NONCE_LEN + MAC_LEN];
    stream.read_exact(&mut challenge).map_err(io_err)?;
    let (server_nonce, server_proof) = challenge.split_at(NONCE_LEN);
    let server_knows_token = token.verify(protocol::SERVER_LABEL, server_nonce, &client_nonce, server_proof);
    // Our proof goes out even when the server's was wrong, so that the server reports the mismatch at once too.
    stream.write_all(&token.prove(protocol::CLIENT_LABEL, server_nonce, &client_nonce)).map_err(io_err)?;
    if !server_knows_token {
        return Err(DdpError::TokenRejected { peer: addr.to_string() });
    }
    let mut answer = [0u8; 1];
    match stream.read(&mut answer) {
        Ok(1) if answer[0] == protocol::HELLO_OK => Ok(()),
        // The server closes after refusing our proof.
        Ok(_) => Err(DdpError::TokenRejected { peer: addr.to_string() }),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted) => {
            Err(DdpError::TokenRejected { peer: addr.to_string() })
        }
        Err(e) => Err(io_err(e)),
    }
}

/// Shortest time a peer gets to answer the hello, even when the connect timeout is nearly spent.
const MIN_HANDSHAKE_WAIT: Duration = Duration::from_millis(200);
/// How much of a foreign peer's answer an error message quotes, in bytes.
const QUOTE_BYTES: usize = 64;

/// Reads until `buf` holds `want` bytes, the peer closes, or the read timeout passes. Returns whether the peer
/// stayed silent until the timeout (as opposed to closing or answering enough).
fn read_up_to(stream: &mut TcpStream, buf: &mut Vec<u8>, want: usize) -> bool {
    let mut chunk = [0u8; QUOTE_BYTES];
    while buf.len() < want {
        let n = (want - buf.len()).min(chunk.len());
        match stream.read(&mut chunk[..n]) {
            Ok(0) => return false,
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
        }
    }
    false
}

fn not_a_store(addr: &str, answered: &[u8], silent: bool, waited: Duration) -> DdpError {
    let what = if !answered.is_empty() {
        let quoted = answered[..answered.len().min(QUOTE_BYTES)].escape_ascii().to_string();
        format!("it answered \"{quoted}\"{}", if answered.len() > QUOTE_BYTES { "..." } else { "" })
    } else if silent {
        format!("it answered nothing within {:.1} s", waited.as_secs_f64())
    } else {
        "it closed the connection without answering".to_string()
    };
    DdpError::Protocol(format!(
        "the peer at {addr} is not an accel store: {what}; check that MASTER_ADDR/MASTER_PORT name this job's \
         store (rank 0 or the launcher) and that no other job or service listens on that port"
    ))
}

fn version_mismatch(addr: &str) -> DdpError {
    DdpError::Protocol(format!(
        "store server {addr} speaks another protocol version than ours ({}); run the same accel-rs build on every \
         machine",
        protocol::VERSION
    ))
}
