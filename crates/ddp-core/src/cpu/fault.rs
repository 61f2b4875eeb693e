//! Fault handling: turning one rank's failure into a prompt, well-named error on every surviving rank.
//!
//! When a collective fails on a rank (a peer's connection closed or broke, a mismatching frame, a timeout), that
//! rank aborts the group:
//! 1. it records *why* under the group's store key `abort` with compare-and-set, so the first record — the root
//!    cause, e.g. "rank 2 disconnected" — wins and every rank reports the same blamed rank;
//! 2. it writes an abort frame naming the blamed rank to every peer whose stream is at a frame boundary (so the
//!    information travels even when the store died with the failed rank);
//! 3. it shuts down the write side of all its connections.
//!
//! Step 3 makes every rank that waits on this one see its connection close at once; that rank looks up the store
//! record (or reads the abort frame), blames the same root-cause rank, and aborts in turn — so the failure spreads
//! through the mesh in milliseconds. A rank blocked on a peer that is alive but itself stuck wakes every tick
//! ([`super::transport::TICK`]) and checks the store record; the collective timeout (default 30 min) is the last
//! resort for a peer that simply never calls the collective.
//!
//! After an abort the group is unusable (as with NCCL's `ncclCommAbort` or a failed Gloo context): every later
//! call fails at once with the original cause.

use super::frame::{CallId, FrameKind, Header, MAX_ABORT_PAYLOAD};
use super::transport::{write_frame, Failure};
use crate::store::Store;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;

/// Why a group was aborted; what the store's `abort` key holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AbortRecord {
    /// The rank held responsible (dead, mismatching or timed out), when known.
    pub blamed: Option<usize>,
    /// The rank that detected it.
    pub by: usize,
    /// Collective and sequence number during which it was detected, e.g. "all_reduce (sequence number 17, …)".
    pub during: String,
    /// What happened.
    pub reason: String,
}

impl AbortRecord {
    fn encode(&self) -> Vec<u8> {
        let blamed = self.blamed.map_or("-".to_string(), |b| b.to_string());
        format!("{blamed}\n{}\n{}\n{}", self.by, self.during, self.reason).into_bytes()
    }

    fn decode(raw: &[u8]) -> Option<AbortRecord> {
        let text = String::from_utf8_lossy(raw);
        let mut parts = text.splitn(4, '\n');
        let blamed = parts.next()?;
        let by = parts.next()?.parse().ok()?;
        let during = parts.next()?.to_string();
        let reason = parts.next()?.to_string();
        Some(AbortRecord { blamed: blamed.parse().ok(), by, during, reason })
    }

    /// The sentence users read in the error.
    pub(crate) fn describe(&self, this_rank: usize) -> String {
        if self.by == this_rank {
            format!("{} (detected during {})", self.reason, self.during)
        } else {
            format!("rank {} aborted the group during {}: {}", self.by, self.during, self.reason)
        }
    }
}

/// The record for a failure seen on this rank. `lookup` returns the group's record if one exists: when a peer's
/// connection closes because *that* peer aborted, the record already names the real culprit.
pub(crate) fn record_for(
    failure: &Failure,
    this_rank: usize,
    call: &CallId,
    lookup: &dyn Fn() -> Option<AbortRecord>,
) -> AbortRecord {
    let during = call.to_string();
    match failure {
        Failure::PeerLost { peer, detail } => lookup().unwrap_or_else(|| AbortRecord {
            blamed: Some(*peer),
            by: this_rank,
            during,
            reason: format!("rank {peer} is gone: {detail}"),
        }),
        Failure::Mismatch { peer, detail } => AbortRecord {
            blamed: Some(*peer),
            by: this_rank,
            during,
            reason: format!("mismatch with rank {peer}: {detail}"),
        },
        Failure::Timeout { peer, waited } => AbortRecord {
            blamed: *peer,
            by: this_rank,
            during,
            reason: format!(
                "timed out after {:.1} s waiting for {} (raise ACCEL_TIMEOUT / InitOptions::timeout if it is only slow)",
                waited.as_secs_f64(),
                peer.map_or("peers".to_string(), |p| format!("rank {p}"))
            ),
        },
        Failure::RemoteAbort { from, blamed, reason } => {
            // The store holds the full record when reachable; the frame carries the same facts otherwise.
            lookup().unwrap_or_else(|| AbortRecord {
                blamed: *blamed,
                by: from.unwrap_or(this_rank),
                during,
                reason: reason.clone(),
            })
        }
    }
}

/// Publishes `rec` unless a record exists; returns the record that won (the first one).
pub(crate) fn publish(store: &dyn Store, key: &str, rec: AbortRecord) -> crate::Result<AbortRecord> {
    let winner = store.compare_set(key, b"", &rec.encode())?;
    Ok(AbortRecord::decode(&winner).unwrap_or(rec))
}

/// The group's abort record, if any.
pub(crate) fn read(store: &dyn Store, key: &str) -> crate::Result<Option<AbortRecord>> {
    if !store.check(&[key])? {
        return Ok(None);
    }
    Ok(AbortRecord::decode(&store.get(key)?))
}

/// Best effort: an abort frame to every peer whose outgoing stream is at a frame boundary, then shut down the
/// write side of every connection so blocked peers wake up.
pub(crate) fn abort_links(peers: &[Option<TcpStream>], tx_mid_frame: &[bool], call: &CallId, rec: &AbortRecord) {
    let mut text = rec.describe(usize::MAX).into_bytes();
    text.truncate(MAX_ABORT_PAYLOAD);
    let header = Header { kind: FrameKind::Abort, call: *call, unit: 0, len: text.len() as u32 };
    let mut call_for_frame = header;
    call_for_frame.call.size = rec.blamed.map_or(u64::MAX, |b| b as u64);
    let encoded = call_for_frame.encode();
    for (p, s) in peers.iter().enumerate() {
        let Some(s) = s else { continue };
        if !tx_mid_frame[p] {
            // One non-blocking attempt: a full socket buffer means the peer is not reading; the shutdown below
            // still wakes it and the store carries the record.
            let _ = write_frame(s.as_raw_fd(), &encoded, &text, 0);
        }
        let _ = s.shutdown(Shutdown::Write);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trip() {
        let r = AbortRecord {
            blamed: Some(2),
            by: 1,
            during: "all_reduce (sequence number 3, 8 bytes)".into(),
            reason: "rank 2 is gone:\nclosed".into(),
        };
        assert_eq!(AbortRecord::decode(&r.encode()).unwrap(), r);
        let none = AbortRecord { blamed: None, ..r.clone() };
        assert_eq!(AbortRecord::decode(&none.encode()).unwrap(), none);
        assert!(r.describe(0).starts_with("rank 1 aborted the group"));
    }
}
