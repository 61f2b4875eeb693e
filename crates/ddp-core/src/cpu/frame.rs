//! Frame headers of the CPU backend's wire protocol.
//!
//! Every piece of data a collective moves between two ranks travels as one frame: a fixed 40-byte header
//! followed by `payload_len` bytes. The header repeats what the sender believes the collective is (op, sequence
//! number, size, dtype, reduction, root) so the receiver can detect ranks that called different collectives
//! ("mismatch") instead of silently reducing garbage. An `Abort` frame tells a peer that the sender gave up on
//! the group and names the rank it blames.
//!
//! Layout (little endian):
//! ```text
//! 0..4   magic  b"ACL1"
//! 4      kind   1 = data, 2 = abort
//! 5      op     collective code (see Op)
//! 6      dtype  DType::code() or 0xff
//! 7      redop  ReduceOp::code() or 0xff
//! 8..16  seq    sequence number of the collective in its group (p2p: per-pair message counter)
//! 16..24 size   the collective's size parameter in bytes (abort: blamed rank, u64::MAX if none)
//! 24..32 param  root rank for broadcast; send/recv: the collectives the sender had issued before it; else 0
//! 32..36 unit   index of this frame in the collective's stream between the two ranks
//! 36..40 len    payload length in bytes
//! ```

use crate::{DType, ReduceOp};

/// Size of an encoded header in bytes.
pub(crate) const HEADER_LEN: usize = 40;
const MAGIC: [u8; 4] = *b"ACL1";
const NONE_CODE: u8 = 0xff;

/// Largest payload of an abort frame (the reason text), bytes.
pub(crate) const MAX_ABORT_PAYLOAD: usize = 4096;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameKind {
    /// Part of a collective's data.
    Data,
    /// The sender aborted the group; `size` names the blamed rank and the payload says why.
    Abort,
}

/// The collective a frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    AllReduce,
    Broadcast,
    AllGather,
    ReduceScatter,
    Send,
    Barrier,
}

impl Op {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::Broadcast => "broadcast",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Send => "send/recv",
            Op::Barrier => "barrier",
        }
    }

    fn code(self) -> u8 {
        match self {
            Op::AllReduce => 1,
            Op::Broadcast => 2,
            Op::AllGather => 3,
            Op::ReduceScatter => 4,
            Op::Send => 5,
            Op::Barrier => 6,
        }
    }

    fn from_code(c: u8) -> Option<Op> {
        Some(match c {
            1 => Op::AllReduce,
            2 => Op::Broadcast,
            3 => Op::AllGather,
            4 => Op::ReduceScatter,
            5 => Op::Send,
            6 => Op::Barrier,
            _ => return None,
        })
    }
}

/// Everything that identifies one collective call; identical on every rank for a well-formed program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CallId {
    pub op: Op,
    pub seq: u64,
    pub size: u64,
    pub dtype: Option<DType>,
    pub redop: Option<ReduceOp>,
    pub param: u64,
}

impl std::fmt::Display for CallId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (sequence number {}, {} bytes", self.op.name(), self.seq, self.size)?;
        if let Some(d) = self.dtype {
            write!(f, ", {d:?}")?;
        }
        if let Some(r) = self.redop {
            write!(f, ", {r:?}")?;
        }
        match self.op {
            Op::Broadcast => write!(f, ", root {}", self.param)?,
            Op::Send => write!(f, ", after {} collectives", self.param)?,
            _ => {}
        }
        f.write_str(")")
    }
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: FrameKind,
    pub call: CallId,
    pub unit: u32,
    pub len: u32,
}

fn dtype_from_code(c: u8) -> Option<DType> {
    [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::U8]
        .into_iter()
        .find(|d| d.code() == c)
}

fn redop_from_code(c: u8) -> Option<ReduceOp> {
    [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product].into_iter().find(|r| r.code() == c)
}

impl Header {
    /// A data frame header.
    pub(crate) fn data(call: CallId, unit: u32, len: usize) -> Header {
        Header { kind: FrameKind::Data, call, unit, len: u32::try_from(len).expect("frame payloads are ≤ 4 GiB") }
    }

    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = match self.kind {
            FrameKind::Data => 1,
            FrameKind::Abort => 2,
        };
        b[5] = self.call.op.code();
        b[6] = self.call.dtype.map_or(NONE_CODE, DType::code);
        b[7] = self.call.redop.map_or(NONE_CODE, ReduceOp::code);
        b[8..16].copy_from_slice(&self.call.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.call.size.to_le_bytes());
        b[24..32].copy_from_slice(&self.call.param.to_le_bytes());
        b[32..36].copy_from_slice(&self.unit.to_le_bytes());
        b[36..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes a header; `Err` describes what is malformed.
    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, String> {
        if b[0..4] != MAGIC {
            return Err(format!(
                "bad frame magic {:02x?} (not an accel-rs CPU backend peer, or a corrupted stream)",
                &b[0..4]
            ));
        }
        let kind = match b[4] {
            1 => FrameKind::Data,
            2 => FrameKind::Abort,
            k => return Err(format!("unknown frame kind {k}")),
        };
        let op = Op::from_code(b[5]).ok_or_else(|| format!("unknown collective code {}", b[5]))?;
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Ok(Header {
            kind,
            call: CallId {
                op,
                seq: u64_at(8),
                size: u64_at(16),
                dtype: dtype_from_code(b[6]),
                redop: redop_from_code(b[7]),
                param: u64_at(24),
            },
            unit: u32_at(32),
            len: u32_at(36),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let call = CallId {
            op: Op::AllReduce,
            seq: 7,
            size: 1 << 33,
            dtype: Some(DType::BF16),
            redop: Some(ReduceOp::Product),
            param: 3,
        };
        let h = Header::data(call, 12, 4096);
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let abort =
            Header { kind: FrameKind::Abort, call: CallId { dtype: None, redop: None, ..call }, unit: 0, len: 9 };
        assert_eq!(Header::decode(&abort.encode()).unwrap(), abort);
        let mut bad = h.encode();
        bad[0] = b'X';
        assert!(Header::decode(&bad).unwrap_err().contains("magic"));
    }
}
