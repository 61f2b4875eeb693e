//! Rendezvous key-value store (like PyTorch's `TCPStore`): how ranks find each other and agree on small facts.
//!
//! - [`TcpStoreServer`] serves keys over TCP; one per job, hosted by the launcher or by rank 0.
//! - [`TcpStore`] is the client every rank holds.
//! - [`PrefixStore`] namespaces keys for sub-groups.
//!
//! Wire protocol: see `protocol.rs` (length-prefixed binary frames with size limits). No request is served before
//! a mutual challenge-response handshake on connect: client and server each send a fresh 16-byte nonce and prove
//! they know the run token with HMAC-SHA256 (RFC 2104) over both nonces and a role label (`"accel-store v2
//! client"` / `"... server"`). The token itself never goes on the wire, so a passive listener, or whatever
//! listens on a mistyped MASTER_ADDR:MASTER_PORT, does not learn it; a recorded handshake cannot be replayed (the
//! other side's nonce is new each time) nor reflected (the labels differ). A wrong token fails both sides at once
//! ([`crate::DdpError::TokenRejected`], "run token mismatch"); a peer that is not a store (an HTTP server, a
//! silent port) fails the client within its connect timeout with [`crate::DdpError::Protocol`] ("... is not an
//! accel store", quoting what it answered). The handshake authenticates, it does not encrypt: keys and values
//! travel in the clear, so keep the store on a trusted network.

mod client;
mod memory;
mod prefix;
mod protocol;
mod server;

pub use client::TcpStore;
pub use memory::MemoryStore;
pub use prefix::PrefixStore;
pub use server::{RefusedPeer, TcpStoreServer, REFUSED_PEER_KEY};

use crate::Result;
use std::time::Duration;

/// Default timeout of blocking store calls (`get`, `wait`): 300 s, as in PyTorch.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(300);

/// Largest key accepted, in bytes.
pub const MAX_KEY_BYTES: usize = 4096;
/// Largest value accepted, in bytes (64 MiB).
pub const MAX_VALUE_BYTES: usize = 64 << 20;

/// The key-value operations ranks use to rendezvous. Implementations are thread-safe.
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, waking every waiter on `key`.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Returns the value of `key`, blocking until it exists or [`Store::timeout`] passes
    /// ([`crate::DdpError::StoreTimeout`] naming the key).
    fn get(&self, key: &str) -> Result<Vec<u8>>;
    /// Adds `delta` to the counter at `key` (ASCII decimal; a missing key counts as 0) and returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// Sets `key` to `desired` if its current value is `expected` (a missing key matches an empty `expected`).
    /// Returns the value after the call.
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>>;
    /// Blocks until every key exists, or fails after `timeout` naming the missing keys.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;
    /// Whether every key exists now (never blocks).
    fn check(&self, keys: &[&str]) -> Result<bool>;
    /// Deletes `key`; returns whether it existed.
    fn delete_key(&self, key: &str) -> Result<bool>;
    /// Number of keys stored (in this view for a [`PrefixStore`]: the whole store's count, as PyTorch does).
    fn num_keys(&self) -> Result<usize>;
    /// The timeout of blocking calls.
    fn timeout(&self) -> Duration;
}
