//! Wire protocol of the TCP store: a challenge-response handshake, then length-prefixed binary request/response
//! frames.
//!
//! Handshake (protocol version 2). The run token never goes on the wire: each side proves it knows the token with
//! an HMAC-SHA256 (RFC 2104, see [`RunToken::prove`]) over both sides' fresh 16-byte nonces and its role label,
//! a mutual challenge-response. A passive listener or a fake server learns only MACs over nonces never used
//! again; a recorded client handshake replayed later fails (the server's nonce is new); a server proof reflected
//! back to the server fails (the labels differ).
//!
//! 1. Client → server, [`HELLO_LEN`] = 24 bytes: [`MAGIC`] `b"ACST"`, [`VERSION`] (u16 LE), reserved u16 (0),
//!    the client nonce `cn`.
//! 2. Server → client: [`SERVER_MAGIC`] `b"ACSS"`, one status byte. [`HELLO_BAD_VERSION`]: the server then
//!    closes. [`HELLO_CHALLENGE`]: followed by the server nonce `sn` (16 bytes) and the server proof
//!    `HMAC(token, SERVER_LABEL, sn, cn)` (32 bytes). A peer whose first bytes are not [`MAGIC`] is closed
//!    without an answer.
//! 3. Client → server: the client proof `HMAC(token, CLIENT_LABEL, sn, cn)` (32 bytes). The client sends it even
//!    when the server's proof was wrong, so that both sides report the mismatch at once.
//! 4. Server → client: one byte, [`HELLO_OK`] or [`HELLO_BAD_TOKEN`] (then the server closes).
//!
//! The client fails with [`DdpError::TokenRejected`] ("run token mismatch") when either proof is wrong, and with
//! [`DdpError::Protocol`] ("... is not an accel store") when the peer's first bytes are not [`SERVER_MAGIC`] or it
//! answers nothing within the connect timeout (e.g. an HTTP server on MASTER_PORT). The handshake authenticates;
//! it does not encrypt the frames that follow (keys and values travel in the clear).
//!
//! Frames (both directions): `u32 LE body length` then the body; the body starts with an opcode (requests) or a
//! response tag. Inside a body: integers are little-endian, byte strings are `u32 LE length + bytes`, keys are
//! UTF-8 of at most [`MAX_KEY_BYTES`], values at most [`MAX_VALUE_BYTES`], a whole body at most
//! [`MAX_FRAME_BYTES`]. Both sides check every limit before allocating and answer a violation with
//! [`DdpError::Protocol`] (the server then closes that connection).
//!
//! The layout is our own (PyTorch's `TCPStore` protocol is similar in spirit: one opcode byte, length-prefixed
//! fields, a server that parks blocking `get`/`wait` until the key is set).

use super::{MAX_KEY_BYTES, MAX_VALUE_BYTES};
use crate::token::{RunToken, MAC_LEN, NONCE_LEN};
use crate::{DdpError, Result};
use std::io::{Read, Write};
use std::time::Duration;

/// First bytes of every client connection.
pub(crate) const MAGIC: [u8; 4] = *b"ACST";
/// First bytes of every server answer to a hello.
pub(crate) const SERVER_MAGIC: [u8; 4] = *b"ACSS";
/// Protocol version; bumped on any incompatible change (2: challenge-response instead of the token in the clear).
pub(crate) const VERSION: u16 = 2;
/// Length of the client hello: magic, version, reserved, client nonce.
pub(crate) const HELLO_LEN: usize = 8 + NONCE_LEN;
/// Length of the server's answer head: magic and status byte.
pub(crate) const ANSWER_HEAD_LEN: usize = 5;
/// Role label of the server's proof.
pub(crate) const SERVER_LABEL: &[u8] = b"accel-store v2 server";
/// Role label of the client's proof.
pub(crate) const CLIENT_LABEL: &[u8] = b"accel-store v2 client";
/// Server's final answer: the client's proof is right.
pub(crate) const HELLO_OK: u8 = 0;
/// Server's final answer: the client's proof is wrong, a run token mismatch (the connection is then closed).
pub(crate) const HELLO_BAD_TOKEN: u8 = 1;
/// Server's status: unsupported protocol version (the connection is then closed).
pub(crate) const HELLO_BAD_VERSION: u8 = 2;
/// Server's status: a challenge (server nonce and server proof) follows.
pub(crate) const HELLO_CHALLENGE: u8 = 3;

/// Largest frame body: a compare_set carrying two maximal values plus a maximal key and headers.
pub(crate) const MAX_FRAME_BYTES: usize = 2 * MAX_VALUE_BYTES + MAX_KEY_BYTES + 64;
/// Most keys in one `wait`/`check`.
pub(crate) const MAX_KEYS_PER_CALL: usize = 1 << 16;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_COMPARE_SET: u8 = 4;
const OP_WAIT: u8 = 5;
const OP_CHECK: u8 = 6;
const OP_DELETE: u8 = 7;
const OP_NUM_KEYS: u8 = 8;

const R_OK: u8 = 0;
const R_VALUE: u8 = 1;
const R_INT: u8 = 2;
const R_BOOL: u8 = 3;
const R_TIMEOUT: u8 = 4;
const R_ERROR: u8 = 5;

/// The client's hello: magic, version, reserved, client nonce.
pub(crate) fn encode_hello(client_nonce: &[u8; NONCE_LEN]) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&VERSION.to_le_bytes());
    h[8..].copy_from_slice(client_nonce);
    h
}

/// The server's challenge: magic, [`HELLO_CHALLENGE`], server nonce, server proof.
pub(crate) fn encode_challenge(
    token: &RunToken,
    server_nonce: &[u8; NONCE_LEN],
    client_nonce: &[u8],
) -> [u8; ANSWER_HEAD_LEN + NONCE_LEN + MAC_LEN] {
    let mut c = [0u8; ANSWER_HEAD_LEN + NONCE_LEN + MAC_LEN];
    c[..4].copy_from_slice(&SERVER_MAGIC);
    c[4] = HELLO_CHALLENGE;
    c[ANSWER_HEAD_LEN..ANSWER_HEAD_LEN + NONCE_LEN].copy_from_slice(server_nonce);
    c[ANSWER_HEAD_LEN + NONCE_LEN..].copy_from_slice(&token.prove(SERVER_LABEL, server_nonce, client_nonce));
    c
}

/// A request, borrowing its keys and values (from the caller, or from the received frame on the server).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request<'a> {
    Set {
        key: &'a str,
        value: &'a [u8],
    },
    /// Blocks on the server until `key` exists or `timeout` passes.
    Get {
        key: &'a str,
        timeout: Duration,
    },
    Add {
        key: &'a str,
        delta: i64,
    },
    CompareSet {
        key: &'a str,
        expected: &'a [u8],
        desired: &'a [u8],
    },
    /// Blocks on the server until every key exists or `timeout` passes.
    Wait {
        keys: Vec<&'a str>,
        timeout: Duration,
    },
    Check {
        keys: Vec<&'a str>,
    },
    Delete {
        key: &'a str,
    },
    NumKeys,
}

impl Request<'_> {
    /// Short name for error messages.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Request::Set { .. } => "set",
            Request::Get { .. } => "get",
            Request::Add { .. } => "add",
            Request::CompareSet { .. } => "compare_set",
            Request::Wait { .. } => "wait",
            Request::Check { .. } => "check",
            Request::Delete { .. } => "delete_key",
            Request::NumKeys => "num_keys",
        }
    }

    /// How long the server may legitimately hold this request before answering.
    pub(crate) fn server_wait(&self) -> Duration {
        match self {
            Request::Get { timeout, .. } | Request::Wait { timeout, .. } => *timeout,
            _ => Duration::ZERO,
        }
    }

    /// Encodes the request as a complete frame (length prefix included), checking the size limits.
    pub(crate) fn encode_frame(&self) -> Result<Vec<u8>> {
        let mut w = FrameWriter::new();
        match self {
            Request::Set { key, value } => {
                w.u8(OP_SET);
                w.key(key)?;
                w.value(value)?;
            }
            Request::Get { key, timeout } => {
                w.u8(OP_GET);
                w.key(key)?;
                w.u64(millis(*timeout));
            }
            Request::Add { key, delta } => {
                w.u8(OP_ADD);
                w.key(key)?;
                w.u64(*delta as u64);
            }
            Request::CompareSet { key, expected, desired } => {
                w.u8(OP_COMPARE_SET);
                w.key(key)?;
                w.value(expected)?;
                w.value(desired)?;
            }
            Request::Wait { keys, timeout } => {
                w.u8(OP_WAIT);
                w.keys(keys)?;
                w.u64(millis(*timeout));
            }
            Request::Check { keys } => {
                w.u8(OP_CHECK);
                w.keys(keys)?;
            }
            Request::Delete { key } => {
                w.u8(OP_DELETE);
                w.key(key)?;
            }
            Request::NumKeys => w.u8(OP_NUM_KEYS),
        }
        w.finish()
    }

    /// Decodes a frame body (without its length prefix).
    pub(crate) fn decode(body: &[u8]) -> Result<Request<'_>> {
        let mut r = FrameReader { buf: body, pos: 0 };
        let req = match r.u8()? {
            OP_SET => Request::Set { key: r.key()?, value: r.value()? },
            OP_GET => Request::Get { key: r.key()?, timeout: Duration::from_millis(r.u64()?) },
            OP_ADD => Request::Add { key: r.key()?, delta: r.u64()? as i64 },
            OP_COMPARE_SET => Request::CompareSet { key: r.key()?, expected: r.value()?, desired: r.value()? },
            OP_WAIT => Request::Wait { keys: r.keys()?, timeout: Duration::from_millis(r.u64()?) },
            OP_CHECK => Request::Check { keys: r.keys()? },
            OP_DELETE => Request::Delete { key: r.key()? },
            OP_NUM_KEYS => Request::NumKeys,
            op => return Err(DdpError::Protocol(format!("unknown store opcode {op}"))),
        };
        r.end()?;
        Ok(req)
    }
}

/// Kinds of error a server reports back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorKind {
    /// The request was well-formed but cannot be served (e.g. `add` on a non-counter): InvalidArgument.
    InvalidArgument = 0,
    /// The request broke the protocol: Protocol.
    Protocol = 1,
    /// The server is shutting down.
    ShuttingDown = 2,
}

/// A server's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Response {
    Ok,
    Value(Vec<u8>),
    Int(i64),
    Bool(bool),
    /// A blocking `get`/`wait` ran out of time; `missing` are the keys still absent.
    Timeout {
        waited: Duration,
        missing: Vec<String>,
    },
    Error {
        kind: ErrorKind,
        message: String,
    },
}

impl Response {
    /// Encodes the response as a complete frame (length prefix included).
    pub(crate) fn encode_frame(&self) -> Result<Vec<u8>> {
        let mut w = FrameWriter::new();
        match self {
            Response::Ok => w.u8(R_OK),
            Response::Value(v) => {
                w.u8(R_VALUE);
                w.value(v)?;
            }
            Response::Int(i) => {
                w.u8(R_INT);
                w.u64(*i as u64);
            }
            Response::Bool(b) => {
                w.u8(R_BOOL);
                w.u8(*b as u8);
            }
            Response::Timeout { waited, missing } => {
                w.u8(R_TIMEOUT);
                w.u64(millis(*waited));
                let refs: Vec<&str> = missing.iter().map(String::as_str).collect();
                w.keys(&refs)?;
            }
            Response::Error { kind, message } => {
                w.u8(R_ERROR);
                w.u8(*kind as u8);
                let msg = truncate_utf8(message, MAX_KEY_BYTES);
                w.bytes(msg.as_bytes());
            }
        }
        w.finish()
    }

    /// Decodes a frame body (without its length prefix).
    pub(crate) fn decode(body: &[u8]) -> Result<Response> {
        let mut r = FrameReader { buf: body, pos: 0 };
        let resp = match r.u8()? {
            R_OK => Response::Ok,
            R_VALUE => Response::Value(r.value()?.to_vec()),
            R_INT => Response::Int(r.u64()? as i64),
            R_BOOL => Response::Bool(r.u8()? != 0),
            R_TIMEOUT => {
                let waited = Duration::from_millis(r.u64()?);
                let missing = r.keys()?.into_iter().map(str::to_string).collect();
                Response::Timeout { waited, missing }
            }
            R_ERROR => {
                let kind = match r.u8()? {
                    0 => ErrorKind::InvalidArgument,
                    2 => ErrorKind::ShuttingDown,
                    _ => ErrorKind::Protocol,
                };
                let message = String::from_utf8_lossy(r.bytes(MAX_KEY_BYTES, "error message")?).into_owned();
                Response::Error { kind, message }
            }
            tag => return Err(DdpError::Protocol(format!("unknown store response tag {tag}"))),
        };
        r.end()?;
        Ok(resp)
    }
}

/// Reads one frame body. `Ok(None)` on a clean end of stream before the first byte of a frame.
pub(crate) fn read_frame(stream: &mut impl Read) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match stream.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME_BYTES {
        // Checked before allocating, so a hostile length cannot make us reserve gigabytes.
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("store frame of {len} bytes is outside 1..={MAX_FRAME_BYTES}"),
        ));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    Ok(Some(body))
}

/// Writes a complete frame (as built by `encode_frame`) in one call, so that with TCP_NODELAY it leaves as one
/// segment when small.
pub(crate) fn write_frame(stream: &mut impl Write, frame: &[u8]) -> std::io::Result<()> {
    stream.write_all(frame)?;
    stream.flush()
}

fn millis(d: Duration) -> u64 {
    d.as_millis().min(u64::MAX as u128) as u64
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Checks a key against the protocol's limit (used by clients before sending).
pub(crate) fn check_key(key: &str) -> Result<()> {
    if key.len() > MAX_KEY_BYTES {
        return Err(DdpError::Protocol(format!(
            "store key of {} bytes exceeds MAX_KEY_BYTES ({MAX_KEY_BYTES}); use shorter keys",
            key.len()
        )));
    }
    Ok(())
}

/// Checks a value against the protocol's limit (used by clients before sending).
pub(crate) fn check_value(value: &[u8]) -> Result<()> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(DdpError::Protocol(format!(
            "store value of {} bytes exceeds MAX_VALUE_BYTES ({MAX_VALUE_BYTES}); the store is for small \
             rendezvous data, send tensors through a process group instead",
            value.len()
        )));
    }
    Ok(())
}

struct FrameWriter {
    buf: Vec<u8>,
}

impl FrameWriter {
    fn new() -> Self {
        // Room for the length prefix, filled in by `finish`.
        FrameWriter { buf: vec![0u8; 4] }
    }
    fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(&(b.len() as u32).to_le_bytes());
        self.buf.extend_from_slice(b);
    }
    fn key(&mut self, k: &str) -> Result<()> {
        check_key(k)?;
        self.bytes(k.as_bytes());
        Ok(())
    }
    fn value(&mut self, v: &[u8]) -> Result<()> {
        check_value(v)?;
        self.bytes(v);
        Ok(())
    }
    fn keys(&mut self, keys: &[&str]) -> Result<()> {
        if keys.len() > MAX_KEYS_PER_CALL {
            return Err(DdpError::Protocol(format!(
                "{} keys in one store call exceed the limit of {MAX_KEYS_PER_CALL}",
                keys.len()
            )));
        }
        self.buf.extend_from_slice(&(keys.len() as u32).to_le_bytes());
        for k in keys {
            self.key(k)?;
        }
        Ok(())
    }
    fn finish(mut self) -> Result<Vec<u8>> {
        let body = self.buf.len() - 4;
        if body > MAX_FRAME_BYTES {
            return Err(DdpError::Protocol(format!(
                "store message of {body} bytes exceeds the frame limit of {MAX_FRAME_BYTES} bytes"
            )));
        }
        self.buf[..4].copy_from_slice(&(body as u32).to_le_bytes());
        Ok(self.buf)
    }
}

struct FrameReader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> FrameReader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if self.buf.len() - self.pos < n {
            return Err(DdpError::Protocol(format!(
                "truncated store frame: {what} needs {n} bytes, {} left",
                self.buf.len() - self.pos
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1, "a byte")?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, "a u32")?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, "a u64")?.try_into().expect("8 bytes")))
    }
    fn bytes(&mut self, max: usize, what: &str) -> Result<&'a [u8]> {
        let len = self.u32()? as usize;
        if len > max {
            return Err(DdpError::Protocol(format!("store {what} of {len} bytes exceeds the limit of {max} bytes")));
        }
        self.take(len, what)
    }
    fn key(&mut self) -> Result<&'a str> {
        let b = self.bytes(MAX_KEY_BYTES, "key")?;
        std::str::from_utf8(b).map_err(|_| DdpError::Protocol("store key is not valid UTF-8".into()))
    }
    fn value(&mut self) -> Result<&'a [u8]> {
        self.bytes(MAX_VALUE_BYTES, "value")
    }
    fn keys(&mut self) -> Result<Vec<&'a str>> {
        let n = self.u32()? as usize;
        if n > MAX_KEYS_PER_CALL {
            return Err(DdpError::Protocol(format!(
                "{n} keys in one store call exceed the limit of {MAX_KEYS_PER_CALL}"
            )));
        }
        (0..n).map(|_| self.key()).collect()
    }
    fn end(&self) -> Result<()> {
        if self.pos != self.buf.len() {
            return Err(DdpError::Protocol(format!(
                "{} trailing bytes after a store message",
                self.buf.len() - self.pos
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(frame: &[u8]) -> &[u8] {
        let len = u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(len, frame.len() - 4);
        &frame[4..]
    }

    #[test]
    fn requests_round_trip() {
        let reqs = [
            Request::Set { key: "a", value: b"xyz" },
            Request::Get { key: "k/é", timeout: Duration::from_millis(1500) },
            Request::Add { key: "c", delta: -7 },
            Request::CompareSet { key: "c", expected: b"", desired: b"1" },
            Request::Wait { keys: vec!["a", "b"], timeout: Duration::from_secs(3) },
            Request::Check { keys: vec![] },
            Request::Delete { key: "a" },
            Request::NumKeys,
        ];
        for req in reqs {
            let frame = req.encode_frame().unwrap();
            assert_eq!(Request::decode(body(&frame)).unwrap(), req);
        }
    }

    #[test]
    fn responses_round_trip() {
        let resps = [
            Response::Ok,
            Response::Value(vec![1, 2, 3]),
            Response::Int(-42),
            Response::Bool(true),
            Response::Timeout { waited: Duration::from_millis(250), missing: vec!["x".into()] },
            Response::Error { kind: ErrorKind::InvalidArgument, message: "nope".into() },
        ];
        for resp in resps {
            let frame = resp.encode_frame().unwrap();
            assert_eq!(Response::decode(body(&frame)).unwrap(), resp);
        }
    }

    #[test]
    fn limits_are_enforced_on_encode_and_decode() {
        let long_key = "k".repeat(MAX_KEY_BYTES + 1);
        let err = Request::Delete { key: &long_key }.encode_frame().unwrap_err().to_string();
        assert!(err.contains("MAX_KEY_BYTES"), "{err}");

        // A hand-made frame claiming a key longer than the limit is refused by the decoder.
        let mut b = vec![OP_DELETE];
        b.extend_from_slice(&((MAX_KEY_BYTES + 1) as u32).to_le_bytes());
        b.extend(std::iter::repeat_n(b'k', MAX_KEY_BYTES + 1));
        let err = Request::decode(&b).unwrap_err().to_string();
        assert!(err.contains("key") && err.contains("exceeds"), "{err}");

        // A value length beyond MAX_VALUE_BYTES is refused before reading the (absent) bytes.
        let mut b = vec![OP_SET];
        b.extend_from_slice(&1u32.to_le_bytes());
        b.push(b'k');
        b.extend_from_slice(&((MAX_VALUE_BYTES + 1) as u32).to_le_bytes());
        let err = Request::decode(&b).unwrap_err().to_string();
        assert!(err.contains("value") && err.contains("exceeds"), "{err}");

        // Oversized frame length is refused before allocating.
        let mut stream: &[u8] = &((MAX_FRAME_BYTES + 1) as u32).to_le_bytes();
        assert_eq!(read_frame(&mut stream).unwrap_err().kind(), std::io::ErrorKind::InvalidData);

        // Truncated and trailing data.
        assert!(Request::decode(&[OP_ADD, 1, 0]).is_err());
        let mut f = Request::NumKeys.encode_frame().unwrap();
        f.push(0);
        assert!(Request::decode(&f[4..]).unwrap_err().to_string().contains("trailing"));
        assert!(Request::decode(&[200]).unwrap_err().to_string().contains("opcode"));
    }
}
